"""Stage outputs without a shared filesystem.

A recipe's ``storage`` location (a local folder, or any ``pyarrow.fs`` URI such as ``s3://bucket/runs``)
receives the models a stage hands on: the initial model, each stage's final model. A model is then passed
between stages, and to rollout engines and evaluation workers, as its stored URI; whichever node needs it
materialises it into its own cache (``$SSE_PIPELINE_CACHE/storage``, default ``~/.cache/sse-pipeline``) once.
An upload writes a marker last (every file and its size), so a reader never takes a partial copy, and a
download is checked against it before it is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)
MARKER = "_stored.json"
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_stored(location: str | Path) -> bool:
    """Whether ``location`` is a storage URI (``file://``, ``s3://``, ...) rather than a local path."""
    return bool(_SCHEME.match(str(location)))


def storage_uri(storage: str, *parts: str) -> str:
    """The URI of ``parts`` under a recipe's storage location (a plain folder becomes a ``file://`` URI)."""
    base = storage if is_stored(storage) else Path(storage).expanduser().resolve().as_uri()
    return "/".join([base.rstrip("/"), *parts])


def _filesystem(uri: str):
    from pyarrow import fs

    try:
        return fs.FileSystem.from_uri(uri)
    except Exception as error:  # pyarrow raises ArrowInvalid / ArrowNotImplementedError / OSError
        raise ValueError(f"storage: cannot open {uri!r} ({error}); give a local folder or a pyarrow.fs URI "
                         "such as s3://bucket/path") from error


def upload(local: Path, uri: str) -> str:
    """Copies the directory ``local`` to ``uri`` (replacing what was there) and returns ``uri``."""
    from pyarrow import fs as pafs

    local = Path(local)
    files = {p.relative_to(local).as_posix(): p.stat().st_size
             for p in sorted(local.rglob("*")) if p.is_file() and p.name != MARKER}
    fs, path = _filesystem(uri)
    if _stored_files(fs, path) == files:  # already there (a re-run of a finished stage)
        return uri
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)  # the marker goes first: no reader trusts a copy being replaced
    fs.create_dir(path, recursive=True)
    pafs.copy_files(str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    if (local / MARKER).exists():
        fs.delete_file(f"{path}/{MARKER}")  # a materialised copy's own marker: rewritten below
    with fs.open_output_stream(f"{path}/{MARKER}") as out:
        out.write(json.dumps(files, indent=1).encode())
    logger.info("stored %s as %s", local, uri)
    return uri


def _stored_files(fs, path: str) -> dict | None:
    """The marker of a complete stored copy at ``path``, or None."""
    try:
        with fs.open_input_stream(f"{path}/{MARKER}") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def cache_root() -> Path:
    return Path(os.environ.get("SSE_PIPELINE_CACHE") or Path.home() / ".cache" / "sse-pipeline") / "storage"


def materialize(location: str | Path) -> Path:
    """A local directory holding ``location``: the path itself when it is local, else this node's cached copy
    of the stored directory, fetched when missing or different from the stored one."""
    if not is_stored(location):
        return Path(location)
    from pyarrow import fs as pafs

    uri = str(location)
    fs, path = _filesystem(uri)
    files = _stored_files(fs, path)
    if files is None:
        raise FileNotFoundError(f"{uri}: no complete stored copy there (its {MARKER} is missing)")
    local = cache_root() / hashlib.sha1(uri.encode()).hexdigest()[:16]
    if (local / MARKER).exists() and json.loads((local / MARKER).read_text()) == files:
        return local
    tmp = local.with_name(f"{local.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pafs.copy_files(path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    for name, size in files.items():
        if not (tmp / name).is_file() or (tmp / name).stat().st_size != size:
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(f"{uri}: {name} did not arrive whole; the stored copy changed while it was read?")
    shutil.rmtree(local, ignore_errors=True)
    os.replace(tmp, local)
    logger.info("fetched %s into %s", uri, local)
    return local
