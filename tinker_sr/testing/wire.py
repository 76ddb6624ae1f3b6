"""Wire-level faults and call traces for `mock_tinker` and `tinker_server`.

Both wrap the `tinker-sr serve` ASGI app in `WireMiddleware`, so a fault or a trace looks the
same whichever client (the official SDK, `tinker_sr` over HTTP) and whichever harness (in
process, or a real server on a port) is in use.

A `WireFault` matches requests by endpoint (the path after ``/api/v1/``, ``fnmatch`` style:
``"asample"``, ``"retrieve_future"``, ``"*"``) and call count: it lets the first ``after``
matching calls through, then fires on the next ``times`` of them (``None``: on every one).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from tinker_sr.testing.faults import FaultTable, check_count, check_seconds, is_int

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

FaultKind = Literal[
    "status", "reset", "slow", "timeout", "try_again", "expire_session", "expire_sequence"
]
_KINDS: tuple[str, ...] = FaultKind.__args__  # type: ignore[attr-defined]
API_PREFIX = "/api/v1/"
CONTROL_PREFIX = "/_tinker_sr_testing/"
_TIMEOUT_HOLD_S = 600.0  # a server-side "timeout" holds the request until the client gives up


# What the clients send as X-Tinker-Request-Type on `retrieve_future` polls (official SDK 0.38).
REQUEST_TYPES = (
    "Sample", "Forward", "ForwardBackward", "OptimStep", "SaveWeights", "SaveWeightsForSampler",
    "SaveWeightsExternal", "LoadWeights", "CreateModel", "CreateCustomLoss",
)  # fmt: skip

# An instance of each endpoint the server answers, as a fault matches it (the path after
# /api/v1/, parameters as "x"; the OpenAI and Anthropic routes by their whole path):
# `tests/test_testing_wire.py` holds it to the app's routes.
KNOWN_ENDPOINTS = (
    "asample", "billing/usage/checkpoints/current", "billing/usage/events", "cancel_future",
    "checkpoints", "client/config", "client/dynamic_config", "copy_weights", "create_model",
    "create_sampling_session", "create_session", "external_weights_files/x/x/x",
    "forward_backward", "get_info", "get_server_capabilities", "healthz", "load_weights",
    "optim_step", "retrieve_future", "samplers/x", "save_weights", "save_weights_external",
    "save_weights_for_sampler", "session_heartbeat", "sessions", "sessions/x",
    "sessions/x/finish", "telemetry", "training_runs", "training_runs/x",
    "training_runs/x/checkpoints", "training_runs/x/checkpoints/x",
    "training_runs/x/checkpoints/x/x",
    "training_runs/x/checkpoints/x/x/external_weights_urls",
    "training_runs/x/checkpoints/x/x/publish", "training_runs/x/checkpoints/x/x/ttl",
    "weights_info", "/oai/api/v1/chat/completions", "/oai/api/v1/completions",
    "/oai/api/v1/models", "/anthropic/api/v1/messages", "/anthropic/api/v1/messages/count_tokens",
)  # fmt: skip


def _check_endpoint(pattern: str) -> None:
    """Refuse a pattern that no request can match: it must match an endpoint, or name one with
    its own ids or globs in the parameters' places ('sessions/sess-1', 'samplers/*')."""
    templates = ("/".join("*" if p == "x" else p for p in e.split("/")) for e in KNOWN_ENDPOINTS)
    if not any(fnmatch.fnmatchcase(e, pattern) for e in KNOWN_ENDPOINTS) and not any(
        fnmatch.fnmatchcase(pattern, t) for t in templates
    ):
        names = ", ".join(e for e in KNOWN_ENDPOINTS if "/" not in e)
        raise ValueError(
            f"WireFault.endpoint {pattern!r} matches no endpoint of the server, so the fault "
            f"could never fire. Name one as the path after /api/v1/ ({names}, ...; sampling is "
            "'asample'), a pattern such as 'sessions/*' or '*', or an OpenAI/Anthropic route by "
            "its whole path ('/oai/api/v1/completions')"
        )


# Endpoints whose request bodies name a sampler, model or session (`expire_session_of` reads
# them): the only ones an `expire_session` fault can act on.
_NAMES_A_SESSION = frozenset({
    "asample", "forward_backward", "optim_step", "save_weights", "save_weights_for_sampler",
    "save_weights_external", "load_weights", "create_model", "create_sampling_session",
    "get_info", "session_heartbeat", "copy_weights", "telemetry",
})  # fmt: skip


@dataclass
class WireFault:
    """One planned fault. Build them with the helpers below (`http_error`, `rate_limited`, ...).

    ``kind``: ``status`` answers ``status`` (with ``Retry-After: retry_after`` when set) without
    running the request; ``reset`` drops the connection; ``slow`` delays the request by
    ``delay_s`` and then runs it; ``timeout`` never answers, so the client's read timeout fires;
    ``try_again`` answers a ``retrieve_future`` poll with ``try_again`` (the future looks still
    pending); ``expire_session`` finishes the session that owns the request's sampler (or
    model, or session) as the server's inactivity expiry does, then runs the request;
    ``expire_sequence`` ages the recorded sequences a ``forward_backward`` references past their
    TTL, then runs it. ``request_type`` narrows the match to requests whose
    ``X-Tinker-Request-Type`` header (sent on ``retrieve_future`` polls) is this, e.g. "Sample".
    ``seen``/``fired``: matching calls so far, and how many of them it fired on.
    """

    endpoint: str
    kind: FaultKind
    status: int = 503
    retry_after: float | None = None
    delay_s: float = 0.0
    after: int = 0
    times: int | None = 1
    request_type: str | None = None
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"WireFault.kind must be one of {_KINDS}, got {self.kind!r}")
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise TypeError(
                f"WireFault.endpoint must be an endpoint name such as 'asample' (or a pattern "
                f"such as '*'), got {self.endpoint!r}"
            )
        self.endpoint = self.endpoint.removeprefix(API_PREFIX)
        if not self.endpoint.startswith(("/oai/", "/anthropic/")):
            self.endpoint = self.endpoint.lstrip("/")  # "/asample" as "asample"
        _check_endpoint(self.endpoint)
        if self.kind == "status" and not (is_int(self.status) and 400 <= self.status <= 599):
            raise ValueError(f"WireFault.status must be an HTTP error code, got {self.status!r}")
        check_count("WireFault.after", self.after, 0)
        if self.times is not None:
            check_count("WireFault.times", self.times, 1, "or None: on every matching call")
        check_seconds("WireFault.delay_s", self.delay_s, allow_zero=True)
        if self.retry_after is not None:
            check_seconds("WireFault.retry_after", self.retry_after, allow_zero=False)
        if self.request_type is not None and self.request_type not in REQUEST_TYPES:
            raise ValueError(
                f"WireFault.request_type {self.request_type!r} is not one the clients send "
                f"(X-Tinker-Request-Type); use one of {', '.join(REQUEST_TYPES)}"
            )
        self._check_reach()

    def _check_reach(self) -> None:
        """Refuse a fault whose kind (or request_type) no request this endpoint names could
        carry out: it would count as fired and change nothing."""
        polls = fnmatch.fnmatchcase("retrieve_future", self.endpoint)
        if self.request_type is not None and not polls:
            raise ValueError(
                f"WireFault.request_type: only retrieve_future polls carry X-Tinker-Request-"
                f"Type, and endpoint {self.endpoint!r} is not one; fault 'retrieve_future' with "
                f"request_type={self.request_type!r} to fail the polls of those requests"
            )
        if self.kind == "try_again" and not polls:
            raise ValueError(
                f"WireFault.kind 'try_again' answers retrieve_future polls; endpoint "
                f"{self.endpoint!r} is not one (use future_stays_pending(), or 'slow' to delay it)"
            )
        if self.kind == "expire_sequence" and not fnmatch.fnmatchcase(
            "forward_backward", self.endpoint
        ):
            raise ValueError(
                f"WireFault.kind 'expire_sequence' ages the sequences a forward_backward's "
                f"provenance names; endpoint {self.endpoint!r} carries none (use "
                "'forward_backward')"
            )
        if self.kind == "expire_session" and not any(
            fnmatch.fnmatchcase(e, self.endpoint) for e in _NAMES_A_SESSION
        ):
            raise ValueError(
                f"WireFault.kind 'expire_session' finishes the session a request's sampler, "
                f"model or session id names; a {self.endpoint!r} request names none (use the "
                "endpoint of the call that should meet the expired session, e.g. 'asample')"
            )

    @property
    def name(self) -> str:
        return f"http_{self.status}" if self.kind == "status" else self.kind

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def http_error(endpoint: str, status: int, **match: Any) -> WireFault:
    """Answer ``status`` (500, 502, 503, ...) without running the request."""
    return WireFault(endpoint, "status", status=status, **match)


def rate_limited(endpoint: str, retry_after: float = 1.0, **match: Any) -> WireFault:
    """HTTP 429 with ``Retry-After: retry_after`` without running the request."""
    return WireFault(endpoint, "status", status=429, retry_after=retry_after, **match)


def connection_reset(endpoint: str, **match: Any) -> WireFault:
    """Drop the connection (TCP RST on a real server) before answering."""
    return WireFault(endpoint, "reset", **match)


def slow_response(endpoint: str, delay_s: float, **match: Any) -> WireFault:
    """Run the request ``delay_s`` seconds late."""
    return WireFault(endpoint, "slow", delay_s=delay_s, **match)


def request_timeout(endpoint: str, **match: Any) -> WireFault:
    """Never answer: the client's read timeout fires (at once in the mock)."""
    return WireFault(endpoint, "timeout", **match)


def future_stays_pending(
    times: int | None = None, *, after: int = 0, delay_s: float = 0.05, **match: Any
) -> WireFault:
    """``retrieve_future`` answers ``try_again`` (default: forever), after ``delay_s`` (a real
    server long-polls first; without a pause clients poll in a tight loop)."""
    return WireFault(
        "retrieve_future", "try_again", after=after, times=times, delay_s=delay_s, **match
    )


def session_expires(endpoint: str = "asample", **match: Any) -> WireFault:
    """The session behind the request expires (as after missed heartbeats) just before it."""
    return WireFault(endpoint, "expire_session", **match)


def sequence_expired(endpoint: str = "forward_backward", **match: Any) -> WireFault:
    """The recorded sequences the request's provenance spans name have expired."""
    return WireFault(endpoint, "expire_sequence", **match)


class FaultPlan(FaultTable[WireFault]):
    """The faults of one mock or server, with per-endpoint call counters (thread-safe)."""

    fault_types = (WireFault,)

    def next_call(
        self, endpoint: str, request_type: str | None = None
    ) -> tuple[int, WireFault | None]:
        """Count a call to ``endpoint``; return its 1-based number and the fault that fires
        (the first one due; every matching fault counts the call)."""
        with self._lock:
            n = self.calls.get(endpoint, 0) + 1
            self.calls[endpoint] = n
            due: WireFault | None = self._first_due(
                f
                for f in self.faults
                if fnmatch.fnmatchcase(endpoint, f.endpoint)
                and f.request_type in (None, request_type)
            )
        return n, due


class Trace:
    """Every request and response the harness saw, in order; also appended to ``path`` as JSONL.

    An entry: ``seq``, ``endpoint``, ``call`` (1-based per endpoint), ``method``, ``path``,
    ``status`` (None when the connection was dropped or timed out), ``fault`` (its name or
    None), ``retry_count`` (the client's ``x-stainless-retry-count``), ``request_type``,
    ``started`` (seconds since the trace began), ``duration_s``, ``request`` and ``response``
    (decoded JSON; protobuf bodies as dicts; else ``{"bytes": n}``).
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: list[dict[str, Any]] = []
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            entry["seq"] = len(self.entries) + 1
            self.entries.append(entry)
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(json.dumps(entry, default=str) + "\n")

    def calls(self, endpoint: str | None = None) -> list[dict[str, Any]]:
        """Entries for ``endpoint`` (fnmatch pattern; all when None)."""
        with self._lock:
            return [
                e
                for e in self.entries
                if endpoint is None or fnmatch.fnmatchcase(e["endpoint"], endpoint)
            ]

    def count(self, endpoint: str) -> int:
        return len(self.calls(endpoint))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.calls())

    def __len__(self) -> int:
        return len(self.entries)


def read_trace(path: str | Path) -> Trace:
    """A `Trace` loaded from a JSONL file written by another process (e.g. `tinker_server`)."""
    trace = Trace()
    p = Path(path)
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                trace.entries.append(json.loads(line))
            except ValueError:
                continue  # a line the server is still writing
    trace.path = p
    return trace


# ---- body decoding for traces ------------------------------------------------------------------


def decode_body(body: bytes, content_type: str, endpoint: str, *, request: bool) -> Any:
    """JSON → object; a forward_backward / sample protobuf → dict; anything else → its size."""
    if not body:
        return None
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == "application/json" or (not ctype and body[:1] in (b"{", b"[")):
        with contextlib.suppress(ValueError):
            return json.loads(body)
    if "protobuf" in ctype or ctype == "application/octet-stream":
        with contextlib.suppress(Exception):
            return _decode_proto(body, endpoint, request=request)
    return {"bytes": len(body)}


def _decode_proto(body: bytes, endpoint: str, *, request: bool) -> Any:
    from google.protobuf.json_format import MessageToDict

    from tinker_sr.wire import tinker_public_pb2 as pb

    if request and endpoint.startswith("forward_backward"):
        msg: Any = pb.ForwardBackwardRequest.FromString(body)
    else:
        # Results polled from retrieve_future: a sample or a forward_backward output.
        msg = pb.SampleResponse.FromString(body)
        if not msg.sequences:
            msg = pb.ForwardBackwardOutput.FromString(body)
    return MessageToDict(msg, preserving_proto_field_name=True)


def sequence_ids_in(obj: Any) -> set[str]:
    """Every ``sequence_id`` value in a decoded request (provenance spans)."""
    found: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "sequence_id" and isinstance(v, str):
                found.add(v)
            else:
                found |= sequence_ids_in(v)
    elif isinstance(obj, list):
        for v in obj:
            found |= sequence_ids_in(v)
    return found


# ---- the middleware ----------------------------------------------------------------------------


class TransportFault(Exception):
    """Raised by `WireMiddleware` in process mode; the mock turns it into the httpx error
    a client would get (``kind``: ``reset`` or ``timeout``)."""

    def __init__(self, kind: str, endpoint: str) -> None:
        super().__init__(f"injected {kind} on {endpoint}")
        self.kind = kind


@dataclass
class _Exchange:
    endpoint: str
    call: int
    fault: WireFault | None
    body: bytes
    headers: dict[str, str]
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytearray = field(default_factory=bytearray)


class WireMiddleware:
    """ASGI middleware around the Tinker app: applies the `FaultPlan`, records the `Trace`.

    ``in_process``: True in the mock (transport faults raise `TransportFault`); False on a real
    server (``reset`` aborts the TCP connection, ``timeout`` holds the request).
    ``server``: returns the app's `TinkerServer`, for the state faults (expire_*).
    """

    def __init__(
        self,
        app: ASGIApp,
        plan: FaultPlan,
        trace: Trace,
        *,
        in_process: bool,
        server: Callable[[], Any],
    ) -> None:
        self.app = app
        self.plan = plan
        self.trace = trace
        self.in_process = in_process
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        body, more = await _read_body(receive)
        endpoint = path.removeprefix(API_PREFIX)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        call, fault = self.plan.next_call(endpoint, headers.get("x-tinker-request-type"))
        ex = _Exchange(endpoint, call, fault, body, headers)
        started = self.trace.now()
        try:
            await self._serve(ex, scope, _replay(body, more, receive), _capture(ex, send), send)
        finally:
            self._record(ex, scope, started)

    async def _serve(
        self, ex: _Exchange, scope: Scope, receive: Receive, send: Send, raw_send: Send
    ) -> None:
        fault = ex.fault
        if fault is None:
            await self.app(scope, receive, send)
            return
        if fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault.kind == "status":
            await _respond(send, fault.status, _fault_body(fault, ex.endpoint), fault.retry_after)
        elif fault.kind == "try_again":
            from tinker_sr.wire.messages import try_again

            await _respond(send, 200, try_again(_json_field(ex.body, "request_id") or ""))
        elif fault.kind in ("reset", "timeout"):
            await self._transport_fault(fault.kind, ex.endpoint, receive, raw_send)
        else:
            await self._state_fault(fault, ex)
            await self.app(scope, receive, send)

    async def _transport_fault(
        self, kind: str, endpoint: str, receive: Receive, raw_send: Send
    ) -> None:
        if self.in_process:
            raise TransportFault(kind, endpoint)
        if kind == "reset" and _abort_connection(raw_send):
            return
        if kind == "timeout":
            # Answer nothing until the client hangs up (its read timeout fired).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_TIMEOUT_HOLD_S):
                    while (await receive())["type"] != "http.disconnect":
                        pass
            return
        raise TransportFault(kind, endpoint)  # no raw transport: the server closes the stream

    async def _state_fault(self, fault: WireFault, ex: _Exchange) -> None:
        server = self.server()
        if fault.kind == "expire_session":
            await expire_session_of(server, ex.endpoint, ex.body, ex.headers)
        else:
            request = decode_body(ex.body, ex.headers.get("content-type", ""), ex.endpoint,
                                  request=True)  # fmt: skip
            expire_sequences(server, sequence_ids_in(request))

    def _record(self, ex: _Exchange, scope: Scope, started: float) -> None:
        self.trace.record(
            {
                "endpoint": ex.endpoint,
                "call": ex.call,
                "method": scope.get("method"),
                "path": scope.get("path"),
                "status": ex.status,
                "fault": ex.fault.name if ex.fault is not None else None,
                "retry_count": _int_or_none(ex.headers.get("x-stainless-retry-count")),
                "request_type": ex.headers.get("x-tinker-request-type"),
                "started": round(started, 6),
                "duration_s": round(self.trace.now() - started, 6),
                "request": decode_body(ex.body, ex.headers.get("content-type", ""), ex.endpoint,
                                       request=True),
                "response": decode_body(bytes(ex.response_body),
                                        ex.response_headers.get("content-type", ""), ex.endpoint,
                                        request=False),
            }
        )  # fmt: skip


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(chunks), False
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks), True


def _replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay if complete else receive


def _capture(ex: _Exchange, send: Send) -> Send:
    async def capture(msg: Message) -> None:
        if msg["type"] == "http.response.start":
            ex.status = int(msg["status"])
            ex.response_headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in msg.get("headers", [])
            }
        elif msg["type"] == "http.response.body":
            ex.response_body += msg.get("body", b"")
        await send(msg)

    return capture


async def _respond(
    send: Send, status: int, body: dict[str, Any], retry_after: float | None = None
) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    if retry_after is not None:
        headers.append((b"retry-after", f"{retry_after:g}".encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _fault_body(fault: WireFault, endpoint: str) -> dict[str, Any]:
    return {"detail": f"injected fault: HTTP {fault.status} on {endpoint} (tinker_sr.testing)"}


def _json_field(body: bytes, name: str) -> Any:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return obj.get(name) if isinstance(obj, dict) else None


def _int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _abort_connection(raw_send: Send) -> bool:
    """Reset the TCP connection under a uvicorn request (RST, not FIN). False if ``raw_send``
    is not uvicorn's (then the caller falls back to failing the response)."""
    transport = getattr(getattr(raw_send, "__self__", None), "transport", None)
    if transport is None or not hasattr(transport, "abort"):
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    return True


# ---- state faults: real expiry through the server's own bookkeeping ---------------------------


async def expire_session_of(
    server: Any, endpoint: str, body: bytes, headers: dict[str, str]
) -> str | None:
    """Finish the session that owns the request's sampler/model/session as the server's
    inactivity expiry does (heartbeats then get 410, new work 400). Returns the session id."""
    from tinker_sr.wire.proto import peek_forward_backward_target

    obj: Any = {}
    with contextlib.suppress(ValueError):
        obj = json.loads(body) if body else {}
    if endpoint.startswith("forward_backward"):
        target = peek_forward_backward_target(body)
        obj = {"model_id": target[0]} if target else {}
    state = server.state
    session_id: str | None = None
    if isinstance(obj, dict):
        if obj.get("sampling_session_id"):
            row = state.sampler_session(obj["sampling_session_id"])
            session_id = row.session_id if row is not None else None
        elif obj.get("model_id"):
            row = state.model_session(obj["model_id"])
            session_id = row.session_id if row is not None else None
        else:
            session_id = obj.get("session_id")
    if session_id is not None:
        await server.sessions.expire(session_id)
    return session_id


def expire_sequences(server: Any, sequence_ids: set[str]) -> None:
    """Age recorded sequences past their TTL, as if unused for longer than it."""
    from tinker_sr.provenance import RECORD_TTL_SECONDS

    store = server.backend.store
    store.touch_sequences(sequence_ids, time.time() - RECORD_TTL_SECONDS - 60)
