"""Projections that share an input (q/k/v; gate/up), with LoRA adapters merged per step.

A LoRA layer computes ``x W^T + s (x A^T) B^T``: on a CPU the rank-r products are memory
bound, and their scaling and sum add passes over the [M, N] output. For a batch of many
tokens it is cheaper to merge ``W' = W + s B A`` once per forward (a weight-sized pass), run
one GEMM for the whole group (``x [W'_q; W'_k; W'_v]^T``), and get the adapter gradients from
small products in backward:

    dx = dy W',   dB = s dy^T (x A^T),   dA = s (dy B)^T x

``W'`` is rebuilt in backward rather than kept (memory for a weight-sized pass). The merged
weight is formed exactly as `LoraLinear.merged_weight` does (``W + (B A) s``), so this path
computes what a sampler on merged weights computes. Small batches (decode, short requests)
keep the per-layer path, where the weight-sized merge would cost more than it saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# False: always the per-layer path (for A/B benchmarks and the equivalence tests).
ENABLED = True


def linear_group(x: Tensor, layers: Sequence[nn.Module]) -> list[Tensor]:
    """``[layer(x) for layer in layers]``, through one merged GEMM when every layer is a LoRA
    layer over a frozen base and the batch is large enough for merging to pay."""
    parts = [_lora_parts(layer) for layer in layers]
    group = [p for p in parts if p is not None]
    if not ENABLED or len(group) < len(parts) or not _merge_pays(x, group):
        return [layer(x) for layer in layers]
    if len({p.scaling for p in group}) != 1:
        return [layer(x) for layer in layers]
    y = _MergedLoraGroup.apply(
        x,
        group[0].scaling,
        len(group),
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
    return list(y.split(sizes, dim=-1))


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


def _merge_pays(x: Tensor, group: Sequence[_LoraParts]) -> bool:
    """Merging costs ~8 weight-sized passes (forward and backward); the per-layer adapter
    ~6 output-sized plus 4 input-sized passes per token. Compare the two."""
    m = x.numel() // x.shape[-1]
    n = sum(p.weight.shape[0] for p in group)
    k = x.shape[-1]
    return m * (3 * n + 2 * k) >= 4 * n * k


def _merged_weight(
    weights: Sequence[Tensor], a: Sequence[Tensor], b: Sequence[Tensor], s: float
) -> Tensor:
    """cat_i(W_i + s B_i A_i) in the adapters' dtype (float32), then the base's dtype.

    Formed outside autocast: it is weight-sized arithmetic on the float32 master adapters
    (autocast would also refuse the ``out=`` products or make them slow); a caller under
    autocast then casts the result once, as for any weight.
    """
    n = sum(w.shape[0] for w in weights)
    out = torch.empty(n, weights[0].shape[1], dtype=a[0].dtype, device=weights[0].device)
    row = 0
    with torch.autocast(out.device.type, enabled=False):
        for w, a_i, b_i in zip(weights, a, b, strict=True):
            block = out[row : row + w.shape[0]]
            if w.dtype == out.dtype:  # one pass: W + s (B A) in the GEMM's epilogue
                torch.addmm(w, b_i, a_i, alpha=s, out=block)
            else:
                torch.mm(b_i, a_i, out=block).mul_(s).add_(w)
            row += w.shape[0]
    return out if weights[0].dtype == out.dtype else out.to(weights[0].dtype)


class _MergedLoraGroup(torch.autograd.Function):
    """y = x cat_i(W_i + s B_i A_i)^T for frozen W_i; gradients for x, A_i and B_i."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, x: Tensor, scaling: float, g: int, *tensors: Tensor) -> Tensor:  # type: ignore[override]
        weights, a, b = tensors[:g], tensors[g : 2 * g], tensors[2 * g :]
        merged = _merged_weight(weights, a, b, scaling)
        ctx.save_for_backward(x, *tensors)
        ctx.scaling, ctx.g = scaling, g
        return F.linear(x, merged)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, *tensors = ctx.saved_tensors
        g = ctx.g
        weights, a, b = tensors[:g], tensors[g : 2 * g], tensors[2 * g :]
        dx, da, db = _group_grads(x, dy, weights, a, b, ctx.scaling, ctx.needs_input_grad[0])
        return (dx, None, None, *([None] * g), *da, *db)


