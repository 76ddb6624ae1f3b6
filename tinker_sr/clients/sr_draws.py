"""Client-side stability draws and records for lowered StableReinforce (`sr_lowering`).

`client_draws` makes K i.i.d. draws per position from the sampler's returned top-k head (or,
via `head_from_raw`, from the raw model's top-k), from an independent stream (`draw_rng`);
`Records` keeps what this session sampled for the one provenance validator; `Lookup` prefers
the embedded engine's own records (its draws) when there are some. numpy only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any, cast

import numpy as np

from tinker_sr import types
from tinker_sr.provenance.validate import RECORD_TTL_SECONDS, SequenceRecord
from tinker_sr.types.topk_logprobs import MASK_LOGPROB

__all__ = [
    "DEFAULT_MAX_RECORD_TOKENS",
    "Lookup",
    "Records",
    "client_draws",
    "draw_rng",
    "engine_records",
    "head_from_raw",
]


def client_draws(
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    k: int,
    rng: np.random.Generator,
    *,
    sampling_top_k: int = -1,
) -> tuple[np.ndarray, np.ndarray]:
    """``k`` i.i.d. draws per row from the distribution whose head is given → (int32 draws
    ``[T, k]``, float32 tail mass ``[T]``).

    ``topk_ids``/``topk_logprobs`` are the sampler's ``[T, k']`` top entries of log q (empty
    cells hold ``(0, MASK_LOGPROB)``; ``-inf`` cells are left out). The draws come from the
    head renormalised; the tail mass is what that leaves out: exactly 0 when the head is q's
    whole support (an empty cell, ``0 < sampling_top_k <= k'``, or a head summing to 1 within
    float32 rounding), else ``1 - Σ head``. A row with no head gets -1 draws and tail mass 1.
    """
    ids = np.asarray(topk_ids, dtype=np.int64)
    lps = np.asarray(topk_logprobs, dtype=np.float64)
    empty = lps == MASK_LOGPROB
    filled = np.isfinite(lps) & ~empty
    p = np.where(filled, np.exp(np.where(filled, lps, 0.0)), 0.0)
    mass = p.sum(axis=1)
    complete = empty.any(axis=1) | (0 < sampling_top_k <= ids.shape[1])
    # A head summing to 1 within float32 rounding (one ulp per entry) misses nothing.
    complete |= 1.0 - mass <= ids.shape[1] * float(np.finfo(np.float32).eps)
    tail = np.where(complete, 0.0, np.clip(1.0 - mass, 0.0, 1.0))
    tail = np.where(mass > 0, tail, 1.0)
    cdf = np.cumsum(p, axis=1)
    u = rng.random((ids.shape[0], k)) * mass[:, None]
    col = np.empty((ids.shape[0], k), dtype=np.int64)
    for t in range(ids.shape[0]):
        col[t] = np.searchsorted(cdf[t], u[t], side="right")
    # u * mass can round to mass: clamp to the last filled cell.
    last = np.where(filled.any(axis=1), ids.shape[1] - 1 - np.argmax(filled[:, ::-1], axis=1), 0)
    col = np.minimum(col, last[:, None])
    draws = np.take_along_axis(ids, col, axis=1)
    draws[mass <= 0] = -1
    return draws.astype(np.int32), tail.astype(np.float32)


def head_from_raw(
    topk_ids: np.ndarray, raw_logprobs: np.ndarray, params: types.SamplingParams
) -> np.ndarray:
    """The raw model's top-k (``compute_logprobs``-style ``topk_prompt_logprobs``, temperature
    1, no filters, best first) → log q over the same cells for `client_draws`: temperature,
    top_k and top_p applied to the head, scaled so that the head sums to ``1 - tail``.

    Exact (tail 0) when ``0 < top_k <= k``, or at temperature 1 when top-p cuts inside the
    head or the head is the whole vocabulary. Otherwise the tail is the raw model's mass
    outside the head, which is exact at temperature 1 and an estimate at any other.
    """
    ids = np.asarray(topk_ids)
    raw = np.asarray(raw_logprobs, dtype=np.float64)
    empty = raw == MASK_LOGPROB
    keep = np.isfinite(raw) & ~empty
    if params.top_k > 0:
        keep &= np.arange(ids.shape[1])[None, :] < params.top_k
    limited = 0 < params.top_k <= ids.shape[1]
    temperature = params.temperature if params.temperature > 0 else 1.0
    z = np.where(keep, raw / temperature, -np.inf)
    if limited or temperature != 1.0:  # probabilities relative to the head
        z = z - np.logaddexp.reduce(z, axis=1, keepdims=True)
    p = np.where(keep, np.exp(z), 0.0)
    cut = np.zeros(ids.shape[0], dtype=bool)
    if params.top_p < 1.0:
        before = np.cumsum(p, axis=1) - p
        dropped = keep & (before >= params.top_p)
        cut = dropped.any(axis=1)
        keep &= ~dropped
    head = np.where(keep, np.exp(raw), 0.0).sum(axis=1)
    exact = limited | empty.any(axis=1) | (cut & (temperature == 1.0))
    tail = np.where(exact, 0.0, np.clip(1.0 - head, 0.0, 1.0))
    q = np.where(keep, p, 0.0)
    q = q / np.maximum(q.sum(axis=1, keepdims=True), 1e-300) * (1.0 - tail)[:, None]
    with np.errstate(divide="ignore"):
        return np.where(keep, np.log(q), -np.inf)


def draw_rng(seed: int | None, row: int) -> np.random.Generator:
    """An independent stream per (seed, row): never the sampler's own token stream."""
    if seed is None:
        return np.random.default_rng()
    ss = np.random.SeedSequence([int(seed) % 2**63, row, 0x5EED_D7A5])
    return np.random.Generator(np.random.PCG64(ss))


