"""The wire codec: generated module, protobuf and JSON round trips, and compatibility with
the official SDK's own converters (tinker/proto/request_conv.py and response_conv.py)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import pytest

from tinker_sr import types
from tinker_sr.wire import BodyTooLargeError, WireError, compression, proto
from tinker_sr.wire import messages as msgs
from tinker_sr.wire import tinker_public_pb2 as pb

REPO = Path(__file__).resolve().parents[1]


def _grpc_tools_version() -> str | None:
    try:
        return version("grpcio-tools")
    except PackageNotFoundError:
        return None


# ---- generated module -----------------------------------------------------------------


@pytest.mark.skipif(
    _grpc_tools_version() != "1.85.1" or shutil.which("bash") is None,
    reason="needs grpcio-tools==1.85.1 (the pinned generator)",
)
def test_committed_pb2_is_exactly_what_the_pinned_generator_produces(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, cwd=REPO
    )
    for name in ("tinker_public_pb2.py", "tinker_public_pb2.pyi"):
        fresh = (tmp_path / name).read_bytes()
        committed = (REPO / "tinker_sr" / "wire" / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run scripts/gen_proto.sh and commit it"


def test_schema_is_identical_to_the_official_sdk_descriptor() -> None:
    # Identical descriptors are what lets `tinker` and `tinker_sr` share one process.
    official = pytest.importorskip("tinker.proto.tinker_public_pb2")
    assert pb.DESCRIPTOR.serialized_pb == official.DESCRIPTOR.serialized_pb


# ---- tensors ------------------------------------------------------------------------------


def _roundtrip_tensor(td: types.TensorData) -> types.TensorData:
    return proto.tensor_from_proto(
        pb.Tensor.FromString(proto.tensor_to_proto(td).SerializeToString())
    )


@pytest.mark.parametrize(
    "td",
    [
        types.TensorData(data=[1.5, -2.0, 3.25], dtype="float32"),
        types.TensorData(data=[1, 2, 3, 2**40], dtype="int64"),
        types.TensorData(
            data=np.arange(6, dtype=np.float32).reshape(2, 3), dtype="float32", shape=[2, 3]
        ),
        types.TensorData(data=[], dtype="int64", shape=[0]),
    ],
    ids=["f32", "i64", "2d", "empty"],
)
def test_dense_tensor_roundtrips_values_dtype_and_shape(td: types.TensorData) -> None:
    back = _roundtrip_tensor(td)
    assert back.dtype == td.dtype
    np.testing.assert_array_equal(back.to_numpy(), td.to_numpy())
    assert list(back.to_numpy().shape) == list(td.to_numpy().shape)


def test_sparse_csr_tensor_stays_sparse_and_densifies_identically() -> None:
    import torch

    dense = torch.zeros(4, 6, dtype=torch.int64)
    dense[0, 1], dense[2, 5], dense[3, 0] = 7, 9, 11
    td = types.TensorData.from_torch_sparse(dense)
    assert td.sparse_crow_indices is not None
    back = _roundtrip_tensor(td)
    assert back.sparse_crow_indices == td.sparse_crow_indices
    assert back.sparse_col_indices == td.sparse_col_indices
    np.testing.assert_array_equal(back.to_numpy(), dense.numpy())


@pytest.mark.parametrize(
    ("tensor", "needle"),
    [
        (pb.Tensor(dense=b"\x00" * 6, dtype=pb.DTYPE_FLOAT32), "not a whole number of float32"),
        (
            pb.Tensor(dense=b"\x00" * 8, dtype=pb.DTYPE_FLOAT32, shape=[3]),
            "shape [3] needs 3 values",
        ),
        (pb.Tensor(dense=b"", dtype=pb.DTYPE_UNSPECIFIED), "DTYPE_UNSPECIFIED is not supported"),
        (pb.Tensor(dense=b"", dtype=pb.DTYPE_INT64, shape=[-1]), "negative dimension"),
        (
            pb.Tensor(
                sparse_csr=pb.SparseCsr(
                    values=np.ones(2, np.int64).tobytes(),
                    crow_indices=np.array([0, 1], np.int64).tobytes(),
                    col_indices=np.array([0, 5], np.int64).tobytes(),
                ),
                dtype=pb.DTYPE_INT64,
                shape=[2, 3],
            ),
            "crow_indices must have rows + 1 = 3",
        ),
        (
            pb.Tensor(
                sparse_csr=pb.SparseCsr(
                    values=np.ones(1, np.int64).tobytes(),
                    crow_indices=np.array([0, 1], np.int64).tobytes(),
                    col_indices=np.array([5], np.int64).tobytes(),
                ),
                dtype=pb.DTYPE_INT64,
                shape=[1, 3],
            ),
            "col_indices must hold nnz = 1 column indices in [0, 3)",
        ),
    ],
    ids=["ragged-bytes", "shape-mismatch", "no-dtype", "negative-dim", "bad-crow", "bad-col"],
)
def test_malformed_tensor_is_rejected_with_a_message_naming_the_problem(
    tensor: pb.Tensor, needle: str
) -> None:
    with pytest.raises(WireError, match=None) as info:
        proto.tensor_from_proto(tensor, "datum 0.loss_fn_inputs['weights']")
    assert needle in str(info.value)
    assert "datum 0.loss_fn_inputs['weights']" in str(info.value)


def test_int32_and_bfloat16_tensors_are_widened_on_decode() -> None:
    i32 = pb.Tensor(dense=np.array([1, -2], np.int32).tobytes(), dtype=pb.DTYPE_INT32)
    assert proto.tensor_from_proto(i32).dtype == "int64"
    assert proto.tensor_from_proto(i32).tolist() == [1, -2]
    bf16 = np.array([1.5, -2.0], np.float32).view(np.uint32) >> 16
    t = pb.Tensor(dense=bf16.astype(np.uint16).tobytes(), dtype=pb.DTYPE_BFLOAT16)
    assert proto.tensor_from_proto(t).tolist() == [1.5, -2.0]


# ---- forward_backward request ---------------------------------------------------------------


def _datums() -> list[types.Datum]:
    plain = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 0.5, 0.0]},
    )
    spans = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[1, 2, 3]),
                types.EncodedTextChunk(tokens=[100, 101, 102]),
            ]
        ),
        loss_fn_inputs={
            "target_tokens": [2, 3, 100, 101, 102, 103],
            "logprobs": [0.0, 0.0, -1.0, -1.5, -0.5, -0.25],
            "advantages": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        },
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="S", length=3),
            types.SampledProvenanceSpan(sequence_id="S", length=3),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="S", offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id="S", length=4),
        ],
    )
    return [plain, spans]


def _assert_datums_equal(got: list[types.Datum], want: list[types.Datum]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.model_input.to_ints() == w.model_input.to_ints()
        assert sorted(g.loss_fn_inputs) == sorted(w.loss_fn_inputs)
        for key in w.loss_fn_inputs:
            assert g.loss_fn_inputs[key].dtype == w.loss_fn_inputs[key].dtype
            np.testing.assert_array_equal(
                g.loss_fn_inputs[key].to_numpy(), w.loss_fn_inputs[key].to_numpy()
            )
        assert g.model_input_spans == w.model_input_spans
        assert g.loss_fn_input_spans == w.loss_fn_input_spans


def test_forward_backward_request_roundtrips_datums_spans_and_config() -> None:
    body = proto.encode_forward_backward_request(
        "s:train:0", 4, _datums(), "stable_reinforce", {"kl_coeff": 0.01, "mode": "x"}
    )
    call = proto.decode_forward_backward_request(body)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == (
        "s:train:0",
        4,
        "stable_reinforce",
        False,
    )
    assert call.loss_fn_config == {"kl_coeff": 0.01, "mode": "x"}
    _assert_datums_equal(call.data, _datums())


def test_forward_backward_request_rejects_garbage_unknown_fields_and_bad_seq_id() -> None:
    with pytest.raises(WireError, match="not a valid tinker_public.ForwardBackwardRequest"):
        proto.decode_forward_backward_request(b'{"model_id": "x"}')
    good = proto.encode_forward_backward_request("m", 1, _datums(), "cross_entropy")
    with pytest.raises(WireError, match=r"unknown protobuf field number\(s\) \[15\]"):
        proto.decode_forward_backward_request(good + b"\x78\x01")
    with pytest.raises(WireError, match="seq_id must be >= 1"):
        proto.decode_forward_backward_request(
            proto.encode_forward_backward_request("m", 0, _datums(), "cross_entropy")
        )
    half = pb.ForwardBackwardRequest.FromString(good)
    del half.data[1].loss_fn_input_spans[:]
    with pytest.raises(WireError, match="datum 1: provenance comes as a pair"):
        proto.decode_forward_backward_request(half.SerializeToString())


def test_decodes_what_the_official_sdk_request_converter_produces() -> None:
    tinker = pytest.importorskip("tinker")
    from tinker.proto.request_conv import forward_backward_request_to_proto

    official_datums = [
        tinker.types.Datum(
            model_input=tinker.types.ModelInput(
                chunks=[
                    tinker.types.EncodedTextChunk(tokens=list(c.tokens))
                    for c in d.model_input.chunks
                ]
            ),
            loss_fn_inputs={
                k: tinker.types.TensorData(data=v.to_numpy(), dtype=v.dtype, shape=v.shape)
                for k, v in d.loss_fn_inputs.items()
            },
            model_input_spans=[
                (
                    tinker.types.PromptProvenanceSpan
                    if isinstance(s, types.PromptProvenanceSpan)
                    else tinker.types.SampledProvenanceSpan
                )(sequence_id=s.sequence_id, offset=s.offset, length=s.length)
                for s in d.model_input_spans
            ]
            if d.model_input_spans
            else None,
            loss_fn_input_spans=[
                (
                    tinker.types.PromptProvenanceSpan
                    if isinstance(s, types.PromptProvenanceSpan)
                    else tinker.types.SampledProvenanceSpan
                )(sequence_id=s.sequence_id, offset=s.offset, length=s.length)
                for s in d.loss_fn_input_spans
            ]
            if d.loss_fn_input_spans
            else None,
        )
        for d in _datums()
    ]
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(
            data=official_datums,
            loss_fn="stable_reinforce",
            loss_fn_config={"kl_coeff": 0.5, "mode": "t"},
        ),
        model_id="sess:train:0",
        seq_id=7,
    )
    official_bytes = forward_backward_request_to_proto(request).SerializeToString()
    call = proto.decode_forward_backward_request(official_bytes)
    assert (call.model_id, call.seq_id, call.loss_fn) == ("sess:train:0", 7, "stable_reinforce")
    assert call.loss_fn_config == {"kl_coeff": 0.5, "mode": "t"}
    _assert_datums_equal(call.data, _datums())
    # And we write the same message the SDK writes.
    ours = proto.encode_forward_backward_request(
        "sess:train:0", 7, _datums(), "stable_reinforce", {"kl_coeff": 0.5, "mode": "t"}
    )
    assert pb.ForwardBackwardRequest.FromString(ours) == pb.ForwardBackwardRequest.FromString(
        official_bytes
    )


def test_zstd_bodies_roundtrip_and_the_decompressed_size_is_capped() -> None:
    body = proto.encode_forward_backward_request("m", 1, _datums(), "cross_entropy")
    assert compression.zstd_decompress(compression.zstd_compress(body), 1 << 20) == body
    with pytest.raises(BodyTooLargeError, match="exceeds the server's limit of 10 bytes"):
        compression.zstd_decompress(compression.zstd_compress(body), 10)
    with pytest.raises(WireError, match="not a zstd frame"):
        compression.zstd_decompress(b"definitely not zstd", 1 << 20)


# ---- forward_backward output ---------------------------------------------------------------


def _fb_output() -> types.ForwardBackwardOutput:
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[
            {
                "logprobs": types.TensorData(data=[-0.5, -1.0, -2.0], dtype="float32"),
                "elementwise_loss": types.TensorData(data=[0.5, 1.0, 2.0], dtype="float32"),
            },
            {
                "logprobs": types.TensorData(data=[-0.25], dtype="float32"),
                "elementwise_loss": types.TensorData(data=[0.25], dtype="float32"),
            },
        ],
        metrics={"loss:sum": 3.75},
    )


def _assert_outputs_equal(
    got: types.ForwardBackwardOutput, want: types.ForwardBackwardOutput
) -> None:
    assert got.loss_fn_output_type == want.loss_fn_output_type
    assert got.metrics == want.metrics
    assert len(got.loss_fn_outputs) == len(want.loss_fn_outputs)
    for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        assert sorted(g) == sorted(w)
        for k in w:
            assert g[k].dtype == w[k].dtype
            np.testing.assert_array_equal(g[k].to_numpy(), w[k].to_numpy())


def test_forward_backward_output_roundtrips_with_byte_offsets() -> None:
    body = proto.encode_forward_backward_output(_fb_output())
    msg = pb.ForwardBackwardOutput.FromString(body)
    (record,) = msg.loss_fn_outputs
    assert record.num_datums == 2
    assert np.frombuffer(record.fields["logprobs"].offsets, np.int64).tolist() == [0, 12, 16]
    _assert_outputs_equal(proto.decode_forward_backward_output(body), _fb_output())


def test_outputs_with_different_trailing_shapes_become_separate_records() -> None:
    out = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[
            {
                "x": types.TensorData(
                    data=np.ones((2, 3), np.float32), dtype="float32", shape=[2, 3]
                )
            },
            {
                "x": types.TensorData(
                    data=np.ones((1, 5), np.float32), dtype="float32", shape=[1, 5]
                )
            },
        ],
        metrics={},
    )
    body = proto.encode_forward_backward_output(out)
    assert len(pb.ForwardBackwardOutput.FromString(body).loss_fn_outputs) == 2
    _assert_outputs_equal(proto.decode_forward_backward_output(body), out)


def test_official_response_converter_parses_our_forward_backward_output() -> None:
    pytest.importorskip("tinker")
    from tinker.proto.response_conv import deserialize_forward_backward_output

    got = deserialize_forward_backward_output(proto.encode_forward_backward_output(_fb_output()))
    assert got.metrics == {"loss:sum": 3.75}
    assert got.loss_fn_output_type == "ArrayRecord"
    assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == [[-0.5, -1.0, -2.0], [-0.25]]


def test_corrupt_batched_offsets_are_rejected() -> None:
    msg = pb.ForwardBackwardOutput.FromString(proto.encode_forward_backward_output(_fb_output()))
    msg.loss_fn_outputs[0].fields["logprobs"].offsets = np.array([0, 12, 99], np.int64).tobytes()
    with pytest.raises(WireError, match="offsets must run from 0 to len"):
        proto.decode_forward_backward_output(msg.SerializeToString())


# ---- sample response ------------------------------------------------------------------------


def _sample_response() -> types.SampleResponse:
    topk = types.TopkLogprobs(
        token_ids=np.array([[5, 6], [7, 0]], np.int32),
        logprobs=np.array([[-0.1, -2.0], [-0.3, -99999.0]], np.float32),
    )
    return types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason="length",
                sequence_id="a",
                tokens_np=np.array([5, 7], np.int32),
                logprobs_np=np.array([-0.1, -0.3], np.float32),
                topk_logprobs_np=topk,
            ),
            types.SampledSequence(
                stop_reason="stop",
                sequence_id="b",
                _tokens_list=[9],
                _logprobs_list=[-0.7],
            ),
        ],
        prompt_logprobs_np=np.array([np.nan, -2.0, -2.5], np.float32),
        prompt_cache_hit_tokens=3,
        prompt_alt_tokens=types.PromptAltTokens(
            tokens=types.TensorData(data=[[1], [2]], dtype="int64", shape=[2, 1]),
            logprobs=types.TensorData(data=[[-1.0], [-2.0]], dtype="float32", shape=[2, 1]),
        ),
    )


def test_sample_response_roundtrips_and_takes_sequence_ids_from_the_promise() -> None:
    body = proto.encode_sample_response(_sample_response())
    got = proto.decode_sample_response(body, ["id-0", "id-1"])
    assert [s.sequence_id for s in got.sequences] == ["id-0", "id-1"]
    assert [s.tokens for s in got.sequences] == [[5, 7], [9]]
    assert [s.stop_reason for s in got.sequences] == ["length", "stop"]
    assert got.sequences[1].logprobs == pytest.approx([-0.7])
    assert got.sequences[0].topk_logprobs == [
        [(5, pytest.approx(-0.1)), (6, -2.0)],
        [(7, pytest.approx(-0.3))],
    ]
    assert got.prompt_logprobs == [None, -2.0, -2.5]
    assert got.prompt_cache_hit_tokens == 3
    assert got.prompt_alt_tokens is not None and got.prompt_alt_tokens.tokens.tolist() == [[1], [2]]
    with pytest.raises(WireError, match="has 2 sequences but the promise carried 1"):
        proto.decode_sample_response(body, ["only-one"])


def test_official_response_converter_parses_our_sample_response() -> None:
    pytest.importorskip("tinker")
    from tinker.proto.response_conv import deserialize_sample_response

    got = deserialize_sample_response(proto.encode_sample_response(_sample_response()))
    assert [s.tokens for s in got.sequences] == [[5, 7], [9]]
    assert [s.stop_reason for s in got.sequences] == ["length", "stop"]
    assert got.sequences[0].logprobs == pytest.approx([-0.1, -0.3])
    assert got.prompt_logprobs[0] is None and got.prompt_logprobs[1:] == [-2.0, -2.5]
    assert got.prompt_alt_tokens.logprobs.tolist() == [[-1.0], [-2.0]]


# ---- JSON messages --------------------------------------------------------------------------


def test_captured_sdk_request_bodies_parse() -> None:
    create = msgs.parse(
        msgs.CreateModelRequest,
        {
            "session_id": "sess-1",
            "model_seq_id": 0,
            "base_model": "Qwen/Qwen3-0.6B",
            "lora_config": {
                "rank": 8,
                "train_unembed": True,
                "train_mlp": True,
                "train_attn": True,
            },
            "optimizer_config": {"type": "adamw"},
            "type": "create_model",
        },
        "create_model",
    )
    assert create.lora_config == types.LoraConfig(rank=8)
    sample = msgs.parse(
        msgs.SampleRequest,
        {
            "num_samples": 2,
            "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 4, "temperature": 1.0, "top_k": -1, "top_p": 1.0},
            "sampling_session_id": "sess-1:sample:0",
            "seq_id": 0,
            "prompt_logprobs": True,
            "topk_prompt_logprobs": 0,
            "topk_sample_logprobs": 0,
            "prompt_alt_tokens_k": 0,
            "record_stability_info": True,
            "type": "sample",
        },
        "asample",
    )
    assert sample.prompt.to_ints() == [1, 2, 3]
    assert sample.sampling_params.to_public().max_tokens == 4
    step = msgs.parse(
        msgs.OptimStepRequest,
        {
            "model_id": "m",
            "seq_id": 2,
            "type": "optim_step",
            "adam_params": {
                "learning_rate": 0.0001,
                "beta1": 0.9,
                "beta2": 0.95,
                "eps": 1e-12,
                "weight_decay": 0.0,
                "grad_clip_norm": 0.0,
            },
        },
        "optim_step",
    )
    assert step.adam_params == types.AdamParams()


def test_official_sdk_request_models_serialise_to_bodies_we_accept() -> None:
    tinker = pytest.importorskip("tinker")
    body = tinker.types.SampleRequest(
        prompt=tinker.types.ModelInput.from_ints([1, 2]),
        sampling_params=tinker.types.SamplingParams(max_tokens=3, stop=["\n"], seed=2**63),
        sampling_session_id="s:sample:0",
        seq_id=1,
        prompt_logprobs=True,
        target_prompt_logprobs={"data": [5], "dtype": "int64", "shape": [1, 1]},
    ).model_dump(mode="json", exclude_none=True)
    parsed = msgs.parse(msgs.SampleRequest, body, "asample")
    assert parsed.sampling_params.stop == ["\n"]
    assert parsed.target_prompt_logprobs is not None
    assert parsed.target_prompt_logprobs.to_public("x").tolist() == [[5]]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"session_id": "s", "model_seq_id": "0", "base_model": "m"}, "field 'model_seq_id'"),
        ({"session_id": "s", "model_seq_id": 0}, "missing required field 'base_model'"),
        (
            {"session_id": "s", "model_seq_id": 0, "base_model": "m", "turbo": True},
            "unknown field 'turbo'",
        ),
        (
            {"session_id": "s", "model_seq_id": 0, "base_model": "m", "lora_config": {"rank": 8.5}},
            "field 'lora_config.rank'",
        ),
        (
            {"session_id": "s", "model_seq_id": 0, "base_model": "m", "type": "sample"},
            "field 'type'",
        ),
        ([1, 2], "must be a JSON object"),
    ],
    ids=["str-for-int", "missing", "unknown", "nested-type", "wrong-literal", "not-object"],
)
def test_wrong_json_types_are_rejected_with_the_field_named(body: object, needle: str) -> None:
    with pytest.raises(WireError) as info:
        msgs.parse(msgs.CreateModelRequest, body, "create_model")
    assert needle in str(info.value)
    assert str(info.value).startswith("create_model: ")


def test_to_json_omits_none_and_keeps_non_none_defaults() -> None:
    body = msgs.to_json(
        msgs.SaveWeightsForSamplerRequest(model_id="m", sampling_session_seq_id=0, seq_id=3)
    )
    assert body == {
        "model_id": "m",
        "sampling_session_seq_id": 0,
        "kind": "snapshot",
        "seq_id": 3,
        "type": "save_weights_for_sampler",
    }


def test_invalid_json_and_failure_payloads() -> None:
    with pytest.raises(WireError, match="not valid JSON"):
        msgs.parse_json(b"{nope", "get_info")
    assert msgs.parse_json(b"", "x") == {}
    assert msgs.future_failure("bad", types.RequestErrorCategory.User) == {
        "error": "bad",
        "category": "user",
    }
    assert msgs.category_of("weird") is types.RequestErrorCategory.Unknown
    # A diverged run's NaN metrics still reach the client.
    assert math.isnan(json.loads(msgs.dumps({"x": float("nan")}))["x"])
