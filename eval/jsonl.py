"""Append-only JSONL logs (generations, training metrics) that survive a killed writer.

A writer killed mid-line leaves a torn last line. :func:`repair_tail` cuts it before a resumed writer appends,
so a new record never fuses with it; :func:`read_jsonl` skips (with a warning naming the file and line) any
line that still does not parse, instead of dropping everything after it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def repair_tail(path: Path) -> int:
    """Cuts a torn last line (no newline, or not JSON) of ``path``; returns the number of bytes cut."""
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    with path.open("rb") as handle:
        data = handle.read()
    end = len(data)
    if data and not data.endswith(b"\n"):
        end = data.rfind(b"\n") + 1
    else:
        start = data.rfind(b"\n", 0, max(end - 1, 0)) + 1
        try:
            if data[start:end].strip():
                json.loads(data[start:end])
        except ValueError:
            end = start
    if end != size:
        with path.open("r+b") as handle:
            handle.truncate(end)
        log.warning("%s: cut a torn last line (%d bytes) left by an interrupted writer", path, size - end)
    return size - end


def read_jsonl(path: Path) -> list[dict]:
    """Every record of ``path``; lines that do not parse are skipped with a warning naming the line."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                log.warning("%s:%d: skipped a torn or corrupt line (%d bytes)", path, number, len(line))
    return records
