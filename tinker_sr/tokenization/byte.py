"""Byte-level tokenizer of the built-in models, and an equivalent Hugging Face tokenizer dir.

Ids 0..255 are the raw UTF-8 bytes; 256 = <|bos|>, 257 = <|eos|>, 258 = <|pad|>.
`write_hf_tokenizer_dir` writes files that `transformers.AutoTokenizer.from_pretrained`
loads offline and that encode text to the same ids (so the official SDK's
`get_tokenizer()` works against a built-in model).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinker_sr.user_errors import EngineUserError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
# The built-in models (`tinker_sr.engine.model.BUILTIN_CONFIGS`), every one on this tokenizer:
# named here so the clients' get_tokenizer() knows them without importing the engine.
BYTE_TOKENIZER_MODELS = ("tinker-sr/tiny", "tinker-sr/small")
# Where a server writes this tokenizer as a directory for the official SDK (its tokenizer id
# for a built-in model): <store>/tokenizers/byte-level, else a temporary tinker-sr-tokenizers-*.
SERVED_DIR_NAME, SERVED_TEMP_PREFIX = "byte-level", "tinker-sr-tokenizers-"


MARKER = "tinker_sr_tokenizer"  # in the directory's tokenizer_config.json


def is_served_byte_tokenizer(tokenizer_id: str) -> bool:
    """Whether a service's tokenizer id is the byte-level directory a tinker_sr server writes
    (`write_hf_tokenizer_dir`) for its built-in models, wherever that server runs: this
    tokenizer, with no `tokenizers` package and no access to the server's disk needed. Where
    the path is a directory here, only if its config carries the server's mark (a user's own
    tokenizer saved under such a name is theirs)."""
    parts = tokenizer_id.replace("\\", "/").rstrip("/").split("/")
    named = (
        len(parts) >= 2
        and parts[-1] == SERVED_DIR_NAME
        and (parts[-2] == "tokenizers" or parts[-2].startswith(SERVED_TEMP_PREFIX))
    )
    if not named or not os.path.isdir(tokenizer_id):
        return named
    try:
        config = json.loads((Path(tokenizer_id) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get(MARKER) == SERVED_DIR_NAME


_SPECIAL_SPLIT = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")
# Ids in all: the 256 bytes and the special tokens (the built-in models' embedding rows).
TOKENIZER_SIZE = 256 + len(SPECIAL_TOKENS)


class ByteTokenizer:
    """The built-in models' tokenizer, with the Hugging Face interface that the tokenizer
    directory a server reports for them (`write_hf_tokenizer_dir`) has in transformers: the
    same ids, tokens, ``vocab_size`` (256: the base vocabulary, without the special tokens,
    as transformers counts it) and ``len()`` (259)."""

    name_or_path = "tinker-sr/byte"
    vocab_size = 256
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    bos_token, eos_token, pad_token = BOS, EOS, PAD
    all_special_ids = [256, 257, 258]
    all_special_tokens = list(SPECIAL_TOKENS)
    chat_template: str | None = None

    def __len__(self) -> int:
        return TOKENIZER_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes of `text` (a special token written in it is its id), after <|bos|>
        unless ``add_special_tokens=False``.

        The default matches Hugging Face tokenizers (and the tokenizer directory a server
        reports), so a script gets the same ids on every backend."""
        ids: list[int] = []
        for part in _SPECIAL_SPLIT.split(text):  # special tokens in the text are theirs, as in HF
            if part in SPECIAL_TOKENS:
                ids.append(256 + SPECIAL_TOKENS.index(part))
            else:
                ids.extend(part.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = False) -> str:
        """Bytes → text with errors="replace"; special ids print as their names unless skipped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if not 256 <= i < TOKENIZER_SIZE:
                raise EngineUserError(
                    f"token id {i} is outside the byte tokenizer's vocabulary [0, {TOKENIZER_SIZE})"
                )
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not skip_special_tokens:
                out.append(SPECIAL_TOKENS[i - 256])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def batch_decode(self, rows: Sequence[Sequence[int]] | Any, **kw: Any) -> list[str]:
        if hasattr(rows, "tolist"):
            rows = rows.tolist()
        return [self.decode(r, **kw) for r in rows]

    def get_vocab(self) -> dict[str, int]:
        """Token → id, the tokens spelled as transformers spells byte-level ones (a space is
        ``Ġ``), the special tokens included."""
        return dict(_token_ids())

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        tokens = _token_strings()
        if isinstance(ids, int):
            return tokens[ids]
        return [tokens[int(i)] for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """Ids of tokens; None for a string that is no token (as transformers' unk-less
        tokenizers give)."""
        vocab = _token_ids()
        if isinstance(tokens, str):
            return vocab.get(tokens)
        return [vocab.get(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation: Sequence[dict[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        return_dict: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """The built-in models have no chat template (they are not chat models): pass
        ``chat_template=`` to render one, as with transformers (`chat_template.apply`): a
        `ChatEncoding` as transformers 5 returns, or the ids with ``return_dict=False``."""
        from tinker_sr.tokenization.chat_template import apply

        return apply(
            self,
            conversation,
            template=chat_template or self.chat_template,
            missing="the built-in models' tokenizer has no chat template (they are not chat "
            "models); pass chat_template=..., or use a model directory whose tokenizer has one",
            special_tokens={"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
            tokenize=tokenize,
            return_dict=return_dict,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

    def __call__(
        self, text: str | list[str], add_special_tokens: bool = True, **_: Any
    ) -> dict[str, Any]:
        """Minimal HF-like call: {"input_ids": ..., "attention_mask": ...} (lists, no tensors)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        rows = [self.encode(t, add_special_tokens=add_special_tokens) for t in text]
        return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}


