"""Training request/response types: loss names, forward/backward, optim step, LoRA config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from pydantic import (
    AliasChoices,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from ._base import BaseModel, StrictBase
from .datum import Datum, LossFnOutput
from .optimizer import AdamParams, OptimParams

__all__ = [
    "LossFnType",
    "ModelID",
    "ForwardBackwardInput",
    "ForwardBackwardOutput",
    "OptimStepRequest",
    "OptimStepResponse",
    "LoraConfig",
]

ModelID: TypeAlias = str

LossFnType: TypeAlias = Literal[
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
    "custom",
]


@dataclass(frozen=True)
class ForwardBackwardInput:
    data: list[Datum]
    loss_fn: LossFnType
    loss_fn_config: Mapping[str, float | str] | None = field(default=None)
    """Loss options, e.g. PPO clip thresholds or StableReinforce ``kl_coeff``."""


@dataclass(frozen=True)
class ForwardBackwardOutput:
    loss_fn_output_type: str
    """Class name of the per-datum output records, e.g. ``"ArrayRecord"``."""

    loss_fn_outputs: list[LossFnOutput]
    """One dict per input datum, in order (``"logprobs"`` for every built-in loss)."""

    metrics: dict[str, float] = field(default_factory=dict)
    """Keys are ``"<name>:<reduction>"``; the total loss is ``metrics["loss:sum"]``."""


class OptimStepRequest(StrictBase):
    optim_params: OptimParams = Field(
        validation_alias=AliasChoices("optim_params", "adam_params", "optimizer_params")
    )
    model_id: ModelID
    seq_id: int | None = None
    type: Literal["optim_step"] = "optim_step"

    @model_serializer(mode="wrap")
    def _serialize_wire(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The wire keeps Adam and the other optimizers under different keys.
        data = handler(self)
        if "optim_params" in data:
            key = "adam_params" if isinstance(self.optim_params, AdamParams) else "optimizer_params"
            data[key] = data.pop("optim_params")
        return data


class OptimStepResponse(BaseModel):
    metrics: dict[str, float] | None = None


class LoraConfig(StrictBase):
    rank: int
    """LoRA rank."""
    seed: int | None = None
    """Seed for the LoRA initialisation; ``None`` picks one at random."""
    train_unembed: bool = True
    train_mlp: bool = True
    """Includes MoE layers."""
    train_attn: bool = True
