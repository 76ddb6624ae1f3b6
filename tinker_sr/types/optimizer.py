"""Optimizer choice (at model creation) and per-step optimizer parameters."""

from __future__ import annotations

from typing import Literal, TypeAlias

from pydantic import ConfigDict, Field, SerializeAsAny

from ._base import StrictBase

__all__ = [
    "OptimizerConfigBase",
    "AdamOptimizerConfig",
    "DimuonOptimizerConfig",
    "OptimizerConfig",
    "AdamParams",
    "OptimParamsBase",
    "DimuonParams",
    "OptimParams",
]


class OptimizerConfigBase(StrictBase):
    """Open base so a server can name optimizers this client does not know yet."""

    model_config = ConfigDict(extra="allow")

    type: str


class AdamOptimizerConfig(OptimizerConfigBase):
    model_config = ConfigDict(extra="forbid")

    type: Literal["adamw"] = "adamw"


class DimuonOptimizerConfig(OptimizerConfigBase):
    model_config = ConfigDict(extra="forbid")

    type: Literal["dimuon"] = "dimuon"
    version: Literal[1] = 1


OptimizerConfig: TypeAlias = AdamOptimizerConfig | SerializeAsAny[OptimizerConfigBase]


class AdamParams(StrictBase):
    """AdamW hyperparameters for one ``optim_step`` (weight decay is decoupled)."""

    learning_rate: float = 0.0001
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """Global gradient-norm clip; 0 disables clipping."""


class OptimParamsBase(StrictBase):
    """Open base for non-Adam step parameters, tagged by ``type``."""

    model_config = ConfigDict(extra="allow")

    type: str


class DimuonParams(OptimParamsBase):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["dimuon"] = "dimuon"
    learning_rate: float = Field(ge=0)
    grad_clip_norm: float = 0.0
    """Non-positive disables clipping."""
    beta1: float = Field(default=0.9, ge=0, lt=1)


OptimParams: TypeAlias = AdamParams | SerializeAsAny[OptimParamsBase]
