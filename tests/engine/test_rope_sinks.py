"""YaRN RoPE (gpt-oss, Qwen3's long-context setting, DeepSeek) against transformers' own
computation, and `gpt_oss.sink_attention` against plain causal attention and the sink's
closed form."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tinker_sr.engine.gpt_oss import sink_attention
from tinker_sr.engine.model import ModelConfig
from tinker_sr.engine.rope import rope_angles, rope_attention_factor, rope_inv_freq

_YARN: dict[str, dict[str, Any]] = {
    "gpt-oss": {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096},
    "qwen3 long context (truncate by default)": {"factor": 4.0,
                                                 "original_max_position_embeddings": 32768},
    "deepseek mscale": {"factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                        "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    "explicit attention factor": {"factor": 8.0, "attention_factor": 1.5,
                                  "original_max_position_embeddings": 2048},
    "narrow ramp": {"factor": 2.0, "beta_fast": 4.0, "beta_slow": 3.9,
                    "original_max_position_embeddings": 64},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_YARN))
def test_yarn_equals_transformers(case: str) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **_YARN[case]}
    theirs_config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=dict(params),
        max_position_embeddings=131072,
    )  # fmt: skip
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](theirs_config)
    ours = ModelConfig(
        name=case, vocab_size=8, dim=256, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=8,
        max_seq_len=131072, rope_theta=150000.0, explicit_head_dim=64,
        rope_scaling=tuple(sorted({k: v for k, v in params.items() if k != "rope_theta"}.items())),
    )  # fmt: skip
    assert torch.equal(rope_inv_freq(ours), want_freq.float())
    assert rope_attention_factor(ours) == pytest.approx(want_scale, rel=1e-12)
    assert want_scale != 1.0 or case == "deepseek mscale"  # the scale is exercised
    cos, sin = rope_angles(rope_inv_freq(ours), 100, 3, torch.float32, torch.device("cpu"), 1.5)
    plain_cos, plain_sin = rope_angles(rope_inv_freq(ours), 100, 3, torch.float32, cos.device)
    torch.testing.assert_close(cos, plain_cos * 1.5, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, plain_sin * 1.5, rtol=0, atol=1e-6)


def _qkv(b: int = 2, h: int = 4, kv: int = 2, t: int = 12, d: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(b, n, t, d, generator=gen) for n in (h, kv, kv)]


def test_without_sinks_or_window_it_is_causal_attention() -> None:
    q, k, v = _qkv()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(sink_attention(q, k, v, None, 0, 0), want, rtol=0, atol=1e-6)


def test_sinks_scale_each_head_by_its_share_of_the_softmax() -> None:
    """With a sink logit s, a query's output is causal attention's times Z / (Z + e^s), Z the
    sum of its keys' exponentiated scores: the sink is a key of value zero."""
    q, k, v = _qkv()
    sinks = torch.tensor([-1.0, 0.0, 2.0, 5.0])
    got = sink_attention(q, k, v, sinks, 0, 0)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    scores = q @ k.repeat_interleave(2, 1).transpose(2, 3) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    share = torch.sigmoid(lse - sinks.view(1, 4, 1, 1))
    torch.testing.assert_close(got, plain * share, rtol=0, atol=1e-6)


def test_window_sees_the_last_positions_only_and_chunks_agree() -> None:
    """Window W: query i sees keys i-W+1..i (as transformers' sliding mask); attending from a
    later chunk (queries at start..) over all the keys gives the whole sequence's rows."""
    q, k, v = _qkv(t=20)
    sinks = torch.tensor([0.5, -0.5, 1.0, 0.0])
    whole = sink_attention(q, k, v, sinks, 5, 0)
    for i in (0, 4, 5, 13, 19):  # one query alone over its window of keys
        lo = max(0, i - 4)
        alone = sink_attention(q[:, :, i : i + 1], k[:, :, lo : i + 1], v[:, :, lo : i + 1],
                               sinks, 0, i - lo)  # fmt: skip
        torch.testing.assert_close(whole[:, :, i : i + 1], alone, rtol=0, atol=1e-6)
    tail = sink_attention(q[:, :, 8:], k, v, sinks, 5, 8)
    torch.testing.assert_close(tail, whole[:, :, 8:], rtol=0, atol=1e-6)
    assert not torch.allclose(whole, sink_attention(q, k, v, sinks, 0, 0), atol=1e-3)


def test_a_qwen3_directory_with_yarn_computes_transformers_logits(tmp_path: Path) -> None:
    """Qwen3's model cards switch YaRN on in config.json for long contexts; the original
    context is set small here so that the ramp and the attention factor matter at 70 tokens."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tinker_sr.engine.hf import load_model_dir
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    root = make_tiny_hf_model_dir(tmp_path / "q", "qwen3")
    hf = json.loads((root / "config.json").read_text())
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 16}  # fmt: skip
    (root / "config.json").write_text(json.dumps(hf | {"rope_parameters": yarn}))
    ids = torch.randint(0, 400, (2, 70), generator=torch.Generator().manual_seed(1))
    theirs = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    ours = load_model_dir(root)
    assert ours.rope_scale == pytest.approx(0.1 * math.log(4.0) + 1)
    with torch.no_grad():
        want, got = theirs(ids).logits, ours(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
