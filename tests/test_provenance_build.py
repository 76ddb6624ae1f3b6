"""Datum builders: canonical layouts of spec/api.md §10.3 that pass the validator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinker_sr.types as T
from tinker_sr.engine.losses import LossDatum, compute_loss
from tinker_sr.provenance import (
    DatumSpans,
    SequenceRecord,
    build_datum,
    build_trajectory_datum,
    validate_provenance,
)

NOW = 5000.0


class Lookup:
    def __init__(self) -> None:
        self.records: dict[str, SequenceRecord] = {}

    def add(self, sid: str, prompt: list[int], sampled: list[int], k: int = 4) -> None:
        rng = np.random.default_rng(len(self.records))
        self.records[sid] = SequenceRecord(
            sequence_id=sid,
            session_id="sess",
            prompt_tokens=np.asarray(prompt, np.int32),
            sampled_tokens=np.asarray(sampled, np.int32),
            sampler_logprobs=np.full(len(sampled), -1.0, np.float32),
            draws=rng.integers(0, 50, size=(len(sampled), k)).astype(np.int32),
            created_at=NOW,
            last_used_at=NOW,
        )

    def get(self, sequence_id: str) -> SequenceRecord | None:
        return self.records.get(sequence_id)


def seq(types, sid: str, tokens: list[int]):
    return types.SampledSequence(
        stop_reason="stop",
        sequence_id=sid,
        tokens_np=np.asarray(tokens, np.int32),
        logprobs_np=-0.1 * np.arange(1, len(tokens) + 1, dtype=np.float32),
    )


def spans_of(datum) -> DatumSpans:
    inputs = datum.loss_fn_inputs
    return DatumSpans(
        input_tokens=np.asarray(datum.model_input.to_ints(), np.int64),
        target_tokens=np.asarray(inputs["target_tokens"].to_numpy(), np.int64),
        advantages=np.asarray(inputs["advantages"].to_numpy(), np.float32),
        model_input_spans=list(datum.model_input_spans),
        loss_fn_input_spans=list(datum.loss_fn_input_spans),
    )


def validate(datums, lookup):
    return validate_provenance(
        [spans_of(d) for d in datums],
        session_id="sess",
        lookup=lookup,
        loss_fn="stable_reinforce",
        now=NOW,
    )


def span_tuples(spans) -> list[tuple[str, str, int, int]]:
    return [(type(s).__name__[0], s.sequence_id, s.offset, s.length) for s in spans]


def test_single_turn_datum_has_the_canonical_layout_and_passes_the_validator() -> None:
    lookup = Lookup()
    lookup.add("a", [1, 2, 3, 4], [5, 6, 7])
    d = build_datum(T.ModelInput.from_ints([1, 2, 3, 4]), seq(T, "a", [5, 6, 7]), 0.5)
    assert isinstance(d, T.Datum)
    assert d.model_input.to_ints() == [1, 2, 3, 4, 5, 6]
    inputs = d.loss_fn_inputs
    assert inputs["target_tokens"].tolist() == [0, 0, 0, 5, 6, 7]
    assert inputs["target_tokens"].dtype == "int64"
    np.testing.assert_allclose(inputs["logprobs"].tolist(), [0, 0, 0, -0.1, -0.2, -0.3], 1e-6)
    assert inputs["advantages"].tolist() == [0, 0, 0, 0.5, 0.5, 0.5]
    assert span_tuples(d.model_input_spans) == [("P", "a", 0, 4), ("S", "a", 0, 2)]
    assert span_tuples(d.loss_fn_input_spans) == [("P", "a", 1, 3), ("S", "a", 0, 3)]
    (view,) = validate([d], lookup)
    assert view is not None and view.sampled_mask.tolist() == [False] * 3 + [True] * 3


def test_single_turn_accepts_token_lists_and_per_token_advantages() -> None:
    d = build_datum([1, 2], seq(T, "a", [5, 6, 7]), [1.0, -1.0, 0.25])
    assert d.loss_fn_inputs["advantages"].tolist() == [0, 1.0, -1.0, 0.25]
    with pytest.raises(ValueError, match="got 2 advantages for 3 sampled tokens"):
        build_datum([1, 2], seq(T, "a", [5, 6, 7]), [1.0, 2.0])


def test_single_turn_edge_lengths_drop_empty_runs() -> None:
    one_sampled = build_datum([1, 2, 3], seq(T, "a", [9]), 1.0)
    assert span_tuples(one_sampled.model_input_spans) == [("P", "a", 0, 3)]
    assert span_tuples(one_sampled.loss_fn_input_spans) == [("P", "a", 1, 2), ("S", "a", 0, 1)]
    one_prompt = build_datum([1], seq(T, "a", [8, 9]), 1.0)
    assert span_tuples(one_prompt.model_input_spans) == [("P", "a", 0, 1), ("S", "a", 0, 1)]
    assert span_tuples(one_prompt.loss_fn_input_spans) == [("S", "a", 0, 2)]
    lookup = Lookup()
    lookup.add("a", [1], [8, 9])
    assert validate([one_prompt], lookup)[0] is not None


def test_single_turn_keeps_non_text_prompt_chunks() -> None:
    image = T.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=3)
    prompt = T.ModelInput(chunks=[image, T.EncodedTextChunk(tokens=[1, 2])])
    d = build_datum(prompt, seq(T, "a", [5, 6]), 1.0)
    assert d.model_input.length == 6
    assert d.model_input.chunks[0] == image
    assert d.loss_fn_inputs["target_tokens"].tolist() == [0, 0, 0, 0, 5, 6]
    assert span_tuples(d.model_input_spans) == [("P", "a", 0, 5), ("S", "a", 0, 1)]


def test_multi_turn_layout_matches_the_spec_exactly() -> None:
    # Turn 0: prompt O0, action A0; turn 1: new obs O1 then A1; turn 2: no new obs, A2.
    o0, a0, o1, a1, a2 = [1, 2, 3], [10, 11], [4, 5], [12, 13, 14], [15]
    lookup = Lookup()
    lookup.add("t0", o0, a0)
    lookup.add("t1", o0 + a0 + o1, a1)
    lookup.add("t2", o0 + a0 + o1 + a1, a2)
    d = build_trajectory_datum(
        [(o0, seq(T, "t0", a0), 1.0), (o1, seq(T, "t1", a1), -0.5), ([], seq(T, "t2", a2), 2.0)]
    )
    full = o0 + a0 + o1 + a1 + a2
    assert d.model_input.to_ints() == full[:-1]
    assert d.loss_fn_inputs["target_tokens"].tolist() == full[1:]
    # Full-sequence runs: P(t0,0,3) S(t0,0,2) P(t1,5,2) S(t1,0,3) S(t2,0,1).
    assert span_tuples(d.model_input_spans) == [
        ("P", "t0", 0, 3),
        ("S", "t0", 0, 2),
        ("P", "t1", 5, 2),
        ("S", "t1", 0, 3),
    ]
    assert span_tuples(d.loss_fn_input_spans) == [
        ("P", "t0", 1, 2),
        ("S", "t0", 0, 2),
        ("P", "t1", 5, 2),
        ("S", "t1", 0, 3),
        ("S", "t2", 0, 1),
    ]
    assert d.loss_fn_inputs["advantages"].tolist() == [0, 0, 1, 1, 0, 0, -0.5, -0.5, -0.5, 2]
    np.testing.assert_allclose(
        d.loss_fn_inputs["logprobs"].tolist(),
        [0, 0, -0.1, -0.2, 0, 0, -0.1, -0.2, -0.3, -0.1],
        atol=1e-6,
    )
    (view,) = validate([d], lookup)
    assert view is not None
    assert view.sampled_mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1, 1]
    assert view.sequence_ids == {"t0", "t1", "t2"}
    np.testing.assert_array_equal(view.draws[9], lookup.records["t2"].draws[0])


def test_multi_turn_rejects_an_empty_first_observation() -> None:
    with pytest.raises(ValueError, match="turn 0: the first observation"):
        build_trajectory_datum([([], seq(T, "t0", [1, 2]), 1.0)])


def test_multi_turn_refuses_a_whole_prompt_as_an_observation() -> None:
    """A cookbook environment's observation is turn k's whole prompt; the builder wants only
    the new tokens. Passing the whole prompt built a datum the server refused ("runs past the
    end of the prompt"), naming neither the mistake nor the fix."""
    o0, a0, o1 = [1, 2, 3], [10, 11], [4, 5]
    with pytest.raises(ValueError, match=r"turn 1: .*repeats the 5 tokens .*observation\[5:\]"):
        build_trajectory_datum(
            [(o0, seq(T, "t0", a0), 1.0), (o0 + a0 + o1, seq(T, "t1", [12]), 1.0)]
        )


def test_official_tinker_types_are_built_and_validated() -> None:
    tinker_types = pytest.importorskip("tinker.types")
    lookup = Lookup()
    lookup.add("a", [1, 2, 3], [5, 6])
    d = build_datum(tinker_types.ModelInput.from_ints([1, 2, 3]), seq(tinker_types, "a", [5, 6]), 1)
    assert type(d) is tinker_types.Datum
    official = (tinker_types.PromptProvenanceSpan, tinker_types.SampledProvenanceSpan)
    assert all(type(s) in official for s in d.loss_fn_input_spans)
    assert validate([d], lookup)[0] is not None
    # Plain inputs with types= picks the official package too.
    d2 = build_trajectory_datum(
        [([1, 2, 3], seq(tinker_types, "a", [5, 6]), 1.0)], types=tinker_types
    )
    assert type(d2) is tinker_types.Datum
    assert span_tuples(d2.loss_fn_input_spans) == span_tuples(d.loss_fn_input_spans)


def test_built_datum_trains_with_stable_reinforce() -> None:
    lookup = Lookup()
    lookup.add("a", [1, 2, 3, 4], [5, 6, 7])
    d = build_datum([1, 2, 3, 4], seq(T, "a", [5, 6, 7]), 0.5)
    (view,) = validate([d], lookup)
    assert view is not None
    inputs = {
        k: torch.from_numpy(d.loss_fn_inputs[k].to_numpy()) for k in ("logprobs", "advantages")
    }
    datum = LossDatum(
        target_tokens=torch.from_numpy(d.loss_fn_inputs["target_tokens"].to_numpy()),
        inputs=inputs,
        draws=torch.from_numpy(view.draws),
        sampled_mask=torch.from_numpy(view.sampled_mask),
    )
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0), requires_grad=True)
    result = compute_loss("stable_reinforce", [logits], [datum], {})
    result.loss.backward()
    assert logits.grad is not None and logits.grad[:3].abs().max() == 0
    assert result.metrics["num_tokens:sum"] == 3
