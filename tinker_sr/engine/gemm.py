"""The engine's float32 GEMMs on a CPU, through oneDNN where this torch build has it.

``torch.mm``/``F.linear`` run float32 on a CPU through torch's BLAS: MKL on x86 builds, whose
code paths are known to depend on the CPU vendor as well as the ISA. On the AMD EPYC (Zen 5,
full-width AVX-512) our figures come from, MKL ran at 205-215 GFLOP/s on 2 threads, while
oneDNN, which ships inside every x86 torch build (torch already uses it for bf16 matmuls) and
dispatches on the ISA, ran the same products at 420-490 GFLOP/s in IEEE float32 (no
reduced-precision math mode; results differ from MKL's by summation order only), in every
shape of a training step, and 2-5x
faster for the 8-row products of decode. On an Intel Xeon with AMX (session 24) the two are
level: MKL 344-357 and oneDNN 321-337 GFLOP/s at 1024 x 1024, and a 16 x 256 LoRA step took
2.61-2.72 s through oneDNN and 2.71-2.72 s with ``$TINKER_SR_GEMM=blas``. oneDNN is chosen by
availability, not by a timing, either way.

So the engine's hot products (the projections of every layer, forward and backward, the
unembedding and its backward, the LoRA gradients) call `linear`/`mm` here, which use oneDNN
for float32 CPU tensors when it is available and passes a numerical check at first use, and
torch's own op otherwise (other dtypes, autocast, CUDA, tiny products where a oneDNN call's
fixed cost exceeds the work). The choice depends only on the build, the dtype and the shape,
never on a timing: runs stay bit-identical. ``$TINKER_SR_GEMM=blas`` keeps torch's BLAS
everywhere (for A/B benchmarks and to compare against another machine's results).

Every oneDNN product runs at a bucketed row count (`bucket_rows`: a multiple of 8 below 256
rows, then 16 steps per octave; the rows past the product's are zeros and their results are
dropped), and products that sum over a varying number of rows (the tokens: LoRA weight
gradients) through `mm_over_rows`. oneDNN compiles and caches a kernel per shape (about 1-3
MiB each, by shape, in two caches of 1,024 entries each by default; `cpu.bound_kernel_caches`
lowers that to 128): a long run whose sequence lengths, prompt lengths or per-expert row
counts vary met a new shape at almost every step, and its memory grew by hundreds of MiB over
a few hundred steps (``benchmarks/user_trial.py --max-tokens 96``,
``--family qwen3_moe``). With buckets the shapes of a run are few, so the caches stop growing
once they have seen them; the padding costs at most 1/16 more rows.

`packed_linear`/`packed_mm` multiply by a weight reordered once into oneDNN's blocked layout
(`packed_weight`, cached on the weight like `fused.frozen_cast`): decode's products of a few
rows, where reading the weight is the whole cost, and the unembedding's chunks, where a plain
weight would be reordered inside every call.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "BACKEND_ENV",
    "bucket_rows",
    "linear",
    "mm",
    "mm_over_rows",
    "onednn_fp32",
    "packed_linear",
    "packed_mm",
    "packed_weight",
    "stacked_linear",
    "uses_onednn",
]

BACKEND_ENV = "TINKER_SR_GEMM"
# Below this many multiply-adds a oneDNN call's fixed cost (~7 us) outweighs its speed.
MIN_MACS = 1 << 20


@functools.cache
def _op() -> Any | None:
    """torch's oneDNN linear op, looked up once (it is called for every product)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return None if ops is None else ops._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def onednn_fp32() -> bool:
    """oneDNN float32 GEMMs are available in this torch build, not switched off by
    ``$TINKER_SR_GEMM=blas``, and agree with torch's own on a check product."""
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if choice not in ("", "onednn", "blas"):
        raise ValueError(f"${BACKEND_ENV}={choice!r}: use 'onednn' (the default) or 'blas'")
    if choice == "blas" or not torch.backends.mkldnn.is_available():
        return False
    op = _op()
    if op is None:
        return False
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=gen), torch.randn(80, 96, generator=gen)
    try:
        got = op(x, w, None, "none", [], "")
        packed = op(x, _reorder(w, 8), None, "none", [], "")
    except RuntimeError:
        return False
    want = F.linear(x.double(), w.double()).float()
    return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-4)) and torch.equal(got, packed)


