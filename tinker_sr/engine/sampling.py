"""Request-level sampling on a registered `Sampler`: request checks, stop conditions, the
prompt-side extras (top-k / target prompt logprobs, alternative prompt tokens), generation,
and recording each sampled sequence for provenance checks of later training requests.

The token-level work (prefill, KV-cache decode, stability draws) is `engine.sampler`.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import numpy as np

from tinker_sr import types, validation
from tinker_sr.engine import sampler as engine_sampler
from tinker_sr.engine import usage
from tinker_sr.engine.guards import DIVERGED
from tinker_sr.engine.model import Transformer
from tinker_sr.engine.registry import ModelRegistry, Sampler
from tinker_sr.engine.store import Store
from tinker_sr.engine.store_files import record_done_work
from tinker_sr.limits import DEFAULT_LIMITS, Limits
from tinker_sr.provenance.validate import RECORD_TTL_SECONDS, SequenceRecord
from tinker_sr.tokenization.byte import foreign_ids_hint
from tinker_sr.user_errors import EngineUserError

STABILITY_K = 8
DEFAULT_MAX_TOKENS = 4096


class StopTokenizer(Protocol):
    """What sampling needs of a model's tokenizer (`tinker_sr.tokenization.hf.ModelTokenizer`)."""

    eos_token_ids: tuple[int, ...]

    @property
    def token_bytes(self) -> Sequence[bytes]: ...


@dataclass(frozen=True)
class SampleRequest:
    """The arguments of `Backend.sample` beyond the sampler and ``seq_id``."""

    prompt: types.ModelInput
    num_samples: int
    sampling_params: types.SamplingParams
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: types.TensorData | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool = False
    sequence_ids: Sequence[str] | None = None
    logprobs_mode: engine_sampler.LogprobsMode = "sampled"  # OpenAI routes: vLLM's (sampler.py)


@dataclass(frozen=True)
class _Plan:
    """A checked request: what to generate, and how."""

    tokens: list[int]
    max_tokens: int
    stop_ids: list[int]
    stop_strings: list[str]
    seed: int
    targets: np.ndarray | None


