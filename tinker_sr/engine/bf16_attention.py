"""Causal attention in bf16 as batched GEMMs, for CPU mixed precision.

The products run as bf16 batched GEMMs (oneDNN; on AMX / AVX-512 bf16 hosts several times
faster than float32 ones), the softmax and its gradient accumulate in float32: in one C pass
each (`bf16_rows.causal_softmax`, the causal mask included) where the C kernels apply, else
torch's masked_fill_ and bf16 softmax ops.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from tinker_sr.engine import bf16_rows

__all__ = ["KEPT_BYTES", "bf16_causal_attention", "suits_bf16_weights"]

# The bf16 probabilities kept for backward, per layer, up to which a bf16 checkpoint's training
# step (no autocast) runs attention here rather than in torch's flash attention.
KEPT_BYTES = 64 << 20


def suits_bf16_weights(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Should a bf16 model's training forward outside autocast (a bf16 checkpoint as loaded)
    run its attention here? torch's CPU flash attention backward on bf16 was 5-9x slower than
    this in the engine's process (fwd + bwd at 16 heads of 128, 8 KV heads: B 16 x T 25 35.9 vs
    4.2 ms, 16 x 96 120 vs 13 ms, 8 x 256 96 vs 21 ms; ~3x of it from its per-thread scratch
    allocations contending on the engine's single malloc heap, `cpu.tune_allocator`; an RL
    step of a Qwen3-0.6B-shaped checkpoint spent ~1 s of ~4.5 s there); it keeps O(T) memory
    where this keeps the [T, T] probabilities, so beyond `KEPT_BYTES` per layer flash
    attention stays."""
    b, h, t, _ = q.shape
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and h % k.shape[1] == 0
        and b * h * t * t * 2 <= KEPT_BYTES
        and _fast_bf16()
    )


@functools.cache
def _fast_bf16() -> bool:
    """bf16 products in hardware (AMX / AVX512_BF16), where the comparison above was made;
    elsewhere both forms emulate bf16 and flash attention keeps its O(T) memory."""
    from tinker_sr.engine.cpu import has_fast_bf16

    return has_fast_bf16()


def bf16_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention with grouped-query heads (q [B, H, T, D], k and v [B, H_kv, T, D]),
    the same as ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``
    to bf16 rounding, for CPU mixed precision: the products run as bf16 batched GEMMs
    (oneDNN; ~2x faster than torch's CPU flash attention in float32, which calls the BLAS),
    the softmax and its gradient accumulate in float32. Each KV head's G query heads form one
    [G·T, D] x [D, T] product. The probabilities are kept in bf16 for backward
    ([B, H, T, T]: 2 bytes per entry, 16 MiB per layer at 16 x 256 with 8 heads)."""
    return _BF16CausalAttention.apply(q, k, v)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=8)
def _causal_mask(g: int, t: int, device: torch.device) -> Tensor:
    """bool [G·T, T], True where row i·T + r may not see a column (columns after r); the
    same mask serves every layer of a step, and the steps of one shape."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu_(1).repeat(g, 1)


class _BF16CausalAttention(torch.autograd.Function):
    """q is scaled by 1/sqrt(D) before the score product (exact for D a power of 4), so no
    pass over the [G·T, T] scores scales them; torch's bf16 softmax and softmax backward
    accumulate in float32 internally and read and write bf16."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # type: ignore[override]
        b, h, t, d = q.shape
        hk = k.shape[1]
        g = h // hk
        low = torch.bfloat16
        with torch.autocast(q.device.type, enabled=False):
            qg = q.to(low).reshape(b * hk, g * t, d).mul(d**-0.5)
            kg, vg = k.to(low).reshape(b * hk, t, d), v.to(low).reshape(b * hk, t, d)
            s = torch.bmm(qg, kg.transpose(1, 2))
            p = bf16_rows.causal_softmax(s)  # in place: mask and softmax in one C pass
            if p is None:
                s.masked_fill_(_causal_mask(g, t, q.device), float("-inf"))
                p = torch.softmax(s, dim=-1)
            del s
            o = torch.bmm(p, vg)
        ctx.save_for_backward(qg, kg, vg, p)
        ctx.shape, ctx.dtypes = (b, h, hk, t, d), (q.dtype, k.dtype, v.dtype)
        return o.view(b, h, t, d)

    @staticmethod
    def backward(ctx: Any, do: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        qg, kg, vg, p = ctx.saved_tensors
        b, h, hk, t, d = ctx.shape
        with torch.autocast(do.device.type, enabled=False):
            dog = do.to(p.dtype).reshape(b * hk, (h // hk) * t, d)
            dv = torch.bmm(p.transpose(1, 2), dog)
            dp = torch.bmm(dog, vg.transpose(1, 2))
            ds = bf16_rows.causal_softmax_backward(p, dp)  # in place of dp
            if ds is None:
                ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
            del dp
            dq = torch.bmm(ds, kg).mul_(d**-0.5)
            dk = torch.bmm(ds.transpose(1, 2), qg)
        dq_t, dk_t, dv_t = ctx.dtypes
        return (
            dq.view(b, h, t, d).to(dq_t),
            dk.view(b, hk, t, d).to(dk_t),
            dv.view(b, hk, t, d).to(dv_t),
        )
