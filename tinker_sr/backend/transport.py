"""The HTTP side of `RemoteBackend`: the official SDK's headers, retries, the
``client/config`` bootstrap, session heartbeats, and futures (submit, then long-poll
``retrieve_future``).

Retries: every call retries connection errors, timeouts and HTTP 408/409/429/5xx with
exponential backoff (0.5 s doubling, capped at 10 s, up to 25 % jitter; ``Retry-After`` is
obeyed when it is at most 60 s), re-sending the same body with the same
``X-Idempotency-Key``. Errors become `tinker_sr.errors` exceptions: an HTTP error is the
matching `APIStatusError` subclass, a future that resolved to ``{"error", "category"}`` is
`RequestFailedError` with that category.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import ipaddress
import logging
import math
import os
import platform
import random
import time
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import pydantic

from tinker_sr import types
from tinker_sr.backend.submit_order import SubmitOrder
from tinker_sr.errors import (
    APIConnectionError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    RequestFailedError,
    TinkerError,
    make_status_error,
)
from tinker_sr.wire import messages as m

__all__ = ["WireTransport", "DEFAULT_BASE_URL"]

log = logging.getLogger("tinker_sr.remote")

DEFAULT_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"
PROTOBUF = "application/x-protobuf"
_RETRYABLE = frozenset({408, 409, 429})
_HEARTBEAT_S = 10.0
_HEARTBEAT_WARN_AFTER_S = 120.0
CANCEL_GRACE_S = 2.0  # how long closing waits for cancel_future posts under way

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


def _checked_key(key: str | None, given: bool) -> str:
    """The API key, refused with the fix where it cannot be sent: a key read from a file with
    its newline (or with a space or tab) failed as "Connection error." after ~55 s of retries
    (httpx refuses the header value), and the official SDK hangs on it."""
    where = "api_key" if given else "$TINKER_API_KEY"
    if not key:
        raise TinkerError(
            "RemoteBackend needs an API key: pass api_key='tml-...' or set TINKER_API_KEY"
        )
    bad = next((c for c in key if not (c.isascii() and c.isprintable()) or c.isspace()), None)
    if bad is not None:
        raise TinkerError(
            f"{where} holds {bad!r} at position {key.index(bad)}: an API key is printable ASCII "
            "without spaces (read from a file? strip its newline)"
        )
    if not key.startswith(("tml-", "eyJ")):
        raise TinkerError("The api_key must start with the 'tml-' prefix")
    return key


def is_loopback_url(url: str | None) -> bool:
    """Whether ``url``'s host is this machine: ``localhost`` or a loopback address
    (``127.0.0.0/8``, ``::1``)."""
    if not url:
        return False
    try:
        host = urlsplit(url if "://" in url else f"http://{url}").hostname
    except ValueError:
        return False
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class WireTransport:
    """HTTP plumbing shared by every `RemoteBackend` call. One instance may serve many
    sessions."""

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
        where = "base_url" if base_url else "$TINKER_BASE_URL"
        # Schemes are case-insensitive (the SDK connects to HTTP://...); httpx said only
        # "Connection error." for a URL without one.
        if not url.lower().startswith(("http://", "https://")):
            raise TinkerError(
                f"{where} {url!r} must start with http:// or https://, e.g. "
                "'http://127.0.0.1:8000' for a local `tinker-sr serve`"
            )
        self.base_url = url.rstrip("/")
        key = _checked_key(api_key or os.environ.get("TINKER_API_KEY"), api_key is not None)
        self._api_key = key
        self.project_id = project_id or os.environ.get("TINKER_PROJECT_ID") or None
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.poll_timeout = poll_timeout
        self.max_retries = max_retries
        self._transport = transport
        self._submit_order = SubmitOrder()  # a model's training requests, in seq_id order
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
        self._sample_cancel = False  # the server takes cancel_future (dynamic_config)
        # cancel_future posts in flight, and abandoned sample submits awaiting their answer
        self._cancels: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._sleep = asyncio.sleep  # tests replace it to observe backoff without waiting

    # ---- HTTP -----------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise TinkerError("RemoteBackend is closed")
        if self._client is None or self._client_loop is not loop:
            # An httpx client belongs to one event loop; a new loop gets its own.
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
            transport = self._transport
            if transport is None and is_loopback_url(self.base_url):
                # A proxy cannot reach this machine's loopback: $HTTP_PROXY without 127.0.0.1
                # in $NO_PROXY (common on company machines) made every call to a local server
                # fail as "Connection error.". httpx takes no proxy from the environment for a
                # client given its transport; the transport still reads $SSL_CERT_FILE.
                transport = httpx.AsyncHTTPTransport(limits=limits)
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
                transport=transport,
                limits=limits,
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
        abandoned: asyncio.Event | None = None,
    ) -> httpx.Response:
        """One call with retries; returns a 2xx response (or one whose status the caller
        handles itself, ``expect_error``), else raises the matching `TinkerError`. Once
        ``abandoned`` is set, no further attempt is made (the call ends cancelled)."""
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
            if abandoned is not None and abandoned.is_set():
                raise asyncio.CancelledError
            hdrs["x-stainless-retry-count"] = str(attempt)
            try:
                request = client.build_request(
                    method,
                    path,
                    json=json,
                    content=content,
                    headers=hdrs,
                    params=params,
                    timeout=httpx.Timeout(read_timeout, connect=self.connect_timeout),
                )
            except ValueError as e:  # NaN or infinity: JSON cannot carry them
                where = _non_finite(json)
                if where is None:
                    raise
                raise ValueError(
                    f"{path}: {where[0]} is {where[1]}, which JSON cannot carry; pass a finite "
                    "number"
                ) from e
            try:
                resp = await client.send(request)
            except RuntimeError:  # httpx's "client has been closed": closed while this waited
                if self._closed:
                    raise TinkerError("RemoteBackend is closed") from None
                raise
            except httpx.TimeoutException as e:
                if attempt >= retries:
                    raise APITimeoutError(request) from e
            except httpx.LocalProtocolError as e:  # nothing a retry changes (a bad header)
                raise APIConnectionError(request, f"Connection error: {e}") from e
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
            flags = await self._request(
                "POST",
                "/api/v1/client/dynamic_config",
                json=body,
                timeout=10.0,
                max_retries=0,
                expect_error=frozenset({404}),
            )
            self._sample_cancel = flags.status_code == 200 and _flag(flags, "sample_cancel_enabled")
            self._config = config

    # ---- futures ------------------------------------------------------------------------------

    async def _submit(
        self,
        path: str,
        body: Any,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        abandoned: asyncio.Event | None = None,
    ) -> dict[str, Any]:
        await self._ensure_config()
        resp = await self._request(
            "POST",
            path,
            json=None if content is not None else body,
            content=content,
            headers=headers,
            abandoned=abandoned,
        )
        promise = await self._json(resp)
        if not isinstance(promise, dict) or not isinstance(promise.get("request_id"), str):
            raise APIResponseValidationError(
                resp, promise, f"{path} must answer a future {{'request_id': str, ...}}"
            )
        return promise

    async def _submit_sample(self, body: Any, headers: Mapping[str, str]) -> dict[str, Any]:
        """`_submit` for ``asample``. Abandoned before the server's answer arrives, the
        request may have reached the server anyway: it is cancelled there once its id
        arrives (the SDK drops such a cancel, and the work ran to its end). No retry is made
        after that."""
        abandoned = asyncio.Event()
        task = asyncio.ensure_future(
            self._submit("/api/v1/asample", body, headers=headers, abandoned=abandoned)
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            abandoned.set()
            self._cancels.add(task)
            task.add_done_callback(self._cancel_once_answered)
            raise

    async def _finish_cancels(self) -> None:
        """Let the cancels under way (`_send_cancel`'s posts, and abandoned sample submits
        whose id has yet to arrive) reach the server before the connections close, for at
        most `CANCEL_GRACE_S`; stop what is left then. Before, closing cut them off and the
        server sampled for nobody until its check for quiet sessions."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCEL_GRACE_S
        for _ in range(3):  # a cancellation on its way (a cancelled client future) lands
            await asyncio.sleep(0)
        while pending := [t for t in self._cancels if t.get_loop() is loop and not t.done()]:
            if (left := deadline - loop.time()) <= 0:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=0.1)  # let them unwind before the close
                return
            # A submit that finishes adds its cancel_future post: look again.
            await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)

    def _cancel_once_answered(self, task: asyncio.Task[dict[str, Any]]) -> None:
        self._cancels.discard(task)
        if not task.cancelled() and task.exception() is None and self._sample_cancel:
            self._send_cancel(task.result()["request_id"])

    async def _await(
        self, promise: dict[str, Any], request_type: str, *, want_proto: bool
    ) -> tuple[httpx.Response, Any]:
        """Poll ``retrieve_future`` until the result is in. Returns ``(response, body)``:
        raw bytes for a protobuf result, the decoded object for a JSON one. A sample request
        abandoned (its task cancelled: a timeout, a cancelled future) is cancelled on the
        server too where it says it takes that (``sample_cancel_enabled``), as the SDK does."""
        try:
            return await self._poll(promise, request_type, want_proto=want_proto)
        except asyncio.CancelledError:
            if request_type == "Sample" and self._sample_cancel:
                self._send_cancel(promise["request_id"])
            raise

    def _send_cancel(self, rid: str) -> None:
        async def send() -> None:
            with contextlib.suppress(Exception):  # best effort: the server's heartbeat
                await self._request(  # check stops abandoned work anyway
                    "POST", "/api/v1/cancel_future", json={"request_id": rid}, max_retries=2
                )

        task = asyncio.get_running_loop().create_task(send())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _poll(
        self, promise: dict[str, Any], request_type: str, *, want_proto: bool
    ) -> tuple[httpx.Response, Any]:
        rid = promise["request_id"]
        accept = PROTOBUF if want_proto else "application/json"
        iteration, backoff, bad_requests, server_errors = 0, 1.0, 0, 0
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
                if PROTOBUF in resp.headers.get("content-type", ""):
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
            if status == 408:
                continue  # the long poll ran out while the request is still pending
            if status >= 500:
                # A transient server problem: re-poll soon, but back off (50 ms doubling to
                # 2 s) so a failing server is not hit thousands of times a second.
                await self._sleep(_backoff(server_errors, base=0.05, cap=2.0))
                server_errors += 1
                continue
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

    async def _future_json(
        self,
        path: str,
        body: Any,
        request_type: str,
        model: type[M],
        *,
        order: tuple[str, int] | None = None,
    ) -> M:
        """Submit and await a JSON future. ``order``: ``(model_id, seq_id)`` of a training
        request, submitted in its model's order (`SubmitOrder`)."""
        turn = self._submit_order.turn(*order) if order else contextlib.nullcontext()
        async with turn:
            promise = await self._submit(path, body)
        resp, result = await self._await(promise, request_type, want_proto=False)
        if not isinstance(result, dict):
            raise APIResponseValidationError(
                resp, result, f"{request_type} result must be a JSON object"
            )
        return self._validate(model, resp, result)

    async def _heartbeat_loop(self, session_id: str) -> None:
        failing_since: float | None = None
        warned = False
        while True:
            await asyncio.sleep(_HEARTBEAT_S)
            if self._closed:  # closed while the session was being created
                return
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

    async def aclose(self) -> None:
        for task in self._heartbeats.values():
            task.cancel()
        self._heartbeats.clear()
        await self._finish_cancels()
        client, self._client = self._client, None
        self._closed = True
        if client is not None:
            with contextlib.suppress(RuntimeError):  # its loop may already be gone
                await client.aclose()


def _flag(resp: httpx.Response, name: str) -> bool:
    """Whether JSON object ``resp`` sets ``name`` to true (anything unreadable: no)."""
    try:
        flags = resp.json()
    except ValueError:
        return False
    return isinstance(flags, dict) and flags.get(name) is True


def _non_finite(body: Any, where: str = "") -> tuple[str, float] | None:
    """The first NaN or infinite number in a JSON body, with its path (``a.b[2]``)."""
    if isinstance(body, float) and not math.isfinite(body):
        return where or "the body", body
    items: Any = ()
    if isinstance(body, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in body.items())
    elif isinstance(body, list | tuple):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(body))
    for sub, value in items:
        found = _non_finite(value, sub)
        if found is not None:
            return found
    return None
