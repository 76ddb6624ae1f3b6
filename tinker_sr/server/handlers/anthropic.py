"""Anthropic-compatible inference, as Tinker serves it under ``/anthropic/api``: ``POST
/v1/messages`` and ``POST /v1/messages/count_tokens``, for any Anthropic client pointed at
``http://127.0.0.1:8000/anthropic/api`` with a Tinker API key (``x-api-key``, as the Anthropic
SDK sends it, or ``Authorization: Bearer``). ``model`` is what the OpenAI-compatible routes
take (a base model, a tinker:// sampler path, ``<base>;<path>``); the same per-key session and
samplers serve both (`handlers.oai`). Formats: `server.anthropic_format`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..anthropic_format import (
    MessageStream,
    message_body,
    message_events,
    parse_messages_request,
)
from ..http import json_reply, unless_gone
from ..live_stream import engine_streams, live_stream
from ..oai_format import OaiError, OaiRequest
from .oai import prompt_token_count, read_request, sample_choices

if TYPE_CHECKING:
    from ..app import TinkerServer


async def _request(srv: TinkerServer, request: Request, *, count_only: bool) -> OaiRequest:
    return await read_request(
        srv, request, lambda body: parse_messages_request(body, count_only=count_only)
    )


async def messages(srv: TinkerServer, request: Request, owner: str) -> Response:
    req = await _request(srv, request, count_only=False)
    if req.stream and engine_streams(srv.backend):
        return await live_stream(
            lambda progress: sample_choices(srv, owner, req, progress), req, MessageStream(req)
        )
    choices, prompt_tokens = await unless_gone(request, sample_choices(srv, owner, req))
    if req.stream:
        events = message_events(req, choices[0], prompt_tokens)
        return StreamingResponse(iter(events), media_type="text/event-stream")
    return json_reply(message_body(req, choices[0], prompt_tokens))


async def count_tokens(srv: TinkerServer, request: Request, owner: str) -> Response:
    req = await _request(srv, request, count_only=True)
    return json_reply({"input_tokens": await prompt_token_count(srv, owner, req)})


async def unsupported(srv: TinkerServer, request: Request, owner: str) -> Response:
    raise OaiError(
        f"{request.method} {request.url.path} is not part of this server's Anthropic-compatible "
        "API (POST /v1/messages, POST /v1/messages/count_tokens)",
        status=404,
    )
