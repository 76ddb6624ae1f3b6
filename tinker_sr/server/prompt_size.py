"""Prompts too long for a model's context, told from their length in characters before they
are tokenized (the OpenAI- and Anthropic-compatible routes).

Tokenizing is the costly part of such a request: a 10 MB prompt took 28 s and 1.6 GB, a 50 MB
one (under the default ``--max-body-bytes``) 190 s and 8 GB, on the threads every other
request's tokenizing shares, to be refused at the end for not fitting. Where every token
covers at most the characters its vocabulary entry spells (``L`` at most; a byte-level one
spells a byte as one character), a text of more than ``L x context`` characters, as the
tokenizer's normalizer leaves it, is more than ``context`` tokens: it is refused at once, as
its tokenized length would have been.

That holds for the tokenizers checked by `_sound`: BPE whose every character is some token's
(byte-level, byte fallback, or one unknown token per unknown character), pre-tokenizers and
normalizers that drop no character the count relies on, and no added token that swallows the
whitespace beside it. Others (a WordPiece or Unigram model, fused unknown tokens, a
whitespace-splitting pre-tokenizer, a ``Strip`` normalizer, ``lstrip``/``rstrip`` added tokens,
truncation) tokenize as before: a token of theirs can cover more than it spells.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from tinker_sr.tokenization.byte import ByteTokenizer

from .oai_format import OaiError

_LONGEST: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()

# Pieces of a tokenizer.json that keep every character the count relies on.
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "Sequence",
                   "UnicodeScripts"}  # fmt: skip
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Replace", "Prepend", "Sequence",
                "StripAccents"}  # fmt: skip


def _backend(tok: Any) -> Any:
    """The `tokenizers.Tokenizer` behind ``tok`` (transformers' fast tokenizer or
    `tinker_sr.tokenization.hf.FastTokenizer`), else None."""
    return getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tok", None)


def _kinds(node: Any, key: str) -> Iterable[tuple[str, dict[str, Any]]]:
    """Each part of a normalizer / pre-tokenizer spec, its ``Sequence``s' members too."""
    if not isinstance(node, dict):
        return
    yield str(node.get("type")), node
    for child in node.get(key) or ():
        yield from _kinds(child, key)


def _sound(spec: dict[str, Any]) -> bool:
    """Whether no token of this tokenizer.json covers more characters than it spells."""
    model = spec.get("model") or {}
    pre = list(_kinds(spec.get("pre_tokenizer"), "pretokenizers"))
    if model.get("type") != "BPE" or model.get("fuse_unk") or spec.get("truncation"):
        return False
    every_char = (
        model.get("byte_fallback")
        or any(kind == "ByteLevel" for kind, _ in pre)
        or model.get("unk_token") is not None
    )
    keeps = all(kind in _PRE_TOKENIZERS and node.get("behavior") != "Removed" for kind, node in pre)
    norms = all(kind in _NORMALIZERS for kind, _ in _kinds(spec.get("normalizer"), "normalizers"))
    swallow = any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ())
    return bool(every_char) and keeps and norms and not swallow


def longest_token_chars(tok: Any) -> int | None:
    """The most characters one token of ``tok`` spells, where that bounds what a token covers
    (`_sound`); None otherwise, or where the tokenizer cannot list its vocabulary: nothing is
    refused early then."""
    try:
        return _LONGEST[tok]
    except (KeyError, TypeError):
        pass
    longest: int | None = None
    try:
        backend = _backend(tok)
        if isinstance(tok, ByteTokenizer) or (
            backend is not None and _sound(json.loads(backend.to_str()))
        ):
            longest = max((len(t) for t in tok.get_vocab()), default=0) or None
    except Exception:
        longest = None
    try:
        _LONGEST[tok] = longest
    except TypeError:  # not weakly referable: worked out again next time
        pass
    return longest


def _normalized_chars(tok: Any, text: str) -> int:
    """``text``'s length as the tokenizer's model sees it (after its normalizer, which may
    fold characters: NFKC)."""
    normalizer = getattr(_backend(tok), "normalizer", None)
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
        raise OaiError(  # the engine's words for it, which clients match (`context_overflow`)
            f"Prompt length plus max_tokens exceeds the model's context window: more than "
            f"{context} prompt tokens > {context} ({field}: {total:,} characters, and no token "
            f"of this model's tokenizer covers more than {longest}); shorten the prompt",
            field,
        )
