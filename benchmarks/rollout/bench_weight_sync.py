"""Trainer -> engine weight sync time: Ray's object store against a broadcast over a process group, or, for
engines on the trainer's GPU, against CUDA IPC.

A trainer actor (a GPU of its own, or the cores) holds a model with random float32 weights, as the GRPO trainer
does, and syncs it ``--repeats`` times into ``--engines`` rollout engines (bf16 on GPUs) on their own GPUs:
``object_store`` (put once, each engine loads) and ``broadcast`` (NCCL between GPUs, gloo on CPU; the engines'
dtype, ~256 MB buckets). With ``--colocated`` the engines share the trainer's GPU, as colocated GRPO places them
(half of it for the trainer), and the methods are ``object_store`` and ``cuda_ipc`` (the engines copy the weights
from the trainer's memory). Prints the median seconds per sync and the rate in the engines' bytes.

    python -m benchmarks.rollout.bench_weight_sync --presets sse-h-100m sse-h-2b      # >= 2 GPUs
    python -m benchmarks.rollout.bench_weight_sync --colocated --presets sse-h-smollm2 sse-h-2b  # 1 GPU
    python -m benchmarks.rollout.bench_weight_sync --presets sse-h-tiny --device cpu  # any machine
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch


class SyncBench:
    """The trainer side: a model and a fleet of engines built from it."""

    def __init__(self, preset: str, engines: int, method: str, device: str, colocated: bool = False):
        from sse_model import SSEConfig, SSEForCausalLM

        from pipeline.rollout.actor import EngineFleet

        torch.manual_seed(0)
        config = SSEConfig.from_preset(preset)
        self.model = SSEForCausalLM(config).to(device)  # float32 master weights, like the trainer's
        sync = method if method != "broadcast" else ("nccl" if device == "cuda" else "gloo")
        gpus = (0.5 / engines if colocated else 1) if device == "cuda" else 0
        engine_model = SSEForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
        self.fleet = EngineFleet(engine_model, None, num_engines=engines, num_gpus=gpus, num_cpus=1,
                                 weight_sync=sync, device=device, max_slots=1, max_model_len=64,
                                 dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                 use_cuda_graphs=False)
        self.engine_bytes = sum(p.numel() for p in self.model.parameters()) * (2 if device == "cuda" else 4)

    def run(self, repeats: int) -> dict:
        times = []
        for _ in range(repeats + 1):  # the first forms the group / warms the store
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            self.fleet.update_weights(self.model.state_dict())
            times.append(time.perf_counter() - start)
        self.fleet.shutdown()
        median = statistics.median(times[1:])
        return {"first_s": times[0], "median_s": median, "gb": self.engine_bytes / 1e9,
                "gb_per_s": self.engine_bytes / 1e9 / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="*", default=["sse-h-100m", "sse-h-2b"])
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--methods", nargs="*", default=None,
                        help="default: object_store broadcast; with --colocated: object_store cuda_ipc")
    parser.add_argument("--colocated", action="store_true", help="the engines on the trainer's GPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.methods = args.methods or (["object_store", "cuda_ipc"] if args.colocated else ["object_store", "broadcast"])
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    needed = 1 if args.colocated else args.engines + 1
    if args.device == "cuda" and gpus < needed:
        raise SystemExit(f"{args.engines} engine(s) and the trainer need {needed} GPUs; this machine has {gpus}")
    ray.init(num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    trainer = ray.remote(num_gpus=(0.5 if args.colocated else 1) if gpus else 0, num_cpus=1)(SyncBench)
    where = torch.cuda.get_device_name(0) if gpus else "CPU"
    shared = ", on the trainer's GPU" if args.colocated else ""
    print(f"\n### Weight sync, trainer -> {args.engines} engine(s){shared}, {where}\n")
    print("| model | method | engine GB | first sync s (engines starting) | sync s (median) | GB/s |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets:
        for method in args.methods:
            bench = trainer.remote(preset, args.engines, method, args.device, args.colocated)
            r = ray.get(bench.run.remote(args.repeats))
            ray.kill(bench)
            print(f"| {preset} | {method} | {r['gb']:.2f} | {r['first_s']:.2f} | {r['median_s']:.3f} "
                  f"| {r['gb_per_s']:.1f} |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
