"""REST endpoints: capabilities, health, checkpoints and training runs (list, info, copy,
delete, TTL, publish), and the endpoints this server deliberately does not offer."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tinker_sr import validation
from tinker_sr.errors import TinkerError
from tinker_sr.types import CopyWeightsRequest, ParsedCheckpointTinkerPath
from tinker_sr.user_errors import SESSION_QUERIES_UNSUPPORTED, EngineUserError
from tinker_sr.wire import messages as m

from ..http import HTTPError, body_hash, json_reply

if TYPE_CHECKING:
    from ..app import TinkerServer

log = logging.getLogger("tinker_sr.server")

# Endpoints the SDK knows that this server deliberately does not offer (400 with a reason,
# rather than an anonymous 404).
_UNSUPPORTED = {
    "auth/token": "JWT exchange is disabled (client/config says pjwt_auth_enabled: false)",
    "retrieve_futures": "the session poller is disabled (sample_use_retrieve_futures: false)",
    "join_sampling_session": "sample_join_sampling_session is false",
    "create_custom_loss": "server-side custom losses are disabled (custom_loss_server_side: "
    "false); forward_backward_custom runs the loss client-side",
    "unload_model": "models are unloaded when their session finishes",
    "audit": "audit logs are not kept",
    "forward": "forward() of a tinker SDK before 0.22.3 posts here; this server takes a forward "
    "as forward_backward with forward_only (client/config fwd_via_fwdbwd: true), which newer "
    "SDKs send: upgrade the SDK (pip install -U tinker)",
}
# Checkpoint archives (RestClient.get_checkpoint_archive_url*, deprecated in SDK 0.35, gone
# in 0.36) are not built here.
_ARCHIVE_ROUTE = re.compile(r"training_runs/[^/]+/checkpoints/.+/archive")
_NO_ARCHIVES = (
    "checkpoint archives are not built by this server (RestClient.get_checkpoint_archive_url "
    "is deprecated in the SDK and gone in 0.36); download weights with save_weights_external "
    "and RestClient.get_external_weights_urls, or run `tinker-sr export` where the server runs"
)
# The hosted service's session endpoints (search, project, trace export). Any other path under
# sessions/ is no endpoint (404), as on the embedded engine: the SDK sends a session id
# unquoted, so one holding "/" reaches no route.
_HOSTED_SESSION_ROUTE = re.compile(r"sessions/(?:search|[^/]+/(?:project|trace_export))")


async def capabilities(srv: TinkerServer, request: Request, owner: str) -> Response:
    caps = await srv.backend.get_server_capabilities()
    return json_reply(caps.model_dump(mode="json", exclude_none=True))


async def healthz(srv: TinkerServer, request: Request, owner: str) -> Response:
    return json_reply({"status": "ok"})


async def list_checkpoints(srv: TinkerServer, request: Request, owner: str) -> Response:
    run_id = request.path_params["run_id"]
    srv.sessions.run_owned(run_id, owner)
    out = await srv.backend.list_checkpoints(run_id)
    return json_reply(out.model_dump(mode="json", exclude_none=True))


def paging(request: Request, default_limit: int, allowed: set[str]) -> tuple[int, int]:
    extra = set(request.query_params) - allowed
    if extra:
        raise HTTPError(400, f"unsupported query parameter(s): {', '.join(sorted(extra))}")
    out = []
    for name, default in (("limit", default_limit), ("offset", 0)):
        raw = request.query_params.get(name, str(default))
        # ASCII digits only (str.isdigit also accepts "²", which int() refuses), and few
        # enough of them for SQLite's 64-bit integers.
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
            raise HTTPError(
                400,
                f"query parameter {name} must be a non-negative integer below 10**9, got {raw!r:.40}",
            )
        out.append(int(raw))
    return out[0], out[1]


def access_scope(request: Request) -> None:
    scope = request.query_params.get("access_scope", "owned")
    if scope not in ("owned", "accessible"):
        raise HTTPError(400, f"access_scope must be 'owned' or 'accessible', got {scope!r}")


def _only_owned(listed: list[str], runs: set[str]) -> None:
    """Fail closed if the backend ignored ``runs=`` (a wrapping backend may): a listing must
    never show another owner's runs."""
    if stray := set(listed) - runs:  # neither named nor counted in the reply
        log.error(
            "the backend listed %d run(s) of other owners; the listing is refused", len(stray)
        )
        raise RuntimeError("the backend ignored the runs= filter of its listing")


