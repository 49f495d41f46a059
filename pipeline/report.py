"""``report.md`` of a run: what ran, where its outputs are, each stage's headline numbers, the evaluation table
and GRPO's time split and reward curve."""

from __future__ import annotations

from pathlib import Path

from .metrics import read_metrics
from .models import precision_name, resolve_device
from .recipe import Recipe
from .stages import STAGES


def time_split(rows: list[dict]) -> list[str]:
    """Mean seconds per GRPO step in rollout / reward / weight sync / train, as a markdown table."""
    parts = ("rollout", "reward", "weight_sync", "train")
    rows = [r for r in rows if "time/step_s" in r and "time/rollout_s" in r]
    if not rows:
        return []
    mean = {p: sum(r.get(f"time/{p}_s", 0.0) for r in rows) / len(rows) for p in ("step", *parts)}
    rate = [r["tokens/generated_per_s"] for r in rows if "tokens/generated_per_s" in r]
    header = "| steps | s/step | " + " | ".join(parts) + " | generated tok/s (rollout) |"
    cells = " | ".join(f"{mean[p]:.2f} s ({100 * mean[p] / max(mean['step'], 1e-9):.0f}%)" for p in parts)
    rate_text = f"{sum(rate) / len(rate):,.0f}" if rate else ""
    return ["Time per step (mean over logged steps):", "", header, "|" + " --- |" * (len(parts) + 3),
            f"| {len(rows)} | {mean['step']:.2f} | {cells} | {rate_text} |", ""]


def starting(recipe: Recipe, out: Path) -> str:
    """The model the run's first stage started from: the record of a stage started elsewhere, else the recipe's."""
    import json

    first = next((stage for stage in STAGES if (out / stage).exists()), None)  # the first stage that ran
    record = out / str(first) / "started_from.json"
    if first is not None and record.exists():  # a model of another run, or a --checkpoint
        return f"`{json.loads(record.read_text())['model']}` ({first})"
    m = recipe.model
    return (f"`{m.path}`" if m.path else f"the preset {m.preset} (random weights)" if m.preset
            else f"{m.convert_from}, converted")


def write_report(recipe: Recipe, out: Path, timings: dict, total: float) -> Path:
    """``report.md`` in ``out``; ``timings``: seconds each stage took in this run."""
    lines = [f"# {recipe.name}", "", f"Output directory: `{out}`", f"Started from: {starting(recipe, out)}."]
    if any((out / stage / "final").exists() for stage in STAGES if stage != "eval"):  # an evaluation alone trains none
        lines.append(f"Training precision: {precision_name(recipe, resolve_device(recipe.device))}.")
    lines.append("")
    lines += ["| stage | seconds this run | final model | highlights |", "| --- | --- | --- | --- |"]
    for name, stage in STAGES.items():
        stage_dir = out / name
        if not stage_dir.exists():
            continue
        final = stage_dir / "final"
        lines.append(f"| {name} | {timings.get(name, 0.0):.0f} | {'`' + str(final) + '`' if final.exists() else ''} | "
                     f"{stage.highlight(recipe, stage_dir)} |")
    for stage in ("align", "distill"):
        if (out / stage / "loss.png").exists():
            lines += ["", f"![{stage} loss]({stage}/loss.png)"]
    if (out / "eval" / "results.md").exists():
        lines += ["", "## Evaluation", "", (out / "eval" / "results.md").read_text(), "![eval](eval/results.png)"]
    if (out / "grpo" / "reward_curve.png").exists():
        lines += ["", "## GRPO", "", *time_split(read_metrics(out / "grpo" / "metrics.jsonl")),
                  "![reward curve](grpo/reward_curve.png)"]
    lines += ["", f"Total wall time of this run: {total:.0f} s.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
