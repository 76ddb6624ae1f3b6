"""Checkpoints, training runs, and the save/load responses that name them."""

from __future__ import annotations

from datetime import datetime
from typing import Literal, TypeAlias
from urllib.parse import quote

from ._base import BaseModel, StrictBase
from .optimizer import AdamOptimizerConfig, OptimizerConfig

__all__ = [
    "CheckpointType",
    "Checkpoint",
    "ParsedCheckpointTinkerPath",
    "Cursor",
    "CheckpointsListResponse",
    "TrainingRun",
    "TrainingRunsResponse",
    "SaveWeightsResponse",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsExternalResponse",
    "SaveWeightsExternalResponseInternal",
    "SaveWeightsForSamplerResponseInternal",
    "LoadWeightsResponse",
    "ExternalWeightsUrlsResponse",
    "WeightsInfoResponse",
    "CopyWeightsRequest",
    "CopyWeightsResponse",
]

CheckpointType: TypeAlias = Literal["training", "sampler", "external"]

_SEGMENT_TO_TYPE: dict[str, CheckpointType] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}

_CONSOLE_BASE_URL = "https://tinker.thinkingmachines.ai"


class Checkpoint(BaseModel):
    checkpoint_id: str
    checkpoint_type: CheckpointType
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class ParsedCheckpointTinkerPath(BaseModel):
    tinker_path: str
    training_run_id: str
    checkpoint_type: CheckpointType
    checkpoint_id: str
    """``"<segment>/<name>"``, e.g. ``"weights/step-100"``."""

    @classmethod
    def from_tinker_path(cls, tinker_path: str) -> ParsedCheckpointTinkerPath:
        """Parse ``tinker://<run_id>/<weights|sampler_weights|external_weights>/<name>``."""
        if not tinker_path.startswith("tinker://"):
            raise ValueError(f"Invalid tinker path: {tinker_path}")
        parts = tinker_path[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in _SEGMENT_TO_TYPE:
            raise ValueError(f"Invalid tinker path: {tinker_path}")
        return cls(
            tinker_path=tinker_path,
            training_run_id=parts[0],
            checkpoint_type=_SEGMENT_TO_TYPE[parts[1]],
            checkpoint_id=f"{parts[1]}/{parts[2]}",
        )


class Cursor(BaseModel):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(BaseModel):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(BaseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(BaseModel):
    training_runs: list[TrainingRun]
    cursor: Cursor


def _checkpoint_console_url(tinker_path: str) -> str:
    parsed = ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    return (
        f"{_CONSOLE_BASE_URL}/checkpoints/{quote(parsed.training_run_id, safe='')}/"
        f"{quote(parsed.checkpoint_id, safe='')}"
    )


class SaveWeightsResponse(BaseModel):
    path: str
    """``tinker://<run_id>/weights/<name>``."""
    type: Literal["save_weights"] | None = None

    def get_console_url(self) -> str:
        return _checkpoint_console_url(self.path)


class SaveWeightsForSamplerResponse(BaseModel):
    path: str
    """``tinker://<run_id>/sampler_weights/<name>``."""
    type: Literal["save_weights_for_sampler"] | None = None

    def get_console_url(self) -> str:
        return _checkpoint_console_url(self.path)

    def get_playground_url(self) -> str:
        return (
            f"{_CONSOLE_BASE_URL}/playground?mode=checkpoint&checkpoint={quote(self.path, safe='')}"
        )


class SaveWeightsForSamplerResponseInternal(BaseModel):
    """What the server returns; ``path`` is ``None`` for ephemeral sampler snapshots."""

    path: str | None = None
    sampling_session_id: str | None = None
    type: Literal["save_weights_for_sampler"] | None = None


class SaveWeightsExternalResponseInternal(BaseModel):
    path: str | None = None
    size_bytes: int | None = None
    type: Literal["save_weights_external"] | None = None


class SaveWeightsExternalResponse(BaseModel):
    path: str
    """``tinker://<run_id>/external_weights/<name>``."""
    type: Literal["save_weights_external"] | None = None


class LoadWeightsResponse(BaseModel):
    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] | None = None


class ExternalWeightsUrlsResponse(BaseModel):
    urls: dict[str, str]
    expires: datetime


class WeightsInfoResponse(BaseModel):
    """What is needed to load a checkpoint: its base model and LoRA configuration
    (``RestClient.get_weights_info_by_tinker_path``; ``POST /api/v1/weights_info``)."""

    base_model: str
    optimizer_config: OptimizerConfig = AdamOptimizerConfig()
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class CopyWeightsRequest(StrictBase):
    """Body of ``POST /api/v1/copy_weights``: the copy goes into training-run slot
    ``model_seq_id`` of session ``session_id``, or, when neither is given, into a new
    session of project ``destination_project_id``."""

    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    source_path: str
    """A tinker path of either kind (``weights`` or ``sampler_weights``)."""
    ttl_seconds: int | None = None
    """Seconds until the copy expires (3600 to 10 years); ``None`` = never. The source's
    expiry is not inherited."""
    weights_access_token: str | None = None


class CopyWeightsResponse(BaseModel):
    tinker_path: str
    """Path of the new copy."""