class SequenceRecorder:
    """Stores sampled sequences (for provenance) and purges expired ones hourly."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._last_purge: float | None = None  # time.monotonic(): a throttle, not a date

    def record(
        self,
        session_id: str,
        tokens: list[int],
        ids: list[str],
        outs: Sequence[engine_sampler.SampleOutput],
        with_draws: bool,
    ) -> None:
        now = time.time()
        if self._last_purge is None or time.monotonic() - self._last_purge > 3600:
            # Records live 24 h after their last use; drop the dead ones hourly.
            self.store.purge_expired_sequences(now - RECORD_TTL_SECONDS)
            self._last_purge = time.monotonic()
        prompt_arr = np.asarray(tokens, dtype=np.int32)
        self.store.put_sequences(
            [
                SequenceRecord(
                    sequence_id=sid,
                    session_id=session_id,
                    prompt_tokens=prompt_arr,
                    sampled_tokens=np.asarray(o.tokens, dtype=np.int32),
                    sampler_logprobs=np.asarray(o.logprobs, dtype=np.float32),
                    draws=o.draws if with_draws else None,
                    created_at=now,
                    last_used_at=now,
                )
                for sid, o in zip(ids, outs, strict=True)
            ]
        )


class Started(NamedTuple):
    """A checked sample request, ready to decode: its rows, and what turns their outputs into
    the response (recording the sequences first)."""

    group: engine_sampler.DecodeGroup
    finish: Callable[[list[engine_sampler.SampleOutput]], types.SampleResponse]


def begin(
    s: Sampler,
    seq_id: int,
    req: SampleRequest,
    *,
    tokenizer: StopTokenizer,
    recorder: SequenceRecorder,
    limits: Limits = DEFAULT_LIMITS,
) -> Started:
    """Check one sample request on ``s`` and compute its prompt-side extras; every check runs
    here, before anything is generated or recorded. ``tokenizer`` is the model's own: its EOS
    ids end a row unless ``stop=[]``, and string stops are matched on its per-token bytes.
    Decode the returned group (alone: `engine.sampler.decode_alone`; beside others:
    `engine.scheduler`), then call ``finish`` with its outputs."""
    model = s.model  # materialised once (merged weights from the cache, or adapters on the base)
    plan = _plan(model, req, tokenizer.eos_token_ids, limits)
    topk_prompt, target_out, alt = _prompt_extras(model, req, plan)
    prompt_lps = _prompt_logprobs(model, req, plan.tokens)
    sp = req.sampling_params
    group = engine_sampler.DecodeGroup(
        model,
        plan.tokens,
        num_samples=req.num_samples,
        max_tokens=plan.max_tokens,
        temperature=float(sp.temperature),
        top_k=int(sp.top_k),
        top_p=float(sp.top_p),
        stop_token_ids=plan.stop_ids,
        stop_strings=plan.stop_strings,
        token_bytes=tokenizer.token_bytes if plan.stop_strings else None,
        seed=plan.seed,
        stability_k=STABILITY_K if req.record_stability_info else 0,
        top_k_logprobs=req.topk_sample_logprobs,
        logprobs_mode=req.logprobs_mode,
        cache_scope=s.session_id,  # a session's prompts are never another's to reuse
    )
    ids = (
        list(req.sequence_ids)
        if req.sequence_ids is not None
        else validation.sequence_ids(s.sampler_id, seq_id, req.num_samples, secrets.token_hex(4))
    )

    def finish(outs: list[engine_sampler.SampleOutput]) -> types.SampleResponse:
        for o in outs:
            _finite("sample", o.logprobs)
        recorder.record(s.session_id, plan.tokens, ids, outs, req.record_stability_info)
        resp = types.SampleResponse(
            sequences=[_sequence(sid, o) for sid, o in zip(ids, outs, strict=True)],
            prompt_logprobs_np=prompt_lps,
            topk_prompt_logprobs_np=topk_prompt,
            target_prompt_logprobs=target_out,
            prompt_alt_tokens=alt,
            prompt_cache_hit_tokens=group.cache_hit_tokens,
        )
        # Prompt log-probs of any kind are a forward over the whole prompt: none of it cached.
        whole = any(x is not None for x in (prompt_lps, topk_prompt, target_out, alt))
        counts = usage.sample_counts(len(plan.tokens), resp, prompt_recomputed=whole)
        record_done_work(  # engine.usage
            "sampling usage", lambda: recorder.store.add_usage(s.session_id, s.base_model, counts)
        )
        return resp

    return Started(group, finish)


def _plan(model: Transformer, req: SampleRequest, eos_ids: Sequence[int], limits: Limits) -> _Plan:
    _check_types(req)
    vocab = model.config.vocab_size
    tokens = _prompt_tokens(req.prompt, vocab)
    validation.check_num_samples(req.num_samples, limits)
    if req.sequence_ids is not None and len(req.sequence_ids) != req.num_samples:
        raise EngineUserError(
            f"{len(req.sequence_ids)} sequence_ids given for num_samples={req.num_samples}"
        )
    sp = req.sampling_params
    max_tokens = resolve_max_tokens(sp.max_tokens, len(tokens), model.config.max_seq_len)
    if max_tokens >= 1:  # below 1 is refused by the sampler, with its own message
        limits.check_sample_tokens(req.num_samples, len(tokens), max_tokens)
    stop_ids, stop_strings = _stop_conditions(sp.stop, eos_ids)
    if not eos_ids and max_tokens > 1 and sp.stop is None:  # rows could end only at max_tokens
        raise EngineUserError(
            "this model declares no EOS token id (config.json, generation_config.json and the "
            "tokenizer's eos_token name none), so a sample could not end at one: set "
            "eos_token_id in the model's config.json, or give the request its own stop "
            "strings or token ids (sampling_params.stop=[]: none at all, every row runs to "
            "max_tokens)"
        )
    seed = sp.seed if sp.seed is not None else secrets.randbits(63)
    _check_k("topk_prompt_logprobs", req.topk_prompt_logprobs, vocab)
    _check_k("topk_sample_logprobs", req.topk_sample_logprobs, vocab)
    _check_k("prompt_alt_tokens_k", req.prompt_alt_tokens_k, vocab)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not (1 <= last_n <= len(tokens) - 1):
        raise EngineUserError(
            f"prompt_logprobs_last_n must be in [1, len(prompt) - 1 = {len(tokens) - 1}]"
            f", got {last_n}"
        )
    targets = (
        _target_ids(req.target_prompt_logprobs, len(tokens), vocab)
        if req.target_prompt_logprobs is not None
        else None
    )
    return _Plan(tokens, max_tokens, stop_ids, stop_strings, int(seed), targets)


def _prompt_extras(
    model: Transformer, req: SampleRequest, plan: _Plan
) -> tuple[types.TopkLogprobs | None, types.TensorData | None, types.PromptAltTokens | None]:
    tokens = plan.tokens
    topk_prompt = None
    if req.topk_prompt_logprobs:
        ids_k, lps_k = engine_sampler.prompt_top_k_logprobs(model, tokens, req.topk_prompt_logprobs)
        _finite("top-k prompt log-probs", lps_k)
        if req.prompt_logprobs_last_n is not None:
            cut = len(tokens) - req.prompt_logprobs_last_n
            ids_k[:cut], lps_k[:cut] = engine_sampler.TOPK_SENTINEL
        topk_prompt = types.TopkLogprobs(token_ids=ids_k, logprobs=lps_k)
    target_out = None
    if plan.targets is not None:
        assert req.target_prompt_logprobs is not None
        dense = _finite(
            "target prompt log-probs", engine_sampler.target_logprobs(model, tokens, plan.targets)
        )
        target_out = _like_request(dense, req.target_prompt_logprobs)
    alt = None
    if req.prompt_alt_tokens_k:
        alt_ids, alt_lps = engine_sampler.prompt_alt_tokens(
            model,
            tokens,
            req.prompt_alt_tokens_k,
            temperature=float(req.sampling_params.temperature),
            seed=plan.seed,
        )
        _finite("prompt alternative tokens' log-probs", alt_lps)
        alt = types.PromptAltTokens(
            tokens=types.TensorData.from_numpy(alt_ids.astype(np.int64)),
            logprobs=types.TensorData.from_numpy(alt_lps.astype(np.float32)),
        )
    return topk_prompt, target_out, alt


_Values = TypeVar("_Values", np.ndarray, list[float])


def _finite(name: str, values: _Values) -> _Values:
    """``values``, refused if not finite: a diverged model's outputs (sampled log-probs,
    greedy rows included, and every kind of prompt log-probs) say so, never hold NaN."""
    if not np.isfinite(np.asarray(values)).all():
        raise EngineUserError(f"{name}: {DIVERGED}")
    return values


def _prompt_logprobs(
    model: Transformer, req: SampleRequest, tokens: list[int]
) -> np.ndarray | None:
    if not req.include_prompt_logprobs:
        return None
    lps = engine_sampler.prompt_logprobs(model, tokens)
    arr = np.array([np.nan if v is None else v for v in lps], dtype=np.float32)
    _finite("prompt log-probs", arr[1:])  # entry 0 (no context) is the only None
    if req.prompt_logprobs_last_n is not None:
        arr[: len(tokens) - req.prompt_logprobs_last_n] = np.nan
    return arr


def _sequence(sid: str, o: engine_sampler.SampleOutput) -> types.SampledSequence:
    return types.SampledSequence(
        stop_reason=o.stop_reason,
        sequence_id=sid,
        tokens_np=np.asarray(o.tokens, dtype=np.int32),
        logprobs_np=np.asarray(o.logprobs, dtype=np.float32),
        topk_logprobs_np=(
            types.TopkLogprobs(token_ids=o.topk_token_ids, logprobs=o.topk_logprobs)
            if o.topk_token_ids is not None and o.topk_logprobs is not None
            else None
        ),
    )


# ---- request checks ----------------------------------------------------------------------
def _check_types(req: SampleRequest) -> None:
    """The embedded path gets Python objects, not parsed JSON: a wrong type is the caller's
    error, named as such (the clients coerce what the official SDK coerces first)."""
    expected: list[tuple[str, object, type | tuple[type, ...]]] = [
        ("prompt", req.prompt, types.ModelInput),
        ("sampling_params", req.sampling_params, types.SamplingParams),
        ("num_samples", req.num_samples, (int, np.integer)),
    ]
    for name, value, kind in expected:
        if not isinstance(value, kind) or isinstance(value, bool):
            want = kind.__name__ if isinstance(kind, type) else "int"
            raise EngineUserError(f"{name} must be a {want}, got {type(value).__name__}")


def _check_k(field_name: str, k: int, vocab: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 0 <= k <= vocab:
        raise EngineUserError(
            f"{field_name} must be an integer in [0, vocab size = {vocab}], got {k!r}"
        )


def _target_ids(td: types.TensorData, prompt_len: int, vocab: int) -> np.ndarray:
    """The request's target_prompt_logprobs as a dense int64 [len(prompt) - 1, K] array (-1 =
    nothing requested), validated."""
    if td.dtype != "int64":
        raise EngineUserError(
            f"target_prompt_logprobs must be an int64 tensor of token ids, got {td.dtype}"
        )
    shape = td.shape
    # Checked before densifying: a sparse [2, 10**13] would otherwise be allocated.
    if shape is None or len(shape) != 2 or shape[0] != prompt_len - 1 or not 1 <= shape[1] <= vocab:
        raise EngineUserError(
            f"target_prompt_logprobs must have shape [len(prompt) - 1 = {prompt_len - 1}, K] "
            f"with 1 <= K <= {vocab} (row i is scored at prompt position i + 1), got {shape}"
        )
    try:
        ids = np.asarray(td.to_numpy(pad_value=-1), dtype=np.int64)
    except ValueError as e:
        raise EngineUserError(f"target_prompt_logprobs: {e}") from None
    if ids.ndim != 2 or ids.shape[0] != prompt_len - 1:
        raise EngineUserError(
            f"target_prompt_logprobs must have shape [len(prompt) - 1 = {prompt_len - 1}, K] "
            f"(row i is scored at prompt position i + 1), got {list(ids.shape)}"
        )
    bad = (ids < -1) | (ids >= vocab)
    if bad.any():
        r, c = (int(x[0]) for x in np.nonzero(bad))
        raise EngineUserError(
            f"target_prompt_logprobs: id {int(ids[r, c])} at [{r}, {c}] is outside the vocabulary "
            f"[0, {vocab}); use -1 for cells that request nothing"
        )
    if not (ids >= 0).any():
        raise EngineUserError(
            "target_prompt_logprobs holds no token id (every cell is -1); request at least one"
        )
    return ids


def _like_request(dense: np.ndarray, request: types.TensorData) -> types.TensorData:
    """float32 logprobs in the request's layout: dense stays dense, CSR keeps its pattern."""
    dense = np.asarray(dense, dtype=np.float32)
    if request.sparse_crow_indices is None:
        return types.TensorData(data=dense, dtype="float32", shape=list(dense.shape))
    crow = np.asarray(request.sparse_crow_indices, dtype=np.int64)
    col = np.asarray(request.sparse_col_indices, dtype=np.int64)
    rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    return types.TensorData(
        data=np.ascontiguousarray(dense[rows, col]),
        dtype="float32",
        shape=list(dense.shape),
        sparse_crow_indices=list(request.sparse_crow_indices),
        sparse_col_indices=list(request.sparse_col_indices or []),
    )


