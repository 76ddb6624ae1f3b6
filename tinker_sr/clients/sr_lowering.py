"""StableReinforce on any Tinker-compatible engine: the client lowers it to ``cross_entropy``.

With the sampler's logprobs fixed, the StableReinforce surrogate (docs/stable_reinforce.md) is
linear in the learner's log-probabilities, so its gradient is the gradient of a weighted
cross-entropy over the sampled token and the K draws of each sampled position: weight
``A_t + β`` on ``x_t``, ``-A_t / K_t`` on each valid draw ``y_{t,k}`` (``K_t`` = the number of
valid draws of that row), nothing elsewhere. A service without ``stable_reinforce`` gets one
``cross_entropy`` call with 2-D targets ``[N, 1+K]`` or, if it refuses 2-D targets, one 1-D
call per column (gradients accumulate until ``optim_step``). The loss value and the
diagnostics are computed here from the returned logprobs, with the engine's formulas.

Draws: the embedded engine's recorded draws when it has them; otherwise K i.i.d. draws made
here, from an independent stream, from the sampler's top-k distribution returned with each
sample (``topk_sample_logprobs``). That is exact when the sampler's support fits in the
returned k (``top_k <= k``, or fewer than k tokens left after top-p); otherwise the draws come
from the renormalised head and the missing tail mass is reported per step
(``draw_tail_mass:{mean,max}``).

Capabilities are learned per session from the service's answers, once (a backend that declares
``native_stable_reinforce``, the embedded engine, starts with them known), and the path taken
is logged once. This module uses numpy only (no torch, no engine).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import numpy as np

from tinker_sr import types
from tinker_sr.clients import chunks
from tinker_sr.clients.sr_draws import (
    DEFAULT_MAX_RECORD_TOKENS,
    client_draws,
    head_from_raw,
)
from tinker_sr.clients.sr_draws import Lookup as _Lookup
from tinker_sr.clients.sr_draws import Records as _Records
from tinker_sr.clients.sr_draws import draw_rng as _draw_rng
from tinker_sr.clients.sr_draws import engine_records as _engine_records
from tinker_sr.clients.sr_lowered import LoweredDatum as _LoweredDatum
from tinker_sr.clients.sr_lowered import ce_datum as _ce_datum
from tinker_sr.clients.sr_lowered import datum_inputs as _inputs
from tinker_sr.clients.sr_lowered import kl_coeff_of as _kl_coeff
from tinker_sr.clients.sr_lowered import lowered_inputs, lowered_result
from tinker_sr.clients.sr_lowered import user_error as _user_error
from tinker_sr.errors import APIStatusError, RequestFailedError, TinkerError
from tinker_sr.provenance.validate import RECORD_TTL_SECONDS as RECORD_TTL_SECONDS
from tinker_sr.provenance.validate import (
    DatumSpans,
    ProvenanceView,
    SequenceRecord,
    validate_provenance,
)
from tinker_sr.user_errors import EngineUserError

if TYPE_CHECKING:
    from tinker_sr.backend.base import Backend

__all__ = [
    "DEFAULT_DRAW_TOPK",
    "DRAWS_K",
    "LoweringMode",
    "LoweringOptions",
    "SessionLowering",
    "TargetsMode",
    "client_draws",
    "head_from_raw",
    "lowered_result",
    "DEFAULT_MAX_RECORD_TOKENS",
    "configure",
    "lowered_inputs",
    "session_of",
]

log = logging.getLogger("tinker_sr")

LoweringMode = Literal["auto", "always", "never"]
TargetsMode = Literal["auto", "2d", "1d"]
SRPath = Literal["native", "lowered-2d", "lowered-1d"]

DRAWS_K = 8
"""Draws per sampled position, as the engine records (docs/stable_reinforce.md)."""

DEFAULT_DRAW_TOPK = 20
"""Top-k asked of the sampler for client-side draws when sampling has no top_k limit (the
usual cap of hosted logprob APIs)."""

_ENV_MODE = "TINKER_SR_LOWERING"


@dataclass(frozen=True)
class LoweringOptions:
    """How ``stable_reinforce`` runs on this session's service.

    ``mode``: ``"auto"`` runs it natively when the service implements it, else lowers it;
    ``"always"`` lowers even on a service that has it (to compare the two); ``"never"``
    always sends it natively (a service without it then fails the request).
    ``targets``: lowered form; ``"auto"`` uses 2-D targets when the service takes them.
    ``draw_topk``: k asked of the sampler for client-side draws (None: the sampling
    ``top_k`` when it is set, else `DEFAULT_DRAW_TOPK`).
    """

    mode: LoweringMode = "auto"
    targets: TargetsMode = "auto"
    draw_topk: int | None = None
    draws_k: int = DRAWS_K

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "always", "never"):
            raise ValueError(
                f"stable_reinforce lowering mode must be 'auto', 'always' or 'never', got "
                f"{self.mode!r}"
            )
        if self.targets not in ("auto", "2d", "1d"):
            raise ValueError(f"targets must be 'auto', '2d' or '1d', got {self.targets!r}")
        if self.draw_topk is not None and self.draw_topk < 1:
            raise ValueError(f"draw_topk must be >= 1 (or None), got {self.draw_topk}")
        if self.draws_k < 1:
            raise ValueError(f"draws_k must be >= 1, got {self.draws_k}")

    @classmethod
    def parse(cls, value: LoweringOptions | str | None) -> LoweringOptions:
        """An options object, a mode name, or None (``$TINKER_SR_LOWERING``, else auto)."""
        if isinstance(value, LoweringOptions):
            return value
        if value is not None:
            return cls(mode=cast(LoweringMode, value))
        try:
            return cls(mode=cast(LoweringMode, os.environ.get(_ENV_MODE) or "auto"))
        except ValueError as e:
            raise ValueError(f"${_ENV_MODE}: {e}") from None


# ---- capabilities and the per-session state ----------------------------------------------


class Turn(Protocol):
    """A training call's place in its client's order (see TrainingClient._submit_turn)."""

    def take(self, n: int) -> list[int]: ...

    def release(self) -> None: ...


Rescore = Callable[[list[int], int], Awaitable[types.TopkLogprobs | None]]
"""(prompt + completion tokens, k) → the raw model's top-k at every position, or None."""

