"""Benchmarks of the SSE kernels on one GPU; prints markdown tables (``docs/benchmarks.md`` holds results).

    python -m kernels.bench.bench_sse                     # all tables
    python -m kernels.bench.bench_sse --tables decode     # one of: chunk, partitions, decode

(a) ``chunk``: forward and forward+backward time of SSE (routing + reorder + chunked kernels + gather, varlen
    and masking) next to fla's ``chunk_gla`` on the same heads and dims and PyTorch SDPA (causal), at
    constant tokens per batch (B x T = ``--tokens``);
(b) ``partitions``: SSE varlen for N = 4..64 partitions at K = 1;
(c) ``decode``: one decode step of an SSE layer for a batch of sequences in a state pool, our kernel and
    the PyTorch step, against the memory roofline: state bytes that must move / measured copy bandwidth.

fla autotunes each kernel over many configurations, which costs minutes of compilation per kernel on a
fresh machine; ``--fla-autotune first`` (the default) keeps each kernel's first configuration. It applies to
fla's ``chunk_gla`` and to our SSE path alike (the SSE path runs on fla's chunked kernels).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

H, D = 18, 128


def limit_autotune() -> None:
    import triton

    original = triton.autotune

    def autotune(configs, *args, **kwargs):
        return original(configs[:1], *args, **kwargs)

    triton.autotune = autotune


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (CUDA-event timed, after warm-up)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60)


def sse_inputs(B, T, N, dtype=torch.bfloat16, grad=False):
    from sse_model.ops.sse import Branch

    def make(*shape, fn=None):
        x = torch.randn(*shape, device="cuda")
        x = fn(x) if fn else x
        return x.to(dtype).requires_grad_(grad)

    def side():
        return Branch(make(B, T, H, D), make(B, T, H, D, fn=lambda x: x.softmax(-1)),
                      make(B, T, H, D, fn=lambda x: F.logsigmoid(x) / 16))

    return side(), side(), make(B, T, H, D), make(B, T, N)


def sse_call(inputs, impl, K=1):
    from sse_model.ops.dispatch import route_tokens, sse_attention
    from sse_model.ops.sse import SSEOptions

    shared, sparse, v, logits = inputs
    B, T = v.shape[:2]
    cu = torch.arange(0, (B + 1) * T, T, device="cuda", dtype=torch.int32)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (shared.q, shared.k, shared.g, sparse.q, sparse.k, sparse.g, v)]
    from sse_model.ops.sse import Branch

    def run():
        routing = route_tokens(logits.reshape(1, B * T, -1), K, K)
        o, _ = sse_attention(Branch(*flat[:3]), Branch(*flat[3:6]), flat[6], routing, SSEOptions(),
                             implementation=impl, cu_seqlens=cu)
        return o

    return run


def fwd_bwd(run, leaves):
    def step():
        o = run()
        o.backward(torch.ones_like(o))
        for x in leaves:
            x.grad = None

    return step


def leaves_of(inputs):
    shared, sparse, v, logits = inputs
    return [shared.q, shared.k, shared.g, sparse.q, sparse.k, sparse.g, v, logits]


def table_chunk(tokens: int, lengths: list[int]) -> None:
    from fla.ops.gla import chunk_gla

    print(f"\n### (a) Chunked forward / forward+backward, ms (H={H}, D={D}, bf16, B x T = {tokens}, N=4, K=1)\n")
    print("| T | B | GLA fwd | SSE varlen fwd | SSE mask fwd | SDPA fwd | GLA f+b | SSE varlen f+b | SSE mask f+b "
          "| SDPA f+b | varlen/GLA f+b | mask/GLA f+b | SDPA/varlen f+b |")
    print("|" + "---|" * 13)
    for T in lengths:
        B = max(1, tokens // T)
        row = {}
        for grad in (False, True):
            inputs = sse_inputs(B, T, 4, grad=grad)
            shared, _, v, _ = inputs
            gla = lambda: chunk_gla(shared.q, shared.k, v, shared.g.float())[0]  # noqa: E731
            q = shared.q.transpose(1, 2).detach().requires_grad_(grad)
            sdpa = lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)  # noqa: E731
            cases = {"GLA": (gla, [shared.q, shared.k, v, shared.g]), "SDPA": (sdpa, [q])}
            for impl in ("varlen", "mask"):
                cases[f"SSE {impl}"] = (sse_call(inputs, impl), leaves_of(inputs))
            for name, (fn, leaves) in cases.items():
                try:
                    with torch.no_grad() if not grad else torch.enable_grad():
                        row[(name, grad)] = bench(fwd_bwd(fn, leaves) if grad else fn)
                except torch.OutOfMemoryError:
                    row[(name, grad)] = math.nan
                print(f"  T={T} {name} {'f+b' if grad else 'fwd'}: {row[(name, grad)]:.2f} ms", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
            del inputs, cases
        f = lambda x: f"{x:.2f}"  # noqa: E731
        r = lambda a, b: f"{row[a] / row[b]:.2f}x"  # noqa: E731
        print(f"| {T} | {B} | {f(row[('GLA', False)])} | {f(row[('SSE varlen', False)])} | {f(row[('SSE mask', False)])} "
              f"| {f(row[('SDPA', False)])} | {f(row[('GLA', True)])} | {f(row[('SSE varlen', True)])} "
              f"| {f(row[('SSE mask', True)])} | {f(row[('SDPA', True)])} | {r(('SSE varlen', True), ('GLA', True))} "
              f"| {r(('SSE mask', True), ('GLA', True))} | {r(('SDPA', True), ('SSE varlen', True))} |", flush=True)


def table_partitions(T: int) -> None:
    print(f"\n### (b) SSE varlen vs number of partitions, ms (B=1, T={T}, H={H}, D={D}, K=1, bf16)\n")
    print("| N | fwd | fwd+bwd | f+b vs N=4 |")
    print("|---|---|---|---|")
    base = None
    for N in (4, 8, 16, 32, 64):
        inputs = sse_inputs(1, T, N, grad=True)
        run = sse_call(inputs, "varlen")
        with torch.no_grad():
            fwd = bench(run)
        fb = bench(fwd_bwd(run, leaves_of(inputs)))
        base = base or fb
        print(f"| {N} | {fwd:.2f} | {fb:.2f} | {fb / base:.2f}x |", flush=True)
        del inputs
        torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write) of 1 GiB."""
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


