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
        assert "characters cannot fit this model's context of 40,960 tokens" in err["message"]
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


_PIECES = list("ab é\u0301\n\tz0") + ["<|im_start|>", "<|endoftext|>", "\U0001d400", "  "]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=60).map("".join)


def _exact(tok: Any, text: str, context: int) -> None:
    try:
        refuse_past_context(tok, context, "prompt", len(text), lambda: [text])
    except OaiError:
        assert len(tok.encode(text, add_special_tokens=False)) > context, (text, context)


@pytest.fixture(scope="module")
def tokenizers(model_dir: Path) -> list[Any]:
    """The tiny model's byte-level BPE, the built-in byte tokenizer, and a BPE whose NFKC
    normalizer folds characters (a text's raw length overstates what the model sees)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folding = Tokenizer(models.BPE(unk_token="[UNK]"))
    folding.normalizer = normalizers.NFKC()
    folding.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    folding.train_from_iterator(["ab é z0 abab zz00 A", "é" * 8, "é" * 8], trainer)
    nfkc = PreTrainedTokenizerFast(tokenizer_object=folding, unk_token="[UNK]")
    return [load_hf_tokenizer(model_dir), ByteTokenizer(), nfkc]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_an_early_refusal_is_always_a_prompt_whose_tokens_do_not_fit(
    tokenizers: list[Any], data: st.DataObject
) -> None:
    tok = data.draw(st.sampled_from(tokenizers))
    text = data.draw(_TEXT)
    context = data.draw(st.integers(1, 12))
    _exact(tok, text, context)


def test_a_folding_normalizer_is_measured_after_folding(tokenizers: list[Any]) -> None:
    """An "e" + a combining acute is one character after NFKC: 64 of them, 128 characters as
    sent, are 64 to the model, 8 tokens of 8 "é" each; they fit a context of 8."""
    nfkc = tokenizers[2]
    text = "e\u0301" * 64
    assert longest_token_chars(nfkc) == 8
    assert len(nfkc.encode(text, add_special_tokens=False)) == 8
    refuse_past_context(nfkc, 8, "prompt", len(text), lambda: [text])  # no error
    with pytest.raises(OaiError, match="65 characters cannot fit"):
        refuse_past_context(nfkc, 8, "prompt", len(text) + 1, lambda: [text + "e"])
