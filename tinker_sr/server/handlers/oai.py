"""OpenAI-compatible inference, as Tinker serves it under ``/oai/api/v1``: ``/completions``,
``/chat/completions`` and ``/models``, for any OpenAI client pointed at
``http://127.0.0.1:8000/oai/api/v1`` with a Tinker API key (``Authorization: Bearer`` or
``X-API-Key``).

``model`` is a base model (as ``create_sampling_client(base_model=...)`` takes it), a
``tinker://.../sampler_weights/...`` path of the caller's (or a published one), or
``<base model>;<tinker path>``, whose base must be the checkpoint's. Each API key gets one
session of its own on the engine for this ("openai-compatible inference"), so what it samples
shows in its usage like any sampling client's; a sampler per model is kept for the next
request (the last `SAMPLERS_KEPT`). Formats and the fields honoured: `server.oai_format`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tinker_sr import types
from tinker_sr.limits import DEFAULT_LIMITS

from ..http import HTTPError, json_reply, plain_error
from ..oai_format import (
    Choice,
    OaiError,
    OaiRequest,
    completion_body,
    cut_at_stop,
    parse_request,
    stream_events,
)

if TYPE_CHECKING:
    from ..app import TinkerServer

SAMPLERS_KEPT = 16
"""Samplers an API key keeps for its OpenAI-compatible requests (least recently used go)."""

_RESERVED_TEMPLATE_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "return_dict",
                             "chat_template", "return_tensors")  # fmt: skip


@dataclass
class _Target:
    sampler_id: str
    base_model: str
    seq: itertools.count[int] = field(default_factory=itertools.count)


class OaiSamplers:
    """Per API key: one engine session, and a sampler for each model string it asked for."""

    def __init__(self, srv: TinkerServer) -> None:
        self.srv = srv
        self._lock = asyncio.Lock()
        self._sessions: dict[str, str] = {}
        self._targets: dict[str, OrderedDict[str, _Target]] = {}
        self._sampler_seq = itertools.count()

    async def target(self, owner: str, model: str) -> _Target:
        async with self._lock:
            session_id = await self._session(owner)
            kept = self._targets.setdefault(owner, OrderedDict())
            found = kept.get(model)
            if found is not None:
                kept.move_to_end(model)
                return found
            found = await self._create(owner, session_id, model)
            kept[model] = found
            while len(kept) > SAMPLERS_KEPT:
                _, old = kept.popitem(last=False)
                release = getattr(self.srv.backend, "release_sampler", None)
                if release is not None:
                    await release(old.sampler_id)
            return found

    async def _session(self, owner: str) -> str:
        """The key's session, made anew if it was finished (expired) since."""
        srv = self.srv
        session_id = self._sessions.get(owner)
        if session_id is not None:
            row = srv.state.session(session_id)
            if row is not None and row.finished is None:
                srv.sessions.touch(session_id)
                return session_id
            self._targets.pop(owner, None)
        session_id = await srv.backend.create_session(
            display_name="openai-compatible inference", tags=["oai"]
        )
        srv.state.add_session(session_id, owner)
        srv.sessions.touch(session_id)
        self._sessions[owner] = session_id
        return session_id

    async def _create(self, owner: str, session_id: str, model: str) -> _Target:
        srv = self.srv
        base, sep, path = model.partition(";")
        if not sep and model.startswith("tinker://"):
            base, path = "", model
        base, path = base.strip(), path.strip()
        try:
            if path:
                await srv.sessions.readable_checkpoint(path, owner, field="model")
            sampler_id = await srv.backend.create_sampling_session(
                session_id,
                next(self._sampler_seq),
                base_model=None if path else base,
                model_path=path or None,
            )
        except Exception as e:  # named as the field this API calls it
            status, detail = (e.status, e.detail) if isinstance(e, HTTPError) else plain_error(e)
            if status >= 500:
                raise
            raise OaiError(f"model {model!r}: {detail}", "model", status) from None
        srv.state.add_sampler(sampler_id, session_id, path or None)
        actual = await srv.backend.get_sampler_base_model(sampler_id)
        if path and base:
            resolve = getattr(srv.backend, "resolve_model", None)
            same = resolve(base) == resolve(actual) if resolve is not None else base == actual
            if not same:
                raise OaiError(
                    f"model: {path} was trained on {actual!r}, not {base!r}; name its own base "
                    "model before the ';', or send the tinker:// path alone",
                    "model",
                )
        return _Target(sampler_id, actual)


# ---- requests --------------------------------------------------------------------------------


