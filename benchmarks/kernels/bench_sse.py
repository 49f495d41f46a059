"""Benchmarks of the SSE kernels on one GPU; prints markdown tables (``docs/benchmarks.md`` holds results).

    python -m benchmarks.kernels.bench_sse                     # all tables
    python -m benchmarks.kernels.bench_sse --tables decode     # one of: chunk, overlap, partitions, compile, decode

(a) ``chunk``: forward and forward+backward time of our SSE (routing + plan + chunked kernels) and our GLA
    next to fla's ``chunk_gla`` on the same heads and dims, the reference SSE layer of fla's SSE pull request
    (when its source is on the path) and PyTorch SDPA (causal), at constant tokens (B x T = ``--tokens``),
    with peak memory;
(b) ``partitions``: SSE for N = 4..64 partitions at K = 1;
(b') ``overlap``: SSE with the sparse partitions' work on a second stream beside the shared state walk (the
    default, ``kernels.sse_chunk.OVERLAP``) against one stream, at the ``--lengths``, heads 18 and 8;
(c) ``compile``: the first SSE step in a fresh process with an empty Triton cache, against a warm step;
(d) ``decode``: one decode step of an SSE layer for a batch of sequences in a state pool, our kernel and
    the PyTorch step, against the memory roofline: state bytes that must move / measured copy bandwidth.

fla autotunes each kernel over many configurations, which costs minutes of compilation per kernel on a
fresh machine; ``--fla-autotune first`` (the default) keeps each of fla's kernels to its first configuration
(our kernels do not autotune).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

H, D = 18, 128


def limit_autotune() -> None:
    """Every Triton autotuner (``triton.autotune`` and fla's cached autotuner, a subclass) keeps only its first
    configuration: full autotuning compiles each of fla's kernels many times, minutes on a fresh machine.
    Call before fla is imported."""
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.__init__

    def init(self, fn, arg_names, configs, *args, **kwargs):
        original(self, fn, arg_names, configs[:1], *args, **kwargs)

    Autotuner.__init__ = init


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (CUDA-event timed, after warm-up)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60)


def sse_inputs(B, T, N, dtype=torch.bfloat16, grad=False, heads=H, head_dim=D):
    from sse_model.ops.sse import Branch

    def make(*shape, fn=None):
        x = torch.randn(*shape, device="cuda")
        x = fn(x) if fn else x
        return x.to(dtype).requires_grad_(grad)

    def side():
        return Branch(make(B, T, heads, head_dim), make(B, T, heads, head_dim, fn=lambda x: x.softmax(-1)),
                      make(B, T, heads, head_dim, fn=lambda x: F.logsigmoid(x) / 16))

    return side(), side(), make(B, T, heads, head_dim), make(B, T, N)


def sse_call(inputs, impl="auto", K=1, backward_head_groups=1):
    """Our SSE through the dispatch point (routing, plan, kernels), on packed rows like the pipeline's."""
    from sse_model.ops.dispatch import route_tokens, sse_attention
    from sse_model.ops.sse import Branch, SSEOptions

    shared, sparse, v, logits = inputs
    B, T = v.shape[:2]
    cu = torch.arange(0, (B + 1) * T, T, device="cuda", dtype=torch.int32)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (shared.q, shared.k, shared.g, sparse.q, sparse.k, sparse.g, v)]

    def run():
        routing = route_tokens(logits.reshape(1, B * T, -1), K, K)
        o, _ = sse_attention(Branch(*flat[:3]), Branch(*flat[3:6]), flat[6], routing,
                             SSEOptions(backward_head_groups=backward_head_groups), implementation=impl, cu_seqlens=cu)
        return o

    return run


