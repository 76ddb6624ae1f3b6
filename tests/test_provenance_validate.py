"""The provenance validator: one test per rule, each pinning the error and its message."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from tinker_sr.provenance.validate import (
    RECORD_TTL_SECONDS,
    DatumSpans,
    SequenceRecord,
    touch_ids,
    validate_provenance,
)
from tinker_sr.types.provenance_spans import PromptProvenanceSpan as P
from tinker_sr.types.provenance_spans import SampledProvenanceSpan as S
from tinker_sr.user_errors import EngineUserError

NOW = 1_000_000.0
PROMPT = [11, 12, 13, 14]
SAMPLED = [21, 22, 23]
DRAWS = np.arange(24, dtype=np.int32).reshape(3, 8)


class Lookup:
    """In-memory SequenceLookup that counts calls and never changes its records."""

    def __init__(self, *records: SequenceRecord) -> None:
        self.records = {r.sequence_id: r for r in records}

    def get(self, sequence_id: str) -> SequenceRecord | None:
        return self.records.get(sequence_id)


def record(
    sid: str = "s1",
    session: str = "sess",
    prompt: list[int] = PROMPT,
    sampled: list[int] = SAMPLED,
    draws: np.ndarray | None = DRAWS,
    last_used: float = NOW - 10,
) -> SequenceRecord:
    return SequenceRecord(
        sequence_id=sid,
        session_id=session,
        prompt_tokens=np.asarray(prompt, np.int32),
        sampled_tokens=np.asarray(sampled, np.int32),
        sampler_logprobs=np.full(len(sampled), -0.5, np.float32),
        draws=draws,
        created_at=last_used,
        last_used_at=last_used,
    )


def canonical(sid: str = "s1", adv: float = 1.0) -> DatumSpans:
    """The single-turn layout of spec/api.md §10.3 for PROMPT + SAMPLED."""
    p, s = len(PROMPT), len(SAMPLED)
    return DatumSpans(
        input_tokens=np.asarray(PROMPT + SAMPLED[:-1], np.int64),
        target_tokens=np.asarray([0] * (p - 1) + SAMPLED, np.int64),
        advantages=np.asarray([0.0] * (p - 1) + [adv] * s, np.float32),
        model_input_spans=[P(sequence_id=sid, length=p), S(sequence_id=sid, length=s - 1)],
        loss_fn_input_spans=[
            P(sequence_id=sid, offset=1, length=p - 1),
            S(sequence_id=sid, length=s),
        ],
    )


def run(data, lookup=None, loss_fn="stable_reinforce", session="sess", now=NOW):
    return validate_provenance(
        data,
        session_id=session,
        lookup=lookup if lookup is not None else Lookup(record()),
        loss_fn=loss_fn,
        now=now,
    )


def rejects(data, message, **kw) -> None:
    with pytest.raises(EngineUserError, match=re.escape(message)):
        run(data, **kw)


def test_canonical_single_turn_datum_passes_and_yields_mask_and_draws() -> None:
    (view,) = run([canonical()])
    assert view is not None
    np.testing.assert_array_equal(view.sampled_mask, [False] * 3 + [True] * 3)
    assert view.draws is not None and view.draws.dtype == np.int64
    np.testing.assert_array_equal(view.draws[:3], -1)
    np.testing.assert_array_equal(view.draws[3:], DRAWS)
    assert view.sequence_ids == frozenset({"s1"})


def test_datum_without_provenance_gives_none_for_other_losses() -> None:
    d = dataclasses.replace(canonical(), model_input_spans=None, loss_fn_input_spans=None)
    assert run([d], loss_fn="importance_sampling") == [None]


def test_only_one_span_list_is_rejected() -> None:
    d = dataclasses.replace(canonical(), loss_fn_input_spans=None)
    rejects(
        [d],
        "datum 0: model_input_spans is set but loss_fn_input_spans is not; provenance comes "
        "as a pair",
        loss_fn="cross_entropy",
    )
    d = dataclasses.replace(canonical(), model_input_spans=None)
    rejects([d], "datum 0: loss_fn_input_spans is set but model_input_spans is not")


def test_model_input_spans_must_tile_model_input() -> None:
    d = canonical()
    d.model_input_spans = [P(sequence_id="s1", length=4), S(sequence_id="s1", length=1)]
    rejects([d], "datum 0: model_input_spans cover 5 positions but model_input has 6")


def test_loss_spans_must_tile_target_rows() -> None:
    d = canonical()
    d.loss_fn_input_spans = [P(sequence_id="s1", offset=1, length=2), S(sequence_id="s1", length=3)]
    rejects([d], "datum 0: loss_fn_input_spans cover 5 positions but target_tokens has 6")


def test_loss_spans_tile_rows_of_2d_targets() -> None:
    d = canonical()
    d.target_tokens = np.zeros((7, 2), np.int64)
    rejects(
        [d],
        "datum 0: loss_fn_input_spans cover 6 positions but target_tokens has 7",
        loss_fn="cross_entropy",
    )
    # Correct row count with 2-D targets passes (target values are not compared in 2-D).
    d.target_tokens = np.zeros((6, 2), np.int64)
    (view,) = run([d], loss_fn="cross_entropy")
    assert view is not None and view.sampled_mask.sum() == 3


def test_an_empty_span_covers_nothing_and_still_names_a_known_sequence() -> None:
    """tinker-cookbook's ``recipes/rl_loop.py`` names a one-token sample's model_input run
    ``SampledProvenanceSpan(length=num_sampled - 1)``: length 0. SDK 0.38 accepts it, so does
    the engine (before: "length must be >= 1"); its sequence id must still be known."""
    d = canonical()
    d.loss_fn_input_spans = [
        P(sequence_id="s1", offset=1, length=3),
        S(sequence_id="s1", length=0),
        S(sequence_id="s1", length=3),
    ]
    (view,) = run([d])
    assert view is not None and view.sampled_mask.sum() == 3
    d.loss_fn_input_spans[1] = S(sequence_id="nope", length=0)
    rejects([d], "loss_fn_input_spans span 1 (SampledProvenanceSpan sequence_id='nope'")
    negative = object.__new__(S)  # past the constructor's own check, as a decoded one could be
    for field, value in (("sequence_id", "s1"), ("offset", 0), ("length", -1)):
        object.__setattr__(negative, field, value)
    d.loss_fn_input_spans[1] = negative
    rejects([d], "length must be >= 0")


def test_unknown_sequence_id_is_rejected() -> None:
    d = canonical(sid="nope")
    rejects(
        [d],
        "datum 0: model_input_spans span 0 (PromptProvenanceSpan sequence_id='nope', offset=0, "
        "length=4): sequence_id 'nope' is not known in this session; either its sample request "
        "never finished (it failed, or was cancelled: use only the sequences of a sample that "
        "returned), or it was sampled in another session (sequence ids resolve only in the "
        "session that sampled them",
    )


def test_other_sessions_sequence_looks_exactly_like_an_unknown_one() -> None:
    lookup = Lookup(record(sid="theirs", session="other"))
    with pytest.raises(EngineUserError) as foreign:
        run([canonical(sid="theirs")], lookup=lookup)
    with pytest.raises(EngineUserError) as unknown:
        run([canonical(sid="theirs")], lookup=Lookup())
    assert str(foreign.value) == str(unknown.value)
    # Even when that foreign record is expired: no hint that it exists.
    lookup = Lookup(record(sid="theirs", session="other", last_used=0.0))
    with pytest.raises(EngineUserError) as expired_foreign:
        run([canonical(sid="theirs")], lookup=lookup)
    assert str(expired_foreign.value) == str(unknown.value)


def test_expired_sequence_is_rejected_and_ttl_boundary_is_inclusive() -> None:
    lookup = Lookup(record(last_used=NOW - RECORD_TTL_SECONDS - 1))
    rejects(
        [canonical()],
        "datum 0: model_input_spans span 0 (PromptProvenanceSpan sequence_id='s1', offset=0, "
        "length=4): sequence 's1' expired (86401 s since its last use; records are kept "
        "86400 s after last use); sample it again",
        lookup=lookup,
    )
    assert run([canonical()], lookup=Lookup(record(last_used=NOW - RECORD_TTL_SECONDS)))[0]


def test_prompt_span_must_lie_inside_the_prompt() -> None:
    d = canonical()
    d.loss_fn_input_spans = [P(sequence_id="s1", offset=2, length=3), S(sequence_id="s1", length=3)]
    rejects(
        [d],
        "datum 0: loss_fn_input_spans span 0 (PromptProvenanceSpan sequence_id='s1', offset=2, "
        "length=3): runs past the end of the prompt of sequence 's1' (4 tokens); offset + "
        "length must not exceed that count",
    )


def test_sampled_span_must_lie_inside_the_sampled_tokens() -> None:
    d = canonical()
    d.model_input_spans = [P(sequence_id="s1", length=3), S(sequence_id="s1", offset=1, length=3)]
    rejects(
        [d],
        "datum 0: model_input_spans span 1 (SampledProvenanceSpan sequence_id='s1', offset=1, "
        "length=3): runs past the end of the sampled tokens of sequence 's1' (3 tokens)",
    )


def test_model_input_tokens_must_equal_recorded_tokens() -> None:
    d = canonical()
    d.input_tokens = np.asarray([11, 12, 99, 14, 21, 22], np.int64)
    rejects(
        [d],
        "datum 0: model_input_spans span 0 (PromptProvenanceSpan sequence_id='s1', offset=0, "
        "length=4): model_input token at position 2 is 99 but the recorded prompt token 2 is "
        "13; the training context must reproduce the sampling context",
    )
    d = canonical()
    d.input_tokens = np.asarray([11, 12, 13, 14, 21, 98], np.int64)
    rejects([d], "model_input token at position 5 is 98 but the recorded sampled token 1 is 22")


def test_targets_under_sampled_spans_must_equal_sampled_tokens() -> None:
    d = canonical()
    d.target_tokens = np.asarray([0, 0, 0, 21, 77, 23], np.int64)
    rejects(
        [d],
        "datum 0: loss_fn_input_spans span 1 (SampledProvenanceSpan sequence_id='s1', offset=0, "
        "length=3): target_tokens at position 4 is 77 but the recorded sampled token 1 is 22; "
        "targets under a SampledProvenanceSpan must be the sampled tokens",
    )


def test_targets_under_prompt_spans_are_not_checked() -> None:
    d = canonical()
    d.target_tokens = np.asarray([12, 13, 14, 21, 22, 23], np.int64)  # real tokens instead of 0
    assert run([d])[0] is not None
    d.target_tokens = np.asarray([5, 5, 5, 21, 22, 23], np.int64)  # arbitrary padding
    assert run([d])[0] is not None


def test_stable_reinforce_needs_provenance_on_every_datum() -> None:
    bare = dataclasses.replace(canonical(), model_input_spans=None, loss_fn_input_spans=None)
    rejects(
        [canonical(), bare],
        "datum 1: stable_reinforce needs provenance on every datum, but this one has no "
        "model_input_spans or loss_fn_input_spans",
    )


def test_stable_reinforce_needs_a_sampled_span_in_the_loss_spans() -> None:
    lookup = Lookup(record(prompt=PROMPT + SAMPLED))
    d = canonical(adv=0.0)
    d.model_input_spans = [P(sequence_id="s1", length=6)]
    d.loss_fn_input_spans = [P(sequence_id="s1", offset=1, length=6)]
    rejects(
        [d],
        "datum 0: stable_reinforce needs at least one SampledProvenanceSpan in loss_fn_input_spans",
        lookup=lookup,
    )
    assert run([d], lookup=lookup, loss_fn="importance_sampling")[0] is not None


def test_stable_reinforce_needs_every_sampled_token_covered_once() -> None:
    lookup = Lookup(record())
    d = canonical()
    # Last two sampled tokens only: the row predicting sampled token 0 is claimed as a prompt
    # position (each sampled token still follows the context it was sampled in).
    d.input_tokens = np.asarray(PROMPT + SAMPLED[:2], np.int64)
    d.model_input_spans = [P(sequence_id="s1", length=4), S(sequence_id="s1", length=2)]
    d.loss_fn_input_spans = [
        P(sequence_id="s1", offset=1, length=3),
        P(sequence_id="s1", length=1),
        S(sequence_id="s1", offset=1, length=2),
    ]
    d.target_tokens = np.asarray([0, 0, 0, 0, 22, 23], np.int64)
    d.advantages = np.asarray([0, 0, 0, 0, 1, 1], np.float32)
    rejects(
        [d],
        "datum 0: loss_fn_input_spans span 2 (SampledProvenanceSpan sequence_id='s1', offset=1, "
        "length=2): sampled token 0 of sequence 's1' is not covered (2 of 3 sampled tokens are); "
        "stable_reinforce trains on whole sampled sequences",
        lookup=lookup,
    )
    assert run([d], lookup=lookup, loss_fn="importance_sampling")[0] is not None


def test_a_sampled_token_trained_twice_is_rejected_by_its_context() -> None:
    # The second copy of sampled token 2 follows 7 tokens; it was sampled after 6. (Covering a
    # token twice always puts one copy in a context it was not sampled in.)
    d = canonical()
    d.input_tokens = np.asarray(PROMPT + SAMPLED, np.int64)
    d.model_input_spans = [P(sequence_id="s1", length=4), S(sequence_id="s1", length=3)]
    d.target_tokens = np.asarray([0, 0, 0, 21, 22, 23, 23], np.int64)
    d.advantages = np.asarray([0, 0, 0, 1, 1, 1, 1], np.float32)
    d.loss_fn_input_spans = [
        P(sequence_id="s1", offset=1, length=3),
        S(sequence_id="s1", length=3),
        S(sequence_id="s1", offset=2, length=1),
    ]
    for loss_fn in ("stable_reinforce", "importance_sampling"):
        with pytest.raises(EngineUserError, match="span 2 .*trained after 7 model_input tokens"):
            run([d], loss_fn=loss_fn)


def test_stable_reinforce_needs_stability_info_where_advantage_is_nonzero() -> None:
    lookup = Lookup(record(draws=None))
    rejects(
        [canonical()],
        "datum 0: loss_fn_input_spans span 1 (SampledProvenanceSpan sequence_id='s1', offset=0, "
        "length=3): sequence 's1' was sampled without stability info; sample with a client "
        "created with record_stability_info=True",
        lookup=lookup,
    )
    # Zero advantage (KL-only positions) needs no draws; other losses never need them.
    (view,) = run([canonical(adv=0.0)], lookup=lookup)
    assert view is not None and view.draws is None
    assert run([canonical()], lookup=lookup, loss_fn="importance_sampling")[0] is not None


def test_stable_reinforce_rejects_nonzero_advantage_outside_sampled_spans() -> None:
    d = canonical()
    d.advantages = np.asarray([0, 0.25, 0, 1, 1, 1], np.float32)
    rejects(
        [d],
        "datum 0: loss_fn_input_spans span 0 (PromptProvenanceSpan sequence_id='s1', offset=1, "
        "length=3): advantages[1] = 0.25 on a prompt position; stable_reinforce accepts "
        "non-zero advantages only on sampled tokens; set the advantages outside "
        "SampledProvenanceSpans to 0 (a KL penalty discounted onto prompt tokens, the "
        "cookbook's kl_discount_factor > 0, puts values there)",
    )
    assert run([d], loss_fn="ppo")[0] is not None


def test_span_of_a_foreign_type_is_rejected() -> None:
    d = canonical()
    d.model_input_spans = [{"sequence_id": "s1", "offset": 0, "length": 6}]  # type: ignore[list-item]
    rejects(
        [d],
        "datum 0: model_input_spans span 0 is a dict; expected PromptProvenanceSpan or "
        "SampledProvenanceSpan",
    )


def test_official_sdk_span_types_are_accepted() -> None:
    tinker_types = pytest.importorskip("tinker.types")
    d = canonical()
    d.model_input_spans = [
        tinker_types.PromptProvenanceSpan(sequence_id="s1", length=4),
        tinker_types.SampledProvenanceSpan(sequence_id="s1", length=2),
    ]
    d.loss_fn_input_spans = [
        tinker_types.PromptProvenanceSpan(sequence_id="s1", offset=1, length=3),
        tinker_types.SampledProvenanceSpan(sequence_id="s1", length=3),
    ]
    (view,) = run([d])
    assert view is not None and view.sampled_mask.sum() == 3


def test_two_sequences_in_one_datum_align_their_draws() -> None:
    draws2 = 100 + np.arange(8, dtype=np.int32).reshape(2, 4)  # K differs: padded with -1
    r2 = record(sid="s2", prompt=PROMPT + SAMPLED + [31], sampled=[41, 42], draws=draws2)
    lookup = Lookup(record(), r2)
    d = DatumSpans(
        input_tokens=np.asarray(PROMPT + SAMPLED + [31, 41], np.int64),
        target_tokens=np.asarray([0, 0, 0, 21, 22, 23, 31, 41, 42], np.int64),
        advantages=np.asarray([0, 0, 0, 1, 1, 1, 0, -1, -1], np.float32),
        model_input_spans=[
            P(sequence_id="s1", length=4),
            S(sequence_id="s1", length=3),
            P(sequence_id="s2", offset=7, length=1),
            S(sequence_id="s2", length=1),
        ],
        loss_fn_input_spans=[
            P(sequence_id="s1", offset=1, length=3),
            S(sequence_id="s1", length=3),
            P(sequence_id="s2", offset=7, length=1),
            S(sequence_id="s2", length=2),
        ],
    )
    (view,) = run([d], lookup=lookup)
    assert view is not None and view.draws is not None
    np.testing.assert_array_equal(view.sampled_mask, [0, 0, 0, 1, 1, 1, 0, 1, 1])
    np.testing.assert_array_equal(view.draws[3:6], DRAWS)
    np.testing.assert_array_equal(view.draws[7:, :4], draws2)
    np.testing.assert_array_equal(view.draws[7:, 4:], -1)
    np.testing.assert_array_equal(view.draws[6], -1)
    assert touch_ids([view, None]) == {"s1", "s2"}


def test_validation_is_pure() -> None:
    rec = record()
    lookup = Lookup(rec)
    d = canonical()
    before = (d.input_tokens.copy(), d.target_tokens.copy(), list(d.loss_fn_input_spans))
    run([d, canonical()], lookup=lookup)
    assert lookup.records["s1"] is rec and rec.last_used_at == NOW - 10
    np.testing.assert_array_equal(d.input_tokens, before[0])
    np.testing.assert_array_equal(d.target_tokens, before[1])
    assert d.loss_fn_input_spans == before[2]


def test_error_names_the_failing_datum_index() -> None:
    bad = canonical()
    bad.target_tokens = np.asarray([0, 0, 0, 21, 22, 24], np.int64)
    rejects([canonical(), canonical(), bad], "datum 2: loss_fn_input_spans span 1")
