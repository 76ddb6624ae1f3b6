"""Who owns what, and which sessions are alive.

A session belongs to the API key that created it (a hash of the key is stored), and models
and samplers belong to sessions. A request naming anything its key does not own gets the same
404 as a request naming something that does not exist. One exception: a checkpoint its owner
published may be read by every key (loaded, sampled, copied, its weights info fetched).

Every owned request counts as activity; a session with no heartbeat or request for
``timeout_s`` is finished as "interrupted" (`Sessions.expire_quiet`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from tinker_sr import validation
from tinker_sr.backend.base import Backend, WorkNotStarted
from tinker_sr.types import ParsedCheckpointTinkerPath
from tinker_sr.user_errors import EngineUserError

from .futures import Futures
from .http import HTTPError
from .state import ServerState, SessionRow

log = logging.getLogger("tinker_sr.server")

_EXPIRED_KEPT = 10_000  # why_finished names expiry for these; older ones get the general reason


class Sessions:
    """Ownership checks, activity tracking and expiry of quiet sessions."""

    def __init__(
        self,
        state: ServerState,
        backend: Backend,
        timeout_s: float | None,
        futures: Futures | None = None,
        sample_abandon_s: float | None = None,
    ) -> None:
        self.state = state
        self.backend = backend
        self.timeout_s = timeout_s
        self.futures = futures
        self.sample_abandon_s = sample_abandon_s
        # Last request per session (time.monotonic(): a wall clock stepped back by NTP made
        # every session look active for as long as the step, hunt); heartbeats are also
        # kept in SQLite, for the listings and pruning.
        self.last_seen: dict[str, float] = {}
        # Sessions this process finished for inactivity, newest last (the last _EXPIRED_KEPT).
        self._expired: dict[str, None] = {}
        self._started = time.monotonic()
        self._serving: dict[str, int] = {}  # requests under way per session (`serving`)

    # ---- activity and expiry ---------------------------------------------------------
    def add(self, session_id: str, owner: str) -> None:
        """A session made now, owned by ``owner``: its creation is its first activity."""
        self.state.add_session(session_id, owner)
        self.touch(session_id)

    def touch(self, session_id: str) -> None:
        self.last_seen[session_id] = time.monotonic()

    @contextlib.contextmanager
    def serving(self, session_id: str | None) -> Iterator[None]:
        """A request of ``session_id`` under way (a long poll, an OpenAI-compatible request
        loading its model): its session is not quiet meanwhile, however long it waits, and
        its end counts as activity. Before, a poll waiting on a slow sample counted only when
        it arrived, so the sample could be cancelled as abandoned while its client waited
        for it. ``None``: nothing to track."""
        if session_id is None:
            yield
            return
        self._serving[session_id] = self._serving.get(session_id, 0) + 1
        try:
            yield
        finally:
            if left := self._serving.pop(session_id) - 1:
                self._serving[session_id] = left
            if session_id in self.last_seen:  # not finished meanwhile
                self.touch(session_id)

    def _quiet_since(self, session_id: str, cutoff: float) -> bool:
        """Whether ``session_id`` had no heartbeat or request since ``cutoff`` (monotonic)
        and none is under way; time before this process started does not count."""
        if session_id in self._serving:
            return False
        return max(self.last_seen.get(session_id, self._started), self._started) < cutoff

    def paused(self, seconds: float) -> None:
        """This process did not run for ``seconds`` (SIGSTOP, a frozen container or VM): as
        after a restart, quiet time before now does not count."""
        log.warning(
            "the server did not run for %.0f s (stopped or frozen?): sessions are not counted "
            "quiet for that time", seconds,
        )  # fmt: skip
        self._started = time.monotonic()

    def finished(self, session_id: str) -> None:
        """``session_id`` was finished by its client."""
        self.last_seen.pop(session_id, None)

    async def expire_quiet(self) -> None:
        """Finish (as "interrupted") sessions with no heartbeat or request for
        ``timeout_s``. Time before this process started does not count, so a restart
        does not expire the sessions of clients that are still running."""
        timeout = self.timeout_s
        if timeout is None:
            return
        cutoff = time.monotonic() - timeout
        if self._started >= cutoff:
            return
        for session_id in self.state.unfinished_sessions():
            if self._quiet_since(session_id, cutoff):
                await self.expire(session_id)

    def stop_abandoned_samples(self) -> int:
        """Cancel the sample requests of sessions with no heartbeat or request for
        ``sample_abandon_s``: their client has exited (or is suspended), so nobody will read
        the results, and the work held the sampling worker and its key's pending-sample
        allowance (as the hosted service stops a request once its SDK's heartbeats lapse).
        The session itself lives on until ``timeout_s``. Returns how many were cancelled."""
        if self.sample_abandon_s is None or self.futures is None:
            return 0
        cutoff, stopped = time.monotonic() - self.sample_abandon_s, 0
        for session_id in self.futures.sampling_sessions():
            if not self._quiet_since(session_id, cutoff):
                continue
            why = (
                f"cancelled: its session {session_id} had no heartbeat or request for "
                f"{self.sample_abandon_s:g} s (its client exited or was suspended); sample again"
            )
            if n := self.futures.cancel_session_samples(session_id, why):
                log.info("stopped %d sample request(s) of session %s: %s", n, session_id, why)
            stopped += n
        return stopped

    def stop_samples(self, session_id: str, why: str) -> None:
        """Cancel ``session_id``'s running sample requests, as it finishes: nobody can
        sample with it again, and its client has let go of them."""
        if self.futures is not None:
            self.futures.cancel_session_samples(session_id, f"cancelled: {why}")

    async def expire(self, session_id: str) -> bool:
        """Finish ``session_id`` as "interrupted" for inactivity (also used by
        `tinker_sr.testing`'s ``session_expires`` fault). False if it was already finished."""
        if not self.state.finish_session(session_id, "interrupted"):
            return False
        self._expired[session_id] = None
        if len(self._expired) > _EXPIRED_KEPT:
            del self._expired[next(iter(self._expired))]
        self.last_seen.pop(session_id, None)
        timeout = self.timeout_s
        why = f"no heartbeat or request for {timeout:g} s" if timeout else "expired"
        log.info("session %s expired: %s", session_id, why)
        self.stop_samples(session_id, f"its session {session_id} expired ({why})")
        try:
            await self.backend.close_session(session_id, "interrupted", why)
        except WorkNotStarted:  # the server is stopping: its models go with it
            pass
        except Exception:
            log.exception("closing expired session %s failed", session_id)
        return True

    def why_finished(self, session_id: str) -> str:
        if session_id in self._expired:
            if self.timeout_s is None:
                return "it expired"
            return f"it expired after {self.timeout_s:g} s without a heartbeat or request"
        return "close() was called, or it expired without heartbeats"

    # ---- ownership -------------------------------------------------------------------
    def session(self, session_id: str, owner: str, *, active: bool = True) -> SessionRow:
        row = self.state.session(session_id)
        if row is None or row.owner != owner:
            raise HTTPError(404, f"unknown session_id {session_id!r}; create a session first")
        if active and row.finished is not None:
            raise HTTPError(
                400,
                f"session {session_id} is finished ({self.why_finished(session_id)}); start a "
                "new ServiceClient to keep working",
            )
        if row.finished is None:
            self.touch(session_id)
        return row

    def model(self, model_id: str, owner: str) -> SessionRow:
        row = self.state.model_session(model_id)
        if row is None or row.owner != owner:
            raise HTTPError(404, f"unknown model_id {model_id!r}; create a training client first")
        if row.finished is not None:
            raise HTTPError(
                400,
                f"model {model_id} belongs to finished session {row.session_id} "
                f"({self.why_finished(row.session_id)}); load its checkpoint from a new "
                "ServiceClient",
            )
        loaded = getattr(self.backend, "has_trainer", None)
        if loaded is not None and not loaded(model_id):
            raise HTTPError(
                404,
                f"model {model_id} is not loaded on this server: it was created before the "
                "server restarted, and a model's weights live in memory (only checkpoints "
                "survive a restart). Resume from its last save_state checkpoint: "
                "ServiceClient.create_training_client_from_state(path), with a path from "
                f"RestClient.list_checkpoints({model_id!r})",
            )
        self.touch(row.session_id)
        return row

    def sampler(self, sampler_id: str, owner: str) -> SessionRow:
        row = self.state.sampler_session(sampler_id)
        if row is None or row.owner != owner:
            raise HTTPError(
                404, f"unknown sampling_session_id {sampler_id!r}; create a sampling client first"
            )
        if row.finished is not None:
            raise HTTPError(
                400,
                f"sampler {sampler_id} belongs to finished session {row.session_id} "
                f"({self.why_finished(row.session_id)})",
            )
        self.check_loaded_sampler(sampler_id)
        self.touch(row.session_id)
        return row

    def check_loaded_sampler(self, sampler_id: str) -> None:
        """A 404 saying so where ``sampler_id`` (this server's record) was created before the
        server restarted and its weights are gone with the old process."""
        loaded = getattr(self.backend, "has_sampler", None)
        if (
            loaded is not None
            and not loaded(sampler_id)
            and self.state.sampler_predates_start(sampler_id)
        ):
            raise HTTPError(
                404,
                f"sampling client {sampler_id} is not loaded on this server: it was created "
                "before the server restarted, and sampling weights live in memory (only "
                "checkpoints survive a restart). Make a new one: ServiceClient."
                "create_sampling_client(model_path=<a sampler_weights checkpoint>) or "
                "(base_model=...), or TrainingClient.save_weights_and_get_sampling_client()",
            )

    def run_owned(self, run_id: str, owner: str) -> None:
        row = self.state.model_session(run_id)
        if row is None or row.owner != owner:
            raise HTTPError(404, f"unknown training run {run_id!r}")

    def checkpoint_path(
        self, path: str, owner: str, *, field: str = "path"
    ) -> ParsedCheckpointTinkerPath:
        try:
            parsed = validation.checkpoint_path(path, field)
        except EngineUserError as e:
            raise HTTPError(400, str(e)) from None
        row = self.state.model_session(parsed.training_run_id)
        if row is None or row.owner != owner:
            raise HTTPError(404, f"checkpoint {path} does not exist")
        return parsed

    async def readable_checkpoint(
        self, path: str, owner: str, *, field: str = "path"
    ) -> ParsedCheckpointTinkerPath:
        """A checkpoint this key may read: one of its own, or one its owner published.
        Anything else gets the same 404 as a checkpoint that does not exist."""
        try:
            return self.checkpoint_path(path, owner, field=field)
        except HTTPError as e:
            if e.status != 404:
                raise
            try:
                public = (await self.backend.get_checkpoint(path)).public
            except Exception:
                public = False
            if not public:
                raise
            return ParsedCheckpointTinkerPath.from_tinker_path(path)
