"""Tokenizers whose decoders join tokens by words: WordPiece (BERT-style "##" continuations) and
BPE with an end-of-word suffix ("</w>"). Decoded one id at a time, a continuation kept its "##"
and a word lost its space, so a stop string spanning two words never matched: the bytes each
token contributes must agree with the `tokenizers` library's decoding of a whole text, and a
string stop across words must end a sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

import tinker_sr  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.hf import token_bytes_table  # noqa: E402

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
WORDS = "the a and of to is what how many plus equals user assistant hello world playing".split()
CORPUS = [
    " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(9)) + ", ok. " + "?:"[i % 2]
    for i in range(300)
]
TEXTS = ["hello playing world, what is it?", "the user plays. assistant: helloing"]


def wordpiece_tokenizer_json(vocab_size: int = 80) -> dict[str, Any]:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return json.loads(tok.to_str())  # type: ignore[no-any-return]


def test_wordpiece_token_bytes_agree_with_the_library_decoding() -> None:
    from tokenizers import Tokenizer

    spec = wordpiece_tokenizer_json()
    tok = Tokenizer.from_str(json.dumps(spec))
    table = token_bytes_table(spec, tok.get_vocab_size() + 3)  # padded rows decode to nothing
    assert table[-1] == b"" and all(table[tok.token_to_id(s)] == b"" for s in SPECIALS)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert any(tok.id_to_token(i).startswith("##") for i in ids)  # continuations were used
        # Every word, the first too, comes after a space: in a continuation it does.
        assert b"".join(table[i] for i in ids) == b" " + tok.decode(ids).encode()


def test_end_of_word_suffix_token_bytes_agree_with_the_library_decoding() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]", end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    trainer = trainers.BpeTrainer(
        vocab_size=60, special_tokens=SPECIALS, end_of_word_suffix="</w>", show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    spec = json.loads(tok.to_str())
    table = token_bytes_table(spec, tok.get_vocab_size())
    for text in ("hello playing world", "what is the user"):
        ids = tok.encode(text).ids
        assert len(ids) > len(text.split())  # some word took two tokens
        # The decoder drops the last word's trailing space; the bytes keep it.
        assert b"".join(table[i] for i in ids) == tok.decode(ids).encode() + b" "


def test_a_stop_string_across_two_words_ends_a_wordpiece_models_sample(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    root = make_tiny_hf_model_dir(tmp_path / "bert-tokenized", family="llama")
    spec = wordpiece_tokenizer_json()
    tok = Tokenizer.from_str(json.dumps(spec))
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        (root / name).unlink()  # the fixture's Llama 3 names
    (root / "tokenizer.json").write_text(json.dumps(spec))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "[SEP]", "unk_token": "[UNK]",
        "pad_token": "[PAD]", "cls_token": "[CLS]",
    }))  # fmt: skip
    sep = tok.token_to_id("[SEP]")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((root / name).read_text())
        config.update(bos_token_id=None, eos_token_id=sep, pad_token_id=None)
        (root / name).write_text(json.dumps(config))

    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    sampler = client.create_sampling_client(base_model=str(root)).result()
    prompt = types.ModelInput.from_ints(tok.encode("hello world", add_special_tokens=False).ids)

    def word(i: int) -> bool:  # a token that starts a word (not a continuation, not special)
        token = tok.id_to_token(i)  # None: a padded row of the model's larger vocabulary
        return i >= len(SPECIALS) and token is not None and not token.startswith("##")

    # A stop: two consecutive word-starting tokens, "w1 w2", in a row without EOS before them.
    for seed in range(10):
        free = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=30, seed=seed)).result()
        found = [
            (r, f"{tok.id_to_token(t[a])} {tok.id_to_token(t[a + 1])}", a + 2)
            for r, t in enumerate(s.tokens for s in free.sequences)
            for a in range(2, len(t) - 1)
            if sep not in t[: a + 2] and word(t[a]) and word(t[a + 1])
        ]
        if found:
            break
    else:
        pytest.fail("no two consecutive words in 10 seeds")
    row, text, end = found[0]
    params = types.SamplingParams(max_tokens=30, stop=[text], seed=seed)
    got = sampler.sample(prompt, 4, params).result().sequences[row]
    assert got.stop_reason == "stop" and len(got.tokens) <= end
    assert got.tokens == free.sequences[row].tokens[: len(got.tokens)]
    assert text in tok.decode(got.tokens) and text not in tok.decode(got.tokens[:-1])
    client.close().result()
    backend.close()
