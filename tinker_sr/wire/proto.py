"""Protobuf half of the wire codec (schema: ``tinker_public.proto``).

Three things travel as protobuf: the ``forward_backward`` request body, and the results of
forward/backward and sample futures. Everything here converts between those messages and
the public types, in both directions, so the server and `RemoteBackend` share one
implementation. Decoders validate as they go and raise `WireError` naming the field that
is wrong; they never trust a length, shape or offset they were sent.

Byte payloads are little-endian: token ids int32, ``TensorData`` in its declared dtype,
CSR indices and ``BatchedTensor`` offsets int64 (offsets count *bytes*).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from tinker_sr import validation
from tinker_sr.types import (
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageAssetPointerChunk,
    ImageChunk,
    ModelInput,
    ModelInputChunk,
    PromptAltTokens,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
    SampleResponse,
    TensorData,
    TopkLogprobs,
)
from tinker_sr.types.topk_logprobs import MASK_LOGPROB

from . import tinker_public_pb2 as pb
from .errors import WireError

__all__ = [
    "ForwardBackwardCall",
    "encode_forward_backward_request",
    "decode_forward_backward_request",
    "peek_forward_backward_target",
    "encode_forward_backward_output",
    "decode_forward_backward_output",
    "encode_sample_response",
    "decode_sample_response",
    "tensor_to_proto",
    "tensor_from_proto",
    "span_to_proto",
    "span_from_proto",
    "datum_to_proto",
    "datum_from_proto",
]

_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_U16 = np.dtype("<u2")

_DTYPE_TO_PROTO = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_NUMPY_OF: dict[str, np.dtype[Any]] = {"float32": _F32, "int64": _I64}
# proto dtype -> (numpy dtype of the bytes, public dtype after widening)
_FROM_PROTO: dict[int, tuple[np.dtype[Any], str]] = {
    pb.DTYPE_FLOAT32: (_F32, "float32"),
    pb.DTYPE_INT64: (_I64, "int64"),
    pb.DTYPE_INT32: (_I32, "int64"),
    pb.DTYPE_BFLOAT16: (_U16, "float32"),
}
_STOP_TO_PROTO = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_STOP_FROM_PROTO = {v: k for k, v in _STOP_TO_PROTO.items()}


# ---- raw arrays -------------------------------------------------------------------------


def _frombuffer(data: bytes, dtype: np.dtype[Any], where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise WireError(
            f"{where}: {len(data)} bytes is not a whole number of {dtype.name} values "
            f"({dtype.itemsize} bytes each)"
        )
    return np.frombuffer(data, dtype=dtype)


def _widen(arr: np.ndarray, proto_dtype: int) -> np.ndarray:
    """int32 -> int64 and bfloat16 -> float32, the two widenings the public types need."""
    if proto_dtype == pb.DTYPE_INT32:
        return arr.astype(np.int64)
    if proto_dtype == pb.DTYPE_BFLOAT16:
        # bfloat16 is the top half of a float32: shift into place, reinterpret.
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def _dtype_name(value: int) -> str:
    try:
        return pb.DType.Name(value)
    except ValueError:
        return str(value)


def _check_no_unknown_fields(msg: Message, where: str) -> None:
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise WireError(
            f"{where}: unknown protobuf field number(s) {numbers} in {msg.DESCRIPTOR.full_name}; "
            "this server speaks the tinker SDK 0.38 schema and does not ignore fields it "
            "does not understand"
        )


# ---- tensors ------------------------------------------------------------------------------


def tensor_to_proto(td: TensorData, msg: pb.Tensor | None = None) -> pb.Tensor:
    """``TensorData`` -> ``Tensor`` (dense, or CSR when the TensorData is sparse)."""
    if msg is None:
        msg = pb.Tensor()
    np_dtype = _NUMPY_OF.get(td.dtype)
    if np_dtype is None:
        raise WireError(f"TensorData dtype {td.dtype!r} cannot be sent; use float32 or int64")
    msg.dtype = _DTYPE_TO_PROTO[td.dtype]
    if td.sparse_crow_indices is not None:
        if td.sparse_col_indices is None or td.shape is None:
            raise WireError("sparse TensorData needs sparse_col_indices and a 2-D shape")
        # The stored CSR values; TensorData has no public accessor for them as an array.
        values = np.asarray(td._numpy, dtype=np_dtype).ravel()
        msg.sparse_csr.values = values.tobytes()
        msg.sparse_csr.crow_indices = np.asarray(td.sparse_crow_indices, dtype=_I64).tobytes()
        msg.sparse_csr.col_indices = np.asarray(td.sparse_col_indices, dtype=_I64).tobytes()
        msg.shape.extend(td.shape)
    else:
        arr = td.to_numpy()
        msg.dense = np.ascontiguousarray(arr, dtype=np_dtype).tobytes()
        msg.shape.extend(arr.shape)
    return msg


def tensor_from_proto(msg: pb.Tensor, where: str = "tensor") -> TensorData:
    """``Tensor`` -> ``TensorData``; a CSR tensor stays sparse. Empty shape = 1-D."""
    entry = _FROM_PROTO.get(msg.dtype)
    if entry is None:
        raise WireError(
            f"{where}: dtype {_dtype_name(msg.dtype)} is not supported; send DTYPE_FLOAT32 "
            "or DTYPE_INT64"
        )
    src, public = entry
    shape = [int(d) for d in msg.shape]
    if any(d < 0 for d in shape):
        raise WireError(f"{where}: shape {shape} has a negative dimension")
    if msg.WhichOneof("encoding") == "sparse_csr":
        return _csr_from_proto(msg, src, public, shape, where)
    arr = _widen(_frombuffer(msg.dense, src, f"{where}.dense"), msg.dtype)
    if not shape:
        return TensorData(data=arr, dtype=public, shape=[int(arr.size)])  # type: ignore[arg-type]
    if math.prod(shape) != arr.size:
        raise WireError(
            f"{where}: shape {shape} needs {math.prod(shape)} values but the dense data holds "
            f"{arr.size}"
        )
    try:
        arr = arr.reshape(shape)
    except ValueError:  # e.g. [0, 2**62]: no values, but dimensions numpy cannot index
        raise WireError(
            f"{where}: shape {shape} is not an array shape this server can hold; send the "
            "tensor's real dimensions"
        ) from None
    return TensorData(data=arr, dtype=public, shape=shape)  # type: ignore[arg-type]


def _csr_from_proto(
    msg: pb.Tensor, src: np.dtype[Any], public: str, shape: list[int], where: str
) -> TensorData:
    if len(shape) != 2:
        raise WireError(f"{where}: a sparse CSR tensor needs a 2-D dense shape, got {shape}")
    csr = msg.sparse_csr
    values = _widen(_frombuffer(csr.values, src, f"{where}.sparse_csr.values"), msg.dtype)
    crow = _frombuffer(csr.crow_indices, _I64, f"{where}.sparse_csr.crow_indices")
    col = _frombuffer(csr.col_indices, _I64, f"{where}.sparse_csr.col_indices")
    rows, cols = shape
    nnz = values.size
    if len(crow) != rows + 1 or (rows + 1 and (crow[0] != 0 or crow[-1] != nnz)):
        raise WireError(
            f"{where}: CSR crow_indices must have rows + 1 = {rows + 1} entries running from 0 "
            f"to nnz = {nnz}; got {len(crow)} entries"
        )
    if np.any(np.diff(crow) < 0):
        raise WireError(f"{where}: CSR crow_indices must be non-decreasing")
    if len(col) != nnz or (nnz and (col.min() < 0 or col.max() >= cols)):
        raise WireError(
            f"{where}: CSR col_indices must hold nnz = {nnz} column indices in [0, {cols}); "
            f"got {len(col)}"
        )
    return TensorData(
        data=values,
        dtype=public,  # type: ignore[arg-type]
        shape=shape,
        sparse_crow_indices=crow.tolist(),
        sparse_col_indices=col.tolist(),
    )


# ---- model input chunks --------------------------------------------------------------------


def _chunk_to_proto(chunk: ModelInputChunk, msg: pb.Chunk) -> None:
    if isinstance(chunk, EncodedTextChunk):
        msg.encoded_text.tokens = np.asarray(chunk.tokens, dtype=_I32).tobytes()
    elif isinstance(chunk, ImageChunk):
        msg.image.data = chunk.data
        msg.image.format = chunk.format
        if chunk.expected_tokens is not None:
            msg.image.expected_tokens = chunk.expected_tokens
    elif isinstance(chunk, DmelChunk):
        msg.dmel.dmel = chunk.dmel
    elif isinstance(chunk, ImageAssetPointerChunk):
        raise WireError(
            "an ImageAssetPointerChunk cannot be sent in forward_backward (the protobuf schema "
            "has no such chunk); send the image bytes as an ImageChunk"
        )
    else:
        raise WireError(f"unsupported model input chunk type {type(chunk).__name__}")


def _chunk_from_proto(msg: pb.Chunk, where: str) -> ModelInputChunk:
    kind = msg.WhichOneof("chunk")
    if kind == "encoded_text":
        tokens = _frombuffer(msg.encoded_text.tokens, _I32, f"{where}.encoded_text.tokens")
        return EncodedTextChunk(tokens=tokens.tolist())
    if kind == "image":
        img = msg.image
        if img.format not in ("png", "jpeg"):
            raise WireError(f"{where}.image.format must be 'png' or 'jpeg', got {img.format!r}")
        if img.HasField("override_dimensions"):
            raise WireError(f"{where}.image.override_dimensions is not supported by this server")
        return ImageChunk(
            data=img.data,
            format=img.format,  # type: ignore[arg-type]
            expected_tokens=img.expected_tokens if img.HasField("expected_tokens") else None,
        )
    if kind == "dmel":
        return DmelChunk(dmel=msg.dmel.dmel)
    raise WireError(f"{where}: chunk has none of encoded_text, image, dmel set")


# ---- provenance spans ----------------------------------------------------------------------


def span_to_proto(
    span: PromptProvenanceSpan | SampledProvenanceSpan, msg: pb.ProvenanceSpan | None = None
) -> pb.ProvenanceSpan:
    if msg is None:
        msg = pb.ProvenanceSpan()
    arm = msg.sampled_tokens if isinstance(span, SampledProvenanceSpan) else msg.prompt_tokens
    arm.sequence_id = span.sequence_id
    arm.offset = span.offset
    arm.length = span.length
    return msg


def span_from_proto(
    msg: pb.ProvenanceSpan, where: str = "span"
) -> PromptProvenanceSpan | SampledProvenanceSpan:
    kind = msg.WhichOneof("span")
    if kind is None:
        raise WireError(f"{where}: span has neither prompt_tokens nor sampled_tokens set")
    arm = getattr(msg, kind)
    cls = PromptProvenanceSpan if kind == "prompt_tokens" else SampledProvenanceSpan
    try:
        return cls(sequence_id=arm.sequence_id, offset=arm.offset, length=arm.length)
    except ValueError as e:
        raise WireError(f"{where}: {e}") from None


# ---- datums -------------------------------------------------------------------------------


def datum_to_proto(datum: Datum, msg: pb.Datum | None = None) -> pb.Datum:
    if msg is None:
        msg = pb.Datum()
    for chunk in datum.model_input.chunks:
        _chunk_to_proto(chunk, msg.model_input.add())
    for name, td in datum.loss_fn_inputs.items():
        tensor_to_proto(td, msg.loss_fn_inputs[name])
    for span in datum.model_input_spans or ():
        span_to_proto(span, msg.model_input_spans.add())
    for span in datum.loss_fn_input_spans or ():
        span_to_proto(span, msg.loss_fn_input_spans.add())
    return msg


def datum_from_proto(msg: pb.Datum, where: str = "datum") -> Datum:
    _check_no_unknown_fields(msg, where)
    chunks = []
    for j, c in enumerate(msg.model_input):
        _check_no_unknown_fields(c, f"{where}.model_input[{j}]")
        chunks.append(_chunk_from_proto(c, f"{where}.model_input[{j}]"))
    inputs = {}
    for name, t in msg.loss_fn_inputs.items():
        _check_no_unknown_fields(t, f"{where}.loss_fn_inputs[{name!r}]")
        inputs[name] = tensor_from_proto(t, f"{where}.loss_fn_inputs[{name!r}]")
    mi_spans = [
        span_from_proto(s, f"{where}.model_input_spans[{j}]")
        for j, s in enumerate(msg.model_input_spans)
    ]
    lf_spans = [
        span_from_proto(s, f"{where}.loss_fn_input_spans[{j}]")
        for j, s in enumerate(msg.loss_fn_input_spans)
    ]
    if bool(mi_spans) != bool(lf_spans):
        raise WireError(
            f"{where}: provenance comes as a pair; model_input_spans has {len(mi_spans)} spans "
            f"but loss_fn_input_spans has {len(lf_spans)} (set both or neither)"
        )
    return Datum(
        model_input=ModelInput(chunks=chunks),
        loss_fn_inputs=inputs,
        model_input_spans=mi_spans or None,
        loss_fn_input_spans=lf_spans or None,
    )


# ---- forward_backward request --------------------------------------------------------------


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded ``POST /api/v1/forward_backward`` body."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


def encode_forward_backward_request(
    model_id: str,
    seq_id: int,
    data: Sequence[Datum],
    loss_fn: str,
    loss_fn_config: Mapping[str, float | str] | None = None,
    *,
    forward_only: bool = False,
) -> bytes:
    """Serialized ``ForwardBackwardRequest``, written the way the official SDK writes it
    (numeric config entries go to both the legacy map and v2, strings to v2 only)."""
    msg = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=forward_only
    )
    for key, value in (loss_fn_config or {}).items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            msg.loss_fn_config[key] = float(value)
            msg.loss_fn_config_v2[key].number = float(value)
        else:
            raise WireError(
                f"loss_fn_config[{key!r}] must be a number or a string, got {type(value).__name__}"
            )
    for datum in data:
        datum_to_proto(datum, msg.data.add())
    return msg.SerializeToString()


def peek_forward_backward_target(body: bytes) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` of a body that parses as protobuf, even if its datums are bad."""
    try:
        msg = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError:
        return None
    return (msg.model_id, msg.seq_id) if msg.model_id and msg.seq_id > 0 else None


