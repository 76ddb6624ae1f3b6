"""Qwen3.5's hybrid decoder layers: gated DeltaNet linear attention and gated full attention.

Qwen3.5 (``Qwen3_5ForConditionalGeneration`` on the Hub; its text model, the one RL trains, is
``Qwen3_5ForCausalLM``) interleaves two token mixers, as ``layer_types`` lists them (by default
three ``linear_attention`` layers, then one ``full_attention``):

- `GatedDeltaNet`, linear attention with a recurrent state per head ([key dim, value dim]) in
  place of a KV cache. Each token: q, k, v from one projection through a causal depthwise
  convolution (kernel 4) and SiLU; q and k L2-normalised; a decay ``g = -exp(A_log) *
  softplus(a + dt_bias)`` and a write strength ``beta = sigmoid(b)`` per value head; the state
  decays by ``exp(g)`` and takes the delta-rule update ``S += k (beta (v - S^T k))^T``; the
  output ``S^T q / sqrt(d_k)`` goes through an RMSNorm gated by ``silu(z)`` and ``out_proj``.
  Training and prefill run the recurrence over whole sequences (`gated_delta_rule`: position
  by position in C on a CPU, else its chunked (WY) form); decode runs one step per token
  (`gated_delta_step`).
- `GatedAttention`, causal softmax attention whose ``q_proj`` also yields a per-head output gate
  (``sigmoid``, applied before ``o_proj``), with q/k RMSNorms and RoPE on the first
  ``partial_rotary_factor`` of each head (a quarter).

The checkpoint's fused ``in_proj_qkv`` is held as three projections, ``in_proj_q``, ``in_proj_k``,
``in_proj_v`` (one GEMM where `fused.linear_group` merges them): that is how Tinker names the
adapters it trains on this model (tinker-cookbook's Qwen3.5 merge splits them back). Qwen3.5's
RMSNorm gains are stored as offsets from 1 (``(1 + w) * x``); the engine holds ``1 + w``
(`NORM_OFFSET_KEYS`) and writes ``w`` back on export.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinker_sr.engine.delta_native import (
    delta_rule,
    delta_rule_runs,
    deltanet_heads,
    deltanet_runs,
    gated_delta_step_,
    gated_rms_norm,
    short_conv_silu,
    unit_lower_solve,
)
from tinker_sr.engine.fused import apply_linear, linear_group
from tinker_sr.user_errors import EngineUserError

if TYPE_CHECKING:
    from tinker_sr.engine.model import KVCache, ModelConfig

CHUNK = 64  # positions per chunk of the WY form (transformers and FLA use 64)
# Decays below exp(DECAY_FLOOR) (~9e-14, far below float32's precision beside the undecayed
# terms every sum holds) are exact zeros in the chunked form: left as they were, the tails of
# fast-decaying heads ran into float32's subnormal range, whose arithmetic x86 does in slow
# microcode, and made a Qwen3.5 step ~1.3x slower (`linear_attention.py --baseline floor`).
DECAY_FLOOR = -30.0
QKV = ("in_proj_q", "in_proj_k", "in_proj_v")
LAYER_KINDS = frozenset({"full_attention", "linear_attention"})  # config layer_types entries
# Gains stored as offsets from 1 in a Qwen3.5 checkpoint (the linear attention's gated norm,
# ``linear_attn.norm``, is a plain gain).
NORM_OFFSET_SUFFIXES = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)
NORM_OFFSET_KEYS = ("model.norm.weight",)
FUSED_QKV = "linear_attn.in_proj_qkv.weight"
# Experts stored as 3-D tensors (transformers 5's in-memory layout, which some checkpoints keep).
FUSED_EXPERTS, FUSED_EXPERTS_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
UNUSED_PREFIXES = ("model.visual.", "mtp.")  # the vision tower; multi-token prediction


def check_config(config: ModelConfig) -> None:
    """`ModelConfig`'s checks of the hybrid fields (`EngineUserError` naming them)."""
    kinds = LAYER_KINDS | {"sliding_attention"}  # gpt-oss's windowed layers
    if config.layer_types and (
        len(config.layer_types) != config.n_layers or not set(config.layer_types) <= kinds
    ):
        raise EngineUserError(
            f"model config {config.name!r}: layer_types must name each of the "
            f"{config.n_layers} layers one of {sorted(kinds)}, got {config.layer_types}"
        )
    if "sliding_attention" in config.layer_types and config.sliding_window < 1:
        raise EngineUserError(
            f"model config {config.name!r}: sliding_attention layers need sliding_window >= 1, "
            f"got {config.sliding_window}"
        )
    rotary = config.rotary_dim
    if rotary is not None and not (0 < rotary <= config.head_dim and rotary % 2 == 0):
        raise EngineUserError(
            f"model config {config.name!r}: rotary_dim={rotary} must be even and at most "
            f"head_dim={config.head_dim}"
        )
    if not config.hybrid:
        return
    sizes = (config.linear_k_heads, config.linear_v_heads, config.linear_k_dim, config.linear_v_dim)
    if min(sizes) < 1 or config.linear_conv < 1 or config.linear_v_heads % config.linear_k_heads:
        raise EngineUserError(
            f"model config {config.name!r}: linear attention needs positive head counts, "
            f"widths and kernel, value heads a multiple of key heads; got k/v heads "
            f"{config.linear_k_heads}/{config.linear_v_heads}, widths {config.linear_k_dim}/"
            f"{config.linear_v_dim}, kernel {config.linear_conv}"
        )


