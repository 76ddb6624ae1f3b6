"""The one provenance validator: local, remote and official-SDK traffic all pass through here.

Given the datums of a training request and the recorded sequences of the session, check that
every provenance span points at a sequence this session owns, that has not expired, and whose
recorded tokens the datum reproduces; for ``stable_reinforce`` also check the loss's own
requirements (docs/stable_reinforce.md, "What training validates"). Returns, per datum, the
view the loss needs: which target positions are sampled tokens and the stability draws
aligned to them.

Validation is pure. The caller refreshes ``last_used_at`` of ``touch_ids(views)`` only after
the whole request has succeeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tinker_sr.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan
from tinker_sr.user_errors import EngineUserError

__all__ = [
    "RECORD_TTL_SECONDS",
    "DatumSpans",
    "ProvenanceView",
    "SequenceLookup",
    "SequenceRecord",
    "touch_ids",
    "validate_provenance",
]

RECORD_TTL_SECONDS = 86400.0

Span = PromptProvenanceSpan | SampledProvenanceSpan


@dataclass(frozen=True)
class SequenceRecord:
    """What the sampler recorded for one sampled sequence."""

    sequence_id: str
    session_id: str
    prompt_tokens: np.ndarray  # int32 [P]
    sampled_tokens: np.ndarray  # int32 [S]
    sampler_logprobs: np.ndarray  # float32 [S]
    draws: np.ndarray | None  # int32 [S, K]; None when sampled without record_stability_info
    created_at: float
    last_used_at: float


class SequenceLookup(Protocol):
    def get(self, sequence_id: str) -> SequenceRecord | None:
        """The record of ``sequence_id`` in any session, or None."""
        ...


@dataclass
class ProvenanceView:
    """What the loss needs from one datum's provenance."""

    sampled_mask: np.ndarray  # bool [N] target positions under a SampledProvenanceSpan
    draws: np.ndarray | None  # int64 [N, K], -1 where none; None when no sequence has draws
    sequence_ids: frozenset[str]


@dataclass
class DatumSpans:
    """One datum as the validator sees it (plain data, no client types)."""

    input_tokens: np.ndarray  # int64 [N]
    target_tokens: np.ndarray | None  # int64 [N] or [N, K]
    advantages: np.ndarray | None  # float32 [N]
    model_input_spans: list[Span] | None
    loss_fn_input_spans: list[Span] | None


def touch_ids(views: Sequence[ProvenanceView | None]) -> set[str]:
    """Sequence ids whose ``last_used_at`` the caller refreshes once the request succeeded."""
    out: set[str] = set()
    for view in views:
        if view is not None:
            out |= view.sequence_ids
    return out


def _kind(span: object) -> str | None:
    """'prompt' / 'sampled' for our span types and the official SDK's (duck-typed by name)."""
    if isinstance(span, SampledProvenanceSpan):
        return "sampled"
    if isinstance(span, PromptProvenanceSpan):
        return "prompt"
    name = type(span).__name__
    if all(hasattr(span, a) for a in ("sequence_id", "offset", "length")):
        if name == "SampledProvenanceSpan":
            return "sampled"
        if name == "PromptProvenanceSpan":
            return "prompt"
    return None


def _describe(span: Span) -> str:
    return (
        f"{type(span).__name__} sequence_id={span.sequence_id!r}, "
        f"offset={span.offset}, length={span.length}"
    )


class _Datum:
    """Formats errors for one datum in the house style."""

    def __init__(self, index: int) -> None:
        self.index = index

    def error(self, message: str) -> EngineUserError:
        return EngineUserError(f"datum {self.index}: {message}")

    def span_error(self, field: str, j: int, span: Span, broken: str, fix: str) -> EngineUserError:
        return self.error(f"{field} span {j} ({_describe(span)}): {broken}; {fix}")


def _first_mismatch(got: np.ndarray, want: np.ndarray) -> int:
    return int(np.nonzero(np.asarray(got) != np.asarray(want))[0][0])


