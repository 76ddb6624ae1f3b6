"""The Tinker wire protocol (spec/wire.md) in front of any `Backend`, as a Starlette app.

No training logic lives here: every handler decodes its body with `tinker_sr.wire`, checks
ownership, calls the backend and encodes the answer. Long operations become futures: the
submission answers ``{"request_id", ...}`` at once, the backend call runs in a background
task, and ``retrieve_future`` long-polls for the encoded result (JSON, or protobuf for
forward/backward and sample results). Futures and id bookkeeping live in `ServerState`.

Isolation: a session belongs to the API key that created it (a hash of the key is stored),
and models and samplers belong to sessions. A request naming anything its key does not own
gets the same 404 as a request naming something that does not exist. One exception: a
checkpoint its owner published may be read by every key (loaded, sampled, copied, its
weights info fetched); listing, deleting and changing it stay the owner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pydantic
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tinker_sr.backend.base import Backend
from tinker_sr.engine.errors import EngineNotFoundError
from tinker_sr.errors import APIStatusError, RequestFailedError
from tinker_sr.types import (
    CopyWeightsRequest,
    GetInfoResponse,
    ModelData,
    ParsedCheckpointTinkerPath,
    RequestErrorCategory,
)
from tinker_sr.wire import BodyTooLargeError, WireError, proto
from tinker_sr.wire import messages as m

from .state import COMPLETE, FAILED, PENDING, FutureRow, ServerState, SessionRow

__all__ = [
    "create_app",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_LONG_POLL_S",
    "DEFAULT_MAX_PENDING_SAMPLES",
    "DEFAULT_SESSION_TIMEOUT_S",
]

log = logging.getLogger("tinker_sr.server")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""Well above the SDK's forward_backward chunk size (5 MB estimated per request)."""

DEFAULT_LONG_POLL_S = 25.0
"""How long ``retrieve_future`` holds a pending request before answering try_again (the
SDK's read timeout for it is 45 s)."""

_PROTOBUF = "application/x-protobuf"
_MAX_SAMPLES_PER_REQUEST = 4096
_MAX_GAP_WATCH = 1024
_PRUNE_EVERY_S = 3600.0
_TTL_MIN_S, _TTL_MAX_S = 3600, 10 * 365 * 24 * 3600
DEFAULT_MAX_PENDING_SAMPLES = 64
"""asample requests allowed to be pending or running at once; above it asample answers 429
(the SDK waits, throttles and resubmits the same seq_id, spec §8.3)."""
DEFAULT_SESSION_TIMEOUT_S = 600.0
"""A session with no heartbeat or request for this long is finished as "interrupted"."""
DEFAULT_SEQ_GAP_GRACE_S = 5.0
"""How long a model's later request waits for a missing earlier seq_id before the server
decides that request was refused or lost and skips its number."""

# Endpoints the SDK knows that this server deliberately does not offer (400 with a reason,
# rather than an anonymous 404).
_UNSUPPORTED = {
    "auth/token": "JWT exchange is disabled (client/config says pjwt_auth_enabled: false)",
    "retrieve_futures": "the session poller is disabled (sample_use_retrieve_futures: false)",
    "cancel_future": "sample cancellation is disabled (dynamic_config sample_cancel_enabled)",
    "join_sampling_session": "sample_join_sampling_session is false",
    "create_custom_loss": "server-side custom losses are disabled (custom_loss_server_side: "
    "false); forward_backward_custom runs the loss client-side",
    "save_weights_external": "external weights are not supported",
    "unload_model": "models are unloaded when their session finishes",
    "audit": "audit logs are not kept",
    "sessions": "session listing and search are not supported",
    "billing": "there is no billing",
}

T = TypeVar("T")
Req = TypeVar("Req", bound=pydantic.BaseModel)
Handler = Callable[[Request, str], Awaitable[Response]]


class _HTTPError(Exception):
    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(m.dumps(obj), status_code=status, media_type="application/json")


def _strip_prefix(message: str) -> str:
    # The SDK prefixes "Request failed: " itself when it raises RequestFailedError.
    return message.removeprefix("Request failed: ")


def _is_not_found(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, EngineNotFoundError):
            return True
        seen = seen.__cause__
    return False


