"""Stage outputs without a shared filesystem.

A recipe's ``storage`` location (a local folder, or any ``pyarrow.fs`` URI such as ``s3://bucket/runs``)
receives the models a stage hands on (the initial model, each stage's final model) and the training stages'
checkpoints, which a re-run on another node fetches to resume from. A model is then passed
between stages, and to rollout engines and evaluation workers, as its stored URI; whichever node needs it
materialises it into its own cache (``$SSE_PIPELINE_CACHE/storage``, default ``~/.cache/sse-pipeline``) once.
An upload writes a marker last (every file with its size and SHA-256), so a reader never takes a partial copy, a
download is checked against it before it is renamed into place, and a folder of the same file names and sizes but
other contents (other weights of one architecture) is never taken for the stored one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def inventory(local: Path) -> dict[str, list]:
    """Every file of the directory ``local`` (its marker aside): relative name -> ``[size, sha256]``."""
    local = Path(local)
    return {p.relative_to(local).as_posix(): [p.stat().st_size, sha256_file(p)]
            for p in sorted(local.rglob("*")) if p.is_file() and p.name != MARKER}


def check_writable(storage: str) -> None:
    """Refuses a storage location that cannot be opened or written (before a run that would store its models
    there starts), naming it: writes and deletes a small probe file."""
    uri = storage_uri(storage, f".probe-{os.getpid()}-{time.time_ns()}")
    fs, path = _filesystem(uri)
    try:
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as out:
            out.write(b"ok")
        fs.delete_file(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"storage: cannot write to {storage!r} ({error})") from error


def upload(local: Path, uri: str) -> str:
    """Copies the directory ``local`` to ``uri`` (replacing what was there unless it holds the same contents) and
    returns ``uri``."""
    from pyarrow import fs as pafs

    local = Path(local)
    files = inventory(local)
    fs, path = _filesystem(uri)
    if (_marker(fs, path) or {}).get("files") == files:  # already there (a re-run of a finished stage)
        return uri
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)  # the marker goes first: no reader trusts a copy being replaced
    fs.create_dir(path, recursive=True)
    pafs.copy_files(str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    if (local / MARKER).exists():
        fs.delete_file(f"{path}/{MARKER}")  # a materialised copy's own marker: rewritten below
    with fs.open_output_stream(f"{path}/{MARKER}") as out:  # "stored": which upload this is (an identity)
        out.write(json.dumps({"files": files, "stored": time.time_ns()}, indent=1).encode())
    logger.info("stored %s as %s", local, uri)
    return uri


def _marker(fs, path: str) -> dict | None:
    """The marker of a complete stored copy at ``path`` (``files``: name -> ``[size, sha256]``, ``stored``: when),
    or None."""
    try:
        with fs.open_input_stream(f"{path}/{MARKER}") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def _complete(uri: str):
    """``(fs, path, marker)`` of the complete stored copy at ``uri``; refused when its marker is missing."""
    fs, path = _filesystem(uri)
    marker = _marker(fs, path)
    if marker is None:
        raise FileNotFoundError(f"{uri}: no complete stored copy there (its {MARKER} is missing)")
    return fs, path, marker


def identity(uri: str) -> str:
    """What a stored model is, the same on every node: its URI and which upload put it there."""
    return f"{uri} [stored {_complete(uri)[2]['stored']}]"


def cache_home() -> Path:
    """The project's local cache: ``$SSE_PIPELINE_CACHE``, default ``~/.cache/sse-pipeline``."""
    return Path(os.environ.get("SSE_PIPELINE_CACHE") or Path.home() / ".cache" / "sse-pipeline")


def cache_root() -> Path:
    return cache_home() / "storage"