def _prompt_tokens(prompt: types.ModelInput, vocab: int) -> list[int]:
    for i, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise EngineUserError(
                f"prompt chunk {i} is of type {type(chunk).__name__}; the tinker_sr engine only "
                "accepts EncodedTextChunk (text models)"
            )
    tokens = prompt.to_ints()
    if not tokens:
        raise EngineUserError("prompt is empty; pass at least one token")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise EngineUserError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); "
            f"{len(bad)} token(s) out of range{foreign_ids_hint(vocab)}"
        )
    return tokens


def request_overflow(
    models: ModelRegistry,
    sampler_id: str,
    prompt: object,
    params: object,
    num_samples: object = None,
    limits: Limits | None = None,
    sdk_hint: bool = True,
) -> str | None:
    """Why a sample request does not fit its sampler's context (`sampler.context_overflow`)
    or, given ``num_samples`` and ``limits``, the engine's token limit for one request: told
    before it is queued, so a server can refuse it (400) as the hosted service does; None when
    it fits or cannot be told here (an unknown sampler: the engine's own checks say)."""
    context = sampler_context(models, sampler_id)
    if context is None or not isinstance(prompt, types.ModelInput):
        return None
    n = sum(len(getattr(c, "tokens", ())) for c in prompt.chunks)
    wanted = resolve_max_tokens(getattr(params, "max_tokens", None), n, context)
    if not isinstance(wanted, int):
        return None
    problem = engine_sampler.context_overflow(n, wanted, context, sdk_hint)
    plain = n >= 1 and all(isinstance(c, types.EncodedTextChunk) for c in prompt.chunks)
    if problem is None and limits is not None and isinstance(num_samples, int) and wanted >= 1:
        try:  # as `_plan` checks it, where it would fail the accepted request's future
            if plain:  # else `_plan`'s own error (an image chunk, an empty prompt) comes first
                limits.check_sample_tokens(max(num_samples, 1), n, wanted)
        except EngineUserError as e:
            return str(e)
    return problem