def linear_activations(config: ModelConfig, device: torch.device | str = "cpu") -> int:
    """Float32 values per token a gated DeltaNet layer keeps (estimate): the norms, the
    projections, the convolution's input window and its output before and after SiLU (the C
    convolution, where it runs on ``device``, keeps its input and output only), q/k/v before
    and after normalising (q and k repeated per value head), what the rule saves, the output
    and its gated norm (the C norm keeps its two inputs only). The chunked rule's share per
    value head and token, ``7 * CHUNK + 9 * Dk +
    2 * Dv + Dk * Dv / CHUNK`` (its decay, system and attention rows, the masks, u, w, the
    decayed q and k, one state per chunk), was counted with saved-tensor hooks over head
    widths 32-128 (6.3 CHUNK-wide rows, rounded up). The C rule, where it runs on ``device``
    (`delta_native.delta_rule`), keeps its inputs (q, k, v, g, beta: ``2 * Dk + Dv + 2``) and
    one state per CHUNK positions."""
    keys, values = (
        config.linear_k_heads * config.linear_k_dim,
        config.linear_v_heads * config.linear_v_dim,
    )
    k, v = config.linear_k_dim, config.linear_v_dim
    repeated = config.linear_v_heads * k
    channels = 2 * keys + values
    share = 2 * k + v + 2 if delta_rule_runs(torch.device(device)) else 7 * CHUNK + 9 * k + 2 * v
    chunk = config.linear_v_heads * (share + k * v // CHUNK)
    in_c = deltanet_runs(torch.device(device))  # the C convolution, heads and gated norm
    conv, norm = (2 * channels, 2 * values) if in_c else (3 * channels, 4 * values)
    return 4 * config.dim + conv + 2 * (2 * repeated + values) + chunk + norm


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule over a sequence, chunk by chunk (float32 inputs).

    q, k [B, T, H, Dk] (L2-normalised, one per value head), v [B, T, H, Dv], g (log decay,
    <= 0) and beta [B, T, H], state [B, H, Dk, Dv] or None (zeros). Returns (out [B, T, H, Dv],
    the state after the last position). Within a chunk the updates are condensed by the
    UT transform, ``(I + strictly_lower(beta K K^T * decay))^-1``, into matrix products; the
    state is carried from chunk to chunk. No in-place writes: autograd differentiates it.
    Decays under ``exp(DECAY_FLOOR)`` are zeros (`decay_exp`).

    On the CPU in float32 or float64 the same recurrence runs position by position in C
    (`delta_native.delta_rule`: at these sizes faster than the chunked form's small products,
    forward and backward); this chunked form runs elsewhere and with the C kernels off."""
    native = delta_rule(q, k, v, g, beta, state, DECAY_FLOOR, CHUNK)
    if native is not None:
        return native
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q = q * Dk**-0.5
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
    pad = -T % CHUNK
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // CHUNK
    q, k, v = (t.reshape(B, H, n, CHUNK, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, CHUNK), beta.reshape(B, H, n, CHUNK)
    kb, vb = k * beta[..., None], v * beta[..., None]
    gc = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = decay_exp((gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")))
    system = (kb @ k.transpose(-1, -2)) * decay  # the solve reads its strictly lower part
    u = unit_lower_solve(system, vb)
    from_start = decay_exp(gc)[..., None]  # each position's decay since the chunk's start
    # w's rows past the floor are zeros: their rows of the system are zeroed too, or the solve
    # would form them from products (decay from j times j's from_start) below the floor.
    w_system = system * (from_start > 0)
    w = unit_lower_solve(w_system, kb * from_start)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * from_start
    k_dec = k * decay_exp(gc[..., -1:] - gc)[..., None]
    chunk_decay = decay_exp(gc[..., -1])[..., None, None]
    s = torch.zeros(B, H, Dk, Dv, dtype=q.dtype, device=q.device) if state is None else state
    outs = []
    # Chunks through unbind, not t[:, :, i]: each such slice's backward would zero-fill and add
    # a whole [B, H, n, CHUNK, CHUNK] gradient (n per tensor).
    chunks = zip(*(t.unbind(2) for t in (u, w, q_dec, inner, k_dec, chunk_decay)), strict=True)
    for u_i, w_i, q_i, inner_i, k_i, decay_i in chunks:
        v_new = u_i - w_i @ s
        outs.append(q_i @ s + inner_i @ v_new)
        s = s * decay_i + k_i.transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(B, H, n * CHUNK, Dv)[:, :, :T]
    return out.transpose(1, 2), s


def decay_exp(log_decay: Tensor) -> Tensor:
    """``exp(log_decay)``, zero where ``log_decay < DECAY_FLOOR`` (gradient zero there too)."""
    return log_decay.masked_fill(log_decay < DECAY_FLOOR, float("-inf")).exp()


def gated_delta_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One position of the gated delta rule: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H],
    state [B, H, Dk, Dv] -> (out [B, H, Dv], new state). Elementwise products and reductions
    over each row's own values only, so a row's result does not depend on the rows beside it.
    A decay under ``exp(DECAY_FLOOR)`` is zero, as in the chunked form."""
    q = q * q.shape[-1] ** -0.5
    s = state * decay_exp(g)[..., None, None]
    read = (s * k[..., None]).sum(-2)
    s = s + k[..., None] * ((v - read) * beta[..., None])[..., None, :]
    return (s * q[..., None]).sum(-2), s


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's output, then gated by ``silu(z)`` (float32 gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """-> ``dtype`` (default x's). The C pass computes in float32 from x as it is (the
        rule's float32 output); torch's ops round x to ``dtype`` first, as transformers does."""
        dtype = dtype or x.dtype
        out = gated_rms_norm(x, z, self.weight, self.eps)  # one C pass a row, where it applies
        if out is not None:
            return out.to(dtype)
        x = x.to(dtype)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention token mixer (``linear_attn``); see the module docstring."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.k_heads, self.v_heads = c.linear_k_heads, c.linear_v_heads
        self.k_dim, self.v_dim = c.linear_k_dim, c.linear_v_dim
        keys, values = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.channels = 2 * keys + values
        self.kernel = c.linear_conv
        self.in_proj_q = nn.Linear(c.dim, keys, bias=False)
        self.in_proj_k = nn.Linear(c.dim, keys, bias=False)
        self.in_proj_v = nn.Linear(c.dim, values, bias=False)
        self.in_proj_z = nn.Linear(c.dim, values, bias=False)
        self.in_proj_b = nn.Linear(c.dim, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(c.dim, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.channels, self.channels, self.kernel, groups=self.channels, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, c.norm_eps)
        self.out_proj = nn.Linear(values, c.dim, bias=False)

    def forward(self, x: Tensor, start_pos: int, cache: KVCache | None, layer: int) -> Tensor:
        """x [B, T, dim]: a whole sequence (no cache), a prefill (start_pos 0; B may be 1 for
        every cache row) or a continuation from the cache's states."""
        B, T, _ = x.shape
        qkv = linear_group(x, [getattr(self, n) for n in QKV], split=False)  # merged: whole
        qkv = qkv if isinstance(qkv, Tensor) else torch.cat(qkv, -1)  # [B, T, channels]
        z, b, a = (apply_linear(getattr(self, f"in_proj_{n}"), x) for n in "zba")
        resume = cache is not None and start_pos > 0
        # B may be 1 for every cache row (a prefill chunk): all rows hold the same window.
        before = cache.conv[layer][:B].to(qkv.dtype) if resume and cache is not None else None
        mixed = short_conv_silu(qkv, self.conv1d.weight, before)  # [B, T, channels], in C
        if mixed is None:
            qkv_t = qkv.transpose(1, 2)
            window = (
                F.pad(qkv_t, (self.kernel - 1, 0))
                if before is None
                else torch.cat([before, qkv_t], -1)
            )
            conv = F.conv1d(window, self.conv1d.weight, groups=self.channels)
            mixed = F.silu(conv).transpose(1, 2)
        if cache is not None:  # the window after x (``before`` is a view of it): its last inputs
            keep = self.kernel - 1
            prev = before if before is not None else qkv.new_zeros(B, self.channels, keep)
            tail = qkv[:, max(T - keep, 0) :].transpose(1, 2)
            window = torch.cat([prev, tail], -1)
            cache.conv[layer].copy_(window[..., window.shape[-1] - keep :])
        q, k, v, g, beta = self._heads(mixed, a, b)
        state = cache.state[layer][:B] if resume and cache is not None else None
        with torch.autocast(x.device.type, enabled=False):  # the recurrence stays in float32
            y, s = gated_delta_rule(q, k, v, g, beta, state)
        if cache is not None:
            cache.state[layer].copy_(s)
        y = self.norm(y, z.view(B, T, self.v_heads, self.v_dim), x.dtype)
        return apply_linear(self.out_proj, y.reshape(B, T, -1))

    def _heads(self, mixed: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
        """mixed [..., channels] (after the convolution) and the a, b projections -> float32
        q, k (L2-normalised, repeated per value head), v [..., heads, dims], g and beta
        [..., v_heads]."""
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        dims = (self.k_heads, self.v_heads, self.k_dim, self.v_dim)
        heads = deltanet_heads(mixed, *dims)  # one C pass, heads-major views, where it applies
        if heads is not None:
            return (*heads, g, beta)
        keys = self.k_heads * self.k_dim
        q, k, v = mixed.split([keys, keys, self.v_heads * self.v_dim], -1)
        lead = mixed.shape[:-1]
        q = q.reshape(*lead, self.k_heads, self.k_dim).float()
        k = k.reshape(*lead, self.k_heads, self.k_dim).float()
        v = v.reshape(*lead, self.v_heads, self.v_dim).float()
        if self.v_heads != self.k_heads:  # each key head serves consecutive value heads
            rep = self.v_heads // self.k_heads
            q, k = q.repeat_interleave(rep, -2), k.repeat_interleave(rep, -2)
        return l2norm(q), l2norm(k), v, g, beta

    def step(
        self, qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, conv: Tensor, state: Tensor
    ) -> Tensor:
        """One decode position for n rows from their projections (qkv [n, channels], z, b, a),
        each row's convolution window ``conv`` [n, channels, kernel - 1] and ``state``, both
        advanced in place -> the gated norm's output [n, value heads * width], before
        ``out_proj``. Elementwise and per-row reductions only: a row's result does not depend
        on the rows beside it (decode batches many requests)."""
        n = qkv.shape[0]
        window = torch.cat([conv.to(qkv.dtype), qkv[..., None]], -1)  # [n, C, kernel]
        conv.copy_(window[..., 1:])
        taps = self.conv1d.weight[:, 0]
        if deltanet_runs(qkv.device):  # in float32, as prefill's and training's C convolution
            window, taps = window.float(), taps.float()
        mixed = F.silu((window * taps).sum(-1))
        q, k, v, g, beta = self._heads(mixed, a, b)
        y = gated_delta_step_(q, k, v, g, beta, state, DECAY_FLOOR)  # the C kernel, in place
        if y is None:
            y, s = gated_delta_step(q, k, v, g, beta, state)
            state.copy_(s)
        y = self.norm(y, z.view(n, self.v_heads, self.v_dim), qkv.dtype)
        return y.reshape(n, -1)


def partial_rope(
    x: Tensor, cos: Tensor, sin: Tensor, rotate: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> Tensor:
    """``rotate`` (a RoPE function of x, cos, sin) on the first ``cos.shape[-1]`` features of
    each head, the rest passed through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat([rotate(x[..., :r], cos, sin), x[..., r:]], -1)


def split_gate(q_and_gate: Tensor, heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Qwen3.5's q_proj output [..., heads * 2 * head_dim] -> (q [..., heads, head_dim], gate
    [..., heads * head_dim]): each head's query, then its gate."""
    lead = q_and_gate.shape[:-1]
    q, gate = q_and_gate.view(*lead, heads, 2 * head_dim).chunk(2, -1)
    return q, gate.reshape(*lead, heads * head_dim)


def to_engine(key: str, tensor: Tensor, config: ModelConfig) -> list[tuple[str, Tensor]]:
    """A Qwen3.5 checkpoint tensor as the engine's tensors: ``in_proj_qkv`` split three ways,
    norm gains as ``1 + w`` (in float32), the ``model.language_model.`` prefix dropped."""
    key = engine_key(key)
    if key.endswith(FUSED_QKV):
        keys = config.linear_k_heads * config.linear_k_dim
        values = config.linear_v_heads * config.linear_v_dim
        parts = tensor.split([keys, keys, values], 0)
        stem = key.removesuffix("in_proj_qkv.weight")
        return [(f"{stem}{n}.weight", p) for n, p in zip(QKV, parts, strict=True)]
    if key.endswith(NORM_OFFSET_SUFFIXES) or key in NORM_OFFSET_KEYS:
        return [(key, tensor.float() + 1.0)]
    if key.endswith(FUSED_EXPERTS):  # [E, 2F, D]: each expert's gate rows, then its up rows
        stem = key.removesuffix("gate_up_proj")
        return [
            (f"{stem}{e}.{name}.weight", part)
            for e, pair in enumerate(tensor)
            for name, part in zip(("gate_proj", "up_proj"), pair.chunk(2, 0), strict=True)
        ]
    if key.endswith(FUSED_EXPERTS_DOWN):  # [E, D, F]
        stem = key.removesuffix("down_proj")
        return [(f"{stem}{e}.down_proj.weight", t) for e, t in enumerate(tensor)]
    return [(key, tensor)]


def engine_key(key: str) -> str:
    return (
        "model." + key.removeprefix("model.language_model.")
        if key.startswith("model.language_model.")
        else key
    )


def to_hf(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The engine's state dict as a Qwen3.5 text checkpoint (``Qwen3_5ForCausalLM``'s names):
    q/k/v fused back into ``in_proj_qkv``, norm gains written as offsets from 1."""
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        stem, _, leaf = key.rpartition(".linear_attn.")
        if leaf == "in_proj_q.weight":
            fused = [state[f"{stem}.linear_attn.{n}.weight"] for n in QKV]
            out[f"{stem}.linear_attn.in_proj_qkv.weight"] = torch.cat(fused, 0)
        elif leaf in ("in_proj_k.weight", "in_proj_v.weight"):
            continue  # fused with in_proj_q
        elif key.endswith(NORM_OFFSET_SUFFIXES) or key in NORM_OFFSET_KEYS:
            out[key] = (t.float() - 1.0).to(t.dtype)
        else:
            out[key] = t
    return out


def fuse_qkv_adapters(adapters: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """LoRA adapters with each linear-attention layer's q, k and v adapters (rank r each) as
    one adapter of rank 3r on the checkpoint's fused ``in_proj_qkv``: A stacked, B block
    diagonal, so ``B A`` is exactly the three updates stacked. The rest unchanged."""
    out: dict[str, Tensor] = {}
    for key, t in adapters.items():
        stem, _, leaf = key.rpartition(".linear_attn.")
        if leaf == "in_proj_q.lora_A.weight":
            a = [adapters[f"{stem}.linear_attn.{n}.lora_A.weight"] for n in QKV]
            b = [adapters[f"{stem}.linear_attn.{n}.lora_B.weight"] for n in QKV]
            out[f"{stem}.linear_attn.in_proj_qkv.lora_A.weight"] = torch.cat(a, 0)
            out[f"{stem}.linear_attn.in_proj_qkv.lora_B.weight"] = torch.block_diag(*b)
        elif not (leaf and leaf.split(".")[0] in QKV):
            out[key] = t
    return out