def decode_forward_backward_request(body: bytes) -> ForwardBackwardCall:
    """Parse and validate a ``ForwardBackwardRequest`` (already decompressed)."""
    try:
        msg = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError as e:
        raise WireError(
            f"forward_backward body is not a valid tinker_public.ForwardBackwardRequest "
            f"protobuf ({e}); send Content-Type: application/x-protobuf as the tinker SDK does"
        ) from None
    _check_no_unknown_fields(msg, "forward_backward")
    if not msg.model_id:
        raise WireError("forward_backward: model_id is empty")
    if msg.seq_id < 1:
        raise WireError(
            f"forward_backward: seq_id must be >= 1 (training requests are numbered from 1), "
            f"got {msg.seq_id}"
        )
    if not msg.loss_fn:
        raise WireError(validation.EMPTY_LOSS_FN)
    config: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config_v2.items():
        _check_no_unknown_fields(value, f"forward_backward.loss_fn_config_v2[{key!r}]")
        kind = value.WhichOneof("value")
        if kind is None:
            raise WireError(
                f"forward_backward.loss_fn_config_v2[{key!r}] has neither number nor text set"
            )
        config[key] = value.number if kind == "number" else value.text
    for key, number in msg.loss_fn_config.items():
        config.setdefault(key, number)  # v2 wins; the legacy map only fills gaps
    data = [datum_from_proto(d, f"datum {i}") for i, d in enumerate(msg.data)]
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        data=data,
        loss_fn=msg.loss_fn,
        loss_fn_config=config or None,
        forward_only=msg.forward_only,
    )


