"""Optional fused elementwise kernels for the training step, compiled by ``torch.compile``.

Off by default; ``$TINKER_SR_COMPILE=1`` turns it on. What it replaces: the chains of
memory-bound eager passes around the matrix products of a training step on a large batch,
each now one loop over its tensors (inductor generates C++ with OpenMP and compiles it with
the machine's C++ compiler):

* RMSNorm forward (``weight * x / sqrt(mean(x^2) + eps)``) and its input gradient;
* the rotary embedding and its inverse (the gradient);
* ``silu(gate) * up`` and, in the merged LoRA MLP's backward, both halves of the gate/up
  gradient written into one buffer.

The matrix products, attention and the loss stay as they are (the products run on oneDNN,
faster than what inductor would call for them). Measured on the 16 x 256 benchmark step
(docs/performance.md, `benchmarks/compiled.py`): ~5 % less time per step (1-9 % over four
runs), nothing at 8 x 128, after a one-time compile of ~5-20 s per process (inductor keeps
the generated code in a disk cache, so later processes compile faster).

Used only where it pays and is safe: float32 CPU tensors of at least `MIN_ELEMENTS`
elements (training-sized), outside autocast and outside inference mode: the samplers (decode
and prefill, which run in inference mode on their own worker thread beside training) keep
the eager kernels, so their many small shapes never trigger a compile. Shapes are compiled
dynamic, so an RL loop whose batch shape changes every step does not recompile per shape.
Results match the eager path to float32 rounding (the norms' sums run in another order) and
are bit-identical from run to run. Each kernel's first call compiles it and logs that (INFO,
logger ``tinker_sr.engine``: the first large step takes seconds longer). If compiling fails
(no C++ compiler, an unsupported torch build), the engine warns once and keeps the eager
path for the rest of the process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["ENV", "MIN_ELEMENTS", "attention", "call", "enabled", "failure", "use", "use_attention"]

ENV = "TINKER_SR_COMPILE"
# Below this many elements a kernel's call overhead (guards, dispatch) outweighs the fusion.
MIN_ELEMENTS = 1 << 16

_failure: str | None = None
_compiled: set[str] = set()  # kernels whose first call (the compile) has returned
log = logging.getLogger("tinker_sr.engine")


@functools.cache
def enabled() -> bool:
    """``$TINKER_SR_COMPILE``: ``1`` compiles the fused kernels; unset or ``0`` keeps eager."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${ENV}={raw!r}: use 1 to compile the fused kernels or 0 (the default)")


