"""Learner log-probs of chosen token columns, without materialising tokens x vocab.

Log-probs are computed by gathering the needed logits and subtracting a row-chunked
logsumexp; the backward pass writes the logit gradient straight into one buffer. Beyond that
gradient, nothing of size tokens x vocab is allocated (transients are bounded by
``_CHUNK_ELEMENTS``). When every datum's logits are row views of one contiguous padded batch,
the gradient is produced for the batch at once instead of one padded copy per datum.
`head_logprobs` does the same from final hidden states, running the unembedding chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tinker_sr.engine import bf16_rows, compiled, gemm, lora_head
from tinker_sr.engine.fused import frozen_cast
from tinker_sr.engine.lora import LoraLinear
from tinker_sr.engine.lora_head import _KnownGrads, _Lora

# (first row, stop row, the rows' log-probs [n, J]) -> the gradient of the loss with respect
# to those log-probs, as autograd will deliver it to the head (see `head_logprobs`).
GradOf = Callable[[int, int, torch.Tensor], torch.Tensor]


# Upper bound on the elements of any transient rows x vocab tensor: just under 32 MiB in
# float32, so that a fresh chunk of logits (the oneDNN GEMM has no ``out=``) comes from the
# heap that `cpu.tune_allocator` keeps (glibc serves 32 MiB and more by a fresh mmap, whose
# pages fault in and are zeroed on every chunk).
_CHUNK_ELEMENTS = (1 << 23) - (1 << 12)
# False: a frozen head recomputes its live rows in backward too (for A/B benchmarks).
PRECOMPUTE_HEAD_GRAD = True
# A frozen float32 head up to this size is multiplied through oneDNN-packed copies of its
# weight and its transpose (`gemm.packed_weight`, made at the first step and kept: two more
# copies of the weight, 2 x 62.5 MiB at 32,000 x 512), which saved ~3 % of a 16 x 256 LoRA
# step there; a larger one (152k x 1024: 2 x 594 MiB) is multiplied as it is.
PACK_HEAD_MAX_BYTES = 256 << 20


def chunk_rows(vocab: int) -> int:
    """Rows per chunk of logits: at most `_CHUNK_ELEMENTS` elements, rounded down to a multiple
    of 64 rows where there are that many (16 below): oneDNN runs the unembedding's products
    ~5-8 % faster on 256 rows than on the 262 that fit at V = 32,000 (a ragged row block)."""
    rows = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for unit in (64, 16):
        if rows >= unit:
            return rows // unit * unit
    return rows


class _GatherLogprobs(torch.autograd.Function):
    """log_softmax(z)[row, col] for the rows in ``ranges`` and the columns ``cols[m, :]``.

    ``z`` is [R, V]; ``ranges`` lists (start, stop) row ranges whose concatenation gives the
    M output rows; ``cols`` is [M, J]. Forward keeps only a per-row logsumexp; backward builds
    dL/dz = onehot-scatter(g) - softmax(z) * sum_j g[:, j] directly in the gradient buffer.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        z: torch.Tensor,
        ranges: list[tuple[int, int]],
        cols: torch.Tensor,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        chunk = chunk_rows(z.shape[1])
        lse = torch.empty(cols.shape[0], dtype=compute_dtype, device=z.device)
        picked = torch.empty(cols.shape, dtype=compute_dtype, device=z.device)
        for sl, a, b in _chunks(ranges, chunk):
            lse[sl] = torch.logsumexp(z[a:b].to(compute_dtype), dim=-1)
            picked[sl] = z[a:b].gather(1, cols[sl])
        ctx.save_for_backward(z, cols, lse)
        ctx.ranges = ranges
        return picked.sub_(lse[:, None])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        z, cols, lse = ctx.saved_tensors
        ranges: list[tuple[int, int]] = ctx.ranges
        chunk = chunk_rows(z.shape[1])
        grad = grad.to(lse.dtype)
        gsum = grad.sum(dim=1)

        ordered = sorted(ranges)
        disjoint = all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:], strict=False))
        covered = sum(stop - start for start, stop in ranges)
        # Write each row straight into the gradient when every row is written exactly once.
        gz = torch.empty_like(z) if disjoint and covered == z.shape[0] else torch.zeros_like(z)
        if disjoint and z.dtype == lse.dtype and z.is_contiguous():
            # -softmax(z) * gsum as one exp: exp(z - lse + log|gsum|), then flip the rows whose
            # gsum is positive. Rows with gsum == 0 come out exactly 0 (exp(-inf)).
            shift = lse - torch.log(gsum.abs())
            flip = gsum > 0
            for sl, a, b in _chunks(ranges, chunk):
                out = gz[a:b]
                torch.sub(z[a:b], shift[sl, None], out=out).exp_()
                rows = torch.nonzero(flip[sl]).squeeze(1)
                if rows.numel():
                    out[rows] = out[rows].neg_()
                out.scatter_add_(1, cols[sl], grad[sl])
        else:
            for sl, a, b in _chunks(ranges, chunk):
                g = torch.exp(z[a:b].to(lse.dtype) - lse[sl, None]).mul_(-gsum[sl, None])
                g.scatter_add_(1, cols[sl], grad[sl])
                gz[a:b] += g.to(z.dtype)
        return gz, None, None, None