def _body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class TinkerServer:
    """Handlers plus the futures runner; `create_app` wraps it in a Starlette app."""

    def __init__(
        self,
        backend: Backend,
        *,
        store_dir: Path | None,
        api_keys: Sequence[str] | None,
        max_body_bytes: int,
        long_poll_s: float,
        close_backend: bool,
        seq_gap_grace_s: float = DEFAULT_SEQ_GAP_GRACE_S,
        max_pending_samples: int = DEFAULT_MAX_PENDING_SAMPLES,
        session_timeout_s: float | None = DEFAULT_SESSION_TIMEOUT_S,
    ) -> None:
        self.backend = backend
        self.store_dir = store_dir
        self.api_keys = [k.encode() for k in api_keys or () if k]
        self.max_body_bytes = max_body_bytes
        self.long_poll_s = long_poll_s
        self.close_backend = close_backend
        self.state = ServerState(store_dir / "server.sqlite" if store_dir is not None else None)
        self.seq_gap_grace_s = seq_gap_grace_s
        self.max_pending_samples = max_pending_samples
        self.session_timeout_s = session_timeout_s
        self._pending_samples: set[str] = set()  # request ids of asample work not yet done
        # Last request per session (time.time()); heartbeats are also kept in SQLite.
        self._last_seen: dict[str, float] = {}
        self._expired: set[str] = set()  # sessions this process finished for inactivity
        self._started = time.time()
        self._seen: dict[str, set[int]] = {}
        self._floor: dict[str, int] = {}
        self._gap_watches: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._events: dict[str, asyncio.Event] = {}
        # Recently finished futures, so polls rarely touch SQLite: request_id -> row.
        self._recent: OrderedDict[str, FutureRow] = OrderedDict()
        self._tokenizer_lock = threading.Lock()
        self._byte_tokenizer_dir: str | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    async def startup(self) -> None:
        orphans = self.state.fail_orphans()
        if orphans:
            log.warning("failed %d request(s) left pending by a previous server process", orphans)
        self.state.prune()
        self._spawn(self._prune_periodically())

    async def _prune_periodically(self) -> None:
        tick = _PRUNE_EVERY_S
        if self.session_timeout_s is not None:
            tick = min(tick, max(self.session_timeout_s / 4, 0.01))
        last_prune = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            try:
                await self._expire_quiet_sessions()
            except Exception:
                log.exception("expiring quiet sessions failed")
            if time.monotonic() - last_prune >= _PRUNE_EVERY_S:
                last_prune = time.monotonic()
                try:
                    self.state.prune()
                except Exception:
                    log.exception("pruning old futures failed")

    def _touch(self, session_id: str) -> None:
        self._last_seen[session_id] = time.time()

    async def _expire_quiet_sessions(self) -> None:
        """Finish (as "interrupted") sessions with no heartbeat or request for
        ``session_timeout_s``. Time before this process started does not count, so a restart
        does not expire the sessions of clients that are still running."""
        timeout = self.session_timeout_s
        if timeout is None:
            return
        cutoff = time.time() - timeout
        if self._started >= cutoff:
            return
        for session_id in self.state.quiet_sessions(cutoff):
            if self._last_seen.get(session_id, 0.0) >= cutoff:
                continue
            if not self.state.finish_session(session_id, "interrupted"):
                continue
            self._expired.add(session_id)
            self._last_seen.pop(session_id, None)
            log.info("session %s expired: no heartbeat or request for %.0f s", session_id, timeout)
            try:
                await self.backend.close_session(
                    session_id, "interrupted", f"no heartbeat or request for {timeout:g} s"
                )
            except Exception:
                log.exception("closing expired session %s failed", session_id)

    def _why_finished(self, session_id: str) -> str:
        if session_id in self._expired:
            return f"it expired after {self.session_timeout_s:g} s without a heartbeat or request"
        return "close() was called, or it expired without heartbeats"

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.close_backend:
            await self.backend.aclose()
        self.state.close()

    # ---- plumbing ------------------------------------------------------------------------

    def _owner(self, request: Request) -> str:
        key = request.headers.get("x-api-key")
        if not key:
            raise _HTTPError(
                401, "missing X-API-Key header; pass api_key='tml-...' or set TINKER_API_KEY"
            )
        if self.api_keys:
            # Compare against every key so timing does not reveal which one nearly matched.
            matches = [hmac.compare_digest(key.encode(), k) for k in self.api_keys]
            if not any(matches):
                raise _HTTPError(
                    401,
                    "X-API-Key is not accepted by this server (it is not one of the keys "
                    "configured with --api-keys / TINKER_SR_API_KEYS)",
                )
        elif not key.startswith("tml-"):
            raise _HTTPError(
                401, "X-API-Key must start with 'tml-' (e.g. TINKER_API_KEY=tml-local)"
            )
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    async def _body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLargeError(
                f"request body of {declared} bytes exceeds this server's limit of {limit} bytes "
                "(--max-body-bytes); send smaller requests"
            )
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLargeError(
                    f"request body exceeds this server's limit of {limit} bytes "
                    "(--max-body-bytes); send smaller requests"
                )
            parts.append(chunk)
        body = b"".join(parts)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding == "zstd":
            return proto.zstd_decompress(body, limit)
        if encoding not in ("", "identity"):
            raise _HTTPError(
                415, f"Content-Encoding {encoding!r} is not supported; send identity or zstd"
            )
        return body

    async def _parse(self, request: Request, model: type[T], what: str) -> tuple[T, bytes]:
        body = await self._body(request)
        return m.parse(model, m.parse_json(body, what), what), body  # type: ignore[type-var]

    def endpoint(
        self, fn: Handler, *, auth: bool = True
    ) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            try:
                owner = self._owner(request) if auth else ""
                return await fn(request, owner)
            except _HTTPError as e:
                return _error(e.status, e.detail, e.headers)
            except BodyTooLargeError as e:
                return _error(413, str(e))
            except WireError as e:
                return _error(400, str(e))
            except Exception as e:  # a backend failure on a plain (non-future) call
                status, detail = self._plain_error(e)
                if status >= 500:
                    log.exception("%s %s failed", request.method, request.url.path)
                return _error(status, detail)

        return handler

    @staticmethod
    def _plain_error(e: Exception) -> tuple[int, str]:
        if isinstance(e, RequestFailedError):
            if e.category == RequestErrorCategory.User:
                return (404 if _is_not_found(e) else 400), _strip_prefix(e.message)
            return 500, _strip_prefix(e.message)
        if isinstance(e, APIStatusError):  # the backend is itself remote: pass it through
            return e.status_code, e.message
        if isinstance(e, NotImplementedError):
            # 400, not 501: the SDK retries every 5xx for minutes before giving up.
            return 400, f"not supported by this server: {e}"
        return 500, f"internal server error: {type(e).__name__}: {e}"

    # ---- ownership ------------------------------------------------------------------------

    def _session(self, session_id: str, owner: str, *, active: bool = True) -> SessionRow:
        row = self.state.session(session_id)
        if row is None or row.owner != owner:
            raise _HTTPError(404, f"unknown session_id {session_id!r}; create a session first")
        if active and row.finished is not None:
            raise _HTTPError(
                400,
                f"session {session_id} is finished ({self._why_finished(session_id)}); start a "
                "new ServiceClient to keep working",
            )
        if row.finished is None:
            self._touch(session_id)
        return row

    def _model(self, model_id: str, owner: str) -> SessionRow:
        row = self.state.model_session(model_id)
        if row is None or row.owner != owner:
            raise _HTTPError(404, f"unknown model_id {model_id!r}; create a training client first")
        if row.finished is not None:
            raise _HTTPError(
                400,
                f"model {model_id} belongs to finished session {row.session_id} "
                f"({self._why_finished(row.session_id)}); load its checkpoint from a new "
                "ServiceClient",
            )
        self._touch(row.session_id)
        return row

    def _run_owned(self, run_id: str, owner: str) -> None:
        row = self.state.model_session(run_id)
        if row is None or row.owner != owner:
            raise _HTTPError(404, f"unknown training run {run_id!r}")

    def _checkpoint_path(
        self, path: str, owner: str, *, field: str = "path"
    ) -> ParsedCheckpointTinkerPath:
        try:
            parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        except ValueError:
            raise _HTTPError(
                400,
                f"{field} {path!r} is not a checkpoint path; expected "
                "tinker://<run_id>/<weights|sampler_weights>/<name>",
            ) from None
        row = self.state.model_session(parsed.training_run_id)
        if row is None or row.owner != owner:
            raise _HTTPError(404, f"checkpoint {path} does not exist")
        return parsed

    async def _readable_checkpoint(
        self, path: str, owner: str, *, field: str = "path"
    ) -> ParsedCheckpointTinkerPath:
        """A checkpoint this key may read: one of its own, or one its owner published.
        Anything else gets the same 404 as a checkpoint that does not exist."""
        try:
            return self._checkpoint_path(path, owner, field=field)
        except _HTTPError as e:
            if e.status != 404:
                raise
            try:
                public = (await self.backend.get_checkpoint(path)).public
            except Exception:
                public = False
            if not public:
                raise
            return ParsedCheckpointTinkerPath.from_tinker_path(path)

    def _sampler(self, sampler_id: str, owner: str) -> SessionRow:
        row = self.state.sampler_session(sampler_id)
        if row is None or row.owner != owner:
            raise _HTTPError(
                404, f"unknown sampling_session_id {sampler_id!r}; create a sampling client first"
            )
        if row.finished is not None:
            raise _HTTPError(
                400,
                f"sampler {sampler_id} belongs to finished session {row.session_id} "
                f"({self._why_finished(row.session_id)})",
            )
        self._touch(row.session_id)
        return row

    # ---- futures -------------------------------------------------------------------------

    def _submit(
        self,
        *,
        kind: str,
        owner: str,
        session_id: str,
        dedupe_key: str,
        body: bytes,
        work: Callable[[dict[str, Any]], Awaitable[tuple[str, bytes]]],
        promise_extra: dict[str, Any] | Callable[[str], dict[str, Any]] | None = None,
        train_seq: tuple[str, int] | None = None,
    ) -> Response:
        """Register a future (or find the earlier one for the same key) and start ``work``.

        ``promise_extra`` (or a function of the new request id giving it) is merged into the
        promise; ``work(promise)`` returns ``(encoding, payload)``: ``"json"`` or ``"proto"``
        and the bytes.
        """
        body_hash = _body_hash(body)
        existing = self.state.find_future(dedupe_key)
        if existing is not None:
            return self._resubmission(existing, kind, owner, body_hash, dedupe_key)
        rid = f"req-{uuid.uuid4().hex}"
        extra = promise_extra(rid) if callable(promise_extra) else promise_extra
        promise: dict[str, Any] = {"request_id": rid, **(extra or {})}
        if train_seq is not None:
            self._note_seq(*train_seq)
        if not self.state.add_future(
            rid,
            owner=owner,
            session_id=session_id,
            kind=kind,
            dedupe_key=dedupe_key,
            body_hash=body_hash,
            promise=promise,
        ):  # lost a race with an identical submission
            existing = self.state.find_future(dedupe_key)
            assert existing is not None
            return self._resubmission(existing, kind, owner, body_hash, dedupe_key)
        self._events[rid] = asyncio.Event()
        if kind == "Sample":
            self._pending_samples.add(rid)
        task = asyncio.get_running_loop().create_task(self._execute(rid, work, promise))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return _json(promise)

    def _resubmission(
        self, row: FutureRow, kind: str, owner: str, body_hash: str, dedupe_key: str
    ) -> Response:
        if row.owner != owner:
            raise _HTTPError(404, "unknown model or sampler")
        if row.kind != kind or row.body_hash != body_hash:
            what = dedupe_key.split("|", 1)[1].replace("|", " ")
            raise _HTTPError(
                400,
                f"{what} was already used by a different {row.kind} request "
                f"({row.request_id}); every request needs a fresh seq_id",
            )
        return _json(row.promise)  # an HTTP retry of the same submission: same future

    async def _execute(
        self,
        rid: str,
        work: Callable[[dict[str, Any]], Awaitable[tuple[str, bytes]]],
        promise: dict[str, Any],
    ) -> None:
        try:
            encoding, payload = await work(promise)
            self.state.complete_future(rid, encoding, payload)
        except asyncio.CancelledError:
            raise
        except RequestFailedError as e:
            self.state.fail_future(rid, _strip_prefix(e.message), str(e.category))
        except WireError as e:
            self.state.fail_future(rid, str(e), "user")
        except Exception as e:
            log.exception("request %s failed inside the backend", rid)
            self.state.fail_future(rid, f"internal error: {type(e).__name__}: {e}", "server")
        finally:
            self._pending_samples.discard(rid)
            row = self.state.get_future(rid)
            if row is not None and row.status != PENDING:
                self._recent[rid] = row
                while len(self._recent) > 256:
                    self._recent.popitem(last=False)
            event = self._events.pop(rid, None)
            if event is not None:
                event.set()

    # A model's requests run strictly in seq_id order, and the client numbers them before it
    # sends them. A request refused here (or lost on the way) still used up its number, so
    # the backend must be told, or every later request of that model would wait forever.

    def _note_seq(self, model_id: str, seq_id: int) -> None:
        """Record that ``seq_id`` reached the backend (or was released); watch for gaps."""
        seen = self._seen.setdefault(model_id, set())
        seen.add(seq_id)
        floor = self._floor.get(model_id, 1)
        while floor in seen:
            seen.discard(floor)
            floor += 1
        self._floor[model_id] = floor
        for missing in range(floor, min(seq_id, floor + _MAX_GAP_WATCH)):
            if missing not in seen and (model_id, missing) not in self._gap_watches:
                self._gap_watches.add((model_id, missing))
                self._spawn(self._watch_gap(model_id, missing))

    def _seq_accounted(self, model_id: str, seq_id: int) -> bool:
        return (
            seq_id < self._floor.get(model_id, 1)
            or seq_id in self._seen.get(model_id, ())
            or self.state.find_future(f"train|{model_id}|seq_id {seq_id}") is not None
        )

    def _reject_seq(self, model_id: str, seq_id: int) -> None:
        """A training request with this number was refused at submission: release it."""
        if self._seq_accounted(model_id, seq_id):
            return
        self._note_seq(model_id, seq_id)
        self._spawn(self._release_seq(model_id, seq_id))

    async def _watch_gap(self, model_id: str, seq_id: int) -> None:
        """A later seq_id arrived but this one did not: if it still has not come after a
        grace period (parallel chunk uploads may arrive out of order), it was lost."""
        try:
            await asyncio.sleep(self.seq_gap_grace_s)
            if not self._seq_accounted(model_id, seq_id):
                log.warning(
                    "model %s: seq_id %d never arrived (its request was refused or lost); "
                    "releasing it so later requests can run",
                    model_id,
                    seq_id,
                )
                self._reject_seq(model_id, seq_id)
        finally:
            self._gap_watches.discard((model_id, seq_id))

    async def _release_seq(self, model_id: str, seq_id: int) -> None:
        with contextlib.suppress(Exception):  # an unknown model has nothing to release
            await self.backend.release_seq(model_id, seq_id)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- bootstrap / sessions ------------------------------------------------------------------

    async def client_config(self, request: Request, owner: str) -> Response:
        await self._parse(request, m.ClientConfigRequest, "client/config")
        return _json(m.SERVER_CLIENT_CONFIG)

    async def dynamic_config(self, request: Request, owner: str) -> Response:
        await self._parse(request, m.ClientConfigRequest, "client/dynamic_config")
        return _json(m.SERVER_DYNAMIC_CONFIG)

    async def create_session(self, request: Request, owner: str) -> Response:
        req, body = await self._parse(request, m.CreateSessionRequest, "create_session")
        idem = request.headers.get("x-idempotency-key")
        if idem:
            earlier = self.state.reply(owner, f"create_session|{idem}")
            if earlier is not None and earlier[0] == _body_hash(body):
                return _json(earlier[1])
        session_id = await self.backend.create_session(
            user_metadata=req.user_metadata,
            project_id=req.project_id,
            display_name=req.display_name,
            tags=req.tags,
        )
        self.state.add_session(session_id, owner)
        reply = {"session_id": session_id, "type": "create_session"}
        if idem:
            self.state.save_reply(owner, f"create_session|{idem}", _body_hash(body), reply)
        return _json(reply)

    async def heartbeat(self, request: Request, owner: str) -> Response:
        req, _ = await self._parse(request, m.SessionHeartbeatRequest, "session_heartbeat")
        row = self._session(req.session_id, owner, active=False)
        if row.finished is not None:
            return _error(
                410, f"session {req.session_id} is finished ({self._why_finished(row.session_id)})"
            )
        self.state.heartbeat(req.session_id)
        return _json({"type": "session_heartbeat"})

    async def finish_session(self, request: Request, owner: str) -> Response:
        session_id = request.path_params["session_id"]
        req, _ = await self._parse(request, m.SessionFinishRequest, "sessions/{id}/finish")
        self._session(session_id, owner, active=False)
        if self.state.finish_session(session_id, req.reason.type):
            self._last_seen.pop(session_id, None)
            await self.backend.close_session(session_id, req.reason.type, req.detail)
        return Response(status_code=204)

    async def telemetry(self, request: Request, owner: str) -> Response:
        await self._body(request)  # accepted and dropped
        return _json({"status": "accepted"})

    # ---- training -----------------------------------------------------------------------------

    async def create_model(self, request: Request, owner: str) -> Response:
        req, body = await self._parse(request, m.CreateModelRequest, "create_model")
        self._session(req.session_id, owner)
        if req.lora_config is None:
            raise _HTTPError(
                400,
                "create_model: lora_config is required; this server trains "
                "LoRA adapters only (pass rank=...)",
            )
        if req.model_seq_id < 0:
            raise _HTTPError(
                400, f"create_model: model_seq_id must be >= 0, got {req.model_seq_id}"
            )
        lora = req.lora_config

        async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
            model_id = await self.backend.create_model(
                req.session_id,
                req.model_seq_id,
                base_model=req.base_model,
                lora_config=lora,
                optimizer_config=req.optimizer_config,
                user_metadata=req.user_metadata,
            )
            self.state.add_model(model_id, req.session_id)
            return "json", m.dumps({"model_id": model_id, "type": "create_model"})

        return self._submit(
            kind="CreateModel",
            owner=owner,
            session_id=req.session_id,
            dedupe_key=f"model|{req.session_id}|model_seq_id {req.model_seq_id}",
            body=body,
            work=work,
            promise_extra={"model_id": f"{req.session_id}:train:{req.model_seq_id}"},
        )

    async def get_info(self, request: Request, owner: str) -> Response:
        req, _ = await self._parse(request, m.GetInfoRequest, "get_info")
        self._model(req.model_id, owner)
        info = await self.backend.get_info(req.model_id)
        tokenizer_id = self._tokenizer_id(info)
        if tokenizer_id != info.model_data.tokenizer_id:
            data = info.model_data.model_copy(update={"tokenizer_id": tokenizer_id})
            info = info.model_copy(
                update={"model_data": ModelData.model_validate(data.model_dump())}
            )
        out = info.model_dump(mode="json", exclude_none=True)
        out.setdefault("type", "get_info")
        return _json(out)

    async def forward_backward(self, request: Request, owner: str) -> Response:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in (_PROTOBUF, "application/octet-stream"):
            raise _HTTPError(
                415,
                f"forward_backward takes a protobuf tinker_public.ForwardBackwardRequest "
                f"body with Content-Type: {_PROTOBUF} (got {ctype or 'none'}); JSON "
                "forward_backward bodies are not part of the SDK 0.38 protocol",
            )
        body = await self._body(request)
        target = proto.peek_forward_backward_target(body)
        if target is not None:
            self._model(target[0], owner)  # unknown/foreign model: 404 before anything else
        try:
            call = proto.decode_forward_backward_request(body)
        except WireError:
            if target is not None:
                self._reject_seq(*target)
            raise
        session = self._model(call.model_id, owner)

        async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
            out = await self.backend.forward_backward(
                call.model_id,
                call.seq_id,
                call.data,
                call.loss_fn,
                call.loss_fn_config,
                forward_only=call.forward_only,
            )
            return "proto", proto.encode_forward_backward_output(out)

        return self._submit_training(
            "ForwardBackward", owner, session, call.model_id, call.seq_id, body, work
        )

    def _submit_training(
        self,
        kind: str,
        owner: str,
        session: SessionRow,
        model_id: str,
        seq_id: int,
        body: bytes,
        work: Callable[[dict[str, Any]], Awaitable[tuple[str, bytes]]],
    ) -> Response:
        """Submit a model's numbered training request (deduplicated by (model, seq_id))."""
        return self._submit(
            kind=kind,
            owner=owner,
            session_id=session.session_id,
            dedupe_key=f"train|{model_id}|seq_id {seq_id}",
            train_seq=(model_id, seq_id),
            body=body,
            work=work,
            promise_extra={"model_id": model_id},
        )

    async def _training_request(
        self, request: Request, model_cls: type[Req], what: str, owner: str
    ) -> tuple[bytes, Req, SessionRow, int]:
        """Parse a JSON training request; a malformed one still frees its seq_id."""
        body = await self._body(request)
        raw = m.parse_json(body, what)
        try:
            req = m.parse(model_cls, raw, what)
        except WireError:
            self._release_if_known(raw, owner)
            raise
        model_id: str = req.model_id  # type: ignore[attr-defined]
        session = self._model(model_id, owner)
        seq_id = self._training_seq(model_id, req.seq_id, what)  # type: ignore[attr-defined]
        return body, req, session, seq_id

    def _training_seq(self, model_id: str, seq_id: int | None, what: str) -> int:
        if seq_id is None:
            raise _HTTPError(
                400, f"{what}: seq_id is required (training requests are numbered per model from 1)"
            )
        if seq_id < 1:
            raise _HTTPError(400, f"{what}: seq_id must be >= 1, got {seq_id}")
        return seq_id

    async def optim_step(self, request: Request, owner: str) -> Response:
        body, req, session, seq_id = await self._training_request(
            request, m.OptimStepRequest, "optim_step", owner
        )
        if req.adam_params is None:
            self._reject_seq(req.model_id, seq_id)
            kind = (req.optimizer_params or {}).get("type")
            raise _HTTPError(
                400,
                f"optim_step: optimizer_params of type {kind!r} are not supported; this "
                "server steps with AdamW (send adam_params)"
                if req.optimizer_params is not None
                else "optim_step: adam_params is required",
            )
        params = req.adam_params

        async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
            out = await self.backend.optim_step(req.model_id, seq_id, params)
            return "json", m.dumps(out.model_dump(mode="json", exclude_none=True))

        return self._submit_training("OptimStep", owner, session, req.model_id, seq_id, body, work)

    def _release_if_known(self, raw: Any, owner: str) -> None:
        """After a malformed training body: free its seq_id if model and seq_id are readable."""
        if not isinstance(raw, dict):
            return
        model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
        if isinstance(model_id, str) and isinstance(seq_id, int) and seq_id >= 1:
            row = self.state.model_session(model_id)
            if row is not None and row.owner == owner:
                self._reject_seq(model_id, seq_id)

    async def save_weights(self, request: Request, owner: str) -> Response:
        body, req, session, seq_id = await self._training_request(
            request, m.SaveWeightsRequest, "save_weights", owner
        )
        if not req.path:
            self._reject_seq(req.model_id, seq_id)
            raise _HTTPError(400, "save_weights: path (the checkpoint name) is required")
        name = req.path

        async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
            out = await self.backend.save_state(
                req.model_id,
                seq_id,
                name,
                ttl_seconds=req.ttl_seconds,
                overwrite=req.overwrite,
                user_metadata=req.user_metadata,
            )
            return "json", m.dumps({"path": out.path, "type": "save_weights"})

        return self._submit_training(
            "SaveWeights", owner, session, req.model_id, seq_id, body, work
        )

    async def save_weights_for_sampler(self, request: Request, owner: str) -> Response:
        body, req, session, seq_id = await self._training_request(
            request, m.SaveWeightsForSamplerRequest, "save_weights_for_sampler", owner
        )
        problem = None
        if req.kind == "inflight":
            problem = (
                "save_weights_for_sampler: kind 'inflight' (samplers that follow later "
                "weight updates) is not supported; use the default kind 'snapshot'"
            )
        elif req.path is None and req.sampling_session_seq_id is None:
            problem = (
                "save_weights_for_sampler: send either path (a checkpoint name) or "
                "sampling_session_seq_id (to get a sampling session)"
            )
        if problem is not None:
            self._reject_seq(req.model_id, seq_id)
            raise _HTTPError(400, problem)

        async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
            out = await self.backend.save_weights_for_sampler(
                req.model_id,
                seq_id,
                name=req.path,
                sampling_session_seq_id=None if req.path else req.sampling_session_seq_id,
                ttl_seconds=req.ttl_seconds,
                user_metadata=req.user_metadata,
            )
            result: dict[str, Any] = {"type": "save_weights_for_sampler"}
            sampler_id = getattr(out, "sampling_session_id", None)
            if req.path is None:
                if not sampler_id:
                    raise RuntimeError(
                        "backend returned no sampling_session_id for an unnamed save"
                    )
                self.state.add_sampler(sampler_id, session.session_id, None)
                result["sampling_session_id"] = sampler_id
            else:
                result["path"] = out.path
            return "json", m.dumps(result)

        return self._submit_training(
            "SaveWeightsForSampler", owner, session, req.model_id, seq_id, body, work
        )

    async def load_weights(self, request: Request, owner: str) -> Response:
        body = await self._body(request)
        raw = m.parse_json(body, "load_weights")
        try:
            req = m.parse(m.LoadWeightsRequest, raw, "load_weights")
        except WireError:
            self._release_if_known(raw, owner)
            raise
        if req.session_id is not None or req.model_seq_id is not None:
            return await self._create_from_state(req, owner, body)
        if req.model_id is None:
            raise _HTTPError(
                400,
                "load_weights: send model_id + seq_id (load into a model) or "
                "session_id + model_seq_id (create a model from the checkpoint)",
            )
        session = self._model(req.model_id, owner)
        seq_id = self._training_seq(req.model_id, req.seq_id, "load_weights")
        try:
            if req.weights_access_token is not None:
                raise _HTTPError(400, "load_weights: weights_access_token is not supported")
            await self._readable_checkpoint(req.path, owner)
        except _HTTPError:
            self._reject_seq(req.model_id, seq_id)
            raise
        model_id = req.model_id

        async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
            out = await self.backend.load_state(
                model_id, seq_id, req.path, with_optimizer=req.optimizer
            )
            res = out.model_dump(mode="json", exclude_none=True)
            res["type"] = "load_weights"
            return "json", m.dumps(res)

        return self._submit_training("LoadWeights", owner, session, model_id, seq_id, body, work)

    async def _create_from_state(
        self, req: m.LoadWeightsRequest, owner: str, body: bytes
    ) -> Response:
        if req.session_id is None or req.model_seq_id is None:
            raise _HTTPError(
                400,
                "load_weights: creating a model from a checkpoint needs both "
                "session_id and model_seq_id",
            )
        if req.model_id is not None:
            raise _HTTPError(
                400,
                "load_weights: send model_id (load into a model) or "
                "session_id + model_seq_id (create one), not both",
            )
        if req.weights_access_token is not None:
            raise _HTTPError(400, "load_weights: weights_access_token is not supported")
        self._session(req.session_id, owner)
        await self._readable_checkpoint(req.path, owner)
        session_id, model_seq_id = req.session_id, req.model_seq_id

        async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
            model_id = await self.backend.create_model_from_state(
                session_id,
                model_seq_id,
                path=req.path,
                with_optimizer=req.optimizer,
                base_model=req.base_model,
                optimizer_config=req.optimizer_config,
                user_metadata=req.user_metadata,
            )
            self.state.add_model(model_id, session_id)
            return "json", m.dumps({"model_id": model_id, "path": req.path, "type": "load_weights"})

        return self._submit(
            kind="LoadWeights",
            owner=owner,
            session_id=session_id,
            dedupe_key=f"model|{session_id}|model_seq_id {model_seq_id}",
            body=body,
            work=work,
            promise_extra={"model_id": f"{session_id}:train:{model_seq_id}"},
        )

    # ---- sampling -----------------------------------------------------------------------------

    async def create_sampling_session(self, request: Request, owner: str) -> Response:
        req, body = await self._parse(
            request, m.CreateSamplingSessionRequest, "create_sampling_session"
        )
        self._session(req.session_id, owner)
        if req.model_path is None and req.base_model is None:
            raise _HTTPError(400, "create_sampling_session: send model_path or base_model")
        if req.model_path is not None:
            await self._readable_checkpoint(req.model_path, owner, field="model_path")
        key = f"sampling_session|{req.session_id}|{req.sampling_session_seq_id}"
        earlier = self.state.reply(owner, key)
        if earlier is not None:
            if earlier[0] != _body_hash(body):
                raise _HTTPError(
                    400,
                    f"sampling_session_seq_id {req.sampling_session_seq_id} "
                    f"is already used in session {req.session_id}",
                )
            return _json(earlier[1])
        sampler_id = await self.backend.create_sampling_session(
            req.session_id,
            req.sampling_session_seq_id,
            base_model=req.base_model,
            model_path=req.model_path,
        )
        self.state.add_sampler(sampler_id, req.session_id, req.model_path)
        reply = {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
        self.state.save_reply(owner, key, _body_hash(body), reply)
        return _json(reply)

    async def get_sampler(self, request: Request, owner: str) -> Response:
        sampler_id = request.path_params["sampler_id"]
        row = self.state.sampler_session(sampler_id)
        if row is None or row.owner != owner:
            raise _HTTPError(404, f"unknown sampler {sampler_id!r}")
        base_model = await self.backend.get_sampler_base_model(sampler_id)
        out = {"sampler_id": sampler_id, "base_model": base_model}
        model_path = self.state.sampler_model_path(sampler_id)
        if model_path:
            out["model_path"] = model_path
        return _json(out)

    async def asample(self, request: Request, owner: str) -> Response:
        req, body = await self._parse(request, m.SampleRequest, "asample")
        if req.sampling_session_id is None:
            raise _HTTPError(
                400,
                "asample: sampling_session_id is required; create a sampling "
                "client (create_sampling_session) first",
            )
        if req.base_model is not None or req.model_path is not None:
            raise _HTTPError(
                400,
                "asample: base_model/model_path are not accepted here; they "
                "belong to create_sampling_session",
            )
        if req.seq_id is None:
            raise _HTTPError(400, "asample: seq_id is required")
        if not 1 <= req.num_samples <= _MAX_SAMPLES_PER_REQUEST:
            raise _HTTPError(
                400,
                f"asample: num_samples must be in 1..{_MAX_SAMPLES_PER_REQUEST}, "
                f"got {req.num_samples}",
            )
        session = self._sampler(req.sampling_session_id, owner)
        target = (
            req.target_prompt_logprobs.to_public("asample.target_prompt_logprobs")
            if req.target_prompt_logprobs is not None
            else None
        )
        sampler_id, seq_id, n = req.sampling_session_id, req.seq_id, req.num_samples

        def promise_extra(rid: str) -> dict[str, Any]:
            # Unique within the session: the sampler id is, and so is (seq_id, request).
            return {
                "sample_sequence_ids": [f"{sampler_id}:{seq_id}:{i}:{rid[4:12]}" for i in range(n)]
            }

        async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
            ids = promise["sample_sequence_ids"]
            resp = await self.backend.sample(
                sampler_id,
                seq_id,
                prompt=req.prompt,
                num_samples=n,
                sampling_params=req.sampling_params.to_public(),
                include_prompt_logprobs=bool(req.prompt_logprobs),
                topk_prompt_logprobs=req.topk_prompt_logprobs,
                topk_sample_logprobs=req.topk_sample_logprobs,
                target_prompt_logprobs=target,
                prompt_alt_tokens_k=req.prompt_alt_tokens_k,
                prompt_logprobs_last_n=req.prompt_logprobs_last_n,
                record_stability_info=bool(req.record_stability_info),
                sequence_ids=ids,
            )
            if len(resp.sequences) != n:
                raise RuntimeError(
                    f"backend returned {len(resp.sequences)} sequences for {n} samples"
                )
            return "proto", proto.encode_sample_response(resp)

        dedupe_key = f"sample|{sampler_id}|seq_id {seq_id}"
        if (
            len(self._pending_samples) >= self.max_pending_samples
            and self.state.find_future(dedupe_key) is None
        ):
            # Nothing is recorded: the client resubmits this seq_id later (spec §8.3).
            raise _HTTPError(
                429,
                f"asample: {len(self._pending_samples)} sampling requests are already pending "
                f"(this server's limit is {self.max_pending_samples}); retry shortly",
                {"Retry-After": "1"},
            )
        return self._submit(
            kind="Sample",
            owner=owner,
            session_id=session.session_id,
            dedupe_key=dedupe_key,
            body=body,
            work=work,
            promise_extra=promise_extra,
        )

    # ---- futures -------------------------------------------------------------------------------

    async def retrieve_future(self, request: Request, owner: str) -> Response:
        req, _ = await self._parse(request, m.FutureRetrieveRequest, "retrieve_future")
        row = self._recent.get(req.request_id) or self.state.get_future(req.request_id)
        if row is None or row.owner != owner:
            raise _HTTPError(404, f"unknown request_id {req.request_id!r}")
        if row.session_id in self._last_seen:
            self._touch(row.session_id)
        if row.status == PENDING:
            event = self._events.get(req.request_id)
            if event is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), self.long_poll_s)
            row = self._recent.get(req.request_id) or self.state.get_future(req.request_id)
            if row is None or row.status == PENDING:
                return _json(m.try_again(req.request_id))
        if row.status == FAILED:
            return _json(m.future_failure(row.error or "request failed", row.category or "unknown"))
        assert row.status == COMPLETE and row.result is not None
        media = _PROTOBUF if row.encoding == "proto" else "application/json"
        return Response(row.result, media_type=media)

    # ---- REST ------------------------------------------------------------------------------------

    async def capabilities(self, request: Request, owner: str) -> Response:
        caps = await self.backend.get_server_capabilities()
        return _json(caps.model_dump(mode="json", exclude_none=True))

    async def healthz(self, request: Request, owner: str) -> Response:
        return _json({"status": "ok"})

    async def list_checkpoints(self, request: Request, owner: str) -> Response:
        run_id = request.path_params["run_id"]
        self._run_owned(run_id, owner)
        out = await self.backend.list_checkpoints(run_id)
        return _json(out.model_dump(mode="json", exclude_none=True))

    @staticmethod
    def _paging(request: Request, default_limit: int, allowed: set[str]) -> tuple[int, int]:
        extra = set(request.query_params) - allowed
        if extra:
            raise _HTTPError(400, f"unsupported query parameter(s): {', '.join(sorted(extra))}")
        out = []
        for name, default in (("limit", default_limit), ("offset", 0)):
            raw = request.query_params.get(name, str(default))
            if not raw.isdigit():
                raise _HTTPError(
                    400, f"query parameter {name} must be a non-negative integer, got {raw!r}"
                )
            out.append(int(raw))
        return out[0], out[1]

    @staticmethod
    def _access_scope(request: Request) -> None:
        scope = request.query_params.get("access_scope", "owned")
        if scope not in ("owned", "accessible"):
            raise _HTTPError(400, f"access_scope must be 'owned' or 'accessible', got {scope!r}")

    async def list_user_checkpoints(self, request: Request, owner: str) -> Response:
        limit, offset = self._paging(request, 100, {"limit", "offset"})
        # The backend lists every owner's checkpoints; keep this key's and page here.
        everything = await self.backend.list_user_checkpoints(limit=1 << 30, offset=0)
        mine_runs = self.state.model_ids_of(owner)
        mine = [
            c
            for c in everything.checkpoints
            if ParsedCheckpointTinkerPath.from_tinker_path(c.tinker_path).training_run_id
            in mine_runs
        ]
        page = mine[offset : offset + limit]
        return _json(
            {
                "checkpoints": [c.model_dump(mode="json", exclude_none=True) for c in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)},
            }
        )

    async def get_training_run(self, request: Request, owner: str) -> Response:
        self._paging(request, 0, {"access_scope"})
        self._access_scope(request)
        run_id = request.path_params["run_id"]
        self._run_owned(run_id, owner)
        run = await self.backend.get_training_run(run_id)
        return _json(run.model_dump(mode="json", exclude_none=True))

    async def list_training_runs(self, request: Request, owner: str) -> Response:
        if "project_id" in request.query_params:
            raise _HTTPError(400, "filtering training runs by project_id is not supported")
        limit, offset = self._paging(request, 20, {"limit", "offset", "access_scope"})
        self._access_scope(request)
        everything = await self.backend.list_training_runs(limit=1 << 30, offset=0)
        mine_runs = self.state.model_ids_of(owner)
        mine = [r for r in everything.training_runs if r.training_run_id in mine_runs]
        page = mine[offset : offset + limit]
        return _json(
            {
                "training_runs": [r.model_dump(mode="json", exclude_none=True) for r in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)},
            }
        )

    async def weights_info(self, request: Request, owner: str) -> Response:
        req, _ = await self._parse(request, m.WeightsInfoRequest, "weights_info")
        await self._readable_checkpoint(req.tinker_path, owner, field="tinker_path")
        info = await self.backend.get_weights_info(req.tinker_path)
        # optimizer_config is left out: checkpoints do not record it (the SDK defaults it).
        out = info.model_dump(mode="json", exclude_none=True, exclude={"optimizer_config"})
        return _json(out)

    async def copy_weights(self, request: Request, owner: str) -> Response:
        req, body = await self._parse(request, CopyWeightsRequest, "copy_weights")
        if req.weights_access_token is not None or request.headers.get(
            "x-tinker-weights-access-token"
        ):
            raise _HTTPError(
                400,
                "copy_weights: weights_access_token is not supported by this server; another "
                "key's checkpoint can be copied once its owner publishes it",
            )
        if (req.session_id is None) != (req.model_seq_id is None):
            raise _HTTPError(
                400,
                "copy_weights: send session_id and model_seq_id together (copy into that "
                "training-run slot), or destination_project_id alone (copy into a new session)",
            )
        if req.session_id is not None and req.destination_project_id is not None:
            raise _HTTPError(
                400,
                "copy_weights: send session_id + model_seq_id or destination_project_id, not both",
            )
        if req.model_seq_id is not None and req.model_seq_id < 0:
            raise _HTTPError(
                400, f"copy_weights: model_seq_id must be >= 0, got {req.model_seq_id}"
            )
        ttl = req.ttl_seconds
        if ttl is not None and not (_TTL_MIN_S <= ttl <= _TTL_MAX_S):
            raise _HTTPError(
                400,
                f"copy_weights: ttl_seconds must be between {_TTL_MIN_S} (1 hour) and "
                f"{_TTL_MAX_S} (10 years), or null for no expiry; got {ttl}",
            )
        source = await self._readable_checkpoint(req.source_path, owner, field="source_path")
        if source.checkpoint_type == "external":
            raise _HTTPError(
                400, "copy_weights: external_weights checkpoints are not supported by this server"
            )
        await self.backend.get_checkpoint(req.source_path)  # 404 before anything is created
        idem = request.headers.get("x-idempotency-key")
        if idem:
            earlier = self.state.reply(owner, f"copy_weights|{idem}")
            if earlier is not None and earlier[0] == _body_hash(body):
                return _json(earlier[1])
        if req.session_id is not None:
            assert req.model_seq_id is not None
            self._session(req.session_id, owner)
            path = await self.backend.copy_weights(
                req.source_path,
                session_id=req.session_id,
                model_seq_id=req.model_seq_id,
                ttl_seconds=ttl,
            )
            session_id = req.session_id
        else:
            # A session of its own, finished at once: it only holds the copy.
            session_id = await self.backend.create_session(project_id=req.destination_project_id)
            self.state.add_session(session_id, owner)
            try:
                path = await self.backend.copy_weights(
                    req.source_path, session_id=session_id, model_seq_id=0, ttl_seconds=ttl
                )
            finally:
                if self.state.finish_session(session_id, "success"):
                    await self.backend.close_session(session_id, "success")
        self.state.add_model(
            ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id, session_id
        )
        reply = {"tinker_path": path}
        if idem:
            self.state.save_reply(owner, f"copy_weights|{idem}", _body_hash(body), reply)
        return _json(reply)

    def _checkpoint_route(self, request: Request, owner: str) -> tuple[str, str]:
        run_id, kind, name = (request.path_params[k] for k in ("run_id", "kind", "name"))
        if kind not in ("weights", "sampler_weights"):
            raise _HTTPError(
                404, f"unknown checkpoint kind {kind!r}; expected weights or sampler_weights"
            )
        self._run_owned(run_id, owner)
        return run_id, f"{kind}/{name}"

    async def delete_checkpoint(self, request: Request, owner: str) -> Response:
        run_id, checkpoint_id = self._checkpoint_route(request, owner)
        await self.backend.delete_checkpoint(run_id, checkpoint_id)
        return Response(status_code=204)

    async def set_checkpoint_ttl(self, request: Request, owner: str) -> Response:
        run_id, checkpoint_id = self._checkpoint_route(request, owner)
        req, _ = await self._parse(request, m.CheckpointTtlRequest, "checkpoint ttl")
        await self.backend.set_checkpoint_ttl(f"tinker://{run_id}/{checkpoint_id}", req.ttl_seconds)
        return Response(status_code=204)

    async def publish(self, request: Request, owner: str) -> Response:
        """POST publishes, DELETE unpublishes. Setting the flag a checkpoint already has
        succeeds (the hosted service answers 409, which the SDK retries for minutes)."""
        run_id, checkpoint_id = self._checkpoint_route(request, owner)
        await self._body(request)  # no body expected; any is ignored
        await self.backend.set_checkpoint_public(
            f"tinker://{run_id}/{checkpoint_id}", request.method == "POST"
        )
        return Response(status_code=204)

    async def external_weights_urls(self, request: Request, owner: str) -> Response:
        run_id, kind, name = (request.path_params[k] for k in ("run_id", "kind", "name"))
        if kind != "external_weights":
            raise _HTTPError(
                400,
                f"external_weights_urls is only for external_weights checkpoints "
                f"(tinker://<run_id>/external_weights/<name>), got kind {kind!r}",
            )
        self._run_owned(run_id, owner)
        out = await self.backend.get_external_weights_urls(f"tinker://{run_id}/{kind}/{name}")
        return _json(out.model_dump(mode="json", exclude_none=True))

    async def unsupported(self, request: Request, owner: str) -> Response:
        path = request.url.path.split("/api/v1/", 1)[-1]
        for prefix, reason in _UNSUPPORTED.items():
            if path == prefix or path.startswith(prefix + "/"):
                raise _HTTPError(400, f"/api/v1/{path} is not supported by this server: {reason}")
        raise _HTTPError(404, f"no such endpoint: {request.method} /api/v1/{path}")

    # ---- tokenizer ------------------------------------------------------------------------------

    def _tokenizer_id(self, info: GetInfoResponse) -> str | None:
        """A tokenizer id the official SDK can load offline: a local directory (no ':')."""
        current = info.model_data.tokenizer_id
        if current and os.path.isdir(current):
            return current
        if current:
            return current  # a Hub name chosen by the backend: leave it alone
        resolve = getattr(self.backend, "resolve_model", None)
        name = info.model_data.model_name or info.model_name
        if resolve is None or not name:
            return None
        try:
            resolved = resolve(name)
        except Exception:
            return None
        if os.path.isdir(resolved):
            has_tokenizer = any(
                (Path(resolved) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
            )
            return resolved if has_tokenizer and ":" not in resolved else None
        return self._byte_tokenizer()  # a built-in model: byte-level tokenizer

    def _byte_tokenizer(self) -> str:
        with self._tokenizer_lock:
            if self._byte_tokenizer_dir is None:
                from tinker_sr.engine.tokenizer import write_hf_tokenizer_dir

                root = self.store_dir / "tokenizers" if self.store_dir is not None else None
                if root is None or ":" in str(root.resolve()):
                    # The SDK cuts tokenizer ids at the first ':'; use a path without one.
                    root = Path(tempfile.mkdtemp(prefix="tinker-sr-tokenizers-"))
                path = root.resolve() / "byte-level"
                write_hf_tokenizer_dir(path)
                self._byte_tokenizer_dir = str(path)
            return self._byte_tokenizer_dir

    # ---- routes -------------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        e = self.endpoint
        v = "/api/v1"
        post = ["POST"]
        ckpt = v + "/training_runs/{run_id}/checkpoints/{kind}/{name}"
        return [
            Route(v + "/healthz", e(self.healthz, auth=False), methods=["GET"]),
            Route(v + "/client/config", e(self.client_config), methods=post),
            Route(v + "/client/dynamic_config", e(self.dynamic_config), methods=post),
            Route(v + "/create_session", e(self.create_session), methods=post),
            Route(v + "/session_heartbeat", e(self.heartbeat), methods=post),
            Route(v + "/sessions/{session_id}/finish", e(self.finish_session), methods=post),
            Route(v + "/telemetry", e(self.telemetry), methods=post),
            Route(v + "/create_model", e(self.create_model), methods=post),
            Route(v + "/get_info", e(self.get_info), methods=post),
            Route(v + "/forward_backward", e(self.forward_backward), methods=post),
            Route(v + "/optim_step", e(self.optim_step), methods=post),
            Route(v + "/save_weights", e(self.save_weights), methods=post),
            Route(v + "/save_weights_for_sampler", e(self.save_weights_for_sampler), methods=post),
            Route(v + "/load_weights", e(self.load_weights), methods=post),
            Route(v + "/create_sampling_session", e(self.create_sampling_session), methods=post),
            Route(v + "/samplers/{sampler_id}", e(self.get_sampler), methods=["GET"]),
            Route(v + "/asample", e(self.asample), methods=post),
            Route(v + "/retrieve_future", e(self.retrieve_future), methods=post),
            Route(v + "/get_server_capabilities", e(self.capabilities), methods=["GET"]),
            Route(v + "/weights_info", e(self.weights_info), methods=post),
            Route(v + "/copy_weights", e(self.copy_weights), methods=post),
            Route(v + "/checkpoints", e(self.list_user_checkpoints), methods=["GET"]),
            Route(v + "/training_runs", e(self.list_training_runs), methods=["GET"]),
            Route(v + "/training_runs/{run_id}", e(self.get_training_run), methods=["GET"]),
            Route(
                v + "/training_runs/{run_id}/checkpoints", e(self.list_checkpoints), methods=["GET"]
            ),
            Route(ckpt, e(self.delete_checkpoint), methods=["DELETE"]),
            Route(ckpt + "/ttl", e(self.set_checkpoint_ttl), methods=["PUT"]),
            Route(ckpt + "/publish", e(self.publish), methods=["POST", "DELETE"]),
            Route(ckpt + "/external_weights_urls", e(self.external_weights_urls), methods=["GET"]),
            Route(
                v + "/{rest:path}", e(self.unsupported), methods=["GET", "POST", "PUT", "DELETE"]
            ),
        ]


def create_app(
    backend: Backend,
    *,
    api_keys: Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    store_dir: str | os.PathLike[str] | None = None,
    long_poll_s: float = DEFAULT_LONG_POLL_S,
    close_backend: bool = False,
    seq_gap_grace_s: float = DEFAULT_SEQ_GAP_GRACE_S,
    max_pending_samples: int = DEFAULT_MAX_PENDING_SAMPLES,
    session_timeout_s: float | None = DEFAULT_SESSION_TIMEOUT_S,
) -> Starlette:
    """The ASGI app serving ``backend`` over the Tinker wire protocol.

    ``api_keys``: accept only these X-API-Key values (else any key starting with ``tml-``).
    ``store_dir``: where ``server.sqlite`` and tokenizer files go; defaults to the backend's
    ``store_dir`` attribute, else state is kept in memory. ``close_backend``: call
    ``backend.aclose()`` at shutdown (when the app owns the backend). ``seq_gap_grace_s``:
    how long to wait for a missing training seq_id before skipping it.
    ``max_pending_samples``: asample requests pending or running at once before asample
    answers 429 with ``Retry-After: 1``. ``session_timeout_s``: finish (as "interrupted") a
    session with no heartbeat or request for this long; ``None`` never expires sessions.
    """
    if max_pending_samples < 1:
        raise ValueError(f"max_pending_samples must be at least 1, got {max_pending_samples}")
    if session_timeout_s is not None and session_timeout_s <= 0:
        raise ValueError(f"session_timeout_s must be positive, got {session_timeout_s}")
    if max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes must be at least 1024, got {max_body_bytes}")
    if store_dir is None:
        store_dir = getattr(backend, "store_dir", None)
    server = TinkerServer(
        backend,
        store_dir=Path(store_dir) if store_dir is not None else None,
        api_keys=api_keys,
        max_body_bytes=max_body_bytes,
        long_poll_s=long_poll_s,
        close_backend=close_backend,
        seq_gap_grace_s=seq_gap_grace_s,
        max_pending_samples=max_pending_samples,
        session_timeout_s=session_timeout_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.startup()
        try:
            yield
        finally:
            await server.shutdown()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")

    app = Starlette(
        routes=server.routes(),
        lifespan=lifespan,
        exception_handlers={404: http_error, 405: http_error},
    )
    app.state.tinker_server = server
    return app