def sampler_context(models: ModelRegistry, sampler_id: str) -> int | None:
    """The context length of a live sampler's model; None for one not live (set aside,
    unknown) or whose config.json changed or went away since loading: the engine says."""
    sampler = models.live_sampler(sampler_id)
    if sampler is None:
        return None
    try:
        return int(sampler.context)
    except Exception:
        return None


def resolve_max_tokens(requested: int | None, prompt_len: int, context: int) -> int:
    """``max_tokens``, or for ``None`` the rest of the context capped at `default_max_tokens`:
    the KV cache and every per-token buffer are sized by prompt + this, so a model with a
    40,960-token context does not allocate 40,960 positions per row for an unbounded request."""
    if requested is not None:
        return requested
    return max(1, min(context - prompt_len, default_max_tokens()))


def default_max_tokens() -> int:
    """``$TINKER_SR_DEFAULT_MAX_TOKENS`` (default 4096): new tokens when max_tokens is None."""
    raw = os.environ.get("TINKER_SR_DEFAULT_MAX_TOKENS", "").strip()
    if not raw:
        return DEFAULT_MAX_TOKENS
    if not raw.isdigit() or int(raw) < 1:
        raise EngineUserError(
            f"TINKER_SR_DEFAULT_MAX_TOKENS must be a positive integer, got {raw!r}"
        )
    return int(raw)


def _stop_conditions(
    stop: str | Sequence[str] | Sequence[int] | None, eos_ids: Sequence[int]
) -> tuple[list[int], list[str]]:
    eos = list(eos_ids)
    if stop is None:
        return eos, []
    if isinstance(stop, str):
        return eos, [stop]
    items = list(stop)
    if not items:
        return [], []  # [] = no stop condition at all, not even EOS
    if all(isinstance(s, str) for s in items):
        return eos, [str(s) for s in items]
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        return [*eos, *(int(s) for s in items if isinstance(s, int))], []
    raise EngineUserError(
        "sampling_params.stop must be a string, a list of strings or a list of ints"
    )
