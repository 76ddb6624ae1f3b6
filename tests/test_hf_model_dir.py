"""The tiny HF model-dir builder other tests rely on: real files, non-byte BPE ids, determinism."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tinker_sr.testing.hf_model_dir import (  # noqa: E402
    IM_END,
    make_tiny_hf_model_dir,
    tiny_model_info,
)


def _digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_qwen3_dir_loads_in_transformers_with_a_non_byte_tokenizer(tmp_path: Path) -> None:
    root = make_tiny_hf_model_dir(tmp_path / "q")
    info = tiny_model_info(root)
    tok = AutoTokenizer.from_pretrained(root)
    ids = tok("hello world", add_special_tokens=False).input_ids
    assert ids != list(b"hello world") and len(ids) < len("hello world")  # merges, not bytes
    assert tok.decode(ids) == "hello world"
    assert tok.eos_token == IM_END and tok.eos_token_id == info.special_ids[IM_END]
    assert min(info.special_ids.values()) >= 259 and tok.bos_token_id is None
    assert len(tok) == info.tokenizer_size == info.vocab_size
    gen = json.loads((root / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(info.eos_token_ids) and len(info.eos_token_ids) == 2
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(root)
    assert model.config.tie_word_embeddings and model.dtype == torch.float32
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), info.vocab_size) and torch.isfinite(logits).all()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = _digests(make_tiny_hf_model_dir(tmp_path / "a", seed=3))
    b = _digests(make_tiny_hf_model_dir(tmp_path / "b", seed=3))
    c = _digests(make_tiny_hf_model_dir(tmp_path / "c", seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]


def test_llama_bf16_sharded_with_bos_and_eos_list(tmp_path: Path) -> None:
    root = make_tiny_hf_model_dir(tmp_path / "l", family="llama", dtype="bfloat16", sharded=True)
    assert len(list(root.glob("model-*-of-*.safetensors"))) > 1
    assert (root / "model.safetensors.index.json").is_file()
    info = tiny_model_info(root)
    cfg = json.loads((root / "config.json").read_text())
    assert isinstance(cfg["eos_token_id"], list) and len(cfg["eos_token_id"]) == 2
    tok = AutoTokenizer.from_pretrained(root)
    assert info.bos_token_id is not None and tok("hi").input_ids[0] == info.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(root)
    assert model.dtype == torch.bfloat16
    assert not model.config.tie_word_embeddings


def test_padded_vocab_has_more_rows_than_tokens(tmp_path: Path) -> None:
    root = make_tiny_hf_model_dir(tmp_path / "p", pad_vocab_to_multiple=64)
    info = tiny_model_info(root)
    assert info.vocab_size % 64 == 0 and info.vocab_size > info.tokenizer_size


def test_an_older_transformers_is_named_with_the_version_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hunt (transformers 4.45, the dev extra's old floor): every family failed with
    an ImportError of a Qwen3.5 class. Now one message names both versions and the fix."""
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: "4.45.0" if name == "transformers" else real(name)
    )
    with pytest.raises(ImportError, match=r"needs transformers >= 5\.2 \(installed: 4\.45\.0\)"):
        make_tiny_hf_model_dir(tmp_path / "m", "llama")
    assert not (tmp_path / "m").exists()  # nothing half-written
