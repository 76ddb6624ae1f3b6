"""Public types: construction, conversions, coercion and the client-side errors of spec §7/§11.

Parity tests run the same operation on the official ``tinker`` SDK (when installed) and on
``tinker_sr`` and compare what a user would observe.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import subprocess
import sys
import typing
from datetime import datetime
from typing import Any

import numpy as np
import pydantic
import pytest
import torch

import tinker_sr.types as T
from tinker_sr.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ImageChunk,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    TensorData,
)

try:
    import tinker.types as SDK  # the official SDK, for parity checks
except ImportError:  # pragma: no cover - parity tests skip without it
    SDK = None  # type: ignore[assignment]

needs_sdk = pytest.mark.skipif(SDK is None, reason="official tinker SDK not installed")
BOTH = [pytest.param(T, id="tinker_sr"), pytest.param(SDK, id="tinker", marks=needs_sdk)]


def _outcome(fn: Any) -> Any:
    """The result, or the exception type, so SDK and ours can be compared."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the type is what we compare
        return type(exc)


# --- package surface -----------------------------------------------------------------------

SPEC_NAMES = """Datum ModelInput ModelInputChunk EncodedTextChunk ImageChunk ImageAssetPointerChunk
DmelChunk TensorData TensorDtype LossFnInputs LossFnOutput LossFnType PromptProvenanceSpan
SampledProvenanceSpan ProvenanceSpans SamplingParams StopReason SampleRequest SampleResponse
SampledSequence PromptAltTokens SamplingClientKind ForwardBackwardInput ForwardBackwardOutput
OptimStepRequest OptimStepResponse AdamParams DimuonParams OptimParams AdamOptimizerConfig
DimuonOptimizerConfig OptimizerConfig LoraConfig GetInfoResponse ModelData
GetServerCapabilitiesResponse SupportedModel SaveWeightsResponse SaveWeightsForSamplerResponse
SaveWeightsExternalResponse LoadWeightsResponse Checkpoint CheckpointType
ParsedCheckpointTinkerPath CheckpointsListResponse TrainingRun TrainingRunsResponse ModelID
RequestErrorCategory CustomLossInput CustomLossInputRank ExternalWeightsUrlsResponse""".split()


def test_types_module_exposes_every_spec_name() -> None:
    missing = [name for name in SPEC_NAMES if not hasattr(T, name)]
    assert missing == []
    assert set(SPEC_NAMES) <= set(T.__all__)


def test_tensor_data_and_topk_submodule_paths_work() -> None:
    from tinker_sr.types.tensor_data import TensorData as TD
    from tinker_sr.types.topk_logprobs import TopkLogprobs

    assert TD is TensorData
    assert TopkLogprobs is T.TopkLogprobs


def test_importing_types_does_not_import_torch() -> None:
    code = "import sys, tinker_sr.types; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_sdk
@pytest.mark.parametrize("name", SPEC_NAMES)
def test_type_kind_fields_and_defaults_match_sdk(name: str) -> None:
    ours, theirs = getattr(T, name), getattr(SDK, name)
    if isinstance(theirs, type) and issubclass(theirs, pydantic.BaseModel):
        assert issubclass(ours, pydantic.BaseModel)
        for key in ("extra", "frozen"):
            assert ours.model_config.get(key) == theirs.model_config.get(key), key
        assert list(ours.model_fields) == list(theirs.model_fields)
        for field_name, info in theirs.model_fields.items():
            mine = ours.model_fields[field_name]
            assert mine.is_required() == info.is_required(), field_name
            if not info.is_required():
                assert repr(mine.default) == repr(info.default), field_name
    elif dataclasses.is_dataclass(theirs):
        assert dataclasses.is_dataclass(ours)

        def shape(cls: Any) -> list[tuple[str, str, bool]]:
            return [(f.name, repr(f.default), f.kw_only) for f in dataclasses.fields(cls)]

        assert shape(ours) == shape(theirs)
        for param in ("frozen", "eq", "init"):
            assert getattr(ours.__dataclass_params__, param) == getattr(
                theirs.__dataclass_params__, param
            ), param
    elif isinstance(theirs, type) and issubclass(theirs, enum.Enum):
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]
    else:
        assert _alias_shape(ours) == _alias_shape(theirs)


def _alias_shape(alias: Any) -> Any:
    """A type alias as nested names/literals, so aliases from two packages compare."""
    if isinstance(alias, type):
        return alias.__name__
    args = typing.get_args(alias)
    if not args:
        return repr(alias)
    if typing.get_origin(alias) is typing.Literal:
        return ("Literal", args)
    if typing.get_origin(alias) is typing.Annotated:
        return _alias_shape(args[0])
    return tuple(sorted(map(str, (_alias_shape(a) for a in args))))