def _chunks(ranges: list[tuple[int, int]], chunk: int) -> Iterator[tuple[slice, int, int]]:
    """(output slice, first row, stop row) per chunk of at most ``chunk`` rows of ``ranges``."""
    m = 0
    for start, stop in ranges:
        for a in range(start, stop, chunk):
            b = min(a + chunk, stop)
            yield slice(m + a - start, m + b - start), a, b
        m += stop - start


def _row_source(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """If ``t`` is a row-aligned view of a contiguous [..., V] base, return (base, first row)."""
    base = t._base
    if base is None or t.dim() != 2 or base.dtype != t.dtype or base.dim() < 2:
        return None
    v = t.shape[1]
    if base.shape[-1] != v or not base.is_contiguous() or t.stride() != (v, 1):
        return None
    if t.requires_grad != base.requires_grad or (t.requires_grad and t.grad_fn is None):
        return None  # detached alias: the gradient must not reach the base
    offset = t.storage_offset() - base.storage_offset()
    if offset < 0 or offset % v:
        return None
    row = offset // v
    if row + t.shape[0] > base.numel() // v:
        return None
    return base, row


def compute_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probs and their gradients are computed in for inputs of ``dtype``:
    float64 stays float64, everything else (float32, bf16 autocast) float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_logprobs(
    logits: Sequence[torch.Tensor], cols: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.dtype]:
    """Return per datum log_softmax(logits[i])[:, cols[i]] ([N_i, J_i], compute dtype)."""
    compute_dtype = compute_dtype_of(logits[0].dtype)
    # Group datums by the tensor whose rows they read, so a padded batch is handled in one call.
    groups: dict[int, tuple[torch.Tensor, list[tuple[int, int, int]]]] = {}
    for i, t in enumerate(logits):
        src = _row_source(t)
        if src is None:
            base2d, row = t, 0
            key = id(t)
        else:
            base, row = src
            key = id(base)
            if key in groups:
                base2d = groups[key][0]
            else:
                base2d = base.view(-1, t.shape[1])
        groups.setdefault(key, (base2d, []))[1].append((i, row, row + t.shape[0]))

    out: list[torch.Tensor | None] = [None] * len(logits)
    for z, members in groups.values():
        j_max = max(cols[i].shape[1] for i, _, _ in members)
        ranges = [(a, b) for _, a, b in members]
        padded = torch.cat(
            [torch.nn.functional.pad(cols[i], (0, j_max - cols[i].shape[1])) for i, _, _ in members]
        ).to(z.device)
        logp = _GatherLogprobs.apply(z, ranges, padded, compute_dtype)
        m = 0
        for i, a, b in members:
            out[i] = logp[m : m + b - a, : cols[i].shape[1]]
            m += b - a
    return [o for o in out if o is not None], compute_dtype


class _HeadLogprobs(torch.autograd.Function):
    """log_softmax(head(h))[m, cols[m, :]] without ever holding more than a chunk of logits.

    ``h`` is [M, D] (hidden states of the rows that have targets), ``cols`` [M, J];
    ``params`` are the head's trainable parameters (a LoRA adapter on the unembedding), passed
    so that autograd routes their gradients here. Forward unembeds ``chunk`` rows at a time and
    keeps a per-row logsumexp. With dL/dz = onehot-scatter(g) - softmax(z) * sum_j g, the input
    gradient is dL/dh = sum_j g_j W[col_j] - (sum_j g_j) * softmax(z) @ W. When the head is a
    plain frozen Linear, forward also computes ``softmax(z) @ W`` for the rows in ``hint`` (rows
    that may carry a loss) while their logits are at hand, so backward needs no logits at all.
    Other live rows (an adapter on the head, or rows outside ``hint``) are recomputed in
    backward, chunk by chunk; rows whose incoming gradient is zero (positions that carry no
    loss, e.g. prompts under zero weights or advantages) cost no backward unembedding.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")  # backward recomputes under the same autocast
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        cols: torch.Tensor,
        hint: torch.Tensor | None,
        head: torch.nn.Module,
        compute_dtype: torch.dtype,
        vocab: int,
        grad_of: GradOf | None,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        chunk = chunk_rows(vocab)
        weight = None
        if PRECOMPUTE_HEAD_GRAD and ctx.needs_input_grad[0] and not params:
            weight = _plain_weight(head)
        known = None
        if PRECOMPUTE_HEAD_GRAD and grad_of is not None and params and any(ctx.needs_input_grad):
            lora = _lora_parts(head, h)
            if lora is not None:
                width, need_dh = cols.shape[1], ctx.needs_input_grad[0]
                known = _KnownGrads(lora, h, width, need_dh, chunk, compute_dtype)
        lse = torch.empty(h.shape[0], dtype=compute_dtype, device=h.device)
        picked = torch.empty(cols.shape, dtype=compute_dtype, device=h.device)
        # Only rows marked in ``done`` are ever read: no zero fill (8 MiB at 4096 x 512).
        expected = None if weight is None else torch.empty_like(h)
        done = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
        low = _autocast_weight(head)
        buffers: dict[str, torch.Tensor] = {}  # reused by every chunk: see _chunk_logits
        with torch.no_grad():
            for a in range(0, h.shape[0], chunk):
                hc = h[a : a + chunk]
                if known is not None:
                    z, u = lora_head._lora_logits(known.lora, hc, chunk)
                else:
                    z = _chunk_logits(head, low, hc, compute_dtype, buffers, chunk)
                picked[a : a + chunk] = z.gather(1, cols[a : a + chunk])
                e, total = _exp_rows(z, compute_dtype, lse[a : a + chunk], buffers)
                if expected is not None and weight is not None:
                    mm_weight = weight if low is None else low
                    _expected_rows(e, total, mm_weight, hint, a, expected, done, chunk)
                if known is not None and grad_of is not None:
                    stop = a + hc.shape[0]
                    g = grad_of(a, stop, picked[a:stop] - lse[a:stop, None])
                    known.add_chunk(a, hc, u, e, total, g, cols[a:stop])
            if known is not None:
                known.finish()
        ctx.save_for_backward(h, cols, lse, expected, done)
        ctx.head, ctx.chunk, ctx.params, ctx.weight = head, chunk, params, weight
        ctx.known = known
        return picked.sub_(lse[:, None])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        h, cols, lse, expected, done = ctx.saved_tensors
        grad = grad.to(lse.dtype)
        known: _KnownGrads | None = ctx.known
        ctx.known = None
        if known is not None and torch.equal(grad, known.g):  # forward formed them all
            dh = known.dh.to(h.dtype) if known.dh is not None else None
            return (dh, None, None, None, None, None, None, *known.param_grads(ctx.params))
        live = grad.ne(0).any(dim=1)  # rows that carry a loss
        dh = None
        if ctx.needs_input_grad[0] and expected is not None and bool((live & done).all()):
            dh = _head_grad(grad, _rows_of(ctx.weight, cols), expected).to(h.dtype)  # all rows
            live.zero_()
        elif ctx.needs_input_grad[0]:
            dh = torch.zeros_like(h)
        if dh is not None and expected is not None and bool(live.any()):
            rows = torch.nonzero(live & done).squeeze(1)
            got = _head_grad(grad[rows], _rows_of(ctx.weight, cols[rows]), expected[rows])
            dh.index_copy_(0, rows, got.to(dh.dtype))
            live &= ~done
        dparams = _recompute_rows(ctx, grad, torch.nonzero(live).squeeze(1), h, cols, lse, dh)
        return (dh, None, None, None, None, None, None, *dparams)


def _rows_of(weight: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``weight[cols]`` ([n, J, D]) through index_select (~3x faster than advanced indexing
    for 4,096 rows of a 32,000 x 512 weight)."""
    return weight.index_select(0, cols.reshape(-1)).view(*cols.shape, weight.shape[-1])


def _head_grad(g: torch.Tensor, picked_w: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """dL/dh for rows whose softmax @ W (``expected``) forward kept: g [n, J] the gradients of
    the picked log-probs, ``picked_w`` [n, J, D] the picked columns' weight rows:
    sum_j g_j (W[c_j] - softmax @ W)."""
    got = torch.bmm(g[:, None, :], picked_w.to(g.dtype)).squeeze(1)
    got -= g.sum(dim=1, keepdim=True) * expected.to(g.dtype)
    return got


def _chunk_logits(
    head: torch.nn.Module,
    low: torch.Tensor | None,
    hc: torch.Tensor,
    compute_dtype: torch.dtype,
    buffers: dict[str, torch.Tensor],
    rows: int,
) -> torch.Tensor:
    """``head(hc)``. A plain head on oneDNN (`gemm`) returns a fresh result, which stays under
    glibc's mmap threshold (see _CHUNK_ELEMENTS), multiplied by the weight packed for ``rows``
    rows (the chunk size) where it is at most `PACK_HEAD_MAX_BYTES`; on torch's own GEMM it
    writes into one [chunk, V] buffer (in the GEMM's dtype: `_exp_rows` widens low-precision
    logits) that every chunk of the forward reuses, so no chunk pays for fresh memory,
    allocator tuning or not (the unembedding GEMM ran at ~80 % of its speed into freshly
    mapped 64 MiB chunks).
    ``low``: the head's weight cast for autocast. An adapter on the head: its own forward, in
    ``compute_dtype``."""
    weight = low
    if weight is None and type(head) is torch.nn.Linear and head.bias is None:
        weight = head.weight
    lora = _lora_parts(head, hc) if weight is None else None
    if lora is not None:
        return lora_head._lora_logits(lora, hc, rows)[0]
    if weight is None:  # an adapter on the head, or a bias: its own forward
        return head(hc).to(compute_dtype)  # type: ignore[no-any-return]
    if gemm.uses_onednn(hc, weight):  # a fresh result: see _CHUNK_ELEMENTS
        if _packs_head(weight):
            return gemm.packed_linear(hc, weight, rows=rows)
        return gemm.linear(hc, weight)
    if "logits" not in buffers:  # the first chunk is the largest
        buffers["logits"] = hc.new_empty((hc.shape[0], weight.shape[0]), dtype=weight.dtype)
    out = buffers["logits"][: hc.shape[0]]
    return torch.mm(hc.to(weight.dtype), weight.t(), out=out)


# Rows per piece when low-precision logits are exponentiated in float32 (4 MiB at V = 32k).
_EXP_ROWS = 32


def _exp_rows(
    z: torch.Tensor,
    compute_dtype: torch.dtype,
    lse: torch.Tensor,
    buffers: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``e = exp(z - max)`` per row (softmax's numerator, overwriting ``z``), its row sums, and
    ``lse = max + log(sum)`` written into ``lse`` — the logsumexp by hand, in place
    (torch.logsumexp is several times slower than these passes at V ~ 32k).

    Low-precision logits (bf16 autocast) are widened to ``compute_dtype`` a few rows at a
    time in a cache-sized buffer and exponentiated there, then written back: every value is
    the same as widening the whole chunk first, with one read and one write of the chunk in
    memory instead of six passes over a float32 copy (measured 13.0 -> 8.0 ms per 64 MiB
    chunk)."""
    if z.dtype == compute_dtype:
        total = compiled.softmax_rows(z, lse)  # the same passes in C, where it applies
        if total is not None:
            return z, total
        top = z.amax(dim=-1, keepdim=True)
        e = z.sub_(top).exp_()
        total = e.sum(dim=-1)
        lse.copy_(top.squeeze(1) + total.log())
        return e, total
    if compute_dtype == torch.float32:
        total = bf16_rows.softmax_rows(z, lse)  # bf16 logits: the same passes in C
        if total is not None:
            return z, total
    total = torch.empty(z.shape[0], dtype=compute_dtype, device=z.device)
    if "widened" not in buffers:
        rows = min(_EXP_ROWS, z.shape[0])
        buffers["widened"] = z.new_empty((rows, z.shape[1]), dtype=compute_dtype)
    for a in range(0, z.shape[0], _EXP_ROWS):
        piece = z[a : a + _EXP_ROWS]
        wide = buffers["widened"][: piece.shape[0]].copy_(piece)
        top = wide.amax(dim=-1, keepdim=True)
        e = wide.sub_(top).exp_()
        total[a : a + _EXP_ROWS] = e.sum(dim=-1)
        lse[a : a + _EXP_ROWS] = top.squeeze(1) + total[a : a + _EXP_ROWS].log()
        piece.copy_(e)
    return z, total


def _autocast_weight(head: torch.nn.Module) -> torch.Tensor | None:
    """Under CPU autocast, a plain frozen head's weight in the autocast dtype, cast once and
    kept (autocast would cast the whole [V, D] weight again for every chunk of every step)."""
    weight = _plain_weight(head)
    kind = weight.device.type if weight is not None else "cpu"
    if weight is None or head.bias is not None or not torch.is_autocast_enabled(kind):
        return None
    return frozen_cast(weight, torch.get_autocast_dtype(kind))


def _plain_weight(head: torch.nn.Module) -> torch.Tensor | None:
    """The weight of a plain, frozen Linear head (no adapter), else None."""
    if type(head) is not torch.nn.Linear or head.weight.requires_grad:
        return None
    return head.weight


def _expected_rows(
    e: torch.Tensor,
    total: torch.Tensor,
    weight: torch.Tensor,
    hint: torch.Tensor | None,
    a: int,
    out: torch.Tensor,
    done: torch.Tensor,
    chunk: int,
) -> None:
    """out[a + i] = softmax @ weight for the chunk's rows in ``hint``, from the chunk's
    ``e = exp(z - max)`` and its row sums ``total`` (the division runs on the [n, D] result).
    ``chunk``: the rows per chunk, for which a packed weight is made."""
    n = e.shape[0]
    rows: torch.Tensor | slice = slice(a, a + n)  # every row of the chunk: no index tensors
    if hint is not None and not bool(hint[a : a + n].all()):
        keep = lora_head.live_rows(hint[a : a + n])  # a slice of e where they are consecutive
        e, total = e[keep], total[keep]
        if isinstance(keep, slice):
            rows = slice(a + keep.start, a + keep.stop)
        else:
            rows = keep + a
    e = e.to(weight.dtype)
    got = gemm.packed_mm(e, weight, chunk) if _packs_head(weight) else gemm.mm(e, weight)
    got, total = got.to(out.dtype), total[:, None].to(out.dtype)
    if isinstance(rows, slice):  # straight into the output: no copy of the [n, D] result
        torch.div(got, total, out=out[rows])
    else:
        out[rows] = got.div_(total)
    done[rows] = True


def _packs_head(weight: torch.Tensor) -> bool:
    return weight.numel() * weight.element_size() <= PACK_HEAD_MAX_BYTES


def _recompute_rows(
    ctx: Any,
    grad: torch.Tensor,
    live: torch.Tensor,
    h: torch.Tensor,
    cols: torch.Tensor,
    lse: torch.Tensor,
    dh: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Backward through the head for rows ``live`` by recomputing their logits; fills their
    rows of ``dh`` and returns the gradients of the head's trainable parameters."""
    params: tuple[torch.Tensor, ...] = ctx.params
    lora = _lora_parts(ctx.head, h)
    if lora is not None:
        return lora_head._lora_backward(lora, params, grad, live, h, cols, lse, dh, ctx.chunk)
    dparams = [torch.zeros_like(p) for p in params]
    for a in range(0, live.numel(), ctx.chunk):
        rows = live[a : a + ctx.chunk]
        g = grad[rows]
        with torch.enable_grad():
            hc = h[rows].detach().requires_grad_(dh is not None)
            z = ctx.head(hc)
            dz = torch.exp(z.detach().to(lse.dtype) - lse[rows, None])
            dz.mul_(-g.sum(dim=1, keepdim=True)).scatter_add_(1, cols[rows], g)
            wrt = ([hc] if dh is not None else []) + list(params)
            got = torch.autograd.grad(z, wrt, dz.to(z.dtype), allow_unused=True)
        if dh is not None:
            dh.index_copy_(0, rows, got[0])
            got = got[1:]
        for acc, g_p in zip(dparams, got, strict=True):
            if g_p is not None:
                acc += g_p
    return dparams


def _lora_parts(head: torch.nn.Module, h: torch.Tensor) -> _Lora | None:
    """A LoRA head (`lora.LoraLinear`: the SDK's default ``train_unembed=True``) whose
    products this module runs itself: no bias, a frozen base, its adapter the only trainable
    parameters, and either one dtype throughout (hidden states, base and adapter; under
    autocast the base's products run in the autocast dtype) or a bf16/fp16 checkpoint's base
    and hidden states with the float32 adapter `lora.LoraLinear` keeps for them (see `_Lora`).
    Else None: the head's own forward and autograd."""
    if type(head) is not LoraLinear or head.bias is not None or head.weight.requires_grad:
        return None
    w, a, b = head.weight, head.lora_A.weight, head.lora_B.weight
    low_base = w.dtype in (torch.bfloat16, torch.float16) and a.dtype == torch.float32
    if not (a.dtype == b.dtype and w.dtype == h.dtype and (w.dtype == a.dtype or low_base)):
        return None
    trainable = [p for p in head.parameters() if p.requires_grad]
    if len(trainable) != 2 or not (trainable[0] is a and trainable[1] is b):
        return None
    kind = h.device.type
    low = w if low_base else None
    if torch.is_autocast_enabled(kind) and not low_base:
        low = frozen_cast(w, torch.get_autocast_dtype(kind))
    return _Lora(w, a, b, head.scaling, low, low is None and _packs_head(w))


def _joined(hidden: Sequence[torch.Tensor]) -> torch.Tensor:
    """The datums' hidden states as one [sum N_i, D] tensor: where they are consecutive
    row-aligned views (`_row_source`) covering the whole of one base, i.e. the rows of the
    [B, T, D] tensor they were unbound from (a batch without padding), a view of it (no copy
    forward, and the gradient reaches it without being stacked back together: ~3 ms a step
    at 16 x 256 x 512); else their concatenation."""
    first = _row_source(hidden[0])
    if first is not None and first[1] == 0:
        base, row = first
        for t in hidden:
            src = _row_source(t)
            if src is None or src[0] is not base or src[1] != row:
                break
            row += t.shape[0]
        else:
            if row * hidden[0].shape[1] == base.numel():
                return base.view(-1, hidden[0].shape[1])
    return torch.cat(list(hidden))


def head_logprobs(
    hidden: Sequence[torch.Tensor],
    cols: list[torch.Tensor],
    head: torch.nn.Module,
    hint: Sequence[torch.Tensor] | None = None,
    grad_of: GradOf | None = None,
) -> tuple[list[torch.Tensor], torch.dtype]:
    """Per datum log_softmax(head(hidden[i]))[:, cols[i]] ([N_i, J_i]), chunked. ``hint[i]``
    (bool [N_i]) marks the positions that may carry a loss (None: any may); it only decides
    where backward work is done ahead, never the result. ``grad_of(start, stop, logp)``: the
    gradient autograd will deliver for rows ``start:stop`` of the concatenated datums (padded
    to the widest J with zeros) given their log-probs, for losses that know it from each
    row's own log-probs; a LoRA head then forms its whole backward in forward (see
    `_KnownGrads`). Like ``hint`` it never changes a result's meaning: a delivered gradient
    that differs is handled by recomputing."""
    compute_dtype = compute_dtype_of(hidden[0].dtype)
    j_max = max(c.shape[1] for c in cols)
    h = _joined(hidden)
    padded = torch.cat([torch.nn.functional.pad(c, (0, j_max - c.shape[1])) for c in cols])
    flat_hint = None if hint is None else torch.cat(list(hint)).to(h.device)
    vocab = int(getattr(head, "out_features", 0))
    params = [p for p in head.parameters() if p.requires_grad]
    logp = _HeadLogprobs.apply(
        h, padded.to(h.device), flat_hint, head, compute_dtype, vocab, grad_of, *params
    )
    out, m = [], 0
    for x, c in zip(hidden, cols, strict=True):
        out.append(logp[m : m + x.shape[0], : c.shape[1]])
        m += x.shape[0]
    return out, compute_dtype
