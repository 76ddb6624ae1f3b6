"""JSON half of the wire codec: request bodies, plain responses, futures, errors.

Each endpoint's request body is a pydantic model here. The server parses with `parse`
(strict types, unknown keys rejected, so no option is ever silently ignored) and
`RemoteBackend` builds the same models and sends ``to_json(model)`` (``exclude_none``, as
the official SDK does: ``None`` fields are omitted, non-``None`` defaults are sent).
Future results and error payloads have small helpers at the end.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, TypeVar

import numpy as np
import pydantic
from pydantic import ConfigDict, Field

from tinker_sr.types import (
    AdamParams,
    RequestErrorCategory,
    SamplingParams,
    TensorData,
)
from tinker_sr.types import SampleRequest as PublicSampleRequest
from tinker_sr.types.service import (
    CreateModelRequest,
    CreateSamplingSessionRequest,
    GetInfoRequest,
    LoadWeightsRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    SessionHeartbeatRequest,
)

from .errors import WireError

__all__ = [
    "SDK_VERSION",
    "OLDEST_SDK",
    "SERVER_CLIENT_CONFIG",
    "SERVER_DYNAMIC_CONFIG",
    "ClientConfigRequest",
    "FutureCancelRequest",
    "CreateSessionRequest",
    "SessionHeartbeatRequest",
    "SessionFinishRequest",
    "CreateModelRequest",
    "GetInfoRequest",
    "OptimStepRequest",
    "SaveWeightsRequest",
    "SaveWeightsForSamplerRequest",
    "SaveWeightsExternalRequest",
    "LoadWeightsRequest",
    "CreateSamplingSessionRequest",
    "SampleRequest",
    "WireSamplingParams",
    "WireTensorData",
    "FutureRetrieveRequest",
    "WeightsInfoRequest",
    "CheckpointTtlRequest",
    "parse_json",
    "parse",
    "to_json",
    "dumps",
    "future_failure",
    "try_again",
    "is_try_again",
    "category_of",
]

SDK_VERSION = "0.38.0"

SERVER_CLIENT_CONFIG: dict[str, Any] = {
    # The client-config flags this server chooses (the rest keep SDK defaults).
    "pjwt_auth_enabled": False,  # plain API keys, no /auth/token
    "use_pyqwest_transport": False,  # plain httpx on the client: no native transport needed
    # Bodies are sent uncompressed; the server nevertheless accepts Content-Encoding: zstd.
    "proto_compress_fwdbwd": False,
    # Chunks of one call arrive one by one in seq_id order (the engine runs one at a time).
    "parallel_fwdbwd_chunks": False,
    "sample_use_retrieve_futures": False,  # no /retrieve_futures session poller
    "custom_loss_server_side": False,  # forward_backward_custom runs its loss client-side
    "sample_join_sampling_session": False,  # no /join_sampling_session
    # Read by SDKs before 0.25 (0.38 sends protobuf and routes forward() through
    # forward_backward anyway): without them 0.20-0.24 post JSON forward_backward bodies and
    # forward() to the old /forward route, and cannot train here.
    "proto_write_fwdbwd": True,
    "fwd_via_fwdbwd": True,
}
# The oldest official SDK whose every call this server answers: before 0.24.1 a batch whose
# outputs differ in shape (1-D and 2-D targets) is decoded with the first one's shape;
# 0.20-0.22.2 know no fwd_via_fwdbwd, so their forward() posts to /forward; before 0.20
# forward_backward is JSON.
OLDEST_SDK = (0, 24, 1)

SERVER_DYNAMIC_CONFIG: dict[str, Any] = {"refresh_interval_sec": 300, "sample_cancel_enabled": True}
"""``sample_cancel_enabled``: an SDK that abandons a sample request (a timeout, a cancelled
task) posts ``cancel_future``, and the server stops its work."""


class _Wire(pydantic.BaseModel):
    """A request body: unknown keys are an error, so no option is silently dropped."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


# ---- bootstrap / sessions ----------------------------------------------------------------


class ClientConfigRequest(_Wire):
    # Lenient on purpose: it carries no options, and refusing it would make every client
    # of a newer SDK unusable (a 4xx here aborts client construction).
    model_config = ConfigDict(extra="ignore", frozen=True)

    sdk_version: str | None = None


