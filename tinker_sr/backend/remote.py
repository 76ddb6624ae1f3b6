"""`RemoteBackend`: the `Backend` protocol over the Tinker wire protocol.

Speaks to a tinker_sr server, or any Tinker-compatible service, the way the official SDK
0.38 does: the same paths, headers and bodies (forward_backward as protobuf), a
``client/config`` bootstrap, a heartbeat per session, and futures that are submitted and
then long-polled with ``retrieve_future``. Each public method resolves when the work is
done, as the protocol requires.

The HTTP plumbing (headers, retries with backoff, bootstrap, heartbeats, submitting and
long-polling futures) is `backend.transport.WireTransport`, which this class extends with
one method per `Backend` call. Submissions carry their ``seq_id``, so a server dedupes a
resubmission instead of running it twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from urllib.parse import quote

import pydantic

from tinker_sr import types, validation
from tinker_sr.backend.base import CloseStatus
from tinker_sr.backend.transport import DEFAULT_BASE_URL, PROTOBUF, WireTransport, log
from tinker_sr.errors import (
    APIResponseValidationError,
    RequestFailedError,
    TinkerError,
    refusal,
    refused_as_400,
)
from tinker_sr.wire import WireError, compression, proto
from tinker_sr.wire import messages as m

__all__ = ["RemoteBackend", "DEFAULT_BASE_URL"]

TRACE_EXPORT_POLL_S = 5.0  # between polls of a session's trace export (the SDK's pace)


class RemoteBackend(WireTransport):
    """The `Backend` protocol over HTTP. One instance may serve many sessions."""

    # ---- sessions -----------------------------------------------------------------------------

    async def create_session(
        self,
        *,
        user_metadata: Mapping[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        tags: Sequence[str] = (),
    ) -> str:
        req = m.CreateSessionRequest(
            tags=list(dict.fromkeys(tags)),
            user_metadata=dict(user_metadata or {}),
            sdk_version=m.SDK_VERSION,
            project_id=project_id or self.project_id,
            display_name=display_name,
        )
        resp, body = await self._post("/api/v1/create_session", m.to_json(req))
        session_id = body.get("session_id") if isinstance(body, dict) else None
        if not isinstance(session_id, str):
            raise APIResponseValidationError(
                resp, body, "create_session must return a string session_id"
            )
        for level, key in (
            (logging.INFO, "info_message"),
            (logging.WARNING, "warning_message"),
            (logging.ERROR, "error_message"),
        ):
            if body.get(key):
                log.log(level, "%s", body[key])
        if not self._closed:
            self._heartbeats[session_id] = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(session_id)
            )
        return session_id

    async def close_session(
        self, session_id: str, status: CloseStatus, detail: str | None = None
    ) -> None:
        task = self._heartbeats.pop(session_id, None)
        if task is not None:
            task.cancel()
        await self._ensure_config()
        # Any 2xx will do (204 has no body).
        await self._request(
            "POST",
            f"/api/v1/sessions/{_seg(session_id)}/finish",
            json={"reason": {"type": status}, "detail": detail},
        )

    async def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        resp, body = await self._get("/api/v1/get_server_capabilities")
        return self._validate(types.GetServerCapabilitiesResponse, resp, body)

    # ---- training -------------------------------------------------------------------------------

    async def create_model(
        self,
        session_id: str,
        model_seq_id: int,
        *,
        base_model: str,
        lora_config: types.LoraConfig,
        optimizer_config: types.OptimizerConfig | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> str:
        req = m.CreateModelRequest(
            session_id=session_id,
            model_seq_id=model_seq_id,
            base_model=base_model,
            lora_config=lora_config,
            optimizer_config=optimizer_config or types.AdamOptimizerConfig(),
            user_metadata=dict(user_metadata) if user_metadata else None,
        )
        result = await self._future_json(
            "/api/v1/create_model", m.to_json(req), "CreateModel", _ModelIdResult
        )
        return result.model_id

    async def create_model_from_state(
        self,
        session_id: str,
        model_seq_id: int,
        *,
        path: str,
        with_optimizer: bool,
        base_model: str | None = None,
        optimizer_config: types.OptimizerConfig | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> str:
        req = m.LoadWeightsRequest(
            session_id=session_id,
            model_seq_id=model_seq_id,
            path=path,
            optimizer=with_optimizer,
            base_model=base_model,
            optimizer_config=optimizer_config,
            user_metadata=dict(user_metadata) if user_metadata else None,
        )
        result = await self._future_json(
            "/api/v1/load_weights", m.to_json(req), "LoadWeights", types.LoadWeightsResponse
        )
        # The SDK assumes this id; a server that says otherwise wins.
        return result.model_id or f"{session_id}:train:{model_seq_id}"

    async def get_info(self, model_id: str) -> types.GetInfoResponse:
        resp, body = await self._post(
            "/api/v1/get_info", m.to_json(m.GetInfoRequest(model_id=model_id))
        )
        return self._validate(types.GetInfoResponse, resp, body)

    async def forward_backward(
        self,
        model_id: str,
        seq_id: int,
        data: Sequence[types.Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None = None,
        *,
        forward_only: bool = False,
    ) -> types.ForwardBackwardOutput:
        async with self._submit_order.turn(model_id, seq_id):  # first: see SubmitOrder
            await self._ensure_config()
            try:
                body = proto.encode_forward_backward_request(
                    model_id, seq_id, data, loss_fn, loss_fn_config, forward_only=forward_only
                )
            except WireError as e:
                raise RequestFailedError(
                    f"Request failed: {e}",
                    request_id="",
                    category=types.RequestErrorCategory.User,
                ) from None
            headers = {"Content-Type": PROTOBUF}
            if self.client_config.get("proto_compress_fwdbwd"):
                body = compression.zstd_compress(body)
                headers["Content-Encoding"] = "zstd"
            promise = await self._submit(
                "/api/v1/forward_backward", None, content=body, headers=headers
            )
        kind = "Forward" if forward_only else "ForwardBackward"
        resp, result = await self._await(promise, kind, want_proto=True)
        if not isinstance(result, bytes):
            raise APIResponseValidationError(
                resp,
                result,
                f"{kind} result must be protobuf (tinker_public.ForwardBackwardOutput)",
            )
        try:
            return proto.decode_forward_backward_output(result)
        except WireError as e:
            raise APIResponseValidationError(resp, None, str(e)) from None

    async def release_seq(self, model_id: str, seq_id: int) -> None:
        """Nothing to send: the wire has no release call. Our clients never leave a gap, and
        the server releases numbers of requests it refused and, after a grace period, any
        other gap."""

    async def optim_step(
        self, model_id: str, seq_id: int, adam_params: types.AdamParams
    ) -> types.OptimStepResponse:
        if isinstance(adam_params, types.AdamParams):
            req = m.OptimStepRequest(model_id=model_id, seq_id=seq_id, adam_params=adam_params)
        else:  # Dimuon and the like: as the SDK sends them, for the service to accept or refuse
            other = pydantic.BaseModel.model_dump(adam_params, mode="json")
            req = m.OptimStepRequest(model_id=model_id, seq_id=seq_id, optimizer_params=other)
        # As the SDK sends it: a NaN or infinite hyperparameter as null, which the service
        # refuses (400) and so frees the number; refused here, it would leave a gap.
        body = json.loads(req.model_dump_json(exclude_none=True))
        return await self._future_json(
            "/api/v1/optim_step",
            body,
            "OptimStep",
            types.OptimStepResponse,
            order=(model_id, seq_id),
        )

    async def save_state(
        self,
        model_id: str,
        seq_id: int,
        name: str,
        *,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: Mapping[str, str] | None = None,
    ) -> types.SaveWeightsResponse:
        req = m.SaveWeightsRequest(
            model_id=model_id,
            path=name,
            seq_id=seq_id,
            ttl_seconds=ttl_seconds,
            overwrite=overwrite,
            user_metadata=dict(user_metadata) if user_metadata else None,
        )
        return await self._future_json(
            "/api/v1/save_weights",
            m.to_json(req),
            "SaveWeights",
            types.SaveWeightsResponse,
            order=(model_id, seq_id),
        )

    async def save_weights_for_sampler(
        self,
        model_id: str,
        seq_id: int,
        *,
        name: str | None = None,
        sampling_session_seq_id: int | None = None,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> types.SaveWeightsForSamplerResponseInternal:
        req = m.SaveWeightsForSamplerRequest(
            model_id=model_id,
            path=name,
            sampling_session_seq_id=None if name is not None else sampling_session_seq_id,
            seq_id=seq_id,
            ttl_seconds=ttl_seconds,
            user_metadata=dict(user_metadata) if user_metadata else None,
        )
        return await self._future_json(
            "/api/v1/save_weights_for_sampler",
            m.to_json(req),
            "SaveWeightsForSampler",
            types.SaveWeightsForSamplerResponseInternal,
            order=(model_id, seq_id),
        )

    async def save_weights_external(
        self,
        model_id: str,
        seq_id: int,
        name: str,
        *,
        ttl_seconds: int | None = None,
        age_encryption_recipients: Sequence[str] | None = None,
    ) -> types.SaveWeightsExternalResponse:
        req = m.SaveWeightsExternalRequest(
            model_id=model_id,
            path=name,
            seq_id=seq_id,
            ttl_seconds=ttl_seconds,
            age_encryption_recipients=None
            if age_encryption_recipients is None
            else list(age_encryption_recipients),
        )
        return await self._future_json(
            "/api/v1/save_weights_external",
            m.to_json(req),
            "SaveWeightsExternal",
            types.SaveWeightsExternalResponse,
            order=(model_id, seq_id),
        )

    async def load_state(
        self, model_id: str, seq_id: int, path: str, *, with_optimizer: bool
    ) -> types.LoadWeightsResponse:
        req = m.LoadWeightsRequest(
            model_id=model_id, seq_id=seq_id, path=path, optimizer=with_optimizer
        )
        return await self._future_json(
            "/api/v1/load_weights",
            m.to_json(req),
            "LoadWeights",
            types.LoadWeightsResponse,
            order=(model_id, seq_id),
        )

    # ---- sampling -------------------------------------------------------------------------------

    async def create_sampling_session(
        self,
        session_id: str,
        sampling_session_seq_id: int,
        *,
        base_model: str | None = None,
        model_path: str | None = None,
    ) -> str:
        req = m.CreateSamplingSessionRequest(
            session_id=session_id,
            sampling_session_seq_id=sampling_session_seq_id,
            base_model=base_model,
            model_path=model_path,
        )
        resp, body = await self._post("/api/v1/create_sampling_session", m.to_json(req))
        sampler_id = body.get("sampling_session_id") if isinstance(body, dict) else None
        if not isinstance(sampler_id, str):
            raise APIResponseValidationError(
                resp, body, "create_sampling_session must return a string sampling_session_id"
            )
        return sampler_id

    async def get_sampler_base_model(self, sampler_id: str) -> str:
        return (await self.get_sampler(sampler_id)).base_model

    async def get_sampler(self, sampler_id: str) -> types.GetSamplerResponse:
        resp, body = await self._get(f"/api/v1/samplers/{_seg(sampler_id)}")
        try:
            return types.GetSamplerResponse.model_validate(body)
        except pydantic.ValidationError as e:
            raise APIResponseValidationError(
                resp, body, f"samplers/{{id}} must return a sampler_id and a base_model: {e}"
            ) from None

    async def sampler_tokenizer_id(self, sampler_id: str) -> str | None:
        """The tokenizer id a tinker_sr server gives for ``sampler_id`` (None from others)."""
        _, body = await self._get(f"/api/v1/samplers/{_seg(sampler_id)}")
        found = body.get("tokenizer_id") if isinstance(body, dict) else None
        return found if isinstance(found, str) and found else None

    async def sample(
        self,
        sampler_id: str,
        seq_id: int,
        *,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
        record_stability_info: bool = False,
        sequence_ids: Sequence[str] | None = None,
    ) -> types.SampleResponse:
        if sequence_ids is not None:
            raise TinkerError(
                "RemoteBackend.sample: the server chooses sequence ids; pass sequence_ids=None"
            )
        req = m.SampleRequest(
            num_samples=num_samples,
            prompt=prompt,
            sampling_params=m.WireSamplingParams.from_public(sampling_params),
            sampling_session_id=sampler_id,
            seq_id=seq_id,
            prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_logprobs=(
                m.WireTensorData.from_public(target_prompt_logprobs)
                if target_prompt_logprobs is not None
                else None
            ),
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            record_stability_info=record_stability_info,
        )
        # 429 means "slow down": the retry loop backs off and resubmits the same seq_id.
        promise = await self._submit_sample(
            m.to_json(req), headers={"X-Tinker-Sampling-Backpressure": "1"}
        )
        ids = promise.get("sample_sequence_ids")
        resp, result = await self._await(promise, "Sample", want_proto=True)
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise APIResponseValidationError(
                resp, promise, "the asample promise carried no sample_sequence_ids"
            )
        if not isinstance(result, bytes):
            raise APIResponseValidationError(
                resp, result, "Sample result must be protobuf (tinker_public.SampleResponse)"
            )
        try:
            return proto.decode_sample_response(result, ids)
        except WireError as e:
            raise APIResponseValidationError(resp, None, str(e)) from None

    # ---- checkpoints / runs ----------------------------------------------------------------------

    async def list_checkpoints(self, training_run_id: str) -> types.CheckpointsListResponse:
        resp, body = await self._get(f"/api/v1/training_runs/{_seg(training_run_id)}/checkpoints")
        return self._validate(types.CheckpointsListResponse, resp, body)

    async def list_user_checkpoints(
        self, *, limit: int = 100, offset: int = 0, runs: Collection[str] | None = None
    ) -> types.CheckpointsListResponse:
        _server_side("runs", runs)
        resp, body = await self._get("/api/v1/checkpoints", {"limit": limit, "offset": offset})
        return self._validate(types.CheckpointsListResponse, resp, body)

    async def get_training_run(self, training_run_id: str) -> types.TrainingRun:
        resp, body = await self._get(
            f"/api/v1/training_runs/{_seg(training_run_id)}", {"access_scope": "owned"}
        )
        return self._validate(types.TrainingRun, resp, body)

    async def list_sessions(
        self, *, limit: int = 20, offset: int = 0
    ) -> types.ListSessionsResponse:
        refused_as_400(validation.check_paging, limit, offset, "list_sessions")  # as a server
        resp, body = await self._get(
            "/api/v1/sessions", {"limit": limit, "offset": offset, "access_scope": "owned"}
        )
        return self._validate(types.ListSessionsResponse, resp, body)

    async def get_session(self, session_id: str) -> types.GetSessionResponse:
        path = f"/api/v1/sessions/{_seg(session_id)}"
        resp, body = await self._get(path, {"access_scope": "owned"})
        return self._validate(types.GetSessionResponse, resp, body)

    async def search_sessions(
        self, request: types.SessionSearchRequest
    ) -> types.SessionSearchResponse:
        body = request.model_dump(mode="json", exclude_none=True)
        resp, got = await self._post("/api/v1/sessions/search", body)
        return self._validate(types.SessionSearchResponse, resp, got)

    async def assign_session_project(self, session_id: str, project_id: str) -> None:
        await self._ensure_config()
        path = f"/api/v1/sessions/{_seg(session_id)}/project"
        await self._request("PUT", path, json={"project_id": project_id})

    async def export_session_trace(self, session_id: str) -> str:
        """Poll the service's trace export until the file is ready (as the SDK does)."""
        path, announced = f"/api/v1/sessions/{_seg(session_id)}/trace_export", False
        while True:
            resp, body = await self._get(path)
            status = body.get("status") if isinstance(body, dict) else None
            if status == "ready" and isinstance(body.get("url"), str):
                return str(body["url"])
            if status == "failed":
                raise RuntimeError(
                    f"Trace export failed for session {session_id}: {body.get('error')}"
                )
            if status != "pending":
                raise APIResponseValidationError(
                    resp, body, f"{path}: unexpected answer {body!r:.200}"
                )
            if not announced:
                log.warning(
                    "Building trace export for session: %s (this may take a while)", session_id
                )
                announced = True
            await asyncio.sleep(TRACE_EXPORT_POLL_S)

    async def list_training_runs(
        self, *, limit: int = 20, offset: int = 0, runs: Collection[str] | None = None
    ) -> types.TrainingRunsResponse:
        _server_side("runs", runs)
        resp, body = await self._get(
            "/api/v1/training_runs", {"limit": limit, "offset": offset, "access_scope": "owned"}
        )
        return self._validate(types.TrainingRunsResponse, resp, body)

    async def get_billing_usage(
        self,
        starting_on: datetime | str,
        ending_before: datetime | str,
        *,
        sessions: Collection[str] | None = None,
    ) -> types.BillingUsageResponse:
        _server_side("sessions", sessions)
        request = types.GetBillingUsageRequest.model_validate(
            {"starting_on": starting_on, "ending_before": ending_before}
        )
        params = request.model_dump(mode="json")
        resp, body = await self._get("/api/v1/billing/usage/events", params)
        return self._validate(types.BillingUsageResponse, resp, body)

    async def get_current_checkpoint_storage_usage(
        self, project_id: str | None = None, *, sessions: Collection[str] | None = None
    ) -> types.CurrentCheckpointStorageUsageResponse:
        _server_side("sessions", sessions)
        params = {} if project_id is None else {"project_id": project_id}
        resp, body = await self._get("/api/v1/billing/usage/checkpoints/current", params)
        return self._validate(types.CurrentCheckpointStorageUsageResponse, resp, body)

    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> None:
        await self._ensure_config()
        await self._request("DELETE", _checkpoint_route(training_run_id, checkpoint_id))

    async def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        parsed = _parse_path(tinker_path)
        await self._ensure_config()
        await self._request(
            "PUT",
            _checkpoint_route(parsed.training_run_id, parsed.checkpoint_id, "/ttl"),
            json={"ttl_seconds": ttl_seconds},
        )

    async def get_checkpoint(self, tinker_path: str) -> types.Checkpoint:
        parsed = _parse_path(tinker_path)
        listing = await self.list_checkpoints(parsed.training_run_id)
        for ckpt in listing.checkpoints:
            if ckpt.tinker_path == tinker_path:
                return ckpt
        raise RequestFailedError(
            f"Request failed: checkpoint {tinker_path} does not exist",
            request_id="",
            category=types.RequestErrorCategory.User,
        )

    def _checkpoint_url(self, tinker_path: str, suffix: str = "") -> str:
        parsed = _parse_path(tinker_path)
        return _checkpoint_route(parsed.training_run_id, parsed.checkpoint_id, suffix)

    async def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        url = self._checkpoint_url(tinker_path, "/publish")
        await self._ensure_config()
        await self._request("POST" if public else "DELETE", url)

    async def get_weights_info(self, tinker_path: str) -> types.WeightsInfoResponse:
        resp, body = await self._post("/api/v1/weights_info", {"tinker_path": tinker_path})
        return self._validate(types.WeightsInfoResponse, resp, body)

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
        req = types.CopyWeightsRequest(
            session_id=session_id,
            model_seq_id=model_seq_id,
            destination_project_id=destination_project_id,
            source_path=source_path,
            ttl_seconds=ttl_seconds,
        )
        # Like the SDK: the token travels in a header, never in the (logged) body.
        headers = (
            {"X-Tinker-Weights-Access-Token": weights_access_token}
            if weights_access_token is not None
            else None
        )
        resp, body = await self._post("/api/v1/copy_weights", m.to_json(req), headers=headers)
        return self._validate(types.CopyWeightsResponse, resp, body).tinker_path

    async def get_external_weights_urls(
        self, tinker_path: str
    ) -> types.ExternalWeightsUrlsResponse:
        resp, body = await self._get(self._checkpoint_url(tinker_path, "/external_weights_urls"))
        return self._validate(types.ExternalWeightsUrlsResponse, resp, body)


