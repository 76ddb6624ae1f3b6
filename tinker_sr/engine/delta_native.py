"""C kernels of Qwen3.5's gated delta rule (``csrc/delta_rule.c``), torch's ops where the C
kernels are unavailable (no compiler, ``$TINKER_SR_NATIVE=0``, another device).

`unit_lower_solve` is ``torch.linalg.solve_triangular(system, rhs, upper=False,
unitriangular=True)`` with its gradient, for the chunked form (training, prefill): one OpenMP
region for the whole batch, float32 and float64 on the CPU. torch's own solve calls the BLAS
once per matrix, and each call opens a parallel region; with the engine's passive OpenMP waits
(`cpu.prefer_passive_waits`) each of them costs a wake-up of the other threads, and the 256
solves of 64 x 64 in one layer of a Qwen3.5 step (8 x 256 tokens) took ~16 ms instead of ~1.5.

`gated_delta_step_` is a decode position of the recurrence (`hybrid.gated_delta_step`) with
the state advanced in place, in one C pass per (row, head) where torch's elementwise form makes
five passes over the whole state, each a parallel region.

`benchmarks/linear_attention.py` times both in the step and in sampling (``--work sample``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch
from torch import Tensor

from tinker_sr.engine import compiled

__all__ = ["gated_delta_step_", "native_solve_ready", "unit_lower_solve"]

log = logging.getLogger("tinker_sr.engine")

_FUNCTIONS = {torch.float32: "tsr_unit_lower_solve_f32", torch.float64: "tsr_unit_lower_solve_f64"}


@functools.cache
def _library() -> Any | None:
    from tinker_sr.engine import native

    lib = native.load("delta_rule")
    if lib is None:
        why = native.failure("delta_rule")
        log.info("the gated delta rule's C kernels are unavailable (%s): torch's ops run", why)
        return None
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name in _FUNCTIONS.values():
        getattr(lib, name).argtypes = [p, p, p, n, i, i, i, i]
        getattr(lib, name).restype = None
    f = ctypes.c_float
    lib.tsr_gated_delta_step.argtypes = [p] * 7 + [n, i, i, f, f, i]
    lib.tsr_gated_delta_step.restype = None
    return lib


def native_solve_ready(system: Tensor, rhs: Tensor) -> bool:
    """Would `unit_lower_solve` run the C kernel on these operands?"""
    return (
        compiled.native_mode() != "off"
        and system.device.type == "cpu"
        and system.dtype in _FUNCTIONS
        and rhs.dtype == system.dtype
        and system.shape[:-1] == rhs.shape[:-1]
        and system.shape[-1] == system.shape[-2]
        and _library() is not None
    )


def unit_lower_solve(system: Tensor, rhs: Tensor) -> Tensor:
    """``X`` with ``(I + strictly_lower(system)) X = rhs``: system [..., n, n] (its diagonal and
    upper part are not read), rhs [..., n, m] -> [..., n, m]. Differentiable in both."""
    if not native_solve_ready(system, rhs):
        return torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    return _UnitLowerSolve.apply(system, rhs)  # type: ignore[no-any-return]


def _solve(system: Tensor, rhs: Tensor, transposed: bool) -> Tensor:
    """The C kernel on contiguous copies of the operands flattened to one batch dimension."""
    n, m = rhs.shape[-2], rhs.shape[-1]
    lead = rhs.shape[:-2]
    a = system.reshape(-1, n, n).contiguous()
    b = rhs.reshape(-1, n, m).contiguous()
    out = torch.empty_like(b)
    fn = getattr(_library(), _FUNCTIONS[b.dtype])
    fn(
        ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()),
        ctypes.c_void_p(out.data_ptr()), b.shape[0], n, m, int(transposed),
        torch.get_num_threads(),
    )  # fmt: skip
    return out.reshape(*lead, n, m)


class _UnitLowerSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, system: Tensor, rhs: Tensor) -> Tensor:  # type: ignore[override]
        out = _solve(system, rhs, transposed=False)
        ctx.save_for_backward(system, out)
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor | None, Tensor | None]:
        system, out = ctx.saved_tensors
        grad_rhs = _solve(system, grad, transposed=True)  # (I + L)^-T grad
        grad_system = None
        if ctx.needs_input_grad[0]:  # only the strictly lower part is an input of the solve
            grad_system = -(grad_rhs @ out.transpose(-1, -2)).tril(-1)
        return grad_system, grad_rhs if ctx.needs_input_grad[1] else None


def gated_delta_step_(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, floor: float
) -> Tensor | None:
    """`hybrid.gated_delta_step` with ``state`` [B, H, Dk, Dv] advanced in place by the C
    kernel, decays under ``exp(floor)`` zero -> out [B, H, Dv]; None (nothing done) where the
    kernel cannot take the operands (the caller runs torch's form): not all float32 on the
    CPU, a state not contiguous, shapes other than these, the C kernels off or unavailable, or
    Dv over 1,024."""
    operands = (q, k, v, g, beta, state)
    *lead, dk, dv = state.shape
    lib = _library() if compiled.native_mode() != "off" else None
    if (
        lib is None
        or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in operands)
        or not state.is_contiguous()
        or dv > 1024
        or not q.shape == k.shape == (*lead, dk)
        or v.shape != (*lead, dv)
        or not g.shape == beta.shape == tuple(lead)
    ):
        return None
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = v.new_empty(*lead, dv)
    lib.tsr_gated_delta_step(
        *(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, g, beta, state, out)),
        state.numel() // (dk * dv), dk, dv, dk**-0.5, floor, torch.get_num_threads(),
    )  # fmt: skip
    return out
