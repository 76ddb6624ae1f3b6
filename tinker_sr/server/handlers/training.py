"""Training endpoints: create a model, its info, forward/backward, optimizer steps, and
saving / loading its weights. A model's requests are numbered (seq_id); one refused here
still frees its number (`SeqWatcher.reject`), so later requests do not wait for it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic
from starlette.requests import Request
from starlette.responses import Response

from tinker_sr import validation
from tinker_sr.types import ModelData
from tinker_sr.user_errors import EngineUserError
from tinker_sr.wire import WireError, proto
from tinker_sr.wire import messages as m

from ..http import PROTOBUF, HTTPError, json_reply
from ..state import SessionRow

if TYPE_CHECKING:
    from ..app import TinkerServer

Req = TypeVar("Req", bound=pydantic.BaseModel)
Work = Callable[[dict[str, Any]], Awaitable[tuple[str, bytes]]]


async def create_model(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, body = await srv.parse(request, m.CreateModelRequest, "create_model")
    srv.sessions.session(req.session_id, owner)
    # Checked before the future exists, so these are HTTP 400s (the rest of the LoRA config
    # is the backend's to check, failing the future as the SDK expects).
    lora = validation.require_lora_config(req.lora_config)
    validation.check_model_seq_id(req.model_seq_id, "create_model")
    if lora.seed is None and srv.unseeded is not None:
        seed = srv.unseeded.lora(req.session_id, req.model_seq_id)
        lora = lora.model_copy(update={"seed": seed})

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        model_id = await srv.backend.create_model(
            req.session_id,
            req.model_seq_id,
            base_model=req.base_model,
            lora_config=lora,
            optimizer_config=req.optimizer_config,
            user_metadata=req.user_metadata,
        )
        srv.state.add_model(model_id, req.session_id)
        return "json", m.dumps({"model_id": model_id, "type": "create_model"})

    return srv.futures.submit(
        kind="CreateModel",
        owner=owner,
        session_id=req.session_id,
        dedupe_key=f"model|{req.session_id}|model_seq_id {req.model_seq_id}",
        body=body,
        work=work,
        promise_extra={"model_id": f"{req.session_id}:train:{req.model_seq_id}"},
    )


async def get_info(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, _ = await srv.parse(request, m.GetInfoRequest, "get_info")
    srv.sessions.model(req.model_id, owner)
    info = await srv.backend.get_info(req.model_id)
    tokenizer_id = srv.tokenizers.tokenizer_id(info)
    if tokenizer_id != info.model_data.tokenizer_id:
        data = info.model_data.model_copy(update={"tokenizer_id": tokenizer_id})
        info = info.model_copy(update={"model_data": ModelData.model_validate(data.model_dump())})
    out = info.model_dump(mode="json", exclude_none=True)
    out.setdefault("type", "get_info")
    return json_reply(out)


async def forward_backward(srv: TinkerServer, request: Request, owner: str) -> Response:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in (PROTOBUF, "application/octet-stream"):
        raise HTTPError(
            415,
            f"forward_backward takes a protobuf tinker_public.ForwardBackwardRequest "
            f"body with Content-Type: {PROTOBUF} (got {ctype or 'none'}); JSON "
            "forward_backward bodies are not part of the SDK 0.38 protocol (tinker SDKs "
            "send protobuf from 0.20 on: upgrade an older one, pip install -U tinker)",
        )
    body = await srv.body(request)
    target = proto.peek_forward_backward_target(body)
    if target is not None:
        srv.sessions.model(target[0], owner)  # unknown/foreign model: 404 before anything else
    try:
        call = proto.decode_forward_backward_request(body)
    except WireError:
        if target is not None:
            srv.seqs.reject(*target)
        raise
    session = srv.sessions.model(call.model_id, owner)
    try:
        srv.features.check_forward_backward(call)
    except HTTPError:
        srv.seqs.reject(call.model_id, call.seq_id)
        raise

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        out = await srv.backend.forward_backward(
            call.model_id,
            call.seq_id,
            call.data,
            call.loss_fn,
            call.loss_fn_config,
            forward_only=call.forward_only,
        )
        return "proto", proto.encode_forward_backward_output(out)

    return _submit_training(
        srv, "ForwardBackward", owner, session, call.model_id, call.seq_id, body, work
    )


def _submit_training(
    srv: TinkerServer,
    kind: str,
    owner: str,
    session: SessionRow,
    model_id: str,
    seq_id: int,
    body: bytes,
    work: Work,
) -> Response:
    """Submit a model's numbered training request (deduplicated by (model, seq_id))."""
    return srv.futures.submit(
        kind=kind,
        owner=owner,
        session_id=session.session_id,
        dedupe_key=f"train|{model_id}|seq_id {seq_id}",
        on_accept=lambda: srv.seqs.note(model_id, seq_id),
        body=body,
        work=work,
        promise_extra={"model_id": model_id},
    )


