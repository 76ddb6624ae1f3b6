"""The server's side of training-request ordering: seq_ids that never reach the backend.

The backend is the one ordering mechanism: it runs a model's requests strictly in seq_id
order (`backend/ordering.py`), and `Backend.release_seq` skips a number. The client only
numbers its calls and issues them in call order (`clients/training.py`). In-process every
number reaches the backend (a request that fails validation still takes its turn). Over HTTP,
a numbered request can be refused by the server (malformed body, bad arguments) or lost on
the way (client crash mid-upload), and only the server sees which numbers arrived. So the
server watches for gaps and releases numbers that were refused here or never arrive within a
grace period; without that, every later request of the model would wait forever. This module
only tells the backend; it never holds a request back itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from tinker_sr.backend.base import Backend

from .futures import Background
from .state import ServerState

log = logging.getLogger("tinker_sr.server")

_MAX_GAP_WATCH = 1024
_SWEEP_AT = 1024  # models tracked before those of finished sessions are forgotten


class SeqWatcher:
    """Which seq_ids of each model reached the backend; releases the ones that never will."""

    def __init__(
        self, state: ServerState, backend: Backend, background: Background, grace_s: float
    ) -> None:
        self.state = state
        self.backend = backend
        self.background = background
        self.grace_s = grace_s
        self._seen: dict[str, set[int]] = {}
        self._floor: dict[str, int] = {}
        self._gap_watches: set[tuple[str, int]] = set()
        self._sweep_at = _SWEEP_AT

    def note(self, model_id: str, seq_id: int) -> None:
        """Record that ``seq_id`` reached the backend (or was released); watch for gaps."""
        seen = self._seen.setdefault(model_id, set())
        seen.add(seq_id)
        floor = self._floor.get(model_id, 1)
        while floor in seen:
            seen.discard(floor)
            floor += 1
        self._floor[model_id] = floor
        for missing in range(floor, min(seq_id, floor + _MAX_GAP_WATCH)):
            if missing not in seen and (model_id, missing) not in self._gap_watches:
                self._gap_watches.add((model_id, missing))
                self.background.spawn(self._watch_gap(model_id, missing))
        if len(self._floor) >= self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Forget the models of finished sessions (no request of theirs is accepted again), so
        a server that runs for months does not keep an entry per model it ever trained; the
        next sweep waits until the map has doubled, so the cost per note stays constant."""
        watched = {model_id for model_id, _ in self._gap_watches}
        for model_id in list(self._floor):
            if self._seen.get(model_id) or model_id in watched:
                continue
            row = self.state.model_session(model_id)
            if row is None or row.finished is not None:
                del self._floor[model_id]
                self._seen.pop(model_id, None)
        self._sweep_at = max(_SWEEP_AT, 2 * len(self._floor))

    def _accounted(self, model_id: str, seq_id: int) -> bool:
        return (
            seq_id < self._floor.get(model_id, 1)
            or seq_id in self._seen.get(model_id, ())
            or self.state.find_future(f"train|{model_id}|seq_id {seq_id}") is not None
        )

    def reject(self, model_id: str, seq_id: int) -> None:
        """A training request with this number was refused at submission: release it."""
        if self._accounted(model_id, seq_id):
            return
        self.note(model_id, seq_id)
        self.background.spawn(self._release(model_id, seq_id))

    def reject_if_known(self, raw: Any, owner: str) -> None:
        """After a malformed training body: free its seq_id if model and seq_id are readable."""
        if not isinstance(raw, dict):
            return
        model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
        if isinstance(model_id, str) and isinstance(seq_id, int) and seq_id >= 1:
            row = self.state.model_session(model_id)
            if row is not None and row.owner == owner and row.finished is None:
                self.reject(model_id, seq_id)

    async def _watch_gap(self, model_id: str, seq_id: int) -> None:
        """A later seq_id arrived but this one did not: if it still has not come after a
        grace period (parallel chunk uploads may arrive out of order), it was lost."""
        try:
            await asyncio.sleep(self.grace_s)
            if not self._accounted(model_id, seq_id):
                log.warning(
                    "model %s: seq_id %d never arrived (its request was refused or lost); "
                    "releasing it so later requests can run",
                    model_id,
                    seq_id,
                )
                self.reject(model_id, seq_id)
        finally:
            self._gap_watches.discard((model_id, seq_id))

    async def _release(self, model_id: str, seq_id: int) -> None:
        with contextlib.suppress(Exception):  # an unknown model has nothing to release
            await self.backend.release_seq(model_id, seq_id)
