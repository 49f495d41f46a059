"""Where a training step's time goes, in a recipe's own stage:

    python -m benchmarks.pipeline.stage_profile smollm2-135m --stage align [--warmup 4] [--steps 4] [--set KEY=VALUE ...]

Runs the stage as ``sse-pipeline run`` would (its data, trainer and model; distillation from the recipe's model
without alignment, which trains at the same speed) into a scratch folder: ``warmup`` steps, then ``steps`` under
``torch.profiler``, each measured from the end of the one before (so the batch's loading and the logging count).
Prints the step's wall time, the device's busy time in it (kernels and copies), the memory it peaked at, the host
calls per step that wait for the device (``.item()``, ``nonzero``, synchronizations; one synchronization a step is
the profiler's own) with where they come from (one more step, profiled with Python stacks), and the ops that take
the most host and device time. A step much longer than its device time is host-bound: the tables say where the host
spends it. ``--trace`` also writes each stage's profile as a Chrome trace (``chrome://tracing``, Perfetto).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import TrainerCallback

from pipeline.recipe import load_recipe

# host ops that wait until the device has finished the work before them (``.item()``: the _local_scalar_dense in it)
WAITS = ("aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize", "cudaDeviceSynchronize",
         "cudaEventSynchronize")
STAGES = ("align", "distill")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepProfiler(TrainerCallback):
    """Times every optimizer step from the end of the one before (loading the batch and logging included) and
    profiles steps ``warmup + 1 .. warmup + steps`` (``profiled``), then one more with the Python stack of every op
    (``stacked``: where the waits come from; recording stacks slows the host, so that step is not timed)."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.times: list[float] = []
        self.profiled = self.stacked = None
        self.peak_gib = None  # the device memory the profiled steps peaked at
        self._last = None

    @staticmethod
    def _start(with_stack: bool):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # recent torch records Python frames in a stack only with the verbose experimental config
        extra = {"experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)} if with_stack else {}
        prof = profile(activities=activities, with_stack=with_stack, **extra)
        prof.__enter__()
        return prof

    def on_train_begin(self, args, state, control, **kwargs):
        _sync()
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        now = time.perf_counter()
        self.times.append(now - self._last)
        step = state.global_step
        if step == self.warmup:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.profiled = self._start(with_stack=False)
        elif step == self.warmup + self.steps:
            self.profiled.__exit__(None, None, None)
            if torch.cuda.is_available():
                self.peak_gib = torch.cuda.max_memory_allocated() / 2**30
            self.stacked = self._start(with_stack=True)
        elif step == self.warmup + self.steps + 1:
            self.stacked.__exit__(None, None, None)
            control.should_training_stop = True
        self._last = time.perf_counter()


@dataclass
class Op:
    name: str
    calls: float  # per step
    host_ms: float  # self time on the host, per step
    device_ms: float  # self time on the device, per step


def summarize(profiler: StepProfiler, top: int = 20) -> dict:
    """The profiled steps in numbers: wall and device time per step, the waits per step and where they come from,
    and the ``top`` ops by host and by device time."""
    steps, events = profiler.steps, profiler.profiled.key_averages()
    ops = [Op(e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps, e.self_device_time_total / 1e3 / steps)
           for e in events]
    device_ms = sum(e.self_device_time_total for e in events if e.device_type != torch.autograd.DeviceType.CPU)
    launches = sum(o.calls for o in ops if o.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    waits = {o.name: o.calls for o in ops if o.name in WAITS and o.calls}
    origins = []
    for e in profiler.stacked.key_averages(group_by_stack_n=8):  # one step
        if e.key in WAITS and e.stack:
            frames = [f for f in e.stack if not f.startswith("torch/") and "/torch/" not in f][:4]
            origins.append({"op": e.key, "per_step": e.count, "stack": frames})
    origins.sort(key=lambda o: -o["per_step"])
    profiled = profiler.times[profiler.warmup:profiler.warmup + steps]
    return {
        "step_s": [round(t, 4) for t in profiler.times],
        "profiled_step_s": sum(profiled) / max(len(profiled), 1),
        "device_busy_s": device_ms / 1e6 / steps,
        "kernel_launches": launches,
        "peak_gib": profiler.peak_gib,
        "waits": waits,
        "wait_origins": origins[:top],
        "by_host": [vars(o) for o in sorted(ops, key=lambda o: -o.host_ms)[:top]],
        "by_device": [vars(o) for o in sorted(ops, key=lambda o: -o.device_ms)[:top] if o.device_ms > 0],
    }


def markdown(stage: str, result: dict) -> str:
    step, busy = result["profiled_step_s"], result["device_busy_s"]
    lines = [f"## {stage}: {step * 1e3:.0f} ms a step, the device busy {busy * 1e3:.0f} ms of it "
             f"({100 * busy / step:.0f}%); {result['kernel_launches']:.0f} kernel launches a step"
             + (f"; peak {result['peak_gib']:.1f} GiB" if result["peak_gib"] is not None else ""), "",
             "every step (s): " + ", ".join(f"{t:.3f}" for t in result["step_s"]), "",
             "| host call that waits for the device | per step |", "|---|---|"]
    lines += [f"| `{name}` | {n:.1f} |" for name, n in sorted(result["waits"].items(), key=lambda kv: -kv[1])]
    if result["wait_origins"]:
        lines += ["", "| wait | per step | from |", "|---|---|---|"]
        lines += [f"| `{o['op']}` | {o['per_step']:.1f} | {' <- '.join(o['stack'])} |" for o in result["wait_origins"]]
    for title, key in (("host", "by_host"), ("device", "by_device")):
        lines += ["", f"| op (by {title} time) | calls a step | host ms a step | device ms a step |",
                  "|---|---|---|---|"]
        lines += [f"| `{o['name']}` | {o['calls']:.1f} | {o['host_ms']:.1f} | {o['device_ms']:.1f} |"
                  for o in result[key]]
    return "\n".join(lines) + "\n"


def profile_stage(recipe_name: str, stage: str, overrides: list[str], warmup: int, steps: int, out: Path,
                  trace: Path | None = None) -> dict:
    """Runs ``warmup + steps`` steps of ``stage`` of the recipe into ``out`` and returns :func:`summarize`'s dict."""
    if stage not in STAGES:
        raise ValueError(f"--stage {stage}: one of {STAGES}")
    total = warmup + steps + 1  # the last: the stacked profile's
    limit = {"align": [f"align.steps={total + 1}", f"align.save_steps={total + 1}"],
             "distill": [f"distill.max_steps={total + 1}", f"distill.save_steps={total + 1}"]}[stage]
    recipe = load_recipe(recipe_name, [f"output_dir={out}", *overrides, *limit])
    profiler = StepProfiler(warmup, steps)
    if stage == "align":
        from pipeline.run import stage_runs
        from pipeline.stages.align import run_align

        if not stage_runs(recipe, "align"):
            raise ValueError(f"{recipe_name} has no align stage (disabled, or it converts no layer into SSE)")
        run_align(recipe, out / "align", extra_callbacks=[profiler])
    else:
        from pipeline.stages.distill import run_distill

        run_distill(recipe, out / "distill", extra_callbacks=[profiler])
    if len(profiler.times) < total:
        raise RuntimeError(f"{stage} ran {len(profiler.times)} steps, fewer than the {total} asked (too little data?)")
    if trace is not None:
        profiler.profiled.export_chrome_trace(str(trace))
    return summarize(profiler)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--stage", choices=STAGES, nargs="+", default=list(STAGES))
    parser.add_argument("--warmup", type=int, default=4, help="steps before the profile (first shapes, compilations)")
    parser.add_argument("--steps", type=int, default=4, help="steps profiled")
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=None, help="where the stages run and the results go (a scratch "
                                                                 "folder by default)")
    parser.add_argument("--trace", action="store_true", help="also write each stage's Chrome trace (large)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="stage-profile-"))
    results = {}
    for stage in args.stage:
        result = profile_stage(args.recipe, stage, args.overrides, args.warmup, args.steps, out / stage,
                               out / f"{stage}.trace.json" if args.trace else None)
        results[stage] = result
        text = markdown(stage, result)
        (out / f"{stage}.md").write_text(text)
        print(text, flush=True)
    (out / "profile.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