async def _training_request(
    srv: TinkerServer, request: Request, model_cls: type[Req], what: str, owner: str
) -> tuple[bytes, Req, SessionRow, int]:
    """Parse a JSON training request; a malformed one still frees its seq_id."""
    body = await srv.body(request)
    raw = m.parse_json(body, what)
    try:
        req = m.parse(model_cls, raw, what)
    except WireError:
        srv.seqs.reject_if_known(raw, owner)
        raise
    model_id: str = req.model_id  # type: ignore[attr-defined]
    session = srv.sessions.model(model_id, owner)
    seq_id = _training_seq(req.seq_id, what)  # type: ignore[attr-defined]
    return body, req, session, seq_id


def _training_seq(seq_id: int | None, what: str) -> int:
    if seq_id is None:
        raise HTTPError(
            400, f"{what}: seq_id is required (training requests are numbered per model from 1)"
        )
    if seq_id < 1:
        raise HTTPError(400, f"{what}: seq_id must be >= 1, got {seq_id}")
    return seq_id


async def optim_step(srv: TinkerServer, request: Request, owner: str) -> Response:
    body, req, session, seq_id = await _training_request(
        srv, request, m.OptimStepRequest, "optim_step", owner
    )
    if req.adam_params is None:
        srv.seqs.reject(req.model_id, seq_id)
        kind = (req.optimizer_params or {}).get("type")
        raise HTTPError(
            400,
            validation.optimizer_refused(kind)
            if req.optimizer_params is not None
            else "optim_step: adam_params is required",
        )
    params = req.adam_params

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        out = await srv.backend.optim_step(req.model_id, seq_id, params)
        return "json", m.dumps(out.model_dump(mode="json", exclude_none=True))

    return _submit_training(srv, "OptimStep", owner, session, req.model_id, seq_id, body, work)


async def save_weights(srv: TinkerServer, request: Request, owner: str) -> Response:
    body, req, session, seq_id = await _training_request(
        srv, request, m.SaveWeightsRequest, "save_weights", owner
    )
    if not req.path:
        srv.seqs.reject(req.model_id, seq_id)
        raise HTTPError(400, validation.EMPTY_SAVE_PATH)
    name = req.path

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        out = await srv.backend.save_state(
            req.model_id,
            seq_id,
            name,
            ttl_seconds=req.ttl_seconds,
            overwrite=req.overwrite,
            user_metadata=req.user_metadata,
        )
        return "json", m.dumps({"path": out.path, "type": "save_weights"})

    return _submit_training(srv, "SaveWeights", owner, session, req.model_id, seq_id, body, work)