# ---- forward_backward output ---------------------------------------------------------------


def _output_signature(
    out: Mapping[str, TensorData],
) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    sig = []
    for name in sorted(out):
        arr = out[name].to_numpy()
        sig.append((name, out[name].dtype, tuple(arr.shape[1:])))
    return tuple(sig)


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """``ForwardBackwardOutput`` -> serialized proto.

    Consecutive datums whose outputs have the same fields, dtypes and trailing shapes go
    into one ``ArrayRecord`` (normally: all of them); ``offsets`` are byte offsets.
    """
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    groups: list[list[Mapping[str, TensorData]]] = []
    last_sig: object = None
    for datum_out in out.loss_fn_outputs:
        sig = _output_signature(datum_out)
        if not groups or sig != last_sig:
            groups.append([])
            last_sig = sig
        groups[-1].append(datum_out)
    for group in groups:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(group))
        for name in group[0]:
            first = group[0][name]
            np_dtype = _NUMPY_OF[first.dtype]
            arrays = [np.ascontiguousarray(g[name].to_numpy(), dtype=np_dtype) for g in group]
            sizes = [a.nbytes for a in arrays]
            bt = record.fields[name]
            bt.dtype = _DTYPE_TO_PROTO[first.dtype]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(_I64).tobytes()
            bt.trailing_shape.extend(arrays[0].shape[1:])
    return msg.SerializeToString()


