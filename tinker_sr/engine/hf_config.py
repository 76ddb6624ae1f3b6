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
| Qwen3MoeForCausalLM | yes | ``attention_bias`` | ``attention_bias`` | every layer if ``use_sliding_window`` |
| Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM | yes | ``attention_bias`` | ``attention_bias`` | none |
| GptOssForCausalLM | no | ``attention_bias`` (absent: yes) | as q/k/v | per ``layer_types``, exact |

Qwen3.5 (and Qwen3.5-MoE) come as vision-language wrappers whose ``text_config`` is read
(`tinker_sr.engine.hf_vl.text_config`); their hybrid fields are `_qwen3_5`'s (see
`tinker_sr.engine.hybrid`).

Qwen3-MoE's feed-forward is sparse in the layers ``decoder_sparse_step`` and ``mlp_only_layers``
select (`_moe`); its router's auxiliary load-balancing loss (``router_aux_loss_coef``) is a
pre-training term that Tinker's losses do not add, so it is not computed.

A sliding window W caps the context at W tokens (``max_seq_len = min(max_position_embeddings,
W)``): within W tokens sliding-window attention *is* causal attention, so the model is exact;
longer sequences fail with the usual context-length error instead of being computed wrong.
gpt-oss's windowed layers are computed as such (`tinker_sr.engine.gpt_oss`): no cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tinker_sr.engine import gpt_oss
from tinker_sr.engine.hf_vl import QWEN3_VL_TEXT, text_config
from tinker_sr.engine.hybrid import LAYER_KINDS
from tinker_sr.engine.model import ModelConfig, rope_inv_freq
from tinker_sr.user_errors import EngineUserError

MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig default when the key is absent
MAX_SIZE = 2**24  # any size or count in config.json: far above real models, far below overflow
MAX_EXPERTS = 1024  # experts per MoE layer (real models: 8 to 512)
# Decoder layers, and experts over all layers (real models: up to ~130 layers, ~31k experts).
# The model is built (on the meta device, to check a checkpoint's names) before any weight is
# read: an inflated count cost ~1 ms and 55 KB per layer before its refusal.
MAX_LAYERS = 1024
MAX_TOTAL_EXPERTS = 2**16
# intermediate_size when absent: Qwen3-MoE's; Qwen3.5-MoE has no dense feed-forward layer.
_FFN_DEFAULTS = {"Qwen3MoeForCausalLM": 6144, "Qwen3_5MoeForCausalLM": 512, gpt_oss.ARCH: 2880}


@dataclass(frozen=True)
class _Arch:
    """What an architecture computes and transformers 5's defaults for fields config.json may
    leave out (a checkpoint must load as the model transformers would build from it)."""

    qk_norm: bool
    qkv_bias: bool | None  # None: config.json's attention_bias
    out_bias: bool | None  # None: config.json's attention_bias
    window: str  # "none", "always" (Mistral), "qwen" (use_sliding_window + layer_types),
    # "flag" (Qwen3-MoE: every layer when use_sliding_window)
    context: int  # max_position_embeddings when absent
    kv_heads: int | None  # num_key_value_heads when absent (None: num_attention_heads)
    head_dim: int | None  # head_dim when absent (None: hidden_size // num_attention_heads)
    mlp_bias: bool  # does the architecture read mlp_bias (else it is ignored, as there)


ARCHITECTURES: dict[str, _Arch] = {
    "LlamaForCausalLM": _Arch(False, None, None, "none", 2048, None, None, mlp_bias=True),
    "MistralForCausalLM": _Arch(False, False, False, "always", 131072, 8, None, mlp_bias=False),
    "Qwen2ForCausalLM": _Arch(False, True, False, "qwen", 32768, 32, None, mlp_bias=False),
    "Qwen3ForCausalLM": _Arch(True, None, None, "qwen", 32768, 32, 128, mlp_bias=False),
    "Qwen3MoeForCausalLM": _Arch(True, None, None, "flag", 32768, 4, None, mlp_bias=False),
    "Qwen3_5ForCausalLM": _Arch(True, None, None, "none", 32768, 4, 256, mlp_bias=False),
    "Qwen3_5MoeForCausalLM": _Arch(True, None, None, "none", 32768, 2, 256, mlp_bias=False),
    # gpt-oss: windows per layer, computed exactly (`_gpt_oss`), so no context cap.
    gpt_oss.ARCH: _Arch(False, None, None, "none", 131072, 8, 64, mlp_bias=False),
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
               "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_vl_text": "Qwen3ForCausalLM",
               "qwen3_vl_moe_text": "Qwen3MoeForCausalLM", gpt_oss.MODEL_TYPE: gpt_oss.ARCH}  # fmt: skip