def test_strict_base_forbids_unknown_fields_and_str_is_repr() -> None:
    with pytest.raises(pydantic.ValidationError):
        AdamParams(learning_rate=1e-3, lr=1.0)  # type: ignore[call-arg]
    params = AdamParams()
    assert str(params) == repr(params)
    with pytest.raises(pydantic.ValidationError):
        params.learning_rate = 1.0  # type: ignore[misc]


def test_response_base_ignores_unknown_fields() -> None:
    resp = T.OptimStepResponse.model_validate({"metrics": {"a:mean": 1.0}, "new_field": 3})
    assert resp.metrics == {"a:mean": 1.0}
    assert not hasattr(resp, "new_field")


# --- ModelInput and chunks --------------------------------------------------------------------


def test_model_input_from_ints_round_trips_and_length_is_a_property() -> None:
    mi = ModelInput.from_ints([1, 2, 3])
    assert mi.to_ints() == [1, 2, 3]
    assert mi.length == 3
    assert isinstance(mi.chunks[0], EncodedTextChunk)
    assert ModelInput.empty().length == 0


def test_model_input_append_returns_new_object() -> None:
    mi = ModelInput.from_ints([1])
    longer = mi.append(EncodedTextChunk(tokens=[2, 3])).append_int(4)
    assert mi.to_ints() == [1]
    assert longer.to_ints() == [1, 2, 3, 4]
    assert len(longer.chunks) == 3


def test_to_ints_rejects_non_text_chunks() -> None:
    mi = ModelInput(chunks=[ImageChunk(data=b"x", format="png", expected_tokens=2)])
    assert mi.length == 2
    with pytest.raises(ValueError, match="EncodedTextChunk"):
        mi.to_ints()


def test_image_chunk_length_needs_expected_tokens() -> None:
    with pytest.raises(ValueError, match="expected_tokens"):
        _ = ModelInput(chunks=[ImageChunk(data=b"x", format="jpeg")]).length
    with pytest.raises(ValueError, match="expected_tokens"):
        _ = T.ImageAssetPointerChunk(format="png", location="/x.png").length


def test_image_chunk_accepts_base64_and_serialises_as_base64() -> None:
    chunk = ImageChunk(data="aGk=", format="png")  # type: ignore[arg-type]
    assert chunk.data == b"hi"
    dumped = chunk.model_dump(mode="json")
    assert dumped["data"] == "aGk="
    assert ImageChunk.model_validate(dumped).data == b"hi"


def test_dmel_chunk_length_reads_dim0_from_container_header() -> None:
    # dtype byte 2, ndim 2, dims 300 (varint 0xAC 0x02) and 8
    header = bytes([2, 2, 0xAC, 0x02, 8]) + b"payload"
    assert T.DmelChunk(dmel=header).length == 300
    assert T.DmelChunk(dmel=bytes([254, 1, 1, 5])).length == 5  # constant-tensor marker
    with pytest.raises(ValueError):
        _ = T.DmelChunk(dmel=b"").length


def test_chunk_union_dispatches_on_type_and_defaults_to_text() -> None:
    mi = ModelInput.model_validate(
        {
            "chunks": [
                {"tokens": [1, 2]},
                {"type": "image", "data": "aGk=", "format": "png", "expected_tokens": 4},
                {"type": "image_asset_pointer", "format": "jpeg", "location": "s3://x"},
            ]
        }
    )
    assert [type(c).__name__ for c in mi.chunks] == [
        "EncodedTextChunk",
        "ImageChunk",
        "ImageAssetPointerChunk",
    ]
    with pytest.raises(pydantic.ValidationError):
        ModelInput.model_validate({"chunks": [{"type": "video"}]})


def test_model_input_json_round_trip() -> None:
    mi = ModelInput.from_ints([5, 6]).append(ImageChunk(data=b"\x00\x01", format="png"))
    assert ModelInput.model_validate_json(mi.model_dump_json()) == mi


@pytest.mark.parametrize("M", BOTH)
def test_model_input_json_matches_sdk_shape(M: Any) -> None:
    mi = M.ModelInput.from_ints([1]).append(M.ImageChunk(data=b"hi", format="png"))
    assert mi.model_dump(mode="json") == {
        "chunks": [
            {"tokens": [1], "type": "encoded_text"},
            {"data": "aGk=", "format": "png", "expected_tokens": None, "type": "image"},
        ]
    }


# --- TensorData -------------------------------------------------------------------------------


def test_tensor_data_requires_dtype_and_known_dtype() -> None:
    with pytest.raises(TypeError, match="dtype"):
        TensorData(data=[1, 2])
    with pytest.raises(ValueError, match="int32"):
        TensorData(data=[1], dtype="int32")  # type: ignore[arg-type]