def fla_sse_call(inputs, N):
    """The public reference layer's SSE computation (``SSEGLA.sse_linear_attention_varlen`` of fla's SSE pull
    request), on the same inputs; None when that source is not on the path."""
    try:
        from fla.layers.sse import SSEGLA
    except ImportError:
        return None
    shared, sparse, v, logits = inputs
    B, T = v.shape[:2]
    layer = SSEGLA(hidden_size=H * D, head_dim=D, num_heads=H, num_sparse_partition=N, num_writer=1, num_reader=1)
    cu = torch.arange(0, (B + 1) * T, T, device="cuda", dtype=torch.int32)
    order = (shared.q, sparse.q, shared.k, sparse.k, v, shared.g, sparse.g, logits)  # the layer method's arguments
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in order]
    return lambda: layer.sse_linear_attention_varlen(*flat, cu_seqlens=cu)[0]


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


def peak_gib(fn) -> float:
    """Peak memory of one call above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def table_chunk(tokens: int, lengths: list[int]) -> None:
    from kernels.sse_chunk import chunk_gla_triton

    try:
        from fla.ops.gla import chunk_gla as fla_gla
    except ImportError:
        fla_gla = None
    print(f"\n### (a) Chunked forward / forward+backward, ms (H={H}, D={D}, bf16, B x T = {tokens}, N=4, K=1)\n")
    print("Peers: fla `chunk_gla` (GLA on the same heads and dims), the reference SSE layer of fla's SSE pull "
          "request (its varlen path), PyTorch SDPA (flash, causal). Peak = memory of one f+b above its inputs.\n")
    names = ["SSE", "GLA (ours)", "GLA (fla)", "SSE (fla ref)", "SDPA"]
    print("| T | B | " + " | ".join(f"{n} fwd" for n in names) + " | " + " | ".join(f"{n} f+b" for n in names)
          + " | SSE / fla GLA fwd | SSE / fla GLA f+b | SDPA / SSE f+b | SSE peak GiB | fla GLA peak GiB |")
    print("|" + "---|" * (2 + 2 * len(names) + 5))
    for T in lengths:
        B = max(1, tokens // T)
        row, peak = {}, {}
        for grad in (False, True):
            inputs = sse_inputs(B, T, 4, grad=grad)
            shared, _, v, _ = inputs
            q = shared.q.transpose(1, 2).detach().requires_grad_(grad)
            gla_leaves = [shared.q, shared.k, v, shared.g]
            cases = {
                "SSE": (sse_call(inputs), leaves_of(inputs)),
                "GLA (ours)": (lambda: chunk_gla_triton(shared.q, shared.k, v, shared.g)[0], gla_leaves),
                "SDPA": (lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), [q]),
            }
            if fla_gla is not None:
                cases["GLA (fla)"] = (lambda: fla_gla(shared.q, shared.k, v, shared.g.float())[0], gla_leaves)
            ref = fla_sse_call(inputs, 4)
            if ref is not None:
                cases["SSE (fla ref)"] = (ref, leaves_of(inputs))
            for name, (fn, leaves) in cases.items():
                step = fwd_bwd(fn, leaves) if grad else fn
                try:
                    with torch.no_grad() if not grad else torch.enable_grad():
                        row[(name, grad)] = bench(step)
                        if grad and name in ("SSE", "GLA (fla)"):
                            peak[name] = peak_gib(step)
                except torch.OutOfMemoryError:
                    row[(name, grad)] = math.nan
                print(f"  T={T} {name} {'f+b' if grad else 'fwd'}: {row[(name, grad)]:.2f} ms", file=sys.stderr,
                      flush=True)
                torch.cuda.empty_cache()
            del inputs, cases
        get = lambda n, g: row.get((n, g), math.nan)  # noqa: E731
        cells = [f"{get(n, g):.2f}" for g in (False, True) for n in names]
        ratios = [get("SSE", False) / get("GLA (fla)", False), get("SSE", True) / get("GLA (fla)", True),
                  get("SDPA", True) / get("SSE", True)]
        print(f"| {T} | {B} | " + " | ".join(cells) + " | " + " | ".join(f"{x:.2f}x" for x in ratios)
              + f" | {peak.get('SSE', math.nan):.2f} | {peak.get('GLA (fla)', math.nan):.2f} |", flush=True)


def table_partitions(T: int, tokens: int) -> None:
    B = max(1, tokens // T)
    print(f"\n### (b) SSE vs number of partitions, ms (B={B}, T={T}, H={H}, D={D}, K=1, bf16)\n")
    print("| N | fwd | fwd+bwd | f+b vs N=4 |")
    print("|---|---|---|---|")
    base = None
    for N in (4, 8, 16, 32, 64):
        inputs = sse_inputs(B, T, N, grad=True)
        run = sse_call(inputs)
        with torch.no_grad():
            fwd = bench(run)
        fb = bench(fwd_bwd(run, leaves_of(inputs)))
        base = base or fb
        print(f"| {N} | {fwd:.2f} | {fb:.2f} | {fb / base:.2f}x |", flush=True)
        del inputs
        torch.cuda.empty_cache()


def table_overlap(tokens: int, lengths: list[int]) -> None:
    """The side stream's gain (``kernels.sse_chunk.OVERLAP``), both settings in one process, alternated."""
    from kernels import sse_chunk

    print(f"\n### (b') Sparse work on a side stream beside the shared walk, ms (B x T = {tokens}, D={D}, N=4, K=1, "
          "bf16)\n")
    print("| T | B | H | fwd, one stream | fwd, side stream | f+b, one stream | f+b, side stream | f+b gain |")
    print("|---|---|---|---|---|---|---|---|")
    for heads in (H, 8):
        for T in lengths:
            B = max(1, tokens // T)
            inputs = sse_inputs(B, T, 4, grad=True, heads=heads)
            run, step = sse_call(inputs), fwd_bwd(sse_call(inputs), leaves_of(inputs))
            times = {}
            for overlap in (False, True, False, True):  # alternated: drift of the clock hits both
                sse_chunk.OVERLAP = overlap
                with torch.no_grad():
                    fwd = bench(run)
                times.setdefault(overlap, []).append((fwd, bench(step)))
            sse_chunk.OVERLAP = True
            (f0, b0), (f1, b1) = ([min(col) for col in zip(*times[k])] for k in (False, True))
            print(f"| {T} | {B} | {heads} | {f0:.2f} | {f1:.2f} | {b0:.2f} | {b1:.2f} | {b0 / b1:.2f}x |", flush=True)
            del inputs, run, step
            torch.cuda.empty_cache()


COMPILE_PROBE = """
import time, torch
from benchmarks.kernels.bench_sse import sse_inputs, sse_call, fwd_bwd, leaves_of
import kernels; kernels.register()
inputs = sse_inputs(2, 4096, 4, grad=True)
step = fwd_bwd(sse_call(inputs), leaves_of(inputs))
times = []
for _ in range(3):
    torch.cuda.synchronize(); t = time.perf_counter(); step(); torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
print(f"{times[0]:.3f} {times[2]:.3f}")
"""


def table_compile() -> None:
    """First SSE forward+backward in a fresh process with an empty Triton cache, against a warm one."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, "-c", COMPILE_PROBE], env=env, capture_output=True, text=True, check=True)
    first, warm = map(float, out.stdout.split()[-2:])
    print("\n### (c) First-step compile overhead (fresh process, empty Triton cache; SSE f+b, B=2, T=4096)\n")
    print("| first call s | warm call s | overhead s |")
    print("|---|---|---|")
    print(f"| {first:.2f} | {warm:.3f} | {first - warm:.2f} |", flush=True)


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
    parser.add_argument("--tables", nargs="*", default=["decode", "chunk", "partitions", "compile"])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 32768, 131072])
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
    if "overlap" in args.tables:
        table_overlap(args.tokens, args.lengths)
    if "partitions" in args.tables:
        table_partitions(args.partition_length, args.tokens)
    if "compile" in args.tables:
        table_compile()


if __name__ == "__main__":
    main()
