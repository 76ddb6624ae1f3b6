"""A prompt too long for the model's context is refused from its length before it is
tokenized (found by a hunt: a 50 MB OpenAI prompt, under the default body limit, was
tokenized for 190 s into 8 GB before its 400). The refusal is exact: a prompt is refused early
only where its tokens would not have fit either (fuzzed against the tokenizers themselves)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from tests._server import ServerProcess, serving_model_dir  # noqa: E402
from tinker_sr.server.oai_format import OaiError  # noqa: E402
from tinker_sr.server.prompt_size import longest_token_chars, refuse_past_context  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.byte import ByteTokenizer  # noqa: E402
from tinker_sr.tokenization.hf import load_hf_tokenizer  # noqa: E402

KEY = {"Authorization": "Bearer tml-prompt-size"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    with serving_model_dir(tmp_path_factory, model_dir) as srv:
        yield srv


def _too_long(model_dir: Path) -> str:
    """Text with more characters than the longest token spells times the context."""
    tok = load_hf_tokenizer(model_dir)
    longest = longest_token_chars(tok)
    assert longest is not None
    return "hello world " * (longest * 40960 // 12 + 1)  # the tiny model's 40,960 positions


def test_routes_refuse_a_prompt_past_the_context_before_tokenizing_it(
    server: ServerProcess, model_dir: Path
) -> None:
    text = _too_long(model_dir)
    base = server.base_url
    cases = [
        ("/oai/api/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
        ("/oai/api/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
         "messages"),
        ("/anthropic/api/v1/messages",
         {"messages": [{"role": "user", "content": text}], "max_tokens": 1}, None),
        ("/anthropic/api/v1/messages/count_tokens",
         {"messages": [{"role": "user", "content": text}]}, None),
    ]  # fmt: skip
    for route, body, param in cases:
        resp = httpx.post(
            base + route, json={"model": str(model_dir), **body}, headers=KEY, timeout=120
        )
        assert resp.status_code == 400, (route, resp.text[:300])
        err = resp.json()["error"]
        message = err["message"]  # the engine's words, which clients match, then why
        assert message.startswith("Prompt length plus max_tokens exceeds the model's context")
        assert "more than 40960 prompt tokens > 40960" in message and "characters" in message
        if param is not None:
            assert err["param"] == param, (route, err)
    # The same server still answers a prompt that fits.
    ok = httpx.post(
        base + "/oai/api/v1/completions",
        json={"model": str(model_dir), "prompt": "hello", "max_tokens": 2, "seed": 1},
        headers=KEY,
        timeout=120,
    )
    assert ok.status_code == 200, ok.text


_PIECES = [*"ab é\u0301\n\tz0\u4e00", "<|im_start|>", "<|endoftext|>", "<s>", "<|end|>",
           "\U0001d400", " " * 40, "ab" * 30]  # fmt: skip
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=40).map("".join)


def _exact(tok: Any, text: str, context: int) -> None:
    try:
        refuse_past_context(tok, context, "prompt", len(text), lambda: [text])
    except OaiError:
        assert len(tok.encode(text, add_special_tokens=False)) > context, (text, context)


def _fast(tokenizer: Any, **kw: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kw)


def _sound_ones(model_dir: Path) -> list[Any]:
    """Tokenizers whose tokens cover at most what they spell: the tiny model's byte-level
    BPE, the built-in byte tokenizer, and a BPE whose NFKC normalizer folds characters (a
    text's raw length overstates what the model sees) and whose unknown characters are one
    unknown token each."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    folding = Tokenizer(models.BPE(unk_token="[UNK]"))
    folding.normalizer = normalizers.NFKC()
    folding.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    folding.train_from_iterator(["ab é z0 abab zz00 A", "é" * 8, "é" * 8], trainer)
    return [load_hf_tokenizer(model_dir), ByteTokenizer(), _fast(folding, unk_token="[UNK]")]


def _unsound_ones() -> list[Any]:
    """Tokenizers a token of which can cover more than it spells (found by a review): a
    pre-tokenizer that drops whitespace, an added token that swallows the whitespace beside
    it, fused unknown tokens (BPE, Unigram), WordPiece's and WordLevel's unknown words, a
    Strip normalizer (applied to each piece between added tokens)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    out = []
    drops = Tokenizer(models.BPE(unk_token="[UNK]"))
    drops.pre_tokenizer = pre_tokenizers.Whitespace()
    drops.train_from_iterator(["ab ab"], trainers.BpeTrainer(special_tokens=["[UNK]"]))
    out.append(_fast(drops, unk_token="[UNK]"))
    swallows = Tokenizer(models.BPE())
    swallows.pre_tokenizer = byte_level
    swallows.train_from_iterator(["ab " * 10], trainers.BpeTrainer(initial_alphabet=alphabet))
    swallows.add_special_tokens([AddedToken("<|end|>", lstrip=True, rstrip=True, special=True)])
    out.append(_fast(swallows))
    fused = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=True))
    fused.train_from_iterator(["ab ab"], trainers.BpeTrainer(special_tokens=["[UNK]"]))
    out.append(_fast(fused, unk_token="[UNK]"))
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=10))
    wordpiece.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wordpiece.train_from_iterator(["ab ab"], trainers.WordPieceTrainer(special_tokens=["[UNK]"]))
    out.append(_fast(wordpiece, unk_token="[UNK]"))
    out.append(_fast(Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
                     unk_token="[UNK]"))  # fmt: skip
    out.append(_fast(Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, False)),
                     unk_token="<unk>"))  # fmt: skip
    strip = Tokenizer(models.BPE())
    strip.normalizer = normalizers.Strip()
    strip.pre_tokenizer = byte_level
    strip.train_from_iterator(["a b"], trainers.BpeTrainer(initial_alphabet=alphabet))
    strip.add_special_tokens(["<s>"])
    out.append(_fast(strip))
    return out


@pytest.fixture(scope="module")
def tokenizers(model_dir: Path) -> tuple[list[Any], list[Any]]:
    return _sound_ones(model_dir), _unsound_ones()


def test_only_tokenizers_whose_tokens_cover_what_they_spell_are_refused_early(
    tokenizers: tuple[list[Any], list[Any]],
) -> None:
    sound, unsound = tokenizers
    assert all(longest_token_chars(t) for t in sound)
    assert [longest_token_chars(t) for t in unsound] == [None] * len(unsound)


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_an_early_refusal_is_always_a_prompt_whose_tokens_do_not_fit(
    tokenizers: tuple[list[Any], list[Any]], data: st.DataObject
) -> None:
    tok = data.draw(st.sampled_from(tokenizers[0] + tokenizers[1]))
    _exact(tok, data.draw(_TEXT), data.draw(st.integers(1, 12)))


def test_a_folding_normalizer_is_measured_after_folding(
    tokenizers: tuple[list[Any], list[Any]],
) -> None:
    """An "e" + a combining acute is one character after NFKC: 64 of them, 128 characters as
    sent, are 64 to the model: they fit a context of as many tokens as they are, though 128
    characters would not, and not one fewer."""
    nfkc = tokenizers[0][2]
    text = "e\u0301" * 64
    longest = longest_token_chars(nfkc)
    tokens = len(nfkc.encode(text, add_special_tokens=False))
    assert longest is not None and longest * (tokens - 1) < 64 <= longest * tokens < 128
    refuse_past_context(nfkc, tokens, "prompt", len(text), lambda: [text])  # no error
    with pytest.raises(OaiError, match="64 characters"):
        refuse_past_context(nfkc, tokens - 1, "prompt", len(text), lambda: [text])
