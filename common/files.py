"""Files that survive a killed writer, and data files read with their places named: atomic whole-file writes
(:func:`atomic_write`), append-only JSONL logs (:func:`repair_tail`, :func:`read_jsonl`), and the records of a
JSONL / JSON / parquet data set (:func:`read_records`).

A writer killed mid-line leaves a torn last line. :func:`repair_tail` cuts it before a resumed writer appends,
so a new record never fuses with it; :func:`read_jsonl` skips (with a warning naming the file and line) any
line that still does not parse, instead of dropping everything after it.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

log = logging.getLogger(__name__)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Writes through a temporary file of the same folder, then renames it over ``path``: a reader never sees half a
    file. The file gets the mode an ordinary write would (the umask's), not mkstemp's owner-only one, so the other
    users of a shared cluster read the reports."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "xb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


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


def compressed(path: Path) -> Path:
    """``path``'s gzip beside it (``metrics.jsonl.gz``): how a kept run stores its larger records."""
    return path.with_name(path.name + ".gz")


def write_compressed(path: Path, text: str) -> None:
    """``text`` as ``path``'s gzip (:func:`compressed`), without a timestamp inside: the same text, the same bytes."""
    import gzip

    compressed(Path(path)).write_bytes(gzip.compress(text.encode(), mtime=0))


def read_text(path: Path) -> str:
    """The text of ``path``, or of its gzip where only that exists (a kept run's)."""
    import gzip

    path = Path(path)
    if not path.exists() and compressed(path).exists():
        return gzip.decompress(compressed(path).read_bytes()).decode()
    return path.read_text()


def read_jsonl(path: Path) -> list[dict]:
    """Every record of ``path`` (or of its gzip, :func:`compressed`); lines that do not parse are skipped with a
    warning naming the line."""
    import gzip

    path = Path(path)
    if not path.exists() and compressed(path).exists():
        path = compressed(path)
    if not path.exists():
        return []
    records = []
    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                log.warning("%s:%d: skipped a torn or corrupt line (%d bytes)", path, number, len(line))
    return records


def read_records(path: Path) -> list[tuple[str, dict]]:
    """``(place, record)`` of every record of a JSONL / JSON / parquet file; ``place`` names the file and line
    (JSONL) or record index, for error messages."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(f"{path}: record {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    if suffix == ".json":
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from err
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON ({err})") from err
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records")
        return [(f"{path}: record {i}", r) for i, r in enumerate(data)]
    records = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{number}: not UTF-8 text (byte {err.start} of the line: "
                                 f"{err.reason})") from err
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: invalid JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            records.append((f"{path}:{number}", record))
    return records
