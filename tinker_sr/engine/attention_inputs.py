"""Attention's operands from the q/k/v projection in C (``csrc/rows.c``): Qwen3's per-head
q/k RMSNorm and RoPE in one pass each way, from the projection's output straight into the
[B, heads, T, D] layout attention reads (`norm_rope`), and the whole q/k/v split as one node
whose backward writes every gradient into its slice of one q/k/v gradient (`qkv_heads`).
Used where `compiled.native_ready` takes the operands (``$TINKER_SR_NATIVE``); elsewhere the
model runs `fused.rms_norm` and `fused.rope` on views of the split output. bf16 activations
(mixed precision, or a bf16 checkpoint's training step) take the bf16 kernels, with a bf16
checkpoint's norm weight and rotary tables widened to float32 (`_widened`): float32 math,
one rounding to bf16, where torch's bf16 ops round after each op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tinker_sr.engine import bf16_rows, compiled
from tinker_sr.engine.compiled import _ptr

__all__ = ["MAX_HEAD_DIM", "norm_rope", "qkv_heads", "use_norm_rope"]

# Longest head the C kernels take (the gradient's per-row buffer in csrc/norm_rope.h).
MAX_HEAD_DIM = 1024


def _widened(
    x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor
) -> tuple[Tensor | None, Tensor, Tensor]:
    """For bf16 activations, a bf16 norm weight and rotary tables as the bf16 kernels take them:
    float32 (the weight cast once and kept on it: `fused.frozen_cast`); else as given."""
    if x.dtype != torch.bfloat16:
        return weight, cos, sin
    if weight is not None and weight.dtype == torch.bfloat16 and not weight.requires_grad:
        from tinker_sr.engine.fused import frozen_cast  # fused imports this module

        weight = frozen_cast(weight, torch.float32)
    if cos.dtype == torch.bfloat16 and sin.dtype == torch.bfloat16:
        cos, sin = cos.float(), sin.float()
    return weight, cos, sin


def use_norm_rope(x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor) -> bool:
    """Can `norm_rope` take x [B, T, H, D] (a view of the q/k/v projection's output: unit
    stride inside a head, B and T collapsible), a frozen float32 norm weight [D] or None, and
    cos/sin [T, D]? (D a multiple of 32, at most `MAX_HEAD_DIM`; operands as `native_ready`
    takes them, or bf16 ones as `bf16_rows.takes_norm_rope` does.)"""
    d = x.shape[-1]
    if x.dim() != 4 or d % 32 or d > MAX_HEAD_DIM or x.stride(-1) != 1:
        return False
    if cos.shape != (x.shape[1], d):
        return False
    if not (sin.shape == cos.shape and cos.is_contiguous() and sin.is_contiguous()):
        return False
    if weight is not None and (
        weight.shape != (d,) or not weight.is_contiguous() or weight.requires_grad
    ):
        return False
    try:
        x.view(-1, x.shape[2], d)
    except RuntimeError:
        return False
    if x.dtype == torch.bfloat16:  # bf16 mixed precision or a bf16 checkpoint: its own kernels
        return bf16_rows.takes_norm_rope(x, *_widened(x, weight, cos, sin))
    extra = [] if weight is None else [weight]
    return compiled.native_ready(x, cos, sin, *extra)


def _kernels(dtype: torch.dtype) -> tuple[Any, Any] | None:
    """The C functions (forward, backward) of the norm + RoPE pass for activations of
    ``dtype``: float32 ones from ``csrc/rows.c``, bf16 ones (mixed precision: float32 math,
    bf16 in and out) from ``csrc/rows_bf16.c``; None where the library is unavailable (noted
    once; the caller runs the eager ops)."""
    if dtype == torch.bfloat16:
        lib = bf16_rows.library()
        return None if lib is None else (lib.tsr_norm_rope_bf16, lib.tsr_norm_rope_backward_bf16)
    lib = compiled.rows_or_note()
    return None if lib is None else (lib.tsr_norm_rope, lib.tsr_norm_rope_backward)


def norm_rope(
    x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor
) -> Tensor | None:
    """``rope(rms_norm(x, weight, eps).transpose(1, 2), cos, sin)`` (no norm where ``weight``
    is None) for x [B, T, H, D] as `use_norm_rope` takes it: one C pass forward and one
    backward, the result a contiguous [B, H, T, D] tensor (as `fused.rope` returns). None
    where the C kernels are unavailable (the caller runs the eager ops). A bf16 x (mixed
    precision) gives a bf16 result (`bf16_rows`)."""
    if _kernels(x.dtype) is None:
        return None
    weight, cos, sin = _widened(x, weight, cos, sin)
    return _NormRope.apply(x, weight, eps, cos, sin)  # type: ignore[no-any-return]


def _norm_rope_forward(
    kernel: Any, x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """(y [B, H, T, D] in x's dtype, the norm's per-row scale r [B, T, H] or [B, T, 0] in
    float32) for x [B, T, H, D], by ``kernel`` (`_kernels`' forward for x's dtype)."""
    b, t, h, d = x.shape
    rows = x.view(-1, h, d)
    y = x.new_empty(b, h, t, d)
    r = torch.empty(b, t, h if weight is not None else 0, dtype=torch.float32, device=x.device)
    kernel(
        _ptr(x), rows.stride(0), rows.stride(1), None if weight is None else _ptr(weight),
        eps, _ptr(cos), _ptr(sin), _ptr(y), _ptr(r), b, t, h, d, torch.get_num_threads(),
    )  # fmt: skip
    return y, r


def _norm_rope_backward(
    kernel: Any,
    g: Tensor,
    x: Tensor | None,
    weight: Tensor | None,
    r: Tensor,
    cos: Tensor,
    sin: Tensor,
    dx: Tensor,
) -> None:
    """Write the gradient for x [B, T, H, D] (``x`` None without a norm) into ``dx`` (x's shape
    and dtype, unit stride inside a head: a fresh tensor or a slice of the q/k/v gradient), by
    ``kernel`` (`_kernels`' backward for that dtype)."""
    b, t, h, d = dx.shape
    g = g.to(dx.dtype).contiguous()
    ld = (0, 0) if x is None else x.view(-1, h, d).stride()[:2]
    out = dx.view(-1, h, d).stride()[:2]
    kernel(
        _ptr(g), None if x is None else _ptr(x), ld[0], ld[1],
        None if weight is None else _ptr(weight), _ptr(r), _ptr(cos), _ptr(sin),
        _ptr(dx), out[0], out[1], b, t, h, d, torch.get_num_threads(),
    )  # fmt: skip


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor
    ) -> Tensor:
        ops = _kernels(x.dtype)
        assert ops is not None  # `norm_rope` checked
        y, r = _norm_rope_forward(ops[0], x, weight, eps, cos, sin)
        ctx.save_for_backward(x if weight is not None else None, weight, r, cos, sin)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, r, cos, sin = ctx.saved_tensors
        dx = g.new_empty(ctx.x_shape, dtype=ctx.x_dtype)
        ops = _kernels(ctx.x_dtype)
        assert ops is not None
        _norm_rope_backward(ops[1], g, x, weight, r, cos, sin, dx)
        return dx, None, None, None, None