def _encode(tok: Any, req: OaiRequest) -> list[list[int]]:
    """The request's prompts as token ids."""
    if not req.chat:
        return [
            p if isinstance(p, list) else list(tok.encode(p, add_special_tokens=True))
            for p in req.prompts
        ]
    bad = [k for k in req.chat_template_kwargs if k in _RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise OaiError(f"chat_template_kwargs: {bad[0]!r} is set by the server", bad[0])
    ids = tok.apply_chat_template(
        req.messages,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
        **req.chat_template_kwargs,
    )
    return [list(ids)]


def _params(req: OaiRequest) -> types.SamplingParams:
    return types.SamplingParams(
        max_tokens=max(req.max_tokens, 1) if req.max_tokens is not None else None,
        seed=req.seed,
        stop=req.stop or None,
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
    )


def _token_entries(
    tok: Any, ids: list[int], lps: list[Any], tops: list[Any] | None
) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
    def text(t: int) -> str:
        return str(tok.decode([t], skip_special_tokens=False))

    out = []
    for i, t in enumerate(ids):
        alts = (tops[i] or []) if tops is not None else []
        lp = lps[i]
        out.append(
            (text(t), None if lp is None else float(lp), [(text(a), float(b)) for a, b in alts])
        )
    return out


def _choices(
    tok: Any, req: OaiRequest, prompt: list[int], resp: types.SampleResponse
) -> list[Choice]:
    """The sampled sequences of one prompt as answers (text cut at stop strings; echo puts
    the prompt, and with log-probs its scores, in front)."""
    out = []
    scoring_only = req.max_tokens == 0
    for seq in resp.sequences:
        tokens = [] if scoring_only else list(seq.tokens)
        text = cut_at_stop(
            str(tok.decode(tokens, skip_special_tokens=req.skip_special_tokens)), req.stop
        )
        entries = None
        if req.logprobs is not None:
            tops = seq.topk_logprobs if req.logprobs else None
            entries = _token_entries(tok, tokens, list(seq.logprobs or []), tops)
        if req.echo:
            text = str(tok.decode(prompt, skip_special_tokens=req.skip_special_tokens)) + text
            if entries is not None:
                tops_p = resp.topk_prompt_logprobs if req.logprobs else None
                entries = (
                    _token_entries(tok, prompt, list(resp.prompt_logprobs or []), tops_p) + entries
                )
        reason = "length" if scoring_only or seq.stop_reason == "length" else "stop"
        out.append(Choice(text, reason, entries, len(tokens)))
    return out


async def _answer(srv: TinkerServer, owner: str, req: OaiRequest) -> Response:
    target = await srv.oai.target(owner, req.model)
    from tinker_sr.clients.tokenizers import tokenizer_for

    tok = await asyncio.to_thread(tokenizer_for, srv.backend, target.base_model, None)
    prompts = await asyncio.to_thread(_encode, tok, req)
    params = _params(req)
    overflow = getattr(srv.backend, "sample_overflow", None)
    for ids in prompts:
        problem = (
            overflow(target.sampler_id, types.ModelInput.from_ints(ids), params)
            if overflow
            else None
        )
        if problem is not None:
            raise OaiError(
                problem, "max_tokens" if req.max_tokens else "messages" if req.chat else "prompt"
            )
    top = req.logprobs or 0
    with_prompt = req.echo and req.logprobs is not None

    async def one(ids: list[int]) -> types.SampleResponse:
        return await srv.backend.sample(
            target.sampler_id,
            next(target.seq),
            prompt=types.ModelInput.from_ints(ids),
            num_samples=req.n,
            sampling_params=params,
            include_prompt_logprobs=with_prompt,
            topk_prompt_logprobs=top if with_prompt else 0,
            topk_sample_logprobs=top if req.logprobs is not None else 0,
        )

    results = await asyncio.gather(*(one(ids) for ids in prompts))
    choices = [
        c for ids, r in zip(prompts, results, strict=True) for c in _choices(tok, req, ids, r)
    ]
    prompt_tokens = sum(len(ids) for ids in prompts)
    if req.stream:
        events = stream_events(req, choices, prompt_tokens)
        return StreamingResponse(iter(events), media_type="text/event-stream")
    return json_reply(completion_body(req, choices, prompt_tokens))


async def _serve(srv: TinkerServer, request: Request, owner: str, *, chat: bool) -> Response:
    raw = await srv.body(request)
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise OaiError(f"the request body is not valid JSON: {e}") from None
    limits = getattr(srv.backend, "limits", DEFAULT_LIMITS)
    req = parse_request(body, chat=chat, max_n=limits.max_num_samples)
    return await _answer(srv, owner, req)


async def completions(srv: TinkerServer, request: Request, owner: str) -> Response:
    return await _serve(srv, request, owner, chat=False)


async def chat_completions(srv: TinkerServer, request: Request, owner: str) -> Response:
    return await _serve(srv, request, owner, chat=True)


async def models(srv: TinkerServer, request: Request, owner: str) -> Response:
    """The base models this server offers (a tinker:// sampler path works as ``model`` too)."""
    caps = await srv.backend.get_server_capabilities()
    data = [
        {"id": m.model_name, "object": "model", "created": 0, "owned_by": "tinker-sr"}
        for m in caps.supported_models
        if m.model_name
    ]
    return json_reply({"object": "list", "data": data})


async def unsupported(srv: TinkerServer, request: Request, owner: str) -> Response:
    raise OaiError(
        f"{request.method} {request.url.path} is not part of this server's OpenAI-compatible "
        "API (POST /completions, POST /chat/completions, GET /models)",
        status=404,
    )
