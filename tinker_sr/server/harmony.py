"""gpt-oss's harmony answers split into reasoning and content for the chat routes.

A gpt-oss model answers in harmony messages: ``<|channel|>analysis<|message|>...<|end|>`` (its
chain of thought), then ``<|start|>assistant<|channel|>final<|message|>...<|return|>`` (the
answer). Decoded whole without special tokens that reads "analysis...assistantfinal...", the
header words glued to the texts. As vLLM serves gpt-oss, the chat routes give the final (and
any other non-analysis) channel's text as the answer's ``content`` and the analysis channel's
as ``reasoning_content``; the Anthropic route answers with the content. `/completions` and
``skip_special_tokens: false`` keep the raw text.
"""

from __future__ import annotations

from typing import Any

__all__ = ["opens_message", "split_channels"]

_NAMES = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


def opens_message(tok: Any, prompt: list[int]) -> bool:
    """Is a chat answer to ``prompt`` split by channel (`split_channels`): does ``tok`` speak
    harmony and ``prompt`` open a message for it to continue?"""
    return _opens(_harmony_ids(tok), prompt)


def _opens(ids: dict[str, int] | None, prompt: list[int]) -> bool:
    return ids is not None and ids["<|start|>"] in prompt


def _harmony_ids(tok: Any) -> dict[str, int] | None:
    """The ids of harmony's structural tokens in ``tok``, or None if it lacks any (not a
    harmony tokenizer)."""
    ids: dict[str, int] = {}
    try:
        unk = getattr(tok, "unk_token_id", None)
        for name in _NAMES:
            got = tok.convert_tokens_to_ids(name)
            if not isinstance(got, int) or got == unk or got < 0:
                return None
            ids[name] = got
    except Exception:  # a tokenizer without the lookup: not harmony
        return None
    return ids


def _channel(tok: Any, header: list[int]) -> str | None:
    """The channel a message header names (``<|start|>assistant<|channel|>final``), or None;
    "to=" for a message addressed to a recipient (a tool call: ``<|channel|>commentary
    to=functions.add <|constrain|>json``), which is not text of the answer."""
    text = str(tok.decode(header, skip_special_tokens=False))
    if "to=" in text:
        return "to="
    at = text.rfind("<|channel|>")
    if at < 0:
        return None
    rest = text[at + len("<|channel|>") :].split("<|", 1)[0].split()
    return rest[0] if rest else None


def split_channels(
    tok: Any, prompt: list[int], completion: list[int]
) -> tuple[str | None, str] | None:
    """``(reasoning, content)`` of a harmony completion: the analysis channel's text (None if
    the completion has no analysis message) and the other channels' (final, commentary
    preambles), each decoded without special tokens; a message to a recipient (a tool call)
    is neither, as tinker-cookbook's gpt-oss renderer parses it. The message the prompt
    opened (after its last ``<|start|>``: the generation prompt's ``<|start|>assistant``, or a
    prefill's ``...<|channel|>final<|message|>``) is continued. None where this is not
    harmony: the tokenizer lacks its tokens, the prompt opens no message, or the prompt left a
    header open and the completion holds none of harmony's structural tokens (a model that
    does not write harmony: its text is the answer)."""
    ids = _harmony_ids(tok)
    if ids is None or not _opens(ids, prompt):
        return None
    opened = len(prompt) - 1 - prompt[::-1].index(ids["<|start|>"])
    structural = set(ids.values())
    in_header = ids["<|message|>"] not in prompt[opened:]
    if in_header and not any(t in structural for t in completion):
        return None
    seq = prompt[opened:] + completion
    first = len(prompt) - opened  # seq's index of the completion's first token
    ends = {ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]}
    reasoning: list[int] | None = None
    content: list[int] = []
    header: list[int] | None = []  # None: inside a message's text
    channel = None
    for i, t in enumerate(seq):
        if header is not None:
            if t == ids["<|message|>"]:
                channel, header = _channel(tok, header), None
                if channel == "analysis" and i + 1 >= first and reasoning is None:
                    reasoning = []
            else:
                header.append(t)
        elif t in ends:
            header = []
        elif i >= first:
            if channel == "analysis":
                reasoning = [] if reasoning is None else reasoning
                reasoning.append(t)
            elif channel != "to=":
                content.append(t)
    decode = tok.decode
    return (
        None if reasoning is None else str(decode(reasoning, skip_special_tokens=True)),
        str(decode(content, skip_special_tokens=True)),
    )
