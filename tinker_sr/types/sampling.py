"""Sampling request/response types."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Any, Literal, TypeAlias

import numpy as np
from pydantic import PlainSerializer, PlainValidator

from ._base import BaseModel, StrictBase
from .model_input import ModelInput
from .tensor_data import TensorData
from .topk_logprobs import TopkLogprobs, topk_to_lists

__all__ = [
    "StopReason",
    "SamplingClientKind",
    "SamplingParams",
    "SampleRequest",
    "SampledSequence",
    "SampleResponse",
    "PromptAltTokens",
]

StopReason: TypeAlias = Literal["length", "stop"]
"""``"stop"``: a stop sequence or EOS was hit; ``"length"``: ``max_tokens`` was reached."""

SamplingClientKind: TypeAlias = Literal["snapshot", "inflight"]
"""``snapshot``: fixed weights. ``inflight``: a mutable target shared by the run's inflight
samplers, updated by later inflight saves."""


class SamplingParams(BaseModel):
    max_tokens: int | None = None
    """Maximum number of tokens to generate."""

    seed: int | None = None
    """Seed for reproducible sampling."""

    stop: str | Sequence[str] | Sequence[int] | None = None
    """Stop strings or stop token ids. ``None``: stop at EOS. ``[]``: no stop condition at all
    (not even EOS), so generation runs for ``max_tokens``."""

    temperature: float = 1

    top_k: int = -1
    """``-1`` means no top-k limit."""

    top_p: float = 1


def _validate_tensor_data(value: Any) -> TensorData:
    if isinstance(value, TensorData):
        return value
    if isinstance(value, dict):
        return TensorData(**value)
    raise TypeError(f"expected TensorData or a dict of its fields, got {type(value).__name__}")


def _serialize_tensor_data(value: TensorData) -> dict[str, Any]:
    return {
        "data": value.data,
        "dtype": value.dtype,
        "shape": value.shape,
        "sparse_crow_indices": value.sparse_crow_indices,
        "sparse_col_indices": value.sparse_col_indices,
    }


# TensorData is a plain dataclass with a custom __init__; tell pydantic how to (de)serialise it.
TensorDataField: TypeAlias = Annotated[
    TensorData,
    PlainValidator(_validate_tensor_data),
    PlainSerializer(_serialize_tensor_data),
]


class SampleRequest(StrictBase):
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    """Base model to sample from; inferred from ``model_path`` when that is given."""
    model_path: str | None = None
    """``tinker://…/sampler_weights/…`` path; ``None`` samples the base model."""
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorDataField | None = None
    """int64 ``[len(prompt) - 1, K]`` ids to score; ``-1`` cells request nothing."""
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"


@dataclass(frozen=True)
class PromptAltTokens:
    """``k`` draws per prompt position after the first; row ``i`` are alternatives to
    ``prompt[i + 1]``."""

    tokens: TensorData
    """int64, shape ``[len(prompt) - 1, k]``."""

    logprobs: TensorData
    """float32, shape ``[len(prompt) - 1, k]``."""


@dataclass(frozen=True)
class SampledSequence:
    """One sampled sequence. ``*_np`` fields hold arrays; the list properties convert lazily
    (and prefer the private ``_*_list`` fields when built from lists)."""

    stop_reason: StopReason

    sequence_id: str
    """Session-scoped id of this sequence (used by provenance spans)."""

    tokens_np: np.ndarray | None = field(default=None, repr=False)
    """int32 generated token ids, shape ``(T,)``."""

    logprobs_np: np.ndarray | None = field(default=None, repr=False)
    """float32 logprob of every generated token, shape ``(T,)``."""

    topk_logprobs_np: TopkLogprobs | None = field(default=None, repr=False)

    _tokens_list: list[int] | None = field(default=None, repr=False)
    _logprobs_list: list[float] | None = field(default=None, repr=False)
    _topk_logprobs_list: list[list[tuple[int, float]] | None] | None = field(
        default=None, repr=False
    )

    @cached_property
    def tokens(self) -> list[int]:
        if self._tokens_list is not None:
            return self._tokens_list
        return [] if self.tokens_np is None else self.tokens_np.tolist()

    @cached_property
    def logprobs(self) -> list[float] | None:
        if self._logprobs_list is not None:
            return self._logprobs_list
        return None if self.logprobs_np is None else self.logprobs_np.tolist()

    @cached_property
    def topk_logprobs(self) -> list[list[tuple[int, float]] | None] | None:
        if self._topk_logprobs_list is not None:
            return self._topk_logprobs_list
        return None if self.topk_logprobs_np is None else topk_to_lists(self.topk_logprobs_np)


@dataclass(frozen=True)
class SampleResponse:
    sequences: Sequence[SampledSequence]

    prompt_logprobs_np: np.ndarray | None = field(default=None, repr=False)
    """float32 ``(P,)``; NaN where nothing was computed (position 0, or before last_n)."""

    topk_prompt_logprobs_np: TopkLogprobs | None = field(default=None, repr=False)

    target_prompt_logprobs: TensorData | None = None
    """float32, same shape and layout as the request's ids; 0.0 where the request had -1."""

    prompt_cache_hit_tokens: int = 0
    """Prompt tokens served from the prefix cache, counted once per prompt."""

    prompt_alt_tokens: PromptAltTokens | None = None

    _prompt_logprobs_list: list[float | None] | None = field(default=None, repr=False)
    _topk_prompt_logprobs_list: list[list[tuple[int, float]] | None] | None = field(
        default=None, repr=False
    )

    @cached_property
    def prompt_logprobs(self) -> list[float | None] | None:
        """Per prompt token; ``None`` where nothing was computed."""
        if self._prompt_logprobs_list is not None:
            return self._prompt_logprobs_list
        if self.prompt_logprobs_np is None:
            return None
        values: list[float | None] = self.prompt_logprobs_np.tolist()
        for i in np.flatnonzero(np.isnan(self.prompt_logprobs_np)).tolist():
            values[i] = None
        return values

    @cached_property
    def topk_prompt_logprobs(self) -> list[list[tuple[int, float]] | None] | None:
        if self._topk_prompt_logprobs_list is not None:
            return self._topk_prompt_logprobs_list
        if self.topk_prompt_logprobs_np is None:
            return None
        return topk_to_lists(self.topk_prompt_logprobs_np)
