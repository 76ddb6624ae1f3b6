"""Model info, server capabilities, error categories, custom-loss inputs."""

from __future__ import annotations

from enum import StrEnum, auto
from typing import Literal, TypeAlias

from ._base import BaseModel, StrictBase
from .optimizer import AdamOptimizerConfig, OptimizerConfig
from .training import ModelID

__all__ = [
    "ModelData",
    "GetInfoResponse",
    "SupportedModel",
    "GetServerCapabilitiesResponse",
    "RequestErrorCategory",
    "CustomLossInputRank",
    "CustomLossInput",
]


class ModelData(BaseModel):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None
    """What ``get_tokenizer()`` loads; falls back to the model name when ``None``."""


class GetInfoResponse(BaseModel):
    type: Literal["get_info"] | None = None
    model_data: ModelData
    model_id: ModelID
    optimizer_config: OptimizerConfig = AdamOptimizerConfig()
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None


class SupportedModel(BaseModel):
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


class GetServerCapabilitiesResponse(BaseModel):
    supported_models: list[SupportedModel]


class RequestErrorCategory(StrEnum):
    Unknown = auto()
    Server = auto()
    User = auto()


CustomLossInputRank: TypeAlias = Literal[0, 1, 2]
"""0: scalar per datum, 1: ``[T]``, 2: ``[T, K]``."""


class CustomLossInput(StrictBase):
    name: str
    rank: CustomLossInputRank
