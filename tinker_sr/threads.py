"""Starting the package's own threads where the operating system may refuse one.

A process that has reached its limit on threads (``ulimit -u``, a container's pids limit) or
has no memory left for another thread's stack gets ``RuntimeError: can't start new thread``
from `threading.Thread.start`. Raised from deep inside a client's constructor, that said
neither which thread nor what to do. `start_thread` raises `ThreadLimitError` instead (still
a RuntimeError), naming the thread, how many this process runs and the way out.
Torch-free (it reads the pids limit through the torch-free `tinker_sr.engine.cgroups`), so
every layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = [
    "ThreadLimitError",
    "is_thread_refusal",
    "start_thread",
    "starting",
    "thread_limit_text",
]


def is_thread_refusal(e: BaseException) -> bool:
    """Whether ``e`` is the OS refusing a new thread (Python's ``can't start new thread``)."""
    return isinstance(e, RuntimeError) and "can't start new thread" in str(e)


def thread_limit_text() -> str:
    """Why a thread could not start and the fix, for a message (this process's thread count
    and its limit where the OS reports one)."""
    from tinker_sr.engine.cgroups import pids_limit  # torch-free (docs/architecture.md)

    limits, raise_them = [], ["a container's --pids-limit"]
    if hasattr(os, "geteuid") and os.geteuid() != 0:  # root is not held to RLIMIT_NPROC
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
            if soft != resource.RLIM_INFINITY:
                limits.append(f"ulimit -u {soft}")
                raise_them.insert(0, "ulimit -u")
        except (ImportError, AttributeError, OSError, ValueError):
            pass
    if (pids := pids_limit()) is not None:
        limits.append(f"its cgroup's pids.max {pids[1]}, {pids[0]} in use")
    named = f" ({'; '.join(limits)})" if limits else ""
    return (
        f"this process could not start a thread (it runs {_thread_count()} threads): its "
        f"limit on processes and threads{named} or the memory for a thread's stack is "
        "reached. Retry once other work has ended, close clients and processes you no longer "
        f"use, or raise the limit ({'; '.join(raise_them)})"
    )


def _thread_count() -> int:
    """This process's threads, torch's and OpenMP's too where /proc says (else Python's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class ThreadLimitError(RuntimeError):
    """The operating system refused to start one of tinker_sr's threads."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"cannot start {what}: {thread_limit_text()}")


@contextlib.contextmanager
def starting(what: str) -> Iterator[None]:
    """Within: the OS refusing a new thread (``RuntimeError: can't start new thread``, from
    `threading.Thread.start` or an executor's submit) raises `ThreadLimitError` naming
    ``what`` (e.g. "the embedded engine's sampling thread")."""
    try:
        yield
    except RuntimeError as e:
        if not is_thread_refusal(e):
            raise
        raise ThreadLimitError(what) from e


def start_thread(thread: threading.Thread, what: str) -> None:
    """``thread.start()``, within `starting` (``what``)."""
    with starting(what):
        thread.start()
