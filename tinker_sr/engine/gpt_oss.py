"""OpenAI's gpt-oss (``GptOssForCausalLM``): what it computes beyond the Llama-style layers of
`tinker_sr.engine.model`, and its checkpoint layout.

- **Attention sinks.** Each head has a learned logit ``sinks[h]`` that joins the softmax as
  one more key whose value is zero: the probabilities of the real keys sum to less than 1.
- **Sliding windows.** Layers whose ``layer_types`` entry is ``sliding_attention`` attend to
  the last ``sliding_window`` positions (key j is seen from query i when i - W < j <= i); the
  others to every earlier position. The KV cache keeps every position either way.
- **Experts.** Every layer's feed-forward is a mixture of experts: a router with a bias whose
  top-k *logits* are softmaxed (not the top-k of a softmax), experts with biases and a
  clamped SwiGLU, ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with
  ``g = min(gate, L)`` (`clamped_swiglu`).
- **RoPE** is YaRN (`tinker_sr.engine.rope`), on the "rotate_half" layout.

Attention with sinks or a window runs through torch's fused attention with the sink as one
more key (`sink_attention`): no [B, H, T, S] probabilities are kept for backward (transformers'
eager gpt-oss attention keeps them): forward + backward ~4x faster than the eager form and
9x less memory at 2,048 tokens (`benchmarks/sink_attention.py`, docs/models.md).

The checkpoint stores the experts fused, as transformers holds them: ``gate_up_proj``
[E, D, 2F] with each expert's gate and up columns interleaved (gate at even columns),
``gate_up_proj_bias`` [E, 2F], ``down_proj`` [E, F, D] and ``down_proj_bias`` [E, D]; the
router is ``mlp.router``. The engine holds each expert as three `nn.Linear` (``gate_proj``,
``up_proj``, ``down_proj``, each with its bias) and the router as ``mlp.gate``, so LoRA, the
batched decode step and the exports treat them as the other mixtures of experts
(`to_engine`, `to_hf`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinker_sr.engine.fused import apply_linear
from tinker_sr.user_errors import EngineUserError

if TYPE_CHECKING:
    from tinker_sr.engine.model import ModelConfig

ARCH, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"
FUSED_3D = (GATE_UP, DOWN)  # [E, ., .]
FUSED_2D = (GATE_UP_BIAS, DOWN_BIAS)  # [E, .]
# transformers' GptOssConfig defaults for what a config.json may leave out
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip
# ... and those where gpt-oss's default is not the other architectures' (8 experts, 1e-6)
DEFAULTS = {"num_experts_per_tok": 4, "rms_norm_eps": 1e-5}
SWIGLU_DEFAULTS = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
_EXPERT = re.compile(r"(?P<stem>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<kind>weight|bias)")  # fmt: skip


def sink_attention(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, window: int, start: int
) -> Tensor:
    """Causal attention of q [B, H, T, D] (query i at position ``start + i``) over k, v
    [B, KV, S, D] (key j at position j), grouped-query; keys older than ``window`` positions
    masked (0: none); ``sinks`` [H] (or None) as one more logit per head with a zero value.
    Returns [B, H, T, D].

    Through `F.scaled_dot_product_attention` (its fused kernels: no [B, H, T, S] tensor is
    kept for backward) by one more key: the sink's logit ``s_h`` is the dot product of a
    query widened by ``s_h / scale`` with a key that is 1 in that extra feature and 0 in the
    others (the real keys 0 there), and its value is zero. The widening is padded to a
    multiple of 8 features (zeros change no product) where fused kernels want it."""
    B, H, T, D = q.shape
    S, scale = k.shape[2], D**-0.5
    q_pos = torch.arange(start, start + T, device=q.device)[:, None]
    k_pos = torch.arange(S, device=q.device)[None, :]
    seen = k_pos <= q_pos
    if window:
        seen &= k_pos > q_pos - window
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)
    extra = 8 - D % 8  # >= 1: the sink's feature, then zeros
    column = (sinks.float() / scale).to(q.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    qa = torch.cat([q, column, q.new_zeros(B, H, T, extra - 1)], dim=-1)
    sink_key = k.new_zeros(B, k.shape[1], 1, D + extra)
    sink_key[..., D] = 1
    ka = torch.cat([sink_key, F.pad(k, (0, extra))], dim=2)
    va = torch.cat([v.new_zeros(B, v.shape[1], 1, D + extra), F.pad(v, (0, extra))], dim=2)
    mask = torch.cat([seen.new_ones(T, 1), seen], dim=1)  # every query sees the sink
    y = F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, scale=scale, enable_gqa=True)
    return y[..., :D]


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's expert activation on the gate and up projections."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedMLP(nn.Module):
    """A gpt-oss expert: projections with biases, `clamped_swiglu` between them."""

    def __init__(self, config: ModelConfig, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, width)
        self.up_proj = nn.Linear(config.dim, width)
        self.down_proj = nn.Linear(width, config.dim)
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def activation(self, gate: Tensor, up: Tensor) -> Tensor:
        return clamped_swiglu(gate, up, self.alpha, self.limit)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = apply_linear(self.gate_proj, x), apply_linear(self.up_proj, x)
        return apply_linear(self.down_proj, self.activation(gate, up))


def route(logits: Tensor, top_k: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Router logits [N, E] -> (weights [N, k]: softmax over the k largest logits, in the
    logits' dtype, then ``dtype``; expert indices [N, k])."""
    top, chosen = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype).to(dtype), chosen


