"""The Anthropic-compatible inference API's formats (Tinker's ``/anthropic/api``): a Messages
request checked into the `OaiRequest` the OpenAI-compatible routes sample with (one sample, the
chat template of the model), and the answer written back as a Message, its stream events and
Anthropic's error body. The routes are `server.handlers.anthropic`.

Honoured: ``model``, ``max_tokens`` (required), ``messages`` (text content; a last assistant
message is a prefill the answer continues), ``system``, ``stop_sequences``, ``temperature``
(0-1), ``top_p``, ``top_k``, ``stream``; ``metadata``, ``service_tier``, ``thinking:
{"type": "disabled"}`` and ``cache_control`` (prompt caching, on the request or a text block)
change nothing and are accepted, in Anthropic's shapes. Tools, thinking, images, documents,
citations and unknown fields (of the request, a message or a block) are refused with a 400
naming them (never accepted and ignored).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

from tinker_sr.user_errors import clip_message

from .oai_format import (
    Choice,
    OaiError,
    OaiRequest,
    Piece,
    Sent,
    check_stops,
    check_unicode,
    number_field,
    unsent,
)

__all__ = ["parse_messages_request", "message_body", "message_events", "error_reply"]

_FIELDS = {
    "model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p",
    "top_k", "stream", "metadata", "service_tier", "thinking", "tools", "tool_choice",
    "cache_control",
}  # fmt: skip
_COUNT_FIELDS = {"model", "messages", "system", "thinking", "tools", "tool_choice", "cache_control"}
_BLOCK_FIELDS = {"type", "text", "cache_control", "citations"}


def _cache_control(v: Any, where: str) -> None:
    """Prompt caching (``cache_control``) changes no answer, only what a prompt costs: accepted
    and ignored, in Anthropic's shape ``{"type": "ephemeral", "ttl"?: "5m" | "1h"}``."""
    if v is None:
        return
    if not isinstance(v, dict) or v.get("type") != "ephemeral":
        raise OaiError(f"{where} must be {{'type': 'ephemeral'}}, got {v!r}", where)
    extra = sorted(set(v) - {"type", "ttl"})
    if extra:
        raise OaiError(f"{where}.{extra[0]}: Extra inputs are not permitted", f"{where}.{extra[0]}")
    if v.get("ttl") not in (None, "5m", "1h"):
        raise OaiError(f"{where}.ttl must be '5m' or '1h', got {v['ttl']!r}", f"{where}.ttl")


