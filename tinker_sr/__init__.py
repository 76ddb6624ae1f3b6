"""tinker_sr: a drop-in Tinker SDK with an embedded PyTorch engine.

``import tinker_sr as tinker`` runs a Tinker script unchanged. Without a base URL the clients
run on the embedded engine (CPU, no key, no server); with ``base_url=`` or
``$TINKER_BASE_URL`` they speak the Tinker wire protocol to that server.
"""

from tinker_sr import auth, types
from tinker_sr.clients import (
    BackcompatSamplingClientFuture,
    BackcompatTrainingClientFuture,
    RestClient,
    SamplingClient,
    ServiceClient,
    TrainingClient,
)
from tinker_sr.clients.admin import AdminClient
from tinker_sr.clients.custom_loss import LossHandle, PerDatumLossFn
from tinker_sr.engine.cpu import bound_kernel_caches, prefer_passive_waits
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
from tinker_sr.request_options import RequestOptions, Timeout
from tinker_sr.tinker_alias import install_as_tinker as install_as_tinker
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

# Nothing above imports torch (checked by a test), so this runs before torch loads its OpenMP
# runtime: idle OpenMP threads then sleep instead of spinning beside other busy processes.
prefer_passive_waits()
bound_kernel_caches()

__title__ = "tinker_sr"
__version__ = "0.1.0"


class ExperimentalWarning(FutureWarning):
    """Emitted by APIs that may change or go away in any release (a `FutureWarning`, as in
    the SDK, so it is shown by default)."""


__all__ = [
    "APIConnectionError",
    "APIError",
    "APIFuture",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AdamOptimizerConfig",
    "AdamParams",
    "AdminClient",
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
    "LossHandle",
    "ModelID",
    "ModelInput",
    "ModelInputChunk",
    "NotFoundError",
    "OptimParams",
    "OptimStepRequest",
    "OptimStepResponse",
    "ParsedCheckpointTinkerPath",
    "PerDatumLossFn",
    "PermissionDeniedError",
    "PromptProvenanceSpan",
    "RateLimitError",
    "RequestFailedError",
    "RequestOptions",
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
    "Timeout",
    "TinkerError",
    "TrainingClient",
    "TrainingRun",
    "UnprocessableEntityError",
    "__title__",
    "__version__",
    "auth",
    "types",
]
