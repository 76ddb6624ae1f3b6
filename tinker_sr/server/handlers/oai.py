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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tinker_sr import types
from tinker_sr.engine.sampler import NewTokens
from tinker_sr.engine.sampling import sampler_context
from tinker_sr.limits import DEFAULT_LIMITS
from tinker_sr.tokenization.hf import byte_fallback, decode_answer
from tinker_sr.types.topk_logprobs import TopkLogprobs, topk_to_lists

from ..harmony import opens_message, split_channels
from ..http import HTTPError, json_reply, plain_error, unless_gone
from ..live_stream import Progress, Reader, engine_streams, live_stream, sample_takes
from ..oai_format import (
    Choice,
    OaiError,
    OaiRequest,
    OaiStream,
    TokenEntry,
    advance,
    completion_body,
    cut_at_stop,
    parse_request,
    stream_events,
)
from ..prompt_size import refuse_past_context, string_chars

if TYPE_CHECKING:
    from ..app import TinkerServer

SAMPLERS_KEPT = 16
"""Samplers an API key keeps for its OpenAI-compatible requests (least recently used go)."""

_RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt",
                             "return_dict", "chat_template", "return_tensors")  # fmt: skip


@dataclass
class _Target:
    sampler_id: str
    base_model: str
    session_id: str = ""
    path: str | None = None
    saved_at: Any = None  # the checkpoint's time: a checkpoint saved anew is loaded anew
    seq: itertools.count[int] = field(default_factory=itertools.count)


def _model_error(model: str, e: Exception) -> Exception:
    """A failure to serve ``model``, named as the field this API calls it (5xx as is)."""
    status, detail = (e.status, e.detail) if isinstance(e, HTTPError) else plain_error(e)
    if status >= 500:
        return e
    return OaiError(f"model {model!r}: {detail}", "model", status)


class OaiSamplers:
    """Per API key: one engine session, and a sampler for each model string it asked for."""

    def __init__(self, srv: TinkerServer) -> None:
        self.srv = srv
        self._locks: dict[str, asyncio.Lock] = {}  # per key: one key's loading stalls no other
        self._sessions: dict[str, str] = {}
        self._targets: dict[str, OrderedDict[str, _Target]] = {}
        self._sampler_seq = itertools.count()

    async def target(self, owner: str, model: str) -> _Target:
        async with self._locks.setdefault(owner, asyncio.Lock()):
            session_id = await self._session(owner)
            kept = self._targets.setdefault(owner, OrderedDict())
            found = kept.get(model)
            if found is not None and await self._still_readable(owner, model, found):
                kept.move_to_end(model)
                return found
            with self.srv.sessions.serving(session_id):  # loading may take long
                found = await self._create(owner, session_id, model)
            kept[model] = found
            while len(kept) > SAMPLERS_KEPT:
                _, old = kept.popitem(last=False)
                await self._release(old)
            return found

    async def _release(self, target: _Target) -> None:
        release = getattr(self.srv.backend, "release_sampler", None)
        if release is not None:
            await release(target.sampler_id)

    async def _still_readable(self, owner: str, model: str, target: _Target) -> bool:
        """Whether a kept sampler may serve this request: its checkpoint is still readable
        by this key (not deleted, expired or unpublished since) and not saved anew. False:
        make a new one; a checkpoint no longer readable raises as a new sampler would."""
        if target.path is None:
            return True
        try:
            saved_at = await self._saved_at(owner, target.path)
        except Exception as e:
            await self._forget(owner, model, target)
            raise _model_error(model, e) from None
        if saved_at == target.saved_at:
            return True
        await self._forget(owner, model, target)
        return False

    async def _saved_at(self, owner: str, path: str) -> Any:
        """When checkpoint ``path`` was saved, if this key may read it (else the 404 of
        `Sessions.readable_checkpoint`)."""
        await self.srv.sessions.readable_checkpoint(path, owner, field="model")
        return (await self.srv.backend.get_checkpoint(path)).time

    async def _forget(self, owner: str, model: str, target: _Target) -> None:
        self._targets[owner].pop(model, None)
        await self._release(target)

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
        srv.sessions.add(session_id, owner)
        self._sessions[owner] = session_id
        return session_id

    async def _create(self, owner: str, session_id: str, model: str) -> _Target:
        srv = self.srv
        base, sep, path = model.partition(";")
        if not sep and model.startswith("tinker://"):
            base, path = "", model
        base, path = base.strip(), path.strip()
        try:
            saved_at = await self._saved_at(owner, path) if path else None
            sampler_id = await srv.backend.create_sampling_session(
                session_id,
                next(self._sampler_seq),
                base_model=None if path else base,
                model_path=path or None,
            )
        except Exception as e:
            raise _model_error(model, e) from None
        srv.state.add_sampler(sampler_id, session_id, path or None)
        actual = await srv.backend.get_sampler_base_model(sampler_id)
        if path and base:
            resolve = getattr(srv.backend, "resolve_model", None)
            same = resolve(base) == resolve(actual) if resolve is not None else base == actual
            if not same:
                await self._release(_Target(sampler_id, actual))
                raise OaiError(
                    f"model: {path} was trained on {actual!r}, not {base!r}; name its own base "
                    "model before the ';', or send the tinker:// path alone",
                    "model",
                )
        return _Target(sampler_id, actual, session_id, path or None, saved_at)