async def list_user_checkpoints(srv: TinkerServer, request: Request, owner: str) -> Response:
    limit, offset = paging(request, 100, {"limit", "offset"})
    runs = srv.state.model_ids_of(owner)
    page = await srv.backend.list_user_checkpoints(limit=limit, offset=offset, runs=runs)
    _only_owned(
        [
            ParsedCheckpointTinkerPath.from_tinker_path(c.tinker_path).training_run_id
            for c in page.checkpoints
        ],
        runs,
    )
    return json_reply(page.model_dump(mode="json", exclude_none=True))


async def get_training_run(srv: TinkerServer, request: Request, owner: str) -> Response:
    paging(request, 0, {"access_scope"})
    access_scope(request)
    run_id = request.path_params["run_id"]
    srv.sessions.run_owned(run_id, owner)
    run = await srv.backend.get_training_run(run_id)
    return json_reply(run.model_dump(mode="json", exclude_none=True))


async def list_training_runs(srv: TinkerServer, request: Request, owner: str) -> Response:
    if "project_id" in request.query_params:
        raise HTTPError(400, "filtering training runs by project_id is not supported")
    limit, offset = paging(request, 20, {"limit", "offset", "access_scope"})
    access_scope(request)
    runs = srv.state.model_ids_of(owner)
    page = await srv.backend.list_training_runs(limit=limit, offset=offset, runs=runs)
    _only_owned([r.training_run_id for r in page.training_runs], runs)
    return json_reply(page.model_dump(mode="json", exclude_none=True))


