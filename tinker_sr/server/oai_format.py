"""The OpenAI-compatible inference API's formats (Tinker's ``/oai/api/v1``): requests checked
into an `OaiRequest`, and sampled sequences written back as OpenAI completions, chat
completions, their server-sent-event chunks and OpenAI's error body. No engine here (the
routes are `server.handlers.oai`).

What is honoured and what is refused (never accepted and ignored):

* ``/completions``: ``model``, ``prompt`` (a string, a list of strings, a list of token ids or
  a list of such lists), ``max_tokens`` (default 16, as OpenAI's; 0 with ``echo`` scores the
  prompt), ``temperature``, ``top_p``, ``top_k`` (vLLM's extension), ``n``, ``stop``,
  ``seed``, ``logprobs`` (0-20 alternatives per token), ``echo``, ``stream`` and
  ``stream_options.include_usage``, ``skip_special_tokens`` (default true).
* ``/chat/completions``: the same, with ``messages`` rendered by the model's own chat
  template (``chat_template_kwargs`` passed to it, e.g. ``{"enable_thinking": false}``),
  ``max_completion_tokens`` or ``max_tokens`` (default: the rest of the context, at most
  ``$TINKER_SR_DEFAULT_MAX_TOKENS``), ``logprobs`` + ``top_logprobs``.
* ``user``, ``metadata``, ``store``, ``service_tier`` and ``parallel_tool_calls`` change
  nothing a sample depends on and are accepted. Penalties, ``logit_bias``, ``best_of`` > 1,
  ``suffix``, tools and functions, a ``response_format`` other than text, non-text content
  and anything unknown are refused with a 400 naming the field.
"""

from __future__ import annotations

import codecs
import json
import math
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from tinker_sr.user_errors import clip_message

from .http import HTTPError

__all__ = [
    "OaiError",
    "OaiRequest",
    "Choice",
    "TokenEntry",
    "parse_request",
    "completion_body",
    "stream_events",
    "Chunks",
    "OaiStream",
    "unsent",
    "error_reply",
]

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
    "stream_options", "logprobs", "skip_special_tokens", "user", "metadata", "store",
    "service_tier",
}  # fmt: skip
_COMPLETIONS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
    "parallel_tool_calls", "tools", "tool_choice", "functions", "function_call",
    "response_format",
}  # fmt: skip
_REFUSED = {
    "frequency_penalty": "penalties are not implemented by the tinker_sr engine; remove it",
    "presence_penalty": "penalties are not implemented by the tinker_sr engine; remove it",
    "repetition_penalty": "penalties are not implemented by the tinker_sr engine; remove it",
    "logit_bias": "logit_bias is not implemented by the tinker_sr engine; remove it",
    "suffix": "suffix (fill-in-the-middle) is not supported; put the text in the prompt",
    "tools": "tool calling is not supported here: render tools into the prompt yourself "
    "(e.g. a tinker-cookbook renderer) and send it to /completions",
    "functions": "function calling is not supported; see tools",
    "reasoning_effort": "reasoning_effort is not supported; use chat_template_kwargs, e.g. "
    '{"enable_thinking": false}',
    "modalities": "only text output is supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}
_MAX_TOP_LOGPROBS = 20


class OaiError(HTTPError):
    """A request the API refuses: a message naming the fix, and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(status, message, param=param)


@dataclass
class OaiRequest:
    """A checked request. ``prompts``: the completion prompts (text or token ids); for chat,
    ``messages`` instead. ``logprobs``: alternatives per token, or None for no log-probs."""

    chat: bool
    model: str
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    skip_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    prefill: str = ""  # chat: the start of the answer, after the generation prompt


Offset = tuple[int, bytes]
"""Where the next token begins in an answer's text: the characters before it, and the bytes of
a character that tokens so far have begun and not completed (a token of a byte-level vocabulary
may hold part of one)."""


@dataclass
class TokenEntry:
    """One token's log-prob entry: its decoded text, its log-prob (None for a prompt's first
    token), its bytes (the token's own, which may be part of a UTF-8 character its text cannot
    show) and the most likely alternatives (entries without alternatives)."""

    text: str
    logprob: float | None
    raw: bytes
    top: list[TokenEntry] = field(default_factory=list)
    shown: bytes | None = None  # what it adds to the text, where not `raw` (a skipped special)

    @property
    def width(self) -> bytes:
        """The bytes it adds to the answer's text (`text_offset` counts their characters)."""
        return self.raw if self.shown is None else self.shown