def test_tensor_data_casts_and_reshapes() -> None:
    td = TensorData(data=[1.7, 2.2, 3.0, 4.0], dtype="int64", shape=[2, 2])
    assert td.tolist() == [[1, 2], [3, 4]]
    assert td.data == [1, 2, 3, 4]
    assert td.to_numpy().dtype == np.int64
    assert TensorData(dtype="float32").tolist() == []
    with pytest.raises(ValueError):
        TensorData(data=[1, 2, 3], dtype="int64", shape=[2, 2])


def test_tensor_data_copies_read_only_arrays() -> None:
    arr = np.frombuffer(np.arange(3, dtype=np.float32).tobytes(), dtype=np.float32)
    assert not arr.flags.writeable
    assert TensorData(data=arr, dtype="float32").to_numpy().flags.writeable


def test_tensor_data_uses_identity_equality_and_pickles() -> None:
    a = TensorData(data=[1], dtype="int64")
    b = TensorData(data=[1], dtype="int64")
    assert a != b and a == a
    restored = pickle.loads(pickle.dumps(a))
    assert restored.tolist() == [1] and restored.dtype == "int64"


@pytest.mark.parametrize(
    ("array", "dtype"),
    [
        (np.array([1.5], dtype=np.float64), "float32"),
        (np.array([[1, 2]], dtype=np.int32), "int64"),
        (np.array([1], dtype=np.int8), "int64"),
    ],
)
def test_from_numpy_maps_dtype_kind(array: np.ndarray, dtype: str) -> None:
    td = TensorData.from_numpy(array)
    assert td.dtype == dtype
    assert td.shape == list(array.shape)
    np.testing.assert_array_equal(td.to_numpy(), array)


@pytest.mark.parametrize("array", [np.array([True]), np.array([1], dtype=np.uint8)])
def test_from_numpy_rejects_non_int_float(array: np.ndarray) -> None:
    with pytest.raises(ValueError, match="Unsupported numpy dtype"):
        TensorData.from_numpy(array)