async def weights_info(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, _ = await srv.parse(request, m.WeightsInfoRequest, "weights_info")
    await srv.sessions.readable_checkpoint(req.tinker_path, owner, field="tinker_path")
    info = await srv.backend.get_weights_info(req.tinker_path)
    # optimizer_config is left out: checkpoints do not record it (the SDK defaults it).
    out = info.model_dump(mode="json", exclude_none=True, exclude={"optimizer_config"})
    return json_reply(out)


async def copy_weights(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, body = await srv.parse(request, CopyWeightsRequest, "copy_weights")
    header_token = request.headers.get("x-tinker-weights-access-token")
    validation.check_copy_weights(
        session_id=req.session_id,
        model_seq_id=req.model_seq_id,
        destination_project_id=req.destination_project_id,
        ttl_seconds=req.ttl_seconds,
        weights_access_token=req.weights_access_token or header_token,
    )
    source = await srv.sessions.readable_checkpoint(req.source_path, owner, field="source_path")
    if source.checkpoint_type == "external":
        raise HTTPError(
            400, "copy_weights: external_weights checkpoints are not supported by this server"
        )
    await srv.backend.get_checkpoint(req.source_path)  # 404 before anything is created
    idem = request.headers.get("x-idempotency-key")
    if idem:
        earlier = srv.state.reply(owner, f"copy_weights|{idem}")
        if earlier is not None and earlier[0] == body_hash(body):
            return json_reply(earlier[1])
    path, session_id = await _copy(srv, req, owner)
    srv.state.add_model(
        ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id, session_id
    )
    reply = {"tinker_path": path}
    if idem:
        srv.state.save_reply(owner, f"copy_weights|{idem}", body_hash(body), reply)
    return json_reply(reply)


async def _copy(srv: TinkerServer, req: CopyWeightsRequest, owner: str) -> tuple[str, str]:
    """Copy into the requested run slot, or into a new session of ``owner``."""
    ttl = req.ttl_seconds
    if req.session_id is not None:
        assert req.model_seq_id is not None
        srv.sessions.session(req.session_id, owner)
        path = await srv.backend.copy_weights(
            req.source_path,
            session_id=req.session_id,
            model_seq_id=req.model_seq_id,
            ttl_seconds=ttl,
        )
        return path, req.session_id
    # A session of its own, finished at once: it only holds the copy.
    session_id = await srv.backend.create_session(project_id=req.destination_project_id)
    srv.sessions.add(session_id, owner)
    try:
        with srv.sessions.serving(session_id):
            path = await srv.backend.copy_weights(
                req.source_path, session_id=session_id, model_seq_id=0, ttl_seconds=ttl
            )
    finally:
        if srv.state.finish_session(session_id, "success"):
            srv.sessions.finished(session_id)
            await srv.backend.close_session(session_id, "success")
    return path, session_id


async def _checkpoint_route(srv: TinkerServer, request: Request, owner: str) -> tuple[str, str]:
    run_id, kind, name = (request.path_params[k] for k in ("run_id", "kind", "name"))
    if request.url.query:
        # The official SDK puts a tinker path's name into the URL unquoted: from "name?x=1"
        # the "?" on would cut the route short (an unpublish became a delete of "name").
        raise HTTPError(
            400,
            f"checkpoint {kind}/{name}: unexpected query string {request.url.query!r:.60}; "
            "a checkpoint name cannot contain '?' or '#': check the tinker path",
        )
    if kind not in ("weights", "sampler_weights", "external_weights"):
        raise HTTPError(
            404,
            f"unknown checkpoint kind {kind!r}; expected weights, sampler_weights or "
            "external_weights",
        )
    srv.sessions.run_owned(run_id, owner)
    return run_id, f"{kind}/{await _name_as_sent(srv, request, run_id, kind, name)}"


async def _name_as_sent(
    srv: TinkerServer, request: Request, run_id: str, kind: str, name: str
) -> str:
    """``name`` as the URL spells it, where that differs from its decoding and names a
    checkpoint: the official SDK puts names into URLs unquoted, so a name holding "%" (which
    older tinker_sr versions accepted at save) arrives as "%41", decoded to "A": deleting
    "pct%41" deleted "pctA" (hunt). A quoting client (tinker_sr's) spells a literal "%" as
    "%25", which names no checkpoint, so its name is the decoded one."""
    raw = request.scope.get("raw_path") or b""
    marker = f"/checkpoints/{kind}/".encode()
    if b"%" not in raw or marker not in raw:
        return name
    sent = raw.split(marker, 1)[1].split(b"/", 1)[0].decode("latin-1")
    if sent == name:
        return name
    try:
        await srv.backend.get_checkpoint(f"tinker://{run_id}/{kind}/{sent}")
    except Exception:
        return name
    return sent


async def checkpoint_id_without_kind(srv: TinkerServer, request: Request, owner: str) -> Response:
    """``.../checkpoints/step-1``: the name ``save_state`` took, not the checkpoint id (a
    "no such endpoint" here read as a server of another version)."""
    run_id, checkpoint_id = (request.path_params[k] for k in ("run_id", "checkpoint_id"))
    srv.sessions.run_owned(run_id, owner)
    raise HTTPError(
        404,
        f"checkpoint {checkpoint_id!r:.80} of run {run_id!r:.80} does not exist; a "
        f"checkpoint_id is <weights|sampler_weights|external_weights>/<name>, e.g. "
        f"'weights/{checkpoint_id:.80}'",
    )


async def delete_checkpoint(srv: TinkerServer, request: Request, owner: str) -> Response:
    run_id, checkpoint_id = await _checkpoint_route(srv, request, owner)
    await srv.backend.delete_checkpoint(run_id, checkpoint_id)
    return Response(status_code=204)


async def set_checkpoint_ttl(srv: TinkerServer, request: Request, owner: str) -> Response:
    run_id, checkpoint_id = await _checkpoint_route(srv, request, owner)
    req, _ = await srv.parse(request, m.CheckpointTtlRequest, "checkpoint ttl")
    await srv.backend.set_checkpoint_ttl(f"tinker://{run_id}/{checkpoint_id}", req.ttl_seconds)
    return Response(status_code=204)


async def publish(srv: TinkerServer, request: Request, owner: str) -> Response:
    """POST publishes, DELETE unpublishes. Setting the flag a checkpoint already has
    succeeds (the hosted service answers 409, which the SDK retries for minutes)."""
    run_id, checkpoint_id = await _checkpoint_route(srv, request, owner)
    if checkpoint_id.startswith("external_weights/"):
        raise HTTPError(
            400,
            "external_weights checkpoints are not published; publish the training or sampler "
            "checkpoint instead",
        )
    await srv.body(request)  # no body expected; any is ignored
    await srv.backend.set_checkpoint_public(
        f"tinker://{run_id}/{checkpoint_id}", request.method == "POST"
    )
    return Response(status_code=204)


async def external_weights_urls(srv: TinkerServer, request: Request, owner: str) -> Response:
    run_id, kind, name = (request.path_params[k] for k in ("run_id", "kind", "name"))
    if kind != "external_weights":
        raise HTTPError(
            400,
            f"external_weights_urls is only for external_weights checkpoints "
            f"(tinker://<run_id>/external_weights/<name>), got kind {kind!r}",
        )
    srv.sessions.run_owned(run_id, owner)
    path = f"tinker://{run_id}/{kind}/{name}"
    files = getattr(srv.backend, "external_weights_files", None)
    if files is None or srv.file_download_urls:
        # A remote backend signs its own URLs; inside the client's process (mock_tinker) the
        # embedded engine's file:// URLs are the ones a plain GET can reach.
        out = await srv.backend.get_external_weights_urls(path)
        return json_reply(out.model_dump(mode="json", exclude_none=True))
    version, found = await files(path)
    urls, expires = srv.signer.sign(str(request.base_url), run_id, name, version, sorted(found))
    return json_reply({"urls": urls, "expires": expires.isoformat()})


async def external_weights_file(srv: TinkerServer, request: Request, owner: str) -> Response:
    """One file of an export, for whoever holds a URL signed by `external_weights_urls` (no
    API key: the signature is the grant). The file is opened here and streamed from the open
    handle, so a delete racing the download cannot fail it half-way."""
    run_id, name, file = (request.path_params[k] for k in ("run_id", "name", "file"))
    path = f"tinker://{run_id}/external_weights/{name}"
    try:
        version, files = await srv.backend.external_weights_files(path)  # type: ignore[attr-defined]
    except (EngineUserError, TinkerError):  # not (any more) here: answered like a bad signature
        version, files = "", {}
    query = request.query_params
    srv.signer.check(run_id, name, version, file, query.get("expires"), query.get("sig"))
    try:
        handle = open(files[file], "rb")  # noqa: SIM115 (closed by the stream)
    except (KeyError, FileNotFoundError):
        raise HTTPError(404, f"checkpoint {path} has no file {file!r} any more") from None
    size = os.fstat(handle.fileno()).st_size

    def chunks() -> Iterator[bytes]:
        with handle:
            while block := handle.read(1 << 20):
                yield block

    headers = {"Content-Length": str(size)}
    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)


# ---- usage (AdminClient; tinker_sr.engine.usage): the caller's own sessions only ----------
def _owned_sessions(srv: TinkerServer, owner: str) -> set[str]:
    return set(srv.state.session_ids_of(owner, limit=-1, offset=0))


async def billing_usage(srv: TinkerServer, request: Request, owner: str) -> Response:
    query = request.query_params
    paging(request, 0, {"starting_on", "ending_before"})  # refuses other parameters
    for name in ("starting_on", "ending_before"):
        if name not in query:
            raise HTTPError(
                400, f"query parameter {name} is required (an RFC 3339 time on a UTC hour)"
            )
    out = await srv.backend.get_billing_usage(
        query["starting_on"], query["ending_before"], sessions=_owned_sessions(srv, owner)
    )
    return json_reply(out.model_dump(mode="json", exclude_none=True))


async def checkpoint_storage_usage(srv: TinkerServer, request: Request, owner: str) -> Response:
    paging(request, 0, {"project_id"})
    out = await srv.backend.get_current_checkpoint_storage_usage(
        request.query_params.get("project_id"), sessions=_owned_sessions(srv, owner)
    )
    return json_reply(out.model_dump(mode="json", exclude_none=True))


async def unsupported(srv: TinkerServer, request: Request, owner: str) -> Response:
    path = request.url.path.split("/api/v1/", 1)[-1]
    for prefix, reason in _UNSUPPORTED.items():
        if path == prefix or path.startswith(prefix + "/"):
            raise HTTPError(400, f"/api/v1/{path} is not supported by this server: {reason}")
    for route, reason in ((_HOSTED_SESSION_ROUTE, SESSION_QUERIES_UNSUPPORTED),
                          (_ARCHIVE_ROUTE, _NO_ARCHIVES)):  # fmt: skip
        if route.fullmatch(path):
            raise HTTPError(400, f"/api/v1/{path} is not supported by this server: {reason}")
    raise HTTPError(404, f"no such endpoint: {request.method} /api/v1/{path}")