MOE = "Qwen3MoeForCausalLM"
QWEN3_5 = "Qwen3_5ForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
QWEN3_5_FAMILY = (QWEN3_5, QWEN3_5_MOE)
# Qwen3.5's RoPE: multimodal sections (positions equal across them for text, so the same
# rotation as plain RoPE) and the fraction of each head rotated.
QWEN3_5_ROPE_KEYS = {"partial_rotary_factor", "mrope_section", "mrope_interleaved"}
# RoPE keys the engine computes, per rope type (anything else would be ignored: refused).
ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate",
             "original_max_position_embeddings", "attention_factor", "mscale", "mscale_all_dim"},
}  # fmt: skip


def _refuse_unsupported(hf: dict[str, Any], name: str, arch_name: str) -> None:
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
    if act not in ("silu", "swish"):  # transformers maps both to SiLU
        raise EngineUserError(
            f"{name}: config.json hidden_act {act!r} is not supported (the engine's "
            f"feed-forward is SwiGLU with silu, as {arch_name} uses by default)"
        )
    if ARCHITECTURES[arch_name].mlp_bias and _flag(hf, "mlp_bias", name):
        raise EngineUserError(
            f"{name}: config.json mlp_bias=true is not supported (feed-forward projections "
            "without bias only)"
        )
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    partial = hf.get("partial_rotary_factor", 1.0)
    partial = rope.get("partial_rotary_factor", partial) if isinstance(rope, dict) else partial
    if partial != 1.0 and arch_name not in QWEN3_5_FAMILY:
        raise EngineUserError(
            f"{name}: config.json partial_rotary_factor={partial!r} is not supported (RoPE "
            "over the whole head only)"
        )


# The layer kinds a Llama / Mistral / Qwen2 / Qwen3 config's layer_types may list ("attention":
# transformers' older name of "full_attention"); Qwen3.5 and gpt-oss check their own.
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "attention")


