"""A model's training requests leave the client in ``seq_id`` order.

A Tinker server runs a model's training requests in ``seq_id`` order, and when a number is
missing while later ones wait, it gives the number up after a grace period (a request refused
or lost on the way would otherwise hold the model forever). So a client must not let a later
request overtake an earlier one on the wire: a large ``forward_backward`` still uploading when
the small ``optim_step`` after it arrives would be given up, the ``optim_step`` would run with
no gradients, and the ``forward_backward`` would be refused when it lands. The official SDK
submits a model's requests one after another (each once the one before it was accepted or
refused, where the service's ``parallel_fwdbwd_chunks`` is false, as ours is); `SubmitOrder`
does the same for `RemoteBackend`. Only the submissions wait: the answers are awaited
concurrently, so pipelining (``forward_backward`` then ``optim_step``, both in flight) is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["SubmitOrder"]


class SubmitOrder:
    """Per model, the submissions still to be made, by ``seq_id``.

    ``async with order.turn(model_id, seq_id): <submit>`` waits until every request of the
    model with a lower number that entered its turn earlier has been submitted (or failed to
    be). The place is taken when ``turn`` is called, so call it first thing in the request's
    coroutine: clients start their requests' coroutines in ``seq_id`` order, and a number that
    never reaches the backend (refused in the client) holds nothing up."""

    def __init__(self) -> None:
        self._unsent: dict[str, dict[int, asyncio.Event]] = {}

    def turn(self, model_id: str, seq_id: int) -> contextlib.AbstractAsyncContextManager[None]:
        unsent = self._unsent.setdefault(model_id, {})
        earlier = [sent for seq, sent in unsent.items() if seq < seq_id]
        mine = asyncio.Event()
        unsent[seq_id] = mine
        return self._in_turn(model_id, seq_id, earlier, mine)

    def waiting(self, model_id: str) -> int:
        """Requests of ``model_id`` in their turn and not yet submitted (for tests)."""
        return len(self._unsent.get(model_id, {}))

    @contextlib.asynccontextmanager
    async def _in_turn(
        self, model_id: str, seq_id: int, earlier: list[asyncio.Event], mine: asyncio.Event
    ) -> AsyncIterator[None]:
        try:
            for sent in earlier:
                await sent.wait()
            yield
        finally:
            mine.set()
            unsent = self._unsent.get(model_id, {})
            if unsent.get(seq_id) is mine:
                del unsent[seq_id]
            if not unsent:
                self._unsent.pop(model_id, None)
