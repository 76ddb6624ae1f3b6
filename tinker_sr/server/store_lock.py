"""One server per store: an exclusive lock on ``<store>/server.lock`` for the server's lifetime.

A server's start-up fails every future its store still holds as pending, because those were left
by a dead process (`ServerState.fail_orphans`). A second server started on the store of a live
one would do that to the first server's requests while it is still running them: its clients
would be told "the server restarted, submit it again" for work that is in fact being done, and a
resubmitted ``optim_step`` would then be applied twice. So the store is locked while a server
uses it, and a second server on it is refused with the first one's pid and command line.

The lock is an OS advisory lock (``flock`` on POSIX, ``msvcrt.locking`` on Windows) on an open
file, so it goes with the process: a crashed or SIGKILLed server leaves the file behind but not
the lock, and the next start proceeds (and fails the orphans, as it should). Filesystems that
cannot lock (some network mounts) get a warning and no lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("tinker_sr.server")

LOCK_NAME = "server.lock"

__all__ = ["LOCK_NAME", "StoreInUseError", "StoreLock"]


class StoreInUseError(RuntimeError):
    """Another live server holds this store (see the module docstring)."""

    def __init__(self, store: Path, holder: dict[str, Any]) -> None:
        self.store = store
        self.holder = holder
        who = f"pid {holder['pid']}" if "pid" in holder else "another process"
        if holder.get("argv"):
            who += f": {holder['argv']}"
        since = holder.get("started_at")
        when = (
            f", running since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
            if isinstance(since, (int, float))
            else ""
        )
        super().__init__(
            f"store {store} is in use by another tinker-sr server ({who}{when}). Two servers "
            "on one store would fail each other's requests as left over from a crash. Stop "
            "that server, or give this one its own state directory with --store DIR "
            "(or $TINKER_SR_STORE)"
        )


_SECRET_FLAGS = ("--api-key", "--api-keys")


def redacted(args: list[str]) -> list[str]:
    """A command line with the values of its key flags as ``***`` (the lock file is readable
    by others and outlives the server)."""
    out, hide = [], False
    for a in args:
        flag, eq, _ = a.partition("=")
        if hide:
            out.append("***")
        elif eq and flag in _SECRET_FLAGS:
            out.append(f"{flag}=***")
        else:
            out.append(a)
        hide = not hide and a in _SECRET_FLAGS
    return out


# Windows locks a byte range from the file's position, and a file opened to append stands at
# its end, which moves as the holder is written: each server must lock the same byte. One far
# past the holder's JSON, so a refused server can still read who holds the store.
_WINDOWS_LOCK_BYTE = 2**30


def _try_lock(f: IO[bytes]) -> bool:
    """Lock ``f`` exclusively without waiting; False if another process holds it."""
    if sys.platform == "win32":
        import msvcrt

        f.seek(_WINDOWS_LOCK_BYTE)
        try:
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        holder = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class StoreLock:
    """Hold ``<store>/server.lock`` until `release` (or the process ends)."""

    def __init__(self, store: Path) -> None:
        from tinker_sr.engine.store import StoreUnwritableError, make_store_dir

        make_store_dir(store)
        self.path = store / LOCK_NAME
        try:
            self._file: IO[bytes] | None = open(self.path, "a+b")  # noqa: SIM115 - held open
        except OSError as e:
            raise StoreUnwritableError(store, e) from None
        try:
            locked = _try_lock(self._file)
        except OSError as e:  # e.g. ENOLCK on a network filesystem
            log.warning(
                "cannot lock %s (%s); make sure no other server uses this store", self.path, e
            )
            return
        if not locked:
            self._file.close()
            self._file = None
            raise StoreInUseError(store, _read_holder(self.path))
        holder = {
            "pid": os.getpid(),
            "argv": " ".join([Path(sys.argv[0]).name, *redacted(sys.argv[1:])]) if sys.argv else "",
            "started_at": time.time(),
        }
        self._file.truncate(0)
        self._file.write(json.dumps(holder).encode())
        self._file.flush()

    def release(self) -> None:
        """Drop the lock (closing the file releases it); the file stays for the next server."""
        if self._file is not None:
            if sys.platform == "win32":  # unlocked before it closes, as Windows asks
                import msvcrt

                with contextlib.suppress(OSError):  # never locked: a filesystem without locks
                    self._file.seek(_WINDOWS_LOCK_BYTE)
                    msvcrt.locking(self._file.fileno(), msvcrt.LK_UNLCK, 1)
            self._file.close()
            self._file = None