def validate_provenance(
    data: Sequence[DatumSpans],
    *,
    session_id: str,
    lookup: SequenceLookup,
    loss_fn: str,
    now: float,
    ttl_seconds: float = RECORD_TTL_SECONDS,
) -> list[ProvenanceView | None]:
    """Check every datum's provenance; return one view per datum (None without provenance).

    Raises EngineUserError naming the datum, the span and the fix.
    """
    records: dict[str, SequenceRecord | None] = {}

    def record(sequence_id: str) -> SequenceRecord | None:
        if sequence_id not in records:
            rec = lookup.get(sequence_id)
            # Another session's sequence must look exactly like an unknown one.
            records[sequence_id] = rec if rec is not None and rec.session_id == session_id else None
        return records[sequence_id]

    views: list[ProvenanceView | None] = []
    for i, datum in enumerate(data):
        views.append(_validate_datum(_Datum(i), datum, record, loss_fn, now, ttl_seconds))
    return views


def _validate_datum(
    ctx: _Datum,
    datum: DatumSpans,
    record: _RecordFn,
    loss_fn: str,
    now: float,
    ttl: float,
) -> ProvenanceView | None:
    mis, lis = datum.model_input_spans, datum.loss_fn_input_spans
    stable = loss_fn == "stable_reinforce"
    if mis is None and lis is None:
        if stable:
            raise ctx.error(
                "stable_reinforce needs provenance on every datum, but this one has no "
                "model_input_spans or loss_fn_input_spans; attach them with "
                "Datum.with_provenance(...) or build the datum with "
                "tinker_sr.provenance.build_datum"
            )
        return None
    if mis is None or lis is None:
        have, missing = "model_input_spans", "loss_fn_input_spans"
        if mis is None:
            have, missing = missing, have
        raise ctx.error(
            f"{have} is set but {missing} is not; provenance comes as a pair, set both "
            "(Datum.with_provenance does)"
        )

    tokens = np.asarray(datum.input_tokens)
    targets = None if datum.target_tokens is None else np.asarray(datum.target_tokens)
    if targets is None:
        raise ctx.error(
            "loss_fn_input_spans tile the rows of loss_fn_inputs['target_tokens'], which is "
            "missing; add target_tokens"
        )
    fields: tuple[_Field, ...] = (
        ("model_input_spans", mis, len(tokens), "model_input"),
        ("loss_fn_input_spans", lis, int(targets.shape[0]), "target_tokens"),
    )
    _check_tiling(ctx, fields)  # structure first: kinds, lengths, tiling
    ids = _check_against_records(ctx, fields, tokens, targets, record, now, ttl)
    sampled_mask, draws = _sampled_positions(lis, int(targets.shape[0]), record)
    if stable:
        _check_stable_reinforce(ctx, lis, datum.advantages, record)
    return ProvenanceView(sampled_mask=sampled_mask, draws=draws, sequence_ids=frozenset(ids))


_Field = tuple[str, list[Span], int, str]  # (field name, spans, positions to tile, what)


def _check_tiling(ctx: _Datum, fields: tuple[_Field, ...]) -> None:
    for name, spans, size, what in fields:
        covered = 0
        for j, span in enumerate(spans):
            if _kind(span) is None:
                raise ctx.error(
                    f"{name} span {j} is a {type(span).__name__}; expected "
                    "PromptProvenanceSpan or SampledProvenanceSpan"
                )
            # An empty run covers nothing, and is accepted: tinker-cookbook's recipes/rl_loop.py
            # names a one-token sample's model_input run with length 0 (SDK 0.38 allows it).
            if span.length < 0:
                raise ctx.span_error(name, j, span, "length must be >= 0", "fix the length")
            if span.offset < 0:
                raise ctx.span_error(name, j, span, "offset must be >= 0", "fix the offset")
            covered += span.length
        if covered != size:
            raise ctx.error(
                f"{name} cover {covered} positions but {what} has {size}; the runs must tile "
                f"{what} exactly, each position in one run"
            )