class CreateSessionRequest(_Wire):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, str] | None = None  # typed as the SDK's public methods type it
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class FinishReason(_Wire):
    type: Literal["success", "errored", "interrupted"]


class SessionFinishRequest(_Wire):
    reason: FinishReason
    detail: str | None = None


# ---- training ------------------------------------------------------------------------------


class OptimStepRequest(_Wire):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None
    """Non-Adam step parameters (e.g. Dimuon); this server refuses them explicitly."""
    type: Literal["optim_step"] = "optim_step"


# ---- sampling -----------------------------------------------------------------------------


class WireSamplingParams(_Wire):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1
    top_k: int = -1
    top_p: float = 1

    def to_public(self) -> SamplingParams:
        return SamplingParams(**self.model_dump(exclude_unset=True))

    @classmethod
    def from_public(cls, params: SamplingParams) -> WireSamplingParams:
        fields = params.model_dump()  # the same six fields
        if fields["stop"] is not None and not isinstance(fields["stop"], str):
            fields["stop"] = list(fields["stop"])  # a tuple of stops is a JSON list
        return cls(**fields)


class WireTensorData(_Wire):
    """``TensorData`` as JSON (the sample request's ``target_prompt_logprobs``)."""

    data: list[int] | list[float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    def to_public(self, where: str) -> TensorData:
        if self.shape is not None and any(d < 0 for d in self.shape):
            raise WireError(f"{where}.shape {self.shape} has a negative dimension")
        if self.sparse_crow_indices is None:
            if self.shape is not None and math.prod(self.shape) != len(self.data):
                raise WireError(
                    f"{where}: shape {self.shape} needs {math.prod(self.shape)} values, "
                    f"data has {len(self.data)}"
                )
        elif self.sparse_col_indices is None or self.shape is None or len(self.shape) != 2:
            raise WireError(f"{where}: a sparse tensor needs sparse_col_indices and a 2-D shape")
        try:  # checks values (int64 range) and CSR structure without densifying
            td = TensorData(
                data=self.data,
                dtype=self.dtype,
                shape=self.shape,
                sparse_crow_indices=self.sparse_crow_indices,
                sparse_col_indices=self.sparse_col_indices,
            )
            td.check_sparse()
            return td
        except ValueError as e:
            raise WireError(f"{where}: {e}") from None

    @classmethod
    def from_public(cls, td: TensorData) -> WireTensorData:
        values = np.asarray(td._numpy).ravel().tolist()
        return cls(
            data=values,
            dtype=td.dtype,
            shape=td.shape if td.shape is not None else [len(values)],
            sparse_crow_indices=td.sparse_crow_indices,
            sparse_col_indices=td.sparse_col_indices,
        )


class SampleRequest(_Wire, PublicSampleRequest):
    """The public `tinker_sr.types.SampleRequest` (same fields, order and defaults), with the two
    fields that are not plain JSON in their wire forms (pydantic validates against these; mypy
    calls replacing a field's type an unsafe override, hence the ignores)."""

    sampling_params: WireSamplingParams  # type: ignore[assignment]
    target_prompt_logprobs: WireTensorData | None = None  # type: ignore[assignment]


# ---- futures / REST -----------------------------------------------------------------------


class FutureCancelRequest(_Wire):
    request_id: str


class FutureRetrieveRequest(_Wire):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfoRequest(_Wire):
    tinker_path: str


class CheckpointTtlRequest(_Wire):
    ttl_seconds: int | None = None


# ---- parsing / serialising ----------------------------------------------------------------

M = TypeVar("M", bound=pydantic.BaseModel)


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects a JSON body may have. Real bodies need about 8; deeper
ones exist only to exhaust the parser's stack."""

# A ``\uD800``-``\uDFFF`` escape: JSON lets it through alone, but a lone surrogate is not text
# (it cannot be encoded as UTF-8, so it would fail later, in storage or in the reply).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(body: bytes, what: str) -> Any:
    """Decode a JSON body; an empty body counts as ``{}``.

    Refused as a WireError (a 400): invalid JSON or UTF-8, nesting deeper than
    ``MAX_JSON_DEPTH``, and strings holding a lone UTF-16 surrogate.
    """
    if not body.strip():
        return {}
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"{what}: request body is not valid JSON ({e})") from None
    except RecursionError:
        raise _too_deep(what) from None
    except ValueError as e:  # e.g. an integer literal longer than Python converts (4300 digits)
        raise WireError(
            f"{what}: request body holds a number too long to read ({str(e).split(';')[0]}); "
            "send numbers that fit 64 bits"
        ) from None
    _check_json_tree(obj, what, check_text=_SURROGATE_ESCAPE.search(body) is not None)
    return obj


