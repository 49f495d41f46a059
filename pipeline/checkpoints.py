"""Checkpoints that survive being killed: verified resume points and atomic final models."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import zipfile
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerCallback

from .storage import fetch_latest_checkpoint, inventory, sha256_file, store_checkpoint

DONE = "stage_done.json"
COMPLETE = "checkpoint_complete.json"
log = logging.getLogger(__name__)


class CheckpointMarker(TrainerCallback):
    """Writes ``checkpoint_complete.json`` (every file, its size and SHA-256) into a checkpoint once every data-parallel
    worker has finished saving it: a resume trusts only checkpoints whose files are all there with those contents
    (a file damaged in place, same size, resumed silently when only sizes were kept). With
    ``store`` (a storage URI, :mod:`pipeline.storage`) the finished checkpoint is also stored there, the newest
    ``args.save_total_limit`` kept. Given to every worker: each writes files of its own (its RNG state, FSDP's
    shards), which the first worker collects (:func:`collect_worker_files`) before it marks the checkpoint."""

    def __init__(self, store: str | None = None):
        self.store = store

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        collect_worker_files(folder)
        if not state.is_world_process_zero:
            return
        if folder.is_dir():
            files = {name: entry for name, entry in inventory(folder).items() if not name.endswith(COMPLETE)}
            tmp = folder / f".{COMPLETE}.tmp"
            tmp.write_text(json.dumps(files, indent=1))
            os.replace(tmp, folder / COMPLETE)
            if self.store is not None:
                store_checkpoint(folder, self.store, args.save_total_limit)


def collect_worker_files(folder: Path) -> None:
    """Every worker's files of a checkpoint into the first worker's ``folder`` (a collective of the default process
    group; nothing outside data-parallel training): workers sharing a filesystem already write into one folder, so
    only what the first worker lacks travels (on other nodes, each worker's RNG state and shards). Returns once every
    worker has saved: the first worker marks nothing another is still writing."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    folder = Path(folder)
    dist.barrier()  # every worker has saved: on a shared filesystem the first one's listing is then whole
    mine = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()} \
        if folder.is_dir() else {}
    listings = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, listings, dst=0)
    wanted = [None]
    if dist.get_rank() == 0:
        wanted = [[[name for name in listing if name not in mine] for listing in listings]]
    dist.broadcast_object_list(wanted, src=0)
    sent = {name: (folder / name).read_bytes() for name in wanted[0][dist.get_rank()]}
    received = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sent, received, dst=0)
    for files in received or ():
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)


def broken_file(folder: Path) -> str | None:
    """The first file of a checkpoint that is missing, cut short or changed, or None if it is whole."""
    marker = folder / COMPLETE
    for name in ("trainer_state.json", "config.json", COMPLETE):  # a JSON file that does not parse fails every resume
        if (folder / name).exists():
            try:
                json.loads((folder / name).read_text())
            except (ValueError, UnicodeDecodeError):
                return f"{folder / name} (not JSON)"
    if marker.exists():
        for name, entry in json.loads(marker.read_text()).items():
            size, digest = entry if isinstance(entry, list) else (entry, None)  # markers of older runs: sizes only
            path = folder / name
            if not path.exists() or path.stat().st_size != size:
                return f"{path} ({'missing' if not path.exists() else f'{path.stat().st_size} of {size} bytes'})"
            if digest is not None and sha256_file(path) != digest:
                return f"{path} (its contents changed since it was saved)"
        return None
    if not (folder / "trainer_state.json").exists():  # written last by transformers' Trainer
        return f"{folder / 'trainer_state.json'} (missing)"
    for path in sorted(folder.glob("*.safetensors")):  # header length, JSON header, then the data it describes
        try:
            with path.open("rb") as handle:
                header = struct.unpack("<Q", handle.read(8))[0]
                meta = json.loads(handle.read(header))
            end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
            if path.stat().st_size < 8 + header + end:
                return f"{path} (cut short)"
        except (OSError, ValueError, struct.error, KeyError):
            return f"{path} (unreadable)"
    for path in sorted(list(folder.glob("*.pt")) + list(folder.glob("*.pth")) + list(folder.glob("*.bin"))):
        try:  # torch.save writes a zip whose directory sits at the end
            zipfile.ZipFile(path).close()
        except (OSError, zipfile.BadZipFile):
            return f"{path} (cut short)"
    return None


def latest_complete_checkpoint(directory: Path, set_aside: bool = True) -> Path | None:
    """The newest ``checkpoint-N`` whose files are whole. A broken one (the run was killed while saving, or a
    file was truncated later) is moved aside as ``incomplete-checkpoint-N`` with a warning naming the bad file
    (``set_aside``; else only skipped: data-parallel workers of one node read one folder, and the first moves it),
    and the one before it is used."""
    directory = Path(directory)
    if not directory.exists():
        return None
    found = sorted(((int(c.name.split("-")[-1]), c) for c in directory.glob("checkpoint-*")
                    if c.is_dir() and c.name.split("-")[-1].isdigit()), reverse=True)
    for _, folder in found:
        try:
            bad = broken_file(folder)
        except OSError as error:  # moved aside by another worker while read
            bad = str(error)
        if bad is None:
            return folder
        if not set_aside:
            continue
        aside = folder.with_name(f"incomplete-{folder.name}")
        shutil.rmtree(aside, ignore_errors=True)
        folder.rename(aside)
        log.warning("checkpoint %s is incomplete: %s; moved to %s, resuming from the one before", folder, bad, aside)
    return None


def resume_point(store: str | None, out_dir: Path) -> Path | None:
    """A training stage's checkpoint to resume from: the newest complete one in ``out_dir/checkpoints``, fetched
    first from ``store`` (where the stage stores its checkpoints, None without storage) when this node has none as
    new."""
    from .distributed import is_main_process

    if store is not None:
        fetch_latest_checkpoint(store, Path(out_dir) / "checkpoints")
    return latest_complete_checkpoint(Path(out_dir) / "checkpoints", set_aside=is_main_process())


def write_error(error: BaseException, folder: Path) -> OSError:
    """A failed save in words that help: torch's writer says "file write failed" (or an ``inline_container`` error),
    not where nor why; this names the folder and the room left there."""
    folder = Path(folder)
    where = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(where).free
    return OSError(f"could not write the model to {folder} ({free / 2**30:.2f} GiB free there"
                   f"{'; no space left' if free < 2**30 else ''}): {error}")


def is_write_error(error: BaseException) -> bool:
    """Whether a training step failed writing a checkpoint (torch's and the OS's words for it)."""
    text = str(error)
    return isinstance(error, OSError) and error.errno in (28, 122) or any(
        word in text for word in ("file write failed", "PytorchStreamWriter", "No space left", "unexpected pos"))


@contextmanager
def writing(folder: Path):
    """Saves inside name ``folder`` and the room left there when they fail for want of it (torch's writer says
    only "file write failed"); other errors pass unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        if is_write_error(error):
            raise write_error(error, folder) from error
        raise


def save_final(model, tokenizer, directory: Path, info: dict, state_dict: dict | None = None) -> Path:
    """Writes the stage's final model to ``directory`` atomically (temp dir + rename) with a done marker;
    ``state_dict``: its weights where the model holds only a shard of them (FSDP, gathered by the trainer)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(tmp):
            model.save_pretrained(tmp, **({} if state_dict is None else {"state_dict": state_dict}))
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            (tmp / DONE).write_text(json.dumps(info, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def is_done(directory: Path) -> bool:
    return (Path(directory) / DONE).exists()