def decode_forward_backward_output(body: bytes) -> ForwardBackwardOutput:
    """Serialized ``ForwardBackwardOutput`` -> public type (several records concatenate)."""
    try:
        msg = pb.ForwardBackwardOutput.FromString(body)
    except DecodeError as e:
        raise WireError(f"result is not a valid ForwardBackwardOutput protobuf ({e})") from None
    outputs: list[dict[str, TensorData]] = []
    for r, record in enumerate(msg.loss_fn_outputs):
        n = record.num_datums
        per_field: dict[str, list[TensorData]] = {}
        for name, bt in record.fields.items():
            where = f"loss_fn_outputs[{r}].fields[{name!r}]"
            per_field[name] = _split_batched(bt, where)
            if not n:  # messages predating num_datums: infer it
                n = len(per_field[name])
            if len(per_field[name]) != n:
                raise WireError(f"{where}: {len(per_field[name])} datums but num_datums is {n}")
        outputs.extend({name: per_field[name][i] for name in per_field} for i in range(n))
    return ForwardBackwardOutput(
        loss_fn_output_type=msg.loss_fn_output_type.rsplit(":", 1)[-1] or "ArrayRecord",
        loss_fn_outputs=outputs,
        metrics={k: float(v) for k, v in msg.metrics.items()},
    )


