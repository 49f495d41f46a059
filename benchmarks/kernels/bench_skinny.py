"""Products of few rows, as a decode step runs them: ``kernels.skinny`` against cuBLAS (``F.linear``) and the memory
roofline, at the weight shapes of ``sse-h-2b``; prints markdown tables (GPU).

    python -m benchmarks.kernels.bench_skinny [--rows 8 32] [--sweep]

Each product reads a weight the previous products did not (the step streams 3.7 GB through a 50 MB L2): every
shape is timed over enough distinct copies of its weight to fill 256 MB, one launch each, back to back in a CUDA
graph (GPU time, as the engine replays a step). The last
row is a whole step's products (18 layers, the head) in order. ``--sweep`` also times every tile configuration at the
first ``--rows`` and prints the best per shape.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.kernels.bench_sse import copy_bandwidth
from kernels.skinny import skinny_config, skinny_linear

HIDDEN, HEADS, DIM, INTER, VOCAB, RANK = 2304, 18, 128, 6144, 151936, 64
# (name, N, K, with residual)
SHAPES = [
    ("SSE input maps (q, k, v, low-rank firsts)", 3 * HEADS * DIM + 2 * RANK + 2 * 16 + DIM, HIDDEN, False),
    ("attention q, k, v", 3 * HEADS * DIM, HIDDEN, False),
    ("output gate, second half", HEADS * DIM, DIM, False),
    ("output projection (+ residual)", HIDDEN, HEADS * DIM, True),
    ("MLP gate + up", 2 * INTER, HIDDEN, False),
    ("MLP down (+ residual)", HIDDEN, INTER, True),
    ("router", 4, HIDDEN, False),
    ("head", VOCAB, HIDDEN, False),
]
# how many times a decode step of sse-h-2b runs each shape (15 SSE layers, 3 attention layers)
PER_STEP = [15, 3, 15, 18, 18, 18, 15, 1]


def timed(fn, calls: int, repeats: int = 20) -> float:
    """GPU milliseconds per call of ``fn(i)`` for i in range(calls), back to back in one CUDA graph (as the engine
    replays a step: the host's launch cost is not measured)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # compile, warm up
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (repeats * calls)


def operands(M: int, N: int, K: int, residual: bool):
    nbytes = N * K * 2
    copies = max(1, -(-256 * 2**20 // nbytes))
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if residual else None
    return weights, x, res


def cublas(x, w, res):
    return F.linear(x, w) if res is None else torch.addmm(res, x, w.t())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s\n")
    print("| rows | product | N x K | MB | roofline us | cuBLAS us | skinny us | cuBLAS TB/s | skinny TB/s | "
          "cuBLAS / skinny | config | max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for M in args.rows:
        step = {"roofline": 0.0, "cublas": 0.0, "skinny": 0.0}
        for (name, N, K, residual), per_step in zip(SHAPES, PER_STEP):
            weights, x, res = operands(M, N, K, residual)
            ref = cublas(x, weights[0], res).float()
            ours = skinny_linear(x, weights[0], residual=res).float()
            diff = ((ours - ref).abs().max() / ref.abs().max()).item()
            t_cublas = timed(lambda i: cublas(x, weights[i], res), len(weights)) * 1e3
            t_ours = timed(lambda i: skinny_linear(x, weights[i], residual=res), len(weights)) * 1e3
            nbytes = N * K * 2
            roofline = nbytes / bandwidth * 1e6
            config = skinny_config(M, N, K, sms)
            print(f"| {M} | {name} | {N} x {K} | {nbytes / 1e6:.1f} | {roofline:.1f} | {t_cublas:.1f} | {t_ours:.1f} | "
                  f"{nbytes / t_cublas / 1e6:.2f} | {nbytes / t_ours / 1e6:.2f} | {t_cublas / t_ours:.2f}x | "
                  f"{config[:3]} | {diff:.1e} |", flush=True)
            step["roofline"] += per_step * roofline
            step["cublas"] += per_step * t_cublas
            step["skinny"] += per_step * t_ours
            if args.sweep and M == args.rows[0]:
                best = None
                for BN, BK, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)):
                    if BN * BK > 65536:
                        continue
                    cfg = (max(16, 1 << (M - 1).bit_length()), BN, BK, warps, stages)
                    try:
                        t = timed(lambda i: skinny_linear(x, weights[i], residual=res, config=cfg), len(weights), 5)
                    except Exception:  # out of shared memory
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                print(f"|   | best of the sweep | | | | | {best[0] * 1e3:.1f} | | {nbytes / best[0] / 1e9:.2f} | "
                      f"{t_cublas / (best[0] * 1e3):.2f}x | {best[1]} | |", flush=True)
            del weights
            torch.cuda.empty_cache()
        print(f"| {M} | **a decode step's products** | | | {step['roofline']:.0f} | {step['cublas']:.0f} | "
              f"{step['skinny']:.0f} | | | {step['cublas'] / step['skinny']:.2f}x | | |", flush=True)


if __name__ == "__main__":
    main()