def _split_heads(x: Tensor, heads: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """The q, k and v slices of a [B, T, (H + 2 KV) D] tensor (``heads`` = (H, KV, D)) as
    [B, T, heads, D] views."""
    h, kv, d = heads
    b, t, _ = x.shape
    return (
        x[..., : h * d].view(b, t, h, d),
        x[..., h * d : (h + kv) * d].view(b, t, kv, d),
        x[..., (h + kv) * d :].view(b, t, kv, d),
    )


def qkv_heads(
    qkv: Tensor,
    heads: tuple[int, int, int],
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    eps: float,
    cos: Tensor,
    sin: Tensor,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The attention operands from one q/k/v projection output ``qkv`` [B, T, (H + 2 KV) D]
    (``heads`` = (H, KV, D)): q [B, H, T, D] and k [B, KV, T, D] through `norm_rope` (Qwen3's
    per-head norm where a weight is given, then RoPE), v the [B, KV, T, D] view of its slice.
    One autograd node whose backward writes q's and k's gradients straight into their slices
    of one [B, T, (H + 2 KV) D] gradient and copies v's into the third: splitting ``qkv`` into
    three views would make autograd concatenate the three gradients again (one more pass over
    the whole gradient per layer). None where `use_norm_rope` refuses the operands or the C
    kernels are unavailable (the caller splits and runs the eager nodes)."""
    h, kv, d = heads
    if qkv.dim() != 3 or qkv.shape[-1] != (h + 2 * kv) * d or qkv.stride(-1) != 1:
        return None
    xq, xk, _ = _split_heads(qkv, heads)
    q_weight, cos, sin = _widened(qkv, q_weight, cos, sin)  # once: the checks take them so
    k_weight = _widened(qkv, k_weight, cos, sin)[0]
    if not (use_norm_rope(xq, q_weight, cos, sin) and use_norm_rope(xk, k_weight, cos, sin)):
        return None
    if _kernels(qkv.dtype) is None:
        return None
    got = _QKVHeads.apply(qkv, heads, q_weight, k_weight, eps, cos, sin)
    return got  # type: ignore[no-any-return]


class _QKVHeads(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        qkv: Tensor,
        heads: tuple[int, int, int],
        q_weight: Tensor | None,
        k_weight: Tensor | None,
        eps: float,
        cos: Tensor,
        sin: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        xq, xk, xv = _split_heads(qkv, heads)
        ops = _kernels(qkv.dtype)
        assert ops is not None  # `qkv_heads` checked
        q, rq = _norm_rope_forward(ops[0], xq, q_weight, eps, cos, sin)
        k, rk = _norm_rope_forward(ops[0], xk, k_weight, eps, cos, sin)
        v = xv.transpose(1, 2)
        # qkv itself is kept (both norms read their input again in backward; it is also the
        # base of v, which attention keeps padded).
        ctx.save_for_backward(qkv, q_weight, k_weight, rq, rk, cos, sin)
        ctx.heads = heads
        return q, k, v

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        qkv, q_weight, k_weight, rq, rk, cos, sin = ctx.saved_tensors
        grad = qkv.new_empty(qkv.shape)
        q_grad, k_grad, v_grad = _split_heads(grad, ctx.heads)
        xq, xk, _ = _split_heads(qkv, ctx.heads)
        ops = _kernels(qkv.dtype)
        assert ops is not None
        for g, weight, r, out, x in (
            (dq, q_weight, rq, q_grad, xq),
            (dk, k_weight, rk, k_grad, xk),
        ):
            if g is None:
                out.zero_()
            else:  # the norm's input is read again only where there is a norm
                x_in = None if weight is None else x
                _norm_rope_backward(ops[1], g, x_in, weight, r, cos, sin, out)
        if dv is None:
            v_grad.zero_()
        else:
            v_grad.copy_(dv.transpose(1, 2))
        return grad, None, None, None, None, None, None
