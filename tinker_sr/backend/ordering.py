"""Per-model ``seq_id`` ordering: the one mechanism that makes a model's training requests
run in the order they were called.

Clients number each training call when it is made (from 1 per model) and issue calls in that
order; `LocalBackend` runs every numbered request through `SeqOrdering.run`, which holds it
until all earlier numbers of its model have finished, whatever order requests arrive in.
A number that will never arrive (a request refused on the wire) is skipped with
`SeqOrdering.release`; only the server needs that (`server/ordering.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tinker_sr.backend.base import WorkNotStarted
from tinker_sr.futures import run_to_the_end
from tinker_sr.limits import DEFAULT_LIMITS, Limits
from tinker_sr.user_errors import EngineUserError

T = TypeVar("T")


@dataclass
class _Order:
    next_seq: int = 1
    cond: asyncio.Condition | None = None
    # seq_ids given up by the client (a request refused before it reached us): skip them.
    released: set[int] = field(default_factory=set)

    def condition(self) -> asyncio.Condition:
        if self.cond is None:
            self.cond = asyncio.Condition()
        return self.cond

    def advance_past(self, seq_id: int) -> None:
        self.next_seq = max(self.next_seq, seq_id + 1)
        while self.next_seq in self.released:
            self.released.discard(self.next_seq)
            self.next_seq += 1


class SeqOrdering:
    """The ``seq_id`` order of every live model."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._orders: dict[str, _Order] = {}
        self._limits = limits
        self._stopped = False

    async def stop_starting(self) -> None:
        """From now on a waiting request does not run: it raises `WorkNotStarted` (at once,
        also one waiting for a number that has not arrived); the one running is unaffected."""
        self._stopped = True
        for order in list(self._orders.values()):
            cond = order.condition()
            async with cond:
                cond.notify_all()

    def add(self, model_id: str) -> None:
        self._orders[model_id] = _Order()

    def remove(self, model_id: str) -> None:
        """Forget ``model_id``; requests already waiting still run (and fail) in order."""
        self._orders.pop(model_id, None)

    async def run(self, model_id: str, seq_id: int, fn: Callable[[], Awaitable[T]]) -> T:
        """Await ``fn()`` when every earlier ``seq_id`` of ``model_id`` has finished.
        Raises `EngineUserError` (before ``fn`` runs) for an unknown model or a used number.

        A number handed in is a request accepted: if the caller stops waiting (its task is
        cancelled, e.g. by ``asyncio.wait_for``), the request still waits its turn and runs, as
        on a server; otherwise every later number of the model would wait forever for it."""
        return await run_to_the_end(self._when_due(model_id, seq_id, fn))

    async def _when_due(self, model_id: str, seq_id: int, fn: Callable[[], Awaitable[T]]) -> T:
        order = self._orders.get(model_id)
        if order is None:
            raise EngineUserError(f"unknown model_id {model_id!r}; create a training client first")
        cond = order.condition()
        async with cond:
            if seq_id < order.next_seq:
                raise EngineUserError(
                    f"seq_id {seq_id} for model {model_id} was already executed (next is "
                    f"{order.next_seq}); every training request needs a fresh seq_id"
                )
            # A number far ahead could only wait forever for the ones in between.
            self._limits.check_seq_ahead(model_id, seq_id, order.next_seq)
            await cond.wait_for(lambda: self._stopped or order.next_seq == seq_id)
            if self._stopped:
                raise WorkNotStarted(f"{model_id} seq_id {seq_id}")
        try:
            return await fn()
        finally:
            async with cond:
                order.advance_past(seq_id)
                cond.notify_all()

    async def release(self, model_id: str, seq_id: int) -> None:
        """Give up ``seq_id`` of ``model_id`` without running anything, so later requests do
        not wait for a request that will never arrive (e.g. one refused on the wire)."""
        order = self._orders.get(model_id)
        if order is None:
            return
        cond = order.condition()
        async with cond:
            if seq_id == order.next_seq:
                order.advance_past(seq_id)
                cond.notify_all()
            elif seq_id > order.next_seq:
                order.released.add(seq_id)
