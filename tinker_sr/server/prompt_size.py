"""Prompts too long for a model's context, told from their length in characters before they
are tokenized (the OpenAI- and Anthropic-compatible routes).

Tokenizing is the costly part of such a request: a 10 MB prompt took 28 s and 1.6 GB, a 50 MB
one (under the default ``--max-body-bytes``) 190 s and 8 GB, on the threads every other
request's tokenizing shares, to be refused at the end for not fitting. No token of a
tokenizer spells more than ``L`` characters of its vocabulary (a byte-level one spells a byte
as one character; the added and special tokens count), so a text of more than ``L x context``
characters, as the tokenizer's normalizer leaves it, is more than ``context`` tokens: it is
refused at once, exactly as its tokenized length would have been.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from .oai_format import OaiError

_LONGEST: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token_chars(tok: Any) -> int | None:
    """The most characters one token of ``tok`` spells; None where the tokenizer cannot
    list its vocabulary (nothing is refused early then)."""
    try:
        return _LONGEST[tok]
    except (KeyError, TypeError):
        pass
    try:
        longest = max((len(t) for t in tok.get_vocab()), default=0)
    except Exception:
        return None
    if longest < 1:
        return None
    try:
        _LONGEST[tok] = longest
    except TypeError:  # not weakly referable: computed again next time
        pass
    return longest


def _normalized_chars(tok: Any, text: str) -> int:
    """``text``'s length as the tokenizer's model sees it (after its normalizer, which may
    fold characters: NFKC, a SentencePiece character map)."""
    normalizer = getattr(getattr(tok, "backend_tokenizer", None), "normalizer", None)
    if normalizer is None:
        return len(text)
    return len(normalizer.normalize_str(text))


def string_chars(value: Any) -> int:
    """Characters in every string inside ``value`` (a message list, its content parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(string_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(string_chars(v) for v in value)
    return 0


def refuse_past_context(
    tok: Any,
    context: int | None,
    field: str,
    chars: int,
    texts: Callable[[], Iterable[str]],
) -> None:
    """Refuse (a 400 naming ``field``) a prompt that cannot fit ``context`` tokens: checked
    only when ``chars`` (a cheap count, at least what is tokenized) is past ``L x context``;
    then ``texts()`` gives what would be tokenized (a rendered chat template), measured after
    the normalizer."""
    longest = longest_token_chars(tok) if context else None
    if context is None or longest is None or chars <= longest * context:
        return
    total = sum(_normalized_chars(tok, t) for t in texts())
    if total > longest * context:
        raise OaiError(
            f"{field}: {total:,} characters cannot fit this model's context of {context:,} "
            f"tokens (no token of its tokenizer spells more than {longest} characters, so "
            f"they are more than {context:,} tokens); shorten the prompt",
            field,
        )