def with_defaults(hf: dict[str, Any], name: str = "gpt-oss") -> dict[str, Any]:
    """A gpt-oss config.json with transformers' defaults where it has none: YaRN RoPE
    (`DEFAULT_ROPE`), theta 150,000, 4 experts per token and an RMSNorm epsilon of 1e-5. A
    null SwiGLU constant is `EngineUserError` (transformers refuses it too; null is not "no
    clamp" there, and a silent default would compute another model)."""
    for key, default in SWIGLU_DEFAULTS.items():
        if key in hf and hf[key] is None:
            raise EngineUserError(
                f"{name}: config.json {key} is null; give a positive number, or leave the "
                f"field out for transformers' default ({default})"
            )
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    out = dict(hf) if rope else {**hf, "rope_scaling": dict(DEFAULT_ROPE)}
    out |= {k: v for k, v in DEFAULTS.items() if out.get(k) is None}
    inner = rope.get("rope_theta") if isinstance(rope, dict) else None
    if out.get("rope_theta") is None and inner is None:
        out["rope_theta"] = DEFAULT_THETA
    return out


def engine_key(key: str) -> str:
    """A stored name as the engine's (the router is ``mlp.gate``)."""
    return key.replace(".mlp.router.", ".mlp.gate.")


def to_engine(key: str, tensor: Tensor, config: ModelConfig) -> list[tuple[str, Tensor]]:
    """A gpt-oss checkpoint tensor as the engine's tensors: fused experts split per expert and
    projection (gate at the even columns of ``gate_up_proj``, up at the odd), transposed to
    `nn.Linear`'s [out, in]; the router renamed; the rest as it is."""
    del config  # the shapes are the tensor's own (checked against the model's by the loader)
    for fused in (GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS):
        if key.endswith(fused):
            stem = key.removesuffix(fused) + "mlp.experts"
            kind = "bias" if fused.endswith("_bias") else "weight"
            out: list[tuple[str, Tensor]] = []
            for e, t in enumerate(tensor):
                if fused in (DOWN, DOWN_BIAS):
                    out.append((f"{stem}.{e}.down_proj.{kind}", t.T if kind == "weight" else t))
                    continue
                gate, up = (t[..., 0::2], t[..., 1::2])
                if kind == "weight":
                    gate, up = gate.T, up.T
                out += [(f"{stem}.{e}.gate_proj.{kind}", gate), (f"{stem}.{e}.up_proj.{kind}", up)]
            return out
    return [(engine_key(key), tensor)]


def to_hf(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The engine's state dict in the checkpoint's layout (`to_engine` inverted): experts
    fused back, gate and up interleaved, the router as ``mlp.router``."""
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[tuple[str, str], dict[int, Tensor]]] = {}
    for key, t in state.items():
        m = _EXPERT.fullmatch(key)
        if m is None:
            out[key.replace(".mlp.gate.", ".mlp.router.")] = t
            continue
        slot = experts.setdefault(m["stem"], {}).setdefault((m["proj"], m["kind"]), {})
        slot[int(m["e"])] = t
    for stem, parts in experts.items():
        for kind in ("weight", "bias"):
            gate, up, down = (parts[(p, kind)] for p in ("gate", "up", "down"))
            n = len(gate)
            if kind == "weight":  # [E, D, 2F] (x @ W layout), gate at even columns
                g = torch.stack([gate[e].T for e in range(n)])
                u = torch.stack([up[e].T for e in range(n)])
                d = torch.stack([down[e].T for e in range(n)])
            else:
                g, u, d = (torch.stack([p[e] for e in range(n)]) for p in (gate, up, down))
            fused = torch.stack([g, u], dim=-1).flatten(-2)  # interleave along the last dim
            suffix = "" if kind == "weight" else "_bias"
            out[f"{stem}.gate_up_proj{suffix}"] = fused.contiguous()
            out[f"{stem}.down_proj{suffix}"] = d.contiguous()
    return out
