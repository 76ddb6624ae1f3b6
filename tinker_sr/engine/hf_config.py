"""Hugging Face ``config.json`` ⇄ `ModelConfig`, for the architectures the engine computes exactly.

Every field of a checkpoint's config that changes what the model computes is either mapped or
refused with a message: a model that loads but computes something else (an ignored bias, a
quantized weight read as a plain one, another activation) is the failure this module exists
to prevent. `tinker_sr.engine.hf.load_model_dir` adds the same rule for tensors: every tensor
of the checkpoint must land in the model.

| architecture | q/k norm | q/k/v bias | o bias | sliding window |
| --- | --- | --- | --- | --- |
| LlamaForCausalLM | no | ``attention_bias`` | ``attention_bias`` | none |
| MistralForCausalLM | no | no | no | ``sliding_window`` (absent: 4096), every layer |
| Qwen2ForCausalLM | no | yes | no | ``sliding_window`` if ``use_sliding_window`` |
| Qwen3ForCausalLM | yes | ``attention_bias`` | ``attention_bias`` | as Qwen2 |

A sliding window W caps the context at W tokens (``max_seq_len = min(max_position_embeddings,
W)``): within W tokens sliding-window attention *is* causal attention, so the model is exact;
longer sequences fail with the usual context-length error instead of being computed wrong.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tinker_sr.engine.model import ModelConfig
from tinker_sr.user_errors import EngineUserError

log = logging.getLogger("tinker_sr.engine")

MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig default when the key is absent


@dataclass(frozen=True)
class _Arch:
    qk_norm: bool
    qkv_bias: bool | None  # None: config.json's attention_bias
    out_bias: bool | None  # None: config.json's attention_bias
    window: str  # "none", "always" (Mistral), "qwen" (use_sliding_window + layer_types)


ARCHITECTURES: dict[str, _Arch] = {
    "LlamaForCausalLM": _Arch(qk_norm=False, qkv_bias=None, out_bias=None, window="none"),
    "MistralForCausalLM": _Arch(qk_norm=False, qkv_bias=False, out_bias=False, window="always"),
    "Qwen2ForCausalLM": _Arch(qk_norm=False, qkv_bias=True, out_bias=False, window="qwen"),
    "Qwen3ForCausalLM": _Arch(qk_norm=True, qkv_bias=None, out_bias=None, window="qwen"),
}


def _refuse_unsupported(hf: dict[str, Any], name: str, arch: str) -> None:
    """Fields whose non-default values the engine would otherwise ignore."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise EngineUserError(
            f"{name}: config.json quantization_config ({method}) is not supported: the "
            "quantized weights would be read as plain ones; load the unquantized "
            "(bfloat16/float32) checkpoint of this model instead"
        )
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise EngineUserError(
            f"{name}: config.json hidden_act {act!r} is not supported (the engine's "
            f"feed-forward is SwiGLU with silu, as {arch} uses by default)"
        )
    if hf.get("mlp_bias"):
        raise EngineUserError(
            f"{name}: config.json mlp_bias=true is not supported (feed-forward projections "
            "without bias only)"
        )


def _window(hf: dict[str, Any], arch: _Arch, n_layers: int) -> int | None:
    """The sliding window some layer applies, or None when every layer attends causally."""
    if arch.window == "always":
        value = hf.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
    elif arch.window == "qwen" and hf.get("use_sliding_window"):
        value = hf.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
        types = hf.get("layer_types")
        if types is not None:
            if "sliding_attention" not in types:
                return None
        elif int(hf.get("max_window_layers", 28)) >= n_layers:
            return None  # transformers: layers from max_window_layers on slide
    else:
        return None
    return None if value is None else int(value)


def config_from_hf(hf: dict[str, Any], name: str) -> ModelConfig:
    """`ModelConfig` of a checkpoint's config.json; `EngineUserError` naming the field for
    anything the engine cannot compute exactly."""
    arch_name = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch_name not in ARCHITECTURES:
        raise EngineUserError(
            f"{name}: config.json architecture {arch_name!r} is not supported; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[arch_name]
    _refuse_unsupported(hf, name, arch_name)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))

    def first(x: Any) -> int | None:
        return x[0] if isinstance(x, list) else x

    n_heads, n_layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim")
    bias = bool(hf.get("attention_bias", False))
    context = int(hf.get("max_position_embeddings", 2048))
    window = _window(hf, arch, n_layers)
    if window is not None and window < context:
        log.info(
            "%s: sliding-window attention (window %d): context capped at %d tokens, "
            "where sliding-window and causal attention agree",
            name,
            window,
            window,
        )
        context = window
    return ModelConfig(
        name=name,
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=context,
        rope_theta=float(rope_theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=arch.qk_norm,
        bos_token_id=first(hf.get("bos_token_id")),
        eos_token_id=first(hf.get("eos_token_id")),
        pad_token_id=first(hf.get("pad_token_id")),
        explicit_head_dim=head_dim
        if head_dim and head_dim != hf["hidden_size"] // n_heads
        else None,
        attention_bias=bias if arch.qkv_bias is None else arch.qkv_bias,
        attention_out_bias=bias if arch.out_bias is None else arch.out_bias,
        rope_scaling=None if kind == "default" else tuple(sorted(scaling.items())),
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers loads as the same model (Qwen3 with q/k norms, Qwen2 for
    q/k/v-only biases, else Llama)."""
    if config.attention_bias == config.attention_out_bias:
        arch, model_type = "LlamaForCausalLM", "llama"
        if config.qk_norm:
            arch, model_type = "Qwen3ForCausalLM", "qwen3"
    elif config.attention_bias and not config.qk_norm:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        raise EngineUserError(
            f"model config {config.name!r}: q/k norms with attention_bias="
            f"{config.attention_bias} and attention_out_bias={config.attention_out_bias} "
            "have no Hugging Face architecture"
        )
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_dim,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": "float32",
    }
    if arch != "Qwen2ForCausalLM":
        hf["attention_bias"] = config.attention_bias
    if config.rope_scaling:
        hf["rope_scaling"] = dict(config.rope_scaling)
    return hf
