"""`StoreLock` on Windows, where ``msvcrt.locking`` locks a byte range from the file's
position: played here with a stand-in ``msvcrt`` that keeps byte-range locks as Windows does
(per file and offset, refused to any other open file)."""

from __future__ import annotations

import errno
import os
import sys
import types
from pathlib import Path

import pytest

from tinker_sr.server import store_lock
from tinker_sr.server.store_lock import StoreInUseError, StoreLock


def _windows_msvcrt() -> types.ModuleType:
    held: dict[tuple[int, int], int] = {}  # (inode, offset) -> the descriptor that locked it

    def locking(fd: int, mode: int, nbytes: int) -> None:
        assert nbytes == 1
        key = (os.fstat(fd).st_ino, os.lseek(fd, 0, os.SEEK_CUR))
        if mode == module.LK_UNLCK:
            if held.get(key) != fd:
                raise OSError(errno.EACCES, "not locked")
            del held[key]
        elif held.setdefault(key, fd) != fd:
            raise OSError(errno.EACCES, "Permission denied")

    module = types.ModuleType("msvcrt")
    module.LK_NBLCK, module.LK_UNLCK = 2, 0  # type: ignore[attr-defined]
    module.locking = locking  # type: ignore[attr-defined]
    return module


def test_on_windows_every_server_locks_the_same_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, each server locked the byte at its file's end, which the first server's
    holder line had moved: a second server on a live store was let in."""
    monkeypatch.setitem(sys.modules, "msvcrt", _windows_msvcrt())
    monkeypatch.setattr(store_lock, "sys", types.SimpleNamespace(platform="win32", argv=["x"]))
    first = StoreLock(tmp_path)
    with pytest.raises(StoreInUseError, match=f"pid {os.getpid()}"):
        StoreLock(tmp_path)  # and who holds it is still readable
    first.release()
    StoreLock(tmp_path).release()  # released: the next server starts
