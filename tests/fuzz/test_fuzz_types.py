"""Property: any value given to the public types either builds one or raises ValueError /
TypeError / KeyError naming the problem; nothing else escapes, and what builds round-trips."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ
from tinker_sr import types
from tinker_sr.provenance.validate import DatumSpans, SequenceRecord, validate_provenance
from tinker_sr.user_errors import EngineUserError

TYPED = (ValueError, TypeError, KeyError)

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
scalars = st.one_of(numbers, st.none(), st.text(max_size=3))
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=12
)  # ragged, nested, mixed
shapes = st.one_of(st.none(), st.lists(st.integers(-2, 10**14), max_size=3))
index_lists = st.one_of(st.none(), st.lists(st.integers(-3, 12), max_size=6))


@FUZZ
@given(data=values, dtype=st.sampled_from(["int64", "float32", "bool", None]), shape=shapes,
       crow=index_lists, col=index_lists)  # fmt: skip
def test_tensor_data_builds_or_raises_a_typed_error(
    data: Any, dtype: Any, shape: Any, crow: Any, col: Any
) -> None:
    try:
        td = types.TensorData(
            data=data, dtype=dtype, shape=shape, sparse_crow_indices=crow, sparse_col_indices=col
        )
    except TYPED:
        return
    try:
        td.check_sparse()
        if td.dense_size > 10**6:
            return  # refused by request validation before densifying (test_hardening 04)
        arr = td.to_numpy()
    except TYPED:
        return
    assert arr.dtype == (np.int64 if dtype == "int64" else np.float32)
    if shape is not None:
        assert list(arr.shape) == shape


loss_keys = st.sampled_from(
    ["target_tokens", "weights", "advantages", "logprobs", "clip_low_threshold", "custom_x"]
)
loss_values = st.one_of(
    values, st.builds(lambda n: np.arange(n, dtype=np.float64) / 3, st.integers(0, 5))
)


@FUZZ
@given(
    tokens=st.lists(st.integers(-5, 300), max_size=6),
    inputs=st.dictionaries(loss_keys, loss_values, max_size=4),
    with_spans=st.sampled_from([None, "model", "loss", "both"]),
)
def test_datum_coercion_builds_or_raises_a_typed_error(
    tokens: list[int], inputs: dict[str, Any], with_spans: str | None
) -> None:
    spans = [types.SampledProvenanceSpan(sequence_id="s", length=len(tokens))]
    kw: dict[str, Any] = {}
    if with_spans in ("model", "both"):
        kw["model_input_spans"] = spans
    if with_spans in ("loss", "both"):
        kw["loss_fn_input_spans"] = spans
    try:
        d = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs, **kw)
    except TYPED:
        return
    for key, td in d.loss_fn_inputs.items():
        assert isinstance(td, types.TensorData), key
        if key == "target_tokens":
            assert td.dtype == "int64" or isinstance(inputs[key], np.ndarray)


span_fields = st.tuples(st.text(max_size=3), st.integers(-2, 8), st.integers(-2, 8))
span_lists = st.lists(
    st.tuples(st.sampled_from(["prompt", "sampled"]), span_fields), min_size=0, max_size=4
)


def _spans(raw: list[tuple[str, tuple[str, int, int]]]) -> list[Any]:
    out: list[Any] = []
    for kind, (sid, offset, length) in raw:
        cls = types.PromptProvenanceSpan if kind == "prompt" else types.SampledProvenanceSpan
        out.append(cls(sequence_id=sid, offset=offset, length=length))
    return out


RECORD = SequenceRecord(
    sequence_id="s",
    session_id="sess",
    prompt_tokens=np.asarray([1, 2, 3], np.int32),
    sampled_tokens=np.asarray([4, 5], np.int32),
    sampler_logprobs=np.zeros(2, np.float32),
    draws=np.zeros((2, 8), np.int32),
    created_at=0.0,
    last_used_at=0.0,
)


class _Lookup:
    def get(self, sequence_id: str) -> SequenceRecord | None:
        return RECORD if sequence_id == "s" else None


@FUZZ
@given(
    mis=span_lists,
    lis=span_lists,
    tokens=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    loss_fn=st.sampled_from(["cross_entropy", "importance_sampling", "stable_reinforce"]),
)
def test_provenance_spans_validate_or_raise_a_user_error(
    mis: Any, lis: Any, tokens: list[int], loss_fn: str
) -> None:
    try:
        model_spans, loss_spans = _spans(mis), _spans(lis)
    except TYPED:
        return
    datum = DatumSpans(
        input_tokens=np.asarray(tokens, np.int64),
        target_tokens=np.asarray(tokens[1:] + [5], np.int64),
        advantages=np.ones(len(tokens), np.float32),
        model_input_spans=model_spans or None,
        loss_fn_input_spans=loss_spans or None,
    )
    try:
        views = validate_provenance(
            [datum], session_id="sess", lookup=_Lookup(), loss_fn=loss_fn, now=1.0
        )
    except EngineUserError as e:
        assert str(e).startswith("datum 0: "), e
        return
    assert len(views) == 1