@dataclass
class Choice:
    """One sampled answer, ready to write: its text, why it ended, and per-token log-probs."""

    text: str
    finish_reason: str
    tokens: list[TokenEntry] | None = None
    completion_tokens: int = 0
    stop_string: str | None = None  # the stop string that ended it, if one did
    reasoning: str | None = None  # gpt-oss's analysis channel (`harmony`), chat only
    offset: Offset = (0, b"")  # where its first entry begins (< 0: before the text, `echo`)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def number_field(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise OaiError(f"{key} must be a number, got {v!r}", key)
    if not lo <= v <= hi:
        raise OaiError(f"{key} must be between {lo:g} and {hi:g}, got {v!r}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise OaiError(f"{key} must be an integer, got {v!r}", key)
    if not lo <= v <= hi:
        raise OaiError(f"{key} must be between {lo} and {hi}, got {v!r}", key)
    return int(v)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise OaiError(f"{key} must be true or false, got {v!r}", key)
    return v


def _bad_text(v: Any, where: str) -> str | None:
    """Where in ``v`` (JSON) a string is not valid Unicode (a lone surrogate such as
    ``"\\ud800"``, which JSON can spell but no tokenizer can encode); None if nowhere."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found = _bad_text(x, f"{where}[{i}]")
            if found is not None:
                return found
    elif isinstance(v, dict):
        for k, x in v.items():
            found = _bad_text(k, where)  # a field's name: where it is ("" at the top)
            if found is None:
                found = _bad_text(x, f"{where}.{k}" if where else str(k))
            if found is not None:
                return found
    return None


def check_unicode(body: Any) -> None:
    """Refuse a body with a string that is not valid Unicode, naming where it is."""
    bad = _bad_text(body, "")
    if bad is not None:
        raise OaiError(
            f"{bad or 'the request'}: a string is not valid Unicode (a lone UTF-16 surrogate "
            "escape such as \\ud800); send UTF-8 text",
            bad or None,
        )


_IGNORED_TYPES: dict[str, tuple[type, str]] = {
    "user": (str, "a string"),
    "service_tier": (str, "a string"),
    "metadata": (dict, "an object of strings"),
    "store": (bool, "true or false"),
    "parallel_tool_calls": (bool, "true or false"),
}


def _check_ignored(body: dict[str, Any]) -> None:
    """The fields accepted and ignored still have OpenAI's types."""
    for key, (kind, what) in _IGNORED_TYPES.items():
        v = body.get(key)
        if v is None:
            continue
        ok = isinstance(v, kind)
        if ok and kind is dict:
            ok = all(isinstance(x, str) for x in v.values())
        if not ok:
            raise OaiError(f"{key} must be {what}, got {clip_message(repr(v))}", key)


def _refuse_unsupported(body: dict[str, Any], allowed: set[str]) -> None:
    for key, value in body.items():
        if key in _REFUSED and value not in (None, 0, 0.0, {}, [], ""):
            raise OaiError(f"{key}: {_REFUSED[key]}", key)
        if key in _REFUSED:
            continue
        if key not in allowed:
            raise OaiError(f"unrecognized request argument supplied: {key}", key)
    choice = body.get("tool_choice", body.get("function_call"))
    if choice not in (None, "none"):
        raise OaiError("tool_choice: tool calling is not supported; remove it", "tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise OaiError(
            "response_format: only {'type': 'text'} is supported (no JSON mode or schemas)",
            "response_format",
        )
    best_of = body.get("best_of")
    if best_of is not None and not (_is_int(best_of) and best_of == 1):
        raise OaiError("best_of: only 1 is supported; ask for n samples and choose", "best_of")


def _stop(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise OaiError("stop must be a non-empty string or a list of them", "stop")
    return check_stops(items, "stop")


MAX_STOPS, MAX_STOP_CHARS = 16, 1024


def check_stops(items: list[str], field: str) -> list[str]:
    """At most 16 stop strings (OpenAI's limit) of at most 1,024 characters each: each is
    looked for in the answer at every streamed step."""
    if len(items) > MAX_STOPS:
        raise OaiError(f"{field}: at most {MAX_STOPS} stop strings, got {len(items)}", field)
    for i, item in enumerate(items):
        if len(item) > MAX_STOP_CHARS:
            raise OaiError(
                f"{field}[{i}] is {len(item):,} characters long; a stop string may have at most "
                f"{MAX_STOP_CHARS:,}: end the answer on a shorter string it would begin with",
                field,
            )
    return list(items)


def _prompts(v: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of prompts."""
    bad = OaiError(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids (none of them empty, not mixed)",
        "prompt",
    )
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise bad
    if all(_is_int(t) for t in v):
        return [list(v)]
    if all(isinstance(p, str) and p for p in v):
        return list(v)
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in v):
        return [list(p) for p in v]
    raise bad  # empty, or strings and token lists mixed in one list (OpenAI refuses that too)


def _text_content(content: Any, where: str) -> str | None:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OaiError(
                    f"{where}: only text content is supported, got a {kind!r} part", where
                )
            if not isinstance(part.get("text"), str):
                raise OaiError(f"{where}: a text part needs a string 'text'", where)
            parts.append(part["text"])
        return "".join(parts)
    raise OaiError(f"{where} must be a string or a list of text parts", where)


def _messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise OaiError("messages must be a non-empty list of messages", "messages")
    out = []
    for i, msg in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise OaiError(f"{where} must be an object with 'role' and 'content'", where)
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise OaiError(
                f"{where}.role must be system, developer, user, assistant or tool, got {role!r}",
                f"{where}.role",
            )
        if msg.get("tool_calls") or msg.get("function_call"):
            raise OaiError(f"{where}: tool calls are not supported", where)
        out.append({**msg, "content": _text_content(msg.get("content"), f"{where}.content")})
    return out


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:
        return _int(body, "logprobs", None, 0, _MAX_TOP_LOGPROBS)
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, _MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise OaiError("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    limit = 1 << 20
    if not chat:
        return _int(body, "max_tokens", 16, 0, limit)
    mt = _int(body, "max_tokens", None, 1, limit)
    mct = _int(body, "max_completion_tokens", None, 1, limit)
    if mt is not None and mct is not None and mt != mct:
        raise OaiError(
            "max_tokens and max_completion_tokens differ; send one", "max_completion_tokens"
        )
    return mct if mct is not None else mt


def parse_request(body: Any, *, chat: bool, max_n: int) -> OaiRequest:
    """Check a request body (parsed JSON) of ``/chat/completions`` (``chat``) or
    ``/completions``; every problem is an `OaiError` naming the field."""
    if not isinstance(body, dict):
        raise OaiError("the request body must be a JSON object")
    check_unicode(body)
    _refuse_unsupported(body, _CHAT if chat else _COMPLETIONS)
    _check_ignored(body)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise OaiError("model is required: a base model or a tinker:// sampler path", "model")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise OaiError("stream_options is only allowed with stream: true", "stream_options")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise OaiError("chat_template_kwargs must be an object", "chat_template_kwargs")
    req = OaiRequest(
        chat=chat,
        model=model.strip(),
        max_tokens=_max_tokens(body, chat),
        temperature=number_field(body, "temperature", 1.0, 0.0, 100.0),
        top_p=number_field(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_int(body, "top_k", -1, -1, 1 << 31) or -1,
        n=_int(body, "n", 1, 1, max_n) or 1,
        stop=_stop(body),
        seed=_int(body, "seed", None, -(1 << 63), (1 << 64) - 1),
        logprobs=_logprobs(body, chat),
        echo=_bool(body, "echo", False),
        stream=stream,
        include_usage=bool(options and _bool(options, "include_usage", False)),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        chat_template_kwargs=dict(kwargs),
    )
    if req.top_p == 0.0:
        raise OaiError("top_p must be above 0", "top_p")
    if chat:
        req.messages = _messages(body.get("messages"))
    else:
        req.prompts = _prompts(body.get("prompt"))
        if req.max_tokens == 0 and not req.echo:
            raise OaiError("max_tokens: 0 needs echo: true (to score the prompt)", "max_tokens")
    return req


# ---- responses -------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """The text before the first stop string in it (OpenAI leaves stop strings out), and that
    stop string (None if none occurs)."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return text, None
    at, stop = min(found, key=lambda f: (f[0], len(f[1])))  # the one that ends first
    return text[:at], stop


def _utf8_reader(at: Offset) -> Any:
    reader = codecs.getincrementaldecoder("utf-8")("replace")
    reader.setstate((at[1], 0))
    return reader


def token_offsets(at: Offset, raws: Iterable[bytes]) -> tuple[list[int], Offset]:
    """Where each of the tokens whose bytes are ``raws`` begins, in characters of the text,
    counting from ``at``; and ``at`` moved past them all."""
    starts, chars, reader = [], at[0], _utf8_reader(at)
    for raw in raws:
        starts.append(chars)
        chars += len(reader.decode(raw))
    return starts, (chars, reader.getstate()[0])


def advance(at: Offset, raws: Iterable[bytes]) -> Offset:
    """``at`` moved past tokens whose bytes are ``raws``."""
    return token_offsets(at, raws)[1]


def _completion_logprobs(tokens: Sequence[TokenEntry], start: Offset = (0, b"")) -> dict[str, Any]:
    """`/completions`' log-probs; ``text_offset`` counts characters of the answer's text (not of
    the tokens' displayed strings: "bytes:\\xe2" is one third of a character)."""
    starts = token_offsets(start, (t.width for t in tokens))[0]
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [({a.text: a.logprob for a in t.top} if t.logprob is not None else None)
                         for t in tokens],
        "text_offset": [max(c, 0) for c in starts],
    }  # fmt: skip


def _chat_logprobs(tokens: Sequence[TokenEntry]) -> dict[str, Any]:
    def entry(t: TokenEntry) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.raw)}

    content = [{**entry(t), "top_logprobs": [entry(a) for a in t.top]} for t in tokens]
    return {"content": content, "refusal": None}


