"""A model's own tokenizer: what the engine needs of it, and the object `get_tokenizer()` returns.

The engine needs only two things, and reads both from the directory's JSON files (no library):
- the EOS ids (`tinker_sr.hf_files.eos_token_ids` plus the tokenizer's ``eos_token``);
- the bytes each token id decodes to (`token_bytes_table`), for incremental stop strings.

`ModelTokenizer.hf` is the Hugging Face interface (encode/decode/apply_chat_template/...):
``transformers.AutoTokenizer`` when `transformers` is installed, else `FastTokenizer`, a small
wrapper over the `tokenizers` library that reads tokenizer_config.json (special tokens, chat
template rendered with `jinja2`). Loading is lazy, so sampling never imports either.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinker_sr.hf_files import (
    MAX_JSON_BYTES,
    eos_token_ids,
    installed_version,
    model_config,
    present,
    read_json,
    version_below,
)
from tinker_sr.tokenization.byte import ByteTokenizer, _bytes_to_unicode
from tinker_sr.tokenization.chat_template import apply
from tinker_sr.user_errors import EngineUserError, clip_message

_SP_SPACE = "\u2581"  # SentencePiece's "▁"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclasses.dataclass(frozen=True)
class ByteFallback:
    """What streaming and log-probs need to know of a byte-fallback vocabulary (Llama 2,
    Mistral, Gemma: "<0xNN>" pieces). Its decoder turns a run of byte pieces into the run's
    UTF-8 text, or where the run is not valid UTF-8 into one U+FFFD a byte, so a later piece
    of a run can change the text of the earlier ones, valid characters included
    (`live_stream.settled_text`); special tokens left out of a text, and ids that are no
    token's, join the runs on both sides. Llama 2's and Mistral's decoder also strips a
    text's first space (`decode_answer`)."""

    pieces: frozenset[int]  # the "<0xNN>" pieces' ids
    specials: frozenset[int]  # special tokens' ids (`skip_special_tokens` leaves them out)
    anchor: tuple[int, str] | None  # a one-letter piece and its text, or None
    size: int  # ids from here on are no token's (a model's padded rows): decoding drops them


_BYTE_FALLBACK: weakref.WeakKeyDictionary[Any, ByteFallback | None] = weakref.WeakKeyDictionary()


def byte_fallback(tok: Any) -> ByteFallback | None:
    """``tok``'s `ByteFallback` facts, or None for a vocabulary without byte pieces (a
    byte-level one: Qwen, Llama 3, GPT-2). Kept while ``tok`` lives."""
    try:
        return _BYTE_FALLBACK[tok]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: worked out each time
        return _byte_fallback(tok)
    found = _BYTE_FALLBACK[tok] = _byte_fallback(tok)
    return found


def _byte_fallback(tok: Any) -> ByteFallback | None:
    vocab: dict[str, int] = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    pieces = frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.match(piece))
    if not pieces:
        return None
    specials = set(getattr(tok, "all_special_ids", None) or ())
    added = getattr(tok, "added_tokens_decoder", None) or {}
    specials.update(i for i, t in added.items() if getattr(t, "special", False))
    anchor = next(
        (
            (i, letter)
            for letter in "abcdefghijklmnopqrstuvwxyz"
            if (i := vocab.get(letter)) is not None
            and str(tok.decode([i], skip_special_tokens=True)) == letter
        ),
        None,
    )
    return ByteFallback(pieces, frozenset(specials), anchor, max(vocab.values()) + 1)


