"""A finished run's results, kept after its machine is gone: ``sse-pipeline keep RUN DEST``.

It copies what a reader and ``sse-pipeline compare`` need from a run folder (the recipes, the report, each
stage's metrics and plots, the records of the model each stage started from, GRPO's engines, the evaluations'
tables, plots and summaries) and none of the weights, checkpoints, generations or event files: a few MiB where the
run holds gigabytes, small enough to bring back from a remote machine or to commit beside the write-up. Each
problem's answers are dropped from the summaries (they are the generations' text again); each problem's accuracy
stays, for compare's paired changes. Summaries and metrics are kept as gzip (``summary.json.gz``), a fifth of their
size; compare reads either. DEST is written whole or not at all (a temporary folder renamed into place).
"""

from __future__ import annotations

import json
import os
import shutil
from fnmatch import fnmatch
from pathlib import Path

from common.files import compressed, read_text, write_compressed
from eval.report import summary_json

KEPT = ("recipe.yaml", "report.md", "metrics.jsonl", "metrics.jsonl.gz", "started_from.json", "engines*.json",
        "results.md", "summary.json", "summary.json.gz", "*.png")
LEFT = ("final", "checkpoints", "generations", "tensorboard")  # folders of weights, generations, event files


def kept_files(run: Path) -> list[Path]:
    """The files of ``run`` that ``keep`` copies, relative to it; outputs a ``--redo`` moved aside are left too."""
    files = []
    for path in sorted(Path(run).rglob("*")):
        parts = path.relative_to(run).parts
        if path.is_file() and not any(p in LEFT or ".replaced-" in p for p in parts[:-1]) \
                and any(fnmatch(path.name, pattern) for pattern in KEPT):
            files.append(Path(*parts))
    return files


def without_answers(summary: dict) -> dict:
    """``summary`` with each problem's answers dropped in place (its accuracies stay, for paired changes)."""
    for benchmark in summary.get("benchmarks", {}).values():
        for problem in benchmark.get("per_problem", []):
            problem.pop("answers", None)
    return summary


def keep(run: str | Path, dest: str | Path) -> list[Path]:
    """Copies ``run``'s kept files into the new folder ``dest``; returns them as written (a gzip where kept as
    one), relative to ``dest``."""
    run, dest = Path(run), Path(dest)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run folder")
    inside = dest.resolve().is_relative_to(run.resolve()) or run.resolve().is_relative_to(dest.resolve())
    if inside:  # a copy inside the run (or the run inside it) nests, and compare would read its summaries twice
        raise ValueError(f"{dest}: inside the run {run} (or around it); keep it in a folder of its own")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest}: exists and is not an empty folder; keep writes a new one")
    files = kept_files(run)
    if not files:
        raise ValueError(f"{run}: nothing to keep (no recipe.yaml, report, metrics or summary.json); is it a run "
                         "folder?")
    tmp = dest.with_name(f".{dest.name}.keep-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    written = []
    try:
        for rel in files:
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if rel.name in ("summary.json", "summary.json.gz"):
                plain = rel.with_suffix("") if rel.suffix == ".gz" else rel
                try:
                    summary = json.loads(read_text(run / plain))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{run / rel}: not JSON ({err})") from err
                write_compressed(tmp / plain, summary_json(without_answers(summary)))
                written.append(compressed(plain))
            elif rel.name == "metrics.jsonl":
                write_compressed(target, (run / rel).read_text())
                written.append(compressed(rel))
            else:
                shutil.copy2(run / rel, target)
                written.append(rel)
    except BaseException:  # nothing half-written is left beside dest
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        dest.rmdir()
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dest)
    return written
