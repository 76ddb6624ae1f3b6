"""One decode step for the rows of many sampling requests at once, with results that do not
depend on what else is in the batch.

Rows of different requests share every row-wise operation of a decode step (the projections,
the MLP, the norms and the unembedding: ~94 % of its FLOPs); attention runs per request on its
own KV cache at its own position, with exactly the shapes it has when the request runs alone.

Determinism across batch compositions. A float32 GEMM on this kind of CPU is not batch
invariant: ``F.linear(x[:M], W)[0]`` differs between M = 1, M = 2..3 and M >= 4, because the
BLAS picks its kernel and blocking by M. For a fixed M each row's result is independent of the
other rows, and for M a multiple of CHUNK (8) one GEMM usually equals running it in CHUNK-row
slices. So every decode GEMM runs on a row count padded to a multiple of CHUNK, and at first
use per (weight shape, dtype, bias, threads, M) a probe checks that one GEMM equals its
CHUNK-row slices and that a row's result does not depend on its neighbours; where the probe
fails (another BLAS, another CPU), that GEMM runs slice by slice, and where even a CHUNK-row
product's rows depend on their places (MKL's AVX2 kernel: ``MKL_ENABLE_INSTRUCTIONS=AVX2``
reproduces it on any x86 CPU), row by row (`gemm_mode`). Either way a row's logits do not
depend on the other rows, and a request alone runs the very same code.
``$TINKER_SR_DECODE_CHUNKED=1`` forces the slice-by-slice path.

The products run through `gemm.packed_linear` (oneDNN on weights reordered once, where the
torch build has it; whether it applies is decided at CHUNK rows, so a row never changes
library with the batch), and the probe checks exactly that path. Projections of one input
(q/k/v, gate/up) run as one product by their weights stacked (`linear_rows_many`) where a
second probe per shape and row count shows that gives the very same values; each parallel
product wakes the other cores once, and on some VMs a wake-up costs ~90 us.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinker_sr.engine.fused import rotate_eager
from tinker_sr.engine.gemm import packed_linear, stacked_linear
from tinker_sr.engine.gpt_oss import ClampedMLP, sink_attention
from tinker_sr.engine.hybrid import QKV, GatedDeltaNet, partial_rope, split_gate
from tinker_sr.engine.lora import LoraLinear
from tinker_sr.engine.model import (
    MLP,
    Attention,
    DecoderLayer,
    GatedAttention,
    KVCache,
    SparseMoe,
    Transformer,
    rope_angles,
)

CHUNK = 8
GemmMode = Literal["whole", "slices", "rows"]
GATE_WIDTH = 16  # columns a one-column sigmoid is widened to (`_moe_rows`)
FORCE_CHUNKED_ENV = "TINKER_SR_DECODE_CHUNKED"

# (out, in, dtype, bias, threads, M) -> how decode runs that GEMM over M rows (`gemm_mode`)
_invariant: dict[tuple[int, int, torch.dtype, bool, int, int], GemmMode] = {}


def padded_rows(m: int) -> int:
    """The row count a decode step of ``m`` rows runs at (a multiple of CHUNK)."""
    return max(CHUNK, -(-m // CHUNK) * CHUNK)


def _probe(weight: Tensor, bias: Tensor | None, m: int) -> bool:
    """`_rows_agree` for the GEMM by ``weight`` (and ``bias``) as decode runs it."""
    return _rows_agree(lambda x: packed_linear(x, weight, bias, CHUNK), weight, m)


def _rows_agree(product: Callable[[Tensor], Tensor], like: Tensor, m: int) -> bool:
    """``product`` over ``m`` random rows (``like``'s width, dtype and device) equals its
    CHUNK-row slices, and (m == CHUNK) a row's result does not depend on the other rows of
    its slice nor on its place in it."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, like.shape[1], generator=gen).to(like.device, like.dtype)
    whole = product(x)
    sliced = torch.cat([product(x[i : i + CHUNK]) for i in range(0, m, CHUNK)])
    if not torch.equal(whole, sliced):
        return False
    if m != CHUNK:
        return True
    other = torch.randn(m, like.shape[1], generator=gen).to(like.device, like.dtype)
    for place in range(m):
        mixed = other.clone()
        mixed[place] = x[0]
        if not torch.equal(product(mixed)[place], whole[0]):
            return False
    return True


def gemm_mode(weight: Tensor, bias: Tensor | None, m: int) -> GemmMode:
    """How decode runs the GEMM by this weight's shape and dtype over ``m`` rows (a multiple of
    CHUNK), probed once (`_probe`): ``"whole"``, one GEMM, where it equals its CHUNK-row slices
    and a CHUNK-row product's rows do not depend on each other or their places; ``"slices"``
    where only the latter holds; ``"rows"``, one row at a time, where a row's result depends on
    its place among CHUNK rows (MKL's AVX2 kernel computes rows 6 and 7 of 8 apart)."""
    threads = torch.get_num_threads()
    key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None, threads, m)
    hit = _invariant.get(key)
    if hit is None:
        if m == CHUNK:
            hit = "whole" if _probe(weight, bias, CHUNK) else "rows"
        else:
            hit = gemm_mode(weight, bias, CHUNK)
            if hit == "whole" and not _probe(weight, bias, m):
                hit = "slices"
        _invariant[key] = hit
    return hit


