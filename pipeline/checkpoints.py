"""Checkpoints that survive being killed: complete-only resume points and atomic final models."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

DONE = "stage_done.json"


def latest_complete_checkpoint(directory: Path) -> Path | None:
    """The newest ``checkpoint-N`` that finished writing. transformers' Trainer writes ``trainer_state.json``
    last, so a directory without it was interrupted and is skipped (and removed)."""
    directory = Path(directory)
    if not directory.exists():
        return None
    found = []
    for child in directory.glob("checkpoint-*"):
        step = child.name.split("-")[-1]
        if not step.isdigit():
            continue
        if (child / "trainer_state.json").exists():
            found.append((int(step), child))
        else:
            shutil.rmtree(child, ignore_errors=True)
    return max(found)[1] if found else None


def save_final(model, tokenizer, directory: Path, info: dict) -> Path:
    """Writes the stage's final model to ``directory`` atomically (temp dir + rename) with a done marker."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / DONE).write_text(json.dumps(info, indent=2))
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def is_done(directory: Path) -> bool:
    return (Path(directory) / DONE).exists()
