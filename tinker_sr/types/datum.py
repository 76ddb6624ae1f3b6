"""Datum: one training example (model input + per-position loss inputs + optional provenance)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, Self, TypeAlias

import numpy as np

from tinker_sr.user_errors import official_sdk_hint

from .model_input import ModelInput
from .provenance_spans import PromptProvenanceSpan, ProvenanceSpans, SampledProvenanceSpan
from .tensor_data import TensorData, check_int64

__all__ = ["Datum", "LossFnInputs", "LossFnOutput", "ProvenancePairError"]

LossFnInputs: TypeAlias = dict[str, TensorData]
LossFnOutput: TypeAlias = dict[str, TensorData]

# Plain Python lists carry no dtype, so the known keys decide it.
_KEY_TO_DTYPE = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
    "sequence_ratio_mask": "float32",
}

# 2-D top-K distillation targets are mostly padding, so these go over the wire as CSR.
_SPARSE_ELIGIBLE_KEYS = frozenset({"target_tokens", "weights"})


class ProvenancePairError(ValueError, AssertionError):
    """Only one of the two span lists is set. A ValueError (bad input); also an
    AssertionError, which is what the official SDK raises here, so code catching that works."""


@dataclass(frozen=True)
class Datum:
    model_input: ModelInput

    loss_fn_inputs: LossFnInputs = field(default_factory=dict)
    """Per-position loss inputs. Values may be given as TensorData, torch tensors, numpy
    arrays or (for the known keys) Python lists; they are stored as TensorData."""

    model_input_spans: ProvenanceSpans | None = None
    """Runs tiling ``model_input`` (lengths sum to its length). Attach via ``with_provenance``."""

    loss_fn_input_spans: ProvenanceSpans | None = None
    """Runs tiling ``loss_fn_inputs["target_tokens"]``. Attach via ``with_provenance``."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            raise TypeError(
                f"Datum.model_input must be a ModelInput, got {type(self.model_input).__name__}; "
                f"build it with ModelInput.from_ints(tokens){official_sdk_hint(self.model_input)}"
            )
        if not isinstance(self.loss_fn_inputs, dict):
            raise TypeError(
                "Datum.loss_fn_inputs must be a dict of key -> tensor, got "
                f"{type(self.loss_fn_inputs).__name__}"
            )
        # Runs again under dataclasses.replace, so replaced inputs are coerced too.
        coerced = {key: _to_tensor_data(key, value) for key, value in self.loss_fn_inputs.items()}
        object.__setattr__(self, "loss_fn_inputs", coerced)
        _check_span_types("model_input_spans", self.model_input_spans)
        _check_span_types("loss_fn_input_spans", self.loss_fn_input_spans)
        if (self.model_input_spans is None) != (self.loss_fn_input_spans is None):
            have = (
                "model_input_spans" if self.loss_fn_input_spans is None else "loss_fn_input_spans"
            )
            raise ProvenancePairError(
                f"Datum: only {have} is set; provenance comes as a pair, set both span lists "
                "or neither (Datum.with_provenance does)"
            )

    def with_provenance(
        self, model_input: ProvenanceSpans, loss_fn_inputs: ProvenanceSpans
    ) -> Self:
        """A copy carrying provenance, after checking that each span list tiles its field.

        ``model_input`` spans must cover ``self.model_input.length`` positions;
        ``loss_fn_inputs`` spans must cover the rows of a 1-D ``target_tokens``.
        """
        _check_tiling("model_input", model_input, self.model_input.length)
        target_tokens = self.loss_fn_inputs.get("target_tokens")
        # As in the official SDK, 2-D targets and shapeless TensorData are left to the server.
        if target_tokens is not None and target_tokens.shape is not None:
            if len(target_tokens.shape) == 1:
                _check_tiling("loss_fn_inputs", loss_fn_inputs, target_tokens.shape[0])
        return replace(self, model_input_spans=model_input, loss_fn_input_spans=loss_fn_inputs)


def _check_span_types(field_name: str, spans: ProvenanceSpans | None) -> None:
    if spans is None:
        return
    if not isinstance(spans, list):
        raise TypeError(f"{field_name} must be a list of spans, got {type(spans).__name__}")
    for i, span in enumerate(spans):
        if not isinstance(span, PromptProvenanceSpan | SampledProvenanceSpan):
            raise TypeError(
                f"{field_name}[{i}] must be a PromptProvenanceSpan or SampledProvenanceSpan, "
                f"got {type(span).__name__}"
            )


def _check_tiling(kwarg: str, spans: ProvenanceSpans, expected: int) -> None:
    total = sum(span.length for span in spans)
    if total != expected:
        raise ValueError(
            f"with_provenance {kwarg} spans cover {total} positions but the field has "
            f"{expected}; the runs must tile it exactly"
        )


def _ragged_error(key: str) -> ValueError:
    return ValueError(
        f"loss_fn_inputs[{key!r}] must be a rectangular numeric array; ragged nested lists "
        "are not supported (pad the rows to one length, or pass a TensorData)"
    )


def _to_tensor_data(key: str, value: Any) -> TensorData:
    if isinstance(value, TensorData):
        return value
    # A torch tensor can only exist if torch was imported by someone: no import needed here.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if key in _SPARSE_ELIGIBLE_KEYS and value.ndim == 2:
            return TensorData.from_torch_sparse(value)
        return TensorData.from_torch(value)
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, list):
        nested = any(isinstance(item, list) for item in value)
        try:
            array = np.asarray(value)
        except ValueError as exc:
            if nested:
                raise _ragged_error(key) from exc
            raise
        if key not in _KEY_TO_DTYPE:
            raise KeyError(
                f"loss_fn_inputs[{key!r}]: a Python list needs a known key to pick its dtype "
                f"(known: {sorted(_KEY_TO_DTYPE)}); pass a TensorData, numpy array or torch "
                "tensor for custom keys"
            )
        dtype = _KEY_TO_DTYPE[key]
        if nested and array.dtype.kind not in "biuf":
            raise _ragged_error(key)
        if dtype == "int64":
            # Token ids: 2.9 is a mistake, not token 2 (the SDK would truncate it silently).
            check_int64(
                array,
                integral=True,
                what=f"loss_fn_inputs[{key!r}]",
                fix="token ids are whole numbers: pass them as integers",
            )
        try:
            return TensorData(data=array, dtype=dtype, shape=list(array.shape))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"loss_fn_inputs[{key!r}]: {exc}") from None
    raise TypeError(
        f"Unsupported loss_fn_inputs value for {key!r}: {type(value).__name__} "
        "(use TensorData, a torch tensor, a numpy array or a list)"
    )