def _too_deep(what: str) -> WireError:
    return WireError(
        f"{what}: request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels; flatten it"
    )


def _check_json_tree(obj: Any, what: str, *, check_text: bool) -> None:
    """Depth (and, if ``check_text``, every string) of a decoded body; iterative, so a
    hostile body cannot exhaust the stack here either."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node, what)
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(what)
        if isinstance(node, dict):
            if check_text:
                for key in node:
                    _check_text(key, what)
            children: Any = node.values()
        else:
            children = node
        kinds = (dict, list, str) if check_text else (dict, list)
        stack.extend((child, depth + 1) for child in children if isinstance(child, kinds))


def _check_text(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise WireError(
            f"{what}: string {s[:40]!r} holds a lone UTF-16 surrogate at index {e.start}, "
            "which is not text; send valid UTF-8 (pair the surrogate or remove it)"
        ) from None


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def format_validation_error(what: str, err: pydantic.ValidationError) -> str:
    problems = []
    for e in err.errors()[:5]:
        loc = _format_loc(tuple(e.get("loc", ())))
        if e.get("type") == "extra_forbidden":
            problems.append(f"unknown field '{loc}' (this server does not support it)")
        elif e.get("type") == "missing":
            problems.append(f"missing required field '{loc}'")
        elif e.get("input") is None and "number" in str(e.get("msg")):
            # The official SDK sends a NaN or infinite float as null.
            problems.append(
                f"field '{loc}': {e.get('msg')} (got null: a NaN or infinity sent as JSON "
                "arrives as null; pass a finite number)"
            )
        else:
            problems.append(f"field '{loc}': {e.get('msg')} (got {e.get('input')!r:.80})")
    more = f" (+{err.error_count() - 5} more)" if err.error_count() > 5 else ""
    return f"{what}: " + "; ".join(problems) + more


def parse(model: type[M], obj: Any, what: str) -> M:
    """Validate a decoded JSON body strictly (no str->int coercion, no unknown keys)."""
    if not isinstance(obj, dict):
        raise WireError(f"{what}: request body must be a JSON object, got {type(obj).__name__}")
    try:
        return model.model_validate(obj, strict=True)
    except pydantic.ValidationError as e:
        raise WireError(format_validation_error(what, e)) from None
    except ValueError as e:  # a validator of a nested public type
        raise WireError(f"{what}: {e}") from None


def to_json(model: pydantic.BaseModel) -> dict[str, Any]:
    """The JSON object the official SDK would send for ``model`` (``None`` fields omitted)."""
    return model.model_dump(mode="json", exclude_none=True)


def dumps(obj: Any) -> bytes:
    """Compact JSON. A diverged run's metrics may be NaN/inf: they are written as the bare
    ``NaN``/``Infinity`` tokens Python's (and the SDK's) JSON parser reads back, rather than
    failing the request."""
    return json.dumps(obj, separators=(",", ":")).encode()


# ---- futures ------------------------------------------------------------------------------


def future_failure(message: str, category: RequestErrorCategory | str) -> dict[str, str]:
    """A failed future's payload: never carries anything else."""
    return {"error": message, "category": str(category)}


def try_again(request_id: str) -> dict[str, str]:
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}


def is_try_again(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("type") == "try_again"


def category_of(value: Any) -> RequestErrorCategory:
    """``"user"``/``"server"``/``"unknown"``; anything else (or missing) is Unknown."""
    try:
        return RequestErrorCategory(value)
    except ValueError:
        return RequestErrorCategory.Unknown