def _check_against_records(
    ctx: _Datum,
    fields: tuple[_Field, ...],
    tokens: np.ndarray,
    targets: np.ndarray,
    record: _RecordFn,
    now: float,
    ttl: float,
) -> set[str]:
    """Each span against its recorded sequence; returns the sequence ids used."""
    ids: set[str] = set()
    for name, spans, _, _ in fields:
        pos = 0
        for j, span in enumerate(spans):
            rec = _live_record(ctx, name, j, span, record, now, ttl)
            sampled = _kind(span) == "sampled"
            recorded = _recorded_run(ctx, name, j, span, rec, sampled)
            kind = "sampled" if sampled else "prompt"
            if name == "model_input_spans":
                got = tokens[pos : pos + span.length]
                fix = (
                    "the training context must reproduce the sampling context token for "
                    "token (do not re-tokenize)"
                )
                _check_same(ctx, name, j, span, pos, got, recorded, "model_input token", kind, fix)
            elif sampled and targets.ndim == 1:
                # Targets under prompt spans may be padding (the cookbook writes 0s): not checked.
                got = targets[pos : pos + span.length]
                fix = "targets under a SampledProvenanceSpan must be the sampled tokens"
                _check_same(ctx, name, j, span, pos, got, recorded, "target_tokens", kind, fix)
            if name == "loss_fn_input_spans" and sampled and span.length:
                _check_context(ctx, j, span, pos, tokens, rec)
            ids.add(span.sequence_id)
            pos += span.length
    return ids


def _live_record(
    ctx: _Datum, name: str, j: int, span: Span, record: _RecordFn, now: float, ttl: float
) -> SequenceRecord:
    rec = record(span.sequence_id)
    if rec is None:
        raise ctx.span_error(
            name,
            j,
            span,
            f"sequence_id {span.sequence_id!r} is not known in this session",
            "either its sample request never finished (it failed, or was cancelled: use only "
            "the sequences of a sample that returned), or it was sampled in another session "
            "(sequence ids resolve only in the session that sampled them; sample and train "
            "through clients of one ServiceClient)",
        )
    idle = now - rec.last_used_at
    if idle > ttl:
        raise ctx.span_error(
            name,
            j,
            span,
            f"sequence {span.sequence_id!r} expired ({idle:.0f} s since its last use; "
            f"records are kept {ttl:.0f} s after last use)",
            "sample it again",
        )
    return rec


def _recorded_run(
    ctx: _Datum, name: str, j: int, span: Span, rec: SequenceRecord, sampled: bool
) -> np.ndarray:
    """The recorded tokens ``span`` claims (sampled tokens or prompt)."""
    source = rec.sampled_tokens if sampled else rec.prompt_tokens
    where = "sampled tokens" if sampled else "prompt"
    if span.offset + span.length > len(source):
        raise ctx.span_error(
            name,
            j,
            span,
            f"runs past the end of the {where} of sequence {span.sequence_id!r} "
            f"({len(source)} tokens)",
            "offset + length must not exceed that count",
        )
    return np.asarray(source[span.offset : span.offset + span.length])


def _check_same(
    ctx: _Datum,
    name: str,
    j: int,
    span: Span,
    pos: int,
    got: np.ndarray,
    recorded: np.ndarray,
    label: str,
    kind: str,
    fix: str,
) -> None:
    if not np.array_equal(got, recorded):
        k = _first_mismatch(got, recorded)
        raise ctx.span_error(
            name,
            j,
            span,
            f"{label} at position {pos + k} is {int(got[k])} but the recorded {kind} token "
            f"{span.offset + k} is {int(recorded[k])}",
            fix,
        )


def _sampled_positions(
    lis: list[Span], n: int, record: _RecordFn
) -> tuple[np.ndarray, np.ndarray | None]:
    """The target rows under a SampledProvenanceSpan, and their recorded draws (-1: none)."""
    sampled_mask = np.zeros(n, dtype=bool)
    k_max = 0
    pos = 0
    for span in lis:
        if _kind(span) == "sampled":
            sampled_mask[pos : pos + span.length] = True
            rec = record(span.sequence_id)
            if rec is not None and rec.draws is not None:
                k_max = max(k_max, int(np.asarray(rec.draws).shape[1]))
        pos += span.length
    draws: np.ndarray | None = None
    if k_max:
        draws = np.full((n, k_max), -1, dtype=np.int64)
        pos = 0
        for span in lis:
            rec = record(span.sequence_id)
            if _kind(span) == "sampled" and rec is not None and rec.draws is not None:
                rows = np.asarray(rec.draws)[span.offset : span.offset + span.length]
                draws[pos : pos + span.length, : rows.shape[1]] = rows
            pos += span.length
    return sampled_mask, draws