def _gemms(mod: nn.Linear) -> list[tuple[Tensor, Tensor | None]]:
    if isinstance(mod, LoraLinear):
        return [(mod.weight, mod.bias), (mod.lora_A.weight, None), (mod.lora_B.weight, None)]
    return [(mod.weight, mod.bias)]


def force_chunked() -> bool:
    return os.environ.get(FORCE_CHUNKED_ENV, "") not in ("", "0")


def _linear(mod: nn.Linear, x: Tensor) -> Tensor:
    """``mod(x)`` with every product through `gemm.packed_linear` (decode's rows are few:
    oneDNN on a weight reordered once reads it 2-5x faster than the BLAS, where available)."""
    if isinstance(mod, LoraLinear):  # an adapter on the shared base
        return mod.forward_with(x, _decode_linear)
    return _decode_linear(x, mod.weight, mod.bias)


def _decode_linear(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    return packed_linear(x, w, bias, CHUNK)


def linear_rows(mod: nn.Linear, x: Tensor) -> Tensor:
    """``mod(x)`` for x [M, in] with M a multiple of CHUNK, each row's result that of a
    CHUNK-row GEMM: one GEMM where the probe shows that is the same, else slice by slice; or,
    where even a CHUNK-row product's rows depend on their places, each row on its own (a
    copy: its own aligned memory), so its result never depends on the batch either way."""
    m = x.shape[0]
    modes = {gemm_mode(w, b, m) for w, b in _gemms(mod)}
    if "rows" in modes:
        return torch.cat([_linear(mod, x[i : i + 1].clone()) for i in range(m)])
    if "slices" in modes or force_chunked():
        return torch.cat([_linear(mod, x[i : i + CHUNK]) for i in range(0, m, CHUNK)])
    return _linear(mod, x)


# (outs, in, dtype, threads, M) -> does the stacked product give what linear_rows gives?
_stackable: dict[tuple[tuple[int, ...], int, torch.dtype, int, int], bool] = {}


def _stack_probe(weights: list[Tensor], m: int) -> bool:
    """On random rows: the stacked product (`gemm.stacked_linear`) over ``m`` and over CHUNK
    rows equals the separate products side by side, and its rows agree as `_rows_agree`
    asks of every decode GEMM. Then it gives what `linear_rows` gives on each weight,
    whichever way that runs it (one GEMM or slices). The separate products reorder their
    weights for this check only (nothing is kept on them: the decode path multiplies by the
    stacked copy alone)."""
    w = weights[0]
    gen = torch.Generator().manual_seed(m)
    for n in {m, CHUNK}:
        x = torch.randn(n, w.shape[1], generator=gen).to(w.device, w.dtype)
        got = stacked_linear(x, weights, CHUNK)
        # a fresh tensor object per weight: its packed copy is not kept (see gemm.packed_weight)
        want = torch.cat([packed_linear(x, v.detach(), None, CHUNK) for v in weights], dim=1)
        if got is None or not torch.equal(got, want):
            return False

    def stacked(x: Tensor) -> Tensor:
        y = stacked_linear(x, weights, CHUNK)
        assert y is not None  # judged at CHUNK rows, as above, whatever x's row count
        return y

    return _rows_agree(stacked, w, m) and (m == CHUNK or _rows_agree(stacked, w, CHUNK))


def linear_rows_many(mods: Sequence[nn.Linear], x: Tensor) -> list[Tensor]:
    """``[linear_rows(mod, x) for mod in mods]`` for projections of one input (q/k/v,
    gate/up): one product by their weights stacked (`gemm.stacked_linear`) where a probe per
    shape shows it gives the same values, so each parallel GEMM region wakes the cores once
    instead of once per projection. Adapters, biases and the forced slice-by-slice path run
    one by one."""
    plain = all(type(mod) is nn.Linear and mod.bias is None for mod in mods)
    rows = plain and any(gemm_mode(mod.weight, None, x.shape[0]) == "rows" for mod in mods)
    if plain and not rows and len(mods) > 1 and not force_chunked():
        weights = [mod.weight for mod in mods]
        w = weights[0]
        outs = tuple(int(v.shape[0]) for v in weights)
        key = (outs, int(w.shape[1]), w.dtype, torch.get_num_threads(), x.shape[0])
        ok = _stackable.get(key)
        if ok is None:
            ok = _stackable[key] = _stack_probe(weights, x.shape[0])
        y = stacked_linear(x, weights, CHUNK) if ok else None
        if y is not None:
            return [part.contiguous() for part in y.split(list(outs), dim=1)]
    return [linear_rows(mod, x) for mod in mods]


class DecodeRows(Protocol):
    """What `decode_step` needs of one request's rows."""

    cache: KVCache  # one row per sample of the request
    pos: int  # absolute position of the tokens fed this step

    @property
    def active(self) -> Tensor:
        """int64 indices of the rows still decoding (finished rows leave the batch)."""
        ...

    @property
    def fed_tokens(self) -> Tensor:
        """int64 [len(active)]: the token each active row feeds this step."""
        ...


def decode_step(model: Transformer, groups: Sequence[DecodeRows]) -> list[Tensor]:
    """Feed each group's active rows one token; returns float32 logits [len(active), V] per
    group. Every group must use ``model``; each group's cache advances by one position."""
    tokens = torch.cat([g.fed_tokens for g in groups])
    m = tokens.shape[0]
    padded = torch.zeros(padded_rows(m), dtype=torch.long, device=model.device)
    padded[:m] = tokens
    x = model.model.embed_tokens(padded)
    ropes = _row_angles(model, groups, x.dtype, x.device)
    layers = cast(Sequence[DecoderLayer], model.model.layers)
    for i, layer in enumerate(layers):
        h = layer.input_layernorm(x)
        if hasattr(layer, "linear_attn"):
            x = x + _linear_attention(layer.linear_attn, h, groups, i, m)
        else:
            x = x + _attention(layer.self_attn, h, groups, ropes, i)
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        x = x + (_moe_rows(mlp, h, m) if isinstance(mlp, SparseMoe) else mlp_rows(mlp, h))
    logits = linear_rows(model.lm_head, model.model.norm(x)).float().cpu()  # samplers: CPU
    sizes = [len(g.active) for g in groups]
    return list(logits[:m].split(sizes))


def mlp_rows(mlp: MLP | ClampedMLP, h: Tensor) -> Tensor:
    gate, up = linear_rows_many([mlp.gate_proj, mlp.up_proj], h)
    act = mlp.activation(gate, up) if isinstance(mlp, ClampedMLP) else F.silu(gate) * up
    return linear_rows(mlp.down_proj, act)


def _moe_rows(moe: SparseMoe, h: Tensor, m: int) -> Tensor:
    """The experts' weighted sum for the first ``m`` rows of h (the rest are padding). Each
    expert runs on its rows padded to a multiple of CHUNK, so a row's result is that of a
    CHUNK-row GEMM whatever else was routed with it; a row adds its experts in ascending
    order, as `SparseMoe.forward` does."""
    weights, chosen = moe.route(linear_rows(moe.gate, h)[:m], h.dtype)
    out = torch.zeros_like(h)
    for e, rows, slot in moe.assignments(chosen):
        n = len(rows)
        xs = torch.zeros(padded_rows(n), h.shape[1], dtype=h.dtype, device=h.device)
        xs[:n] = h[rows]
        y = mlp_rows(cast(MLP | ClampedMLP, moe.experts[e]), xs)[:n]
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if hasattr(moe, "shared_expert"):  # Qwen3.5-MoE: every row, as `SparseMoe.forward`
        # torch's vectorised sigmoid and its scalar tail round differently: on [rows, 1] a
        # row's gate would depend on how many rows there are. Widened to 16 columns, every
        # element takes the vector path whatever the row count (a multiple of CHUNK).
        logit = linear_rows(moe.shared_expert_gate, h)
        gate = torch.sigmoid(logit.expand(-1, GATE_WIDTH).contiguous())[:, :1]
        out = out + gate * mlp_rows(moe.shared_expert, h)
    return out


def _attention(
    attn: Attention,
    h: Tensor,
    groups: Sequence[DecodeRows],
    ropes: tuple[Tensor, Tensor],
    layer: int,
) -> Tensor:
    """Batched q/k/v and o projections and RoPE (each row at its request's position: an
    elementwise rotation, `fused.rotate_eager`, so a row's values do not depend on the others);
    cache update and SDPA per group."""
    rows = h.shape[0]
    q, k, v, gate = attention_rows(attn, h)
    cos, sin = ropes
    m = cos.shape[0]
    q, k = (partial_rope(t[:m], cos, sin, rotate_eager) for t in (q, k))
    y = torch.zeros(rows, attn.n_heads * attn.head_dim, dtype=h.dtype, device=h.device)
    start = 0
    for g in groups:
        end = start + len(g.active)
        qkv = q[start:end], k[start:end], v[start:end]
        y[start:end] = _group_attention(g, attn, *qkv, layer)
        start = end
    if gate is not None:
        y = y * torch.sigmoid(gate)
    return linear_rows(attn.o_proj, y)


def attention_rows(attn: Attention, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q [rows, heads, D], k, v [rows, kv heads, D] (q and k normed where the model norms
    them, not rotated) and Qwen3.5's output gate [rows, heads * D] (else None) of h's rows."""
    rows = h.shape[0]
    q, k, v = linear_rows_many([attn.q_proj, attn.k_proj, attn.v_proj], h)
    gate = None
    if isinstance(attn, GatedAttention):  # Qwen3.5: each head's query, then its output gate
        q, gate = split_gate(q, attn.n_heads, attn.head_dim)
    q = q.reshape(rows, attn.n_heads, attn.head_dim)
    k = k.view(rows, attn.n_kv_heads, attn.head_dim)
    v = v.view(rows, attn.n_kv_heads, attn.head_dim)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v, gate


def delta_rows(net: GatedDeltaNet, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The linear attention's projections of h's rows: qkv, z, b, a (`GatedDeltaNet.step`).
    q, k, v and z as one product by their weights stacked where `linear_rows_many`'s probe
    allows (one parallel region, one wake-up of the cores, instead of four); b and a, a few
    rows each, by torch's op as alone."""
    *qkv, z = linear_rows_many([getattr(net, p) for p in (*QKV, "in_proj_z")], h)
    b, a = (linear_rows(getattr(net, f"in_proj_{p}"), h) for p in "ba")
    return torch.cat(qkv, -1), z, b, a


def _linear_attention(
    net: GatedDeltaNet, h: Tensor, groups: Sequence[DecodeRows], layer: int, m: int
) -> Tensor:
    """Qwen3.5's linear attention for one decode position: batched projections; the
    convolution and the recurrent step per group on its own rows' states (elementwise, so a
    row's values do not depend on the others), as `GatedDeltaNet.step` does alone."""
    qkv, z, b, a = (t[:m] for t in delta_rows(net, h))
    y = torch.zeros(h.shape[0], net.v_heads * net.v_dim, dtype=h.dtype, device=h.device)
    start = 0
    for g in groups:
        end = start + len(g.active)
        conv, state = g.cache.conv[layer], g.cache.state[layer]
        every = len(g.active) == g.cache.batch_size
        rows = slice(None) if every else g.active
        c, s = (conv, state) if every else (conv[rows], state[rows])
        part = slice(start, end)
        y[part] = net.step(qkv[part], z[part], b[part], a[part], c, s)
        if not every:
            conv[rows], state[rows] = c, s
        start = end
    return linear_rows(net.out_proj, y)


def _row_angles(
    model: Transformer, groups: Sequence[DecodeRows], dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """cos, sin [active rows, 1, head_dim]: each group's angles at its position, per row."""
    by_pos: dict[int, tuple[Tensor, Tensor]] = {}
    cos, sin = [], []
    for g in groups:
        if g.pos not in by_pos:
            by_pos[g.pos] = rope_angles(model.inv_freq, g.pos, 1, dtype, device, model.rope_scale)
        c, s = by_pos[g.pos]
        n = len(g.active)
        cos.append(c.expand(n, -1))
        sin.append(s.expand(n, -1))
    return torch.cat(cos)[:, None], torch.cat(sin)[:, None]


def _group_attention(
    g: DecodeRows, attn: Attention, q: Tensor, k: Tensor, v: Tensor, layer: int
) -> Tensor:
    """One request's attention for its active rows (q and k rotated). Runs on all of the
    request's rows (finished ones fed zeros), so its shapes never depend on anything but the
    request."""
    n = g.cache.batch_size
    qf, kf, vf = (_all_rows(t, g.active, n) for t in (q, k, v))  # [n, heads, 1, head_dim]
    keys, values = g.cache.update(layer, g.pos, kf, vf)
    sinks = getattr(attn, "sinks", None)
    if sinks is not None or attn.window:  # gpt-oss
        y = sink_attention(qf, keys, values, sinks, attn.window, g.pos)
    else:
        y = F.scaled_dot_product_attention(qf, keys, values, enable_gqa=True)
    y = y.reshape(n, -1)
    return y if len(g.active) == n else y[g.active]


def _all_rows(t: Tensor, active: Tensor, n: int) -> Tensor:
    """[m, heads, D] values of the active rows → [n, heads, 1, D] with zeros elsewhere."""
    if len(active) == n:
        return t.unsqueeze(2)
    full = torch.zeros(n, *t.shape[1:], dtype=t.dtype, device=t.device)
    full[active] = t
    return full.unsqueeze(2)
