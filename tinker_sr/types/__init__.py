"""Public data types, mirroring ``tinker.types`` (SDK 0.38).

Hot-path values (Datum, TensorData, sampling results) are frozen dataclasses; request and
response models are frozen pydantic models (``StrictBase`` forbids unknown fields,
``BaseModel`` ignores them). Importing this package does not import torch.
"""

from ._base import BaseModel, StrictBase
from .checkpoint import (
    Checkpoint,
    CheckpointsListResponse,
    CheckpointType,
    Cursor,
    ExternalWeightsUrlsResponse,
    LoadWeightsResponse,
    ParsedCheckpointTinkerPath,
    SaveWeightsExternalResponse,
    SaveWeightsExternalResponseInternal,
    SaveWeightsForSamplerResponse,
    SaveWeightsForSamplerResponseInternal,
    SaveWeightsResponse,
    TrainingRun,
    TrainingRunsResponse,
)
from .datum import Datum, LossFnInputs, LossFnOutput
from .info import (
    CustomLossInput,
    CustomLossInputRank,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    ModelData,
    RequestErrorCategory,
    SupportedModel,
)
from .model_input import (
    DmelChunk,
    EncodedTextChunk,
    ImageAssetPointerChunk,
    ImageChunk,
    ModelInput,
    ModelInputChunk,
)
from .optimizer import (
    AdamOptimizerConfig,
    AdamParams,
    DimuonOptimizerConfig,
    DimuonParams,
    OptimizerConfig,
    OptimizerConfigBase,
    OptimParams,
    OptimParamsBase,
)
from .provenance_spans import PromptProvenanceSpan, ProvenanceSpans, SampledProvenanceSpan
from .sampling import (
    PromptAltTokens,
    SampledSequence,
    SampleRequest,
    SampleResponse,
    SamplingClientKind,
    SamplingParams,
    StopReason,
)
from .tensor_data import TensorData
from .tensor_dtype import TensorDtype
from .topk_logprobs import TopkLogprobs
from .training import (
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraConfig,
    LossFnType,
    ModelID,
    OptimStepRequest,
    OptimStepResponse,
)

__all__ = [
    "AdamOptimizerConfig",
    "AdamParams",
    "BaseModel",
    "Checkpoint",
    "CheckpointType",
    "CheckpointsListResponse",
    "Cursor",
    "CustomLossInput",
    "CustomLossInputRank",
    "Datum",
    "DimuonOptimizerConfig",
    "DimuonParams",
    "DmelChunk",
    "EncodedTextChunk",
    "ExternalWeightsUrlsResponse",
    "ForwardBackwardInput",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "GetServerCapabilitiesResponse",
    "ImageAssetPointerChunk",
    "ImageChunk",
    "LoadWeightsResponse",
    "LoraConfig",
    "LossFnInputs",
    "LossFnOutput",
    "LossFnType",
    "ModelData",
    "ModelID",
    "ModelInput",
    "ModelInputChunk",
    "OptimParams",
    "OptimParamsBase",
    "OptimStepRequest",
    "OptimStepResponse",
    "OptimizerConfig",
    "OptimizerConfigBase",
    "ParsedCheckpointTinkerPath",
    "PromptAltTokens",
    "PromptProvenanceSpan",
    "ProvenanceSpans",
    "RequestErrorCategory",
    "SampleRequest",
    "SampleResponse",
    "SampledProvenanceSpan",
    "SampledSequence",
    "SamplingClientKind",
    "SamplingParams",
    "SaveWeightsExternalResponse",
    "SaveWeightsExternalResponseInternal",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsForSamplerResponseInternal",
    "SaveWeightsResponse",
    "StopReason",
    "StrictBase",
    "SupportedModel",
    "TensorData",
    "TensorDtype",
    "TopkLogprobs",
    "TrainingRun",
    "TrainingRunsResponse",
]
