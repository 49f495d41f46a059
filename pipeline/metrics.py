"""Training metrics: a JSONL log next to TensorBoard, time splits, and curves as PNG."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import logging

from transformers import TrainerCallback

from common.files import read_jsonl, repair_tail


logger = logging.getLogger(__name__)


class Timer:
    """Accumulates named wall-clock spans between two log lines (rollout, reward, ...)."""

    def __init__(self):
        self.spans: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.spans[name] = self.spans.get(name, 0.0) + seconds

    def count(self, name: str, value: float) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + value

    def set(self, name: str, value: float) -> None:
        """A value that the next log shows as it was last (a staleness, a fraction), not summed."""
        self.counts[name] = value

    def take(self) -> tuple[dict, dict]:
        spans, counts = self.spans, self.counts
        self.spans, self.counts = {}, {}
        return spans, counts


class MetricsLogger(TrainerCallback):
    """Appends every log of the trainer, plus time split and throughput, to ``metrics.jsonl``."""

    def __init__(self, path: Path, timer: Timer | None = None, extra=None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(self.path)  # a resumed run must not append to a line torn by the killed one
        self.timer = timer or Timer()
        self.extra = extra
        self._last = time.perf_counter()
        self._last_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._last, self._last_step = time.perf_counter(), state.global_step
        if state.is_world_process_zero:
            self.forget_after(state.global_step)

    def forget_after(self, step: int) -> None:
        """Drops the records of steps after ``step`` (a run resumed from its checkpoint at ``step`` logs them again;
        kept, every curve and report would count them twice). Rewritten atomically."""
        rows = read_metrics(self.path)
        keep = [r for r in rows if r.get("step", 0) <= step]
        if len(keep) == len(rows):
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in keep))
        os.replace(tmp, self.path)
        logger.info("%s: dropped %d records of the steps after %d, which the resumed run logs again", self.path,
                    len(rows) - len(keep), step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        now = time.perf_counter()
        steps = max(state.global_step - self._last_step, 1)
        elapsed = now - self._last
        spans, counts = self.timer.take()
        record = {"step": state.global_step, "time": time.time(), **logs}
        if spans or "loss" in logs:
            record["time/step_s"] = elapsed / steps
            for name, seconds in spans.items():
                record[f"time/{name}_s"] = seconds / steps
            if spans:
                record["time/train_s"] = max(0.0, elapsed - sum(spans.values())) / steps
        for name, value in counts.items():
            record[name] = value
        # (generating ahead, the rollout span is the trainer's wait, not the engines' generation)
        if "tokens/generated" in counts and spans.get("rollout") and "async/staleness" not in counts:
            record["tokens/generated_per_s"] = counts["tokens/generated"] / spans["rollout"]
        record.update(gpu_memory())
        if self.extra is not None:
            record.update(self.extra())
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, default=float) + "\n")
        if state.max_steps and "time/step_s" in record:  # a progress line with rate and ETA, in any console
            print(progress_line(self.path.parent.name, state, record), flush=True)  # (Ray forwards a worker's stdout)
        if record.get("frac_reward_zero_std") == 1.0 or record.get("dynamic_sampling/informative_fraction") == 0:
            print(f"{self.path.parent.name}: step {state.global_step}: no group's rewards varied, so this step's "
                  "advantages are all zero and it learned nothing (every sample right, or every one wrong)", flush=True)
        self._last, self._last_step = now, state.global_step


def gpu_memory() -> dict:
    """This process's GPU memory high-water marks so far, in GiB (none before it has touched a GPU): PyTorch's
    tensors and its caching allocator's reserve. A reserve far above the tensors is fragmentation, which packed rows
    of varying lengths cause (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` is PyTorch's remedy)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {"memory/max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def progress_line(stage: str, state, record: dict) -> str:
    """``distill: step 40/120 (33%), 2.31 s/step, ETA 00:03:04, loss 0.812``; GRPO's with its reward and rollout rate
    (the trainer's own log is a dict of some forty metrics a step)."""
    left = (state.max_steps - state.global_step) * record["time/step_s"]
    parts = [f"{stage}: step {state.global_step}/{state.max_steps} ({100 * state.global_step / state.max_steps:.0f}%)",
             f"{record['time/step_s']:.2f} s/step", f"ETA {time.strftime('%H:%M:%S', time.gmtime(left))}"]
    for key, name, form in (("loss", "loss", ".4g"), ("reward", "reward", ".3f"),
                            ("tokens/generated_per_s", "generated tok/s", ",.0f")):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{name} {record[key]:{form}}")
    return ", ".join(parts)


def read_metrics(path: Path) -> list[dict]:
    """Every record of a metrics log; torn lines are skipped with a warning (see :mod:`common.files`)."""
    return read_jsonl(path)


def logged_values(records: list[dict], key: str) -> list[float]:
    """The numbers logged under ``key``, in order: a step can log none (GRPO's reward is null where every
    completion of the step went unscored), which a curve skips rather than reads as zero."""
    return [r[key] for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]


def first_last_means(values: list[float], k: int | None = None) -> tuple[float, float, int]:
    """Means of the first and of the last ``k`` values (default a fifth of them) and ``k``: where a noisy curve
    (GRPO's reward) started and ended."""
    k = max(1, min(len(values), k if k is not None else len(values) // 5))
    return sum(values[:k]) / k, sum(values[-k:]) / k, k


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (the first points average what there is)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# readable titles of the logged keys a figure shows
CURVE_TITLES = {"loss": "training loss", "ce": "cross-entropy", "teacher_kl": "KL to the teacher",
                "balance_loss": "partition-balance loss", "learning_rate": "learning rate", "grad_norm": "gradient norm",
                "reward": "reward (weighted sum)", "completions/mean_length": "completion length (tokens)",
                "time/step_s": "seconds per step"}


def plot_curves(metrics_path: Path, png_path: Path, keys: list[str], title: str) -> Path | None:
    """One panel per metric key found in the log, against the training step, with a moving average over a
    tenth of the steps. A key ending in ``*`` stands for every logged key with that prefix (e.g.
    ``rewards/*`` gives one panel per reward function)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    logged = sorted({k for r in rows for k in r})
    expanded = []
    for key in keys:
        if key.endswith("*"):
            expanded += [k for k in logged if k.startswith(key[:-1]) and k.endswith("/mean")]
        elif key in logged:
            expanded.append(key)
    keys = list(dict.fromkeys(expanded))
    if not keys:
        return None
    columns = min(3, len(keys))  # a grid, not a row of tiny panels
    grid_rows = -(-len(keys) // columns)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(4.4 * columns, 3.3 * grid_rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        points = sorted({r["step"]: r[key] for r in rows if key in r and isinstance(r[key], (int, float))}.items())
        steps, values = [p[0] for p in points], [p[1] for p in points]
        ax.plot(steps, values, marker=".", alpha=0.4 if len(points) >= 5 else 1.0, label="per step")
        if len(points) >= 5:
            window = max(2, len(points) // 10)
            ax.plot(steps, moving_average(values, window), linewidth=2, label=f"mean of {window}")
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(CURVE_TITLES.get(key, key.removesuffix("/mean").replace("rewards/", "reward: ")), fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
