"""A LoRA adapter on the unembedding (the SDK's default ``train_unembed=True``), run by hand
for `loss_logprobs.head_logprobs`: z = h W^T + scaling (h A^T) B^T per chunk of rows, its
backward recomputed (`_lora_backward`) or formed in forward while each chunk's logits are at
hand (`_KnownGrads`), never a [rows, V] temporary beyond the chunk's logits. Which heads take
this path is `loss_logprobs._lora_parts`'s choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tinker_sr.engine import compiled, gemm


@dataclass(frozen=True)
class _Lora:
    """A LoRA head's frozen weight, adapter and scaling: z = h W^T + scaling (h A^T) B^T.
    ``low``: W in a lower precision than the adapter's float32: under autocast, W cast to the
    autocast dtype (`fused.frozen_cast`, kept); for a bf16/fp16 checkpoint, W itself (its
    hidden states in that dtype too). The two unembedding products (logits and dz W) then run
    in it, as a frozen head's do under autocast, rounded to that precision and widened;
    everything else (the adapter's products, the logits and their gradient) stays float32."""

    w: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    low: torch.Tensor | None = None
    packed: bool = False  # W multiplied through its oneDNN-packed copies (`gemm.packed_weight`)

    def base_logits(self, hc: torch.Tensor, rows: int) -> torch.Tensor:
        """hc W^T in the adapter's dtype (on the packed weight, or in ``low``'s dtype and
        widened)."""
        if self.low is not None:
            return torch.mm(hc.to(self.low.dtype), self.low.t()).to(self.a.dtype)
        w = self.w
        return gemm.packed_linear(hc, w, rows=rows) if self.packed else gemm.linear(hc, w)

    def base_grad(self, dz: torch.Tensor, rows: int) -> torch.Tensor:
        """dz W, as `base_logits` runs its product."""
        if self.low is not None:
            return torch.mm(dz.to(self.low.dtype), self.low).to(dz.dtype)
        w = self.w
        return gemm.packed_mm(dz, w, rows) if self.packed else gemm.mm(dz, w)

    def input_grad(self, dz: torch.Tensor, dzb: torch.Tensor, rows: int) -> torch.Tensor:
        """dh = dz W + scaling (dz B) A in the adapter's dtype, for ``dzb`` = dz B."""
        return self.base_grad(dz, rows).to(self.a.dtype).addmm_(dzb, self.a, alpha=self.scaling)


def _lora_logits(lora: _Lora, hc: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``z = hc W^T + u B^T``, ``u = scaling * hc A^T``): the base product on the packed
    weight (as a frozen head's) and the rank-r update added in place, so no [rows, V]
    temporary is scaled or added (the head's own forward made three of them per chunk)."""
    with torch.autocast(hc.device.type, enabled=False):
        u = gemm.linear(hc.to(lora.a.dtype), lora.a).mul_(lora.scaling)
        return lora.base_logits(hc, rows).addmm_(u, lora.b.t()), u


def _lora_backward(
    lora: _Lora,
    params: tuple[torch.Tensor, ...],
    grad: torch.Tensor,
    live: torch.Tensor,
    h: torch.Tensor,
    cols: torch.Tensor,
    lse: torch.Tensor,
    dh: torch.Tensor | None,
    chunk: int,
) -> list[torch.Tensor]:
    """`_recompute_rows` for a LoRA head, by hand: per chunk of live rows, recompute the logits,
    turn them in place into dL/dz = onehot-scatter(g) - softmax(z) * sum_j g, then
    dh = dz W + scaling (dz B) A, dA = scaling (dz B)^T h, dB = dz^T u (u = scaling h A^T).
    Returns (dA, dB) in the order of ``params``."""
    da, db_t = torch.zeros_like(lora.a), torch.zeros_like(lora.b.t())
    for start in range(0, live.numel(), chunk):
        rows = live[start : start + chunk]
        g, hc = grad[rows], h[rows].detach()
        z, u = _lora_logits(lora, hc, chunk)
        dz = _softmax_times(z, lse[rows], -g.sum(dim=1))
        dz.scatter_add_(1, cols[rows], g)
        got = _lora_dz_grads(lora, dz, hc, u, da, db_t, chunk, dh is not None)
        if dh is not None and got is not None:
            dh.index_copy_(0, rows, got.to(dh.dtype))
    return _in_order(lora, params, da, db_t)


def _in_order(
    lora: _Lora, params: Sequence[torch.Tensor], da: torch.Tensor, db_t: torch.Tensor
) -> list[torch.Tensor]:
    """The head's adapter gradients (dA, and dB from its transpose) in the order of ``params``."""
    return [da if p is lora.a else db_t.t().contiguous() for p in params]


def _lora_dz_grads(
    lora: _Lora,
    dz: torch.Tensor,
    hc: torch.Tensor,
    u: torch.Tensor,
    da: torch.Tensor,
    db_t: torch.Tensor,
    chunk: int,
    need_dh: bool,
    deferred: _DeferredDh | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """From a chunk's logit gradient ``dz``: dA += scaling (dz B)^T h and dB^T += u^T dz in
    place; returns the chunk's dh = dz W + scaling (dz B) A (None unless ``need_dh``). With
    ``deferred``, dh is left there for rows ``rows`` instead (None returned)."""
    a, b, scaling = lora.a, lora.b, lora.scaling
    with torch.autocast(dz.device.type, enabled=False):
        dzb = gemm.mm(dz, b)  # [n, r]
        got = None
        if need_dh and deferred is not None:
            deferred.add(rows, dz, dzb)
        elif need_dh:
            got = lora.input_grad(dz, dzb, chunk)
        da.addmm_(dzb.t(), hc.to(a.dtype), alpha=scaling)
        db_t += gemm.mm_over_rows(u, dz)  # [r, V]: ~5x faster than dz^T u into [V, r]
    return got


# Bytes of logit gradients (in the base's low precision) `_DeferredDh` gathers before it
# multiplies them by W: 64 MiB is 220 rows at Qwen3's vocabulary of 151,936 in bf16.
DEFER_BYTES = 64 << 20


class _DeferredDh:
    """dh = dz W + scaling (dz B) A for the rows that carry a loss, one product for many chunks.

    A low-precision head (a bf16 checkpoint's, or autocast's) is large and its chunks short
    (48 rows at V = 151,936), so each chunk's dz W re-read the whole weight (311 MB in bf16)
    for a few rows: 0.48 ms a row at 48 rows against 0.15 at 400 (`torch.mm`, host C). The
    product rounds dz to W's dtype anyway, so the rows' dz are gathered in that dtype (the same
    values the per-chunk product read) into one buffer of up to `DEFER_BYTES` and multiplied
    when it is full and after the last chunk."""

    def __init__(self, lora: _Lora, dh: torch.Tensor):
        assert lora.low is not None
        self.lora, self.dh = lora, dh
        self.buf: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self.dzb: list[torch.Tensor] = []
        self.used = 0

    def add(self, rows: torch.Tensor | None, dz: torch.Tensor, dzb: torch.Tensor) -> None:
        assert rows is not None and self.lora.low is not None
        n, v = dz.shape
        if self.buf is None:
            cap = max(n, DEFER_BYTES // max(1, v * self.lora.low.element_size()))
            self.buf = dz.new_empty((min(cap, self.dh.shape[0]), v), dtype=self.lora.low.dtype)
        if self.used + n > self.buf.shape[0]:
            self.flush()
        if n > self.buf.shape[0]:  # a chunk larger than the buffer: at once
            self.rows, self.dzb = [rows], [dzb]
            self._multiply(dz.to(self.buf.dtype))
            return
        self.buf[self.used : self.used + n].copy_(dz)
        self.rows.append(rows)
        self.dzb.append(dzb)
        self.used += n

    def flush(self) -> None:
        if self.used and self.buf is not None:
            self._multiply(self.buf[: self.used])
        self.used = 0

    def _multiply(self, dz_low: torch.Tensor) -> None:
        got = self.lora.input_grad(dz_low, torch.cat(self.dzb), dz_low.shape[0])
        self.dh.index_copy_(0, torch.cat(self.rows), got.to(self.dh.dtype))
        self.rows, self.dzb = [], []


class _KnownGrads:
    """A LoRA head's backward formed in its forward, chunk by chunk while each chunk's logits
    are at hand, for a loss that says in advance what gradient it will deliver (``grad_of``):
    the logits are not recomputed in backward (one unembedding product less per chunk). Used
    only if the delivered gradient equals ``g`` bit for bit; otherwise backward recomputes
    as it would have without this."""

    def __init__(
        self,
        lora: _Lora,
        h: torch.Tensor,
        width: int,
        need_dh: bool,
        chunk: int,
        compute_dtype: torch.dtype,
    ):
        self.lora, self.chunk_rows = lora, chunk
        # The promise, in the dtype backward compares the delivered gradient in.
        self.g = torch.zeros((h.shape[0], width), dtype=compute_dtype, device=h.device)
        self.dh = torch.zeros_like(h) if need_dh else None
        self.da, self.db_t = torch.zeros_like(lora.a), torch.zeros_like(lora.b.t())
        self.deferred = None
        if self.dh is not None and lora.low is not None:
            self.deferred = _DeferredDh(lora, self.dh)

    def add_chunk(
        self,
        start: int,
        hc: torch.Tensor,
        u: torch.Tensor,
        e: torch.Tensor,
        total: torch.Tensor,
        g: torch.Tensor,
        cols: torch.Tensor,
    ) -> None:
        """Rows ``start:start + n``: ``e = exp(z - max)`` over the chunk's logits (overwritten
        with dL/dz), ``total`` its row sums, ``g`` the loss's gradient for the rows' log-probs,
        ``u = scaling hc A^T``."""
        n = hc.shape[0]
        self.g[start : start + n] = g
        live = g.ne(0).any(dim=1)
        if not bool(live.any()):
            return  # no loss on these rows: dz = 0
        dz = e.mul_((-g.sum(dim=1) / total)[:, None]).scatter_add_(1, cols, g)
        # Multiply only the rows that carry a loss: a slice of them where they are consecutive
        # (a prompt's rows before a completion's), else gathered.
        rows = live_rows(live)
        if not (isinstance(rows, slice) and rows.stop - rows.start == n):
            dz, hc, u = dz[rows], hc[rows], u[rows]
        at = None  # the rows' places in h, for the deferred product
        if self.deferred is not None:
            at = torch.arange(n, device=hc.device)[rows] + start
        got = _lora_dz_grads(
            self.lora, dz, hc, u, self.da, self.db_t, self.chunk_rows, self.dh is not None,
            self.deferred, at,
        )  # fmt: skip
        if self.dh is not None and got is not None:
            if isinstance(rows, slice):
                self.dh[start + rows.start : start + rows.stop] = got
            else:
                self.dh.index_copy_(0, rows + start, got.to(self.dh.dtype))

    def finish(self) -> None:
        """After the last chunk: the deferred rows' dh."""
        if self.deferred is not None:
            self.deferred.flush()

    def param_grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return _in_order(self.lora, params, self.da, self.db_t)


def live_rows(live: torch.Tensor) -> slice | torch.Tensor:
    """The rows marked in the boolean ``live`` (a chunk's rows that carry a loss): a slice
    where they are consecutive, so that a [rows, V] chunk's live rows are a view of it rather
    than a gathered copy (for 192 of 256 rows at V = 32,000 a 24 MiB copy, ~5 ms), else their
    indices. Every row, or none: a slice too."""
    idx = torch.nonzero(live).squeeze(1)
    if idx.numel() == 0:
        return slice(0, 0)
    first, last = int(idx[0]), int(idx[-1])
    return slice(first, last + 1) if last - first + 1 == idx.numel() else idx


def _softmax_times(z: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``softmax(z) * scale[:, None]`` in place of the logits ``z`` (rows' logsumexp ``lse``):
    one C pass where it applies (`compiled.softmax_scale_rows`), else as one exp,
    exp(z - lse + log|scale|), then the rows whose scale is negative negated (rows with scale 0
    come out exactly 0 either way)."""
    if compiled.softmax_scale_rows(z, lse.contiguous(), scale.contiguous()):
        return z
    z.sub_((lse - scale.abs().log())[:, None]).exp_()
    flip = torch.nonzero(scale < 0).squeeze(1)
    if flip.numel():
        z[flip] = z[flip].neg_()
    return z