def table_decode(batches: list[int], N: int = 4) -> None:
    from kernels.decode import sse_decode_triton
    from sse_model.ops.sse import Branch, SSEOptions, route, sse_decode_step

    bw = copy_bandwidth()
    print(f"\n### (c) SSE decode step per layer (H={H}, D={D}, N={N}, K=1, fp32 state pool, bf16 inputs)\n")
    print(f"Measured copy bandwidth: {bw / 1e12:.2f} TB/s. Roofline = (read + write of the shared and the selected "
          "partition's states + inputs and output) / bandwidth.\n")
    print("| batch | roofline us | Triton us | Triton / roofline | PyTorch step us | PyTorch / Triton |")
    print("|---|---|---|---|---|---|")
    opts = SSEOptions()
    for B in batches:
        pool = torch.zeros(B, 1 + N, H, D, D, device="cuda")
        slots = torch.arange(B, device="cuda")

        def side():
            return Branch(*(torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)))

        shared, sparse = side(), side()
        shared.g, sparse.g = shared.g.float().sigmoid().log(), sparse.g.float().sigmoid().log()
        v = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        r = route(torch.randn(B, N, device="cuda"), 1, 1)
        state_bytes = 2 * B * 2 * H * D * D * 4
        io_bytes = B * H * D * (7 * 2 + 4) + B * N * 4
        roof = (state_bytes + io_bytes) / bw * 1e6
        tri = bench(lambda: sse_decode_triton(pool, slots, shared, sparse, v, r, opts)) * 1e3
        ref = bench(lambda: sse_decode_step(pool, slots, shared, sparse, v, r, opts)) * 1e3
        print(f"| {B} | {roof:.1f} | {tri:.1f} | {tri / roof:.2f}x | {ref:.1f} | {ref / tri:.1f}x |", flush=True)
        del pool
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="*", default=["decode", "chunk", "partitions"])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 16384, 32768, 131072])
    parser.add_argument("--partition-length", type=int, default=32768)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--fla-autotune", choices=["first", "full"], default="first")
    args = parser.parse_args()
    if args.fla_autotune == "first":
        limit_autotune()
    import kernels

    kernels.register()

    props = torch.cuda.get_device_properties(0)
    print(f"Device: {props.name}, torch {torch.__version__}")
    if "decode" in args.tables:
        table_decode(args.batches)
    if "chunk" in args.tables:
        table_chunk(args.tokens, args.lengths)
    if "partitions" in args.tables:
        table_partitions(args.partition_length)


if __name__ == "__main__":
    main()