async def save_weights_for_sampler(srv: TinkerServer, request: Request, owner: str) -> Response:
    body, req, session, seq_id = await _training_request(
        srv, request, m.SaveWeightsForSamplerRequest, "save_weights_for_sampler", owner
    )
    problem = None
    try:
        validation.check_sampler_kind(req.kind, "save_weights_for_sampler")
    except EngineUserError as e:
        problem = str(e)
    if problem is None and req.path is None and req.sampling_session_seq_id is None:
        problem = (
            "save_weights_for_sampler: send either path (a checkpoint name) or "
            "sampling_session_seq_id (to get a sampling session)"
        )
    if problem is not None:
        srv.seqs.reject(req.model_id, seq_id)
        raise HTTPError(400, problem)

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        out = await srv.backend.save_weights_for_sampler(
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
                raise RuntimeError("backend returned no sampling_session_id for an unnamed save")
            srv.state.add_sampler(sampler_id, session.session_id, None)
            if srv.unseeded is not None and req.sampling_session_seq_id is not None:
                # Numbered by the same client counter as create_sampling_session's.
                srv.unseeded.sampler(sampler_id, session.session_id, req.sampling_session_seq_id)
            result["sampling_session_id"] = sampler_id
        else:
            result["path"] = out.path
        return "json", m.dumps(result)

    return _submit_training(
        srv, "SaveWeightsForSampler", owner, session, req.model_id, seq_id, body, work
    )


async def save_weights_external(srv: TinkerServer, request: Request, owner: str) -> Response:
    body, req, session, seq_id = await _training_request(
        srv, request, m.SaveWeightsExternalRequest, "save_weights_external", owner
    )
    try:  # refused before the future exists (the backend checks the name and TTL in order)
        validation.age_recipients(req.age_encryption_recipients)
    except EngineUserError as e:
        srv.seqs.reject(req.model_id, seq_id)
        raise HTTPError(400, str(e)) from None

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        out = await srv.backend.save_weights_external(
            req.model_id,
            seq_id,
            req.path,
            ttl_seconds=req.ttl_seconds,
            age_encryption_recipients=req.age_encryption_recipients,
        )
        return "json", m.dumps({"path": out.path, "type": "save_weights_external"})

    return _submit_training(
        srv, "SaveWeightsExternal", owner, session, req.model_id, seq_id, body, work
    )


async def load_weights(srv: TinkerServer, request: Request, owner: str) -> Response:
    body = await srv.body(request)
    raw = m.parse_json(body, "load_weights")
    try:
        req = m.parse(m.LoadWeightsRequest, raw, "load_weights")
    except WireError:
        srv.seqs.reject_if_known(raw, owner)
        raise
    if req.session_id is not None or req.model_seq_id is not None:
        return await _create_from_state(srv, req, owner, body)
    if req.model_id is None:
        raise HTTPError(
            400,
            "load_weights: send model_id + seq_id (load into a model) or "
            "session_id + model_seq_id (create a model from the checkpoint)",
        )
    session = srv.sessions.model(req.model_id, owner)
    seq_id = _training_seq(req.seq_id, "load_weights")
    try:
        validation.check_no_access_token(req.weights_access_token, "load_weights")
        await srv.sessions.readable_checkpoint(req.path, owner)
    except (HTTPError, EngineUserError):
        srv.seqs.reject(req.model_id, seq_id)
        raise
    model_id = req.model_id

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        out = await srv.backend.load_state(model_id, seq_id, req.path, with_optimizer=req.optimizer)
        res = out.model_dump(mode="json", exclude_none=True)
        res["type"] = "load_weights"
        return "json", m.dumps(res)

    return _submit_training(srv, "LoadWeights", owner, session, model_id, seq_id, body, work)


async def _create_from_state(
    srv: TinkerServer, req: m.LoadWeightsRequest, owner: str, body: bytes
) -> Response:
    if req.session_id is None or req.model_seq_id is None:
        raise HTTPError(
            400,
            "load_weights: creating a model from a checkpoint needs both "
            "session_id and model_seq_id",
        )
    if req.model_id is not None:
        raise HTTPError(
            400,
            "load_weights: send model_id (load into a model) or "
            "session_id + model_seq_id (create one), not both",
        )
    validation.check_no_access_token(req.weights_access_token, "load_weights")
    srv.sessions.session(req.session_id, owner)
    await srv.sessions.readable_checkpoint(req.path, owner)
    session_id, model_seq_id = req.session_id, req.model_seq_id

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        model_id = await srv.backend.create_model_from_state(
            session_id,
            model_seq_id,
            path=req.path,
            with_optimizer=req.optimizer,
            base_model=req.base_model,
            optimizer_config=req.optimizer_config,
            user_metadata=req.user_metadata,
        )
        srv.state.add_model(model_id, session_id)
        return "json", m.dumps({"model_id": model_id, "path": req.path, "type": "load_weights"})

    return srv.futures.submit(
        kind="LoadWeights",
        owner=owner,
        session_id=session_id,
        dedupe_key=f"model|{session_id}|model_seq_id {model_seq_id}",
        body=body,
        work=work,
        promise_extra={"model_id": f"{session_id}:train:{model_seq_id}"},
    )
