"""Futures: long operations answer ``{"request_id", ...}`` at once, run in a background task,
and are fetched with ``retrieve_future`` (long poll). Submissions are deduplicated by a key
(an HTTP retry of the same body gets the same future), recently finished results are cached
in memory, and asample is throttled (429 + Retry-After above ``max_pending_samples``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

from starlette.responses import Response

from tinker_sr.backend.base import WorkNotStarted
from tinker_sr.engine.store_files import OUT_OF_SPACE, is_out_of_space
from tinker_sr.errors import APIStatusError, RequestFailedError
from tinker_sr.user_errors import clip_message
from tinker_sr.wire import WireError
from tinker_sr.wire import messages as m

from .http import (
    PROTOBUF,
    HTTPError,
    body_hash,
    env_seconds,
    json_reply,
    plain_error,
    strip_prefix,
)
from .state import COMPLETE, FAILED, PENDING, FutureRow, ServerState

log = logging.getLogger("tinker_sr.server")

Work = Callable[[dict[str, Any]], Awaitable[tuple[str, bytes]]]
"""``work(promise)`` returns ``(encoding, payload)``: ``"json"`` or ``"proto"`` and the bytes."""

_RECENT = 256  # recently finished futures kept at hand for polls, at most this many
_RECENT_BYTES = 64 << 20  # and at most this much of their results (one is always kept)
_REFUSED_KEPT = 4096  # failed futures of requests the database could not take (small rows)
_KEPT_RESULT_BYTES = 1 << 30  # outcomes of work done that it could not take (results)
_LOST = (
    "its result could not be written (out of disk space) and no longer fits in memory; free "
    "space on the server's store and submit it again"
)
SLOW_ENV = "TINKER_SR_SLOW_REQUEST_S"
_SLOW_REPEAT_S = 30.0


def _uncancel() -> None:
    """The current task goes on after a cancellation it handled (asyncio counts them)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def slow_request_s() -> float:
    """After how long a request still running is reported in the server's log (info level):
    ``$TINKER_SR_SLOW_REQUEST_S``, default 10 s; again every 30 s, and when it ends."""
    return env_seconds(SLOW_ENV, 10.0, zero=True)


