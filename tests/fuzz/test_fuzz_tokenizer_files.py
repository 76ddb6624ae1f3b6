"""Fuzz a model directory's tokenizer files as the engine reads them (EOS ids, and the bytes
each token contributes, for string stops): whatever tokenizer.json, tokenizer_config.json and
generation_config.json hold, reading them gives EOS ids inside the vocabulary and a byte table
of the vocabulary's length, or `EngineUserError` naming the directory; nothing else escapes."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ
from tinker_sr.tokenization.hf import ModelTokenizer
from tinker_sr.user_errors import EngineUserError

pytest.importorskip("tokenizers")

VOCAB = 300
LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
    st.text(max_size=4), st.sampled_from(["ByteLevel", "Metaspace", "Sequence", "Replace",
                                          "ByteFallback", "<0x41>", "▁a", "</s>"]),
)  # fmt: skip
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
PATHS = [  # where a mutation lands: (file, key path)
    ("tokenizer.json", ("model", "vocab")),
    ("tokenizer.json", ("model", "vocab", "a")),
    ("tokenizer.json", ("model",)),
    ("tokenizer.json", ("decoder",)),
    ("tokenizer.json", ("decoder", "type")),
    ("tokenizer.json", ("added_tokens",)),
    ("tokenizer.json", ("added_tokens", 0)),
    ("tokenizer.json", ("added_tokens", 0, "id")),
    ("tokenizer.json", ("added_tokens", 0, "content")),
    ("tokenizer_config.json", ("eos_token",)),
    ("tokenizer_config.json", ("added_tokens_decoder",)),
    ("generation_config.json", ("eos_token_id",)),
    ("config.json", ("eos_token_id",)),
]


def _files() -> dict[str, Any]:
    """A small byte-level BPE directory: 256 byte pieces, some merges, two specials."""
    from tinker_sr.tokenization.byte import _bytes_to_unicode

    to_char = _bytes_to_unicode()
    pieces = [to_char[b] for b in range(256)] + ["ab", "abc", "Ġthe"]  # id b is byte b
    return {
        "config.json": {"vocab_size": VOCAB, "eos_token_id": 260},
        "generation_config.json": {"eos_token_id": [260, 261]},
        "tokenizer_config.json": {"eos_token": "<eos>"},
        "tokenizer.json": {
            "model": {"type": "BPE", "vocab": {p: i for i, p in enumerate(pieces)}, "merges": []},
            "decoder": {"type": "ByteLevel"},
            "added_tokens": [
                {"id": 260, "content": "<eos>", "special": True},
                {"id": 261, "content": "<pad>", "special": True},
            ],
        },  # fmt: skip
    }


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


# JSON as Python writes and reads it: Infinity and NaN included (json.loads takes them).
EDGES: list[Any] = [None, True, -1, 0, 259, 300, 10**6, 2**32, 2.5, 260.0, math.inf, math.nan,
                    "x", "260", "</s>", [], [300], [None], [math.inf], {}, {"id": 1},
                    {"content": 3}, {"type": "Metaspace"}]  # fmt: skip


def _check(root: Path, edits: list[tuple[tuple[str, tuple[Any, ...]], Any]]) -> None:
    files = copy.deepcopy(_files())
    for (name, path), value in edits:
        try:
            _set(files[name], path, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit removed the container: the file stays as it is
    root.mkdir()
    for name, doc in files.items():
        (root / name).write_text(json.dumps(doc))
    try:
        tok = ModelTokenizer(root)
        table = tok.token_bytes
    except EngineUserError as e:
        assert str(root) in str(e)
        return
    assert tok.eos_token_ids and all(0 <= i < VOCAB for i in tok.eos_token_ids)
    assert len(table) == VOCAB and all(isinstance(b, bytes) for b in table)


def test_every_place_at_every_edge_value(tmp_path: Path) -> None:
    """Exhaustive over one edit at a time."""
    for i, place in enumerate(PATHS):
        for j, value in enumerate(EDGES):
            _check(tmp_path / f"{i}-{j}", [(place, value)])


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(PATHS), VALUES), min_size=1, max_size=3))
def test_tokenizer_files_read_or_refuse_by_directory(
    tmp_path_factory: pytest.TempPathFactory, edits: list[tuple[tuple[str, tuple[Any, ...]], Any]]
) -> None:
    """Several edits at once, from a wider range of values."""
    _check(tmp_path_factory.mktemp("tok") / "m", edits)


def test_unedited_files_read() -> None:
    """The base directory itself is valid, so a refusal above comes from an edit."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for name, doc in _files().items():
            (Path(d) / name).write_text(json.dumps(doc))
        tok = ModelTokenizer(Path(d))
        assert tok.eos_token_ids == (260, 261) and tok.token_bytes[97] == b"a"