def _text_blocks(content: Any, where: str) -> str:
    """A content of text: a string, or a list of ``{"type": "text", "text": ...}`` blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OaiError(f"{where} must be a string or a list of content blocks", where)
    parts = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise OaiError(
                f"{at}: only text blocks are supported here, got {kind or type(block).__name__!r}"
                " (images, documents, tool use and thinking blocks are not)",
                at,
            )
        if not isinstance(block.get("text"), str):
            raise OaiError(f"{at}.text must be a string", f"{at}.text")
        extra = sorted(set(block) - _BLOCK_FIELDS)
        if extra:
            raise OaiError(f"{at}.{extra[0]}: Extra inputs are not permitted", f"{at}.{extra[0]}")
        _cache_control(block.get("cache_control"), f"{at}.cache_control")
        if block.get("citations"):  # a document's citations: documents are not supported
            raise OaiError(f"{at}.citations: citations are not supported here", f"{at}.citations")
        parts.append(block["text"])
    return "".join(parts)


def _messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The conversation for the chat template (the system prompt first), and the text of a
    last assistant turn (a prefill), or "". Consecutive messages of one role are one turn (as
    Anthropic combines them), their text joined as a message's text blocks are."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise OaiError("messages: a non-empty list of messages is required", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise OaiError(f"{where}.role must be 'user' or 'assistant'", f"{where}.role")
        extra = sorted(set(msg) - {"role", "content"})
        if extra:
            raise OaiError(f"{where}: unexpected field {extra[0]!r}", f"{where}.{extra[0]}")
        text = _text_blocks(msg.get("content"), f"{where}.content")
        if i and raw[i - 1]["role"] == msg["role"]:  # as Anthropic: one turn, its blocks joined
            out[-1]["content"] += text
        else:
            out.append({"role": msg["role"], "content": text})
    prefill = ""
    if out[-1]["role"] == "assistant":
        prefill = out.pop()["content"]
    return out, prefill


def _refuse(body: dict[str, Any], allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise OaiError(f"{key}: Extra inputs are not permitted", key)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise OaiError(f"tools must be a list of tools, got {tools!r}", "tools")
    if tools or body.get("tool_choice") is not None:
        key = "tools" if tools else "tool_choice"
        raise OaiError(f"{key}: tool use is not supported by this server", key)
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise OaiError(
            "thinking: only {'type': 'disabled'} is supported; a model's chat template decides "
            "whether it thinks",
            "thinking",
        )
    _cache_control(body.get("cache_control"), "cache_control")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise OaiError(f"metadata has the wrong type: {metadata!r}", "metadata")
        for key, v in metadata.items():
            if key != "user_id":
                raise OaiError(f"metadata.{key}: Extra inputs are not permitted", f"metadata.{key}")
            if v is not None and not isinstance(v, str):
                raise OaiError(f"metadata.user_id must be a string, got {v!r}", "metadata.user_id")
    tier = body.get("service_tier")
    if tier not in (None, "auto", "standard_only"):
        raise OaiError(
            f"service_tier must be 'auto' or 'standard_only', got {tier!r}", "service_tier"
        )


def _stops(body: dict[str, Any]) -> list[str]:
    v = body.get("stop_sequences")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise OaiError("stop_sequences must be a list of non-empty strings", "stop_sequences")
    return check_stops(v, "stop_sequences")


def parse_messages_request(body: Any, *, count_only: bool = False) -> OaiRequest:
    """A Messages request (or, ``count_only``, a count_tokens one) as the `OaiRequest` to
    sample; every problem an `OaiError` naming the field."""
    if not isinstance(body, dict):
        raise OaiError("the request body must be a JSON object")
    check_unicode(body)
    _refuse(body, _COUNT_FIELDS if count_only else _FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise OaiError("model: a base model or a tinker:// sampler path is required", "model")
    messages, prefill = _messages(body)
    req = OaiRequest(chat=True, model=model.strip(), messages=messages, prefill=prefill)
    if count_only:
        return req
    mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise OaiError(f"max_tokens: a positive integer is required, got {mt!r}", "max_tokens")
    req.max_tokens = mt
    req.temperature = number_field(body, "temperature", 1.0, 0.0, 1.0)
    req.top_p = number_field(body, "top_p", 1.0, 0.0, 1.0)
    if req.top_p == 0.0:
        raise OaiError("top_p must be above 0", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise OaiError(f"top_k must be a positive integer, got {top_k!r}", "top_k")
    req.top_k = top_k or -1
    req.stop = _stops(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OaiError(f"stream must be true or false, got {stream!r}", "stream")
    req.stream = stream
    return req


# ---- answers -------------------------------------------------------------------------------


def _stop(choice: Choice) -> tuple[str, str | None]:
    if choice.stop_string is not None:
        return "stop_sequence", choice.stop_string
    return ("max_tokens" if choice.finish_reason == "length" else "end_turn"), None


def message_body(req: OaiRequest, choice: Choice, prompt_tokens: int) -> dict[str, Any]:
    reason, sequence = _stop(choice)
    return {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": [{"type": "text", "text": choice.text}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": choice.completion_tokens},
    }


def message_events(req: OaiRequest, choice: Choice, prompt_tokens: int) -> Sequence[str]:
    """A whole answer as the Messages stream: message_start, one text block (its text in one
    delta), message_delta with the stop reason and usage, message_stop."""
    stream = MessageStream(req)
    return stream.begin(prompt_tokens) + stream.end([choice], [Sent()], prompt_tokens)


class MessageStream:
    """The Messages stream of an answer as it is sampled (`live_stream.Writer`): message_start
    and the text block's start, a text_delta per piece, then the block's stop, message_delta
    (stop reason, usage) and message_stop."""

    def __init__(self, req: OaiRequest) -> None:
        self.req, self.id = req, "msg_" + secrets.token_hex(12)

    @staticmethod
    def _event(e: dict[str, Any]) -> str:
        return f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"

    def _text(self, text: str) -> str:
        delta = {"type": "text_delta", "text": text}
        return self._event({"type": "content_block_delta", "index": 0, "delta": delta})

    def begin(self, prompt_tokens: int) -> list[str]:
        start: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }  # fmt: skip
        block = {"type": "text", "text": ""}
        return [
            self._event({"type": "message_start", "message": start}),
            self._event({"type": "content_block_start", "index": 0, "content_block": block}),
        ]

    def pieces(self, pieces: Sequence[Piece]) -> str:
        text = "".join(p.text for p in pieces)  # one answer: index 0; its text only
        return self._text(text) if text else ""

    def end(self, choices: Sequence[Choice], sent: Sequence[Sent], prompt_tokens: int) -> list[str]:  # fmt: skip
        choice, more = choices[0], unsent(choices[0].text, sent[0].text)
        reason, sequence = _stop(choice)
        return ([self._text(more)] if more else []) + [
            self._event({"type": "content_block_stop", "index": 0}),
            self._event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": choice.completion_tokens},
                }
            ),
            self._event({"type": "message_stop"}),
        ]

    def error(self, status: int, detail: str) -> str:
        error = {"type": _error_kind(status), "message": clip_message(detail)}
        return self._event({"type": "error", "error": error})

    def whole(self, choices: Sequence[Choice], prompt_tokens: int) -> list[str]:
        return list(message_events(self.req, choices[0], prompt_tokens))


def _error_kind(status: int) -> str:
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_reply(
    status: int, detail: str, headers: dict[str, str] | None = None, param: str | None = None
) -> JSONResponse:
    """An error as Anthropic writes it, ``{"type": "error", "error": {"type", "message"}}``
    (its clients raise ``anthropic.BadRequestError`` & co. with the message)."""
    body = {
        "type": "error",
        "error": {"type": _error_kind(status), "message": clip_message(detail)},
    }
    return JSONResponse(body, status_code=status, headers=headers)
