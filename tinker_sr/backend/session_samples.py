"""The sample requests each session has in flight on the sampling worker, so that closing a
session waits for its own samples only. (A barrier on the worker waited for every session's
samples and held back all requests queued after it: one client finishing its session
stalled every other client's sampling until the whole batch had drained.)"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinker_sr.engine.registry import Sampler


class SessionSamples:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # done-callbacks run on the sampling worker
        self._pending: dict[str, set[Future[Any]]] = {}

    def add(self, sampler: Sampler | None, future: Future[Any]) -> None:
        """Count ``future`` as the session's of ``sampler`` until it is done (None: an unknown
        sampler, whose request fails on the worker)."""
        if sampler is None:
            return
        session_id = sampler.session_id
        with self._lock:
            self._pending.setdefault(session_id, set()).add(future)
        future.add_done_callback(lambda f: self._done(session_id, f))

    def _done(self, session_id: str, future: Future[Any]) -> None:
        with self._lock:
            pending = self._pending.get(session_id)
            if pending is not None:
                pending.discard(future)
                if not pending:
                    del self._pending[session_id]

    def count(self, session_id: str) -> int:
        with self._lock:
            return len(self._pending.get(session_id, ()))

    async def wait(self, session_id: str) -> None:
        """Return once every sample request ``session_id`` made so far has finished (its
        outcome, error or cancellation, is its caller's)."""
        with self._lock:
            pending = list(self._pending.get(session_id, ()))
        if pending:
            await asyncio.wait([asyncio.wrap_future(f) for f in pending])