def _check_context(
    ctx: _Datum, j: int, span: Span, pos: int, tokens: np.ndarray, rec: SequenceRecord
) -> None:
    """Target row ``pos + k`` is predicted from ``tokens[:pos + k + 1]``; sampled token
    ``offset + k`` was drawn after ``prompt + sampled[:offset + k]``. The two must be equal,
    or the recorded logprobs and draws describe another distribution."""
    name = "loss_fn_input_spans"
    fix = (
        "train each sampled token right after the context it was sampled in: the prompt, "
        "then the earlier sampled tokens (tinker_sr.provenance.build_datum does this)"
    )
    prompt = np.asarray(rec.prompt_tokens)
    need = len(prompt) + span.offset
    if pos + 1 != need:
        raise ctx.span_error(
            name,
            j,
            span,
            f"its first token is trained after {pos + 1} model_input tokens but was sampled "
            f"after {need} (the prompt of sequence {span.sequence_id!r} and {span.offset} "
            "sampled tokens)",
            fix,
        )
    sampled_before = np.asarray(rec.sampled_tokens[: span.offset + span.length - 1])
    want = np.concatenate([prompt, sampled_before])
    got = tokens[: len(want)]
    if len(got) != len(want) or not np.array_equal(got, want):
        k = _first_mismatch(got, want[: len(got)]) if len(got) else 0
        raise ctx.span_error(
            name,
            j,
            span,
            f"it is trained in a context that differs from the one it was sampled in, first "
            f"at model_input position {k}",
            fix,
        )


class _RecordFn(Protocol):
    def __call__(self, sequence_id: str) -> SequenceRecord | None: ...


def _check_stable_reinforce(
    ctx: _Datum, lis: list[Span], advantages: np.ndarray | None, record: _RecordFn
) -> None:
    name = "loss_fn_input_spans"
    if not any(_kind(s) == "sampled" for s in lis):
        raise ctx.error(
            f"stable_reinforce needs at least one SampledProvenanceSpan in {name}, but every "
            "target position is under a PromptProvenanceSpan; train on sampled tokens"
        )
    adv = None if advantages is None else np.asarray(advantages)

    # Every sampled sequence the datum trains on is covered whole, each token exactly once.
    cover: dict[str, np.ndarray] = {}
    first_span: dict[str, int] = {}
    for j, span in enumerate(lis):
        if _kind(span) != "sampled":
            continue
        rec = record(span.sequence_id)
        assert rec is not None  # checked by the caller
        seen = cover.setdefault(span.sequence_id, np.zeros(len(rec.sampled_tokens), dtype=int))
        first_span.setdefault(span.sequence_id, j)
        window = seen[span.offset : span.offset + span.length]
        if window.any():
            k = int(np.nonzero(window)[0][0])
            raise ctx.span_error(
                name,
                j,
                span,
                f"sampled token {span.offset + k} of sequence {span.sequence_id!r} is already "
                "covered by an earlier span",
                "cover each sampled token exactly once",
            )
        window += 1
    for sequence_id, seen in cover.items():
        if not seen.all():
            k = int(np.nonzero(seen == 0)[0][0])
            j = first_span[sequence_id]
            raise ctx.span_error(
                name,
                j,
                lis[j],
                f"sampled token {k} of sequence {sequence_id!r} is not covered "
                f"({int(seen.sum())} of {len(seen)} sampled tokens are)",
                "stable_reinforce trains on whole sampled sequences: cover every sampled token "
                "exactly once",
            )

    if adv is None:
        return
    pos = 0
    for j, span in enumerate(lis):
        window = adv[pos : pos + span.length]
        nonzero = np.nonzero(window != 0)[0]
        if _kind(span) == "prompt" and len(nonzero):
            t = pos + int(nonzero[0])
            raise ctx.span_error(
                name,
                j,
                span,
                f"advantages[{t}] = {float(adv[t])} on a prompt position",
                "stable_reinforce accepts non-zero advantages only on sampled tokens; set the "
                "advantages outside SampledProvenanceSpans to 0 (a KL penalty discounted onto "
                "prompt tokens, the cookbook's kl_discount_factor > 0, puts values there)",
            )
        if _kind(span) == "sampled" and len(nonzero):
            rec = record(span.sequence_id)
            if rec is not None and rec.draws is None:
                raise ctx.span_error(
                    name,
                    j,
                    span,
                    f"sequence {span.sequence_id!r} was sampled without stability info",
                    "sample with a client created with record_stability_info=True",
                )
        pos += span.length