def logprobs_body(req: OaiRequest, tokens: Sequence[TokenEntry], start: Offset = (0, b"")) -> Any:
    """The ``logprobs`` of an answer (or a piece of one) whose tokens' entries are ``tokens``,
    the first at ``start`` characters into the answer's text (`/completions`' offsets); None
    where the request did not ask for log-probs."""
    if req.logprobs is None:
        return None
    return _chat_logprobs(tokens) if req.chat else _completion_logprobs(tokens, start)


def _choice_body(req: OaiRequest, index: int, choice: Choice) -> dict[str, Any]:
    lp = logprobs_body(req, choice.tokens or [], choice.offset)
    if req.chat:
        message = {"role": "assistant", "content": choice.text, "refusal": None}
        if choice.reasoning is not None:
            message["reasoning_content"] = choice.reasoning
        return {"index": index, "message": message, "logprobs": lp,
                "finish_reason": choice.finish_reason}  # fmt: skip
    return {"index": index, "text": choice.text, "logprobs": lp,
            "finish_reason": choice.finish_reason}  # fmt: skip


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def completion_body(
    req: OaiRequest, choices: Sequence[Choice], prompt_tokens: int
) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    return {
        "id": new_id(req.chat),
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [_choice_body(req, i, c) for i, c in enumerate(choices)],
        "usage": usage(prompt_tokens, choices),
        "system_fingerprint": None,
    }


