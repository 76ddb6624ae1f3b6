"""The sampling worker: one thread that decodes every in-flight sample request together
(continuous batching, issue 11 goal 4).

Each loop: admit queued requests (check them, compute their prompt extras, prefill, or copy
the prefill of the same prompt on the same model from `engine.prompt_cache`) in arrival order,
sessions taking turns (`DecodeScheduler._next_job`; other sessions' requests that fit join
beside one that does not yet: `_backfill`), while the active rows stay within
``max_rows`` and their KV caches within ``$TINKER_SR_DECODE_CACHE_MB``; then one decode step
per model for all active requests of that model (`engine.batching.decode_step`: rows of many
requests in one step); then retire finished requests (record, respond). A row that stops
leaves the batch at the next step; a new request joins at the next step after its prefill.
Rows share a step only when they decode the same model object (a sampler's merged weights,
a base, or an adapters-on-base copy); different models take separate steps.

Results never depend on what else is in flight (`engine.batching`): a request gives
bit-identical tokens, logprobs and draws alone or beside any others.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import torch

from tinker_sr.engine.cpu import warm_thread_team
from tinker_sr.engine.cuda_graphs import decode
from tinker_sr.engine.prompt_cache import PromptCache
from tinker_sr.engine.sampler import DecodeGroup, SampleOutput
from tinker_sr.threads import start_thread

MAX_ROWS_ENV, DEFAULT_MAX_ROWS = "TINKER_SR_MAX_DECODE_ROWS", 256
# KV caches of the requests decoding together: a request without max_tokens reserves 4096
# positions per row, and decoding requests together multiplies that memory.
CACHE_BUDGET_ENV, DEFAULT_CACHE_MB = "TINKER_SR_DECODE_CACHE_MB", 2048
STEP_HISTORY = 4096  # decode steps whose row counts `rows_per_step` keeps
# At interpreter exit, how long to wait for a sampling thread to finish its current step.
EXIT_JOIN_SECONDS = 10.0

Finish = Callable[[list[SampleOutput]], Any]
# Called on the worker after a request's prefill and each of its decode steps (streaming).
Progress = Callable[[DecodeGroup], None]
# A request's first half, run on the worker: checks and prompt work, then the rows to decode
# and what turns their outputs into the result; None when there is nothing to decode.
Begin = Callable[[], tuple[DecodeGroup, Finish] | None]


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return int(raw)


def max_decode_rows() -> int:
    """``$TINKER_SR_MAX_DECODE_ROWS`` (default 256): rows decoding at once; more queue."""
    return _env_int(MAX_ROWS_ENV, DEFAULT_MAX_ROWS, 1)


def decode_cache_budget() -> int:
    """``$TINKER_SR_DECODE_CACHE_MB`` (default 2048) in bytes: the KV caches of requests
    decoding together; a request that would exceed it waits (0: one request at a time)."""
    return _env_int(CACHE_BUDGET_ENV, DEFAULT_CACHE_MB, 0) << 20


@dataclass
class _Job:
    begin: Begin
    rows: int
    future: Future[Any]
    barrier: bool = False  # runs once everything submitted before it has finished
    progress: Progress | None = None
    tenant: str = ""  # whose request (a session): see `DecodeScheduler._next_job`
    epoch: int = 0  # barriers submitted before it (it starts after they have)
    backfill: bool = False  # admitted beside a request whose turn it was (`_backfill`)


@dataclass
class _Active:
    group: DecodeGroup
    finish: Finish
    future: Future[Any]
    progress: Progress | None = None
    backfill: bool = False

    def report(self) -> None:
        """Tell ``progress`` where the request stands; its failure is never the request's."""
        if self.progress is not None:
            try:
                self.progress(self.group)
            except Exception:  # a listener's bug (or a closed stream) must not stop decoding
                self.progress = None


