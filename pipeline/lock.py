"""One run per output folder: a lock file naming the holder, taken atomically, released on exit.

A second run on the same folder would interleave metrics and duplicate generations, so it fails at once and
names the first one (PID, host, start time). A lock left by a run that was killed (its PID is gone on this
host) is taken over with a warning; a lock from another host is only cleared by hand, since its holder
cannot be checked from here.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)
LOCK_NAME = ".run.lock"


class RunLockedError(RuntimeError):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_NAME
        self.held = False

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    holder = {}
                holder = holder if isinstance(holder, dict) else {}  # a file holding [] or a number names no run
                pid, host = holder.get("pid"), holder.get("host")
                if pid is None:
                    raise RunLockedError(
                        f"{self.path} exists but names no run (empty or unreadable: a run died while taking it, or "
                        f"one is taking it right now); if no run uses {self.path.parent}, remove {self.path}") from None
                if host == me["host"] and isinstance(pid, int) and not _alive(pid):
                    log.warning("%s: taking over the lock of run %s, which no longer exists", self.path.parent, pid)
                    self.path.unlink(missing_ok=True)
                    continue
                raise RunLockedError(
                    f"{self.path.parent} is in use by another run (pid {pid} on {host}, started "
                    f"{holder.get('started', '?')}); wait for it, use another output_dir, or if that run is gone "
                    f"remove {self.path}") from None
            with os.fdopen(fd, "w") as handle:
                json.dump(me, handle)
            self.held = True
            return self
        raise RunLockedError(f"{self.path}: could not take the lock")

    def __exit__(self, *exc) -> None:
        if self.held:
            self.held = False
            try:
                self.path.unlink(missing_ok=True)
            except OSError as error:  # never in place of the error that ends the run (a folder made read-only)
                log.warning("could not remove the run lock %s (%s); remove it by hand before the next run",
                            self.path, error)
