"""The tiny built-in model with Qwen3.5's hybrid layers, for engine tests."""

from __future__ import annotations

import dataclasses

from tinker_sr.engine.model import BUILTIN_CONFIGS, Transformer, build_model


def tiny_hybrid_model(seed: int = 3, moe: bool = False) -> Transformer:
    """The tiny model as Qwen3.5 builds its layers: gated DeltaNet linear attention (a
    recurrent state per row instead of a KV cache), then gated attention with partial RoPE;
    ``moe``: Qwen3.5-MoE's feed-forward (2 of 8 routed experts and a shared one) in each."""
    tiny = BUILTIN_CONFIGS["tinker-sr/tiny"]
    experts = dict(
        n_experts=8, experts_per_token=2, moe_ffn_dim=32, norm_topk_prob=True,
        moe_layers=tuple(range(tiny.n_layers)), shared_expert_ffn_dim=48,
    ) if moe else {}  # fmt: skip
    config = dataclasses.replace(
        tiny, name="tiny-hybrid", qk_norm=True, attn_output_gate=True,
        rotary_dim=tiny.head_dim // 4,
        layer_types=("linear_attention",) * (tiny.n_layers - 1) + ("full_attention",),
        linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=8, linear_conv=4,
        **experts,
    )  # fmt: skip
    return build_model(config, seed=seed).eval()
