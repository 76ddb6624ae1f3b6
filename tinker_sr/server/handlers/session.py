"""Bootstrap, session and future endpoints."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from tinker_sr.engine.store_files import is_out_of_space
from tinker_sr.wire import messages as m

from ..http import HTTPError, body_hash, error, json_reply, unless_gone
from .rest import access_scope, paging

log = logging.getLogger("tinker_sr.server")

if TYPE_CHECKING:
    from ..app import TinkerServer


async def client_config(srv: TinkerServer, request: Request, owner: str) -> Response:
    await srv.parse(request, m.ClientConfigRequest, "client/config")
    return json_reply(m.SERVER_CLIENT_CONFIG)


async def dynamic_config(srv: TinkerServer, request: Request, owner: str) -> Response:
    await srv.parse(request, m.ClientConfigRequest, "client/dynamic_config")
    return json_reply(m.SERVER_DYNAMIC_CONFIG)


async def create_session(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, body = await srv.parse(request, m.CreateSessionRequest, "create_session")
    warning = _older_sdk(req.sdk_version)
    idem = request.headers.get("x-idempotency-key")
    if idem:
        earlier = srv.state.reply(owner, f"create_session|{idem}")
        if earlier is not None and earlier[0] == body_hash(body):
            return json_reply(earlier[1])
    session_id = await srv.backend.create_session(
        user_metadata=req.user_metadata,
        project_id=req.project_id,
        display_name=req.display_name,
        tags=req.tags,
    )
    srv.sessions.add(session_id, owner)
    if srv.unseeded is not None:
        srv.unseeded.session(session_id)
    reply = {"session_id": session_id, "type": "create_session"}
    if warning is not None:
        reply["warning_message"] = warning  # the SDK logs it as a warning
    if idem:
        srv.state.save_reply(owner, f"create_session|{idem}", body_hash(body), reply)
    return json_reply(reply)


def _older_sdk(version: str | None) -> str | None:
    """The warning for an official SDK older than `messages.OLDEST_SDK`, else None (also for
    a version that does not parse: a newer or a development one)."""
    parts = (version or "").split(".")[:3]
    if len(parts) < 3 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    if tuple(int(p) for p in parts) >= m.OLDEST_SDK:
        return None
    oldest = ".".join(map(str, m.OLDEST_SDK))
    return (
        f"tinker_sr's server answers every call of tinker SDK {oldest} and later (tested "
        f"up to {m.SDK_VERSION}); this client is tinker {version}: before 0.24.1 a batch's "
        "outputs of different shapes come back in the first one's shape, before 0.22.3 "
        "forward() is refused, before 0.20 forward_backward too; upgrade it (pip install -U "
        "tinker)"
    )


async def heartbeat(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, _ = await srv.parse(request, m.SessionHeartbeatRequest, "session_heartbeat")
    row = srv.sessions.session(req.session_id, owner, active=False)
    if row.finished is not None:
        why = srv.sessions.why_finished(row.session_id)
        return error(410, f"session {req.session_id} is finished ({why})")
    try:
        srv.state.heartbeat(req.session_id)
    except Exception as e:  # the keep-alive is in memory (`Sessions.touch`, above)
        if not is_out_of_space(e):
            raise
        log.warning("heartbeat of %s not written: the disk is full", req.session_id)
    return json_reply({"type": "session_heartbeat"})


async def finish_session(srv: TinkerServer, request: Request, owner: str) -> Response:
    session_id = request.path_params["session_id"]
    req, _ = await srv.parse(request, m.SessionFinishRequest, "sessions/{id}/finish")
    srv.sessions.session(session_id, owner, active=False)
    if srv.state.finish_session(session_id, req.reason.type):
        srv.sessions.finished(session_id)
        srv.sessions.stop_samples(
            session_id, f"its session {session_id} was finished ({req.reason.type})"
        )
        await srv.backend.close_session(session_id, req.reason.type, req.detail)
    return Response(status_code=204)


async def telemetry(srv: TinkerServer, request: Request, owner: str) -> Response:
    await srv.body(request)  # accepted and dropped
    return json_reply({"status": "accepted"})


async def cancel_future(srv: TinkerServer, request: Request, owner: str) -> Response:
    """``POST /cancel_future``: the SDK abandoned a sample request (a timeout, or its task
    cancelled) and, as ``sample_cancel_enabled`` tells it, asks to stop the work. A request
    already done is left as it is; another key's is unknown (404)."""
    req, _ = await srv.parse(request, m.FutureCancelRequest, "cancel_future")
    row = srv.futures.lookup(req.request_id, owner)
    if row.kind != "Sample":
        raise HTTPError(
            400,
            f"request {req.request_id} is a {row.kind} request: only sample requests can be "
            "cancelled (training requests run in their model's order)",
        )
    srv.futures.cancel_sample(row.request_id, CANCELLED_BY_CLIENT)
    return json_reply({"type": "cancel_future"})


CANCELLED_BY_CLIENT = "cancelled: its client abandoned the request (cancel_future)"


async def retrieve_future(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, _ = await srv.parse(request, m.FutureRetrieveRequest, "retrieve_future")
    row = srv.futures.lookup(req.request_id, owner)
    live = row.session_id if row.session_id in srv.sessions.last_seen else None
    if live is not None:
        srv.sessions.touch(live)
    with srv.sessions.serving(live):  # a client waiting on its request is not quiet ...
        return await unless_gone(request, srv.futures.answer(row))  # ... while it is there


async def list_sessions(srv: TinkerServer, request: Request, owner: str) -> Response:
    """``GET /sessions``: this key's session ids, newest first."""
    limit, offset = paging(request, 20, {"limit", "offset", "access_scope"})
    access_scope(request)
    return json_reply({"sessions": srv.state.session_ids_of(owner, limit=limit, offset=offset)})


async def get_session(srv: TinkerServer, request: Request, owner: str) -> Response:
    """``GET /sessions/{id}``: its training runs, sampling sessions, metadata and name. Reading
    a session does not count as its heartbeat."""
    paging(request, 0, {"access_scope"})
    access_scope(request)
    session_id = request.path_params["session_id"]
    row = srv.state.session(session_id)
    if row is None or row.owner != owner:
        raise HTTPError(404, f"unknown session_id {session_id!r}")
    info = await srv.backend.get_session(session_id)
    # The server's record of its samplers (kept across restarts), not the engine's live ones.
    info = info.model_copy(update={"sampler_ids": srv.state.sampler_ids_of(session_id)})
    return json_reply(info.model_dump(mode="json", exclude_none=True))