class DecodeScheduler:
    """Owns the sampling thread; `submit` a request, get a `Future` of its result."""

    def __init__(self, threads: int, max_rows: int | None = None) -> None:
        """``threads``: torch intra-op threads of the sampling thread; ``max_rows``: rows
        decoding at once (default `max_decode_rows`)."""
        self.max_rows = max_decode_rows() if max_rows is None else max_rows
        self.cache_budget = decode_cache_budget()
        # Prefill results of recent prompts: a group of requests for one prompt prefills once.
        self.prompt_cache = PromptCache()
        self.threads = threads
        self._cond = threading.Condition()
        # Queued requests per tenant, in arrival order; the tenant whose turn is next first.
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._barriers: deque[_Job] = deque()  # queued barriers, in order
        self._barriers_started = 0
        self._active: list[_Active] = []
        # Checked requests waiting for KV-cache room, in arrival order, ahead of the queue.
        self._ready: deque[_Active] = deque()
        self._closing = False
        self._abandoned = False  # interpreter exit: stop after the current step
        # Rows decoded by each step, newest last (for tests and benchmarks).
        self.rows_per_step: deque[int] = deque(maxlen=STEP_HISTORY)
        self._thread = threading.Thread(target=self._loop, name="tinker-sr-sampling", daemon=True)
        start_thread(self._thread, "the embedded engine's sampling thread")
        _live.add(self)

    def submit(
        self, begin: Begin, rows: int, progress: Progress | None = None, tenant: str = ""
    ) -> Future[Any]:
        """Queue a request of ``rows`` rows (its num_samples), from ``tenant`` (a session):
        admitted in arrival order among its tenant's, tenants taking turns (`_next_job`).
        ``progress`` is called with its rows after its prefill and each decode step (on the
        worker)."""
        return self._put(_Job(begin, max(1, rows), Future(), progress=progress, tenant=tenant))

    def barrier(self, fn: Callable[[], Any] = lambda: None) -> Future[Any]:
        """Run ``fn`` on the worker once every request submitted before has finished."""

        def begin() -> None:
            fn()

        return self._put(_Job(begin, 0, Future(), barrier=True))

    def _put(self, job: _Job) -> Future[Any]:
        with self._cond:
            if self._closing:
                raise RuntimeError("the sampling worker is closed")
            job.epoch = self._barriers_started + len(self._barriers)
            if job.barrier:
                self._barriers.append(job)
            else:
                self._queues.setdefault(job.tenant, deque()).append(job)
            self._cond.notify()
        return job.future

    def close(self, wait: bool = True) -> None:
        """Finish everything submitted, then stop the thread (``wait``: until it has)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if wait:
            self._thread.join()

    def abandon(self, timeout: float = EXIT_JOIN_SECONDS) -> None:
        """At interpreter exit: stop after the current step, leaving queued and running
        requests unanswered, and wait (up to ``timeout``) for the thread to end. A daemon
        thread still inside torch when the interpreter finalizes is killed as it retakes the
        GIL, and that kill, unwinding through torch's C++ frames, aborted the process
        (``terminate called without an active exception``, exit status 134) about every
        other time a script exited without closing its clients."""
        with self._cond:
            self._closing = self._abandoned = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        warm_thread_team(self.threads)
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._has_queued() or self._active or self._ready or self._closing):
                        self._cond.wait()
                    if self._abandoned or (
                        self._closing and not (self._has_queued() or self._active or self._ready)
                    ):
                        return
                    admitted = [] if self._ready else self._admissible()
                self._admit_ready()
                for job in admitted:
                    self._start(job)
                self._step()

    def _has_queued(self) -> bool:
        return bool(self._queues or self._barriers)

    def queued(self) -> int:
        """Requests (and barriers) queued, not yet admitted."""
        with self._cond:
            return sum(len(q) for q in self._queues.values()) + len(self._barriers)

    def _admissible(self) -> list[_Job]:
        """Queued jobs to start now (`_next_job`'s), while the active rows fit ``max_rows``
        (one request always fits when nothing runs); a barrier waits until nothing runs."""
        out: list[_Job] = []
        rows = sum(len(a.group.active) for a in self._active)
        while (job := self._next_job()) is not None:
            busy = bool(self._active or out)
            if job.barrier:
                if not busy:
                    self._barriers.popleft()
                    self._barriers_started += 1
                    out.append(job)
                break
            if busy and rows + job.rows > self.max_rows:
                out += self._backfill(job, rows)
                break
            self._take(job)
            out.append(job)
            rows += job.rows
        return out

    def _take(self, job: _Job) -> None:
        jobs = self._queues[job.tenant]
        jobs.popleft()
        if jobs:  # its turn taken: the other tenants' come first
            self._queues.move_to_end(job.tenant)
        else:
            del self._queues[job.tenant]

    def _backfill(self, waiting: _Job, rows: int) -> list[_Job]:
        """Other sessions' next requests that fit beside the rows decoding now while
        ``waiting`` (whose turn it is) does not. Backfilled rows stay within what ``waiting``
        leaves of ``max_rows``, so it fits as soon as the rest has finished: it is never
        starved. Before: one session's request too large to join held every other session's
        small ones behind it, however many rows were free."""
        if 2 * sum(a.group.cache_bytes for a in self._active) > self.cache_budget:
            return []  # a KV cache to wait for: one that joins could hold ``waiting`` longer
        room = self.max_rows - waiting.rows
        room -= sum(len(a.group.active) for a in self._active if a.backfill)
        out = []
        for tenant, jobs in list(self._queues.items()):
            job = jobs[0] if jobs and tenant != waiting.tenant else None
            if job is None or job.epoch != self._barriers_started or job.future.cancelled():
                continue
            if job.rows <= room and rows + job.rows <= self.max_rows:
                self._take(job)
                job.backfill = True
                out.append(job)
                rows += job.rows
                room -= job.rows
        return out

    def _next_job(self) -> _Job | None:
        """The queued request to admit next: the earliest of the tenant whose turn it is
        (tenants take turns, each in arrival order), never one submitted after a barrier that
        has not started; else that barrier. In arrival order alone, one session's burst (a
        server's client sending 64 requests) held every other session's requests until all
        of it had decoded. Requests cancelled while queued leave here, taking no turn."""
        gone = []
        found = None
        for tenant, jobs in self._queues.items():
            while jobs and jobs[0].future.cancelled():
                jobs.popleft()
            if not jobs:
                gone.append(tenant)
            elif jobs[0].epoch == self._barriers_started:
                found = jobs[0]
                break
        for tenant in gone:
            del self._queues[tenant]
        return found or (self._barriers[0] if self._barriers else None)

    def _start(self, job: _Job) -> None:
        """Check the request (`Begin`), then decode it as soon as its KV cache fits."""
        if job.future.cancelled():  # its caller stopped waiting before it started
            return
        try:
            begun = job.begin()
        except Exception as e:  # the request's own error, reported to its caller
            _settle(job.future, error=e)
            return
        if begun is None:
            _settle(job.future, None)
            return
        self._ready.append(_Active(*begun, job.future, job.progress, job.backfill))
        self._admit_ready()

    def _admit_ready(self) -> None:
        """Prefill waiting requests in order while their KV caches fit the budget (one
        request always fits when nothing decodes)."""
        while self._ready:
            a = self._ready[0]
            used = sum(b.group.cache_bytes for b in self._active)
            if self._active and used + a.group.cache_bytes > self.cache_budget:
                return
            self._ready.popleft()
            if a.future.cancelled():
                continue
            try:
                a.group.prefill(self.prompt_cache)
            except Exception as e:
                _settle(a.future, error=e)
                continue
            self._active.append(a)
            a.report()

    def _step(self) -> None:
        """One decode step per model over its active requests, then retire finished ones."""
        # A cancelled request (its caller stopped waiting) leaves the batch: no more work.
        self._active = [a for a in self._active if not a.future.cancelled()]
        by_model: dict[int, list[_Active]] = {}
        for a in self._active:
            if not a.group.finished:
                by_model.setdefault(id(a.group.model), []).append(a)
        for batch in by_model.values():
            groups = [a.group for a in batch]
            try:
                logits = decode(groups[0].model, groups)
                self.rows_per_step.append(sum(len(g.active) for g in groups))
                for g, lg in zip(groups, logits, strict=True):
                    g.receive(lg)
            except Exception as e:  # an engine bug: fail these requests, keep serving
                for a in batch:
                    _settle(a.future, error=e)
                    self._active.remove(a)
                continue
            for a in batch:
                a.report()
        for a in [a for a in self._active if a.group.finished]:
            self._active.remove(a)
            if a.future.cancelled():  # during its last step: nothing recorded or reported
                continue
            try:
                _settle(a.future, a.finish(a.group.outputs()))
            except Exception as e:
                _settle(a.future, error=e)


def _settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless its caller cancelled it meanwhile (setting a cancelled
    future raises, which would end the sampling thread and every later request with it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        if not future.cancelled():
            raise


_live: weakref.WeakSet[DecodeScheduler] = weakref.WeakSet()


@atexit.register
def _abandon_at_exit() -> None:
    """Stop every live sampling thread before the interpreter finalizes (see `abandon`)."""
    for scheduler in list(_live):
        scheduler.abandon()