class _ModelIdResult(types.BaseModel):
    model_config = pydantic.ConfigDict(protected_namespaces=())
    model_id: str


def _seg(value: object) -> str:
    """``value`` as one URL path segment: quoted, so "?", "#", "/" or "%" in an id cannot end
    or change the path (a REST call reaching another resource); "." and ".." (which a URL
    resolves away) name nothing. A long one goes as it is (a server answers it, as for the
    SDK; httpx refuses a URL over 64 KiB)."""
    text = str(value)
    if text in ("", ".", ".."):
        raise refusal(404, f"{text!r:.60} names no session, run, sampler or checkpoint")
    return quote(text, safe="")


def _checkpoint_route(run_id: str, checkpoint_id: str, suffix: str = "") -> str:
    """``/training_runs/<run>/checkpoints/<kind>/<name><suffix>``, each segment quoted."""
    parts = "/".join(_seg(p) for p in str(checkpoint_id).split("/"))
    return f"/api/v1/training_runs/{_seg(run_id)}/checkpoints/{parts}{suffix}"


def _parse_path(tinker_path: str) -> types.ParsedCheckpointTinkerPath:
    try:
        return types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    except ValueError as e:
        raise RequestFailedError(
            f"Request failed: {e}", request_id="", category=types.RequestErrorCategory.User
        ) from None


def _server_side(name: str, value: Collection[str] | None) -> None:
    if value is not None:
        raise ValueError(
            f"{name}= limits a server's own query to one caller's {name}; a server answers "
            f"each caller with its own {name} already"
        )