def _refuse_malformed(hf: dict[str, Any], name: str, arch_name: str, n_layers: int) -> None:
    """Fields transformers' config refuses (so the model's tokenizer would not load either,
    AutoTokenizer reads config.json), named here rather than blamed on the tokenizer: a
    ``layer_types`` entry of another kind or another count than ``num_hidden_layers``; a
    ``dtype`` (or ``torch_dtype``) that is no torch dtype's name."""
    types = hf.get("layer_types")
    if types is not None and arch_name not in (*QWEN3_5_FAMILY, gpt_oss.ARCH):
        if (
            not isinstance(types, list)
            or len(types) != n_layers
            or not all(isinstance(t, str) and t in _ATTENTION_KINDS for t in types)
        ):
            raise EngineUserError(
                f"{name}: config.json layer_types={types!r:.300} must list 'full_attention' or "
                f"'sliding_attention' for each of the {n_layers} layers (num_hidden_layers); "
                "fix config.json"
            )
    key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    declared = hf.get(key)
    if isinstance(declared, str) and declared != "auto":
        if not isinstance(getattr(torch, declared, None), torch.dtype):
            raise EngineUserError(
                f"{name}: config.json {key}={declared!r:.100} is not a torch dtype (e.g. "
                "'bfloat16', 'float16', 'float32'); fix config.json"
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


def _count(
    hf: dict[str, Any], key: str, name: str, default: int | None = None, minimum: int = 1
) -> int:
    if minimum == 0 and hf.get(key) == 0 and not isinstance(hf.get(key), bool | float):
        return 0
    value = _number(hf, key, name, default, what="integer")
    if not isinstance(value, int) or value > MAX_SIZE:
        raise EngineUserError(
            f"{name}: config.json {key}={value!r} must be a positive integer up to "
            f"{MAX_SIZE:,}; fix config.json"
        )
    return value


def _rope(
    hf: dict[str, Any], name: str, context: int, extra: frozenset[str] = frozenset()
) -> tuple[float, Any]:
    """(rope_theta, scaling pairs or None) as transformers 5 reads them: ``rope_scaling`` (4.x's
    key) over ``rope_parameters``, theta inside them over the top-level ``rope_theta``."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    extra |= {"partial_rotary_factor"}  # checked by `_refuse_unsupported` or `_qwen3_5`
    if not isinstance(rope, dict):
        raise EngineUserError(
            f"{name}: config.json rope_scaling / rope_parameters {rope!r} must be an object"
        )
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_KEYS:
        raise EngineUserError(
            f"{name}: config.json rope type {kind!r} is not supported (supported: "
            f"{', '.join(ROPE_KEYS)}); the positions would be encoded differently from the "
            "checkpoint's training"
        )
    unknown = sorted(str(k) for k in set(rope) - ROPE_KEYS[kind] - extra)
    if unknown:
        raise EngineUserError(
            f"{name}: config.json rope parameters {unknown} are not supported for rope type "
            f"{kind!r}; the engine would ignore them"
        )
    theta = rope.get("rope_theta")
    theta = hf.get("rope_theta") if theta is None else theta
    rope_theta = _number({"rope_theta": theta}, "rope_theta", name, 10000.0)
    if kind == "default":
        return rope_theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type") and k not in extra}
    scaling["rope_type"] = kind  # transformers 4.x wrote "type"
    _number(scaling, "factor", f"{name}: rope_scaling")
    if kind == "linear":
        return rope_theta, tuple(sorted(scaling.items()))
    # As transformers 5: a top-level value (Phi-3's place for it) over the one in the dict.
    if hf.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    scaling.setdefault("original_max_position_embeddings", context)
    if kind == "yarn":
        if rope_theta <= 1:  # its ramp divides by log(theta)
            raise EngineUserError(f"{name}: config.json rope_theta={theta!r} must be above 1")
        return rope_theta, _yarn(scaling, name)
    for key in ("low_freq_factor", "high_freq_factor"):
        _number(scaling, key, f"{name}: rope_scaling")
    _count(scaling, "original_max_position_embeddings", f"{name}: rope_scaling")
    if scaling["high_freq_factor"] == scaling["low_freq_factor"]:
        raise EngineUserError(
            f"{name}: config.json llama3 rope_scaling needs high_freq_factor != low_freq_factor"
        )
    return rope_theta, tuple(sorted(scaling.items()))


def _yarn(scaling: dict[str, Any], name: str) -> tuple[tuple[str, Any], ...]:
    """YaRN's parameters, checked (`rope.rope_inv_freq` computes them as transformers)."""
    where = f"{name}: rope_scaling"
    _count(scaling, "original_max_position_embeddings", where)
    for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        if scaling.get(key) is not None:
            _number(scaling, key, where)
    _flag(scaling, "truncate", where)  # absent or null: true, as transformers
    return tuple(sorted(scaling.items()))


def _flag(hf: dict[str, Any], key: str, name: str) -> bool:
    value = hf.get(key)
    if value is not None and not isinstance(value, bool):
        raise EngineUserError(f"{name}: config.json {key}={value!r} must be true or false")
    return bool(value)


def _token_id(hf: dict[str, Any], key: str, name: str) -> int | None:
    """A special token id (an int, a list of them: the first, or null). A negative pad id
    (old Llama conversions' -1) means none, as the model never reads it."""
    value = hf.get(key)
    if value is None or value == [] or (key == "pad_token_id" and value == -1):
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise EngineUserError(
            f"{name}: config.json {key}={value!r} must be a token id, a list of them, or null"
        )
    return int(ids[0])


def _architecture(hf: dict[str, Any], name: str) -> str:
    """The architecture transformers' AutoModelForCausalLM would build: ``model_type``'s, which
    ``architectures[0]`` must not contradict; ``architectures[0]`` alone when there is no
    ``model_type``; an error when neither is there, as transformers' AutoConfig raises."""
    archs, model_type = hf.get("architectures"), hf.get("model_type")
    if archs is not None and archs != []:
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise EngineUserError(
                f"{name}: config.json architectures={archs!r} must be a list of class names"
            )
        if archs[0] not in ARCHITECTURES:
            raise EngineUserError(
                f"{name}: config.json architecture {archs[0]!r} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
    if model_type is None:
        if archs:
            return str(archs[0])
        raise EngineUserError(
            f"{name}: config.json has neither model_type nor architectures, so the model's "
            'architecture is unknown; add e.g. "model_type": "llama" (supported: '
            f"{sorted(MODEL_TYPES)})"
        )
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise EngineUserError(
            f"{name}: config.json model_type {model_type!r} is not supported; supported: "
            f"{sorted(MODEL_TYPES)}"
        )
    arch_name = MODEL_TYPES[model_type]
    if archs and archs[0] != arch_name:
        raise EngineUserError(
            f"{name}: config.json model_type {model_type!r} (which transformers builds as "
            f"{arch_name}) contradicts architectures {archs!r}; make them agree"
        )
    return arch_name


def _window(hf: dict[str, Any], arch: _Arch, n_layers: int, name: str) -> int | None:
    """The sliding window some layer applies, or None when every layer attends causally."""
    if arch.window == "always":
        if "sliding_window" in hf and hf["sliding_window"] is None:
            return None
        return _count(hf, "sliding_window", name, MISTRAL_DEFAULT_WINDOW)
    if arch.window not in ("qwen", "flag") or not _flag(hf, "use_sliding_window", name):
        return None
    if hf.get("sliding_window") is None:
        return None  # transformers: no window, every layer full
    if arch.window == "flag":
        return _count(hf, "sliding_window", name)
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise EngineUserError(f"{name}: config.json layer_types={types!r} must be a list")
        if "sliding_attention" not in types:
            return None
    elif _count(hf, "max_window_layers", name, 28, minimum=0) >= n_layers:
        return None  # transformers: layers from max_window_layers on slide
    return _count(hf, "sliding_window", name)


def config_from_hf(hf: dict[str, Any], name: str) -> ModelConfig:
    """`ModelConfig` of a checkpoint's config.json, as transformers 5 would build the model
    (its defaults for absent fields); `EngineUserError` naming the field for anything the
    engine cannot compute exactly."""
    hf = text_config(hf, name)
    arch_name = _architecture(hf, name)
    arch = ARCHITECTURES[arch_name]
    if arch_name == gpt_oss.ARCH:
        hf = gpt_oss.with_defaults(hf, name)
    _refuse_unsupported(hf, name, arch_name)
    dim, n_heads = _count(hf, "hidden_size", name), _count(hf, "num_attention_heads", name)
    n_layers = _count(hf, "num_hidden_layers", name)
    if n_layers > MAX_LAYERS:
        raise EngineUserError(
            f"{name}: config.json num_hidden_layers={n_layers} is above the {MAX_LAYERS} "
            "decoder layers this engine builds (real models have up to ~130); fix config.json"
        )
    _refuse_malformed(hf, name, arch_name, n_layers)
    head_dim = _count(hf, "head_dim", name, arch.head_dim or dim // n_heads)
    if head_dim % 2:
        raise EngineUserError(f"{name}: config.json head_dim {head_dim} must be even (RoPE)")
    n_kv = hf.get("num_key_value_heads", arch.kv_heads)  # present but null: n_heads
    bias = _flag(hf, "attention_bias", name)
    if arch_name == gpt_oss.ARCH and hf.get("attention_bias") is None:
        bias = True  # transformers' GptOssConfig default
    context = _count(hf, "max_position_embeddings", name, arch.context)
    extra: frozenset[str] = frozenset()
    if arch_name in QWEN3_5_FAMILY or hf.get("model_type") in QWEN3_VL_TEXT:
        extra = frozenset(QWEN3_5_ROPE_KEYS)  # mrope: on text, the same rotation as RoPE
    rope_theta, scaling = _rope(hf, name, context, extra)
    window = _window(hf, arch, n_layers, name)
    config = ModelConfig(
        name=name,
        vocab_size=_count(hf, "vocab_size", name),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=_count({"num_key_value_heads": n_kv}, "num_key_value_heads", name, n_heads),
        ffn_dim=_count(hf, "intermediate_size", name, _FFN_DEFAULTS.get(arch_name)),
        max_seq_len=context if window is None else min(context, window),
        rope_theta=float(rope_theta),
        norm_eps=float(_number(hf, "rms_norm_eps", name, 1e-6)),
        tie_embeddings=_flag(hf, "tie_word_embeddings", name),
        qk_norm=arch.qk_norm,
        bos_token_id=_token_id(hf, "bos_token_id", name),
        eos_token_id=_token_id(hf, "eos_token_id", name),
        pad_token_id=_token_id(hf, "pad_token_id", name),
        explicit_head_dim=head_dim if head_dim * n_heads != dim else None,
        attention_bias=bias if arch.qkv_bias is None else arch.qkv_bias,
        attention_out_bias=bias if arch.out_bias is None else arch.out_bias,
        rope_scaling=scaling,
        **(_moe(hf, name, n_layers) if arch_name == MOE else {}),
        **(_qwen3_5(hf, name, n_layers, head_dim) if arch_name in QWEN3_5_FAMILY else {}),
        **(_qwen3_5_moe(hf, name, n_layers) if arch_name == QWEN3_5_MOE else {}),
        **(_gpt_oss(hf, name, n_layers) if arch_name == gpt_oss.ARCH else {}),
    )
    inv_freq = rope_inv_freq(config)
    if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
        raise EngineUserError(
            f"{name}: config.json rope_theta={rope_theta!r} with rope scaling {scaling} gives "
            "rotary frequencies that are not finite and positive; fix config.json"
        )
    return config


def _qwen3_5(hf: dict[str, Any], name: str, n_layers: int, head_dim: int) -> dict[str, Any]:
    """Qwen3.5's hybrid fields (transformers' defaults where absent): ``layer_types`` (else
    every ``full_attention_interval``-th layer full), the linear attention's heads, widths and
    kernel, the rotary fraction; the output gate must not be switched off."""
    if hf.get("attn_output_gate", True) is not True:
        raise EngineUserError(
            f"{name}: config.json attn_output_gate={hf['attn_output_gate']!r}: Qwen3.5's "
            "attention always gates its output (as transformers computes it); remove the key"
        )
    types = hf.get("layer_types")
    if types is None:
        every = _count(hf, "full_attention_interval", name, 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n_layers)]  # fmt: skip
    if (
        not isinstance(types, list)
        or len(types) != n_layers
        or not all(isinstance(t, str) and t in LAYER_KINDS for t in types)
    ):
        raise EngineUserError(
            f"{name}: config.json layer_types={types!r} must list 'full_attention' or "
            f"'linear_attention' for each of the {n_layers} layers"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise EngineUserError(
            f"{name}: config.json partial_rotary_factor={factor!r} must be in (0, 1]"
        )
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise EngineUserError(
            f"{name}: config.json partial_rotary_factor={factor!r} rotates {rotary} of "
            f"{head_dim} features per head; it must be an even number of at least 2"
        )
    k_heads = _count(hf, "linear_num_key_heads", name, 16)
    v_heads = _count(hf, "linear_num_value_heads", name, 32)
    if v_heads % k_heads:
        raise EngineUserError(
            f"{name}: config.json linear_num_value_heads={v_heads} must be a multiple of "
            f"linear_num_key_heads={k_heads}"
        )
    return {
        "layer_types": tuple(types),
        "attn_output_gate": True,
        "rotary_dim": rotary,
        "linear_k_heads": k_heads,
        "linear_v_heads": v_heads,
        "linear_k_dim": _count(hf, "linear_key_head_dim", name, 128),
        "linear_v_dim": _count(hf, "linear_value_head_dim", name, 128),
        "linear_conv": _count(hf, "linear_conv_kernel_dim", name, 4),
        "qwen3_5_layout": True,
    }


def _gpt_oss(hf: dict[str, Any], name: str, n_layers: int) -> dict[str, Any]:
    """gpt-oss: every layer a mixture of ``num_local_experts`` experts of width
    ``intermediate_size``; ``layer_types`` (absent: sliding and full alternating, sliding
    first) with ``sliding_window``; the experts' clamped SwiGLU (`tinker_sr.engine.gpt_oss`).
    The router's auxiliary loss (``router_aux_loss_coef``) is not computed, as for Qwen3-MoE."""
    fields = _moe({**hf, "decoder_sparse_step": 1, "mlp_only_layers": []}, name, n_layers, 128)
    fields["moe_ffn_dim"] = _count(hf, "intermediate_size", name, 2880)
    fields["norm_topk_prob"] = False  # the top-k logits are softmaxed: they sum to 1
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    kinds = ["sliding_attention", "full_attention"]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in kinds for t in types):
        raise EngineUserError(
            f"{name}: config.json layer_types={types!r} must list 'sliding_attention' or "
            f"'full_attention' for each of the {n_layers} layers"
        )
    if "sliding_attention" in types and hf.get("sliding_window", 128) is None:
        raise EngineUserError(  # as transformers refuses it when building the mask
            f"{name}: config.json sliding_window is null but layer_types has sliding_attention "
            "layers; give the window (gpt-oss: 128)"
        )
    window = _count(hf, "sliding_window", name, 128) if "sliding_attention" in types else 0
    swiglu = {k: float(_number(hf, k, name, v)) for k, v in gpt_oss.SWIGLU_DEFAULTS.items()}
    return (
        fields | swiglu | {"layer_types": tuple(types), "sliding_window": window, "gpt_oss": True}
    )


def _qwen3_5_moe(hf: dict[str, Any], name: str, n_layers: int) -> dict[str, Any]:
    """Qwen3.5-MoE: every layer sparse, the top-k probabilities always renormalised, a shared
    expert (``shared_expert_intermediate_size``) beside the routed ones."""
    fields = _moe({**hf, "decoder_sparse_step": 1, "mlp_only_layers": []}, name, n_layers, 256)
    fields["norm_topk_prob"] = True
    fields["moe_ffn_dim"] = _count(hf, "moe_intermediate_size", name, 512)
    fields["shared_expert_ffn_dim"] = _count(hf, "shared_expert_intermediate_size", name, 512)
    return fields


def _moe(hf: dict[str, Any], name: str, n_layers: int, experts: int = 128) -> dict[str, Any]:
    """Qwen3-MoE's `ModelConfig` fields. The expert count is ``num_experts`` (the Hub's
    checkpoints) or ``num_local_experts`` (what transformers 5 writes); a layer is sparse
    unless ``mlp_only_layers`` lists it or ``(layer + 1) % decoder_sparse_step`` is not 0."""
    counts = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(map(repr, counts.values()))) > 1:
        raise EngineUserError(
            f"{name}: config.json num_experts and num_local_experts differ ({counts}); keep one"
        )
    if hf.get("model_type") == "qwen3_vl_moe_text":
        experts = 60  # its config's default
    n_experts = _count({"num_experts": next(iter(counts.values()), experts)}, "num_experts", name)
    if n_experts > MAX_EXPERTS:  # each expert is three modules per layer, even on meta
        raise EngineUserError(
            f"{name}: config.json num_experts={n_experts} is above the {MAX_EXPERTS} experts "
            "per layer this engine builds; fix config.json"
        )
    top_k = _count(hf, "num_experts_per_tok", name, 8)
    if top_k > n_experts:
        raise EngineUserError(
            f"{name}: config.json num_experts_per_tok={top_k} exceeds num_experts={n_experts}"
        )
    step = _count(hf, "decoder_sparse_step", name, 1)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise EngineUserError(
            f"{name}: config.json mlp_only_layers={dense!r} must be a list of layer indices"
        )
    moe_layers = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
    if len(moe_layers) * n_experts > MAX_TOTAL_EXPERTS:
        raise EngineUserError(
            f"{name}: config.json declares {len(moe_layers)} MoE layers of {n_experts} experts, "
            f"above the {MAX_TOTAL_EXPERTS:,} experts in all this engine builds; fix "
            "num_hidden_layers or num_experts"
        )
    return {
        "n_experts": n_experts,
        "experts_per_token": top_k,
        "moe_ffn_dim": _count(hf, "moe_intermediate_size", name, 768),
        # Qwen3-VL-MoE's router always renormalises (transformers reads no flag for it).
        "norm_topk_prob": _flag(hf, "norm_topk_prob", name)
        or hf.get("model_type") == "qwen3_vl_moe_text",
        "moe_layers": moe_layers,
    }


def _hf_architecture(config: ModelConfig) -> tuple[str, str]:
    """(architecture, model_type) that computes `config`, or `EngineUserError`."""
    same_bias = config.attention_bias == config.attention_out_bias
    if config.rotary_dim not in (None, config.head_dim) and not config.qwen3_5_layout:
        raise EngineUserError(
            f"model config {config.name!r}: partial RoPE (rotary_dim={config.rotary_dim}) is "
            "written only as Qwen3.5"
        )
    if config.gpt_oss:
        return gpt_oss.ARCH, gpt_oss.MODEL_TYPE
    if config.moe_layers and not (config.qk_norm and same_bias):
        raise EngineUserError(
            f"model config {config.name!r}: mixture-of-experts layers need q/k norms and "
            "equal attention biases (Qwen3-MoE), the one MoE architecture written"
        )
    if config.qwen3_5_layout or config.attn_output_gate or config.layer_types:
        if not (config.qk_norm and config.attn_output_gate and config.qwen3_5_layout):
            raise EngineUserError(
                f"model config {config.name!r}: hybrid layers and output gates are written "
                "only as Qwen3.5 (Qwen3_5ForCausalLM: q/k norms, gates, its checkpoint layout)"
            )
        arch, model_type = QWEN3_5, "qwen3_5_text"
        if config.moe_layers:
            arch, model_type = QWEN3_5_MOE, "qwen3_5_moe_text"
    elif config.moe_layers:
        arch, model_type = MOE, "qwen3_moe"
    elif same_bias:
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
    return arch, model_type


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers loads as the same model (Qwen3 with q/k norms, Qwen2 for
    q/k/v-only biases, else Llama; the MoE and Qwen3.5 architectures for theirs)."""
    arch, model_type = _hf_architecture(config)
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
    if arch == MOE:
        hf |= {
            "num_experts": config.n_experts,
            "num_experts_per_tok": config.experts_per_token,
            "moe_intermediate_size": config.moe_ffn_dim,
            "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(config.n_layers) if i not in config.moe_layers],
        }
    if arch in QWEN3_5_FAMILY:
        del hf["rope_theta"]
        hf |= _qwen3_5_fields(config)
    if arch == QWEN3_5_MOE:
        del hf["intermediate_size"]
        hf |= {
            "num_experts": config.n_experts,
            "num_experts_per_tok": config.experts_per_token,
            "moe_intermediate_size": config.moe_ffn_dim,
            "shared_expert_intermediate_size": config.shared_expert_ffn_dim,
        }
    if arch == gpt_oss.ARCH:
        hf |= {
            "num_local_experts": config.n_experts,
            "num_experts_per_tok": config.experts_per_token,
            "intermediate_size": config.moe_ffn_dim,
            "layer_types": list(config.layer_types),
            "sliding_window": config.sliding_window or 128,  # transformers' masks need one
            "swiglu_alpha": config.swiglu_alpha,
            "swiglu_limit": config.swiglu_limit,
        }
    if config.rope_scaling or arch == gpt_oss.ARCH:  # gpt-oss's absent one reads as YaRN
        hf["rope_scaling"] = dict(config.rope_scaling or {"rope_type": "default"})
    return hf


def _qwen3_5_fields(config: ModelConfig) -> dict[str, Any]:
    """Qwen3.5's own config.json fields (`config_to_hf`)."""
    return {
        "layer_types": list(config.layer_types) or ["full_attention"] * config.n_layers,
        "attn_output_gate": True,
        "linear_num_key_heads": config.linear_k_heads,
        "linear_num_value_heads": config.linear_v_heads,
        "linear_key_head_dim": config.linear_k_dim,
        "linear_value_head_dim": config.linear_v_dim,
        "linear_conv_kernel_dim": config.linear_conv,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": (config.rotary_dim or config.head_dim) / config.head_dim,
        },
    }
