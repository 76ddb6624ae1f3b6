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

`delta_rule` is the whole recurrence over sequences for training and prefill, position by
position, each (row, head) pair in one thread with its state in cache, with its gradient (which
recomputes each chunk of states from one saved per 64 positions): ~3x faster than the chunked
form of `hybrid.gated_delta_rule` at heads of 64 x 64 (at 128 x 128 the forward 2x, the backward
about even), and less kept for backward.

`short_conv_silu` is the layer's short causal convolution and its SiLU (``csrc/deltanet.c``)
on the q/k/v projection's [B, T, C] rows as they are, where torch's conv1d wants [B, C, T]:
a transposed, padded copy in forward and transposed strides again in backward.
`deltanet_heads` forms the rule's q, k (L2-normalised, repeated per value head) and v from
the convolution's output in one pass, heads-major as the rule reads them.
`gated_rms_norm` is its gated RMSNorm, one pass a row (torch's eager form: ~8 passes forward,
~12 backward), reading the rule's heads-major output through its strides. The convolution and
the norm compute in float32 whatever their operands' floating types: a bfloat16 checkpoint's
projections, or autocast's, are read as float32 (no bf16 ops and casts around them).

`benchmarks/linear_attention.py` times them in the step and in sampling (``--work sample``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from tinker_sr.engine import compiled

__all__ = [
    "delta_rule",
    "delta_rule_runs",
    "deltanet_heads",
    "deltanet_runs",
    "gated_delta_step_",
    "gated_rms_norm",
    "native_solve_ready",
    "short_conv_silu",
    "unit_lower_solve",
]

log = logging.getLogger("tinker_sr.engine")

# The floating types the DeltaNet layer's C passes take (`short_conv_silu`, `gated_rms_norm`):
# they compute in float32, a half-precision operand read as float32 (a bfloat16 checkpoint's
# projections, autocast's), its gradient returned in its own type.
TAKEN = (torch.float32, torch.bfloat16, torch.float16)

_FUNCTIONS = {torch.float32: "tsr_unit_lower_solve_f32", torch.float64: "tsr_unit_lower_solve_f64"}


def _load(name: str, what: str, defines: tuple[str, ...] = ()) -> Any | None:
    """The library of ``csrc/<name>.c``, or None (logged, with why) where it is unavailable."""
    from tinker_sr.engine import native

    lib = native.load(name, defines)
    if lib is None:
        why = native.failure(name, defines)
        log.info("%s's C kernels are unavailable (%s): torch's ops run", what, why)
    return lib


@functools.cache
def _library(defines: tuple[str, ...] = ()) -> Any | None:
    """csrc/delta_rule.c's library, its functions typed; ``defines``: a build variant
    (`native.load`: benchmarks' baselines)."""
    lib = _load("delta_rule", "the gated delta rule", defines)
    if lib is None:
        return None
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name in _FUNCTIONS.values():
        getattr(lib, name).argtypes = [p, p, p, n, i, i, i, i]
        getattr(lib, name).restype = None
    f = ctypes.c_float
    lib.tsr_gated_delta_step.argtypes = [p] * 7 + [n, i, i, f, f, i]
    lib.tsr_gated_delta_step.restype = None
    for suffix, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        forward, backward = (getattr(lib, f"tsr_delta_rule_{w}_{suffix}") for w in ("fwd", "bwd"))
        forward.argtypes = [p] * 9 + [n, n, i, i, i, real, real, i]
        forward.restype = None
        backward.argtypes = [p] * 14 + [n, n, i, i, i, real, real, i]
        backward.restype = ctypes.c_int
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


def _pointer(t: Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _solve(system: Tensor, rhs: Tensor, transposed: bool) -> Tensor:
    """The C kernel on contiguous copies of the operands flattened to one batch dimension."""
    n, m = rhs.shape[-2], rhs.shape[-1]
    lead = rhs.shape[:-2]
    a = system.reshape(-1, n, n).contiguous()
    b = rhs.reshape(-1, n, m).contiguous()
    out = torch.empty_like(b)
    fn = getattr(_library(), _FUNCTIONS[b.dtype])
    fn(
        _pointer(a), _pointer(b), _pointer(out), b.shape[0], n, m, int(transposed),
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
        *(_pointer(t) for t in (q, k, v, g, beta, state, out)),
        state.numel() // (dk * dv), dk, dv, dk**-0.5, floor, torch.get_num_threads(),
    )  # fmt: skip
    return out


_RULE_TYPES = {torch.float32: "f32", torch.float64: "f64"}


def delta_rule_runs(device: torch.device) -> bool:
    """Does `delta_rule` run the C kernels for float32 / float64 operands on ``device``?"""
    return device.type == "cpu" and compiled.native_mode() != "off" and _library() is not None


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None,
    floor: float,
    chunk: int,
) -> tuple[Tensor, Tensor] | None:
    """`hybrid.gated_delta_rule` position by position in C (``tsr_delta_rule_fwd``), with its
    gradient (``tsr_delta_rule_bwd``, which recomputes each ``chunk`` of states from the one
    saved before it): q, k [B, T, H, Dk] (not yet scaled), v [B, T, H, Dv], g, beta [B, T, H],
    state [B, H, Dk, Dv] or None -> (out [B, T, H, Dv], final state). None where the kernel
    cannot take the operands (the caller runs the chunked form): not all float32 or all
    float64 on the CPU, Dv over 1,024, shapes other than these, the C kernels off or
    unavailable."""
    operands = [q, k, v, g, beta] + ([] if state is None else [state])
    B, T, H, Dk = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    Dv = v.shape[-1]
    shapes = [(B, T, H, Dk), (B, T, H, Dk), (B, T, H, Dv), (B, T, H), (B, T, H), (B, H, Dk, Dv)]
    if (
        q.dim() != 4
        or any(tuple(t.shape) != shape for t, shape in zip(operands, shapes, strict=False))
        or any(t.device != q.device or t.dtype != q.dtype for t in operands)
        or q.dtype not in _RULE_TYPES
        or v.shape[-1] > 1024
        or not delta_rule_runs(q.device)
    ):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        out = _DeltaRule.apply(floor, chunk, state, q, k, v, g, beta)
        return cast(tuple[Tensor, Tensor], out)
    out, final, _ = _rule_forward((q, k, v, g, beta), state, floor, chunk, keep=False)
    return out, final


def _heads_major(*tensors: Tensor) -> list[Tensor]:
    """[B, T, H, ...] -> contiguous [B, H, T, ...] (each (row, head) pair's positions together)."""
    return [t.transpose(1, 2).contiguous() for t in tensors]


def _rule_forward(
    inputs: Sequence[Tensor], state: Tensor | None, floor: float, chunk: int, keep: bool
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The forward kernel on (q, k, v, g, beta) -> (out, final state, what backward needs:
    the inputs heads-major and the saved states; nothing unless ``keep``)."""
    q, v = inputs[0], inputs[2]
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    qh, kh, vh, gh, bh = _heads_major(*inputs)
    s0 = None if state is None else state.contiguous()
    out = vh.new_empty(B, H, T, Dv)
    final = vh.new_empty(B, H, Dk, Dv)
    saved = vh.new_empty(B * H, -(-T // chunk), Dk, Dv) if keep else None
    fn = getattr(_library(), f"tsr_delta_rule_fwd_{_RULE_TYPES[q.dtype]}")
    fn(
        *(_pointer(t) for t in (qh, kh, vh, gh, bh, s0, out, final, saved)),
        B * H, T, Dk, Dv, chunk, Dk**-0.5, floor, torch.get_num_threads(),
    )  # fmt: skip
    kept = [qh, kh, vh, gh, bh, saved] if saved is not None else []
    return out.transpose(1, 2), final, kept


class _DeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, floor: float, chunk: int, state: Tensor | None, *inputs: Tensor
    ) -> tuple[Tensor, Tensor]:
        out, final, kept = _rule_forward(inputs, state, floor, chunk, keep=True)
        ctx.save_for_backward(*kept)
        ctx.floor, ctx.chunk = floor, chunk
        return out, final

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: Tensor | None, grad_final: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        qh, kh, vh, gh, bh, saved = ctx.saved_tensors
        B, H, T, Dk = qh.shape
        Dv = vh.shape[-1]
        dout = (
            vh.new_zeros(B, H, T, Dv) if grad_out is None else grad_out.transpose(1, 2).contiguous()
        )
        dfinal = None if grad_final is None else grad_final.contiguous()
        dq, dk, dv = torch.empty_like(qh), torch.empty_like(kh), torch.empty_like(vh)
        dg, dbeta = torch.empty_like(gh), torch.empty_like(bh)
        dstate = vh.new_empty(B, H, Dk, Dv)
        fn = getattr(_library(), f"tsr_delta_rule_bwd_{_RULE_TYPES[qh.dtype]}")
        failed = fn(
            *(_pointer(t) for t in (qh, kh, vh, gh, bh, saved, dout, dfinal)),
            *(_pointer(t) for t in (dq, dk, dv, dg, dbeta, dstate)),
            B * H, T, Dk, Dv, ctx.chunk, Dk**-0.5, ctx.floor, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(
                f"the gated delta rule's backward could not allocate its buffer of recomputed "
                f"{Dk} x {Dv} states (up to 4 MiB per thread); free memory or use fewer threads"
            )
        grads = [t.transpose(1, 2) for t in (dq, dk, dv, dg, dbeta)]
        return (None, None, dstate if ctx.needs_input_grad[2] else None, *grads)


# The most taps `short_conv_silu` takes (Qwen3.5's convolution has 4).
MAX_TAPS = 16


@functools.cache
def _deltanet_library() -> Any | None:
    lib = _load("deltanet", "the DeltaNet layer's convolution, heads and gated norm")
    if lib is None:
        return None
    p, n, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {  # name: (argument types, result type)
        "tsr_short_conv_silu_fwd": ([p] * 4 + [n, n, n, i, i], None),
        "tsr_short_conv_silu_bwd": ([p] * 4 + [n, n, n, i, i], ctypes.c_int),
        "tsr_gated_rms_norm_fwd": ([p] + [n] * 5 + [p] * 3 + [n, i, f, i], None),
        "tsr_gated_rms_norm_bwd": ([p] + [n] * 5 + [p] * 5 + [n, i, f, i], None),
        "tsr_deltanet_heads_fwd": ([p] * 4 + [n, n, i, i, i, i, f, i], None),
        "tsr_deltanet_heads_bwd": ([p] * 5 + [n, n, i, i, i, i, f, i], None),
    }
    for name, (args, result) in signatures.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    return lib


def deltanet_runs(device: torch.device) -> bool:
    """Do the DeltaNet layer's C passes (`short_conv_silu`, `deltanet_heads`, `gated_rms_norm`)
    run on ``device`` (in float32; the convolution and norm read a bfloat16 operand too)?"""
    return (
        device.type == "cpu" and compiled.native_mode() != "off" and _deltanet_library() is not None
    )


def short_conv_silu(x: Tensor, weight: Tensor, init: Tensor | None = None) -> Tensor | None:
    """``silu(conv1d(pad(x^T), weight, groups=C))^T`` from x's rows as they are: x [B, T, C],
    ``weight`` the depthwise conv1d's [C, 1, K], ``init`` [B, C, K - 1] the inputs before
    x's first position (a decode cache's window; None: zeros) -> float32 [B, T, C], computed in
    float32 whatever the operands' floating types (a bfloat16 checkpoint's, or autocast's
    bfloat16 projection: read as float32, the gradient returned in x's type). Differentiable
    in x (without ``init``). None where the C kernels do not apply (the caller runs torch's
    conv1d): not on the CPU, not a floating type of `TAKEN`, a weight or window that needs a
    gradient, more than `MAX_TAPS` taps, the C kernels off or unavailable."""
    operands = [x, weight] + ([] if init is None else [init])
    B, T, C = x.shape if x.dim() == 3 else (0, 0, 0)
    K = weight.shape[-1]
    grad = torch.is_grad_enabled()
    if (
        x.dim() != 3
        or tuple(weight.shape) != (C, 1, K)
        or not 1 <= K <= MAX_TAPS
        or (init is not None and tuple(init.shape) != (B, C, K - 1))
        or any(t.dtype not in TAKEN or t.device.type != "cpu" for t in operands)
        or (grad and (weight.requires_grad or (init is not None and init.requires_grad)))
        or (grad and x.requires_grad and init is not None)
        or not deltanet_runs(x.device)
    ):
        return None
    taps = weight.detach().float().reshape(C, K).t().contiguous()  # [K, C]
    if grad and x.requires_grad:
        return _ShortConvSilu.apply(x, taps)  # type: ignore[no-any-return]
    window = None if init is None else init.float().transpose(1, 2).contiguous()  # [B, K - 1, C]
    return _conv_forward(x.float().contiguous(), taps, window)


def _conv_forward(x: Tensor, taps: Tensor, window: Tensor | None) -> Tensor:
    B, T, C = x.shape
    out = torch.empty(B, T, C, dtype=torch.float32)
    cast(Any, _deltanet_library()).tsr_short_conv_silu_fwd(
        *(_pointer(t) for t in (x, taps, window, out)), B, T, C, taps.shape[0],
        torch.get_num_threads(),
    )  # fmt: skip
    return out


class _ShortConvSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, taps: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, taps)  # in its own type: a bfloat16 x is read again as float32
        return _conv_forward(x.float().contiguous(), taps, None)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:  # type: ignore[override]
        given, taps = ctx.saved_tensors
        x = given.float().contiguous()
        B, T, C = x.shape
        dx = torch.empty_like(x)
        failed = cast(Any, _deltanet_library()).tsr_short_conv_silu_bwd(
            *(_pointer(t) for t in (x, taps, grad.contiguous(), dx)), B, T, C, taps.shape[0],
            torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(
                f"the short convolution's backward could not allocate its buffer "
                f"({(64 + taps.shape[0]) * C * 4} bytes per thread); free memory or use fewer "
                f"threads"
            )
        return dx.to(given.dtype), None


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """`hybrid.GatedRMSNorm`'s ``weight * (y / sqrt(mean(y^2) + eps)) * silu(z)`` over the last
    dimension, in C: y [..., n] (2 to 4 dimensions, any strides with the last dimension's
    1: the rule's heads-major output as it is), z of y's shape, ``weight`` [n] -> a contiguous
    float32 result of y's shape, computed in float32 whatever the operands' floating types
    (`TAKEN`: a bfloat16 z or weight read as float32, gradients returned in their operand's
    type). Differentiable in y and z. None where the C kernels do not apply (the caller runs
    torch's ops): not all on the CPU in a type of `TAKEN`, a weight that needs a gradient,
    other shapes, the C kernels off or unavailable."""
    n = y.shape[-1] if y.dim() else 0
    if (
        not 2 <= y.dim() <= 4
        or z.shape != y.shape
        or tuple(weight.shape) != (n,)
        or y.stride(-1) != 1
        or any(t.dtype not in TAKEN or t.device.type != "cpu" for t in (y, z, weight))
        or (torch.is_grad_enabled() and weight.requires_grad)
        or not deltanet_runs(y.device)
    ):
        return None
    shape = y.shape
    y4 = y[(None,) * (4 - y.dim())]  # unit leading dimensions: views
    z4 = z.contiguous().view((1,) * (4 - z.dim()) + tuple(z.shape))
    gain = weight.detach().float()
    if torch.is_grad_enabled() and (y.requires_grad or z.requires_grad):
        out = _GatedRMSNorm.apply(y4, z4, gain, eps)
    else:
        out = _norm_forward(y4.float(), z4.float(), gain, eps)
    return out.view(shape)  # type: ignore[no-any-return]


# Below this many values the gated norm runs on one thread: a decode step's few rows cost less
# than waking the other threads (~90 us with passive waits on some VMs), as torch's elementwise
# ops stay serial under their grain size. Rows are independent: the same bits either way.
_SERIAL_VALUES = 1 << 16


def _threads(values: int) -> int:
    return 1 if values < _SERIAL_VALUES else torch.get_num_threads()


def _norm_forward(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    out = torch.empty_like(z)
    cast(Any, _deltanet_library()).tsr_gated_rms_norm_fwd(
        _pointer(y), y.shape[1], y.shape[2], *y.stride()[:3],
        *(_pointer(t) for t in (z, weight.contiguous(), out)), out.numel() // y.shape[3],
        y.shape[3], eps, _threads(out.numel()),
    )  # fmt: skip
    return out


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, y: Tensor, z: Tensor, weight: Tensor, eps: float
    ) -> Tensor:
        if torch.empty_like(y).stride() != y.stride():  # not dense: its gradient could not
            y = y.contiguous()  # take its strides
        ctx.save_for_backward(y, z, weight)  # in their own types: read again as float32
        ctx.eps = eps
        return _norm_forward(y.float(), z.float(), weight, eps)  # float(): y's strides kept

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        y_given, z_given, weight = ctx.saved_tensors
        y, z = y_given.float(), z_given.float()
        dy, dz = torch.empty_like(y), torch.empty_like(z)  # dy: y's strides
        cast(Any, _deltanet_library()).tsr_gated_rms_norm_bwd(
            _pointer(y), y.shape[1], y.shape[2], *y.stride()[:3],
            *(_pointer(t) for t in (z, weight.contiguous(), grad.contiguous(), dy, dz)),
            z.numel() // y.shape[3], y.shape[3], ctx.eps, _threads(z.numel()),
        )  # fmt: skip
        return dy.to(y_given.dtype), dz.to(z_given.dtype), None, None


def deltanet_heads(
    mixed: Tensor, key_heads: int, heads: int, dk: int, dv: int, eps: float = 1e-6
) -> tuple[Tensor, Tensor, Tensor] | None:
    """`hybrid.GatedDeltaNet`'s q, k, v from the convolution's output ``mixed`` [B, T, C]
    (C = 2 key_heads dk + heads dv: q | k | v) in C: q and k L2-normalised (``x / sqrt(sum(x^2)
    + eps)``) and repeated for the consecutive value heads each key head serves, as
    [B, T, heads, dk] and v [B, T, heads, dv], each a transposed view of a heads-major
    [B, heads, T, d] tensor (what the rule reads: no copy there). Differentiable in mixed.
    None where the C kernels do not apply (the caller runs torch's ops): not a contiguous
    float32 [B, T, C] on the CPU, heads not a multiple of key_heads, the C kernels off or
    unavailable."""
    if (
        mixed.dim() != 3
        or mixed.shape[-1] != 2 * key_heads * dk + heads * dv
        or key_heads < 1
        or heads % key_heads
        or mixed.dtype != torch.float32
        or not mixed.is_contiguous()
        or not deltanet_runs(mixed.device)
    ):
        return None
    dims = (key_heads, heads, dk, dv, eps)
    if torch.is_grad_enabled() and mixed.requires_grad:
        qh, kh, vh = _DeltaNetHeads.apply(mixed, *dims)
    else:
        qh, kh, vh = _heads_forward(mixed, *dims)
    return qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2)


def _heads_forward(
    mixed: Tensor, key_heads: int, heads: int, dk: int, dv: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    B, T, _ = mixed.shape
    q, k = (mixed.new_empty(B, heads, T, dk) for _ in "qk")
    v = mixed.new_empty(B, heads, T, dv)
    cast(Any, _deltanet_library()).tsr_deltanet_heads_fwd(
        *(_pointer(t) for t in (mixed, q, k, v)), B, T, key_heads, heads, dk, dv, eps,
        _threads(mixed.numel()),
    )  # fmt: skip
    return q, k, v


class _DeltaNetHeads(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mixed: Tensor, key_heads: int, heads: int, dk: int, dv: int, eps: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        ctx.save_for_backward(mixed)
        ctx.dims = (key_heads, heads, dk, dv, eps)
        return _heads_forward(mixed, key_heads, heads, dk, dv, eps)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        (mixed,) = ctx.saved_tensors
        key_heads, heads, width_k, width_v, eps = ctx.dims
        B, T, _ = mixed.shape
        grads = [
            mixed.new_zeros(B, heads, T, w) if g is None else g.contiguous()
            for g, w in ((dq, width_k), (dk, width_k), (dv, width_v))
        ]
        dmixed = torch.empty_like(mixed)
        cast(Any, _deltanet_library()).tsr_deltanet_heads_bwd(
            *(_pointer(t) for t in (mixed, *grads, dmixed)), B, T, key_heads, heads, width_k,
            width_v, eps, _threads(mixed.numel()),
        )  # fmt: skip
        return dmixed, None, None, None, None, None