# ---- requests --------------------------------------------------------------------------------


def _encode(tok: Any, req: OaiRequest, context: int | None = None) -> list[list[int]]:
    """The request's prompts as token ids; one that cannot fit ``context`` tokens refused
    before it is tokenized, from its length (`prompt_size`)."""
    if not req.chat:
        for p in req.prompts:
            if isinstance(p, str):
                refuse_past_context(tok, context, "prompt", len(p), partial(list, (p,)))
        return [
            p if isinstance(p, list) else list(tok.encode(p, add_special_tokens=True))
            for p in req.prompts
        ]
    bad = [k for k in req.chat_template_kwargs if k in _RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise OaiError(f"chat_template_kwargs: {bad[0]!r} is set by the server", bad[0])
    if not getattr(tok, "chat_template", "unknown"):  # the tokenizer's own hint names Python
        raise OaiError(
            "messages: this model's tokenizer has no chat template (it is not a chat model): "
            "use /completions with a prompt or token ids, or serve a model directory whose "
            "tokenizer has one",
            "messages",
        )

    def render(kwargs: dict[str, Any], tokenize: bool = True) -> Any:
        out = tok.apply_chat_template(
            req.messages, tokenize=tokenize, add_generation_prompt=True, return_dict=False,
            **kwargs,
        )  # fmt: skip
        return [int(t) for t in out] if tokenize else out

    try:
        chars = string_chars(req.messages) + len(req.prefill or "")
        text = partial(render, req.chat_template_kwargs, False)
        refuse_past_context(tok, context, "messages", chars, lambda: [text(), req.prefill or ""])
        ids = render(req.chat_template_kwargs)
    except OaiError:
        raise
    except Exception as e:  # the template's own failure (jinja2, transformers): the request's
        param = "messages"
        if req.chat_template_kwargs:
            try:
                render({})
                param = "chat_template_kwargs"
            except Exception:
                pass
        raise OaiError(
            f"{param}: the model's chat template cannot render this request "
            f"({type(e).__name__}: {e})",
            param,
        ) from None
    # a prefill (Anthropic's last assistant message): the answer's start, after the prompt
    return [ids + list(tok.encode(req.prefill, add_special_tokens=False)) if req.prefill else ids]


async def _prompt_ids(srv: TinkerServer, target: _Target, req: OaiRequest) -> tuple[Any, list[list[int]]]:  # fmt: skip
    """The tokenizer of ``target``'s model, and ``req``'s prompts as its token ids (both off
    the event loop: loading a tokenizer and rendering a template take a while)."""
    from tinker_sr.clients.tokenizers import tokenizer_for

    tok = await asyncio.to_thread(tokenizer_for, srv.backend, target.base_model, None)
    models = getattr(srv.backend, "models", None)
    context = sampler_context(models, target.sampler_id) if models is not None else None
    return tok, await asyncio.to_thread(_encode, tok, req, context)


async def prompt_token_count(srv: TinkerServer, owner: str, req: OaiRequest) -> int:
    """How many tokens ``req``'s prompts are for its model (nothing sampled)."""
    _, prompts = await _prompt_ids(srv, await srv.oai.target(owner, req.model), req)
    return sum(len(ids) for ids in prompts)


def _params(req: OaiRequest) -> types.SamplingParams:
    return types.SamplingParams(
        max_tokens=max(req.max_tokens, 1) if req.max_tokens is not None else None,
        seed=req.seed,
        stop=req.stop or None,
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
    )


def tokenizer_facts(
    backend: Any, base_model: str, with_bytes: bool
) -> tuple[Sequence[bytes] | None, frozenset[int]]:
    """From the engine's tokenizer of ``base_model`` (which takes the model registry's lock:
    call it off the event loop): with ``with_bytes``, the bytes each token id stands for (a
    token can be part of a UTF-8 character, which its decoded text cannot show), and the ids
    that end its answers; (None, no ids) where the engine has no tokenizer of it."""
    models = getattr(backend, "models", None)
    try:
        engine = models.tokenizer(base_model) if models is not None else None
    except Exception:  # no engine tokenizer: the decoded texts' bytes instead, no EOS ids
        return None, frozenset()
    if engine is None:
        return None, frozenset()
    try:
        table = engine.token_bytes if with_bytes else None
    except Exception:  # e.g. no tokenizer.json: the decoded texts' bytes instead
        table = None
    return table, frozenset(engine.eos_token_ids)


def token_text(text: str, raw: bytes) -> str:
    """A token's text in log-probs: ``text``, its decoding, unless that is empty or U+FFFD, a
    token that is part of a UTF-8 character, which is written ``bytes:\\xNN...`` as OpenAI
    does, so that such alternatives do not all collapse onto one "\ufffd" key (or its bytes'
    text, ``raw``, where they are a whole character)."""
    if not raw or (text and "\ufffd" not in text):
        return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _token_entries(
    tok: Any,
    ids: list[int],
    lps: list[Any],
    tops: list[Any] | None,
    table: Any,
    skip_special_tokens: bool = True,
) -> list[TokenEntry]:
    """Log-prob entries of ``ids``; ``table``: the tokens' bytes in a text (`tokenizer_facts`:
    b"" for a special token, which the text leaves out with ``skip_special_tokens``)."""
    facts = byte_fallback(tok)
    spaced = facts is not None and facts.anchor is not None  # answers keep "▁x"'s space

    def entry(t: int, lp: float | None) -> TokenEntry:
        raw = table[t] if table is not None and 0 <= t < len(table) else b""
        # Decoded alone, "▁x" of a Llama 2 / Mistral vocabulary loses the space its answer
        # keeps (`decode_answer`): its text is its bytes'.
        text = "" if spaced and raw else str(tok.decode([t], skip_special_tokens=False))
        left_out = table is not None and not raw and skip_special_tokens
        return TokenEntry(
            token_text(text, raw), lp, raw or text.encode("utf-8"), shown=b"" if left_out else None
        )

    out = []
    for i, t in enumerate(ids):
        alts = (tops[i] or []) if tops is not None else []
        lp = lps[i]
        e = entry(t, None if lp is None else float(lp))
        e.top = [entry(a, float(b)) for a, b in alts]
        out.append(e)
    return out


def _new_entries(tok: Any, req: OaiRequest, table: Any, row: NewTokens) -> list[TokenEntry]:
    """A streamed answer's new tokens' entries, as `_choices` writes the whole answer's."""
    tops = None
    if req.logprobs and row.topk_token_ids is not None and row.topk_logprobs is not None:
        tops = topk_to_lists(TopkLogprobs(row.topk_token_ids, row.topk_logprobs))
    skip = req.skip_special_tokens
    return _token_entries(tok, row.tokens, row.logprobs.tolist(), tops, table, skip)


def _choices(
    tok: Any,
    req: OaiRequest,
    prompt: list[int],
    resp: types.SampleResponse,
    table: Any,
    eos: frozenset[int] = frozenset(),
) -> list[Choice]:
    """The sampled sequences of one prompt as answers (text cut at stop strings; echo puts
    the prompt, and with log-probs its scores, in front)."""
    out = []
    scoring_only, skip = req.max_tokens == 0, req.skip_special_tokens
    for seq in resp.sequences:
        tokens = [] if scoring_only else list(seq.tokens)
        text, stop_string = cut_at_stop(_decoded(tok, req, _said(tokens, seq, eos)), req.stop)
        before_stop = text
        if stop_string is None:  # an incomplete last character is not said, as in vLLM
            text = text.rstrip("\ufffd")
        whole = len(tokens)
        if stop_string is not None:  # a special token's text, which the engine ran past
            tokens = tokens[: _through_stop(tok, req, tokens, text + stop_string)]
        entries, start = None, (0, b"")
        if req.logprobs is not None:
            tops = seq.topk_logprobs if req.logprobs else None
            entries = _token_entries(tok, tokens, list(seq.logprobs or []), tops, table, skip)
        if req.echo:
            head = _prompt_text(tok, req, prompt)
            text = head + text
            if entries is not None:
                tops_p = resp.topk_prompt_logprobs if req.logprobs else None
                lps = list(resp.prompt_logprobs or [])
                scored = _token_entries(tok, prompt, lps, tops_p, table, skip)
                # The first space a Llama 2 decoder strips from the prompt's text: its tokens'
                # bytes hold it (`text_offset` counts from where the text begins).
                start = (min(0, len(head) - advance((0, b""), (e.width for e in scored))[0]), b"")
                entries = scored + entries
        reasoning = None
        if req.chat and req.skip_special_tokens and (parts := split_channels(tok, prompt, tokens)):
            if stop_string is not None:  # it may span channels: the answer ends where it begins
                parts = _channels_before(tok, prompt, tokens, before_stop) or parts
            text = cut_at_stop(parts[1], req.stop)[0].rstrip("\ufffd")
            reasoning = None if parts[0] is None else cut_at_stop(parts[0], req.stop)[0]
            reasoning = None if reasoning is None else reasoning.rstrip("\ufffd")
        ended = scoring_only or (seq.stop_reason == "length" and len(tokens) == whole)
        reason = "length" if ended else "stop"
        out.append(Choice(text, reason, entries, len(tokens), stop_string, reasoning, start))
    return out


def _channels_before(
    tok: Any, prompt: list[int], tokens: list[int], raw: str
) -> tuple[str | None, str] | None:
    """The channels (`split_channels`) of a harmony answer up to ``raw``, its text (special
    tokens skipped) before a stop string: of the tokens whose text lies wholly in ``raw``, and
    of the next one the part of its text that does (none if that part is a header's)."""

    def text_of(n: int) -> str:  # (an incomplete last character left out)
        return str(tok.decode(tokens[:n], skip_special_tokens=True)).rstrip("\ufffd")

    lo, hi = 0, len(tokens)  # the most tokens whose text begins ``raw``
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if raw.startswith(text_of(mid)) else (lo, mid - 1)
    rest = raw[len(text_of(lo)) :]
    if rest and (lo == len(tokens) or not text_of(lo + 1).startswith(raw)):
        return None  # (a decoding whose prefixes do not line up: each channel cut alone)
    parts = split_channels(tok, prompt, tokens[:lo])
    more = split_channels(tok, prompt, tokens[: lo + 1]) if rest else None
    if parts is None or more is None:
        return parts
    reasoning, content = parts
    if more[0] is not None and len(more[0]) > len(reasoning or ""):
        return (reasoning or "") + rest, content
    return reasoning, content + rest if len(more[1]) > len(content) else content


def _said(tokens: list[int], seq: types.SampledSequence, eos: frozenset[int]) -> list[int]:
    """The tokens an answer's text is read from: not the EOS token that ended it (vLLM leaves
    it out, with ``skip_special_tokens: false`` too; its log-prob and usage still count)."""
    ended = seq.stop_reason == "stop" and tokens and tokens[-1] in eos
    return tokens[:-1] if ended else tokens


def _decoded(tok: Any, req: OaiRequest, tokens: list[int]) -> str:
    """An answer's text (`decode_answer`)."""
    return decode_answer(tok, tokens, req.skip_special_tokens)


def _prompt_text(tok: Any, req: OaiRequest, tokens: list[int]) -> str:
    """A prompt's text, as `echo` puts it before the answer."""
    return str(tok.decode(tokens, skip_special_tokens=req.skip_special_tokens))


def _through_stop(tok: Any, req: OaiRequest, tokens: list[int], through: str) -> int:
    """How many of ``tokens`` the answer keeps, given that their text begins with ``through``
    (its text and the stop string that ends it): up to the token that completes it. The
    engine stops there itself, except on a special token's text kept by
    ``skip_special_tokens: false`` (special tokens add no bytes to its stop matching), as
    gpt-oss's "<|end|>" or "<|call|>". (A shorter prefix's text may hold a stop string that a
    longer one's does not: U+FFFD for a character's first bytes, which the next complete.)"""
    lo, hi = 1, len(tokens)  # a prefix that begins with `through` only grows into others that do
    while lo < hi:
        mid = (lo + hi) // 2
        if _decoded(tok, req, tokens[:mid]).startswith(through):
            hi = mid
        else:
            lo = mid + 1
    return hi


def _check_fits(srv: TinkerServer, target: _Target, req: OaiRequest, prompts: list[list[int]],
                params: types.SamplingParams) -> None:  # fmt: skip
    """Each prompt fits the model's context, and all of them together this server's
    ``--max-sample-tokens`` (one request, however many prompts it lists)."""
    overflow: Callable[..., str | None] | None = getattr(srv.backend, "sample_overflow", None)
    for ids in prompts if overflow is not None else ():
        assert overflow is not None
        prompt = types.ModelInput.from_ints(ids)
        problem = overflow(target.sampler_id, prompt, params, sdk_hint=False)
        if problem:
            # the field at fault: the prompt where it alone fills the context
            alone = overflow(target.sampler_id, prompt, types.SamplingParams(max_tokens=1))
            prompt_field = "messages" if req.chat else "prompt"
            raise OaiError(problem, prompt_field if alone or not req.max_tokens else "max_tokens")
    limit = getattr(srv.backend, "limits", DEFAULT_LIMITS).max_sample_tokens
    total = sum(req.n * (len(ids) + (params.max_tokens or 0)) for ids in prompts)
    if len(prompts) > 1 and total > limit:
        raise OaiError(
            f"prompt: {len(prompts)} prompts x n {req.n} x (prompt + max_tokens) = {total} "
            f"tokens, above this server's limit of {limit} for one request "
            "(--max-sample-tokens); send fewer prompts per request",
            "prompt",
        )


async def _answer(srv: TinkerServer, request: Request, owner: str, req: OaiRequest) -> Response:
    if req.stream and engine_streams(srv.backend):
        return await live_stream(
            lambda progress: sample_choices(srv, owner, req, progress), req, OaiStream(req)
        )
    choices, prompt_tokens = await unless_gone(request, sample_choices(srv, owner, req))
    if req.stream:
        events = stream_events(req, choices, prompt_tokens)
        return StreamingResponse(iter(events), media_type="text/event-stream")
    return json_reply(completion_body(req, choices, prompt_tokens))


async def sample_choices(
    srv: TinkerServer, owner: str, req: OaiRequest, progress: Progress | None = None
) -> tuple[list[Choice], int]:
    """The answers to ``req`` and its prompt tokens, sampled counted among the caller's
    pending sample requests: above ``max_pending_samples`` (per API key, shared with asample)
    a 429 with ``Retry-After``, which OpenAI and Anthropic clients wait out and retry. ``progress``
    hears each row's tokens as they are sampled (but where the request only scores its
    prompts: ``echo`` and ``max_tokens`` 0)."""
    with srv.futures.pending_sample(owner), srv.answering():
        target = await srv.oai.target(owner, req.model)
        with srv.sessions.serving(target.session_id):  # its session is not quiet meanwhile
            return await _sampled(srv, target, req, progress)


async def _sampled(
    srv: TinkerServer, target: _Target, req: OaiRequest, progress: Progress | None = None
) -> tuple[list[Choice], int]:
    tok, prompts = await _prompt_ids(srv, target, req)
    params = _params(req)
    _check_fits(srv, target, req, prompts, params)
    top = req.logprobs or 0
    with_prompt = req.echo and req.logprobs is not None
    table, eos = await asyncio.to_thread(
        tokenizer_facts, srv.backend, target.base_model, req.logprobs is not None
    )
    prompt_tokens = sum(map(len, prompts))
    extra: dict[str, Any] = {}
    if req.logprobs is not None and sample_takes(srv.backend, "logprobs_mode"):
        extra["logprobs_mode"] = srv.logprobs_mode  # vLLM's two modes (`engine.sampler`)
    reader = None
    if progress is not None and not (req.echo and req.max_tokens == 0):  # not scoring only
        entries = None if req.logprobs is None else partial(_new_entries, tok, req, table)
        split = req.chat and req.skip_special_tokens and opens_message(tok, prompts[0])
        echoes = [_prompt_text(tok, req, ids) for ids in prompts] if req.echo else None
        reader = Reader(
            tok,
            answers=len(prompts) * req.n,
            prompts=len(prompts),
            entries=entries,
            channels=prompts[0] if split else None,
            echoes=None if echoes is None else [e for e in echoes for _ in range(req.n)],
        )

    async def one(p: int, ids: list[int]) -> types.SampleResponse:
        live: dict[str, Any] = {}
        if reader is not None and progress is not None:  # prompt p's rows: choices p*n, ...
            first = p * req.n
            live["progress"] = lambda rows: progress(reader, prompt_tokens, first, rows)
        return await srv.backend.sample(
            target.sampler_id,
            next(target.seq),
            prompt=types.ModelInput.from_ints(ids),
            num_samples=req.n,
            sampling_params=params,
            include_prompt_logprobs=with_prompt,
            topk_prompt_logprobs=top if with_prompt else 0,
            topk_sample_logprobs=top if req.logprobs is not None else 0,
            **extra,
            **live,
        )

    samples = [asyncio.ensure_future(one(p, ids)) for p, ids in enumerate(prompts)]
    try:
        results = await asyncio.gather(*samples)
    except BaseException as e:  # one failed (or the caller left): stop the others' samples
        for sample in samples:
            sample.cancel()
        if not isinstance(e, Exception):
            raise
        status, detail = plain_error(e)  # the engine's checks of the prompt: name the field
        if status != 400 or not detail.startswith("prompt token id"):
            raise
        raise OaiError(detail, "messages" if req.chat else "prompt") from None
    choices = [
        c
        for ids, r in zip(prompts, results, strict=True)
        for c in _choices(tok, req, ids, r, table, eos)
    ]
    return choices, prompt_tokens


async def read_request(
    srv: TinkerServer, request: Request, parse: Callable[[Any], OaiRequest]
) -> OaiRequest:
    """The request's JSON body, checked by ``parse``: not JSON, or nested too deeply to read
    or check, is a 400 (of OpenAI's or Anthropic's API, whichever is asked)."""
    raw = await srv.body(request)
    try:
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise OaiError(f"the request body is not valid JSON: {e}") from None
        return parse(body)
    except RecursionError:  # reading or checking it
        raise OaiError("the request body is nested too deeply to read") from None


async def _serve(srv: TinkerServer, request: Request, owner: str, *, chat: bool) -> Response:
    limits = getattr(srv.backend, "limits", DEFAULT_LIMITS)
    req = await read_request(
        srv, request, lambda body: parse_request(body, chat=chat, max_n=limits.max_num_samples)
    )
    return await _answer(srv, request, owner, req)


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