def materialize(location: str | Path) -> Path:
    """A local directory holding ``location``: the path itself when it is local, else this node's cached copy
    of the stored directory, fetched when missing or different from the stored one."""
    if not is_stored(location):
        return Path(location)
    uri = str(location)
    marker = _complete(uri)[2]
    local = cache_root() / hashlib.sha1(uri.encode()).hexdigest()[:16]
    local.parent.mkdir(parents=True, exist_ok=True)
    # the processes of one node (data-parallel workers, engines) share its cache: one fetches, the others wait for
    # it and take its copy, and none replaces a copy another is reading
    with open(local.with_name(local.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (local / MARKER).exists() and json.loads((local / MARKER).read_text()) == marker:
            return local
        tmp = local.with_name(f"{local.name}.partial-{os.getpid()}")
        _download(uri, tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        shutil.rmtree(local, ignore_errors=True)
        os.replace(tmp, local)
    logger.info("fetched %s into %s", uri, local)
    return local


def _download(uri: str, tmp: Path) -> None:
    """The complete stored copy at ``uri`` into the fresh folder ``tmp`` (its marker left out), checked."""
    from pyarrow import fs as pafs

    fs, path, marker = _complete(uri)
    files = marker["files"]
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pafs.copy_files(path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    (tmp / MARKER).unlink(missing_ok=True)
    for name, entry in files.items():
        size, digest = entry if isinstance(entry, list) else (entry, None)  # markers of older uploads: sizes only
        got = tmp / name
        if not got.is_file() or got.stat().st_size != size or (digest is not None and sha256_file(got) != digest):
            what = "is missing" if not got.exists() else "does not match the size and SHA-256 its marker records"
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(f"{uri}: {name} {what}: the stored copy is damaged (or was replaced while it was read); "
                          f"store it again, e.g. --redo the stage that wrote it")


def _stored_checkpoints(uri: str) -> list[tuple[int, str]]:
    """``(step, uri)`` of the complete ``checkpoint-N`` copies under ``uri``, newest first."""
    from pyarrow import fs as pafs

    fs, path = _filesystem(uri)
    found = []
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        step = info.base_name.removeprefix("checkpoint-")
        if info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint-") and step.isdigit():
            if _marker(fs, info.path) is not None:
                found.append((int(step), f"{uri.rstrip('/')}/{info.base_name}"))
    return sorted(found, reverse=True)


def store_checkpoint(folder: Path, uri: str, keep: int | None = None) -> None:
    """Stores a finished ``checkpoint-N`` folder under ``uri``, keeping the newest ``keep`` stored ones."""
    upload(folder, f"{uri.rstrip('/')}/{Path(folder).name}")
    if keep is not None:
        for _, old in _stored_checkpoints(uri)[keep:]:
            fs, path = _filesystem(old)
            fs.delete_file(f"{path}/{MARKER}")  # first: a reader never takes a half-deleted copy
            fs.delete_dir(path)


def fetch_latest_checkpoint(uri: str, local_dir: Path) -> Path | None:
    """Puts the newest stored checkpoint under ``uri`` into ``local_dir`` unless a local one is as new (a re-run
    on a node that did not write them); returns the fetched folder, or None."""
    stored = _stored_checkpoints(uri)
    if not stored:
        return None
    step, source = stored[0]
    local_dir = Path(local_dir)
    have = [int(c.name.split("-")[-1]) for c in local_dir.glob("checkpoint-*") if c.name.split("-")[-1].isdigit()]
    if have and max(have) >= step:
        return None
    target = local_dir / f"checkpoint-{step}"
    tmp = local_dir / f".fetching-checkpoint-{step}-{os.getpid()}"  # data-parallel workers of one node race
    _download(source, tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another worker of this node put it there first
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("fetched checkpoint-%d from %s", step, uri)
    return target


def set_aside(uri: str, suffix: str) -> None:
    """Moves what is stored at ``uri`` to ``uri + suffix`` (a stage run again keeps nothing of the old run in
    its place); a store that cannot move folders deletes it instead, with a warning."""
    from pyarrow import fs as pafs

    fs, path = _filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return
    try:
        fs.move(path, path + suffix)
    except (NotImplementedError, OSError) as error:
        logger.warning("storage: cannot move %s aside (%s); deleting it", uri, error)
        fs.delete_dir(path)


def put_files(paths: list[Path], uri: str) -> None:
    """Copies single files into the folder ``uri`` (replacing files of the same names)."""
    from pyarrow import fs as pafs

    fs, path = _filesystem(uri)
    fs.create_dir(path, recursive=True)
    for p in paths:
        pafs.copy_files(str(p), f"{path}/{Path(p).name}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)


def get_files(uri: str, local_dir: Path, pattern: str = "*") -> list[Path]:
    """Copies the files of the folder ``uri`` whose names match ``pattern`` into ``local_dir``."""
    from fnmatch import fnmatch

    from pyarrow import fs as pafs

    fs, path = _filesystem(uri)
    local_dir = Path(local_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    got = []
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if info.type == pafs.FileType.File and fnmatch(info.base_name, pattern):
            tmp = local_dir / f".{info.base_name}.fetching-{os.getpid()}"
            pafs.copy_files(info.path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
            os.replace(tmp, local_dir / info.base_name)
            got.append(local_dir / info.base_name)
    return got
