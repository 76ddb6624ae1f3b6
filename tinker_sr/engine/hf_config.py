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
import math
from dataclasses import dataclass
from typing import Any

import torch

from tinker_sr.engine.model import ModelConfig, rope_inv_freq
from tinker_sr.user_errors import EngineUserError

log = logging.getLogger("tinker_sr.engine")

MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig default when the key is absent
MAX_SIZE = 2**24  # any size or count in config.json: far above real models, far below overflow


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
    if quant is not None and quant is not False:
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
    if _flag(hf, "mlp_bias", name):
        raise EngineUserError(
            f"{name}: config.json mlp_bias=true is not supported (feed-forward projections "
            "without bias only)"
        )


def _number(
    hf: dict[str, Any], key: str, name: str, default: float | None = None, what: str = "number"
) -> float:
    """config.json's `key` (absent or null: `default`; no default: an error) as a positive
    number, else `EngineUserError` naming the field."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise EngineUserError(f"{name}: config.json lacks {key!r}, which this model needs")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise EngineUserError(
            f"{name}: config.json {key}={value!r} must be a positive {what}; fix config.json"
        )
    return value


def _count(hf: dict[str, Any], key: str, name: str, default: int | None = None) -> int:
    value = _number(hf, key, name, default, what="integer")
    if not isinstance(value, int) or value > MAX_SIZE:
        raise EngineUserError(
            f"{name}: config.json {key}={value!r} must be a positive integer up to "
            f"{MAX_SIZE:,}; fix config.json"
        )
    return value


def _rope_scaling(rope: Any, name: str) -> tuple[tuple[str, Any], ...] | None:
    """The RoPE scaling pairs the engine computes (default, llama3), else `EngineUserError`."""
    if not isinstance(rope, dict):
        raise EngineUserError(
            f"{name}: config.json rope_scaling / rope_parameters {rope!r} must be an object"
        )
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise EngineUserError(
            f"{name}: config.json rope type {kind!r} is not supported (supported: default, "
            "llama3); the positions would be encoded differently from the checkpoint's training"
        )
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        _number(scaling, key, f"{name}: rope_scaling")
    _count(scaling, "original_max_position_embeddings", f"{name}: rope_scaling")
    if scaling["high_freq_factor"] == scaling["low_freq_factor"]:
        raise EngineUserError(
            f"{name}: config.json llama3 rope_scaling needs high_freq_factor != low_freq_factor"
        )
    return tuple(sorted(scaling.items()))


def _flag(hf: dict[str, Any], key: str, name: str) -> bool:
    value = hf.get(key)
    if value is not None and not isinstance(value, bool):
        raise EngineUserError(f"{name}: config.json {key}={value!r} must be true or false")
    return bool(value)


def _token_id(hf: dict[str, Any], key: str, name: str) -> int | None:
    """A special token id (an int, a list of them: the first, or null)."""
    value = hf.get(key)
    if value is None or value == []:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise EngineUserError(
            f"{name}: config.json {key}={value!r} must be a token id, a list of them, or null"
        )
    return int(ids[0])


MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # fmt: skip


def _architecture(hf: dict[str, Any], name: str) -> str:
    """config.json's ``architectures[0]``; without it, the one ``model_type`` names (Llama when
    neither is there, as the engine always assumed)."""
    archs = hf.get("architectures")
    if archs is None or archs == []:
        model_type = hf.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise EngineUserError(
                f"{name}: config.json model_type {model_type!r} is not supported; supported: "
                f"{sorted(MODEL_TYPES)}"
            )
        return MODEL_TYPES[model_type]
    if not isinstance(archs, list) or archs[0] not in ARCHITECTURES:
        shown = archs[0] if isinstance(archs, list) else archs
        raise EngineUserError(
            f"{name}: config.json architecture {shown!r} is not supported; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    return str(archs[0])


def _window(hf: dict[str, Any], arch: _Arch, n_layers: int, name: str) -> int | None:
    """The sliding window some layer applies, or None when every layer attends causally."""
    if arch.window == "always":
        if "sliding_window" in hf and hf["sliding_window"] is None:
            return None
        return _count(hf, "sliding_window", name, MISTRAL_DEFAULT_WINDOW)
    if arch.window != "qwen" or not _flag(hf, "use_sliding_window", name):
        return None
    if hf.get("sliding_window") is None:
        return None  # transformers: no window, every layer full
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise EngineUserError(f"{name}: config.json layer_types={types!r} must be a list")
        if "sliding_attention" not in types:
            return None
    elif _count(hf, "max_window_layers", name, 28) >= n_layers:
        return None  # transformers: layers from max_window_layers on slide
    return _count(hf, "sliding_window", name)


def config_from_hf(hf: dict[str, Any], name: str) -> ModelConfig:
    """`ModelConfig` of a checkpoint's config.json; `EngineUserError` naming the field for
    anything the engine cannot compute exactly."""
    arch_name = _architecture(hf, name)
    arch = ARCHITECTURES[arch_name]
    _refuse_unsupported(hf, name, arch_name)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    scaling = _rope_scaling(rope, name)
    # transformers 5 keeps rope_theta inside rope_parameters; 4.x beside it.
    rope_theta = _number(hf if "rope_theta" in hf else rope, "rope_theta", name, 10000.0)
    dim, n_heads = _count(hf, "hidden_size", name), _count(hf, "num_attention_heads", name)
    n_layers = _count(hf, "num_hidden_layers", name)
    head_dim = _count(hf, "head_dim", name) if hf.get("head_dim") is not None else None
    bias = _flag(hf, "attention_bias", name)
    context = _count(hf, "max_position_embeddings", name, 2048)
    window = _window(hf, arch, n_layers, name)
    if window is not None and window < context:
        log.info(
            "%s: sliding-window attention (window %d): context capped at %d tokens, "
            "where sliding-window and causal attention agree",
            name,
            window,
            window,
        )
        context = window
    config = ModelConfig(
        name=name,
        vocab_size=_count(hf, "vocab_size", name),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=_count(hf, "num_key_value_heads", name, n_heads),
        ffn_dim=_count(hf, "intermediate_size", name),
        max_seq_len=context,
        rope_theta=float(rope_theta),
        norm_eps=float(_number(hf, "rms_norm_eps", name, 1e-6)),
        tie_embeddings=_flag(hf, "tie_word_embeddings", name),
        qk_norm=arch.qk_norm,
        bos_token_id=_token_id(hf, "bos_token_id", name),
        eos_token_id=_token_id(hf, "eos_token_id", name),
        pad_token_id=_token_id(hf, "pad_token_id", name),
        explicit_head_dim=head_dim if head_dim and head_dim != dim // n_heads else None,
        attention_bias=bias if arch.qkv_bias is None else arch.qkv_bias,
        attention_out_bias=bias if arch.out_bias is None else arch.out_bias,
        rope_scaling=scaling,
    )
    inv_freq = rope_inv_freq(config)
    if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
        raise EngineUserError(
            f"{name}: config.json rope_theta={rope_theta!r} with rope scaling {scaling} gives "
            "rotary frequencies that are not finite and positive; fix config.json"
        )
    return config


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
