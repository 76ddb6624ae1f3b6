"""LoRA adapters sized as Tinker sizes them: for each model in tinker-cookbook's table of
Tinker's models that the engine computes (dense, Qwen3.5's hybrid layers, mixtures of experts
in the shared-outer scheme), a run's trainable parameters per rank and component equal the
table's (`hyperparam_utils.get_lora_param_count`). Built on the meta device from the real
checkpoints' config.json fields: no weights."""

from __future__ import annotations

import pytest

from tinker_sr import types

_Q35 = {"num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "full_attention_interval": 4, "vocab_size": 248320}  # fmt: skip
# Real checkpoints' config.json (the fields that size the adapters).
_REAL_SIZES = {
    "Qwen/Qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "vocab_size": 151936, "tie_word_embeddings": False},
    "openai/gpt-oss-20b": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088},
    "Qwen/Qwen3-8B": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False},
    "meta-llama/Llama-3.2-1B": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "tie_word_embeddings": True},
    # Qwen3.5: the linear attention's q, k, v, z and out adapters, the gated full attention's.
    "Qwen/Qwen3.5-4B": {"architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": _Q35 | {
            "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32}},
    # routed experts shared-outer, the shared expert an MLP with its own adapters
    "Qwen/Qwen3.5-35B-A3B": {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe", "tie_word_embeddings": False, "text_config": _Q35 | {
            "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
            "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512}},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_REAL_SIZES))
def test_adapter_sizes_are_tinkers(name: str) -> None:
    """The adapters a run creates have exactly the parameters per rank that tinker-cookbook's
    table of Tinker's models says (`hyperparam_utils.get_lora_param_count`), per component:
    for a mixture of experts that is the shared-outer scheme's count."""
    table = pytest.importorskip(
        "tinker_cookbook.hyperparam_utils"
    )._LORA_PARAMS_PER_RANK_BY_COMPONENT
    from tinker_sr.engine.hf_config import config_from_hf
    from tinker_sr.engine.lora import apply_lora
    from tinker_sr.engine.model import Transformer
    from tinker_sr.engine.skeleton import on_meta
    from tinker_sr.engine.training import lora_spec

    hf = _REAL_SIZES[name]
    text = hf.get("text_config", hf)
    # One period of the layer pattern (Qwen3.5: three linear-attention layers, then a full one;
    # gpt-oss: sliding, full), its counts times the periods: the same numbers, built in a
    # second instead of ~20 s for the 48 layers of 128 experts.
    period = text.get("full_attention_interval", 2 if hf["model_type"] == "gpt_oss" else 1)
    periods, rest = divmod(text["num_hidden_layers"], period)
    assert rest == 0
    one = {**text, "num_hidden_layers": period}
    config = config_from_hf({**hf, "text_config": one} if "text_config" in hf else one, name)
    with on_meta():  # shapes only, as the engine builds its skeletons
        model = Transformer(config)
    apply_lora(model, lora_spec(types.LoraConfig(rank=1), experts=bool(config.moe_layers)))
    counts = {"mlp": 0, "attn": 0, "unembed": 0}
    for n, p in model.named_parameters():
        if p.requires_grad:
            counts["unembed" if n.startswith("lm_head") else "mlp" if ".mlp." in n else "attn"] += (
                p.numel()
            )
    counts["mlp"] *= periods
    counts["attn"] *= periods
    assert counts == table[name]
