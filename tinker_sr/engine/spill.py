"""Temporary directories for spilled sampler adapters that no crash leaves behind.

A registry spills the adapters of samplers beyond its in-memory budget to files in a temporary
directory, removed when the registry is closed or collected. A process killed (SIGKILL, the
OOM killer, a lost container) runs neither, and its directory (up to sessions x 64 adapters,
about 1 GB a session at rank 64 on `tinker-sr/small`) stayed in the temp dir for good. Each
directory is now locked by its process (`fcntl.flock` on the directory itself, released by the
kernel when the process dies, whatever the pid namespace); the first registry of a process
sweeps the directories of this user whose lock can be taken. Where locks are unavailable
(Windows; a filesystem without flock) directories are made unlocked, and never swept.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import threading

try:
    import fcntl
except ImportError:  # Windows: no sweeping
    fcntl = None  # type: ignore[assignment]

__all__ = ["PREFIX", "SpillDir", "sweep_orphans", "sweep_once"]

PREFIX = "tinker-sr-adapters-"
_MARK = ".locked"  # made once the directory is locked: directories without it are not swept
log = logging.getLogger("tinker_sr.engine")
_swept: set[str] = set()  # temp dirs this process has swept (`sweep_once`)
_swept_lock = threading.Lock()


def _lock(fd: int) -> bool:
    """Take ``fd``'s exclusive lock without waiting; False where it is held or unsupported."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


class SpillDir:
    """A fresh temporary directory, locked by this process until `close` (idempotent; in a
    forked child, which inherits the lock, `close` leaves the directory to its creator)."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix=PREFIX)
        self._pid = os.getpid()
        # (Windows opens no directory: there it stays unlocked.)
        self._fd: int | None = os.open(self.path, os.O_RDONLY) if fcntl is not None else None
        if self._fd is not None and _lock(self._fd):  # the mark after the lock: marked = locked
            try:
                with open(os.path.join(self.path, _MARK), "x"):
                    pass
            except OSError:  # out of inodes, say: no directory left behind, locked or not
                self.close()
                raise
        else:  # no flock here: unlocked and unmarked, as before, and never swept
            log.debug("spill dir %s: no lock (flock unsupported)", self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if os.getpid() == self._pid:
            shutil.rmtree(self.path, ignore_errors=True)


def sweep_once() -> None:
    """`sweep_orphans` in the temp dir, once per process and temp dir (cheap thereafter)."""
    root = tempfile.gettempdir()
    with _swept_lock:
        if root in _swept:
            return
        _swept.add(root)
    sweep_orphans(root)


def sweep_orphans(root: str) -> int:
    """Remove the spill directories under ``root`` of this user whose process is gone (marked
    as locked, and their lock can be taken); returns how many. Unmarked ones (an older
    tinker_sr's, or one made where flock is unsupported) cannot be told from live ones: they
    stay."""
    if fcntl is None:
        return 0
    removed = 0
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue  # a link, a file or another user's: never followed, never removed
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            marked = stat.S_ISREG(os.lstat(os.path.join(path, _MARK)).st_mode)
            if marked and _lock(fd):  # marked, so locked by its maker: who is gone
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        except OSError:  # no mark: an older tinker_sr's, or one not locked
            pass
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d spill directories of processes that ended without cleanup", removed)
    return removed
