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

import functools
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["ENV", "MIN_ELEMENTS", "call", "enabled", "failure", "use"]

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