def _bucket_step(m: int) -> int:
    """The spacing of the row buckets around ``m``: 8 below 256 rows, then 16 per octave."""
    return max(8, 1 << max(m.bit_length() - 5, 0))


def bucket_rows(m: int) -> int:
    """The row count a oneDNN product of ``m`` rows runs at: ``m`` rounded up to a multiple of
    8 below 256 (decode's padded batches stay as they are), then to 16 steps per octave (at
    most 1/16 more rows), so a run meets few distinct shapes."""
    step = _bucket_step(m)
    return -(-m // step) * step


def _run(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's ``F.linear(x, w, bias)`` with x's rows padded with zeros to `bucket_rows` (the
    padded rows' results are dropped: a view of the first rows)."""
    k = x.shape[-1]
    m = x.numel() // max(k, 1)
    rows = bucket_rows(m)
    if rows == m:
        return _op()(x, w, bias, "none", [], "")  # type: ignore[misc,no-any-return]
    padded = x.new_empty(rows, k)
    padded[:m] = x.reshape(m, k)
    padded[m:] = 0
    y = _op()(padded, w, bias, "none", [], "")[:m]  # type: ignore[misc]
    return y.view(*x.shape[:-1], y.shape[-1])  # type: ignore[no-any-return]


def uses_onednn(x: Tensor, w: Tensor, rows: int | None = None) -> bool:
    """Would ``linear(x, w)`` run on oneDNN? ``rows``: judge the size at this many rows
    instead of x's (decode: the same choice whatever the batch)."""
    m = x.numel() // max(x.shape[-1], 1) if rows is None else rows
    return (
        x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and m * w.numel() >= MIN_MACS
        and not torch.is_autocast_enabled("cpu")
        and onednn_fp32()
    )


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)`` (x [..., K], w [N, K]). The oneDNN op has no autograd
    formula, so it runs only where no graph is being recorded through it: inside custom
    autograd nodes (their forward and backward) or under no_grad; anywhere else (an operand
    that needs a gradient, with grad mode on) torch's op."""
    tracked = torch.is_grad_enabled() and (
        x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not tracked and uses_onednn(x, w) and (bias is None or bias.dtype == torch.float32):
        return _run(x, w, bias)
    if x.dim() > 2:
        # As a 2-D product: torch's CPU linear of a [1, 1, K] bfloat16 input by a large weight
        # (a prefill's last position by a 151,936-row unembedding) took 1.1 s, 45x the time
        # of the same product from [1, K]. Same values (the same GEMM, rows folded).
        y = F.linear(x.reshape(-1, x.shape[-1]), w, bias)
        return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, bias)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for 2-D a [M, K], b [K, N] (strided views welcome), as `linear`."""
    return linear(a, b.t())


def mm_over_rows(a: Tensor, b: Tensor) -> Tensor:
    """``a.t() @ b`` for a [M, P], b [M, N]: a sum over M rows (the tokens: a weight gradient),
    as `mm`, with ``a.t()`` laid out contiguous (rank-major: MKL runs rank-8 products 2-5x
    faster that way round). Where oneDNN runs it, the sum is split at the largest
    `bucket_rows` count in M and the rest (under 1/16 of the rows) padded with zero rows to
    its own bucket, so the summed dimension takes few distinct sizes as well (`bucket_rows`)."""
    m = a.shape[0]
    if not uses_onednn(a.t(), b.t()) or bucket_rows(m) == m:
        return mm(a.t().contiguous(), b)
    step = _bucket_step(m)
    head = m // step * step  # a bucket itself: same bit length, so the same step
    rest = bucket_rows(m - head)
    pa, pb = a.new_zeros(rest, a.shape[1]), b.new_zeros(rest, b.shape[1])
    pa[: m - head], pb[: m - head] = a[head:], b[head:]
    out = mm(pa.t().contiguous(), pb)
    return out if head == 0 else out.add_(mm(a[:head].t().contiguous(), b[:head]))


def _reorder(w: Tensor, rows: int) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)  # type: ignore[no-any-return]


def _kept_on(w: Tensor, name: str) -> dict[Any, Any]:
    """The dict of reordered copies kept on ``w`` as attribute ``name`` (made at first use):
    they live and die with the weight."""
    cache: dict[Any, Any] | None = getattr(w, name, None)
    if cache is None:
        cache = {}
        setattr(w, name, cache)
    return cache


def packed_weight(w: Tensor, rows: int, transpose: bool = False) -> Tensor:
    """``w`` (``w.t()`` with ``transpose``) reordered once into oneDNN's blocked layout for
    products of about ``rows`` rows, kept on ``w`` per (rows, transpose) and reordered again
    if ``w`` was modified in place since. A plain weight is reordered inside every oneDNN call
    (for a 64 MiB unembedding, ~2.5 ms of each ~20 ms chunk); a transposed view also pays for
    its strides."""
    cache = _kept_on(w, "_tinker_sr_packed")
    hit = cache.get((rows, transpose))
    if hit is None or hit[0] != w._version:
        with torch.no_grad():
            src = w.detach().t().contiguous() if transpose else w.detach()
            hit = (w._version, _reorder(src, rows))
        cache[(rows, transpose)] = hit
    return hit[1]


def _packs(x: Tensor, w: Tensor, rows: int) -> bool:
    tracked = torch.is_grad_enabled() and x.requires_grad  # decode runs in inference mode
    return not tracked and uses_onednn(x, w, rows)


def packed_linear(x: Tensor, w: Tensor, bias: Tensor | None = None, rows: int = 8) -> Tensor:
    """``F.linear(x, w, bias)`` with ``w`` packed for ``rows`` rows (`packed_weight`): decode's
    products of a few rows, where reading the weight is the whole cost, and the unembedding's
    chunks. Whether oneDNN applies is judged at ``rows`` rows, whatever x's row count (decode:
    the same path at every batch size); where it does not, torch's own op."""
    if not _packs(x, w, rows) or (bias is not None and bias.dtype != torch.float32):
        return F.linear(x, w, bias)
    return _run(x, packed_weight(w, rows), bias)


def packed_mm(a: Tensor, w: Tensor, rows: int) -> Tensor:
    """``a @ w`` (a [M, K], w [K, N]) with ``w.t()`` packed for ``rows`` rows and kept on
    ``w``: the unembedding's ``softmax @ W``. Where oneDNN does not apply, `mm`."""
    if not _packs(a, w.t(), rows):
        return mm(a, w)
    return _run(a, packed_weight(w, rows, transpose=True), None)


def stacked_linear(x: Tensor, weights: list[Tensor], rows: int = 8) -> Tensor | None:
    """``torch.cat([F.linear(x, w) for w in weights], -1)`` as one oneDNN product by the weights
    stacked and reordered once for ``rows`` rows (kept on ``weights[0]`` while none of them
    changes; no plain stacked copy is kept): decode's q/k/v and gate/up, one parallel region
    instead of several (each wakes the cores: ~90 us on some VMs). None where oneDNN does not
    apply (judged at ``rows`` rows, as `packed_linear`); the caller then multiplies them
    one by one. Whether the values equal the separate products is the caller's to check."""
    first = weights[0]
    if not _packs(x, first, rows) or any(
        w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1]
        for w in weights
    ):
        return None
    key = tuple((id(w), 0 if w.is_inference() else w._version) for w in weights)
    cache = _kept_on(first, "_tinker_sr_stacked")
    hit = cache.get(rows)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            stacked = torch.cat([w.detach() for w in weights])
            hit = cache[rows] = (key, _reorder(stacked, rows))
            del stacked
    return _run(x, hit[1], None)