def use(*tensors: Tensor) -> bool:
    """Should these operands go through a compiled kernel? (float32, CPU, large, no autocast,
    not in inference mode: sampling keeps its eager kernels, see the module's docstring.)"""
    if not enabled() or _failure is not None or torch.is_autocast_enabled("cpu"):
        return False
    if torch.is_inference_mode_enabled():
        return False
    if tensors[0].numel() < MIN_ELEMENTS:
        return False
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def call(name: str, *args: Any) -> Any | None:
    """Run kernel ``name``; None where compiling failed (the caller runs its eager code)."""
    global _failure
    try:
        if name in _compiled:
            return _kernels()[name](*args)
        log.info("%s=1: compiling the fused kernel %r (first use)", ENV, name)
        start = time.perf_counter()
        out = _kernels()[name](*args)
        _compiled.add(name)
        log.info("compiled %r in %.1f s", name, time.perf_counter() - start)
        return out
    except Exception as exc:  # a compile failure: inductor, the C++ compiler, dynamo
        _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        warnings.warn(
            f"${ENV}=1: compiling the fused kernel {name!r} failed ({_failure}); the engine "
            "keeps its eager kernels for the rest of this process. torch.compile needs a C++ "
            f"compiler on PATH (g++ or clang++); unset {ENV} to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def failure() -> str | None:
    """Why compiled kernels were switched off in this process, or None."""
    return _failure


# ---- causal attention: a C kernel (csrc/causal_attention.c) ---------------------------------

ATTENTION_BLOCK = 64  # the C kernel's block of queries and keys (its padding unit)


def use_attention(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Can `attention` take these [B, H, T, D] / [B, KV, T, D] operands? (As `use`, and a
    head size that is a multiple of 16, whole query groups.)"""
    return (
        q.dim() == 4
        and q.shape[-1] % 16 == 0
        and q.shape[1] % k.shape[1] == 0
        and k.shape == v.shape
        and use(q, k, v)
    )


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """Causal attention of q [B, H, T, D] over k, v [B, KV, T, D] (H a multiple of KV: grouped
    queries), scaled by 1/sqrt(D), like ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True, enable_gqa=True)``; None where the C kernel could not be built (the
    caller uses torch's). The result is a [B, H, T, D] view of a [B, T, H, D] tensor: the
    layout the output projection reads, so transposing it back costs no copy."""
    global _failure
    lib = _attention_library()
    if lib is None:
        from tinker_sr.engine import native

        _failure = native.failure("causal_attention")
        warnings.warn(
            f"${ENV}=1: the C attention kernel is unavailable ({_failure}); the engine keeps "
            f"its eager kernels for the rest of this process. Unset {ENV} to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return _CausalAttention.apply(q, k, v)  # type: ignore[no-any-return]


@functools.cache
def _attention_library() -> Any | None:
    from tinker_sr.engine import native

    lib = native.load("causal_attention")
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.tsr_attention_forward.argtypes = [p] * 5 + [i] * 6 + [ctypes.c_float, i]
    lib.tsr_attention_forward.restype = None
    lib.tsr_attention_backward.argtypes = [p] * 12 + [i] * 6 + [ctypes.c_float, i]
    lib.tsr_attention_backward.restype = None
    log.info("%s=1: C attention kernel loaded", ENV)
    return lib


def _padded(x: Tensor, tp: int, transpose: bool) -> Tensor:
    """x [..., T, D] as a zero-padded [..., Tp, D] (or, transposed, [..., D, Tp]) copy."""
    *lead, t, d = x.shape
    if transpose:
        out = x.new_zeros(*lead, d, tp)
        out[..., :t].copy_(x.transpose(-1, -2))
    else:
        out = x.new_zeros(*lead, tp, d)
        out[..., :t, :].copy_(x)
    return out


def _ptr(t: Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # type: ignore[override]
        b, h, t, d = q.shape
        kv = k.shape[1]
        tp = -(-t // ATTENTION_BLOCK) * ATTENTION_BLOCK
        q = q.contiguous()
        kt, vp = _padded(k, tp, transpose=True), _padded(v, tp, transpose=False)
        o, lse = q.new_empty(b, t, h, d), q.new_zeros(b, h, tp)
        scale = 1.0 / math.sqrt(d)
        lib = _attention_library()
        assert lib is not None  # `attention` checked
        lib.tsr_attention_forward(
            _ptr(q), _ptr(kt), _ptr(vp), _ptr(o), _ptr(lse),
            b, h, kv, t, tp, d, scale, torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(q, kt, vp, o, lse)
        return o.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        q, kt, vp, o, lse = ctx.saved_tensors
        b, h, t, d = q.shape
        kv, tp = kt.shape[1], kt.shape[-1]
        go = grad.transpose(1, 2).contiguous()  # [B, T, H, D]: no copy for the model's grad
        qt = _padded(q, tp, transpose=True)
        got = _padded(grad, tp, transpose=True)
        kp = kt.transpose(-1, -2).contiguous()
        dl = q.new_zeros(b, h, tp)
        dl[..., :t].copy_((go * o).sum(-1).transpose(1, 2))
        dqt = q.new_zeros(b, h, d, tp)
        dk, dv = q.new_empty(b, kv, t, d), q.new_empty(b, kv, t, d)
        lib = _attention_library()
        assert lib is not None
        lib.tsr_attention_backward(
            _ptr(qt), _ptr(q), _ptr(kp), _ptr(vp), _ptr(kt), _ptr(go), _ptr(got),
            _ptr(lse), _ptr(dl), _ptr(dqt), _ptr(dk), _ptr(dv),
            b, h, kv, t, tp, d, 1.0 / math.sqrt(d), torch.get_num_threads(),
        )  # fmt: skip
        return dqt[..., :t].transpose(-1, -2), dk, dv


# ---- the kernels (their eager twins are in fused.py) -----------------------------------------


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * r).to(x.dtype) * weight, r


def _rms_norm_backward(g: Tensor, x: Tensor, weight: Tensor, r: Tensor) -> Tensor:
    n = x.float() * r
    gn = (g * weight).float()
    mean = (gn * n).mean(-1, keepdim=True)
    return ((gn - n * mean) * r).to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _rope_inverse(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], dim=-1)


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return torch.nn.functional.silu(gate) * up


def _swiglu_backward(gate_up: Tensor, dh: Tensor) -> Tensor:
    """[d_gate | d_up] for h = silu(gate) * up, ``gate_up = [gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d_up = gate * sig * dh
    d_gate = dh * up * (sig * (1 + gate * (1 - sig)))  # silu'(gate), as aten's silu_backward
    return torch.cat([d_gate, d_up], dim=-1)


@functools.cache
def _kernels() -> dict[str, Callable[..., Any]]:
    fns: dict[str, Callable[..., Any]] = {
        "rms_norm": _rms_norm,
        "rms_norm_backward": _rms_norm_backward,
        "rope": _rope,
        "rope_inverse": _rope_inverse,
        "silu_mul": _silu_mul,
        "swiglu_backward": _swiglu_backward,
    }
    return {k: torch.compile(f, dynamic=True, fullgraph=True) for k, f in fns.items()}
