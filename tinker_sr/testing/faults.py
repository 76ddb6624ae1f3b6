"""Fault injection for tests: wrap any `Backend` and make chosen calls fail or stall.

    backend = FaultyBackend(LocalBackend(tmp), [Fault("sample", error=request_failed())])
    backend.add_fault(Fault("forward_backward", delay_s=5))  # or later, while the test runs
    client = tinker.ServiceClient(backend=backend)

Faults match by backend method name, let the first ``after`` matching calls made since they
were planned through, and fire on the next ``times`` (``None``: forever). ``delay_s`` stalls
the call first (to test timeouts). Everything else is delegated unchanged, so RL code under test sees real results.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tinker_sr.errors import RequestFailedError
from tinker_sr.types import RequestErrorCategory


def request_failed(message: str = "injected failure", *, user: bool = False) -> RequestFailedError:
    """The error a Tinker service reports for a failed request."""
    return RequestFailedError(
        f"Request failed: {message}",
        request_id=f"fault-{uuid.uuid4().hex[:8]}",
        category=RequestErrorCategory.User if user else RequestErrorCategory.Server,
    )


F = TypeVar("F")


@dataclass
class Fault:
    method: str
    error: BaseException | None = None
    after: int = 0
    times: int | None = 1
    delay_s: float = 0.0
    fired: int = 0
    seen: int = 0  # matching calls since it was planned (`after` counts these, as WireFault's)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise TypeError(f"Fault.method must be a Backend method name, got {self.method!r}")
        if self.error is not None and not isinstance(self.error, BaseException):
            raise TypeError(
                "Fault.error must be an exception to raise, e.g. request_failed('...'), got "
                f"{self.error!r}"
            )
        check_count("Fault.after", self.after, 0)
        if self.times is not None:
            check_count("Fault.times", self.times, 1)
        check_seconds("Fault.delay_s", self.delay_s, allow_zero=True)


# Field checks shared by `Fault` and `testing.wire.WireFault` (``field``: "Fault.after", ...).
def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(field: str, value: object, low: int, extra: str = "") -> None:
    if not is_int(value) or value < low:  # type: ignore[operator]
        more = f" ({extra})" if extra else ""
        raise ValueError(f"{field} must be an integer >= {low}{more}, got {value!r}")


def check_seconds(field: str, value: object, *, allow_zero: bool) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):  # type: ignore[operator]
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{field} must be a number of seconds {bound}, got {value!r}")


class FaultTable(Generic[F]):
    """Faults to inject and per-name call counters, thread-safe: the common part of
    `FaultyBackend` (faults per Backend method) and `testing.wire.FaultPlan` (per endpoint)."""

    def __init__(self, faults: Sequence[F] = ()) -> None:
        self.faults: list[F] = []
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        for fault in faults:
            self.add(fault)

    fault_types: tuple[type, ...] = ()  # what `add` takes (set by each table)

    def add(self, fault: F) -> F:
        if self.fault_types and not isinstance(fault, self.fault_types):
            names = " or ".join(t.__name__ for t in self.fault_types)
            raise TypeError(
                f"add_fault takes a {names} (e.g. rate_limited('asample'), http_error(...), "
                f"or Fault('sample', error=...)), got {fault!r}"
            )
        with self._lock:
            self.faults.append(fault)
        return fault

    def add_fault(self, fault: F) -> F:
        """`add`, by the name the `tinker_mock` / `tinker_server` fixtures use."""
        return self.add(fault)

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def _first_due(self, matching: Iterable[Any]) -> Any:
        """Count a call against each of the ``matching`` faults (the caller holds the lock);
        the first of them due fires and is returned (None: none is)."""
        due = None
        for f in matching:
            f.seen += 1
            if due is None and f.seen > f.after and (f.times is None or f.fired < f.times):
                f.fired += 1
                due = f
        return due


class FaultyBackend(FaultTable[Fault]):
    """A `Backend` that delegates to ``inner`` except where a `Fault` fires."""

    fault_types = (Fault,)

    def __init__(self, inner: Any, faults: Sequence[Fault] = ()) -> None:
        super().__init__()
        self.inner = inner
        for f in faults:
            self.add(f)

    def add(self, fault: Fault) -> Fault:
        """Plan ``fault``; its ``method`` must be one the backend has (else it never fires)."""
        if not isinstance(fault, Fault):
            return super().add(fault)  # (refused there, naming what it takes)
        if not asyncio.iscoroutinefunction(getattr(self.inner, fault.method, None)):
            methods = sorted(
                n
                for n in dir(self.inner)
                if not n.startswith("_") and asyncio.iscoroutinefunction(getattr(self.inner, n))
            )
            raise ValueError(
                f"Fault.method {fault.method!r} is not a method of {type(self.inner).__name__}, "
                f"so the fault could never fire; use one of {', '.join(methods)}"
            )
        return super().add(fault)

    def _due(self, method: str) -> Fault | None:
        """The first fault due on this call of ``method`` (each matching fault counts it)."""
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
            due: Fault | None = self._first_due(f for f in self.faults if f.method == method)
        return due

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not asyncio.iscoroutinefunction(target):
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            fault = self._due(name)
            if fault is not None:
                if fault.delay_s:
                    await asyncio.sleep(fault.delay_s)
                if fault.error is not None:
                    await self._release_number(target, args, kwargs)
                    raise fault.error
            return await target(*args, **kwargs)

        return call

    async def _release_number(self, target: Any, args: Any, kwargs: Any) -> None:
        """A training call that fails here never reaches ``inner``, which runs a model's calls
        in ``seq_id`` order: give its number up, as a server does for a request it refuses,
        or every later call of the model waits for it forever."""
        try:
            bound = inspect.signature(target).bind(*args, **kwargs)
        except TypeError:
            return
        model_id, seq_id = bound.arguments.get("model_id"), bound.arguments.get("seq_id")
        if isinstance(model_id, str) and isinstance(seq_id, int):
            with contextlib.suppress(Exception):
                await self.inner.release_seq(model_id, seq_id)
