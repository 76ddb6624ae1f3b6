"""`RemoteBackend`: the `Backend` protocol over the Tinker wire protocol (spec/wire.md).

Speaks to a tinker_sr server, or any Tinker-compatible service, the way the official SDK
0.38 does: the same paths, headers and bodies (forward_backward as protobuf), a
``client/config`` bootstrap, a heartbeat per session, and futures that are submitted and
then long-polled with ``retrieve_future``. Each public method resolves when the work is
done, as the protocol requires.

Retries: every call retries connection errors, timeouts and HTTP 408/409/429/5xx with
exponential backoff (0.5 s doubling, capped at 10 s, up to 25 % jitter; ``Retry-After`` is
obeyed when it is at most 60 s), re-sending the same body with the same
``X-Idempotency-Key``. Submissions carry their ``seq_id``, so a server dedupes a
resubmission instead of running it twice. Errors become `tinker_sr.errors` exceptions: an
HTTP error is the matching `APIStatusError` subclass, a future that resolved to
``{"error", "category"}`` is `RequestFailedError` with that category.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import os
import platform
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import httpx
import pydantic

from tinker_sr import types
from tinker_sr.backend.base import CloseStatus
from tinker_sr.errors import (
    APIConnectionError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    RequestFailedError,
    TinkerError,
    make_status_error,
)
from tinker_sr.wire import WireError, proto
from tinker_sr.wire import messages as m

__all__ = ["RemoteBackend", "DEFAULT_BASE_URL"]

log = logging.getLogger("tinker_sr.remote")

DEFAULT_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"
_PROTOBUF = "application/x-protobuf"
_RETRYABLE = frozenset({408, 409, 429})
_HEARTBEAT_S = 10.0
_HEARTBEAT_WARN_AFTER_S = 120.0

M = TypeVar("M", bound=pydantic.BaseModel)


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("tinker-sr")
    except Exception:
        return "0"


def _retry_after(resp: httpx.Response) -> float | None:
    """Seconds from ``retry-after-ms`` / ``retry-after`` when 0 < value <= 60."""
    raw_ms = resp.headers.get("retry-after-ms")
    seconds: float | None = None
    if raw_ms:
        with contextlib.suppress(ValueError):
            seconds = float(raw_ms) / 1000
    raw = resp.headers.get("retry-after")
    if seconds is None and raw:
        try:
            seconds = float(raw)
        except ValueError:
            parsed = email.utils.parsedate_to_datetime(raw) if raw else None
            if parsed is not None:
                seconds = parsed.timestamp() - time.time()
    return seconds if seconds is not None and 0 < seconds <= 60 else None


def _backoff(attempt: int, base: float = 0.5, cap: float = 10.0) -> float:
    delay = min(base * 2**attempt, cap)
    return delay * (1 - 0.25 * random.random())


def _error_body(resp: httpx.Response) -> object:
    try:
        return resp.json()
    except ValueError:
        return resp.text or None


def _status_error(resp: httpx.Response) -> APIStatusError:
    body = _error_body(resp)
    detail = body.get("detail", body) if isinstance(body, dict) else body
    return make_status_error(f"Error code: {resp.status_code} - {detail}", resp, body)


class RemoteBackend:
    """The `Backend` protocol over HTTP. One instance may serve many sessions."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        default_headers: Mapping[str, str] | None = None,
        project_id: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        poll_timeout: float = 45.0,
        max_retries: int = 10,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        url = base_url or os.environ.get("TINKER_BASE_URL") or DEFAULT_BASE_URL
        self.base_url = url.rstrip("/")
        key = api_key or os.environ.get("TINKER_API_KEY")
        if not key:
            raise TinkerError(
                "RemoteBackend needs an API key: pass api_key='tml-...' or set TINKER_API_KEY"
            )
        if not key.startswith(("tml-", "eyJ")):
            raise TinkerError("The api_key must start with the 'tml-' prefix")
        self._api_key = key
        self.project_id = project_id or os.environ.get("TINKER_PROJECT_ID") or None
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.poll_timeout = poll_timeout
        self.max_retries = max_retries
        self._transport = transport
        self._headers = {
            "X-API-Key": key,
            "User-Agent": f"tinker-sr/{_package_version()} (tinker SDK {m.SDK_VERSION} protocol)",
            "x-sdk-version": m.SDK_VERSION,
            "x-stainless-os": platform.system(),
            "x-stainless-arch": platform.machine(),
            "x-stainless-runtime": "CPython",
            "x-stainless-runtime-version": platform.python_version(),
            "x-stainless-async": "async:asyncio",
            **dict(default_headers or {}),
        }
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._config: dict[str, Any] | None = None
        self._config_lock: asyncio.Lock | None = None
        self._heartbeats: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        self._sleep = asyncio.sleep  # tests replace it to observe backoff without waiting

    # ---- HTTP -----------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise TinkerError("RemoteBackend is closed")
        if self._client is None or self._client_loop is not loop:
            # An httpx client belongs to one event loop; a new loop gets its own.
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
                transport=self._transport,
                limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
            )
            self._client_loop = loop
            self._config_lock = None
        return self._client

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        max_retries: int | None = None,
        expect_error: frozenset[int] = frozenset(),
    ) -> httpx.Response:
        """One call with retries; returns a 2xx response (or one whose status the caller
        handles itself, ``expect_error``), else raises the matching `TinkerError`."""
        client = self._http()
        retries = self.max_retries if max_retries is None else max_retries
        hdrs = dict(headers or {})
        if method != "GET":
            # Same key on every retry of this call: the server may dedupe on it.
            hdrs.setdefault("X-Idempotency-Key", f"stainless-python-retry-{uuid.uuid4()}")
        read_timeout = self.timeout if timeout is None else timeout
        hdrs["x-stainless-read-timeout"] = str(read_timeout)
        attempt = 0
        while True:
            hdrs["x-stainless-retry-count"] = str(attempt)
            request = client.build_request(
                method,
                path,
                json=json,
                content=content,
                headers=hdrs,
                params=params,
                timeout=httpx.Timeout(read_timeout, connect=self.connect_timeout),
            )
            try:
                resp = await client.send(request)
            except httpx.TimeoutException as e:
                if attempt >= retries:
                    raise APITimeoutError(request) from e
            except httpx.TransportError as e:
                if attempt >= retries:
                    raise APIConnectionError(request) from e
            else:
                if resp.is_success or resp.status_code in expect_error:
                    return resp
                should = resp.headers.get("x-should-retry")
                retryable = resp.status_code in _RETRYABLE or resp.status_code >= 500
                if should in ("true", "false"):
                    retryable = should == "true"
                if not retryable or attempt >= retries:
                    raise _status_error(resp)
                delay = _retry_after(resp)
                if delay is not None:
                    await self._sleep(delay)
                    attempt += 1
                    continue
            await self._sleep(_backoff(attempt))
            attempt += 1

    async def _json(self, resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError as e:
            raise APIResponseValidationError(
                resp, resp.text, f"expected a JSON response from {resp.request.url.path}"
            ) from e

    def _validate(self, model: type[M], resp: httpx.Response, body: Any) -> M:
        try:
            return model.model_validate(body)
        except pydantic.ValidationError as e:
            raise APIResponseValidationError(
                resp, body, f"{resp.request.url.path} returned an invalid {model.__name__}: {e}"
            ) from None

    async def _post(self, path: str, body: Any, **kw: Any) -> tuple[httpx.Response, Any]:
        await self._ensure_config()
        resp = await self._request("POST", path, json=body, **kw)
        return resp, await self._json(resp)

    async def _get(
        self, path: str, params: Mapping[str, Any] | None = None
    ) -> tuple[httpx.Response, Any]:
        await self._ensure_config()
        resp = await self._request("GET", path, params=params)
        return resp, await self._json(resp)

    # ---- bootstrap --------------------------------------------------------------------------

    @property
    def client_config(self) -> dict[str, Any]:
        """The server's feature flags from ``client/config`` (empty before the first call)."""
        return dict(self._config or {})

    async def _ensure_config(self) -> None:
        if self._config is not None:
            return
        self._http()
        if self._config_lock is None:
            self._config_lock = asyncio.Lock()
        async with self._config_lock:
            if self._config is not None:
                return
            body = {"sdk_version": m.SDK_VERSION}
            resp = await self._request("POST", "/api/v1/client/config", json=body)
            config = await self._json(resp)
            if not isinstance(config, dict):
                raise APIResponseValidationError(
                    resp, config, "client/config must return an object"
                )
            # dynamic_config is optional (404 = defaults); only the flags matter to us.
            await self._request(
                "POST",
                "/api/v1/client/dynamic_config",
                json=body,
                timeout=10.0,
                max_retries=0,
                expect_error=frozenset({404}),
            )
            self._config = config

    # ---- futures ------------------------------------------------------------------------------

    async def _submit(
        self,
        path: str,
        body: Any,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        await self._ensure_config()
        resp = await self._request(
            "POST",
            path,
            json=None if content is not None else body,
            content=content,
            headers=headers,
        )
        promise = await self._json(resp)
        if not isinstance(promise, dict) or not isinstance(promise.get("request_id"), str):
            raise APIResponseValidationError(
                resp, promise, f"{path} must answer a future {{'request_id': str, ...}}"
            )
        return promise

    async def _await(
        self, promise: dict[str, Any], request_type: str, *, want_proto: bool
    ) -> tuple[httpx.Response, Any]:
        """Poll ``retrieve_future`` until the result is in. Returns ``(response, body)``:
        raw bytes for a protobuf result, the decoded object for a JSON one."""
        rid = promise["request_id"]
        accept = _PROTOBUF if want_proto else "application/json"
        iteration, backoff, bad_requests = 0, 1.0, 0
        while True:
            headers = {
                "Accept": accept,
                "X-Tinker-Request-Type": request_type,
                "X-Tinker-Request-Iteration": str(iteration),
            }
            iteration += 1
            try:
                resp = await self._request(
                    "POST",
                    "/api/v1/retrieve_future",
                    json={"request_id": rid, "allow_metadata_only": False},
                    headers=headers,
                    timeout=self.poll_timeout,
                    max_retries=0,
                    expect_error=frozenset(range(400, 600)),
                )
            except (APIConnectionError, APITimeoutError):
                await self._sleep(backoff)
                backoff = min(2 * backoff, 30.0)
                continue
            status = resp.status_code
            if status == 200:
                if _PROTOBUF in resp.headers.get("content-type", ""):
                    return resp, resp.content
                body = await self._json(resp)
                if m.is_try_again(body) or (
                    isinstance(body, dict) and body.get("status") == "complete_metadata"
                ):
                    continue  # the server long-polls, so re-poll at once
                if isinstance(body, dict) and "error" in body:
                    raise RequestFailedError(
                        f"Request failed: {body['error']}",
                        request_id=rid,
                        category=m.category_of(body.get("category")),
                    )
                return resp, body
            if status == 408 or status >= 500:
                continue  # still pending, or a transient server problem: re-poll at once
            if status == 429:
                await self._sleep(backoff)
                backoff = min(2 * backoff, 30.0)
                continue
            if status == 400 and bad_requests < 3:
                bad_requests += 1
                continue
            if status == 410:
                raise RequestFailedError(
                    f"Request failed: the server no longer has request {rid} (promise expired)",
                    request_id=rid,
                    category=types.RequestErrorCategory.Server,
                )
            raise _status_error(resp)

    async def _future_json(self, path: str, body: Any, request_type: str, model: type[M]) -> M:
        promise = await self._submit(path, body)
        resp, result = await self._await(promise, request_type, want_proto=False)
        if not isinstance(result, dict):
            raise APIResponseValidationError(
                resp, result, f"{request_type} result must be a JSON object"
            )
        return self._validate(model, resp, result)

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
        self._heartbeats[session_id] = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(session_id)
        )
        return session_id

    async def _heartbeat_loop(self, session_id: str) -> None:
        failing_since: float | None = None
        warned = False
        while True:
            await asyncio.sleep(_HEARTBEAT_S)
            try:
                resp = await self._request(
                    "POST",
                    "/api/v1/session_heartbeat",
                    json={"session_id": session_id, "type": "session_heartbeat"},
                    timeout=10.0,
                    max_retries=0,
                    expect_error=frozenset({410}),
                )
            except TinkerError:
                failing_since = failing_since or time.monotonic()
                if not warned and time.monotonic() - failing_since > _HEARTBEAT_WARN_AFTER_S:
                    log.warning(
                        "heartbeats for session %s have failed for %.0f s; the server may end "
                        "the session",
                        session_id,
                        time.monotonic() - failing_since,
                    )
                    warned = True
                continue
            if resp.status_code == 410:
                return  # the server says the session is over
            failing_since, warned = None, False

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
            f"/api/v1/sessions/{session_id}/finish",
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
        await self._ensure_config()
        try:
            body = proto.encode_forward_backward_request(
                model_id, seq_id, data, loss_fn, loss_fn_config, forward_only=forward_only
            )
        except WireError as e:
            raise RequestFailedError(
                f"Request failed: {e}", request_id="", category=types.RequestErrorCategory.User
            ) from None
        headers = {"Content-Type": _PROTOBUF}
        if self.client_config.get("proto_compress_fwdbwd"):
            body = proto.zstd_compress(body)
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
        req = m.OptimStepRequest(model_id=model_id, seq_id=seq_id, adam_params=adam_params)
        return await self._future_json(
            "/api/v1/optim_step", m.to_json(req), "OptimStep", types.OptimStepResponse
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
            "/api/v1/save_weights", m.to_json(req), "SaveWeights", types.SaveWeightsResponse
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
        )

    async def load_state(
        self, model_id: str, seq_id: int, path: str, *, with_optimizer: bool
    ) -> types.LoadWeightsResponse:
        req = m.LoadWeightsRequest(
            model_id=model_id, seq_id=seq_id, path=path, optimizer=with_optimizer
        )
        return await self._future_json(
            "/api/v1/load_weights", m.to_json(req), "LoadWeights", types.LoadWeightsResponse
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
        resp, body = await self._get(f"/api/v1/samplers/{sampler_id}")
        base = body.get("base_model") if isinstance(body, dict) else None
        if not isinstance(base, str):
            raise APIResponseValidationError(
                resp, body, "samplers/{id} must return a string base_model"
            )
        return base

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
        promise = await self._submit(
            "/api/v1/asample", m.to_json(req), headers={"X-Tinker-Sampling-Backpressure": "1"}
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
        resp, body = await self._get(f"/api/v1/training_runs/{training_run_id}/checkpoints")
        return self._validate(types.CheckpointsListResponse, resp, body)

    async def list_user_checkpoints(
        self, *, limit: int = 100, offset: int = 0
    ) -> types.CheckpointsListResponse:
        resp, body = await self._get("/api/v1/checkpoints", {"limit": limit, "offset": offset})
        return self._validate(types.CheckpointsListResponse, resp, body)

    async def get_training_run(self, training_run_id: str) -> types.TrainingRun:
        resp, body = await self._get(
            f"/api/v1/training_runs/{training_run_id}", {"access_scope": "owned"}
        )
        return self._validate(types.TrainingRun, resp, body)

    async def list_training_runs(
        self, *, limit: int = 20, offset: int = 0
    ) -> types.TrainingRunsResponse:
        resp, body = await self._get(
            "/api/v1/training_runs", {"limit": limit, "offset": offset, "access_scope": "owned"}
        )
        return self._validate(types.TrainingRunsResponse, resp, body)

    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> None:
        await self._ensure_config()
        await self._request(
            "DELETE", f"/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}"
        )

    async def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        parsed = _parse_path(tinker_path)
        await self._ensure_config()
        await self._request(
            "PUT",
            f"/api/v1/training_runs/{parsed.training_run_id}/checkpoints/{parsed.checkpoint_id}/ttl",
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
        return (
            f"/api/v1/training_runs/{parsed.training_run_id}/checkpoints/"
            f"{parsed.checkpoint_id}{suffix}"
        )

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

    async def aclose(self) -> None:
        for task in self._heartbeats.values():
            task.cancel()
        self._heartbeats.clear()
        client, self._client = self._client, None
        self._closed = True
        if client is not None:
            with contextlib.suppress(RuntimeError):  # its loop may already be gone
                await client.aclose()


class _ModelIdResult(types.BaseModel):
    model_config = pydantic.ConfigDict(protected_namespaces=())
    model_id: str


def _parse_path(tinker_path: str) -> types.ParsedCheckpointTinkerPath:
    try:
        return types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    except ValueError as e:
        raise RequestFailedError(
            f"Request failed: {e}", request_id="", category=types.RequestErrorCategory.User
        ) from None
