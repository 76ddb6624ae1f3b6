"""Fuzz the chat routes' harmony split (`server.harmony.split_channels`) with what a sampler
can return after a gpt-oss prompt: any mix of harmony's structural tokens, header words, text
and out-of-place tokens, after prompts that leave a header or a channel's text open. It never
raises; the parts are texts; where the completion holds no structural token, an open channel
gets all of it and an open header none (the answer is then its plain text: None)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ
from tinker_sr.server.harmony import split_channels
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir
from tinker_sr.tokenization.hf import load_hf_tokenizer

pytest.importorskip("transformers")

PIECES = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
          "<|constrain|>", "assistant", "analysis", "final", "commentary", " to=functions.f",
          "json", "the answer is", " 42", "add", "\n"]  # fmt: skip
OPENINGS = ["", "<|channel|>analysis<|message|>", "<|channel|>final<|message|>",
            "<|channel|>", "<|channel|>analysis"]  # fmt: skip
_TOK: dict[str, Any] = {}


def _tok(tmp: Path) -> Any:
    if "tok" not in _TOK:
        _TOK["tok"] = load_hf_tokenizer(make_tiny_hf_model_dir(tmp / "oss", "gpt_oss"))
    return _TOK["tok"]


@FUZZ
@given(
    opening=st.sampled_from(OPENINGS),
    pieces=st.lists(st.sampled_from(PIECES), max_size=24),
    stray=st.lists(st.integers(0, 700), max_size=4),
)
def test_any_completion_splits_without_error(
    tmp_path_factory: pytest.TempPathFactory, opening: str, pieces: list[str], stray: list[int]
) -> None:
    tok = _tok(tmp_path_factory.getbasetemp())
    ask = [{"role": "user", "content": "add"}]
    text = tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=False) + opening
    prompt = tok.encode(text, add_special_tokens=False)
    vocab = len(tok)
    completion = tok.encode("".join(pieces), add_special_tokens=False)
    completion += [t for t in stray if t < vocab]
    got = split_channels(tok, prompt, completion)
    structural = {tok.convert_tokens_to_ids(p) for p in PIECES[:6]}
    if any(t in structural for t in completion):
        assert got is not None
    if got is None:
        assert opening in ("", "<|channel|>", "<|channel|>analysis")
        return
    reasoning, content = got
    assert isinstance(content, str) and (reasoning is None or isinstance(reasoning, str))
    if not any(t in structural for t in completion) and opening.endswith("<|message|>"):
        whole = tok.decode(completion, skip_special_tokens=True)
        assert got == ((whole, "") if "analysis" in opening else (None, whole))
