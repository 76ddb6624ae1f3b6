"""The adapter gradients of a LoRA group in C (csrc/rows.c): `lora_grads` for any group, and
`swiglu_backward_lora` for the gate/up group inside the SwiGLU gradient's own pass.

A group is g projections sharing an input x [M, K] (q/k/v; gate/up), their outputs side by
side in dy [M, N], member i with W_i + s B_i A_i (B_i [N_i, r], A_i [r, K]). From one read of
dy (and x) the kernels form s x A^T, s dy B, dB_i = s dy_i^T (x A_i^T) and dA_i = s (dy B_i)^T x,
each member meeting only its own ranks, with sums over fixed 64-row blocks added in block
order: the results do not depend on the thread count.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tinker_sr.engine import compiled

LORA_BLOCK = 64  # rows per partial sum in csrc/rows.c's tsr_lora_grads (= SWIGLU_BLOCK)


@dataclass
class LoraGrads:
    """`lora_grads`' results: s dy B [M, g r], each member's dB_i [N_i, r], and (given x) each
    member's dA_i [r, K]; every dB_i and dA_i contiguous, in its parameter's layout."""

    dy_b: Tensor
    db: list[Tensor]
    da: list[Tensor] | None


class _Group(ctypes.Structure):
    """csrc/rows.c's ``struct tsr_lora_group``."""

    _fields_ = [
        ("off", ctypes.c_void_p),
        ("g", ctypes.c_int),
        ("r", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("s", ctypes.c_float),
        ("bs", ctypes.c_void_p),
        ("as_", ctypes.c_void_p),
        ("bt", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("ldx", ctypes.c_int64),
        ("K", ctypes.c_int),
        *[(name, ctypes.c_void_p) for name in ("sa", "xa", "dyb", "partials", "dbt", "db", "da")],
    ]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class _Prepared:
    """A group's kernel arguments and the buffers behind them (kept alive for the call)."""

    group: _Group
    keep: list[Any]
    m: int
    r: int
    widths: list[int]
    dyb: Tensor
    db_all: Tensor
    da: Tensor | None

    def grads(self) -> LoraGrads:
        r, r8, g = self.r, self.dyb.shape[-1], len(self.widths)
        db = list(self.db_all.split(self.widths))  # each contiguous: no layout copy in autograd
        if r8 == r:
            dy_b = self.dyb.view(self.m, g * r)
        else:
            dy_b = self.dyb[:, :, :r].reshape(self.m, g * r).contiguous()
        da = None if self.da is None else list(self.da[:, :r].unbind(0))
        return LoraGrads(dy_b, db, da)


def _prepare(
    dy: Tensor,
    b: Sequence[Tensor],
    s: float,
    xa: Tensor | None,
    x: Tensor | None,
    a: Sequence[Tensor] | None,
) -> _Prepared | None:
    """The kernel's group for output gradient ``dy`` [M, N] (unit stride in a row), or None
    where the layouts do not suit it or the C kernels do not apply."""
    r, widths = b[0].shape[1], [b_i.shape[0] for b_i in b]
    m, n, k = dy.shape[0], sum(widths), (0 if x is None else x.shape[-1])
    if dy.dim() != 2 or dy.shape[1] != n or dy.stride(-1) != 1:
        return None
    if any(w % 16 or b_i.shape[1] != r for w, b_i in zip(widths, b, strict=True)):
        return None
    x_rows = None if x is None else compiled._as_rows(x)
    if x is None:
        if xa is None or xa.shape != (m, len(b) * r) or not xa.is_contiguous():
            return None
        operands = [xa]
    else:
        if a is None or x_rows is None or x.shape[0] != m or k % 16:
            return None
        operands = [x, *a]
    if not compiled.native_ready(dy, *b, *operands):
        return None
    r8 = -(-r // 8) * 8  # ranks padded to the kernel's 8-rank steps (zero ranks, dropped)
    gr = len(b) * r8
    # The kernel packs s B^T and s A into its padded layouts itself (`lora_pack`) from these
    # pointers: no torch ops on the adapters here.
    b = [b_i.contiguous() for b_i in b]
    members = ctypes.c_void_p * len(b)
    bs, as_ = members(*[b_i.data_ptr() for b_i in b]), None
    off = (ctypes.c_int64 * (len(b) + 1))(0, *itertools.accumulate(widths))
    keep: list[Any] = [b, bs, off]
    sa = da = xa_arg = None
    if x is not None:
        a = [a_i.contiguous() for a_i in operands[1:]]
        as_ = members(*[a_i.data_ptr() for a_i in a])
        sa = dy.new_empty(len(b), r8, k + 16)
        xa_arg, da = dy.new_empty(m, gr), dy.new_empty(len(b), r8, k)
        keep += [a, as_]
    elif r8 == r:
        xa_arg = operands[0]
    else:
        xa_arg = F.pad(operands[0].view(m, len(b), r), (0, r8 - r)).view(m, gr)
    bt, dbt = dy.new_empty(r8, n + 16), dy.new_empty(r8, n)
    dyb, db_all = dy.new_empty(m, len(b), r8), dy.new_empty(n, r)
    slot = r8 * (n + 16) + (0 if x is None else gr * (k + 16))
    partials = dy.new_empty(-(-m // LORA_BLOCK), slot)
    keep += [x, sa, xa_arg, bt, dbt, partials]
    group = _Group(
        ctypes.addressof(off), len(b), r8, r, s, ctypes.addressof(bs),
        None if as_ is None else ctypes.addressof(as_), bt.data_ptr(), _ptr(x),
        0 if x_rows is None else x_rows[1], k, _ptr(sa), _ptr(xa_arg), dyb.data_ptr(),
        partials.data_ptr(), dbt.data_ptr(), db_all.data_ptr(), _ptr(da),
    )  # fmt: skip
    return _Prepared(group, keep, m, r, widths, dyb, db_all, da)


def lora_grads(
    dy: Tensor,
    b: Sequence[Tensor],
    s: float,
    xa: Tensor | None = None,
    x: Tensor | None = None,
    a: Sequence[Tensor] | None = None,
) -> LoraGrads | None:
    """The adapter gradients of a LoRA group y = x cat_i(W_i + s B_i A_i)^T in one C pass over
    its output gradient ``dy`` [M, N] and input ``x`` [M, K] (`tsr_lora_grads`). Given ``x``
    and ``a`` (A_i [r, K]) it forms xa = s x A^T itself; else ``xa`` [M, g r] is given and dA
    is left to the caller (`_SwiGLUDown`'s comes from its SwiGLU pass). Block-diagonal GEMMs
    would multiply by g - 1 zero blocks too, and read dy and x twice each. None where the C
    kernels are off or unavailable, a width is not a multiple of 16, or the layouts do not
    suit (the caller runs the GEMMs)."""
    rows = compiled._as_rows(dy)
    got = None if rows is None else _prepare(dy, b, s, xa, x, a)
    lib = None if got is None else compiled.rows_or_note()
    if got is None or lib is None or rows is None:
        return None
    lib.tsr_lora_grads(
        dy.data_ptr(), rows[1], got.m, ctypes.byref(got.group), torch.get_num_threads()
    )
    return got.grads()


def swiglu_backward_lora(
    gate_up: Tensor,
    dh: Tensor,
    yb: Tensor,
    b: Sequence[Tensor],
    s: float,
    x: Tensor,
    a: Sequence[Tensor],
) -> tuple[Tensor, Tensor, LoraGrads] | None:
    """`compiled.swiglu_backward_da` (the SwiGLU gradient over ``gate_up`` and the down
    projection's dA) with, in the same C pass, `lora_grads` for the gate/up group that produced
    ``gate_up`` (adapters ``a``, ``b`` = [gate's, up's], scaling ``s``, input ``x``): its
    gradient rows go through the group's products while in cache instead of being read back
    from memory (the same bits as the two passes apart). Returns (d_gate_up, the down
    projection's dA, the gate/up group's gradients); None where either would not apply."""
    rows, f = dh.numel() // dh.shape[-1], dh.shape[-1]
    if len(b) != 2 or not gate_up.is_contiguous() or gate_up.numel() != rows * 2 * f:
        return None
    got = _prepare(gate_up.view(rows, 2 * f), b, s, None, x.reshape(-1, x.shape[-1]), a)
    if got is None or got.widths != [f, f]:
        return None
    done = compiled.swiglu_backward_da(gate_up, dh, yb, ctypes.byref(got.group))
    return None if done is None else (*done, got.grads())
