"""Temporary directories for spilled sampler adapters that no crash leaves behind.

A registry spills the adapters of samplers beyond its in-memory budget to files in a temporary
directory, removed when the registry is closed or collected. A process killed (SIGKILL, the
OOM killer, a lost container) runs neither, and its directory (up to sessions x 64 adapters,
about 1 GB a session at rank 64 on `tinker-sr/small`) stayed in the temp dir for good. Each
directory now holds a lock file its process keeps locked (`fcntl.flock`, released by the
kernel when the process dies, whatever the pid namespace); a new directory sweeps those whose
lock can be taken. Without `fcntl` (Windows) nothing is swept.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no sweeping
    fcntl = None  # type: ignore[assignment]

__all__ = ["PREFIX", "SpillDir", "sweep_orphans"]

PREFIX = "tinker-sr-adapters-"
_LOCK = ".owner.lock"
_YOUNG_S = 60.0  # a directory this recent is left alone (its lock may not be taken yet)
log = logging.getLogger("tinker_sr.engine")


class SpillDir:
    """A fresh temporary directory, locked by this process until `close` (idempotent)."""

    def __init__(self, root: str | None = None) -> None:
        sweep_orphans(root)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
        self._fd: int | None = None
        if fcntl is not None:
            self._fd = os.open(self.path / _LOCK, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sweep_orphans(root: str | None = None) -> int:
    """Remove the spill directories under ``root`` (default: the temp dir) whose process is
    gone (their lock can be taken); returns how many. Directories without a lock file (an
    older tinker_sr's) or younger than a minute (one being created) are left alone."""
    if fcntl is None:
        return 0
    removed = 0
    now = time.time()
    for d in Path(root or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            if now - d.stat().st_mtime < _YOUNG_S:  # perhaps made but not yet locked
                continue
            fd = os.open(d / _LOCK, os.O_RDWR)
        except OSError:  # no lock file, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process is alive
            os.close(fd)
            continue
        shutil.rmtree(d, ignore_errors=True)
        os.close(fd)
        removed += 1
    if removed:
        log.info("removed %d spill directories of processes that ended without cleanup", removed)
    return removed