class Background:
    """The server's background tasks, cancelled together at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Futures:
    """Submit, execute and retrieve futures over `ServerState`."""

    def __init__(
        self,
        state: ServerState,
        background: Background,
        *,
        long_poll_s: float,
        max_pending_samples: int,
    ) -> None:
        self.state = state
        self.background = background
        self.long_poll_s = long_poll_s
        self.max_pending_samples = max_pending_samples
        self.pending_samples: set[str] = set()  # request ids of asample work not yet done
        self._sample_owner: dict[str, str] = {}  # each pending sample's owner (API key)
        self._owner_samples: Counter[str] = Counter()  # pending samples per owner
        self._events: dict[str, asyncio.Event] = {}
        self._running: dict[str, tuple[str, asyncio.Task[None]]] = {}  # rid -> (kind, task)
        self._sample_session: dict[str, str] = {}  # each running sample's session
        self._cancelled: dict[str, str] = {}  # samples being cancelled -> why (their error)
        self.closing = False  # shutting down: long polls do not wait (`stop_waiting`)
        # Recently finished futures, so polls rarely touch SQLite: request_id -> row.
        self._recent: OrderedDict[str, FutureRow] = OrderedDict()
        self._recent_bytes = 0
        # What the database could not take (a full disk), kept here for the clients: failed
        # futures of requests never recorded, and outcomes (results) of work done, apart, so
        # that a burst of the first cannot push out the second; written later if space returns.
        self._refused: OrderedDict[str, FutureRow] = OrderedDict()
        self._kept: OrderedDict[str, FutureRow] = OrderedDict()
        self._kept_bytes = 0

    def submit(
        self,
        *,
        kind: str,
        owner: str,
        session_id: str,
        dedupe_key: str,
        body: bytes,
        work: Work,
        promise_extra: dict[str, Any] | Callable[[str], dict[str, Any]] | None = None,
        on_accept: Callable[[], None] | None = None,
    ) -> Response:
        """Register a future (or find the earlier one for the same key) and start ``work``.

        ``promise_extra`` (or a function of the new request id giving it) is merged into the
        promise; ``on_accept`` runs when a new (not a repeated) submission is accepted, after
        its future is recorded.
        """
        digest = body_hash(body)
        existing = self.state.find_future(dedupe_key)
        if existing is not None:
            return self._resubmission(existing, kind, owner, digest, dedupe_key)
        rid = f"req-{uuid.uuid4().hex}"
        extra = promise_extra(rid) if callable(promise_extra) else promise_extra
        promise: dict[str, Any] = {"request_id": rid, **(extra or {})}
        row = FutureRow(rid, owner, session_id, kind, digest, promise, PENDING, *(None,) * 4)
        try:
            added = self.state.add_future(
                rid,
                owner=owner,
                session_id=session_id,
                kind=kind,
                dedupe_key=dedupe_key,
                body_hash=digest,
                promise=promise,
            )
        except sqlite3.OperationalError as e:
            if not is_out_of_space(e):
                raise
            # Not run, and its future fails at once with the reason: a 507 here was retried
            # by the official SDK for up to two hours without a word to its caller.
            self._refuse(replace(row, status=FAILED, error=OUT_OF_SPACE, category="server"))
            return json_reply(promise)
        if not added:  # lost a race with an identical submission
            existing = self.state.find_future(dedupe_key)
            assert existing is not None
            return self._resubmission(existing, kind, owner, digest, dedupe_key)
        # Only once it is recorded: a request that could not be (a full disk) is not accepted,
        # so its training number is released as a gap once the client's next call arrives.
        if on_accept is not None:
            on_accept()
        self._events[rid] = asyncio.Event()
        if kind == "Sample":
            self._count_sample(rid, owner)
            self._sample_session[rid] = session_id
        task = self.background.spawn(self._execute(rid, work, promise, kind))
        self._running[rid] = (kind, task)
        task.add_done_callback(lambda t: self._task_done(rid, t))
        return json_reply(promise)

    # ---- cancelling samples ------------------------------------------------------------
    def cancel_sample(self, rid: str, why: str) -> bool:
        """Stop sample request ``rid`` if it is still queued or decoding (its rows leave the
        batch at the next step); its future fails with ``why``. False if it is not running."""
        kind, task = self._running.get(rid, ("", None))
        if kind != "Sample" or task is None or rid in self._cancelled:
            return False
        self._cancelled[rid] = why
        task.cancel()
        return True

    def cancel_session_samples(self, session_id: str, why: str) -> int:
        """`cancel_sample` every running sample request of ``session_id``; how many."""
        rids = [r for r, s in self._sample_session.items() if s == session_id]
        return sum(self.cancel_sample(rid, why) for rid in rids)

    def sampling_sessions(self) -> set[str]:
        """The sessions with sample requests running."""
        return set(self._sample_session.values())

    def _task_done(self, rid: str, task: asyncio.Task[None]) -> None:
        self._running.pop(rid, None)
        why = self._cancelled.pop(rid, None)
        if why is not None and task.cancelled():  # cancelled before `_execute` began
            self._record(rid, (FAILED, None, None, why, "user"))
            self._settled(rid)

    def check_sample_capacity(self, dedupe_key: str, owner: str) -> None:
        """429 when too many of ``owner``'s asample requests are pending, unless this one is
        a retry of an accepted request (it still gets its future). The limit is per API key:
        shared, one client's burst made every other key's samples wait for 429s."""
        if (
            self._owner_samples[owner] >= self.max_pending_samples
            and self.state.find_future(dedupe_key) is None
        ):
            # Nothing is recorded: the client resubmits this seq_id later (spec §8.3).
            self._refuse_sample("asample: ", owner)

    def _refuse_sample(self, prefix: str, owner: str) -> None:
        raise HTTPError(
            429,
            f"{prefix}{self._owner_samples[owner]} sampling requests of this API key are "
            f"already pending (this server's limit is {self.max_pending_samples} per key); "
            "retry shortly",
            {"Retry-After": "1"},
        )

    def _count_sample(self, rid: str, owner: str) -> None:
        self.pending_samples.add(rid)
        self._sample_owner[rid] = owner
        self._owner_samples[owner] += 1

    def _sample_done(self, rid: str) -> None:
        self.pending_samples.discard(rid)
        owner = self._sample_owner.pop(rid, None)
        if owner is not None:
            self._owner_samples[owner] -= 1
            if not self._owner_samples[owner]:
                del self._owner_samples[owner]

    @contextlib.contextmanager
    def pending_sample(self, owner: str) -> Iterator[None]:
        """Sampling done outside a future (the OpenAI- and Anthropic-compatible routes answer
        in the request) counted among ``owner``'s pending samples while it runs: above
        ``max_pending_samples``, the same 429 + Retry-After as asample."""
        if self._owner_samples[owner] >= self.max_pending_samples:
            self._refuse_sample("", owner)
        rid = f"inline-{uuid.uuid4().hex}"
        self._count_sample(rid, owner)
        try:
            yield
        finally:
            self._sample_done(rid)

    def _resubmission(
        self, row: FutureRow, kind: str, owner: str, digest: str, dedupe_key: str
    ) -> Response:
        if row.owner != owner:
            raise HTTPError(404, "unknown model or sampler")
        if row.kind != kind or row.body_hash != digest:
            what = dedupe_key.split("|", 1)[1].replace("|", " ")
            raise HTTPError(
                400,
                f"{what} was already used by a different {row.kind} request "
                f"({row.request_id}); every request needs a fresh seq_id",
            )
        return json_reply(row.promise)  # an HTTP retry of the same submission: same future

    async def _report_slow(self, rid: str, what: str, started: float, delay: float) -> None:
        """Log that ``rid`` is still running, so a slow server is told from a hung client."""
        while True:
            await asyncio.sleep(delay)
            log.info(
                "%s %s still running after %.1f s (%d requests in progress)",
                what, rid, time.monotonic() - started, len(self._events),
            )  # fmt: skip
            delay = _SLOW_REPEAT_S

    async def _execute(self, rid: str, work: Work, promise: dict[str, Any], kind: str) -> None:
        started = time.monotonic()
        model = promise.get("model_id") or promise.get("sampling_session_id")
        what = f"{kind} on {model}" if model else kind
        slow = slow_request_s()
        watch = asyncio.ensure_future(self._report_slow(rid, what, started, slow))
        try:
            try:
                outcome = await self._outcome(rid, work, promise)
            except asyncio.CancelledError:
                if (why := self._cancelled.pop(rid, None)) is None:
                    raise  # the server is stopping
                _uncancel()
                log.info("%s %s %s", what, rid, why)  # why: "cancelled: ..."
                outcome = (FAILED, None, None, why, "user")
            if outcome is not None:
                self._record(rid, outcome)
        finally:
            watch.cancel()
            if (took := time.monotonic() - started) >= slow:
                log.info("%s %s finished in %.1f s", what, rid, took)
            self._settled(rid)

    def _settled(self, rid: str) -> None:
        """``rid``'s work has ended: count it no more, keep its row at hand, wake its polls."""
        self._sample_done(rid)
        self._sample_session.pop(rid, None)
        row = self._kept.get(rid) or self.state.get_future(rid)
        if row is not None and row.status != PENDING:
            self._keep_recent(rid, row)
        event = self._events.pop(rid, None)
        if event is not None:
            event.set()

    def _keep_recent(self, rid: str, row: FutureRow) -> None:
        """Keep ``row`` at hand, dropping the oldest beyond `_RECENT` rows or `_RECENT_BYTES`
        of results (large results, such as samples with prompt log-probs, are read from
        SQLite again when polled later)."""
        if (old := self._recent.pop(rid, None)) is not None:
            self._recent_bytes -= len(old.result or b"")
        self._recent[rid] = row
        self._recent_bytes += len(row.result or b"")
        while len(self._recent) > 1 and (
            len(self._recent) > _RECENT or self._recent_bytes > _RECENT_BYTES
        ):
            _, dropped = self._recent.popitem(last=False)
            self._recent_bytes -= len(dropped.result or b"")

    async def _outcome(
        self, rid: str, work: Work, promise: dict[str, Any]
    ) -> tuple[str, str | None, bytes | None, str | None, str | None] | None:
        """``work``'s result as (status, encoding, payload, error, category); None: the
        server is stopping and did not start it (it stays pending, failed at the next start
        as interrupted, so the client submits it again)."""
        try:
            encoding, payload = await work(promise)
            return COMPLETE, encoding, payload, None, None
        except WorkNotStarted:
            return None
        except RequestFailedError as e:
            if strip_prefix(e.message).startswith("internal error"):  # an engine bug: its trace
                log.error("request %s failed inside the engine", rid, exc_info=e.__cause__ or e)
            return FAILED, None, None, strip_prefix(e.message), str(e.category)
        except WireError as e:
            return FAILED, None, None, str(e), "user"
        except APIStatusError as e:  # a refusal from the backend (`errors.refusal`)
            status, detail = plain_error(e)
            return FAILED, None, None, detail, "user" if status < 500 else "server"
        except Exception as e:
            log.exception("request %s failed inside the backend", rid)
            text = (
                OUT_OF_SPACE if is_out_of_space(e) else f"internal error: {type(e).__name__}: {e}"
            )
            return FAILED, None, None, text, "server"

    def _record(
        self, rid: str, outcome: tuple[str, str | None, bytes | None, str | None, str | None]
    ) -> None:
        """Write a finished future's outcome. One the database cannot take: on a full disk
        kept in memory (the work is done: its client still gets it from this server); any
        other failure is the future's, as an internal error."""
        status, encoding, payload, error, category = outcome
        error = None if error is None else clip_message(error)
        try:
            self._write(rid, status, encoding, payload, error, category)
        except Exception as e:
            if not is_out_of_space(e):
                log.exception("request %s: its outcome could not be recorded", rid)
                status, encoding, payload, category = FAILED, None, None, "server"
                error = clip_message(f"internal error: recording its outcome failed: {e!r}")
                with contextlib.suppress(Exception):
                    self._write(rid, status, encoding, payload, error, category)
                    return
            pending = self.state.get_future(rid)
            if pending is not None:
                log.error("request %s: its outcome is kept in memory only (%s)", rid, OUT_OF_SPACE)
                self._keep(replace(pending, status=status, encoding=encoding, result=payload,
                                   error=error, category=category))  # fmt: skip
            return
        self._write_kept()  # the database takes writes again

    def _write(self, rid: str, status: str, encoding: str | None, payload: bytes | None,
               error: str | None, category: str | None) -> None:  # fmt: skip
        if status == COMPLETE:
            self.state.complete_future(rid, encoding or "json", payload or b"")
        else:
            self.state.fail_future(rid, error or "", category or "server")

    def _keep(self, row: FutureRow) -> None:
        """Keep an outcome the database could not take, within `_KEPT_RESULT_BYTES`; past
        it the oldest results give way to a failure saying so (never a future left pending)."""
        self._kept[row.request_id] = row
        self._kept_bytes += len(row.result or b"")
        while self._kept_bytes > _KEPT_RESULT_BYTES and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._kept_bytes -= len(old.result or b"")
            self._refuse(replace(old, status=FAILED, encoding=None, result=None, error=_LOST,
                                 category="server"))  # fmt: skip

    def _write_kept(self) -> None:
        """Write outcomes kept in memory, oldest first, while the database takes them."""
        for rid, row in list(self._kept.items())[:16]:
            try:
                self._write(rid, row.status, row.encoding, row.result, row.error, row.category)
            except Exception:
                return
            del self._kept[rid]
            self._kept_bytes -= len(row.result or b"")

    def flush_kept(self) -> None:
        """At a graceful stop: write every outcome still kept in memory (before, one done
        while the disk was full and never followed by another write was lost with the process:
        after the restart its client read it as failed, work done and acknowledged)."""
        while self._kept:
            before = len(self._kept)
            self._write_kept()
            if len(self._kept) == before:
                log.error(
                    "%d result(s) kept in memory could not be written (%s); after the restart "
                    "their clients will see them as failed", before, OUT_OF_SPACE,
                )  # fmt: skip
                return

    def _refuse(self, row: FutureRow) -> None:
        self._refused[row.request_id] = row
        while len(self._refused) > _REFUSED_KEPT:
            self._refused.popitem(last=False)

    def lookup(self, request_id: str, owner: str) -> FutureRow:
        """The future ``request_id`` of ``owner``; 404 for any other."""
        row = self._row(request_id)
        if row is None or row.owner != owner:
            raise HTTPError(404, f"unknown request_id {request_id!r}")
        return row

    def _row(self, request_id: str) -> FutureRow | None:
        found = self._recent.get(request_id) or self._kept.get(request_id)
        return found or self._refused.get(request_id) or self.state.get_future(request_id)

    async def finish_running(self) -> None:
        """At shutdown, once the backend starts no more work (``stop_starting``): samples are
        cancelled (they change nothing and are cheap to redo), and the rest awaited: the
        request running finishes and its result is recorded, so a client retrieves it after
        the restart; before, it was waited for and then thrown away. Those not started end at
        once (`WorkNotStarted`) and stay pending."""
        waiting = []
        for kind, task in list(self._running.values()):
            if kind == "Sample":
                task.cancel()
            else:
                waiting.append(task)
        if waiting:
            log.info("stopping: waiting for the request in progress to finish, to keep its result")
        await asyncio.gather(*waiting, return_exceptions=True)

    def stop_waiting(self) -> None:
        """The server is shutting down: every long poll answers now (still pending: the client
        polls again, and the restarted server answers), instead of holding the shutdown for
        up to ``long_poll_s`` and then being cancelled mid-request."""
        self.closing = True
        for event in self._events.values():
            event.set()

    async def answer(self, row: FutureRow) -> Response:
        """The result of ``row`` once done, or try_again after the long poll."""
        if row.status == PENDING:
            event = self._events.get(row.request_id)
            if event is not None and not self.closing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), self.long_poll_s)
            done = self._row(row.request_id)
            if done is None or done.status == PENDING:
                return json_reply(m.try_again(row.request_id))
            row = done
        if row.status == FAILED:
            return json_reply(
                m.future_failure(row.error or "request failed", row.category or "unknown")
            )
        assert row.status == COMPLETE and row.result is not None
        media = PROTOBUF if row.encoding == "proto" else "application/json"
        return Response(row.result, media_type=media)
