"""The row kernels of a bf16 mixed-precision training step in C (``csrc/rows_bf16.c``).

Under CPU autocast the engine's float32 C kernels (`engine.compiled`) stand aside, and the
passes between the bf16 products ran as torch's eager bf16 ops: the loss's softmax over each
chunk of bf16 logits (widen, amax, sub, exp, sum, narrow), Qwen3's q/k RMSNorm and RoPE
(eleven ops forward and backward, through float32 copies), silu(gate) * up and the SwiGLU
gradient, the bf16 attention's mask + softmax and its gradient, and the casts between the
float32 residual stream and the bf16 sublayers. On an AMX host these took about half of a
bf16 step, whose products run several times faster than float32 ones. Each kernel here
reads bf16, computes in float32 and writes bf16, one pass where torch's ops took several,
rounding to bf16 where those ops round (values within a bf16 unit of theirs, or their very
bits where they only widen and narrow; tests/engine/test_bf16_rows.py).

Every function returns None (or False) where its operands do not suit (dtypes, layouts,
inference mode, small tensors) or the C kernels are off (``$TINKER_SR_NATIVE=0``) or
unavailable; the caller then runs torch's ops, as before.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from tinker_sr.engine import compiled
from tinker_sr.engine.compiled import _ptr

__all__ = [
    "add_rms_norm",
    "bf16_stream_rms_norm",
    "causal_softmax",
    "causal_softmax_backward",
    "library",
    "ready",
    "silu_mul",
    "softmax_rows",
    "swiglu_backward",
    "takes_norm_rope",
    "takes_silu",
]

# Longest row of the causal softmax (its per-row buffer in csrc/rows_bf16.c).
MAX_SOFTMAX_ROW = 4096


def ready(*tensors: Tensor) -> bool:
    """Should these operands (bf16 activations, float32 weights and tables beside them) go
    through a bf16 C kernel? Autocast may be on (that is where they run); inference mode (a
    sampler's forward) keeps torch's ops, as the float32 kernels do."""
    if compiled.native_mode() == "off" or compiled.native_failure() is not None:
        return False
    if torch.is_inference_mode_enabled() or tensors[0].numel() < compiled.MIN_ELEMENTS:
        return False
    return all(
        t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float32) for t in tensors
    )


@functools.cache
def _library() -> Any | None:
    from tinker_sr.engine import native

    lib = native.load("rows_bf16")
    if lib is None:
        return None
    p, i, n, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.tsr_softmax_rows_bf16.argtypes = [p, n, n, p, p, i]
    lib.tsr_norm_rope_bf16.argtypes = [p, n, n, p, f32, p, p, p, p, n, i, i, i, i]
    lib.tsr_norm_rope_backward_bf16.argtypes = [p, p, n, n, p, p, p, p, p, n, n, n, i, i, i, i]
    lib.tsr_silu_mul_bf16.argtypes = [p, n, p, n, p, n, i, i]
    lib.tsr_swiglu_backward_bf16.argtypes = [p, p, p, n, i, i]
    lib.tsr_causal_softmax_bf16.argtypes = [p, n, i, i]
    lib.tsr_add_rms_norm_bf16.argtypes = [p, p, p, p, p, p, n, i, f32, i]
    lib.tsr_rms_norm_backward_bf16.argtypes = [p, p, p, p, p, p, p, n, i, i]
    lib.tsr_causal_softmax_backward_bf16.argtypes = [p, p, n, i, i]
    lib.tsr_add_rms_norm_bf16_stream.argtypes = [p, p, p, p, p, p, n, i, f32, i]
    lib.tsr_rms_norm_backward_bf16_stream.argtypes = [p, p, p, p, p, p, n, i, i]
    for name in (
        "tsr_softmax_rows_bf16",
        "tsr_norm_rope_bf16",
        "tsr_norm_rope_backward_bf16",
        "tsr_silu_mul_bf16",
        "tsr_swiglu_backward_bf16",
        "tsr_causal_softmax_bf16",
        "tsr_causal_softmax_backward_bf16",
        "tsr_add_rms_norm_bf16",
        "tsr_rms_norm_backward_bf16",
        "tsr_add_rms_norm_bf16_stream",
        "tsr_rms_norm_backward_bf16_stream",
    ):
        getattr(lib, name).restype = None
    return lib


def library() -> Any | None:
    """The bf16 kernel library, or None after noting that it is unavailable (torch's kernels
    for the rest of the process, as for the float32 ones)."""
    lib = _library()
    if lib is None:
        compiled._unavailable("rows_bf16")
    return lib


def softmax_rows(z: Tensor, lse: Tensor) -> Tensor | None:
    """For bf16 logits z [rows, V] (contiguous, V a multiple of 16), in place: ``z =
    bf16(exp(z - max))`` per row, ``lse`` (float32 [rows]) the rows' logsumexp; returns the
    float32 sums of the exponentials. The values of widening z to float32, running
    `compiled.softmax_rows` and narrowing back, in two passes over the bf16 chunk."""
    if not (
        z.dim() == 2
        and z.dtype == torch.bfloat16
        and z.shape[1] % 16 == 0
        and z.is_contiguous()
        and lse.dtype == torch.float32
        and lse.shape == z.shape[:1]
        and lse.is_contiguous()
        and ready(z, lse)
    ):
        return None
    lib = library()
    if lib is None:
        return None
    total = lse.new_empty(z.shape[0])
    lib.tsr_softmax_rows_bf16(
        _ptr(z), z.shape[0], z.shape[1], _ptr(total), _ptr(lse), torch.get_num_threads()
    )
    return total


def takes_norm_rope(x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor) -> bool:
    """Does the bf16 norm + RoPE kernel (run by `attention_inputs`) take x [B, T, H, D] (bf16,
    laid out as `attention_inputs.use_norm_rope` checks), a float32 norm weight [D] or None,
    float32 cos/sin [T, D]?"""
    return (
        x.dtype == torch.bfloat16
        and cos.dtype == sin.dtype == torch.float32
        and (weight is None or weight.dtype == torch.float32)
        and ready(x, cos, sin, *([] if weight is None else [weight]))
    )


def takes_silu(gate: Tensor, up: Tensor) -> bool:
    """Do `silu_mul` (given rows of unit stride) and `swiglu_backward` take bf16 gate and up
    of this shape (the last dimension a multiple of 16)?"""
    return (
        gate.dtype == up.dtype == torch.bfloat16
        and gate.shape == up.shape
        and gate.shape[-1] % 16 == 0
        and ready(gate, up)
    )


def silu_mul(gate: Tensor, up: Tensor) -> Tensor | None:
    """``silu(gate) * up`` for bf16 gate and up [..., F] (rows of unit stride, e.g. the halves
    of [gate | up]; F a multiple of 16), rounded as torch's two bf16 ops round, in one pass."""
    if not takes_silu(gate, up):
        return None
    lib = library()
    return None if lib is None else compiled._c_silu_mul(lib, gate, up, lib.tsr_silu_mul_bf16)


def swiglu_backward(gate_up: Tensor, dh: Tensor) -> Tensor | None:
    """[d_gate | d_up] for h = silu(gate) * up, gate_up = [gate | up] (bf16 [..., 2F],
    contiguous) and dh (bf16 [..., F]), written over ``gate_up`` (the SwiGLU node's saved
    activation, dead once its backward has run; its version is bumped, as
    `compiled._c_swiglu_backward` does), rounded as torch's eager bf16 backward rounds."""
    if not (
        gate_up.dtype == dh.dtype == torch.bfloat16
        and gate_up.shape[-1] % 32 == 0  # F, its half, a multiple of 16
        and ready(gate_up, dh)
    ):
        return None
    lib = library()
    if lib is None:
        return None
    return compiled._c_swiglu_backward(lib, gate_up, dh, lib.tsr_swiglu_backward_bf16)  # type: ignore[no-any-return]


def _takes_scores(s: Tensor) -> bool:
    """bf16 scores [N, G T, T] (contiguous; T a multiple of 16, at most `MAX_SOFTMAX_ROW`)."""
    t = s.shape[-1]
    return (
        s.dim() == 3
        and s.dtype == torch.bfloat16
        and t % 16 == 0
        and t <= MAX_SOFTMAX_ROW
        and s.shape[1] % t == 0
        and s.is_contiguous()
        and ready(s)
    )


def causal_softmax(s: Tensor) -> Tensor | None:
    """In place: the causal softmax of bf16 scores s [N, G T, T] (row r of a [G T, T] block is
    query r % T, which sees keys 0..r % T): float32 statistics, probabilities rounded once to
    bf16, zeros past each row's last key; returns s. torch's ``masked_fill_`` with the causal
    mask and bf16 ``softmax`` in one pass."""
    if not _takes_scores(s):
        return None
    lib = library()
    if lib is None:
        return None
    lib.tsr_causal_softmax_bf16(
        _ptr(s), s.numel() // s.shape[-1], s.shape[-1], torch.get_num_threads()
    )
    increment_version(s)
    return s


def causal_softmax_backward(p: Tensor, dp: Tensor) -> Tensor | None:
    """In place of ``dp``: ``p (dp - sum(p dp))`` per row (float32 sums, rounded once to bf16)
    for causal probabilities p (as `causal_softmax` leaves them, or torch's softmax of masked
    scores: zero past each row's last key) and their gradient dp, both bf16 [N, G T, T];
    returns dp. torch's ``_softmax_backward_data`` without the masked half."""
    if not (_takes_scores(dp) and p.shape == dp.shape and _takes_scores(p)):
        return None
    lib = library()
    if lib is None:
        return None
    lib.tsr_causal_softmax_backward_bf16(
        _ptr(p), _ptr(dp), dp.numel() // dp.shape[-1], dp.shape[-1], torch.get_num_threads()
    )
    increment_version(dp)
    return dp


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor] | None:
    """A decoder layer's residual add and RMSNorm under bf16 autocast: ``(h, out)`` with h = x +
    y (x the float32 residual stream, y a bf16 sublayer output: h float32) and out the
    normalised h in bf16, for the next sublayer's products, which would cast it so anyway
    (the same bits as the float32 C pass on y widened, with out rounded once). Backward reads
    out's bf16 gradient and writes x's float32 gradient and y's bf16 one in one pass: no
    casts between the float32 stream and the bf16 sublayers either way. None where it does
    not apply (the caller runs the float32 form)."""
    n = x.shape[-1]
    if not (
        torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and x.dtype == weight.dtype == torch.float32
        and y.dtype == torch.bfloat16
        and y.shape == x.shape
        and weight.shape == (n,)
        and not weight.requires_grad
        and all(t.is_contiguous() for t in (x, y, weight))
        and ready(x, y, weight)
    ):
        return None
    if library() is None:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        return _AddRMSNorm.apply(x, y, weight, eps)  # type: ignore[no-any-return]
    h, out, _ = _add_rms_norm_forward(x, y, weight, eps)
    return h, out


