"""Decoder-only transformer of the Llama / Mistral / Qwen2 / Qwen3 (and -MoE) / gpt-oss family.

RMSNorm, rotary embeddings (HF "rotate_half" layout), grouped-query attention through
`F.scaled_dot_product_attention`, SwiGLU feed-forward (or Qwen3-MoE's routed SwiGLU experts,
`SparseMoe`), optional tied embeddings, optional per-head q/k RMSNorm (Qwen3) and attention
projection biases (Qwen2: q/k/v; Llama: all four). Submodules carry Hugging Face names, so a
real checkpoint's state dict loads by name (`load_pretrained`).

Two call shapes: training / scoring, `model(tokens[B, T], attn_mask=valid[B, T])` on a
right-padded batch; generation, `model(tokens, start_pos=p, cache=kv)` (a `KVCache` per request).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tinker_sr.engine import attention_inputs, compiled, cpu
from tinker_sr.engine.bf16_attention import bf16_causal_attention, suits_bf16_weights
from tinker_sr.engine.device import free_memory
from tinker_sr.engine.fused import (
    add_rms_norm,
    apply_linear,
    linear_group,
    rms_norm,
    rope,
    swiglu_mlp,
)
from tinker_sr.engine.gpt_oss import ClampedMLP, sink_attention
from tinker_sr.engine.gpt_oss import route as top_logits_route
from tinker_sr.engine.hybrid import (
    GatedDeltaNet,
    check_config,
    linear_activations,
    partial_rope,
    split_gate,
)
from tinker_sr.engine.kv_cache import KVCache
from tinker_sr.engine.rope import rope_angles, rope_attention_factor, rope_inv_freq
from tinker_sr.engine.skeleton import on_meta
from tinker_sr.tokenization.byte import TOKENIZER_SIZE, ByteTokenizer
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Qwen3 sets the head width independently of dim / n_heads; None means dim // n_heads.
    explicit_head_dim: int | None = None
    attention_bias: bool = False  # q/k/v projection biases (Qwen2; Llama/Qwen3 attention_bias)
    attention_out_bias: bool = False  # o_proj bias (Llama/Qwen3 attention_bias, not Qwen2)
    # "linear" or Llama 3.x "llama3" RoPE scaling as sorted (key, value) pairs; None = plain.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    # Sparse mixture-of-experts feed-forward (Qwen3-MoE) in the layers `moe_layers` names:
    # `n_experts` SwiGLU experts of width `moe_ffn_dim`, `experts_per_token` chosen per token
    # by a linear router's softmax, their weights renormalised to sum 1 if `norm_topk_prob`.
    n_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_dim: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    shared_expert_ffn_dim: int = 0  # Qwen3.5-MoE's shared expert (0: none)
    # Qwen3.5's hybrid layers (`tinker_sr.engine.hybrid`): `layer_types` names each layer's
    # token mixer, "full_attention" or "linear_attention" (empty: all full attention);
    # `attn_output_gate`: q_proj also yields a sigmoid gate on each head's output;
    # `rotary_dim`: RoPE on the first rotary_dim features of each head (None: all of them);
    # the gated DeltaNet's head counts and widths and its convolution's kernel.
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    rotary_dim: int | None = None
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 0
    # The checkpoint's layout is Qwen3.5's: RMSNorm gains stored as offsets from 1 (the model
    # holds 1 + w), the linear attention's q/k/v fused (`hybrid.to_engine` / `hybrid.to_hf`).
    qwen3_5_layout: bool = False
    # gpt-oss (`tinker_sr.engine.gpt_oss`): a learned sink logit per attention head, layers
    # whose layer_types entry is "sliding_attention" attend to the last `sliding_window`
    # positions, MoE experts with biases and a clamped SwiGLU (`swiglu_alpha`,
    # `swiglu_limit`), a biased router whose top-k logits are softmaxed; its checkpoint layout.
    gpt_oss: bool = False
    sliding_window: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    def window(self, layer: int) -> int:
        """The sliding window ``layer`` attends within (0: every earlier position)."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else 0

    def is_linear(self, layer: int) -> bool:
        """Is ``layer`` a linear-attention (gated DeltaNet) layer?"""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def hybrid(self) -> bool:
        """Does some layer hold a recurrent state instead of a KV cache?"""
        return "linear_attention" in self.layer_types

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise EngineUserError(
                f"model config {self.name!r}: n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.explicit_head_dim is None and self.dim % self.n_heads != 0:
            raise EngineUserError(
                f"model config {self.name!r}: dim={self.dim} must be divisible by "
                f"n_heads={self.n_heads} (or set explicit_head_dim)"
            )
        if self.moe_layers and not 1 <= self.experts_per_token <= self.n_experts:
            raise EngineUserError(
                f"model config {self.name!r}: experts_per_token={self.experts_per_token} must "
                f"be between 1 and n_experts={self.n_experts}"
            )
        check_config(self)
        if any(not 0 <= i < self.n_layers for i in self.moe_layers):
            raise EngineUserError(
                f"model config {self.name!r}: moe_layers {self.moe_layers} must be layer "
                f"indices below n_layers={self.n_layers}"
            )


def _byte_model(name: str, **shape: Any) -> ModelConfig:
    """A built-in model: tied embeddings and the byte tokenizer's vocabulary and special ids
    (256 byte ids + <|bos|>, <|eos|>, <|pad|>)."""
    tok = ByteTokenizer
    return ModelConfig(
        name=name,
        vocab_size=TOKENIZER_SIZE,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_embeddings=True,
        **shape,
    )


BUILTIN_CONFIGS: dict[str, ModelConfig] = {
    # ~140k parameters: a whole RL step is milliseconds on a CPU.
    "tinker-sr/tiny": _byte_model(
        "tinker-sr/tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=512
    ),
    # ~24M parameters, Qwen3-shaped (q/k norm, GQA, tied embeddings).
    "tinker-sr/small": _byte_model(
        "tinker-sr/small",
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=1408,
        max_seq_len=1024,
        rope_theta=1_000_000.0,
        qk_norm=True,
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 and cast back before the gain, as HF Llama/Qwen3 do.
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int = 0) -> None:
        super().__init__()
        hd, bias = config.head_dim, config.attention_bias
        self.window = window  # `ModelConfig.window` of its layer (0: none)
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        q_out = config.n_heads * hd * (2 if config.attn_output_gate else 1)
        self.q_proj = nn.Linear(config.dim, q_out, bias=bias)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(config.n_heads * hd, config.dim, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.norm_eps)
            self.k_norm = RMSNorm(hd, config.norm_eps)
        if config.gpt_oss:  # a learned sink logit per head (`gpt_oss.sink_attention`)
            self.sinks = nn.Parameter(torch.zeros(config.n_heads))

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        start_pos: int,
        cache: KVCache | None,
        layer: int,
    ) -> Tensor:
        q, k, v = self._heads(x, cos, sin)
        return linear_group(self._attend(q, k, v, start_pos, cache, layer), (self.o_proj,))[0]

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, start_pos: int, cache: KVCache | None, layer: int
    ) -> Tensor:
        """Attention of q [B, H, T, D] over k, v (and the cache's earlier positions) ->
        [B, T, H * D], before the output projection."""
        B, _, T, _ = q.shape
        sinks = getattr(self, "sinks", None)
        if sinks is not None or self.window:  # gpt-oss
            if cache is not None:
                k_all, v_all = cache.update(layer, start_pos, k, v)
                if start_pos:
                    k, v = k_all[:B], v_all[:B]
            y = sink_attention(q, k, v, sinks, self.window, start_pos)
        elif cache is None or start_pos == 0:
            # Fresh sequence: attend to this chunk only (a prefill of one row feeds all
            # cache rows; attention runs once, on the unbroadcast keys).
            if cache is not None:
                cache.update(layer, start_pos, k, v)
            y = _causal_attention(q, k, v)
        else:
            k, v = cache.update(layer, start_pos, k, v)
            k, v = k[:B], v[:B]  # a prefill chunk of one row feeds every row: attend once
            mask = None
            if T > 1:  # chunk after a prefix: query i sits at absolute position start_pos + i
                q_pos = torch.arange(start_pos, start_pos + T, device=q.device)[:, None]
                mask = torch.arange(start_pos + T, device=q.device)[None, :] <= q_pos
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return y.transpose(1, 2).reshape(B, T, -1)

    def _heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, T, D], k and v [B, KV, T, D] from x [B, T, dim]: the q/k/v projections
        (one merged GEMM where `linear_group` merges them), Qwen3's q/k norms where the model
        has them, RoPE on q and k. Through one C node (`attention_inputs.qkv_heads`) where the GEMM
        was merged and the C kernels take the operands, else the views of the split output."""
        B, T, _ = x.shape
        qkv = linear_group(x, (self.q_proj, self.k_proj, self.v_proj), split=False)
        q_norm, k_norm = self._qk_norm("q_norm"), self._qk_norm("k_norm")
        same_norms = (q_norm is None and k_norm is None) or (
            q_norm is not None and k_norm is not None and q_norm.eps == k_norm.eps
        )
        if isinstance(qkv, Tensor) and same_norms:
            got = attention_inputs.qkv_heads(
                qkv,
                (self.n_heads, self.n_kv_heads, self.head_dim),
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight,
                0.0 if q_norm is None else q_norm.eps,
                cos,
                sin,
            )
            if got is not None:
                return got
        if isinstance(qkv, Tensor):
            sizes = [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2
            qkv = list(qkv.split(sizes, dim=-1))
        q, k, v = qkv
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = self._norm_rope(q, q_norm, cos, sin), self._norm_rope(k, k_norm, cos, sin)
        return q, k, v.transpose(1, 2)

    def _qk_norm(self, name: str) -> RMSNorm | None:
        """Qwen3's per-head q or k norm (``q_norm``/``k_norm``), None where the model has none."""
        found = getattr(self, name, None)
        return found if isinstance(found, RMSNorm) else None

    @staticmethod
    def _norm_rope(x: Tensor, norm: RMSNorm | None, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, T, heads, D] -> [B, heads, T, D]: Qwen3's per-head RMSNorm (``norm``, from
        `_qk_norm`; None where the model has none), then the rotary embedding; one C pass each
        way where it applies (`attention_inputs.norm_rope`), else the eager nodes."""
        weight = None if norm is None else norm.weight
        if attention_inputs.use_norm_rope(x, weight, cos, sin):
            y = attention_inputs.norm_rope(x, weight, 0.0 if norm is None else norm.eps, cos, sin)
            if y is not None:
                return y
        if norm is not None:
            x = norm(x)
        return rope(x.transpose(1, 2), cos, sin)


class GatedAttention(Attention):
    """Qwen3.5's full attention: q_proj yields each head's query and output gate; q/k norms,
    RoPE on the first `ModelConfig.rotary_dim` features; ``sigmoid(gate)`` scales each head's
    output before o_proj (`tinker_sr.engine.hybrid`)."""

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int, cache: KVCache | None, layer: int
    ) -> Tensor:
        B, T, _ = x.shape
        q, gate = split_gate(apply_linear(self.q_proj, x), self.n_heads, self.head_dim)
        k = apply_linear(self.k_proj, x).view(B, T, self.n_kv_heads, self.head_dim)
        v = apply_linear(self.v_proj, x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = (
            partial_rope(norm(t).transpose(1, 2), cos, sin, _rope_contiguous)
            for t, norm in ((q, self.q_norm), (k, self.k_norm))
        )
        y = self._attend(q, k, v.transpose(1, 2), start_pos, cache, layer)
        return apply_linear(self.o_proj, y * torch.sigmoid(gate))


def _rope_contiguous(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return rope(x.contiguous(), cos, sin)


def _causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal SDPA; under CPU bf16 autocast and in a bf16 checkpoint's training step
    (`bf16_attention.suits_bf16_weights`) bf16 batched GEMMs around a float32-accumulated
    softmax: torch's CPU flash attention backward is 1.8-11x slower on bf16 inputs."""
    kind = q.device.type
    if kind == "cpu" and torch.is_autocast_enabled(kind):
        if torch.get_autocast_dtype(kind) == torch.bfloat16:
            return bf16_causal_attention(q, k, v)
        with torch.autocast(kind, enabled=False):
            q, k, v = q.float(), k.float(), v.float()
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if suits_bf16_weights(q, k, v):
        return bf16_causal_attention(q, k, v)
    if compiled.use_attention(q, k, v):  # the C kernel (default; $TINKER_SR_NATIVE)
        y = compiled.attention(q, k, v)
        if y is not None:
            return y
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        width = width or config.ffn_dim
        self.gate_proj = nn.Linear(config.dim, width, bias=False)
        self.up_proj = nn.Linear(config.dim, width, bias=False)
        self.down_proj = nn.Linear(width, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_mlp(x, self.gate_proj, self.up_proj, self.down_proj)


class SparseMoe(nn.Module):
    """Qwen3-MoE's feed-forward: a bias-free linear router (``gate``) scores the experts, each
    token goes to the `experts_per_token` most probable (softmax in float32; their
    probabilities renormalised to sum 1 where `norm_topk_prob`, then cast to the activations'
    dtype), and its output is the weighted sum of their SwiGLU outputs, added in ascending
    expert order as transformers does. Each expert runs on the rows routed to it only.
    Qwen3.5-MoE adds a shared expert on every token, scaled by ``sigmoid(shared_expert_gate)``,
    after the routed sum."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.experts_per_token, config.norm_topk_prob
        self.top_logits = config.gpt_oss  # softmax over the top-k logits (`gpt_oss.route`)
        self.gate = nn.Linear(config.dim, config.n_experts, bias=config.gpt_oss)
        expert = ClampedMLP if config.gpt_oss else MLP
        self.experts = nn.ModuleList(
            expert(config, config.moe_ffn_dim) for _ in range(config.n_experts)
        )
        if config.shared_expert_ffn_dim:  # Qwen3.5-MoE: every token, scaled by a sigmoid gate
            self.shared_expert = MLP(config, config.shared_expert_ffn_dim)
            self.shared_expert_gate = nn.Linear(config.dim, 1, bias=False)

    def route(self, logits: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Router logits [N, E] -> (weights [N, k] in ``dtype``, expert indices [N, k])."""
        if self.top_logits:
            return top_logits_route(logits, self.top_k, dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(dtype), chosen

    def assignments(self, chosen: Tensor) -> list[tuple[int, Tensor, Tensor]]:
        """(expert, its rows, their slot in ``chosen``) for every expert some row chose, in
        ascending expert order; rows in ascending order."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = []
        for e, part in enumerate(order.split(counts)):
            if len(part):
                out.append((e, part // self.top_k, part % self.top_k))
        return out

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(apply_linear(self.gate, flat), flat.dtype)
        out = torch.zeros_like(flat)
        for e, rows, slot in self.assignments(chosen):
            y = self.experts[e](flat[rows])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if hasattr(self, "shared_expert"):
            gate = torch.sigmoid(apply_linear(self.shared_expert_gate, flat))
            out = out + gate * self.shared_expert(flat)
        return out.view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        if config.is_linear(index):
            self.linear_attn = GatedDeltaNet(config)
        else:
            attention = GatedAttention if config.attn_output_gate else Attention
            self.self_attn = attention(config, config.window(index))
        self.mlp: MLP | SparseMoe = SparseMoe(config) if index in config.moe_layers else MLP(config)
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int, cache: KVCache | None, layer: int
    ) -> Tensor:
        h, m = self.forward_pending(x, None, cos, sin, start_pos, cache, layer)
        return h + m

    def forward_pending(
        self,
        x: Tensor,
        pending: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        start_pos: int,
        cache: KVCache | None,
        layer: int,
    ) -> tuple[Tensor, Tensor]:
        """The layer on the residual stream ``x + pending`` (``pending``: the previous layer's
        MLP output, or None), each residual add folded into the RMSNorm after it
        (`add_rms_norm`). Returns ``(h, m)``: the layer's output is ``h + m``, left for the next
        layer's (or the final) norm to add."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        x, n = add_rms_norm(x, pending, norm1.weight, norm1.eps, low_out=True)
        if hasattr(self, "linear_attn"):
            a = self.linear_attn(n, start_pos, cache, layer)
        else:
            a = self.self_attn(n, cos, sin, start_pos, cache, layer)
        h, n = add_rms_norm(x, a, norm2.weight, norm2.eps, low_out=True)
        return h, self.mlp(n)


class Backbone(nn.Module):
    """Holds the HF `model.*` submodules; the loop over layers lives in Transformer.forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain attribute, not a buffer: RoPE frequencies stay float32 under model.to(bf16).
        self.inv_freq = rope_inv_freq(config)
        # Activation checkpointing per decoder layer (long sequences: memory for compute):
        # True, False, or None = automatic (`checkpoint_pays`).
        self.checkpoint_layers: bool | None = False
        # Training under torch.autocast in this dtype (bf16 mixed precision); None = off.
        self.autocast_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def rope_scale(self) -> float:
        """YaRN's scale on cos and sin (`rope.rope_attention_factor`; 1.0 otherwise)."""
        return rope_attention_factor(self.config)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(self.config, batch_size, max_len, self.dtype, self.device)

    def forward(
        self,
        tokens: Tensor,
        *,
        start_pos: int = 0,
        cache: KVCache | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """tokens [B, T] → float32 logits [B, T, V] on the model's device (`hidden_states`)."""
        x = self.hidden_states(tokens, start_pos=start_pos, cache=cache, attn_mask=attn_mask)
        return apply_linear(self.lm_head, x).float()

    def last_logits(
        self, tokens: Tensor, *, start_pos: int = 0, cache: KVCache | None = None
    ) -> Tensor:
        """tokens [B, T] at start_pos → float32 logits [B, V] after the last token: a prefill
        unembeds only that position, not the other T - 1."""
        x = self.hidden_states(tokens, start_pos=start_pos, cache=cache)[:, -1:]
        return apply_linear(self.lm_head, x).float()[:, -1]

    def hidden_states(
        self,
        tokens: Tensor,
        *,
        start_pos: int = 0,
        cache: KVCache | None = None,
        attn_mask: Tensor | None = None,
        kept_tokens: int | None = None,
    ) -> Tensor:
        """tokens [B, T] → the final-normed hidden states [B, T, D] that `lm_head` unembeds
        (a loss can unembed them in chunks instead of materialising [B, T, V] logits).
        kept_tokens: what backward holds at once when this is one of several forwards before it
        (a call's length groups; default B x T), as `checkpoint_pays` counts them.

        attn_mask [B, T] (bool or 0/1) marks real tokens of a right-padded batch. Under causal
        attention a real token never attends to a later position, so right padding cannot leak
        into real positions and the fast `is_causal` kernel stays exact; the mask only makes pad
        ids harmless (they may be any value, e.g. -1) and is checked to really be right padding.
        Logits at pad positions are meaningless.
        """
        tokens = tokens.to(self.device)  # CPU-built inputs; a no-op on a CPU model
        if attn_mask is not None:
            attn_mask = attn_mask.to(self.device)
            if cache is not None:
                raise ValueError(
                    "attn_mask is for full-sequence (training) forwards, not cached decode"
                )
            valid = attn_mask.to(torch.bool)
            if valid.shape != tokens.shape:
                raise ValueError(
                    f"attn_mask shape {tuple(valid.shape)} != tokens {tuple(tokens.shape)}"
                )
            lengths = valid.sum(1, keepdim=True)
            if not torch.equal(valid, torch.arange(tokens.shape[1], device=self.device) < lengths):
                raise ValueError(
                    "attn_mask must be right padding: each row all True, then all False"
                )
            tokens = tokens.masked_fill(~valid, 0)
        T = tokens.shape[1]
        if start_pos + T > self.config.max_seq_len:
            raise EngineUserError(
                f"sequence of {start_pos + T} tokens exceeds the model's max_seq_len "
                f"{self.config.max_seq_len}; shorten it by {start_pos + T - self.config.max_seq_len}"
            )

        x = self.model.embed_tokens(tokens)
        cos, sin = rope_angles(self.inv_freq, start_pos, T, x.dtype, x.device, self.rope_scale)
        recompute = cache is None and torch.is_grad_enabled()
        if recompute and self.checkpoint_layers is None:
            recompute = checkpoint_pays(self.config, kept_tokens or tokens.numel(), self.device)
        else:
            recompute = recompute and bool(self.checkpoint_layers)
        norm = self.model.norm
        if recompute:
            for i, layer in enumerate(self.model.layers):
                # Keep only each layer's input; its activations are recomputed in backward.
                x = checkpoint(layer, x, cos, sin, start_pos, None, i, use_reentrant=False)
            return norm(x)  # type: ignore[no-any-return]
        pending = None  # each layer's last residual add, done by the next norm
        for i, layer in enumerate(cast(Sequence[DecoderLayer], self.model.layers)):
            x, pending = layer.forward_pending(x, pending, cos, sin, start_pos, cache, i)
        return add_rms_norm(x, pending, norm.weight, norm.eps)[1]


def activation_bytes(config: ModelConfig, tokens: int, device: torch.device | str = "cpu") -> int:
    """Estimated bytes a training forward of ``tokens`` tokens on ``device`` keeps for backward
    in float32: per layer and token the two norms' inputs and outputs, q/k before their norms,
    q/k/v and the output of attention, and the MLP's gate and up projections."""
    q = config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    attention = 4 * config.dim + (4 if config.attn_output_gate else 3) * q + 3 * kv
    linear = sum(config.is_linear(i) for i in range(config.n_layers))
    moe = len(config.moe_layers)  # each token keeps k experts' gate and up, and its input
    moe_token = config.experts_per_token * (2 * config.moe_ffn_dim + config.dim)
    mlp = (config.n_layers - moe) * 2 * config.ffn_dim + moe * moe_token
    mixers = (config.n_layers - linear) * attention + linear * linear_activations(config, device)
    return 4 * tokens * (mixers + mlp)


def checkpoint_pays(
    config: ModelConfig, tokens: int, device: torch.device = torch.device("cpu")
) -> bool:
    """The automatic activation-checkpointing policy: on when the estimated activations (x2
    for backward's transients) would take more than half of the memory still available on
    ``device`` (host memory for the CPU, the GPU's free memory for CUDA)."""
    room = free_memory(device)
    return room is not None and 2 * activation_bytes(config, tokens, device) > room // 2


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Unique parameters (a tied embedding counts once)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad or not trainable_only}
    return sum(p.numel() for p in params.values())


def _stable_seed(*parts: object) -> int:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _empty_model(config: ModelConfig, dtype: torch.dtype) -> Transformer:
    """Allocate without nn.Linear's default init (`skeleton`)."""
    if config.moe_layers:  # more product shapes a step than a dense model's
        cpu.widen_kernel_caches(cpu.MOE_KERNEL_CACHE_ENTRIES)
    with on_meta():
        model = Transformer(config).to(dtype)
    model.to_empty(device="cpu")
    if config.tie_embeddings:  # to_empty allocates each module's parameters separately
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)
    return model


def build_model(
    name_or_config: str | ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Transformer:
    """A randomly initialised model; same (name, seed) ⇒ bit-identical weights in any process.

    Linear and embedding weights ~ N(0, 0.02²), drawn in float32 from a generator seeded by a
    hash of (name, seed) in `named_parameters` order, then cast to `dtype`; norm gains are 1.
    """
    if isinstance(name_or_config, str):
        if name_or_config not in BUILTIN_CONFIGS:
            raise EngineNotFoundError(
                f"unknown base model {name_or_config!r}; built-in models are "
                f"{sorted(BUILTIN_CONFIGS)} (or load a local Hugging Face directory with "
                "load_pretrained)"
            )
        config = BUILTIN_CONFIGS[name_or_config]
    else:
        config = name_or_config
    model = _empty_model(config, torch.float32)
    gen = torch.Generator().manual_seed(_stable_seed("tinker_sr.build_model", config.name, seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.to(dtype)


# --- Hugging Face directories -------------------------------------------------------------


def save_pretrained(model: Transformer, path: str | os.PathLike[str]) -> None:
    """Write config.json + model.safetensors in the Hugging Face layout."""
    from tinker_sr.engine.checkpoints import save_tensors
    from tinker_sr.engine.export import state_to_hf
    from tinker_sr.engine.hf_config import config_to_hf

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    save_tensors(out / "model.safetensors", state_to_hf(model.config, sd), {"format": "pt"})
    hf = config_to_hf(model.config)
    hf["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2))


def load_pretrained(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = torch.float32
) -> Transformer:
    """Load a local HF directory (config.json + *.safetensors; the architectures of
    `tinker_sr.engine.hf_config`) into a Transformer in `dtype` (None: the checkpoint's own dtype).
    See `tinker_sr.engine.hf.load_model_dir`."""
    from tinker_sr.engine.hf import load_model_dir

    return load_model_dir(path, dtype=dtype)
