"""Rotary position embeddings as transformers computes them: the inverse frequencies of the
plain, ``linear``, Llama 3.x ``llama3`` and ``yarn`` (gpt-oss, DeepSeek) variants, and the
cos/sin tables the attention layers rotate by (HF "rotate_half" layout)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tinker_sr.user_errors import EngineUserError

if TYPE_CHECKING:
    from tinker_sr.engine.model import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """float32 inverse frequencies [rotary_dim / 2] of ``config``'s RoPE (`ROPE_TYPES`)."""
    d = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = dict(config.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "linear":  # positions divided by the factor (Llama 2 long-context finetunes)
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(config.rope_theta, d, scaling)
    elif kind != "default":
        raise EngineUserError(
            f"model config {config.name!r}: rope_scaling type {kind!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    return inv_freq


def _yarn_inv_freq(base: float, d: int, scaling: dict[str, Any]) -> Tensor:
    """YaRN: each frequency between its extrapolated (unscaled) and interpolated (divided by
    ``factor``) value by a linear ramp over the dimensions whose wavelengths span
    ``beta_fast``..``beta_slow`` rotations of the original context (transformers'
    ``_compute_yarn_parameters``; ``truncate`` rounds the ramp's ends outwards)."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return (d * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    keep = 1 - ramp  # the extrapolated share of each frequency
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(config: ModelConfig) -> float:
    """YaRN's scale on cos and sin (1.0 for the other types): ``attention_factor`` where
    given, else ``0.1 ln(factor) + 1``, or with ``mscale`` and ``mscale_all_dim`` the ratio
    of those two (DeepSeek), as transformers computes it."""
    scaling = dict(config.rope_scaling or ())
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(float(m)) / mscale(float(m_all)))
    return mscale()


def rope_angles(
    inv_freq: Tensor,
    start_pos: int,
    length: int,
    dtype: torch.dtype,
    device: torch.device,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """cos, sin [length, head_dim] for positions start_pos.. (each half repeats the other, the
    HF "rotate_half" layout `fused.rope` takes), times ``scale`` (`rope_attention_factor`).
    Computed on the CPU in float32, then moved and cast: the same values on any device, in
    prefill, training and decode."""
    freqs = torch.outer(torch.arange(start_pos, start_pos + length, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(device, dtype), sin.to(device, dtype)
