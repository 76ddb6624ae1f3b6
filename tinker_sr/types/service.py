"""The rest of ``tinker.types`` (SDK 0.38): wire request/response bodies, sessions, futures,
billing, telemetry and search types.

Most are here so that code written against the SDK that imports or builds them runs unchanged
(``from tinker.types import CreateModelRequest``), with the SDK's field names, required fields
and defaults (tests/test_surface.py compares them). The request bodies the server parses as
they are (`StrictBase`: an unknown key is an error) are also the wire codec's models
(`tinker_sr.wire.messages` imports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal, TypeAlias, Union

from pydantic import AwareDatetime, Field

from ._base import BaseModel, StrictBase
from .checkpoint import (
    LoadWeightsResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from .info import CustomLossInput, RequestErrorCategory
from .optimizer import AdamOptimizerConfig, OptimizerConfig
from .training import ForwardBackwardInput, ForwardBackwardOutput, LoraConfig, OptimStepResponse

RequestID: TypeAlias = str
EventType: TypeAlias = Literal[
    "SESSION_START", "SESSION_END", "UNHANDLED_EXCEPTION", "GENERIC_EVENT"
]
Severity: TypeAlias = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


# ---- training and sampling requests ----------------------------------------------------------
@dataclass(frozen=True)
class ForwardBackwardRequest:
    forward_backward_input: ForwardBackwardInput
    model_id: str
    seq_id: int | None = None


@dataclass(frozen=True)
class ForwardRequest:
    forward_input: ForwardBackwardInput
    model_id: str
    seq_id: int | None = None


class CreateModelRequest(StrictBase):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = AdamOptimizerConfig()
    type: Literal["create_model"] = "create_model"


class CreateModelResponse(BaseModel):
    model_id: str
    type: Literal["create_model"] = "create_model"


class UnloadModelRequest(BaseModel):
    model_id: str
    type: Literal["unload_model"] = "unload_model"


class UnloadModelResponse(BaseModel):
    model_id: str
    type: Literal["unload_model"] | None = None


class GetInfoRequest(StrictBase):
    model_id: str
    type: Literal["get_info"] = "get_info"


class SaveWeightsRequest(StrictBase):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(StrictBase):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsExternalRequest(StrictBase):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


class LoadWeightsRequest(StrictBase):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None
    type: Literal["load_weights"] = "load_weights"


class CustomLossNode(BaseModel):
    op: Literal["placeholder", "get_attr", "call_function", "call_method", "call_module", "output"]
    name: str
    target: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class CustomLossGraph(BaseModel):
    format: Literal[1] = 1
    nodes: list[CustomLossNode]


class CreateCustomLossRequest(BaseModel):
    session_id: str
    custom_loss_seq_id: int
    name: str
    inputs: list[CustomLossInput]
    graph: CustomLossGraph
    type: Literal["create_custom_loss"] = "create_custom_loss"


class CreateCustomLossResponse(BaseModel):
    loss_id: str
    type: Literal["create_custom_loss"] = "create_custom_loss"


class CreateSamplingSessionRequest(StrictBase):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"


class CreateSamplingSessionResponse(BaseModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class JoinSamplingSessionRequest(BaseModel):
    sampling_session_id: str
    type: Literal["join_sampling_session"] = "join_sampling_session"


class JoinSamplingSessionResponse(BaseModel):
    type: Literal["join_sampling_session"] = "join_sampling_session"
    client_counter: int


class GetSamplerResponse(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None


# ---- sessions and client configuration -------------------------------------------------------
class ClientConfigRequest(BaseModel):
    sdk_version: str


class ClientConfigResponse(BaseModel):
    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    sample_dispatch_bytes_semaphore_size: int = 10 * 1024 * 1024
    inflight_response_bytes_semaphore_size: int = 50 * 1024 * 1024
    parallel_fwdbwd_chunks: bool = True
    proto_compress_fwdbwd: bool = False
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes_count: int = 5_000_000
    fwdbwd_dispatch_bytes_semaphore_size: int = 50_000_000
    billing_exception_max_pause_duration_sec: int = 3600
    sample_no_retries: bool = False
    sample_enable_stuck_detection: bool = True
    sample_max_concurrent_requests: int = 2000
    use_pyqwest_transport: bool = True
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False


class ClientDynamicConfigResponse(BaseModel):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class CreateSessionRequest(BaseModel):
    tags: list[str]
    user_metadata: dict[str, Any] | None
    sdk_version: str
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(BaseModel):
    type: Literal["create_session"] = "create_session"
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None
    session_id: str


class SessionHeartbeatRequest(StrictBase):
    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionHeartbeatResponse(BaseModel):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class GetSessionResponse(BaseModel):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class ListSessionsResponse(BaseModel):
    sessions: list[str]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class AuthTokenResponse(BaseModel):
    jwt: str


class WhoamiResponse(BaseModel):
    user_urn: str
    org_urn: str
    email: str | None = None


# ---- session status ------------------------------------------------------------------------
class SessionFailedRequestReason(BaseModel):
    type: Literal["request"] = "request"
    request_id: str
    request_type: str


class SessionFailedTrainingRunReason(BaseModel):
    type: Literal["training_run"] = "training_run"
    training_run_id: str


class SessionFailedSamplingSessionReason(BaseModel):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str


SessionFailedReason: TypeAlias = Annotated[
    Union[
        SessionFailedRequestReason,
        SessionFailedTrainingRunReason,
        SessionFailedSamplingSessionReason,
    ],
    Field(discriminator="type"),
]


class SessionFailed(BaseModel):
    type: Literal["failed"] = "failed"
    category: Literal["user", "internal"]
    reason: SessionFailedReason
    message: str


class SessionCancelled(BaseModel):
    type: Literal["cancelled"] = "cancelled"
    detail: str | None = None


class ClientSessionFinishSuccess(BaseModel):
    type: Literal["success"] = "success"


class ClientSessionFinishErrored(BaseModel):
    type: Literal["errored"] = "errored"


class ClientSessionFinishInterrupted(BaseModel):
    type: Literal["interrupted"] = "interrupted"


ClientSessionFinishReason: TypeAlias = Annotated[
    Union[ClientSessionFinishSuccess, ClientSessionFinishErrored, ClientSessionFinishInterrupted],
    Field(discriminator="type"),
]
ClientSessionFinishReasonType: TypeAlias = Literal["success", "errored", "interrupted"]


class ClientSessionFinished(BaseModel):
    type: Literal["client_finished"] = "client_finished"
    reason: ClientSessionFinishReason
    detail: str | None = None


class SessionActive(BaseModel):
    type: Literal["active"] = "active"


SessionStatus: TypeAlias = Annotated[
    Union[SessionActive, SessionFailed, SessionCancelled, ClientSessionFinished],
    Field(discriminator="type"),
]


class ActiveSessionStatusQuery(BaseModel):
    type: Literal["active"] = "active"


class CancelledSessionStatusQuery(BaseModel):
    type: Literal["cancelled"] = "cancelled"


class FailedSessionStatusQuery(BaseModel):
    type: Literal["failed"] = "failed"


class ClientFinishedSessionStatusQuery(BaseModel):
    type: Literal["client_finished"] = "client_finished"
    reasons: list[ClientSessionFinishReasonType] | None = Field(default=None, min_length=1)


SessionStatusQuery: TypeAlias = Union[
    ActiveSessionStatusQuery,
    CancelledSessionStatusQuery,
    FailedSessionStatusQuery,
    ClientFinishedSessionStatusQuery,
]


# ---- session search ------------------------------------------------------------------------
class OwnSearchOwner(BaseModel):
    type: Literal["own"] = "own"


class AccessibleSearchOwner(BaseModel):
    type: Literal["accessible"] = "accessible"


class UserSearchOwner(BaseModel):
    type: Literal["user"] = "user"
    owner_urns: list[str]


SearchOwner: TypeAlias = Union[OwnSearchOwner, AccessibleSearchOwner, UserSearchOwner]


class SessionSearchCursor(BaseModel):
    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(BaseModel):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = None
    owner: SearchOwner = OwnSearchOwner()
    statuses: list[SessionStatusQuery] | None = None
    limit: int = 50
    cursor: SessionSearchCursor | None = None


class SessionSummary(BaseModel):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: SessionStatus | None = None
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchResponse(BaseModel):
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursor | None = None


# ---- futures ---------------------------------------------------------------------------------
class UntypedAPIFuture(BaseModel):
    request_id: RequestID
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class FutureRetrieveRequest(BaseModel):
    request_id: RequestID
    allow_metadata_only: bool = False


class RequestFailedResponse(BaseModel):
    error: str
    category: RequestErrorCategory


class TryAgainResponse(BaseModel):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"]


FutureRetrieveResponse: TypeAlias = Union[
    TryAgainResponse,
    ForwardBackwardOutput,
    OptimStepResponse,
    SaveWeightsResponse,
    LoadWeightsResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsExternalResponse,
    CreateModelResponse,
    UnloadModelResponse,
    RequestFailedResponse,
]


class SamplingSessionFuturesTarget(BaseModel):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: int = 0


class FuturesRetrieveRequest(BaseModel):
    target: SamplingSessionFuturesTarget
    prev_cursor: int = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = []


class FutureFinished(BaseModel):
    state: Literal["finished"] = "finished"
    request_id: str
    response_payload_uncompressed_size: int | None = None


class FutureFailed(BaseModel):
    state: Literal["failed"] = "failed"
    request_id: str


FutureCompletion: TypeAlias = Annotated[
    Union[FutureFinished, FutureFailed], Field(discriminator="state")
]


class FuturesRetrieveResponse(BaseModel):
    completions: list[FutureCompletion]
    cursor: int


# ---- billing and storage usage ---------------------------------------------------------------
class GetBillingUsageRequest(BaseModel):
    starting_on: datetime
    ending_before: datetime


class TrainingBillingEvent(BaseModel):
    type: Literal["training"] = "training"
    token_count: int


class SamplingPrefillBillingEvent(BaseModel):
    type: Literal["sampling_prefill"] = "sampling_prefill"
    cached: bool
    token_count: int


class SamplingSampleBillingEvent(BaseModel):
    type: Literal["sampling_sample"] = "sampling_sample"
    token_count: int


class CheckpointBillingEvent(BaseModel):
    type: Literal["checkpoint"] = "checkpoint"
    count: int


class StorageBillingEvent(BaseModel):
    type: Literal["storage"] = "storage"
    free: bool = False
    gigabyte_hours: float


BillingEventInfo: TypeAlias = Annotated[
    Union[
        TrainingBillingEvent,
        SamplingPrefillBillingEvent,
        SamplingSampleBillingEvent,
        CheckpointBillingEvent,
        StorageBillingEvent,
    ],
    Field(discriminator="type"),
]


class BillingUsageEvent(BaseModel):
    bucket_start: datetime
    bucket_end: datetime
    base_model: str | None = None
    user_id: str | None = None
    user_name: str | None = None
    session_id: str | None = None
    project_id: str | None = None
    estimated_cost_usd: float | None = None
    effective_rate_usd_per_million_tokens: float | None = None
    effective_rate_usd_per_gigabyte_month: float | None = None
    event_info: BillingEventInfo


class BillingUsageSession(BaseModel):
    user_metadata: dict[str, str] | None = None


class BillingUsageResponse(BaseModel):
    data: list[BillingUsageEvent]
    sessions: dict[str, BillingUsageSession] = {}
    cost_data_through: datetime | None = None


class GetCurrentCheckpointStorageUsageRequest(BaseModel):
    project_id: str | None = None


class CurrentCheckpointStorageUsageItem(BaseModel):
    project_id: str | None = None
    org_user_urn: str | None = None
    user_email: str | None = None
    user_name: str | None = None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    estimated_monthly_cost_usd: float | None = None


class CurrentCheckpointStorageUsageResponse(BaseModel):
    effective_rate_usd_per_gigabyte_month: float | None = None
    data: list[CurrentCheckpointStorageUsageItem]


# ---- telemetry -------------------------------------------------------------------------------
class SessionStartEvent(BaseModel):
    """The fields every telemetry event has (in the SDK each event class lists them itself)."""

    event: EventType
    event_id: str
    event_session_index: int
    severity: Severity
    timestamp: datetime


class SessionEndEvent(SessionStartEvent):
    duration: str


class UnhandledExceptionEvent(SessionStartEvent):
    error_message: str
    error_type: str
    traceback: str | None = None


class GenericEvent(SessionStartEvent):
    event_name: str
    event_data: dict[str, object] = {}


TelemetryEvent: TypeAlias = Union[
    SessionStartEvent, SessionEndEvent, UnhandledExceptionEvent, GenericEvent
]


class TelemetrySendRequest(BaseModel):
    events: list[TelemetryEvent]
    platform: str
    sdk_version: str
    session_id: str
    process_uuid: str


class TelemetryBatch(TelemetrySendRequest):
    """The same body under the name the SDK uses for a batch it sends."""


class TelemetryResponse(BaseModel):
    status: Literal["accepted"]