def decode_answer(tok: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    """The text a sampled answer adds after its prompt, as vLLM writes it. The decoder of a
    Llama 2 or Mistral vocabulary strips a text's first space, so an answer decoded alone lost
    the space of its first piece ("▁world": "world"), which its tokens' bytes, the engine's
    stop strings and its log-prob strings keep; decoded after a letter, it keeps it."""
    facts = byte_fallback(tok) if ids else None
    if facts is not None and facts.anchor is not None:
        i, lead = facts.anchor
        text = str(tok.decode([i, *ids], skip_special_tokens=skip_special_tokens))
        if text.startswith(lead):
            return text[len(lead) :]
    return str(tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _decoders(spec: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """A tokenizer.json decoder's parts by type (Sequence decoders flattened; the first of each
    type), with the Replace of "▁" by a space also under "SentencePieceSpace"."""
    if not spec:
        return {}
    if spec.get("type") == "Sequence":
        found: dict[str, dict[str, Any]] = {}
        for part in spec.get("decoders", []):
            found = _decoders(part) | found
        return found
    kinds = {str(spec.get("type")): spec}
    if spec.get("type") == "Replace" and (spec.get("pattern") or {}).get("String") == _SP_SPACE:
        kinds["SentencePieceSpace"] = spec
    return kinds


def token_bytes_table(spec: dict[str, Any], vocab_size: int) -> list[bytes]:
    """`table[id]` = the UTF-8 bytes token `id` contributes to decoded text (b"" for special
    tokens and ids the tokenizer does not define, e.g. padded embedding rows).

    Byte-level BPE (GPT-2, Llama 3, Qwen): each character of a token maps back to one byte.
    SentencePiece-style (Llama 2, Mistral): "▁" is a space and "<0xNN>" is byte NN. WordPiece
    (BERT-style): a "##" continuation joins the word before it, any other token starts a word
    after a space. BPE with an end-of-word suffix ("</w>"): the suffix is a space. Other
    decoders: the `tokenizers` library decodes each id alone.
    """
    table = [b""] * vocab_size
    vocab: dict[str, int] = (spec.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram models store [piece, score] pairs
        vocab = {piece: i for i, (piece, _score) in enumerate(vocab)}
    kinds = _decoders(spec.get("decoder"))
    if "ByteLevel" in kinds:
        back = {c: b for b, c in _bytes_to_unicode().items()}
        for tok, i in vocab.items():
            if 0 <= i < vocab_size:
                table[i] = bytes(back[c] for c in tok if c in back)
    elif kinds.keys() & {"Metaspace", "SentencePieceSpace", "ByteFallback"}:
        for tok, i in vocab.items():
            if 0 <= i < vocab_size:
                m = _BYTE_PIECE.match(tok)
                table[i] = (
                    bytes([int(m.group(1), 16)]) if m else tok.replace(_SP_SPACE, " ").encode()
                )
    elif "WordPiece" in kinds:
        table = _wordpiece_table(vocab, kinds["WordPiece"], vocab_size)
    elif "BPEDecoder" in kinds:
        suffix = str(kinds["BPEDecoder"].get("suffix", "</w>"))
        for tok, i in vocab.items():
            if 0 <= i < vocab_size:
                table[i] = tok.replace(suffix, " ").encode()
    else:
        table = _decode_each(spec, vocab_size)
    for added in spec.get("added_tokens") or []:
        i = _token_id(added["id"])
        if 0 <= i < vocab_size:
            table[i] = b"" if added.get("special") else str(added["content"]).encode()
    return table


# What the WordPiece decoder's ``cleanup`` joins to the word before it (no space).
_WORDPIECE_JOINED = frozenset({".", "?", "!", ",", "n't", "'m", "'s", "'ve", "'re"})


def _wordpiece_table(
    vocab: dict[str, int], decoder: dict[str, Any], vocab_size: int
) -> list[bytes]:
    """Each WordPiece token's bytes as the decoder joins them in a text: a continuation
    ("##ing") without its prefix, joined to the word before; any other token after a space
    (decoded alone, a continuation kept its "##" and a word lost its space, so a stop string
    spanning two tokens never matched)."""
    prefix = str(decoder.get("prefix", "##"))
    cleanup = bool(decoder.get("cleanup", True))
    table = [b""] * vocab_size
    for tok, i in vocab.items():
        if not 0 <= i < vocab_size:
            continue
        if tok.startswith(prefix):
            table[i] = tok[len(prefix) :].encode()
        elif cleanup and tok in _WORDPIECE_JOINED:
            table[i] = tok.encode()
        else:
            table[i] = f" {tok}".encode()
    return table


def _decode_each(spec: dict[str, Any], vocab_size: int) -> list[bytes]:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise EngineUserError(
            "stop strings with this tokenizer's decoder need the `tokenizers` package; "
            "pip install tokenizers"
        ) from e
    tok = Tokenizer.from_str(json.dumps(spec))
    n = min(vocab_size, tok.get_vocab_size(with_added_tokens=True))
    return [tok.decode([i], skip_special_tokens=True).encode() for i in range(n)] + [b""] * (
        vocab_size - n
    )


def byte_token_table() -> list[bytes]:
    """The built-in byte tokenizer: ids 0..255 are bytes; specials decode to nothing."""
    return [bytes([i]) for i in range(256)] + [b""] * (ByteTokenizer.vocab_size - 256)


def _special_token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_id(value: Any) -> int:
    """An added token's id as the `tokenizers` library reads it (an unsigned 32-bit integer:
    not a float, a string or a bool), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"an added token's id is {value!r}, not an integer in [0, 2**32)")
    return value


def _special_token_ids(spec: dict[str, Any] | None, config: dict[str, Any]) -> dict[str, int]:
    """Added-token ids by content, from tokenizer.json (``spec``) or tokenizer_config.json."""
    if spec is not None:
        added = spec.get("added_tokens") or []
        return {str(t["content"]): _token_id(t["id"]) for t in added}
    decoder = config.get("added_tokens_decoder") or {}
    return {str(t.get("content")): int(i) for i, t in decoder.items() if isinstance(t, dict)}


def _vocab_id(spec: dict[str, Any] | None, token: str) -> int | None:
    """``token``'s id as an ordinary piece of tokenizer.json's (``spec``'s) model vocabulary
    (a special token may be one, e.g. ``</s>`` in a SentencePiece vocabulary), else None."""
    if spec is None:
        return None
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece: piece -> id
        found = vocab.get(token)
        return found if isinstance(found, int) and not isinstance(found, bool) else None
    if isinstance(vocab, list):  # Unigram: [piece, score] at its id
        for i, entry in enumerate(vocab):
            if isinstance(entry, list) and entry and entry[0] == token:
                return i
    return None


def _named_specials(root: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The BOS, EOS and pad tokens as transformers reads them: tokenizer_config.json's, but
    in an older directory (no ``added_tokens_decoder`` there) special_tokens_map.json's values
    win. The values as written (a string or an added token's dict)."""
    found = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token")}
    special_map = root / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and present(special_map):
        named = read_json(special_map)
        found |= {k: named[k] for k in found if k in named}  # the map wins
    return found


class ModelTokenizer:
    """The tokenizer of one model directory (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # The model's embedding rows; may exceed the tokenizer's length (padded vocabularies).
        vocab = model_config(root).get("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise EngineUserError(
                f"{root}/config.json: vocab_size={vocab!r} must be a positive integer; fix it"
            )
        self.vocab_size = vocab
        self.tokenizer_id: str | None = str(root)
        cfg_file = root / "tokenizer_config.json"
        config = read_json(cfg_file) if present(cfg_file) else {}
        eos = _special_token_content(_named_specials(root, config)["eos_token"])
        spec_file = root / "tokenizer.json"
        spec = read_json(spec_file) if present(spec_file) else None  # read once: may be 10 MB
        try:
            ids = _special_token_ids(spec, config)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EngineUserError(
                f"{root}: the added tokens of tokenizer.json / tokenizer_config.json are "
                f"malformed ({type(e).__name__}: {e}); re-save the tokenizer with transformers"
            ) from e
        eos_id = (ids.get(eos) if eos in ids else _vocab_id(spec, eos)) if eos else None
        self.eos_token_ids = self._eos_ids(eos, eos_id)

    def _eos_ids(self, eos: str | None, tokenizer_eos: int | None) -> tuple[int, ...]:
        """config.json's and generation_config.json's EOS ids, then the tokenizer's, all inside
        the vocabulary; a tokenizer EOS past it beside declared ones is dropped with a warning
        (no row can sample it; transformers' generate never reads it). Possibly none: such a
        model trains, and samples with stops of the request's own."""
        root, vocab = self.root, self.vocab_size
        declared = eos_token_ids(root)
        outside = [i for i in declared if not 0 <= i < vocab]
        if outside:
            raise EngineUserError(
                f"{root}: EOS token ids {outside} (config.json / generation_config.json "
                f"eos_token_id) are outside the model's vocabulary [0, {vocab}); fix "
                "eos_token_id there"
            )
        if tokenizer_eos is not None and not 0 <= tokenizer_eos < vocab:
            where = (
                f"{root}: the tokenizer's eos_token {eos!r} is id {tokenizer_eos}, "
                f"outside the model's vocabulary [0, {vocab})"
            )
            if not declared:
                raise EngineUserError(
                    f"{where}, and config.json / generation_config.json declare no "
                    "eos_token_id; set eos_token_id in config.json"
                )
            warnings.warn(f"{where}; sampling stops at {list(declared)} only", stacklevel=3)
            tokenizer_eos = None
        extra = () if tokenizer_eos is None or tokenizer_eos in declared else (tokenizer_eos,)
        return (*declared, *extra)  # none at all: sampling refuses to rely on one (sampling.py)

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """Needed only for string stops, so a directory without tokenizer.json still samples."""
        if not present(self.root / "tokenizer.json"):
            raise EngineUserError(
                f"{self.root}: stop strings need the model's tokenizer.json (a fast tokenizer; "
                "transformers writes it with tokenizer.save_pretrained); use token-id stops"
            )
        spec = read_json(self.root / "tokenizer.json")
        try:
            return token_bytes_table(spec, self.vocab_size)
        except EngineUserError:
            raise
        except Exception as e:  # the `tokenizers` library raises plain Exception
            raise EngineUserError(
                f"{self.root}/tokenizer.json: cannot be read as a tokenizer "
                f"({type(e).__name__}: {e}); re-save it with transformers' "
                "tokenizer.save_pretrained, or use token-id stops"
            ) from e

    @functools.cached_property
    def hf(self) -> Any:
        return load_hf_tokenizer(self.root)


class ByteModelTokenizer:
    """The built-in models' tokenizer in the `ModelTokenizer` shape."""

    tokenizer_id: str | None = None
    eos_token_ids: tuple[int, ...] = (ByteTokenizer.eos_token_id,)
    vocab_size = ByteTokenizer.vocab_size

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        return byte_token_table()

    @functools.cached_property
    def hf(self) -> ByteTokenizer:
        return ByteTokenizer()


def load_hf_tokenizer(root: Path) -> Any:
    """``AutoTokenizer.from_pretrained(root)`` offline if transformers is installed, else a
    `FastTokenizer`; raises naming the missing package when neither library is there, and
    `EngineUserError` naming the directory and its tokenizer files when they do not load
    (transformers' own errors say neither)."""
    try:
        for name in sorted(TOKENIZER_FILE_NAMES | {"config.json"}):  # what transformers reads
            present(root / name, MAX_JSON_BYTES if name.endswith(".json") else None)
        tok = _load_tokenizer(root)
        # transformers 5 builds some tokenizers (Qwen2's, GPT-2's) from no files at all: an
        # empty vocabulary that encodes every text to [] where it should fail.
        if not set(tok.get_vocab().values()) - set(getattr(tok, "all_special_ids", None) or []):
            raise ValueError("it loaded with no tokens but special ones (no vocabulary file)")
        return tok
    except EngineUserError:
        raise
    except Exception as e:
        found = sorted(p.name for p in root.iterdir() if p.name in TOKENIZER_FILE_NAMES)
        if "trust_remote_code" in str(e):
            raise EngineUserError(
                f"{root}: its tokenizer does not load: tokenizer_config.json's auto_map names "
                "a tokenizer class in Python code, which tinker_sr does not run, and there is "
                f"no tokenizer.json to read instead (tokenizer files there: {found or 'none'}"
                "); add the tokenizer's tokenizer.json (its class's save_pretrained writes it "
                "where that code can run, or copy it from the model's release)"
            ) from e
        if (config_problem := _config_problem(root)) is not None:
            advice = (
                f"transformers does not load its config.json either ({config_problem}), and "
                "AutoTokenizer reads it: fix config.json (the tokenizer files may be sound)"
            )
        # `tokenizers` raises a bare Exception ("data did not match any variant of untagged
        # enum ModelWrapper at line 550 column 3") for a file it cannot read.
        elif "tokenizer.json" in found and type(e) is Exception:
            advice = (
                f"If tokenizer.json is sound, it may be newer than the installed tokenizers "
                f"{installed_version('tokenizers') or '(not installed)'} / transformers "
                f"{installed_version('transformers') or '(not installed)'} read: "
                "pip install -U tokenizers transformers"
            )
        else:
            advice = (
                "A model directory needs tokenizer.json (a fast tokenizer), or the slow "
                "tokenizer's files (tokenizer.model, or vocab.json and merges.txt) beside "
                "tokenizer_config.json: copy them from the model's release, or write them "
                "with transformers' tokenizer.save_pretrained()"
            )
        raise EngineUserError(
            f"{root}: its tokenizer does not load ({type(e).__name__}: "
            f"{clip_message(' '.join(str(e).split()), 600)}). Tokenizer files "
            f"there: {found or 'none'}. {advice}"
        ) from e


def _config_problem(root: Path) -> str | None:
    """Why transformers' AutoConfig does not load the directory's config.json (AutoTokenizer
    loads it to find the tokenizer's class), or None: it loads, or there is none to load."""
    if not present(root / "config.json"):
        return None
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - whatever transformers raises for the file
        return f"{type(e).__name__}: {clip_message(' '.join(str(e).split()), 300)}"
    return None


# transformers' ValueErrors for a tokenizer class it will not build: one in the directory's own
# code, or one this transformers lacks (transformers 5 saves "TokenizersBackend", unknown to 4.x).
_CLASS_UNAVAILABLE = ("trust_remote_code", "does not exist or is not currently imported")


def _load_tokenizer(root: Path) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return FastTokenizer(root)
    try:  # never transformers' interactive prompt, never the directory's own code
        tok = AutoTokenizer.from_pretrained(
            str(root), local_files_only=True, trust_remote_code=False
        )
    except ValueError as e:
        if not any(m in str(e) for m in _CLASS_UNAVAILABLE):
            raise
        if not present(root / "tokenizer.json"):
            raise
        return FastTokenizer(root)  # its tokenizer.json describes it: no class needed
    jinja = root / "chat_template.jinja"  # transformers reads it (and lets it win) from 4.47
    if present(jinja) and version_below("transformers", (4, 47)):
        tok.chat_template = jinja.read_text(encoding="utf-8")
    return tok


# Files that hold a tokenizer's vocabulary: a directory without any has no tokenizer (however
# many configs, special-token maps or templates it holds: transformers 5 builds an empty one).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def has_vocabulary(root: str | Path) -> bool:
    return any(present(Path(root) / name) for name in VOCABULARY_FILES)


# The files a Hugging Face tokenizer may be read from (named in load errors).
TOKENIZER_FILE_NAMES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.txt",
})  # fmt: skip


def _named_templates(template: Any) -> dict[str, str]:
    """The named chat templates of a list (``[{"name": "default", "template": ...},
    {"name": "tool_use", ...}]``, as transformers 4 saved them) by name; {} for a string."""
    listed = template if isinstance(template, list) else []
    return {
        t["name"]: t["template"]
        for t in listed
        if isinstance(t, dict) and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
    }  # fmt: skip


def _default_template(template: Any) -> str | None:
    """A chat template: the string, or from a list of named ones the default."""
    if isinstance(template, list):
        return _named_templates(template).get("default")
    return template if isinstance(template, str) else None


class FastTokenizer:
    """The commonly used part of a Hugging Face fast tokenizer, over the `tokenizers` library:
    encode / decode / __call__ / special tokens / convert_* / apply_chat_template."""

    def __init__(self, root: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise EngineUserError(
                f"loading the tokenizer of {root} needs `tokenizers` (or `transformers`); "
                "pip install tokenizers"
            ) from e
        self.name_or_path = str(root)
        self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        cfg_file = root / "tokenizer_config.json"
        cfg = read_json(cfg_file) if present(cfg_file) else {}
        jinja = root / "chat_template.jinja"  # as transformers: the file wins over the config
        self.chat_template: str | None = (
            jinja.read_text(encoding="utf-8")
            if present(jinja)
            else _default_template(cfg.get("chat_template"))
        )
        self._named_templates = _named_templates(cfg.get("chat_template"))
        found = _named_specials(root, cfg)
        self.bos_token = _special_token_content(found["bos_token"])
        self.eos_token = _special_token_content(found["eos_token"])
        self.pad_token = _special_token_content(found["pad_token"])
        specials = [t for t in self._tok.get_added_tokens_decoder().values() if t.special]
        self.all_special_tokens = [t.content for t in specials]
        self.all_special_ids = [self._tok.token_to_id(t) for t in self.all_special_tokens]

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def _fast_encoding(self, text: str) -> Any:
        """The `tokenizers.Encoding` of ``text`` without added special tokens (what
        ``apply_chat_template`` indexes with an integer, as transformers' fast tokenizers)."""
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = False, **_: Any) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def batch_decode(self, rows: Sequence[Sequence[int]], **kw: Any) -> list[str]:
        return [self.decode(r, **kw) for r in rows]

    def __call__(
        self, text: str | list[str], add_special_tokens: bool = True, **_: Any
    ) -> dict[str, Any]:
        rows = [text] if isinstance(text, str) else text
        ids = [self.encode(t, add_special_tokens=add_special_tokens) for t in rows]
        mask = [[1] * len(r) for r in ids]
        if isinstance(text, str):
            return {"input_ids": ids[0], "attention_mask": mask[0]}
        return {"input_ids": ids, "attention_mask": mask}

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

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
        """Render the model's chat template (or `chat_template`) in transformers' template
        environment (`chat_template.apply`); unless ``tokenize=False`` (the text), its tokens
        as transformers 5 returns them: a `ChatEncoding` (``out["input_ids"]``,
        ``out.input_ids``, ``out["attention_mask"]``; ``out[0]`` the `tokenizers.Encoding`), or
        with ``return_dict=False`` the ids alone (a list, transformers 4's default).
        ``return_tensors="pt"`` / ``"np"`` give a batch of one. Special tokens come from the
        template, so none are added."""
        return apply(
            self,
            conversation,
            # a name of one of the directory's templates (as transformers), else the template
            template=self._named_templates.get(chat_template, chat_template)
            if chat_template
            else self.chat_template,
            missing="the tokenizer has no chat_template (tokenizer_config.json or "
            "chat_template.jinja); pass chat_template=...",
            special_tokens={
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "pad_token": self.pad_token,
            },
            tokenize=tokenize,
            return_dict=return_dict,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
