"""Where the time of one SSE call goes: the top CUDA kernels under ``torch.profiler``.

    python -m benchmarks.kernels.profile_sse [--T 32768 --B 4] [--backward]
"""

from __future__ import annotations

import argparse

import torch

from .bench_sse import fwd_bwd, leaves_of, limit_autotune, sse_call, sse_inputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--backward", action="store_true", help="profile forward + backward")
    args = parser.parse_args()
    limit_autotune()
    import kernels

    kernels.register()
    inputs = sse_inputs(args.B, args.T, 4, grad=args.backward)
    run = sse_call(inputs, args.impl)
    step = fwd_bwd(run, leaves_of(inputs)) if args.backward else run
    with torch.set_grad_enabled(args.backward):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
