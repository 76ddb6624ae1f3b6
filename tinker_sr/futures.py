"""Futures returned by every long-running call.

The clients run backend coroutines on a background event-loop thread and hand back the
resulting ``concurrent.futures.Future`` wrapped here, so one object can be awaited from any
event loop, blocked on from plain code, or passed to ``concurrent.futures.wait``.
"""

from __future__ import annotations

import asyncio
import warnings
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Generator
from concurrent.futures import Future as ConcurrentFuture
from typing import Any, Generic, TypeVar

__all__ = ["APIFuture", "AwaitableConcurrentFuture", "BackcompatConcurrentFuture"]

T = TypeVar("T")


class APIFuture(ABC, Generic[T]):
    """A result that can be awaited (``await fut``) or blocked on (``fut.result()``)."""

    @abstractmethod
    async def result_async(self, timeout: float | None = None) -> T:
        """Await the result; ``TimeoutError`` after ``timeout`` seconds (``None``: no limit)."""
        raise NotImplementedError

    @abstractmethod
    def result(self, timeout: float | None = None) -> T:
        """Block for the result; ``TimeoutError`` after ``timeout`` seconds (``None``: no limit).
        Re-raises the operation's exception."""
        raise NotImplementedError

    @abstractmethod
    def future(self) -> ConcurrentFuture[T]:
        """The underlying ``concurrent.futures.Future`` (for ``wait``, ``as_completed``,
        done callbacks). Cancelling it stops a sampling operation; a training call, once made,
        still runs in its turn (as on a Tinker server: later calls depend on it)."""
        raise NotImplementedError

    async def coroutine(self) -> T:
        """This future as a coroutine, for APIs such as ``asyncio.create_task`` that need one."""
        return await self

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()


async def run_to_the_end(work: Awaitable[T]) -> T:
    """Await ``work``, which the awaiting task's cancellation does not stop: an accepted
    request runs to its end (later requests of its model wait for it) while its caller may
    stop waiting. An abandoned outcome is marked seen (no "never retrieved" warning)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.shield(task)


async def _await_concurrent(future: ConcurrentFuture[T], timeout: float | None) -> T:
    # wrap_future keeps the caller's loop free while another thread finishes the work; on
    # timeout or cancellation it also cancels `future`, i.e. the operation itself.
    async with asyncio.timeout(timeout):
        return await asyncio.wrap_future(future)


class AwaitableConcurrentFuture(APIFuture[T]):
    """An APIFuture over a ``concurrent.futures.Future``.

    The standard future keeps its outcome, so ``result()`` returns the same object (or
    re-raises the same exception) every time.
    """

    def __init__(self, future: ConcurrentFuture[T]) -> None:
        self._future: ConcurrentFuture[T] = future

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        return await _await_concurrent(self._future, timeout)

    def future(self) -> ConcurrentFuture[T]:
        return self._future

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._future._state.lower()}>"


class BackcompatConcurrentFuture(ConcurrentFuture[T], APIFuture[T]):  # type: ignore[misc]
    """What ``SamplingClient.sample`` / ``compute_logprobs`` return.

    Those methods used to return a plain ``concurrent.futures.Future``, so this object still
    is one: its state mirrors the real future's, and the ``Future`` methods keep working but
    emit a ``FutureWarning`` (once per future). ``result()`` and the APIFuture API do not warn.
    """

    def __init__(self, future: ConcurrentFuture[T]) -> None:
        super().__init__()
        self._future: ConcurrentFuture[T] = future
        self._warned = False
        future.add_done_callback(self._mirror)

    def _mirror(self, future: ConcurrentFuture[T]) -> None:
        # Copy the outcome onto ourselves so stdlib machinery that inspects this object
        # directly (wait, as_completed, wrap_future) sees it finish.
        if future.cancelled():
            if ConcurrentFuture.cancel(self):
                self.set_running_or_notify_cancel()
        elif (exc := future.exception()) is not None:
            self.set_exception(exc)
        else:
            self.set_result(future.result())

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        return await _await_concurrent(self._future, timeout)

    def future(self) -> ConcurrentFuture[T]:
        return self._future

    def __await__(self) -> Generator[Any, None, T]:
        return APIFuture.__await__(self)

    def _warn(self, method: str) -> None:
        # Only once: stdlib bridges call done()/exception() from callbacks, where an
        # error-promoted warning would be swallowed and leave their future pending.
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"DEPRECATED: .{method}() on this future uses a temporary compatibility wrapper "
            "for APIFuture. Await the future or call .result(); if you need a "
            "concurrent.futures.Future, call .future().",
            FutureWarning,
            stacklevel=3,
        )

    def cancel(self) -> bool:
        self._warn("cancel")
        return self._future.cancel()

    def cancelled(self) -> bool:
        self._warn("cancelled")
        return self._future.cancelled()

    def running(self) -> bool:
        self._warn("running")
        return self._future.running()

    def done(self) -> bool:
        self._warn("done")
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._warn("exception")
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[ConcurrentFuture[T]], object]) -> None:
        self._warn("add_done_callback")
        super().add_done_callback(fn)