DEFAULT_MAX_RECORD_TOKENS = 20_000_000
"""Tokens kept client-side at most: sampled ones (about 45 bytes each: token, logprob, 8 draws,
tail mass) and prompts (4 bytes a token, once per request: its samples share one array);
beyond it the least recently used sequences are dropped first."""


class Records:
    """The sequences this session sampled with ``record_stability_info``: a `SequenceLookup`
    for the one provenance validator, plus the tail mass of client-side draws. Kept like the
    engine keeps them (a day after last use), least recently used first out past
    ``max_tokens`` tokens, sampled and prompt (`DEFAULT_MAX_RECORD_TOKENS`)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_RECORD_TOKENS) -> None:
        self._lock = threading.Lock()
        self._records: OrderedDict[str, SequenceRecord] = OrderedDict()  # oldest use first
        self._tail: dict[str, np.ndarray] = {}
        # Records holding each prompt array (by id; a record holds it, so the id is not
        # reused): a request's samples share one, counted once.
        self._prompt_users: dict[int, int] = {}
        self._tokens = 0
        self.max_tokens = max_tokens

    def put(self, record: SequenceRecord, tail: np.ndarray | None) -> None:
        with self._lock:
            self._drop(record.sequence_id)
            self._records[record.sequence_id] = record
            self._tokens += len(record.sampled_tokens)
            users = self._prompt_users.get(id(record.prompt_tokens), 0)
            if users == 0:
                self._tokens += len(record.prompt_tokens)
            self._prompt_users[id(record.prompt_tokens)] = users + 1
            if tail is not None:
                self._tail[record.sequence_id] = tail
            self._evict(record.last_used_at)

    def get(self, sequence_id: str) -> SequenceRecord | None:
        with self._lock:
            return self._records.get(sequence_id)

    def tail(self, sequence_id: str) -> np.ndarray | None:
        with self._lock:
            return self._tail.get(sequence_id)

    def touch(self, ids: set[str], now: float) -> None:
        with self._lock:
            for sid in ids:
                rec = self._records.get(sid)
                if rec is not None:
                    self._records[sid] = replace(rec, last_used_at=now)
                    self._records.move_to_end(sid)

    def _drop(self, sequence_id: str) -> None:
        rec = self._records.pop(sequence_id, None)
        if rec is not None:
            self._tokens -= len(rec.sampled_tokens)
            users = self._prompt_users.pop(id(rec.prompt_tokens)) - 1
            if users:
                self._prompt_users[id(rec.prompt_tokens)] = users
            else:
                self._tokens -= len(rec.prompt_tokens)
        self._tail.pop(sequence_id, None)

    def _evict(self, now: float) -> None:
        while self._records:
            oldest_id, oldest = next(iter(self._records.items()))
            expired = now - oldest.last_used_at > RECORD_TTL_SECONDS
            if not expired and self._tokens <= self.max_tokens:
                return
            self._drop(oldest_id)


class Lookup:
    """Engine records when the backend is the embedded engine (its draws), else ours."""

    def __init__(self, engine: Any, ours: Records) -> None:
        self.engine = engine
        self.ours = ours

    def get(self, sequence_id: str) -> SequenceRecord | None:
        if self.engine is not None:
            rec = self.engine.get(sequence_id)
            if rec is not None and rec.draws is not None:
                return cast(SequenceRecord, rec)
        return self.ours.get(sequence_id)


def engine_records(backend: Any) -> Any:
    """The embedded engine's sequence store (it records the draws), or None (a remote
    service keeps its draws to itself)."""
    store = getattr(backend, "store", None)
    return store if callable(getattr(store, "get", None)) else None
