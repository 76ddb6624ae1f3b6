"""`make_tiny_hf_model_dir(family="gpt_oss")` checked with transformers and tinker-cookbook only
(the engine's own gpt-oss checks are in tests/test_gpt_oss.py): the config is gpt-oss-20b's
shape, transformers loads every weight, each gpt-oss part (sinks, router bias, experts' biases,
the window) changes the logits, and the cookbook's harmony renderer works with the tokenizer
and gives the ids the chat template gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tinker_sr.testing.hf_model_dir import (  # noqa: E402
    HARMONY,
    make_tiny_hf_model_dir,
    tiny_model_info,
)

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("oss") / "m", family="gpt_oss")


def _logits(root: Path, ids: torch.Tensor, zero: str = "", **config: Any) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, **config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if zero and name.endswith(zero):
                p.zero_()
        return model(ids).logits


def _templated(tok: Any, chat: list[dict[str, str]], **kw: Any) -> list[int]:
    return tok.encode(tok.apply_chat_template(chat, tokenize=False, **kw), add_special_tokens=False)


def test_config_is_gpt_oss_20b_shaped_and_every_weight_loads(root: Path) -> None:
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["model_type"] == "gpt_oss"
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    experts = (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"])
    assert experts == (8, 2, 32) and cfg["sliding_window"] == 16
    assert cfg["rope_parameters"] == YARN and cfg["max_position_embeddings"] == 131072
    assert cfg["attention_bias"] and not cfg["tie_word_embeddings"] and cfg["dtype"] == "float32"
    model, loading = AutoModelForCausalLM.from_pretrained(root, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    assert not loading["mismatched_keys"] and model.dtype == torch.float32
    params = dict(model.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # [E, h, 2i]
    sinks = params["model.layers.0.self_attn.sinks"]
    assert sinks.abs().mean() > 0.3  # O(1), not transformers' N(0, 0.02)
    for bias in ("mlp.router.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):
        assert params[f"model.layers.1.{bias}"].abs().min() > 0  # drawn, not zeroed


def test_sinks_router_and_expert_biases_and_the_window_all_change_the_logits(root: Path) -> None:
    """So an engine that ignored any of them would not match transformers (48 > 16 tokens)."""
    ids = torch.randint(0, 600, (2, 48), generator=torch.Generator().manual_seed(0))
    want = _logits(root, ids)
    assert torch.isfinite(want).all() and want.shape == (2, 48, tiny_model_info(root).vocab_size)
    for part in ("sinks", "router.bias", "gate_up_proj_bias", "down_proj_bias", "v_proj.bias"):
        assert (_logits(root, ids, zero=part) - want).abs().max() > 1e-2, part
    full = _logits(root, ids, layer_types=["full_attention"] * 4)
    torch.testing.assert_close(full[:, :16], want[:, :16], rtol=0, atol=1e-5)  # inside it
    assert (full[:, 16:] - want[:, 16:]).abs().max() > 1e-2  # past the window


def test_harmony_tokens_are_single_special_ids_and_eos_is_return_and_call(root: Path) -> None:
    info = tiny_model_info(root)
    tok = AutoTokenizer.from_pretrained(root)
    for t in ("<|endoftext|>", *HARMONY):
        assert tok.encode(t, add_special_tokens=False) == [info.special_ids[t]] and (
            info.special_ids[t] >= 259
        )
    ret, end, call = (info.special_ids[t] for t in ("<|return|>", "<|endoftext|>", "<|call|>"))
    assert tok.eos_token == "<|return|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None and info.bos_token_id is None  # harmony has no BOS
    assert info.eos_token_ids == (ret, end, call)  # gpt-oss-20b's generation_config order
    ids = tok("hello world", add_special_tokens=True).input_ids
    assert ids != list(b"hello world") and tok.decode(ids) == "hello world"


def test_the_cookbooks_harmony_renderer_works_and_matches_the_chat_template(root: Path) -> None:
    renderers = pytest.importorskip("tinker_cookbook.renderers")
    tok = AutoTokenizer.from_pretrained(root)
    renderer = renderers.get_renderer("gpt_oss_no_sysprompt", tok)
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "what is 12 plus 30?"}]  # fmt: skip
    prompt = renderer.build_generation_prompt(chat).to_ints()
    assert prompt == _templated(tok, chat, add_generation_prompt=True)
    assert tok.decode(prompt).endswith("<|end|><|start|>assistant")
    reply = "<|channel|>analysis<|message|>add them<|end|><|start|>assistant"
    reply += "<|channel|>final<|message|>12 plus 30 is 42<|return|>"
    message, termination = renderer.parse_response(tok.encode(reply, add_special_tokens=False))
    assert termination.value == "stop_sequence"
    assert message["content"] == [{"type": "thinking", "thinking": "add them"},
                                  {"type": "text", "text": "12 plus 30 is 42"}]  # fmt: skip
    info = tiny_model_info(root)
    assert renderer.get_stop_sequences() == [info.special_ids["<|return|>"],
                                             info.special_ids["<|call|>"]]  # fmt: skip
    # Training: the last assistant turn ends with <|return|>, as the renderer writes it.
    done = [*chat, {"role": "assistant", "content": "42"}]
    tokens, weights = renderer.build_supervised_example(done)
    assert tokens.to_ints() == _templated(tok, done)
    assert tok.decode(tokens.to_ints()).endswith("<|channel|>final<|message|>42<|return|>")
    assert weights.sum() > 0