def _add_rms_norm_forward(
    x: Tensor, y: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    h, out = torch.empty_like(x), torch.empty_like(y)
    r = x.new_empty(*x.shape[:-1], 1)
    _library().tsr_add_rms_norm_bf16(  # type: ignore[union-attr]
        _ptr(x), _ptr(y), _ptr(weight), _ptr(h), _ptr(out), _ptr(r), x.numel() // n, n, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return h, out, r


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, y: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        h, out, r = _add_rms_norm_forward(x, y, weight, eps)
        ctx.save_for_backward(h, weight, r)
        ctx.set_materialize_grads(False)  # the last layer's h feeds nothing but its norm
        return h, out

    @staticmethod
    def backward(ctx: Any, dh: Tensor | None, dout: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, weight, r = ctx.saved_tensors
        if dout is None:  # only the residual path: y's gradient is x's, rounded
            return dh, None if dh is None else dh.to(torch.bfloat16), None, None
        g = dout.to(torch.bfloat16).contiguous()
        add = None if dh is None else dh.to(torch.float32).contiguous()
        d, d_low = torch.empty_like(h), torch.empty_like(g)
        n = h.shape[-1]
        _library().tsr_rms_norm_backward_bf16(  # type: ignore[union-attr]
            _ptr(g), _ptr(h), _ptr(weight), _ptr(r), None if add is None else _ptr(add),
            _ptr(d), _ptr(d_low), h.numel() // n, n, torch.get_num_threads(),
        )  # fmt: skip
        return d, d_low, None, None


def bf16_stream_rms_norm(
    x: Tensor, y: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor] | None:
    """A bf16 checkpoint's residual add and RMSNorm (weights and residual stream in bf16, no
    autocast): ``(h, out)`` with h = x + y in bf16 (``y`` None: h is x) and out =
    ``weight * rms_norm(h)`` as torch's eager bf16 ops round it (`fused.rms_norm`: the
    normalised row cast to bf16 before the gain), in one C pass a row each way where those
    ops take ~6 forward and ~8 backward. Values within a bf16 unit of theirs (the mean of
    squares summed in another order). None where it does not apply (the caller runs torch's
    ops): not all bf16 on the CPU, under autocast, a gain that needs a gradient, rows not a
    multiple of 16 long, inference mode (`ready`)."""
    if x.dtype != torch.bfloat16:  # the float32 steps' calls: out at once
        return None
    n = x.shape[-1]
    operands = (x, weight) if y is None else (x, y, weight)
    if not (
        not torch.is_autocast_enabled("cpu")
        and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in operands)
        and (y is None or y.shape == x.shape)
        and weight.shape == (n,)
        and n % 16 == 0
        and not weight.requires_grad
        and ready(*operands)
        and library() is not None
    ):
        return None
    gain = weight.float()  # a bf16 gain widened exactly
    if torch.is_grad_enabled() and (x.requires_grad or (y is not None and y.requires_grad)):
        got = _StreamRMSNorm.apply(x, y, gain, eps)
        return (x, got) if y is None else got  # type: ignore[return-value]
    h, out, _ = _stream_forward(x, y, gain, eps)
    return h, out


def _stream_forward(
    x: Tensor, y: Tensor | None, gain: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    h = x if y is None else torch.empty_like(x)
    out = torch.empty_like(x)
    r = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    _library().tsr_add_rms_norm_bf16_stream(  # type: ignore[union-attr]
        _ptr(x), None if y is None else _ptr(y), _ptr(gain), _ptr(h), _ptr(out), _ptr(r),
        x.numel() // n, n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return h, out, r


class _StreamRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, y: Tensor | None, gain: Tensor, eps: float
    ) -> tuple[Tensor, Tensor] | Tensor:
        """-> (h, out), or out alone without y (h is x)."""
        h, out, r = _stream_forward(x, y, gain, eps)
        ctx.save_for_backward(h, gain, r)
        ctx.set_materialize_grads(False)  # the last layer's h feeds nothing but its norm
        ctx.added = y is not None
        return (h, out) if ctx.added else out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, gain, r = ctx.saved_tensors
        dh, dout = grads if ctx.added else (None, grads[0])
        if dout is None:  # only the residual path
            return dh, dh, None, None
        add = None if dh is None else dh.contiguous()
        g, d = dout.contiguous(), torch.empty_like(h)
        n = h.shape[-1]
        _library().tsr_rms_norm_backward_bf16_stream(  # type: ignore[union-attr]
            _ptr(g), _ptr(h), _ptr(gain), _ptr(r), None if add is None else _ptr(add), _ptr(d),
            h.numel() // n, n, torch.get_num_threads(),
        )  # fmt: skip
        return d, d if ctx.added else None, None, None