@functools.cache
def _token_strings() -> list[str]:
    """Each id's token, as in the tokenizer directory: a byte as its byte-level character."""
    chars = _bytes_to_unicode()
    return [chars[b] for b in range(256)] + list(SPECIAL_TOKENS)


@functools.cache
def _token_ids() -> dict[str, int]:
    """`_token_strings` inverted (shared: callers copy it before handing it out)."""
    return {t: i for i, t in enumerate(_token_strings())}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def write_hf_tokenizer_dir(path: str | os.PathLike[str], *, model_max_length: int = 1024) -> Path:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json for ByteTokenizer.

    tokenizer.json is a byte-level BPE with no merges whose vocabulary maps byte b to id b,
    plus the three special tokens at 256..258 and a post-processor that prepends <|bos|> when
    special tokens are requested. Built with the `tokenizers` library when installed, else
    written as the equivalent JSON by hand.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    specials = [
        {"id": 256 + i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, tok in enumerate(SPECIAL_TOKENS)
    ]  # fmt: skip
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 256)]
        )
        # Not tok.save(path): the Rust library cannot take a path that is not UTF-8 (a
        # non-ASCII store path under LC_ALL=C made every training client a 500).
        (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    except ImportError:
        spec: dict[str, Any] = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": specials,
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": False},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {BOS: {"id": BOS, "ids": [256], "tokens": [BOS]}},
            },
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": []},
        }  # fmt: skip
        (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = {
        MARKER: SERVED_DIR_NAME,  # `is_served_byte_tokenizer` tells it from a user's directory
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in specials
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    smap = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2))
    return out


def foreign_ids_hint(vocab: int) -> str:
    """For an out-of-vocabulary token id: where the model is a built-in (its byte vocabulary),
    the likely cause, ids from another model's tokenizer (a cookbook recipe's, with the
    model's name aliased to a built-in), and the fixes; else nothing."""
    if vocab != TOKENIZER_SIZE:
        return ""
    return (
        f". This model has the built-in models' {TOKENIZER_SIZE}-id byte tokenizer; ids this "
        "large come from another tokenizer (e.g. a Hugging Face model's, when that model's name "
        "is aliased to tinker-sr/tiny): encode with this client's get_tokenizer(), or alias the "
        "name to a local Hugging Face directory that has that tokenizer"
    )