class Chunks:
    """One streamed answer's server-sent events: each a chunk of one id, ``created`` and
    model (``usage: null`` in each where the request asked for usage at the end)."""

    def __init__(self, req: OaiRequest) -> None:
        self.req = req
        self.head = {
            "id": new_id(req.chat),
            "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "system_fingerprint": None,
        }

    def event(self, choice_list: list[dict[str, Any]], **more: Any) -> str:
        extra = {"usage": None} if self.req.include_usage else {}
        return (
            "data: " + json.dumps({**self.head, "choices": choice_list, **extra, **more}) + "\n\n"
        )

    def role(self, index: int) -> str:
        """A chat answer's first chunk: the assistant's role, no content yet."""
        return self.event([{"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}])  # fmt: skip

    def text(self, index: int, text: str, logprobs: Any = None, key: str = "content") -> str:
        """A piece of answer ``index``'s text (chat: its ``delta``'s ``key``)."""
        return self.event([self._piece(index, text, logprobs, key)])

    def _piece(self, index: int, text: str, logprobs: Any = None, key: str = "content") -> dict[str, Any]:  # fmt: skip
        if self.req.chat:
            piece = {"index": index, "delta": {key: text}, "logprobs": logprobs}
        else:
            piece = {"index": index, "text": text, "logprobs": logprobs}
        return {**piece, "finish_reason": None}

    def finish(self, index: int, reason: str) -> str:
        piece: dict[str, Any] = {"delta": {}} if self.req.chat else {"text": ""}
        return self.event([{"index": index, **piece, "logprobs": None, "finish_reason": reason}])

    def closing(self, choices: Sequence[Choice], prompt_tokens: int) -> list[str]:
        """A usage chunk if asked for, then ``[DONE]``."""
        out = (
            [self.event([], usage=usage(prompt_tokens, choices))] if self.req.include_usage else []
        )
        return out + ["data: [DONE]\n\n"]


def unsent(text: str, sent: str) -> str:
    """What ``text`` adds to the part of it streamed so far (``sent``), where it extends it."""
    return text[len(sent) :] if text.startswith(sent) else ""


@dataclass
class Sent:
    """What a stream has sent of one answer: its text, its tokens' log-prob entries, and its
    reasoning (gpt-oss's analysis channel)."""

    text: str = ""
    tokens: list[TokenEntry] = field(default_factory=list)
    reasoning: str = ""
    _at: Offset = field(default=(0, b""), repr=False)
    _counted: int = field(default=0, repr=False)  # of `tokens`, in `_at`

    @property
    def offset(self) -> Offset:
        """Where the next entry's token begins in the answer's text (`/completions`)."""
        if self._counted < len(self.tokens):
            self._at = advance(self._at, (t.width for t in self.tokens[self._counted :]))
            self._counted = len(self.tokens)
        return self._at


@dataclass
class Piece:
    """What one event adds to answer ``index``: more text, more tokens' entries, and more
    reasoning (gpt-oss's analysis channel, which comes before the text)."""

    index: int
    text: str
    tokens: list[TokenEntry]
    offset: Offset = (0, b"")  # the first entry's place in the answer's text
    reasoning: str = ""


class OaiStream(Chunks):
    """A streamed answer's events as it is sampled (`live_stream.Writer`)."""

    def begin(self, prompt_tokens: int) -> list[str]:
        return [self.role(i) for i in range(self.req.n)] if self.req.chat else []

    def pieces(self, pieces: Sequence[Piece]) -> str:
        out = []
        for p in pieces:
            lp = logprobs_body(self.req, p.tokens, p.offset)
            if not p.reasoning:
                out.append(self._piece(p.index, p.text, lp))
                continue
            piece = self._piece(p.index, p.reasoning, lp, "reasoning_content")
            if p.text:
                piece["delta"]["content"] = p.text
            out.append(piece)
        return self.event(out)

    def end(self, choices: Sequence[Choice], sent: Sequence[Sent], prompt_tokens: int) -> list[str]:  # fmt: skip
        out = []
        for i, (c, done) in enumerate(zip(choices, sent, strict=True)):
            if thought := unsent(c.reasoning or "", done.reasoning):
                out.append(self.text(i, thought, key="reasoning_content"))
            more, rest = unsent(c.text, done.text), (c.tokens or [])[len(done.tokens) :]
            if more or (rest and self.req.logprobs is not None):
                start = done.offset if done.tokens else c.offset
                out.append(self.text(i, more, logprobs_body(self.req, rest, start)))
            out.append(self.finish(i, c.finish_reason))
        return out + self.closing(choices, prompt_tokens)

    def error(self, status: int, detail: str) -> str:
        return self.event([], error={"message": detail, "code": status})

    def whole(self, choices: Sequence[Choice], prompt_tokens: int) -> list[str]:
        return stream_events(self.req, choices, prompt_tokens)


def stream_events(req: OaiRequest, choices: Sequence[Choice], prompt_tokens: int) -> list[str]:
    """A whole answer as server-sent events: per choice, its text in one chunk, then its
    finish reason; a usage chunk if asked for; then ``[DONE]``."""
    chunks, out = Chunks(req), []
    for i, c in enumerate(choices):
        lp = _choice_body(req, i, c)["logprobs"]
        if req.chat:
            out.append(chunks.role(i))
            if c.reasoning is not None:
                out.append(chunks.text(i, c.reasoning, key="reasoning_content"))
        out += [chunks.text(i, c.text, lp), chunks.finish(i, c.finish_reason)]
    return out + chunks.closing(choices, prompt_tokens)


def error_reply(
    status: int, detail: str, headers: dict[str, str] | None = None, param: str | None = None
) -> JSONResponse:
    """An error as OpenAI writes it, ``{"error": {"message", "type", "param", "code"}}`` (its
    clients raise ``openai.BadRequestError`` & co. with ``error.message``)."""
    kind = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"message": clip_message(detail), "type": kind, "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=status, headers=headers)
