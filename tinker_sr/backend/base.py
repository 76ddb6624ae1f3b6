"""The one seam between the public clients and compute.

Clients (`tinker_sr.clients`) only ever call a `Backend`. `LocalBackend` runs the embedded
engine in-process; `RemoteBackend` speaks the Tinker wire protocol to a server, and our server
(`tinker_sr.server`) is a `LocalBackend` behind the wire codec. Every method is a coroutine
that resolves when the work is *done* (the remote backend hides submit + poll behind it).

Identifiers follow the Tinker conventions (as the official SDK forms them), so that they mean
the same thing locally and over the wire:

* ``session_id``: created by `create_session`.
* ``model_id``: ``"{session_id}:train:{model_seq_id}"``; ``model_seq_id`` is chosen by the
  client (0, 1, 2, ... per session, shared by every way of creating a training client).
* ``sampler_id``: ``"{session_id}:sample:{sampling_session_seq_id}"``; the seq id is chosen
  by the client, per session, shared by `create_sampling_session` and unnamed
  `save_weights_for_sampler`.
* training ``seq_id``: per model, reserved by the client at call time, starting at 1; the
  backend executes a model's requests strictly in ``seq_id`` order.

Errors: a caller mistake surfaces as ``RequestFailedError(category=User)`` from the awaited
call (or, for plain calls like `get_info`, an `APIStatusError` subclass in the remote case);
`TinkerError` subclasses are the only exceptions a backend raises, except
`NotImplementedError` for a feature the backend does not have.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from datetime import datetime

    from tinker_sr.types import (
        AdamParams,
        BillingUsageResponse,
        Checkpoint,
        CheckpointsListResponse,
        CurrentCheckpointStorageUsageResponse,
        Datum,
        ExternalWeightsUrlsResponse,
        ForwardBackwardOutput,
        GetInfoResponse,
        GetSamplerResponse,
        GetServerCapabilitiesResponse,
        GetSessionResponse,
        ListSessionsResponse,
        LoadWeightsResponse,
        LoraConfig,
        ModelInput,
        OptimizerConfig,
        OptimStepResponse,
        SampleResponse,
        SamplingParams,
        SaveWeightsExternalResponse,
        SaveWeightsForSamplerResponseInternal,
        SaveWeightsResponse,
        SessionSearchRequest,
        SessionSearchResponse,
        TensorData,
        TrainingRun,
        TrainingRunsResponse,
        WeightsInfoResponse,
    )

CloseStatus = Literal["success", "errored", "interrupted"]


class WorkNotStarted(Exception):
    """Raised, instead of starting it, by work a backend was told not to start any more
    (``stop_starting``, at a server's shutdown): the request was not run, so its future stays
    pending and the restarted server fails it as interrupted (the client submits it again)."""


@runtime_checkable
class Backend(Protocol):
    """Async compute + state for the clients. One instance may serve many sessions."""

    # ---- sessions ---------------------------------------------------------------------
    async def create_session(
        self,
        *,
        user_metadata: Mapping[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        tags: Sequence[str] = (),
    ) -> str:
        """Create a session; returns its id."""
        ...

    async def close_session(
        self, session_id: str, status: CloseStatus, detail: str | None = None
    ) -> None: ...

    async def list_sessions(self, *, limit: int = 20, offset: int = 0) -> ListSessionsResponse:
        """This caller's session ids, newest first."""
        ...

    async def get_session(self, session_id: str) -> GetSessionResponse:
        """A session's training runs, sampling sessions, metadata and display name."""
        ...

    async def search_sessions(self, request: SessionSearchRequest) -> SessionSearchResponse:
        """One page of the organization's sessions (a hosted-service endpoint)."""
        ...

    async def assign_session_project(self, session_id: str, project_id: str) -> None:
        """Move a session into a project (a hosted-service endpoint)."""
        ...

    async def export_session_trace(self, session_id: str) -> str:
        """A signed URL of the session's trace file, when built (a hosted-service endpoint)."""
        ...

    async def get_server_capabilities(self) -> GetServerCapabilitiesResponse: ...

    # ---- training models --------------------------------------------------------------
    async def create_model(
        self,
        session_id: str,
        model_seq_id: int,
        *,
        base_model: str,
        lora_config: LoraConfig,
        optimizer_config: OptimizerConfig | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Create a LoRA training model; returns ``model_id``."""
        ...

    async def create_model_from_state(
        self,
        session_id: str,
        model_seq_id: int,
        *,
        path: str,
        with_optimizer: bool,
        base_model: str | None = None,
        optimizer_config: OptimizerConfig | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Create a training model from a ``tinker://.../weights/...`` checkpoint."""
        ...

    async def get_info(self, model_id: str) -> GetInfoResponse: ...

    async def forward_backward(
        self,
        model_id: str,
        seq_id: int,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None = None,
        *,
        forward_only: bool = False,
    ) -> ForwardBackwardOutput: ...

    async def release_seq(self, model_id: str, seq_id: int) -> None:
        """Give up a reserved ``seq_id`` that will never be submitted (later ones then run)."""
        ...

    async def optim_step(
        self, model_id: str, seq_id: int, adam_params: AdamParams
    ) -> OptimStepResponse: ...

    async def save_state(
        self,
        model_id: str,
        seq_id: int,
        name: str,
        *,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: Mapping[str, str] | None = None,
    ) -> SaveWeightsResponse: ...

    async def save_weights_for_sampler(
        self,
        model_id: str,
        seq_id: int,
        *,
        name: str | None = None,
        sampling_session_seq_id: int | None = None,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> SaveWeightsForSamplerResponseInternal:
        """Named: persist sampler weights and return their path. Unnamed (``name=None``):
        snapshot the current weights into a new sampler whose id is returned in
        ``sampling_session_id`` of the response (``path`` is then empty)."""
        ...

    async def load_state(
        self, model_id: str, seq_id: int, path: str, *, with_optimizer: bool
    ) -> LoadWeightsResponse: ...

    # ---- sampling ---------------------------------------------------------------------
    async def create_sampling_session(
        self,
        session_id: str,
        sampling_session_seq_id: int,
        *,
        base_model: str | None = None,
        model_path: str | None = None,
    ) -> str:
        """Returns ``sampler_id``."""
        ...

    async def get_sampler_base_model(self, sampler_id: str) -> str: ...

    async def get_sampler(self, sampler_id: str) -> GetSamplerResponse:
        """A sampling session's base model and checkpoint path (if any)."""
        ...

    async def sample(
        self,
        sampler_id: str,
        seq_id: int,
        *,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
        record_stability_info: bool = False,
        sequence_ids: Sequence[str] | None = None,
    ) -> SampleResponse:
        """Every returned sequence carries a session-scoped ``sequence_id`` (the given ones,
        or fresh ones when ``sequence_ids`` is None) and is recorded for provenance."""
        ...

    # ---- checkpoints / runs (RestClient) ----------------------------------------------
    async def list_checkpoints(self, training_run_id: str) -> CheckpointsListResponse: ...

    async def list_user_checkpoints(
        self, *, limit: int = 100, offset: int = 0, runs: Collection[str] | None = None
    ) -> CheckpointsListResponse:
        """A page of the checkpoints, newest first. ``runs``: of these training runs only (a
        server's backend, for one caller; a remote backend's server does that itself, and it
        refuses the argument)."""
        ...

    async def get_training_run(self, training_run_id: str) -> TrainingRun: ...

    async def list_training_runs(
        self, *, limit: int = 20, offset: int = 0, runs: Collection[str] | None = None
    ) -> TrainingRunsResponse:
        """A page of the training runs, newest first (``runs``: as in `list_user_checkpoints`)."""
        ...

    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> None: ...

    async def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None: ...

    async def get_checkpoint(self, tinker_path: str) -> Checkpoint: ...

    async def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        """Publish (``public=True``) or unpublish a checkpoint; shown as ``Checkpoint.public``.
        Setting the flag it already has is a no-op."""
        ...

    async def get_weights_info(self, tinker_path: str) -> WeightsInfoResponse:
        """Base model and LoRA configuration of a checkpoint of either kind."""
        ...

    async def copy_weights(
        self,
        source_path: str,
        *,
        session_id: str | None = None,
        model_seq_id: int | None = None,
        destination_project_id: str | None = None,
        ttl_seconds: int | None = None,
        weights_access_token: str | None = None,
    ) -> str:
        """Copy a checkpoint (either kind) into a new training run; returns the copy's path.

        The run is ``"{session_id}:train:{model_seq_id}"`` (a slot of an existing session,
        numbered like `create_model`), or, when neither is given, run 0 of a new, finished
        session in project ``destination_project_id``. The copy keeps the source's kind and
        name (``tinker://<new run>/<segment>/<name>``), loads exactly like the source, is
        private, and expires after ``ttl_seconds`` (3600 s to 10 years; ``None`` = never; the
        source's expiry is not inherited). The new run holds no trainable model.
        """
        ...

    async def save_weights_external(
        self,
        model_id: str,
        seq_id: int,
        name: str,
        *,
        ttl_seconds: int | None = None,
        age_encryption_recipients: Sequence[str] | None = None,
    ) -> SaveWeightsExternalResponse:
        """Export the current adapters as ``tinker://<run>/external_weights/<name>`` (files
        for other tools; encrypted to the age recipients if any)."""
        ...

    async def get_external_weights_urls(self, tinker_path: str) -> ExternalWeightsUrlsResponse:
        """Download URLs of an ``external_weights`` checkpoint's files, by file name."""
        ...

    # ---- usage (AdminClient) ------------------------------------------------------------
    async def get_billing_usage(
        self,
        starting_on: datetime | str,
        ending_before: datetime | str,
        *,
        sessions: Collection[str] | None = None,
    ) -> BillingUsageResponse:
        """Hourly usage buckets in ``[starting_on, ending_before)`` (UTC hours, at most 14
        days): tokens trained, prefilled (computed / from the prompt cache), sampled, and
        checkpoints saved, per session and base model (`tinker_sr.engine.usage`).
        ``sessions``: only these (a server's backend, for one caller; a remote backend's
        server does that itself, and it refuses the argument)."""
        ...

    async def get_current_checkpoint_storage_usage(
        self, project_id: str | None = None, *, sessions: Collection[str] | None = None
    ) -> CurrentCheckpointStorageUsageResponse:
        """The checkpoints stored now: count and bytes per project (``sessions``: as in
        `get_billing_usage`)."""
        ...

    async def aclose(self) -> None:
        """Release resources (threads, connections)."""
        ...
