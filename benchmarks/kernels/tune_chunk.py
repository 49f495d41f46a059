"""Per-kernel tile and warp choices of the chunked SSE kernels, measured at one shape.

Each kernel of :mod:`kernels.sse_chunk` is timed (CUDA time under ``torch.profiler``, summed over its launches in
one SSE forward+backward) under each candidate :class:`~kernels.sse_chunk.KernelConfig` while the others keep
their current one; prints a table and the best choice per kernel, which ``CONFIGS`` in ``sse_chunk.py`` records.
``--then-bench`` runs the chunk table of ``bench_sse`` with the best choices in the same process.

    python -m benchmarks.kernels.tune_chunk [--B 4 --T 32768 --H 18] [--kernels fwd_o bwd_dv] [--then-bench]
    python -m benchmarks.kernels.tune_chunk --B 1 --T 32768 --H 18 --groups 3 --kernels   # the breakdown alone

(``--B 8 --T 4096 --H 8`` and ``--B 2 --T 16384 --H 8``: one layer of the model benchmark's training steps;
``--B 1 --T 32768 --H 18``: one row of ``paper-2b``'s distillation, a single sequence whose state walks have few
programs.) First a breakdown: each chunk kernel's time and launches under the current configs.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from kernels import sse_chunk
from kernels.sse_chunk import KernelConfig

from .bench_sse import fwd_bwd, leaves_of, limit_autotune, sse_call, sse_inputs

SEQUENTIAL = [KernelConfig(64, 64, 4), KernelConfig(64, 64, 8), KernelConfig(32, 64, 4), KernelConfig(64, 64, 4, 3),
              KernelConfig(64, 64, 2), KernelConfig(32, 64, 2), KernelConfig(64, 128, 4), KernelConfig(32, 32, 2),
              KernelConfig(32, 32, 4), KernelConfig(16, 64, 2), KernelConfig(16, 32, 2), KernelConfig(32, 16, 2)]
PER_CHUNK = [KernelConfig(32, 64, 4), KernelConfig(64, 64, 4), KernelConfig(32, 128, 4), KernelConfig(64, 128, 8),
             KernelConfig(32, 64, 4, 3), KernelConfig(32, 64, 2), KernelConfig(16, 64, 4), KernelConfig(64, 64, 4, 3),
             KernelConfig(32, 64, 8), KernelConfig(64, 64, 8), KernelConfig(32, 32, 4)]
# _bwd_dqkg only with two value blocks or more and a pipelined loop: otherwise Triton 3.6 miscompiles it on
# Hopper (an illegal memory access kills the whole process; see CONFIGS in sse_chunk.py)
CANDIDATES = {"fwd_h": SEQUENTIAL, "bwd_dh": SEQUENTIAL, "fwd_o": PER_CHUNK, "bwd_dv": PER_CHUNK,
              "bwd_dqkg": [replace(c, min_blocks_v=2) for c in PER_CHUNK if c.num_stages > 1]}


def profile(step) -> tuple[dict[str, float], dict[str, int], float]:
    """One call of ``step`` after a warm-up call: each chunk kernel's CUDA milliseconds and launches (the walks'
    ``_carry`` too, which has no tile choice), and the call's wall-clock milliseconds."""
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    launches: dict[str, int] = {}
    for event in prof.key_averages():
        name = event.key[1:]
        if name in CANDIDATES or name == "carry":
            times[name] = times.get(name, 0.0) + event.device_time_total / 1e3
            launches[name] = launches.get(name, 0) + event.count
    return times, launches, start.elapsed_time(end)


def kernel_times(step) -> dict[str, float]:
    """Milliseconds of CUDA time per chunk kernel in one call of ``step`` (after a warm-up call)."""
    return profile(step)[0]


def breakdown(step) -> None:
    """Each chunk kernel's CUDA time and launches in one call under the current configs, and the call's time."""
    times, launches, wall = profile(step)

    def config(name: str) -> str:
        c = sse_chunk.CONFIGS.get(name)
        return "" if c is None else f"{c.block_k}, {c.block_v}, {c.num_warps}, {c.num_stages}"

    print("| kernel | BK, BV, warps, stages | launches | ms |")
    print("|---|---|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {config(name)} | {launches[name]} | {ms:.2f} |")
    print(f"| chunk kernels | | | {sum(times.values()):.2f} |")
    print(f"| the call (forward + backward, wall-clock) | | | {wall:.2f} |\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--H", type=int, default=18, help="heads")
    parser.add_argument("--D", type=int, default=128, help="head dim")
    parser.add_argument("--groups", type=int, default=1, help="SSEOptions.backward_head_groups of the call")
    parser.add_argument("--pieces", type=int, default=sse_chunk.PIECE_CHUNKS,
                        help="chunks a piece where the state walks are split (0: whole walks)")
    parser.add_argument("--kernels", nargs="*", default=list(CANDIDATES), choices=list(CANDIDATES),
                        help="kernels to tune (none: the breakdown alone)")
    parser.add_argument("--then-bench", action="store_true")
    args = parser.parse_args()
    limit_autotune()
    sse_chunk.PIECE_CHUNKS = args.pieces
    import kernels

    kernels.register()
    inputs = sse_inputs(args.B, args.T, 4, grad=True, heads=args.H, head_dim=args.D)
    step = fwd_bwd(sse_call(inputs, backward_head_groups=args.groups), leaves_of(inputs))
    print(f"\n### Chunk kernel configs (B={args.B}, T={args.T}, H={args.H}, D={args.D}, N=4, K=1, bf16, one f+b, "
          f"backward_head_groups={args.groups}, pieces of {args.pieces} chunks; {torch.cuda.get_device_name()})\n")
    breakdown(step)
    if args.kernels:
        print("| kernel | BK | BV | warps | stages | ms |")
        print("|---|---|---|---|---|---|")
    for name in args.kernels:
        candidates = CANDIDATES[name]
        best = None
        for cfg in candidates:
            sse_chunk.CONFIGS[name] = cfg
            try:
                ms = kernel_times(step)[name]
            except Exception as e:  # a config the compiler rejects (shared memory): skip it
                print(f"| {name} | {cfg.block_k} | {cfg.block_v} | {cfg.num_warps} | {cfg.num_stages} | "
                      f"failed: {type(e).__name__} |", flush=True)
                continue
            print(f"| {name} | {cfg.block_k} | {cfg.block_v} | {cfg.num_warps} | {cfg.num_stages} | {ms:.2f} |",
                  flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        sse_chunk.CONFIGS[name] = best[1]
    if args.kernels:
        print("\nbest:", {k: (c.block_k, c.block_v, c.num_warps, c.num_stages) for k, c in sse_chunk.CONFIGS.items()})
        print("\nWith the best:\n")
        breakdown(step)
    del inputs
    torch.cuda.empty_cache()
    if args.then_bench:
        from .bench_sse import table_chunk

        table_chunk(131072, [4096, 32768, 131072])


if __name__ == "__main__":
    main()
