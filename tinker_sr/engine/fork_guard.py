"""No SQLite call is under way when the process forks.

SQLite keeps process-wide state (its mutexes, and which of this process's connections holds
which lock on a file) that a fork copies as it is at that instant. A child forked while
another thread was inside SQLite (the embedded engine recording a sequence, say) inherits a
mutex nobody will release, or locks nobody holds: its own new connection to the same store
then hung in ``sqlite3.connect`` or failed with "database is locked" (concurrency hunt: 12 of
40 forks, a reward pool made with multiprocessing's default 'fork' while the engine ran).

Every object that talks to SQLite under one lock registers it here (`guard`); before a fork
the forking thread takes each such lock, so it waits for calls under way to end and none
starts, and both processes release them after. Each lock must be held for every SQLite call
of its owner, and never while waiting on a lock a forking thread may hold.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

_guarded: weakref.WeakSet[Any] = weakref.WeakSet()  # the locks (RLock or Lock)
_held: list[Any] = []
_registry_lock = threading.Lock()


def guard(lock: Any) -> None:
    """Hold ``lock`` across every fork of this process (it must support weak references, as
    `threading.Lock` and `threading.RLock` do)."""
    with _registry_lock:
        _guarded.add(lock)


def _before_fork() -> None:
    _registry_lock.acquire()
    for lock in list(_guarded):
        _held.append(lock)  # before: a signal raising between the two must not leave it held
        lock.acquire()


def _after_fork() -> None:
    while _held:
        with contextlib.suppress(RuntimeError):  # not acquired (a signal interrupted it)
            _held.pop().release()
    _registry_lock.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)