_UNSUPPORTED = re.compile(
    r"loss_fn|stable_reinforce|unknown loss|not supported|unsupported|not implemented", re.I
)


def _error_text(e: BaseException) -> str:
    body = getattr(e, "body", None)
    return f"{e} {body!r}" if body is not None else str(e)


def _refused(e: BaseException) -> bool:
    """A caller-side refusal: an HTTP 4xx or a failed request in category user."""
    if isinstance(e, APIStatusError):
        return 400 <= e.status_code < 500 and e.status_code not in (408, 409, 429)
    return isinstance(e, RequestFailedError) and e.category == types.RequestErrorCategory.User


def _probe_datum(two_d: bool) -> types.Datum:
    if two_d:
        inputs = {
            "target_tokens": types.TensorData.from_numpy(np.zeros((1, 2), dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.zeros((1, 2), dtype=np.float32)),
        }
    else:
        zero = types.TensorData.from_numpy(np.zeros(1, dtype=np.float32))
        inputs = {
            "target_tokens": types.TensorData.from_numpy(np.zeros(1, dtype=np.int64)),
            "logprobs": zero,
            "advantages": zero,
        }
    return types.Datum(model_input=types.ModelInput.from_ints([0]), loss_fn_inputs=inputs)


@dataclass
class Capabilities:
    """What this session's service answered (None: not asked yet)."""

    native: bool | None = None  # accepts loss_fn="stable_reinforce"
    targets_2d: bool | None = None  # accepts 2-D cross_entropy targets
    topk_sample: bool | None = None  # returns topk_sample_logprobs
    topk_prompt: bool | None = None  # answers topk_prompt_logprobs (the fallback pass)
    native_confirmed: bool = False  # a native call with draws went through


@dataclass
class SamplePlan:
    """What a sample request asks for on behalf of the lowering."""

    keep: bool  # record the sequences client-side
    topk: int  # topk_sample_logprobs to request
    user_topk: int  # what the caller asked for (the response is trimmed back to it)
    draw_k: int  # draws per sampled position
    head_k: int  # top-k the client draws from (0: none needed)


_UNKNOWN = " is not known in this session"  # the validator's words; its fix follows them
_ELSEWHERE = (
    " it is of a sampler of this session, but this process holds no draws for it: this "
    "service does not compute stable_reinforce itself, so this client computes it from the "
    "draws it recorded while sampling, and it recorded none for this sample. Either it was "
    "drawn in another process (a pickled SamplingClient in a worker: only that process holds "
    "them), or without record_stability_info=True, or its record was dropped (a day unused, "
    "or past the client's record cap). Sample with record_stability_info=True in the process "
    "that trains, or train on a service that computes stable_reinforce (tinker-sr serve does)"
)


def _sampled_elsewhere(data: Sequence[Any], lookup: _Lookup, session_id: str) -> bool:
    """Does a datum name a sequence of this session's samplers that no record here holds?"""
    for d in data:
        for span in [*(d.model_input_spans or ()), *(d.loss_fn_input_spans or ())]:
            sid = getattr(span, "sequence_id", None)
            if (
                isinstance(sid, str)
                and sid.startswith(f"{session_id}:")
                and lookup.get(sid) is None
            ):
                return True
    return False


@dataclass
class SessionLowering:
    """Per-session lowering state: options, learned capabilities, client-side records."""

    options: LoweringOptions = field(default_factory=LoweringOptions)
    caps: Capabilities = field(default_factory=Capabilities)
    records: _Records = field(default_factory=_Records)
    path: SRPath | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _announced: set[str] = field(default_factory=set)

    # ---- sampling side -------------------------------------------------------------------
    def plan_sample(
        self,
        record_stability_info: bool,
        params: types.SamplingParams,
        topk_sample_logprobs: int,
    ) -> SamplePlan:
        keep = record_stability_info and (
            self.options.mode == "always"
            or (self.options.mode == "auto" and not self.caps.native_confirmed)
        )
        head_k = 0
        if keep and params.temperature != 0:
            head_k = self.options.draw_topk or (
                params.top_k if params.top_k > 0 else DEFAULT_DRAW_TOPK
            )
        topk = topk_sample_logprobs
        if self.caps.topk_sample is not False and topk >= 0:  # a negative one is refused as sent
            topk = max(topk, head_k)
        return SamplePlan(keep, topk, topk_sample_logprobs, self.options.draws_k, head_k)

    async def sample(
        self, plan: SamplePlan, do_sample: Callable[[int], Awaitable[types.SampleResponse]]
    ) -> types.SampleResponse:
        """``do_sample(topk_sample_logprobs)`` with the top-k the plan adds; a service that
        refuses that extra top-k gets the caller's request as it was (and is not asked again)."""
        if plan.topk == plan.user_topk:
            return await do_sample(plan.topk)
        try:
            return await do_sample(plan.topk)
        except TinkerError as e:
            if not _refused(e):
                raise
            self.caps.topk_sample = False
            plan.topk = plan.user_topk
            return await do_sample(plan.topk)

    async def record_sample(
        self,
        plan: SamplePlan,
        session_id: str,
        prompt: types.ModelInput,
        params: types.SamplingParams,
        response: types.SampleResponse,
        rescore: Rescore,
    ) -> types.SampleResponse:
        """Keep the sequences (and client-side draws) of ``response``; return it as the caller
        asked for it (extra top-k columns trimmed). A service that returned no
        ``topk_sample_logprobs`` is asked for the raw top-k of each sequence instead
        (``rescore``: a compute_logprobs pass with ``topk_prompt_logprobs``)."""
        if not plan.keep:
            return response
        now = time.time()
        prompt_tokens = np.asarray(prompt.to_ints(), dtype=np.int32)
        if plan.topk > 0 and response.sequences:
            self.caps.topk_sample = any(s.topk_logprobs_np is not None for s in response.sequences)
        heads = await asyncio.gather(
            *(self._head(plan, params, prompt_tokens, seq, rescore) for seq in response.sequences)
        )
        for row, (seq, head) in enumerate(zip(response.sequences, heads, strict=True)):
            tokens = np.asarray(seq.tokens, dtype=np.int32)
            draws, tail = self._draws(plan, params, head, tokens, row)
            self.records.put(
                SequenceRecord(
                    sequence_id=seq.sequence_id,
                    session_id=session_id,
                    prompt_tokens=prompt_tokens,
                    sampled_tokens=tokens,
                    sampler_logprobs=np.asarray(seq.logprobs or [], dtype=np.float32),
                    draws=draws,
                    created_at=now,
                    last_used_at=now,
                ),
                tail,
            )
        if plan.topk == plan.user_topk:
            return response
        return replace(
            response, sequences=[_trim_topk(s, plan.user_topk) for s in response.sequences]
        )

    async def _head(
        self,
        plan: SamplePlan,
        params: types.SamplingParams,
        prompt: np.ndarray,
        seq: types.SampledSequence,
        rescore: Rescore,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, log q) of the head at each sampled position, or None."""
        top = seq.topk_logprobs_np
        n = len(seq.tokens)
        if top is not None:
            return np.asarray(top.token_ids)[:n], np.asarray(top.logprobs)[:n]
        if params.temperature == 0 or plan.head_k == 0 or n == 0 or self.caps.topk_prompt is False:
            return None
        try:
            raw = await rescore([*prompt.tolist(), *seq.tokens], plan.head_k)
        except TinkerError as e:
            if not _refused(e):
                raise
            raw = None
        self.caps.topk_prompt = raw is not None
        if raw is None:
            return None
        rows = slice(len(prompt), len(prompt) + n)  # row i scores token i given those before
        ids = np.asarray(raw.token_ids)[rows]
        return ids, head_from_raw(ids, np.asarray(raw.logprobs)[rows], params)

    def _draws(
        self,
        plan: SamplePlan,
        params: types.SamplingParams,
        head: tuple[np.ndarray, np.ndarray] | None,
        tokens: np.ndarray,
        row: int,
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        if params.temperature == 0:  # greedy: q is a point mass on the token
            return np.repeat(tokens[:, None], plan.draw_k, axis=1), np.zeros(
                len(tokens), np.float32
            )
        if head is None:
            return None, None
        return client_draws(
            head[0], head[1], plan.draw_k, _draw_rng(params.seed, row), sampling_top_k=params.top_k
        )

    # ---- training side -------------------------------------------------------------------
    async def forward_backward(
        self,
        backend: Backend,
        model_id: str,
        session_id: str,
        turn: Turn,
        data: Sequence[Any],
        config: Mapping[str, float | str] | None,
        *,
        forward_only: bool,
    ) -> types.ForwardBackwardOutput:
        """``stable_reinforce`` natively or lowered, as this service allows."""

        def call(
            data: Sequence[Any], loss_fn: str, cfg: Mapping[str, float | str] | None, fo: bool
        ) -> Awaitable[types.ForwardBackwardOutput]:
            # Not a coroutine function: the seq_ids are taken now, before the turn is released.
            return chunks.issue(backend, model_id, turn.take, data, loss_fn, cfg, forward_only=fo)

        if self.options.mode == "auto" and self.caps.native is None:
            await self._probe_native(call)
        if self.options.mode == "never" or (self.options.mode == "auto" and self.caps.native):
            self._announce("native")
            fut = call(data, "stable_reinforce", config, forward_only)
            turn.release()
            out = await fut
            self.caps.native_confirmed = True
            return out

        kl = _kl_coeff(config)
        lowered = self._lower(backend, session_id, data, kl)
        if self.options.targets == "auto" and self.caps.targets_2d is None:
            await self._probe_2d(call)
        two_d = self.options.targets == "2d" or (
            self.options.targets == "auto" and bool(self.caps.targets_2d)
        )
        self._announce("lowered-2d" if two_d else "lowered-1d")
        if two_d:
            fut = call(
                [_ce_datum(d, lo.targets, lo.weights) for d, lo in zip(data, lowered, strict=True)],
                "cross_entropy",
                None,
                forward_only,
            )
            turn.release()
            out = await fut
            logprobs = [np.asarray(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs]
        else:
            logprobs = await self._one_column_at_a_time(call, turn, data, lowered, forward_only)
        return lowered_result(lowered, logprobs, kl)

    async def _one_column_at_a_time(
        self,
        call: Callable[..., Awaitable[types.ForwardBackwardOutput]],
        turn: Turn,
        data: Sequence[Any],
        lowered: Sequence[_LoweredDatum],
        forward_only: bool,
    ) -> list[np.ndarray]:
        """K+1 calls with 1-D targets; the engine sums their gradients. Columns without any
        weight are skipped (their logprobs are never used)."""

        width = lowered[0].targets.shape[1]
        cols = [0] + [j for j in range(1, width) if any(lo.weights[:, j].any() for lo in lowered)]
        futs = [
            asyncio.ensure_future(
                call(
                    [
                        _ce_datum(d, lo.targets[:, j], lo.weights[:, j])
                        for d, lo in zip(data, lowered, strict=True)
                    ],
                    "cross_entropy",
                    None,
                    forward_only,
                )
            )
            for j in cols
        ]
        turn.release()
        outs = await asyncio.gather(*futs)
        logprobs = [np.zeros(lo.targets.shape, dtype=np.float32) for lo in lowered]
        for j, out in zip(cols, outs, strict=True):
            for lp, o in zip(logprobs, out.loss_fn_outputs, strict=True):
                lp[:, j] = np.asarray(o["logprobs"].to_numpy())
        return logprobs

    def _lower(
        self, backend: Backend, session_id: str, data: Sequence[Any], kl: float
    ) -> list[_LoweredDatum]:
        """Validate provenance here (the one validator, on the sequences this client
        sampled) and build the cross_entropy inputs."""
        lookup = _Lookup(_engine_records(backend), self.records)
        spans = []
        for i, d in enumerate(data):
            tokens, tt, _, adv = _inputs(i, d)
            spans.append(
                DatumSpans(
                    input_tokens=tokens,
                    target_tokens=tt,
                    advantages=adv.astype(np.float32),
                    model_input_spans=d.model_input_spans,
                    loss_fn_input_spans=d.loss_fn_input_spans,
                )
            )
        now = time.time()
        try:
            views = validate_provenance(
                spans, session_id=session_id, lookup=lookup, loss_fn="stable_reinforce", now=now
            )
        except EngineUserError as e:
            message = str(e)
            if "without stability info" in message and self.caps.topk_prompt is False:
                message += (
                    " (this service returned neither topk_sample_logprobs nor "
                    "topk_prompt_logprobs, so the client could not draw the centering tokens)"
                )
            if _UNKNOWN in message and _sampled_elsewhere(data, lookup, session_id):
                cut = message.find(_UNKNOWN) + len(_UNKNOWN)  # its fix replaced by this one
                message = message[:cut] + ";" + _ELSEWHERE
            raise _user_error(message) from None
        present = [v for v in views if v is not None]
        assert len(present) == len(views)  # stable_reinforce requires provenance on every datum
        tails = [self._tails(lookup, d, v) for d, v in zip(data, present, strict=True)]
        lowered = lowered_inputs(data, kl, present, tails)
        self.records.touch(set().union(*(v.sequence_ids for v in present)), now)
        return lowered

    def _tails(self, lookup: _Lookup, d: Any, view: ProvenanceView) -> np.ndarray:
        """Per target position: the tail mass the client-side draws left out (NaN where the
        draws are the engine's own, 0 off sampled positions)."""
        n = len(view.sampled_mask)
        tail = np.zeros(n, dtype=np.float64)
        pos = 0
        for span in d.loss_fn_input_spans:
            if type(span).__name__ == "SampledProvenanceSpan":
                ours = self.records.get(span.sequence_id)
                mass = self.records.tail(span.sequence_id)
                if lookup.get(span.sequence_id) is not ours or mass is None:
                    tail[pos : pos + span.length] = math.nan
                else:
                    tail[pos : pos + span.length] = mass[span.offset : span.offset + span.length]
            pos += span.length
        return tail

    async def _probe_native(self, call: Callable[..., Awaitable[Any]]) -> None:
        """Ask once: does the service take ``stable_reinforce``? A forward on one datum
        without provenance, which changes nothing: an engine that has the loss accepts it or
        refuses the missing provenance; one that does not refuses the loss name."""
        try:
            await call([_probe_datum(False)], "stable_reinforce", None, True)
            self.caps.native = True
        except TinkerError as e:
            text = _error_text(e)
            if "provenance" in text.lower():
                self.caps.native = True
            elif _refused(e) and _UNSUPPORTED.search(text):
                self.caps.native = False
            else:
                raise TinkerError(
                    "could not tell whether this service implements stable_reinforce: the probe "
                    f"request failed with {type(e).__name__}: {e}. Pass "
                    "stable_reinforce_lowering='always' (lower it to cross_entropy) or 'never' "
                    "(send it as is) to ServiceClient"
                ) from e

    async def _probe_2d(self, call: Callable[..., Awaitable[Any]]) -> None:
        """Ask once: does cross_entropy take 2-D targets here (a forward, changes nothing)?"""
        try:
            await call([_probe_datum(True)], "cross_entropy", None, True)
            self.caps.targets_2d = True
        except TinkerError as e:
            if not _refused(e):
                raise
            self.caps.targets_2d = False

    def _announce(self, path: SRPath) -> None:
        with self._lock:
            self.path = path
            if path in self._announced:
                return
            self._announced.add(path)
        if path == "native":
            log.info("stable_reinforce: the service implements it; sending it as is")
            return
        why = (
            "forced by stable_reinforce_lowering='always'"
            if self.options.mode == "always"
            else "this service does not implement stable_reinforce"
        )
        one_d = (
            "targets='1d' was asked for"
            if self.options.targets == "1d"
            else "this service takes no 2-D targets"
        )
        how = (
            "one cross_entropy call with 2-D targets [N, 1+K]"
            if path == "lowered-2d"
            else f"K+1 cross_entropy calls with 1-D targets ({one_d})"
        )
        log.warning(
            "stable_reinforce is lowered by the client (%s): %s, same gradient; loss and "
            "diagnostics computed client-side (docs/stable_reinforce.md, 'Running "
            "StableReinforce on other engines')",
            why,
            how,
        )


def _trim_topk(seq: types.SampledSequence, k: int) -> types.SampledSequence:
    top = seq.topk_logprobs_np
    if top is None:
        return seq
    trimmed = None
    if k > 0:
        trimmed = types.TopkLogprobs(
            token_ids=np.ascontiguousarray(np.asarray(top.token_ids)[:, :k]),
            logprobs=np.ascontiguousarray(np.asarray(top.logprobs)[:, :k]),
        )
    # cached_property values live in __dict__: a replaced copy must not inherit them.
    return replace(seq, topk_logprobs_np=trimmed, _topk_logprobs_list=None)


# ---- one state per session (holder) --------------------------------------------------------

_sessions: weakref.WeakKeyDictionary[Any, SessionLowering] = weakref.WeakKeyDictionary()
_sessions_lock = threading.Lock()


def _new_state(holder: Any, options: LoweringOptions | str | None) -> SessionLowering:
    """A session's lowering state. A backend that declares ``native_stable_reinforce`` (the
    embedded engine: it implements the loss and records its own draws) starts with those
    capabilities known, so samples taken before the first training call are not kept, nor
    asked for an extra top-k, client-side (they cost ~5 % of an RL sampling run there)."""
    state = SessionLowering(options=LoweringOptions.parse(options))
    if getattr(getattr(holder, "backend", None), "native_stable_reinforce", False) is True:
        state.caps.native = state.caps.native_confirmed = True
    return state


def configure(holder: Any, options: LoweringOptions | str | None) -> SessionLowering:
    """Set the lowering options of ``holder``'s session (a ServiceClient's)."""
    state = _new_state(holder, options)
    with _sessions_lock:
        _sessions[holder] = state
    return state


def session_of(holder: Any) -> SessionLowering:
    """The lowering state of ``holder``'s session (default options on first use)."""
    with _sessions_lock:
        state = _sessions.get(holder)
        if state is None:
            state = _new_state(holder, None)
            _sessions[holder] = state
        return state