def _split_batched(bt: pb.BatchedTensor, where: str) -> list[TensorData]:
    entry = _FROM_PROTO.get(bt.dtype)
    if entry is None:
        raise WireError(f"{where}: unsupported dtype {_dtype_name(bt.dtype)}")
    src, public = entry
    buf = _widen(_frombuffer(bt.data, src, f"{where}.data"), bt.dtype)
    offsets = _frombuffer(bt.offsets, _I64, f"{where}.offsets")
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(bt.data):
        raise WireError(f"{where}: offsets must run from 0 to len(data) = {len(bt.data)}")
    if np.any(np.diff(offsets) < 0) or np.any(offsets % src.itemsize):
        raise WireError(f"{where}: offsets must be non-decreasing multiples of {src.itemsize}")
    trailing = [int(d) for d in bt.trailing_shape]
    per_row = math.prod(trailing)
    out = []
    for start, end in zip(offsets[:-1] // src.itemsize, offsets[1:] // src.itemsize, strict=True):
        arr = buf[int(start) : int(end)]
        if (per_row == 0 and arr.size) or (per_row and arr.size % per_row):
            raise WireError(
                f"{where}: a datum holds {arr.size} values, not a whole number of rows of "
                f"trailing shape {trailing}"
            )
        shape = [arr.size // per_row if per_row else 0, *trailing]
        out.append(TensorData(data=arr.reshape(shape), dtype=public, shape=shape))  # type: ignore[arg-type]
    return out


# ---- sample response -----------------------------------------------------------------------


def _topk_dense(
    arrays: TopkLogprobs | None, lists: Sequence[Sequence[tuple[int, float]] | None] | None
) -> TopkLogprobs | None:
    """Topk as two (length, k) matrices, from either representation; empty cells sentinel."""
    if arrays is not None:
        return arrays
    if lists is None:
        return None
    k = max((len(row) for row in lists if row), default=0)
    ids = np.zeros((len(lists), k), dtype=np.int32)
    lps = np.full((len(lists), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(lists):
        for j, (tok, lp) in enumerate(row or ()):
            ids[i, j], lps[i, j] = tok, lp
    return TopkLogprobs(token_ids=ids, logprobs=lps)


def _topk_to_proto(topk: TopkLogprobs, msg: pb.TopkLogprobs) -> None:
    ids = np.asarray(topk.token_ids, dtype=_I32)
    lps = np.asarray(topk.logprobs, dtype=_F32)
    length, k = ids.shape if ids.ndim == 2 else (0, 0)
    msg.token_ids = np.ascontiguousarray(ids).tobytes()
    msg.logprobs = np.ascontiguousarray(lps).tobytes()
    msg.k = k
    msg.length = length


def _topk_from_proto(msg: pb.TopkLogprobs, where: str) -> TopkLogprobs | None:
    n, k = msg.length, msg.k
    if n == 0 or k == 0:
        return None
    ids = _frombuffer(msg.token_ids, _I32, f"{where}.token_ids")
    lps = _frombuffer(msg.logprobs, _F32, f"{where}.logprobs")
    if ids.size != n * k or lps.size != n * k:
        raise WireError(f"{where}: expected length*k = {n * k} entries in token_ids and logprobs")
    return TopkLogprobs(token_ids=ids.reshape(n, k).copy(), logprobs=lps.reshape(n, k).copy())


def encode_sample_response(resp: SampleResponse) -> bytes:
    """``SampleResponse`` -> serialized proto (``sequence_id``s travel in the promise)."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=int(resp.prompt_cache_hit_tokens))
    for seq in resp.sequences:
        s = msg.sequences.add(stop_reason=_STOP_TO_PROTO[seq.stop_reason])
        tokens = seq.tokens_np if seq.tokens_np is not None else seq.tokens
        s.tokens = np.asarray(tokens, dtype=_I32).tobytes()
        logprobs = seq.logprobs_np if seq.logprobs_np is not None else seq.logprobs
        if logprobs is not None:
            s.logprobs = np.asarray(logprobs, dtype=_F32).tobytes()
        topk = _topk_dense(seq.topk_logprobs_np, seq.topk_logprobs)
        if topk is not None:
            _topk_to_proto(topk, s.topk_sampled_logprobs)
    if resp.prompt_logprobs_np is not None:
        msg.prompt_logprobs = np.asarray(resp.prompt_logprobs_np, dtype=_F32).tobytes()
    elif resp.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in resp.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=_F32).tobytes()
    topk = _topk_dense(resp.topk_prompt_logprobs_np, resp.topk_prompt_logprobs)
    if topk is not None:
        _topk_to_proto(topk, msg.topk_prompt_logprobs)
    if resp.target_prompt_logprobs is not None:
        tensor_to_proto(resp.target_prompt_logprobs, msg.target_prompt_logprobs)
    if resp.prompt_alt_tokens is not None:
        tensor_to_proto(resp.prompt_alt_tokens.tokens, msg.prompt_alt_tokens.tokens)
        tensor_to_proto(resp.prompt_alt_tokens.logprobs, msg.prompt_alt_tokens.logprobs)
    return msg.SerializeToString()


def decode_sample_response(body: bytes, sequence_ids: Sequence[str]) -> SampleResponse:
    """Serialized ``SampleResponse`` -> public type, stamping the promise's sequence ids."""
    try:
        msg = pb.SampleResponse.FromString(body)
    except DecodeError as e:
        raise WireError(f"result is not a valid SampleResponse protobuf ({e})") from None
    if len(sequence_ids) != len(msg.sequences):
        raise WireError(
            f"sample result has {len(msg.sequences)} sequences but the promise carried "
            f"{len(sequence_ids)} sample_sequence_ids"
        )
    sequences = []
    for i, (s, sequence_id) in enumerate(zip(msg.sequences, sequence_ids, strict=True)):
        stop = _STOP_FROM_PROTO.get(s.stop_reason)
        if stop is None:
            raise WireError(f"sequences[{i}]: unknown stop_reason {s.stop_reason}")
        tokens = _frombuffer(s.tokens, _I32, f"sequences[{i}].tokens").copy()
        logprobs = (
            _frombuffer(s.logprobs, _F32, f"sequences[{i}].logprobs").copy()
            if s.HasField("logprobs")
            else None
        )
        if logprobs is not None and logprobs.size != tokens.size:
            raise WireError(f"sequences[{i}]: {logprobs.size} logprobs for {tokens.size} tokens")
        topk = (
            _topk_from_proto(s.topk_sampled_logprobs, f"sequences[{i}].topk_sampled_logprobs")
            if s.HasField("topk_sampled_logprobs")
            else None
        )
        sequences.append(
            SampledSequence(
                stop_reason=stop,  # type: ignore[arg-type]
                sequence_id=sequence_id,
                tokens_np=tokens,
                logprobs_np=logprobs,
                topk_logprobs_np=topk,
            )
        )
    prompt_logprobs = (
        _frombuffer(msg.prompt_logprobs, _F32, "prompt_logprobs").copy()
        if msg.HasField("prompt_logprobs")
        else None
    )
    alt = None
    if msg.HasField("prompt_alt_tokens"):
        alt = PromptAltTokens(
            tokens=tensor_from_proto(msg.prompt_alt_tokens.tokens, "prompt_alt_tokens.tokens"),
            logprobs=tensor_from_proto(
                msg.prompt_alt_tokens.logprobs, "prompt_alt_tokens.logprobs"
            ),
        )
    return SampleResponse(
        sequences=sequences,
        prompt_logprobs_np=prompt_logprobs,
        topk_prompt_logprobs_np=(
            _topk_from_proto(msg.topk_prompt_logprobs, "topk_prompt_logprobs")
            if msg.HasField("topk_prompt_logprobs")
            else None
        ),
        target_prompt_logprobs=(
            tensor_from_proto(msg.target_prompt_logprobs, "target_prompt_logprobs")
            if msg.HasField("target_prompt_logprobs")
            else None
        ),
        prompt_cache_hit_tokens=msg.prompt_cache_hit_tokens,
        prompt_alt_tokens=alt,
    )
