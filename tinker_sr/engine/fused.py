"""Projections that share an input (q/k/v; gate/up), with LoRA adapters merged per step.

A LoRA layer computes ``x W^T + s (x A^T) B^T``: on a CPU the rank-r products are memory
bound, and their scaling and sum add passes over the [M, N] output. For a batch of many
tokens it is cheaper to merge ``W' = W + s B A`` once per forward (a weight-sized pass), run
one GEMM for the whole group (``x [W'_q; W'_k; W'_v]^T``), and get the adapter gradients from
small products in backward:

    dx = dy W',   dB = s dy^T (x A^T),   dA = s (dy B)^T x

``W'`` is rebuilt in backward unless kept (`_kept`). The merged weight comes from
`merged_weight`, which `LoraLinear.merged_weight` calls too, so this path computes what a
sampler on merged weights computes. Small batches (decode, short requests) keep the
per-layer path, where the weight-sized merge would cost more than it saves."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinker_sr.engine import bf16_rows, compiled, gemm
from tinker_sr.engine.adapter_grads import LoraGrads, lora_grads, swiglu_backward_lora

# False: always the per-layer path (for A/B benchmarks and the equivalence tests).
ENABLED = True


@overload
def linear_group(x: Tensor, layers: Sequence[nn.Module]) -> list[Tensor]: ...
@overload
def linear_group(
    x: Tensor, layers: Sequence[nn.Module], split: bool, link: _GateUpLink | None = None
) -> Tensor | list[Tensor]: ...
def linear_group(
    x: Tensor, layers: Sequence[nn.Module], split: bool = True, link: _GateUpLink | None = None
) -> Any:
    """``[layer(x) for layer in layers]``, through one merged GEMM when every layer is a LoRA
    layer over a frozen base and the batch is large enough for merging to pay. ``split=False``:
    the merged GEMM's output whole (the outputs side by side in its last dimension), or the
    list where the layers ran one by one. ``link``: see `_GateUpLink`."""
    parts = [_lora_parts(layer) for layer in layers]
    group = [p for p in parts if p is not None]
    if not ENABLED or len(group) < len(parts) or not _merge_pays(x, group):
        return [apply_linear(layer, x) for layer in layers]
    if len({p.scaling for p in group}) != 1:
        return [apply_linear(layer, x) for layer in layers]
    y = _MergedLoraGroup.apply(
        x,
        group[0].scaling,
        len(group),
        link,
        *[p.weight for p in group],
        *[p.a for p in group],
        *[p.b for p in group],
    )
    sizes = [p.weight.shape[0] for p in group]
    if any(p.bias is not None for p in group):
        bias = [
            y.new_zeros(n) if p.bias is None else p.bias for p, n in zip(group, sizes, strict=True)
        ]
        y = y + torch.cat(bias).to(y.dtype)
    if not split:
        return y
    # One member: y itself (a one-piece split would cost a copy of y in backward: autograd
    # concatenates the pieces' gradients, ~0.4 ms a layer for the output projection).
    return [y] if len(sizes) == 1 else list(y.split(sizes, dim=-1))


def apply_linear(layer: nn.Module, x: Tensor) -> Tensor:
    """``layer(x)``; a plain Linear through `frozen_linear` (which keeps ``F.linear`` for a
    weight that trains; a LoRA layer's own forward does the same for its base)."""
    if type(layer) is nn.Linear:
        return frozen_linear(x, layer.weight, layer.bias)
    return layer(x)  # type: ignore[no-any-return]


def frozen_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for a weight (and bias) that take no gradient, with its
    products in `gemm` (forward, and ``dx = dy W`` in backward)."""
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and x.requires_grad:
        return _FrozenLinear.apply(x, weight, bias)  # type: ignore[no-any-return]
    return gemm.linear(x, weight, bias)


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        return gemm.linear(x, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = gemm.mm(dy2, weight.to(dy.dtype)).view(*dy.shape[:-1], weight.shape[1])
        return dx.to(ctx.x_dtype), None, None


def frozen_cast(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` in ``dtype``, cast once and kept on the (frozen, shared) weight itself; a
    weight modified in place since (its version changed) is cast again."""
    key = (dtype, weight._version)
    cached = getattr(weight, "_tinker_sr_cast", None)
    if cached is None or cached[0] != key:
        cached = (key, weight.detach().to(dtype))
        weight._tinker_sr_cast = cached  # type: ignore[attr-defined]
    return cached[1]  # type: ignore[no-any-return]


@dataclass
class _LoraParts:
    weight: Tensor  # frozen base [N, K]
    bias: Tensor | None
    a: Tensor  # [r, K]
    b: Tensor  # [N, r]
    scaling: float


def _lora_parts(layer: nn.Module) -> _LoraParts | None:
    """The pieces of a LoRA layer (`lora.LoraLinear`) over a frozen base, else None."""
    lora_a, lora_b = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
    if not (isinstance(layer, nn.Linear) and isinstance(lora_a, nn.Linear)):
        return None
    if not isinstance(lora_b, nn.Linear) or layer.weight.requires_grad:
        return None
    scaling = float(getattr(layer, "scaling", 1.0))
    return _LoraParts(layer.weight, layer.bias, lora_a.weight, lora_b.weight, scaling)


# How much more a token costs through the per-layer adapters of a bf16/fp16 checkpoint (float32
# adapters, no autocast: `lora._WideAdapter`) than `_merge_pays`'s pass count says: each adapter
# widens its input, runs float32 products and narrows its output, ~15 eager ops forward and
# backward. Measured on Qwen3-0.6B's shapes (28 layers, host C, session 26): merging paid from
# ~120 tokens (146: 1.55 against 1.60 s a forward_backward; 400: 2.29 against 2.70 s) and lost
# below (92: 1.32 against 1.26 s; 23: 0.90 against 0.61 s), where the plain count put the
# crossover at ~1,200 tokens. Merged, the step computes with the merged weights rounded to the
# checkpoint's dtype, as its samplers do (`lora.LoraLinear.merged_weight`).
MIXED_ADAPTER_COST = 10


def _merge_pays(x: Tensor, group: Sequence[_LoraParts]) -> bool:
    """Merging costs ~8 weight-sized passes (forward and backward); the per-layer adapter
    ~6 output-sized plus 4 input-sized passes per token (`MIXED_ADAPTER_COST` times that for
    a low-precision base with float32 adapters outside autocast). Compare the two. ``x``: any
    activation with one row per token (only its row count is used)."""
    m = x.numel() // x.shape[-1]
    n = sum(p.weight.shape[0] for p in group)
    first = group[0]
    k = first.weight.shape[1]
    mixed = first.weight.dtype != first.a.dtype and not torch.is_autocast_enabled(x.device.type)
    return m * (3 * n + 2 * k) * (MIXED_ADAPTER_COST if mixed else 1) >= 4 * n * k


def merged_weight(
    weights: Sequence[Tensor],
    a: Sequence[Tensor],
    b: Sequence[Tensor],
    s: float,
    dtype: torch.dtype | None = None,
    reuse: Tensor | None = None,
) -> Tensor:
    """cat_i(W_i + s B_i A_i) in ``dtype`` (default: the base's): accumulated in float32 (the
    adapters' dtype) and rounded once. The engine's one merge: training's merged groups and
    the samplers' merged copies (`lora.LoraLinear.merged_weight`) compute the same weights.
    Written into ``reuse`` (returned) where it is a contiguous tensor of the result's shape,
    dtype and device that nothing else reads (a sampler copy's evicted weight), else into new
    memory: the same values either way.

    Formed outside autocast: it is weight-sized arithmetic on the float32 master adapters
    (autocast would also refuse the ``out=`` products or make them slow). A caller under
    autocast asks for the autocast dtype: the float32 merge rounded once, as autocast would
    cast it for the product (in the C pass itself, where it applies: no float32 copy).
    """
    shape = (sum(w.shape[0] for w in weights), weights[0].shape[1])
    dtype, device = dtype or weights[0].dtype, weights[0].device
    out = (
        reuse
        if fits(reuse, shape, dtype, device)
        else torch.empty(shape, dtype=dtype, device=device)
    )
    row = 0
    with torch.autocast(out.device.type, enabled=False):
        for w, a_i, b_i in zip(weights, a, b, strict=True):
            block = out[row : row + w.shape[0]]
            if compiled.lora_merge(w, b_i, a_i, s, block):
                pass  # one C pass over the weight (float32 or bfloat16 on a CPU)
            elif w.dtype == a_i.dtype:  # W + s (B A) in the GEMM's epilogue
                if block.dtype == w.dtype:
                    torch.addmm(w, b_i, a_i, alpha=s, out=block)
                else:  # rounded once into the asked dtype
                    block.copy_(torch.addmm(w, b_i, a_i, alpha=s))
            else:
                block.copy_(torch.mm(b_i, a_i).mul_(s).add_(w))
            row += w.shape[0]
    return out


def fits(
    t: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> TypeGuard[Tensor]:
    """``t`` can hold a result of ``shape``, ``dtype`` on ``device`` in place."""
    return (
        t is not None
        and tuple(t.shape) == shape
        and t.dtype == dtype
        and t.device == device
        and t.is_contiguous()
    )


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype autocast casts x's products to, None where it is off."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _kept(merged: Tensor, saved: Tensor) -> Tensor | None:
    """``merged`` if backward should reuse it rather than merge the weights again: when it is no
    larger than the activation its node saves anyway (at most doubling that; a training batch
    of a few thousand tokens on a small model: ~0.5 % of the step saved), not for a large model
    on a short batch, where a weight-sized copy per layer would outweigh the activations."""
    return merged if merged.nbytes <= saved.nbytes else None


class _GateUpLink:
    """Between the gate/up group's node and the `_SwiGLUDown` node that takes its output: the
    group's node registers its ctx here (weakly: no reference cycle), and the SwiGLU node's
    backward, which runs first, may form the group's adapter gradients in its own C pass
    (`swiglu_backward_lora`, reading the group's saved input and adapters from that ctx) and
    leave them in ``grads`` for the group's backward, which then only runs dx's GEMM. The
    saved tensors, once unpacked there, are handed over in ``saved``: under activation
    checkpointing a saved tensor may be unpacked only once."""

    __slots__ = ("ctx", "grads", "saved")

    def __init__(self) -> None:
        self.ctx: weakref.ref[Any] | None = None
        self.grads: LoraGrads | None = None
        self.saved: tuple[Tensor, ...] | None = None


class _MergedLoraGroup(torch.autograd.Function):
    """y = x cat_i(W_i + s B_i A_i)^T for frozen W_i; gradients for x, A_i and B_i."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, scaling: float, g: int, link: _GateUpLink | None, *tensors: Tensor
    ) -> Tensor:
        weights, a, b = tensors[:g], tensors[g : 2 * g], tensors[2 * g :]
        low = _autocast_dtype(x)
        merged = merged_weight(weights, a, b, scaling, low)  # as autocast would cast it
        ctx.scaling, ctx.g, ctx.x_dtype, ctx.link = scaling, g, x.dtype, link
        if link is not None:
            link.ctx = weakref.ref(ctx)
        if low is not None:  # cast once, keep the cast (half the memory)
            x = x.to(low)
        ctx.merged = _kept(merged, x) if ctx.needs_input_grad[0] else None
        ctx.save_for_backward(x, *tensors)
        return gemm.linear(x, merged)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        link: _GateUpLink | None = ctx.link
        done = saved = None
        if link is not None:  # the SwiGLU gradient's pass may have run this group's products
            done, saved, link.grads, link.saved = link.grads, link.saved, None, None
        x, *tensors = ctx.saved_tensors if saved is None else saved
        g = ctx.g
        weights, a, b = tensors[:g], tensors[g : 2 * g], tensors[2 * g :]
        merged, ctx.merged = ctx.merged, None  # freed with this node's backward
        need_dx = ctx.needs_input_grad[0]
        dx, da, db = _group_grads(x, dy, weights, a, b, ctx.scaling, need_dx, merged, done)
        dx = None if dx is None else dx.to(ctx.x_dtype)
        return (dx, None, None, None, *([None] * g), *da, *db)


def _group_grads(
    x: Tensor,
    dy: Tensor,
    weights: Sequence[Tensor],
    a: Sequence[Tensor],
    b: Sequence[Tensor],
    s: float,
    need_dx: bool,
    merged: Tensor | None = None,
    done: LoraGrads | None = None,
) -> tuple[Tensor | None, list[Tensor], list[Tensor]]:
    """dx = dy W', dA_i = s (dy B_i)^T x, dB_i = s dy_i^T (x A_i^T) for y = x W'^T (``merged``:
    W' as the forward formed it, if it kept it; see `_kept`; ``done``: dA and dB already formed).

    The products run in the gradient's dtype (bf16 under mixed precision), with explicit
    casts: a CUDA backward runs outside the forward's autocast.
    """
    low = dy.dtype
    x2, dy2 = x.reshape(-1, x.shape[-1]).to(low), dy.reshape(-1, dy.shape[-1])
    dx = None
    if need_dx:
        w = merged_weight(weights, a, b, s, low) if merged is None else merged
        dx = gemm.mm(dy2, w.to(low)).view(x.shape).to(x.dtype)
    got = done if done is not None else lora_grads(dy2, b, s, x=x2, a=a)  # one C pass
    if got is not None and got.da is not None:
        return dx, got.da, got.db
    a_cat = torch.cat(list(a))  # [g r, K]
    # The scaling goes on the small adapter operands (no pass over an [M, g r] product).
    xa = gemm.mm(x2, (a_cat * s).t().to(low))  # s x A^T, [M, g r]
    # One GEMM per product over the whole group: B as a block-diagonal [N, g r] matrix
    # (the off-diagonal blocks cost g-fold tiny FLOPs, not a strided pass per member).
    # The skinny operands are laid out [g r, *] (rank-major): MKL (the BLAS, `gemm`'s
    # fallback) runs these rank-8 products 2-5x faster that way round than with [*, g r]
    # operands (measured on the bench shapes); oneDNN ran them at 310-400 GFLOP/s.
    b_blk = torch.block_diag(*[b_i.t() for b_i in b]).mul_(s)
    dy_b = gemm.mm(dy2, b_blk.to(low).t())  # s dy B
    db_blk = gemm.mm_over_rows(xa, dy2)  # [g r, N]; member i's block, transposed, is dB_i
    r, row = a[0].shape[0], 0
    db = []
    for i, b_i in enumerate(b):
        db.append(db_blk[i * r : (i + 1) * r, row : row + b_i.shape[0]].t().to(b_i.dtype))
        row += b_i.shape[0]
    da = list(gemm.mm_over_rows(dy_b, x2).to(a_cat.dtype).split(r))  # s (dy B)^T x
    return dx, da, db


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` with one result buffer (bit-identical to the two-op form)."""
    fused = compiled.run("silu_mul", gate, up)
    fused = bf16_rows.silu_mul(gate, up) if fused is None else fused  # bf16: its own pass
    if fused is not None:
        return fused  # type: ignore[no-any-return]
    h = F.silu(gate)
    return h.mul_(up) if h.dtype == torch.result_type(h, up) else h * up


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` keeping only ``gate`` and ``up`` for backward (autograd would also
    keep ``silu(gate)``, the size of ``up``); gradients bit-identical to autograd's."""
    if not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad):
        return _silu_mul(gate, up)
    return _SwiGLU.apply(gate, up)  # type: ignore[no-any-return]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return _silu_mul(gate, up)

    @staticmethod
    def backward(ctx: Any, dh: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        return _swiglu_grads(gate, up, dh.clone(), F.silu(gate))


def _swiglu_grads(
    gate: Tensor,
    up: Tensor,
    dh: Tensor,
    silu: Tensor,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Autograd's own arithmetic for h = silu(gate) * up: d_up = silu(gate) dh, d_gate =
    silu'(gate) (dh up). ``dh`` (the caller's own) and ``silu`` (``F.silu(gate)``, already at
    hand) are overwritten: without ``out`` the two gradients take their buffers (no new
    [M, F] tensors); with ``out`` = (d_gate, d_up) buffers they are written there."""
    if dh.dtype != gate.dtype or silu.dtype != gate.dtype or up.dtype != gate.dtype:
        d_gate = torch.ops.aten.silu_backward(dh.to(up.dtype) * up, gate)
        d_up = F.silu(gate) * dh.to(gate.dtype)
        if out is not None:
            out[0].copy_(d_gate)
            out[1].copy_(d_up)
        return d_gate, d_up
    if out is None:
        d_up = silu.mul_(dh)
    else:
        d_up = torch.mul(silu, dh, out=out[1])
        del silu
    d_gate = dh.mul_(up)
    grad_input = d_gate if out is None else out[0]
    torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=grad_input)
    return grad_input, d_up


def swiglu_mlp(x: Tensor, gate: nn.Module, up: nn.Module, down: nn.Module) -> Tensor:
    """``down(silu(gate(x)) * up(x))``. With LoRA projections on a large batch: one merged
    GEMM for gate and up whose [M, 2F] output goes unsplit into one node for SwiGLU and the
    down projection. That node keeps only the gate/up output (``silu(gate) * up``, the size of
    ``up``, is recomputed in backward) and writes both halves of its gradient into one buffer
    (a split would concatenate them again in backward: one more [M, 2F] pass per layer)."""
    parts = _lora_parts(down)
    gate_up: Tensor | list[Tensor] | None = None
    link = _GateUpLink()
    if ENABLED and parts is not None and parts.bias is None and _merge_pays(x, [parts]):
        gate_up = linear_group(x, (gate, up), split=False, link=link)
    if parts is None or not isinstance(gate_up, Tensor):
        g, u = gate_up if gate_up is not None else linear_group(x, (gate, up))
        return linear_group(swiglu(g, u), (down,))[0]
    return _SwiGLUDown.apply(gate_up, parts.scaling, parts.weight, parts.a, parts.b, link)  # type: ignore[no-any-return]


class _SwiGLUDown(torch.autograd.Function):
    """y = down'(silu(gate) * up) for ``gate_up = [gate | up]``, down' = W + s B A frozen W.

    Where the C kernels take ``gate_up``, forward also keeps xa = s h A^T ([M, r]; h =
    silu(gate) * up and xa from one C pass, `compiled.silu_mul_xa`) and backward gets dA from
    the SwiGLU gradient's own C pass (`compiled.swiglu_backward_da`), so h is never formed in
    backward. Elsewhere backward recomputes h and runs `_group_grads` on it."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(  # type: ignore[override]
        ctx: Any,
        gate_up: Tensor,
        scaling: float,
        w: Tensor,
        a: Tensor,
        b: Tensor,
        link: _GateUpLink | None = None,
    ) -> Tensor:
        ctx.link = link
        gate, up = gate_up.chunk(2, dim=-1)
        xa = None
        if gate_up.is_contiguous() and compiled.native_ready(gate_up, a):
            got = compiled.silu_mul_xa(gate, up, (a * scaling).contiguous())  # h, s h A^T
            if got is not None:
                h, xa = got
        if xa is None:
            h = _silu_mul(gate, up)
        merged = merged_weight([w], [a], [b], scaling, _autocast_dtype(gate_up))
        y = gemm.linear(h, merged)
        ctx.merged = _kept(merged, gate_up)
        ctx.save_for_backward(gate_up, w, a, b, xa)
        ctx.scaling = scaling
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        gate_up, w, a, b, xa = ctx.saved_tensors
        s = ctx.scaling
        merged, ctx.merged = ctx.merged, None  # freed with this node's backward
        if xa is not None:
            dy2 = dy.reshape(-1, dy.shape[-1])
            dh_c = gemm.mm(dy2, merged_weight([w], [a], [b], s) if merged is None else merged)
            fused = lora_grads(dy2, [b], s, xa=xa)  # s dy B and dB = s dy^T (h A^T), one pass
            dy_b = gemm.mm(dy2, b * s) if fused is None else fused.dy_b
            got = _swiglu_grads_c(ctx.link, gate_up, dh_c, dy_b)
            if got is not None:
                db_c = gemm.mm_over_rows(xa, dy2).t() if fused is None else fused.db[0]
                return got[0], None, None, got[1].to(a.dtype), db_c.to(b.dtype), None
        gate, up = gate_up.chunk(2, dim=-1)
        fuse = compiled.fusable(gate, up) or bf16_rows.takes_silu(gate, up)  # as _silu_mul chose
        silu = None if fuse else F.silu(gate)
        h = _silu_mul(gate, up) if silu is None else silu * up  # the forward's value, bitwise
        dh, (da,), (db,) = _group_grads(h, dy, [w], [a], [b], s, True, merged)
        del h
        assert dh is not None  # a fresh GEMM result: _swiglu_grads may overwrite it
        if silu is None:
            d_gate_up = compiled.run("swiglu_backward", gate_up, dh)
            d_gate_up = bf16_rows.swiglu_backward(gate_up, dh) if d_gate_up is None else d_gate_up
            if d_gate_up is not None:
                return d_gate_up, None, None, da, db, None
            silu = F.silu(gate)
        d_gate_up = torch.empty_like(gate_up)
        d_gate, d_up = d_gate_up.chunk(2, dim=-1)
        _swiglu_grads(gate, up, dh, silu, out=(d_gate, d_up))
        return d_gate_up, None, None, da, db, None


def _swiglu_grads_c(
    link: _GateUpLink | None, gate_up: Tensor, dh: Tensor, dy_b: Tensor
) -> tuple[Tensor, Tensor] | None:
    """(d_gate_up, the down projection's dA) from `compiled.swiglu_backward_da`, or from
    `swiglu_backward_lora` where the gate/up group's node is linked and alive: that pass also
    forms the group's adapter gradients, left on the link for the group's backward."""
    group = None if link is None or link.ctx is None else link.ctx()
    if link is not None and group is not None and group.g == 2:
        link.saved = saved = group.saved_tensors  # unpacked once: see `_GateUpLink`
        x, _, _, a_g, a_u, b_g, b_u = saved
        both = swiglu_backward_lora(gate_up, dh, dy_b, [b_g, b_u], group.scaling, x, [a_g, a_u])
        if both is not None:
            link.grads = both[2]
            return both[0], both[1]
    return compiled.swiglu_backward_da(gate_up, dh, dy_b)  # type: ignore[no-any-return]


# ---- RMSNorm and rotary embeddings as single autograd nodes ----------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalised in float32 and cast back before the
    gain, as HF Llama/Qwen3 do (forward values bit-identical to that formula). With autograd,
    one node that keeps only ``x`` and the per-row scale (autograd's chain of five ops keeps
    the normalised copy and runs ~8 passes backward; this runs 5)."""
    if _float32_under_cpu_autocast(x, weight):
        with torch.autocast("cpu", enabled=False):
            return rms_norm(x, weight, eps)
    if (got := bf16_rows.bf16_stream_rms_norm(x, None, weight, eps)) is not None:
        return got[1]  # a bf16 checkpoint's, in C
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)  # type: ignore[no-any-return]
    return _rms_norm_forward(x, weight, eps)[0]


# Dtypes whose values float32 holds exactly: a residual add promotes them to float32 as is.
_WIDENED_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)


def _float32_under_cpu_autocast(*tensors: Tensor) -> bool:
    """CPU autocast is on and these operands are float32 CPU tensors: bf16 mixed precision's
    residual stream, which autocast leaves in float32. The RMSNorm passes then run as in a
    float32 step, C kernels included (they stand aside under autocast; the C ones saved ~2 %
    of a bf16 step on an AMX host over torch's eager passes): float32 either way,
    rounded as the C kernels round (within their tests' tolerance of torch's ops, not bit
    for bit)."""
    return torch.is_autocast_enabled("cpu") and all(
        t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors
    )


def _rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    fused = compiled.run("rms_norm", x, weight, eps)
    if fused is not None:
        return fused  # type: ignore[no-any-return]
    x32 = x.float()
    r = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    n = (x32 * r).to(x.dtype)
    out = n.mul_(weight) if n.dtype == torch.result_type(n, weight) else weight * n
    return out, r


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        out, r = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, r)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, r = ctx.saved_tensors
        dx, dw = _rms_norm_grads(g, x, weight, r, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None


def _rms_norm_grads(
    g: Tensor, x: Tensor, weight: Tensor, r: Tensor, need_dx: bool, need_dw: bool
) -> tuple[Tensor | None, Tensor | None]:
    # out = w * n, n = x r, r = (mean(x^2) + eps)^-1/2:
    # dL/dx = r (g w - n mean(g w n)),  dL/dw = sum over rows of g n.
    if need_dx and not need_dw:
        dx = compiled.run("rms_norm_backward", g, x, weight, r)
        if dx is not None:
            return dx, None
    n = x.float() * r
    dw = None
    if need_dw:
        dw = (g * n.to(x.dtype)).reshape(-1, weight.shape[0]).sum(0).to(weight.dtype)
    gn = (g * weight).float()
    mean = (gn * n).mean(-1, keepdim=True)
    dx = gn.sub_(n.mul_(mean)).mul_(r).to(x.dtype) if need_dx else None
    return dx, dw


def add_rms_norm(
    x: Tensor, y: Tensor | None, weight: Tensor, eps: float, low_out: bool = False
) -> tuple[Tensor, Tensor]:
    """``(h, rms_norm(h, weight, eps))`` for the residual stream ``h = x + y`` (``y`` None:
    h = x): a decoder's residual add and the RMSNorm after it. Where the C kernels take the
    operands (float32, a frozen gain), one autograd node and one C pass each way: forward
    adds and normalises, backward adds the residual path's gradient to the norm's input
    gradient (autograd would sum the two in a pass of its own). Values and gradients are
    bit-identical to the two-step form, which runs everywhere else. ``low_out``: the result
    feeds only products (a decoder layer's sublayer), so under bf16 autocast it may come in
    bf16 (`bf16_rows.add_rms_norm`: the same values those products read)."""
    if y is None:
        return x, rms_norm(x, weight, eps)
    if _float32_under_cpu_autocast(x, weight) and y.dtype in _WIDENED_EXACTLY:
        got = bf16_rows.add_rms_norm(x, y, weight, eps) if low_out else None
        if got is not None:  # a bf16 y and a bf16 result for the next sublayer, in C
            return got
        # A bf16 sublayer output on the float32 residual: x + y promotes y exactly, as here
        # (`float()` of a float32 y is y itself).
        with torch.autocast("cpu", enabled=False):
            return add_rms_norm(x, y.float(), weight, eps)
    if (got := bf16_rows.bf16_stream_rms_norm(x, y, weight, eps)) is not None:
        return got  # a bf16 checkpoint's residual stream, in C
    tracked = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    if (
        weight.requires_grad
        or y.shape != x.shape
        or y.dtype != x.dtype
        or not compiled.native_ready(x, y, weight)
    ):
        h = x + y
        return h, rms_norm(h, weight, eps)
    if tracked:
        return _AddRMSNorm.apply(x, y, weight, eps)  # type: ignore[no-any-return]
    out, _, h = _add_rms_norm_forward(x, y, weight, eps)
    return h, out


def _add_rms_norm_forward(
    x: Tensor, y: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, r, h) with h = x + y; the C pass, else the add and then `_rms_norm_forward`."""
    got = compiled.call_native("rms_norm", x.contiguous(), weight, eps, y.contiguous())
    if got is not None:
        return got  # type: ignore[no-any-return]
    h = x + y
    return (*_rms_norm_forward(h, weight, eps), h)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, y: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        out, r, h = _add_rms_norm_forward(x, y, weight, eps)
        ctx.save_for_backward(h, weight, r)
        ctx.set_materialize_grads(False)  # the last layer's h feeds nothing but its norm
        return h, out

    @staticmethod
    def backward(ctx: Any, dh: Tensor | None, dout: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, weight, r = ctx.saved_tensors
        d = dh
        if dout is not None:
            d = None
            if dh is not None and compiled.native_ready(dout, h, weight, r, dh):
                d = compiled.call_native("rms_norm_backward", dout, h, weight, r, dh)
            if d is None:
                dn = _rms_norm_grads(dout, h, weight, r, True, False)[0]
                assert dn is not None
                d = dn if dh is None else dn + dh
        return d, d, None, None


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding in the HF "rotate_half" layout: ``x cos + rotate_half(x) sin``, where
    ``cos``/``sin`` repeat their first half in the second (as `Transformer.hidden_states` builds
    them). Written half by half into one output (no negated and concatenated copy of ``x``;
    values bit-identical to the rotate_half form); its gradient is the inverse rotation."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)  # type: ignore[no-any-return]
    return _rotate(x, cos, sin, inverse=False)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """[x1, x2] -> [x1 c - x2 s, x2 c + x1 s] (inverse: the signs of s flipped)."""
    fused = compiled.run("rope_inverse" if inverse else "rope", x, cos, sin)
    if fused is not None:
        return fused  # type: ignore[no-any-return]
    return rotate_eager(x, cos, sin, inverse)


def rotate_eager(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """`_rotate` in torch's elementwise ops only: each element is the same few correctly
    rounded products and sums whatever the tensor's shape, so a row's result does not depend
    on the rows beside it (decode rotates the rows of many requests at once)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=torch.result_type(x, cos), device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    tmp = torch.mul(x2, s)
    torch.mul(x1, c, out=o1)
    o1.add_(tmp) if inverse else o1.sub_(tmp)
    torch.mul(x1, s, out=tmp)
    torch.mul(x2, c, out=o2)
    o2.sub_(tmp) if inverse else o2.add_(tmp)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, sin, inverse=True).to(ctx.x_dtype), None, None