def _group_grads(
    x: Tensor,
    dy: Tensor,
    weights: Sequence[Tensor],
    a: Sequence[Tensor],
    b: Sequence[Tensor],
    s: float,
    need_dx: bool,
) -> tuple[Tensor | None, list[Tensor], list[Tensor]]:
    """dx = dy W', dA_i = s (dy B_i)^T x, dB_i = s dy_i^T (x A_i^T) for y = x W'^T.

    The products run in the gradient's dtype (bf16 under mixed precision), with explicit
    casts: a CUDA backward runs outside the forward's autocast.
    """
    low = dy.dtype
    x2, dy2 = x.reshape(-1, x.shape[-1]).to(low), dy.reshape(-1, dy.shape[-1])
    dx = None
    if need_dx:
        dx = torch.mm(dy2, _merged_weight(weights, a, b, s).to(low)).view(x.shape).to(x.dtype)
    a_cat = torch.cat(list(a))  # [g r, K]
    xa = torch.mm(x2, a_cat.t().to(low)).mul_(s)  # s x A^T, [M, g r]
    # One GEMM per product over the whole group: B as a block-diagonal [N, g r] matrix
    # (the off-diagonal blocks cost g-fold tiny FLOPs, not a strided pass per member).
    dy_b = torch.mm(dy2, torch.block_diag(*b).to(low))  # dy B, [M, g r]
    db_blk = torch.mm(dy2.t(), xa)  # [N, g r]; member i's block is dB_i
    r, row = a[0].shape[0], 0
    db = []
    for i, b_i in enumerate(b):
        db.append(db_blk[row : row + b_i.shape[0], i * r : (i + 1) * r].to(b_i.dtype))
        row += b_i.shape[0]
    da = list(torch.mm(dy_b.t().mul_(s), x2).to(a_cat.dtype).split(r))  # s (dy B)^T x
    return dx, da, db


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` keeping only ``gate`` and ``up`` for backward (autograd would also
    keep ``silu(gate)``, the size of ``up``); gradients bit-identical to autograd's."""
    if not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad):
        return F.silu(gate) * up
    return _SwiGLU.apply(gate, up)  # type: ignore[no-any-return]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, dh: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        return _swiglu_grads(gate, up, dh)


def _swiglu_grads(gate: Tensor, up: Tensor, dh: Tensor) -> tuple[Tensor, Tensor]:
    """Autograd's own arithmetic for h = silu(gate) * up, with silu(gate) recomputed."""
    d_up = F.silu(gate).mul_(dh.to(gate.dtype))
    d_gate = torch.ops.aten.silu_backward(dh.to(up.dtype) * up, gate)
    return d_gate, d_up


def mlp_down(gate: Tensor, up: Tensor, down: nn.Module) -> Tensor:
    """``down(silu(gate) * up)``. With a LoRA down projection on a large batch, one autograd
    node that keeps only ``gate`` and ``up``: its input ``silu(gate) * up`` (the size of
    ``up``) is recomputed in backward instead of kept."""
    parts = _lora_parts(down)
    if not ENABLED or parts is None or parts.bias is not None or not _merge_pays(gate, [parts]):
        return linear_group(swiglu(gate, up), (down,))[0]
    return _SwiGLUDown.apply(gate, up, parts.scaling, parts.weight, parts.a, parts.b)  # type: ignore[no-any-return]


class _SwiGLUDown(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(  # type: ignore[override]
        ctx: Any, gate: Tensor, up: Tensor, scaling: float, w: Tensor, a: Tensor, b: Tensor
    ) -> Tensor:
        ctx.save_for_backward(gate, up, w, a, b)
        ctx.scaling = scaling
        return F.linear(F.silu(gate) * up, _merged_weight([w], [a], [b], scaling))

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        gate, up, w, a, b = ctx.saved_tensors
        h = F.silu(gate) * up  # bit-identical to the forward's value
        dh, (da,), (db,) = _group_grads(h, dy, [w], [a], [b], ctx.scaling, True)
        assert dh is not None
        d_gate, d_up = _swiglu_grads(gate, up, dh)
        return d_gate, d_up, None, None, da, db
