"""tinker_sr: a drop-in Tinker SDK with an embedded PyTorch engine.

``import tinker_sr as tinker`` runs a Tinker script unchanged. Without a base URL the clients
run on the embedded engine (CPU, no key, no server); with ``base_url=`` or
``$TINKER_BASE_URL`` they speak the Tinker wire protocol to that server.
"""

from tinker_sr import types
from tinker_sr.clients import (
    BackcompatSamplingClientFuture,
    BackcompatTrainingClientFuture,
    RestClient,
    SamplingClient,
    ServiceClient,
    TrainingClient,
)
from tinker_sr.errors import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    BillingError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestFailedError,
    TinkerError,
    UnprocessableEntityError,
)
from tinker_sr.futures import APIFuture
from tinker_sr.types import (
    AdamOptimizerConfig,
    AdamParams,
    Checkpoint,
    CheckpointType,
    Datum,
    DimuonOptimizerConfig,
    DimuonParams,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoraConfig,
    ModelID,
    ModelInput,
    ModelInputChunk,
    OptimParams,
    OptimStepRequest,
    OptimStepResponse,
    ParsedCheckpointTinkerPath,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
    SampleRequest,
    SampleResponse,
    SamplingParams,
    StopReason,
    TensorData,
    TensorDtype,
    TrainingRun,
)

__title__ = "tinker_sr"
__version__ = "0.1.0"


class ExperimentalWarning(UserWarning):
    """Emitted by alpha features."""


__all__ = [
    "APIConnectionError",
    "APIError",
    "APIFuture",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AdamOptimizerConfig",
    "AdamParams",
    "AuthenticationError",
    "BackcompatSamplingClientFuture",
    "BackcompatTrainingClientFuture",
    "BadRequestError",
    "BillingError",
    "Checkpoint",
    "CheckpointType",
    "ConflictError",
    "Datum",
    "DimuonOptimizerConfig",
    "DimuonParams",
    "DmelChunk",
    "EncodedTextChunk",
    "ExperimentalWarning",
    "ForwardBackwardOutput",
    "InternalServerError",
    "LoraConfig",
    "ModelID",
    "ModelInput",
    "ModelInputChunk",
    "NotFoundError",
    "OptimParams",
    "OptimStepRequest",
    "OptimStepResponse",
    "ParsedCheckpointTinkerPath",
    "PermissionDeniedError",
    "PromptProvenanceSpan",
    "RateLimitError",
    "RequestFailedError",
    "RestClient",
    "SampleRequest",
    "SampleResponse",
    "SampledProvenanceSpan",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "StopReason",
    "TensorData",
    "TensorDtype",
    "TinkerError",
    "TrainingClient",
    "TrainingRun",
    "UnprocessableEntityError",
    "__title__",
    "__version__",
    "types",
]