def test_from_torch_widens_and_round_trips() -> None:
    assert TensorData.from_torch(torch.tensor([1.5], dtype=torch.bfloat16)).dtype == "float32"
    assert TensorData.from_torch(torch.tensor([1.0], dtype=torch.float16)).dtype == "float32"
    ints = TensorData.from_torch(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    assert ints.dtype == "int64" and ints.shape == [2, 2]
    back = ints.to_torch()
    assert back.dtype == torch.int64 and back.tolist() == [[1, 2], [3, 4]]
    floats = TensorData.from_torch(torch.tensor([0.25, 0.5]))
    assert floats.to_torch().dtype == torch.float32


def test_from_torch_sparse_encodes_csr_when_smaller() -> None:
    dense = torch.full((4, 6), -1, dtype=torch.int64)
    dense[0, 0], dense[2, 3], dense[2, 5] = 7, 8, 9
    td = TensorData.from_torch_sparse(dense, pad_value=-1)
    assert td.is_sparse
    assert td.shape == [4, 6]
    assert td.sparse_crow_indices == [0, 1, 1, 3, 3]
    assert td.sparse_col_indices == [0, 3, 5]
    assert td.data == [7, 8, 9]
    assert td.tolist(pad_value=-1) == dense.tolist()
    assert torch.equal(td.to_torch(pad_value=-1), dense)
    # A different pad fills the unlisted cells with it.
    assert td.to_numpy(pad_value=0)[1].tolist() == [0] * 6


def test_from_torch_sparse_falls_back_to_dense() -> None:
    one_d = TensorData.from_torch_sparse(torch.zeros(5, dtype=torch.int64))
    assert not one_d.is_sparse and one_d.shape == [5]
    full = TensorData.from_torch_sparse(torch.ones(2, 2))
    assert not full.is_sparse and full.tolist() == [[1.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("pad", [1.0, True, "0", None])
def test_pad_value_must_be_an_int(pad: Any) -> None:
    sparse = TensorData(data=[1], dtype="int64", shape=[2, 2], sparse_crow_indices=[0, 1, 1])
    sparse = TensorData(
        data=[1], dtype="int64", shape=[2, 2], sparse_crow_indices=[0, 1, 1], sparse_col_indices=[0]
    )
    with pytest.raises(TypeError, match="pad_value"):
        TensorData.from_torch_sparse(torch.zeros(2, 2), pad_value=pad)
    with pytest.raises(TypeError, match="pad_value"):
        sparse.to_numpy(pad_value=pad)
    with pytest.raises(TypeError, match="pad_value"):
        sparse.to_torch(pad_value=pad)
    with pytest.raises(TypeError, match="pad_value"):
        sparse.tolist(pad_value=pad)
    assert sparse.tolist(pad_value=np.int64(3)) == [[1, 3], [3, 3]]


def test_invalid_csr_is_a_clear_error() -> None:
    bad = TensorData(
        data=[1, 2], dtype="int64", shape=[2, 2], sparse_crow_indices=[0, 1], sparse_col_indices=[0]
    )
    with pytest.raises(ValueError, match="CSR"):
        bad.tolist()


@needs_sdk
def test_sparse_encoding_matches_sdk() -> None:
    dense = torch.tensor([[3, 0, 0, 0, 0], [0, 0, 0, 0, 4], [0, 0, 0, 0, 0]])
    ours, theirs = TensorData.from_torch_sparse(dense), SDK.TensorData.from_torch_sparse(dense)
    for attr in ("dtype", "shape", "sparse_crow_indices", "sparse_col_indices", "data"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert repr(ours).replace("tinker_sr.types.tensor_data.", "") == repr(theirs).replace(
        "tinker.", ""
    )


# --- Datum ------------------------------------------------------------------------------------

MI4 = ModelInput.from_ints([1, 2, 3, 4])


def test_datum_is_a_frozen_dataclass_with_default_inputs() -> None:
    d = Datum(model_input=MI4)
    assert dataclasses.is_dataclass(d)
    assert d.loss_fn_inputs == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.model_input = MI4  # type: ignore[misc]


def test_datum_coerces_lists_by_key() -> None:
    d = Datum(
        model_input=MI4,
        loss_fn_inputs={
            "target_tokens": [2.0, 3.0, 4.0, 5.0],
            "weights": [1, 1, 0, 1],
            "advantages": [0.5] * 4,
            "logprobs": [-1.0] * 4,
            "sequence_ratio_mask": [1, 0, 0, 1],
            "clip_low_threshold": [0.8] * 4,
            "clip_high_threshold": [1.2] * 4,
        },
    )
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5]
    for key in ("weights", "advantages", "logprobs", "sequence_ratio_mask", "clip_low_threshold"):
        assert d.loss_fn_inputs[key].dtype == "float32", key
    assert d.loss_fn_inputs["weights"].shape == [4]


def test_datum_list_under_unknown_key_is_key_error() -> None:
    with pytest.raises(KeyError, match="my_key"):
        Datum(model_input=MI4, loss_fn_inputs={"my_key": [1.0, 2.0]})
    # ...but a numpy array or TensorData under a custom key is fine.
    d = Datum(model_input=MI4, loss_fn_inputs={"my_key": np.array([1.0, 2.0])})
    assert d.loss_fn_inputs["my_key"].dtype == "float32"


def test_datum_ragged_list_mentions_rectangular() -> None:
    with pytest.raises(ValueError, match="rectangular") as info:
        Datum(model_input=MI4, loss_fn_inputs={"target_tokens": [[1, 2], [3]]})
    assert "target_tokens" in str(info.value)


def test_datum_flat_bool_list_uses_key_dtype() -> None:
    d = Datum(model_input=MI4, loss_fn_inputs={"weights": [True, False]})
    assert d.loss_fn_inputs["weights"].dtype == "float32"
    assert d.loss_fn_inputs["weights"].tolist() == [1.0, 0.0]


def test_datum_numpy_keeps_array_dtype_not_key_dtype() -> None:
    d = Datum(model_input=MI4, loss_fn_inputs={"weights": np.array([1, 0])})
    assert d.loss_fn_inputs["weights"].dtype == "int64"


def test_datum_torch_2d_targets_become_sparse_when_worth_it() -> None:
    targets = torch.zeros(6, 8, dtype=torch.int64)
    targets[:, 0] = 5
    d = Datum(model_input=MI4, loss_fn_inputs={"target_tokens": targets, "advantages": targets})
    assert d.loss_fn_inputs["target_tokens"].is_sparse
    assert not d.loss_fn_inputs["advantages"].is_sparse  # only target_tokens/weights
    dense_1d = Datum(model_input=MI4, loss_fn_inputs={"weights": torch.ones(4)})
    assert not dense_1d.loss_fn_inputs["weights"].is_sparse


def test_datum_rejects_unsupported_values() -> None:
    with pytest.raises(TypeError, match="target_tokens"):
        Datum(model_input=MI4, loss_fn_inputs={"target_tokens": (1, 2, 3)})  # type: ignore[dict-item]


def test_replace_re_runs_coercion() -> None:
    d = Datum(model_input=MI4, loss_fn_inputs={"target_tokens": [1, 2, 3, 4]})
    d2 = dataclasses.replace(d, loss_fn_inputs={"target_tokens": torch.tensor([4, 3, 2, 1])})
    assert isinstance(d2.loss_fn_inputs["target_tokens"], TensorData)
    assert d2.loss_fn_inputs["target_tokens"].tolist() == [4, 3, 2, 1]
    with pytest.raises(KeyError):
        dataclasses.replace(d, loss_fn_inputs={"unknown": [1]})


SID = "seq-1"


def _spans(length: int) -> list[PromptProvenanceSpan | SampledProvenanceSpan]:
    return [
        PromptProvenanceSpan(sequence_id=SID, length=1),
        SampledProvenanceSpan(sequence_id=SID, length=length - 1),
    ]


def test_provenance_span_lists_must_come_as_a_pair() -> None:
    with pytest.raises(AssertionError, match="pair"):
        Datum(model_input=MI4, model_input_spans=_spans(4))
    with pytest.raises(AssertionError, match="pair"):
        Datum(model_input=MI4, loss_fn_input_spans=_spans(4))


def test_provenance_span_entries_must_be_span_types() -> None:
    with pytest.raises(TypeError, match="model_input_spans"):
        Datum(model_input=MI4, model_input_spans=[("x", 4)], loss_fn_input_spans=_spans(4))  # type: ignore[list-item]


def test_provenance_span_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="length"):
        PromptProvenanceSpan(sequence_id=SID, length=-1)
    with pytest.raises(ValueError, match="offset"):
        SampledProvenanceSpan(sequence_id=SID, offset=-1, length=1)
    with pytest.raises(ValueError, match="sequence_id"):
        SampledProvenanceSpan(sequence_id="", length=1)
    assert SampledProvenanceSpan(sequence_id=SID, length=0).length == 0  # SDK accepts 0


def test_with_provenance_sets_both_lists_after_tiling_check() -> None:
    d = Datum(model_input=MI4, loss_fn_inputs={"target_tokens": [2, 3, 4, 5]})
    p = d.with_provenance(model_input=_spans(4), loss_fn_inputs=_spans(4))
    assert p.model_input_spans == _spans(4) and p.loss_fn_input_spans == _spans(4)
    assert d.model_input_spans is None  # original untouched
    assert p.loss_fn_inputs["target_tokens"] is d.loss_fn_inputs["target_tokens"]


def test_with_provenance_tiling_mismatch_is_value_error() -> None:
    d = Datum(model_input=MI4, loss_fn_inputs={"target_tokens": [2, 3, 4, 5]})
    with pytest.raises(ValueError, match="cover 3 positions but the field has 4"):
        d.with_provenance(model_input=_spans(3), loss_fn_inputs=_spans(4))
    with pytest.raises(ValueError, match="loss_fn_inputs spans cover 5"):
        d.with_provenance(model_input=_spans(4), loss_fn_inputs=_spans(5))


def test_with_provenance_does_not_check_2d_targets_and_direct_construction_skips_it() -> None:
    d = Datum(model_input=MI4, loss_fn_inputs={"target_tokens": np.zeros((4, 2), dtype=np.int64)})
    assert d.with_provenance(model_input=_spans(4), loss_fn_inputs=_spans(9)).loss_fn_input_spans
    direct = Datum(model_input=MI4, model_input_spans=_spans(2), loss_fn_input_spans=_spans(7))
    assert direct.model_input_spans == _spans(2)


DATUM_CASES: dict[str, tuple[Any, Any]] = {
    "list_targets": ({"target_tokens": [1.0, 2.0]}, None),
    "unknown_key_list": ({"foo": [1, 2]}, None),
    "ragged": ({"weights": [[1.0], [1.0, 2.0]]}, None),
    "bools": ({"weights": [True, False]}, None),
    "tuple": ({"weights": (1.0,)}, None),
    "uint_array": ({"weights": np.array([1], dtype=np.uint8)}, None),
    "torch_2d": ({"target_tokens": torch.zeros(5, 9, dtype=torch.int64)}, None),
    "half_pair": ({}, "pair"),
}


@needs_sdk
@pytest.mark.parametrize("case", list(DATUM_CASES))
def test_datum_coercion_matches_sdk(case: str) -> None:
    inputs, extra = DATUM_CASES[case]

    def build(M: Any) -> Any:
        spans = [M.SampledProvenanceSpan(sequence_id="s", length=2)]
        kwargs = {"model_input_spans": spans} if extra == "pair" else {}
        d = M.Datum(model_input=M.ModelInput.from_ints([1, 2]), loss_fn_inputs=inputs, **kwargs)
        return {
            k: (v.dtype, v.shape, v.sparse_crow_indices, v.tolist())
            for k, v in d.loss_fn_inputs.items()
        }

    ours, sdk = _outcome(lambda: build(T)), _outcome(lambda: build(SDK))
    if isinstance(sdk, type):  # ours may be more specific, but code catching the SDK's works
        assert isinstance(ours, type) and issubclass(ours, sdk)
    else:
        assert ours == sdk


def test_loss_fn_input_aliases() -> None:
    assert T.LossFnInputs == dict[str, TensorData]
    assert T.LossFnOutput == dict[str, TensorData]


# --- sampling types ---------------------------------------------------------------------------


def test_sampling_params_defaults_and_extra_ignored() -> None:
    p = T.SamplingParams()
    assert (p.max_tokens, p.seed, p.stop, p.temperature, p.top_k, p.top_p) == (
        None,
        None,
        None,
        1,
        -1,
        1,
    )
    assert T.SamplingParams(max_tokens=3, stop=[], future_knob=1).stop == []  # type: ignore[call-arg]
    assert T.SamplingParams(stop="\n").stop == "\n"
    assert T.SamplingParams(stop=[13, 14]).stop == [13, 14]


def test_sampled_sequence_list_properties_convert_and_cache() -> None:
    seq = T.SampledSequence(
        stop_reason="stop",
        sequence_id="s1",
        tokens_np=np.array([5, 6], dtype=np.int32),
        logprobs_np=np.array([-0.5, -0.25], dtype=np.float32),
    )
    assert seq.tokens == [5, 6]
    assert seq.tokens is seq.tokens  # cached
    assert seq.logprobs == [-0.5, -0.25]
    assert seq.topk_logprobs is None
    empty = T.SampledSequence(stop_reason="length", sequence_id="s2")
    assert empty.tokens == [] and empty.logprobs is None


def test_sampled_sequence_prefers_private_lists() -> None:
    seq = T.SampledSequence(
        stop_reason="stop",
        sequence_id="s",
        _tokens_list=[1, 2],
        _logprobs_list=[-1.0, -2.0],
        _topk_logprobs_list=[None, [(3, -0.1)]],
    )
    assert seq.tokens == [1, 2]
    assert seq.logprobs == [-1.0, -2.0]
    assert seq.topk_logprobs == [None, [(3, -0.1)]]
    assert "tokens_np" not in repr(seq)


def test_topk_logprobs_drop_trailing_sentinels_and_all_sentinel_rows() -> None:
    sentinel = -99999.0
    topk = T.TopkLogprobs(
        token_ids=np.array([[4, 2, 0], [0, 0, 0], [7, 0, 0]], dtype=np.int32),
        logprobs=np.array(
            [[-0.5, -1.5, sentinel], [sentinel] * 3, [-0.25, sentinel, sentinel]],
            dtype=np.float32,
        ),
    )
    seq = T.SampledSequence(stop_reason="length", sequence_id="s", topk_logprobs_np=topk)
    assert seq.topk_logprobs == [[(4, -0.5), (2, -1.5)], None, [(7, -0.25)]]
    assert not hasattr(topk, "__dict__")  # slots, as in the SDK


@needs_sdk
def test_topk_lists_match_sdk() -> None:
    from tinker.types.topk_logprobs import TopkLogprobs as OTopk
    from tinker.types.topk_logprobs import topk_to_lists as o_lists

    from tinker_sr.types.topk_logprobs import topk_to_lists

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 3, size=(20, 4)).astype(np.int32)
    lps = np.where(rng.random((20, 4)) < 0.4, -99999.0, -rng.random((20, 4))).astype(np.float32)
    assert topk_to_lists(T.TopkLogprobs(ids, lps)) == o_lists(OTopk(ids, lps))


def test_sample_response_prompt_logprobs_nan_becomes_none() -> None:
    resp = T.SampleResponse(
        sequences=[T.SampledSequence(stop_reason="stop", sequence_id="a")],
        prompt_logprobs_np=np.array([np.nan, -1.0, -2.0], dtype=np.float32),
    )
    assert resp.prompt_logprobs == [None, -1.0, -2.0]
    assert resp.prompt_cache_hit_tokens == 0
    assert resp.topk_prompt_logprobs is None
    assert T.SampleResponse(sequences=[]).prompt_logprobs is None
    listed = T.SampleResponse(sequences=[], _prompt_logprobs_list=[None, -3.0])
    assert listed.prompt_logprobs == [None, -3.0]


def test_sample_request_is_strict_and_round_trips_target_tensor() -> None:
    ids = TensorData.from_torch_sparse(torch.tensor([[5, -1, -1, -1], [-1] * 4, [-1] * 4]), -1)
    req = T.SampleRequest(
        prompt=MI4, sampling_params=T.SamplingParams(max_tokens=2), target_prompt_logprobs=ids
    )
    assert req.num_samples == 1 and req.type == "sample" and req.prompt_alt_tokens_k == 0
    dumped = req.model_dump(mode="json")
    assert dumped["target_prompt_logprobs"]["sparse_crow_indices"] == [0, 1, 1, 1]
    again = T.SampleRequest.model_validate(dumped)
    assert again.target_prompt_logprobs is not None
    assert again.target_prompt_logprobs.tolist(pad_value=-1) == ids.tolist(pad_value=-1)
    with pytest.raises(pydantic.ValidationError):
        T.SampleRequest(prompt=MI4, sampling_params=T.SamplingParams(), bogus=1)  # type: ignore[call-arg]


def test_prompt_alt_tokens_is_a_frozen_pair() -> None:
    alt = T.PromptAltTokens(
        tokens=TensorData(data=[1, 2], dtype="int64", shape=[2, 1]),
        logprobs=TensorData(data=[-1.0, -2.0], dtype="float32", shape=[2, 1]),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        alt.tokens = alt.logprobs  # type: ignore[misc]


# --- training, optimizer, LoRA ----------------------------------------------------------------


def test_forward_backward_output_has_metrics_default_and_no_loss_attribute() -> None:
    out = T.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[{}])
    assert out.metrics == {}
    assert not hasattr(out, "loss")


def test_adam_params_defaults() -> None:
    p = AdamParams()
    assert (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm) == (
        1e-4,
        0.9,
        0.95,
        1e-12,
        0.0,
        0.0,
    )


def test_dimuon_params_validation() -> None:
    assert T.DimuonParams(learning_rate=0.02).type == "dimuon"
    for bad in (
        {},
        {"learning_rate": -1.0},
        {"learning_rate": float("inf")},
        {"learning_rate": 1.0, "beta1": 1.0},
        {"learning_rate": 1.0, "momentum": 0.5},
    ):
        with pytest.raises(pydantic.ValidationError):
            T.DimuonParams(**bad)
    assert isinstance(T.DimuonParams(learning_rate=1.0), T.OptimParamsBase)
    assert T.OptimParamsBase(type="lion", lr=1.0).model_extra == {"lr": 1.0}  # type: ignore[call-arg]


def test_optimizer_configs() -> None:
    assert T.AdamOptimizerConfig().type == "adamw"
    dimuon = T.DimuonOptimizerConfig()
    assert (dimuon.type, dimuon.version) == ("dimuon", 1)
    assert T.OptimizerConfigBase(type="x", knob=1).model_extra == {"knob": 1}  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        T.AdamOptimizerConfig(knob=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("M", BOTH)
def test_optim_step_request_aliases_and_wire_keys(M: Any) -> None:
    adam = M.OptimStepRequest(adam_params=M.AdamParams(learning_rate=0.5), model_id="m")
    assert adam.optim_params.learning_rate == 0.5
    assert "adam_params" in adam.model_dump() and "optim_params" not in adam.model_dump()
    other = M.OptimStepRequest(optimizer_params=M.DimuonParams(learning_rate=1.0), model_id="m")
    assert other.model_dump()["optimizer_params"]["type"] == "dimuon"
    assert M.OptimStepRequest(optim_params=M.AdamParams(), model_id="m", seq_id=3).seq_id == 3


def test_lora_config_requires_rank() -> None:
    with pytest.raises(pydantic.ValidationError):
        T.LoraConfig()  # type: ignore[call-arg]
    cfg = T.LoraConfig(rank=8)
    assert (cfg.seed, cfg.train_unembed, cfg.train_mlp, cfg.train_attn) == (None, True, True, True)


def test_forward_backward_input_is_dataclass() -> None:
    fbi = T.ForwardBackwardInput(data=[Datum(model_input=MI4)], loss_fn="cross_entropy")
    assert fbi.loss_fn_config is None


def test_loss_fn_type_values() -> None:
    from typing import get_args

    assert set(get_args(T.LossFnType)) == {
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
        "gspo",
        "stable_reinforce",
        "custom",
    }


# --- info, checkpoints, misc ------------------------------------------------------------------


def test_get_info_response_defaults() -> None:
    info = T.GetInfoResponse(model_data=T.ModelData(), model_id="run:train:0")
    assert info.optimizer_config == T.AdamOptimizerConfig()
    assert info.model_data.tokenizer_id is None
    parsed = T.GetInfoResponse.model_validate(
        {"model_data": {}, "model_id": "x", "optimizer_config": {"type": "dimuon", "version": 1}}
    )
    assert parsed.optimizer_config.type == "dimuon"


def test_server_capabilities_parse() -> None:
    caps = T.GetServerCapabilitiesResponse.model_validate(
        {"supported_models": [{"model_name": "tiny", "trainable": True, "other": 1}]}
    )
    assert caps.supported_models[0].model_name == "tiny"
    assert caps.supported_models[0].max_context_length is None


@pytest.mark.parametrize(
    ("path", "kind", "checkpoint_id"),
    [
        ("tinker://s:train:0/weights/step-100", "training", "weights/step-100"),
        ("tinker://s:train:0/sampler_weights/final", "sampler", "sampler_weights/final"),
        ("tinker://r/external_weights/x", "external", "external_weights/x"),
    ],
)
def test_parse_tinker_path(path: str, kind: str, checkpoint_id: str) -> None:
    parsed = T.ParsedCheckpointTinkerPath.from_tinker_path(path)
    assert parsed.checkpoint_type == kind
    assert parsed.checkpoint_id == checkpoint_id
    assert parsed.tinker_path == path
    assert parsed.training_run_id == path.split("/")[2]


BAD_PATHS = [
    "s:train:0/weights/x",
    "tinker://s/weights",
    "tinker://s/weights/a/b",
    "tinker://s/checkpoints/x",
    "http://s/weights/x",
]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_parse_tinker_path_rejects_malformed(path: str) -> None:
    with pytest.raises(ValueError, match=f"^Invalid tinker path: {path}$"):
        T.ParsedCheckpointTinkerPath.from_tinker_path(path)


@needs_sdk
@pytest.mark.parametrize("path", [*BAD_PATHS, "tinker://a:train:1/sampler_weights/s"])
def test_parse_tinker_path_matches_sdk(path: str) -> None:
    def parse(M: Any) -> Any:
        return M.ParsedCheckpointTinkerPath.from_tinker_path(path).model_dump()

    assert _outcome(lambda: parse(T)) == _outcome(lambda: parse(SDK))


@pytest.mark.parametrize("M", BOTH)
def test_save_responses_console_urls(M: Any) -> None:
    resp = M.SaveWeightsForSamplerResponse(path="tinker://s:train:0/sampler_weights/f")
    assert resp.get_console_url().endswith("/checkpoints/s%3Atrain%3A0/sampler_weights%2Ff")
    assert "mode=checkpoint" in resp.get_playground_url()
    save = M.SaveWeightsResponse(path="tinker://s:train:0/weights/w")
    assert save.get_console_url().endswith("/weights%2Fw")


def test_checkpoint_and_training_run_parse() -> None:
    now = datetime(2025, 1, 1)
    ckpt = T.Checkpoint(
        checkpoint_id="weights/a",
        checkpoint_type="training",
        time=now,
        tinker_path="tinker://r/weights/a",
    )
    assert (ckpt.public, ckpt.size_bytes, ckpt.expires_at) == (False, None, None)
    with pytest.raises(pydantic.ValidationError):
        T.Checkpoint(checkpoint_id="x", checkpoint_type="bogus", time=now, tinker_path="p")  # type: ignore[arg-type]
    run = T.TrainingRun(
        training_run_id="r",
        base_model="tiny",
        model_owner="me",
        is_lora=True,
        last_request_time=now,
        last_checkpoint=ckpt,
    )
    assert run.corrupted is False and run.last_checkpoint == ckpt
    runs = T.TrainingRunsResponse.model_validate(
        {
            "training_runs": [run.model_dump()],
            "cursor": {"offset": 0, "limit": 20, "total_count": 1},
        }
    )
    assert runs.training_runs[0].training_run_id == "r"
    assert T.CheckpointsListResponse(checkpoints=[ckpt]).cursor is None


def test_save_load_and_external_responses() -> None:
    assert T.LoadWeightsResponse().path is None
    assert T.SaveWeightsExternalResponse(path="tinker://r/external_weights/x").type is None
    urls = T.ExternalWeightsUrlsResponse(urls={"a": "b"}, expires=datetime(2030, 1, 1))
    assert urls.urls == {"a": "b"}


def test_request_error_category_is_str_enum() -> None:
    assert T.RequestErrorCategory.User == "user"
    assert [c.value for c in T.RequestErrorCategory] == ["unknown", "server", "user"]


def test_custom_loss_input_rank_is_0_1_or_2() -> None:
    assert T.CustomLossInput(name="adv", rank=1).rank == 1
    with pytest.raises(pydantic.ValidationError):
        T.CustomLossInput(name="adv", rank=3)  # type: ignore[arg-type]


def test_model_id_is_str() -> None:
    assert T.ModelID is str


def test_no_type_warns_of_its_model_fields_on_older_pydantic() -> None:
    """``pydantic>=2.5`` is declared; before 2.10, a field named ``model_*`` (``model_id``,
    ``model_path``) warned "has conflict with protected namespace 'model_'" unless its class
    cleared the namespaces. Six classes did not: ``import tinker_sr`` warned six times and
    failed under ``-W error``. The two bases clear them now, for every type."""
    import inspect

    import pydantic

    from tinker_sr import types as t

    models = [
        c for _, c in inspect.getmembers(t, inspect.isclass) if issubclass(c, pydantic.BaseModel)
    ]
    assert len(models) > 50
    fielded = [c for c in models if any(f.startswith("model_") for f in c.model_fields)]
    assert fielded  # e.g. CreateModelResponse.model_id
    for cls in models:
        assert cls.model_config.get("protected_namespaces") == (), cls.__name__
