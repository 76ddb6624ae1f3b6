"""Tinker's built-in `forward_backward` losses, summed over tokens and datums.

Every loss is a plain sum over positions and over the datums of a request (spec/losses.md
§1.2). Notation per position t: ``l_t`` learner log-prob of ``target_tokens[t]``, ``lq_t`` the
sampler log-prob (input ``logprobs``), ``A_t`` the advantage, ``r_t = exp(l_t - lq_t)``.

* ``cross_entropy``        L = -sum w_t l_t; 2-D targets/weights ``[N, K]`` give
                           L = -sum w_tk log p(x_tk) and output ``logprobs`` of shape ``[N, K]``.
* ``importance_sampling``  L = -sum r_t A_t.
* ``ppo``                  L = -sum min(r_t A_t, clip(r_t, lo, hi) A_t); defaults lo=0.8, hi=1.2.
* ``cispo``                L = -sum sg[clip(r_t, lo, hi)] A_t l_t; defaults lo=0.0, hi=4.0.
* ``dro``                  L = -sum [A_t l_t - beta/2 (l_t - lq_t)^2]. Tinker does not document a
                           default ``beta``; ours is 0.05 (the docs' example). As documented the
                           quadratic term has no mask, so with prompt padding ``lq=0`` it also
                           pulls prompt log-probs toward 0 whenever beta > 0 (reproduced literally).
* ``gspo``                 GSPO-token: s = exp(mean_{mask != 0}(sg[l] - lq)) per datum,
                           s_t = sg[s] p(x_t) / sg[p(x_t)], L = -sum min(s_t A_t, clip(s_t) A_t).
                           ``sequence_ratio_mask`` is optional: without it the mean runs over
                           the datum's sampled positions (as for the diagnostics below), i.e.
                           "over a sequence's sampled tokens" as Tinker's GSPO page defines the
                           ratio; the cookbook's generic ``rl.train`` never sends the mask.
                           Tinker does not document default clip thresholds; ours are PPO's
                           0.8 / 1.2 (the GSPO paper used 1 - 3e-4 / 1 + 4e-4: pass them
                           explicitly if that is what you want).
* ``stable_reinforce``     REINFORCE with sampled score centering and a k1 KL pull toward the
                           sampler, on positions under a SampledProvenanceSpan only (S):
                           L = sum_{t in S} [-A_t (l_t - mean_k log p(y_tk)) + kl_coeff (lq_t - l_t)],
                           ``kl_coeff`` default 0.01, finite and >= 0. ``y_tk`` are the draws
                           recorded at sampling time; a row with fewer valid (>= 0) draws averages
                           over the ones it has. ``loss:sum`` is this surrogate value (§2.5).

Per-position ``clip_low_threshold`` / ``clip_high_threshold`` inputs (api.md §9.8) override the
config for ppo, cispo and gspo.

Diagnostics, for losses that take sampler ``logprobs``, on the positions where the datum was
sampled (``sampled_mask`` when provenance is given, else positions with a non-zero advantage or
a non-zero sampler log-prob):

* ``kl_sampler_learner:mean`` k1 estimate of KL(q || p) per token, mean of (lq - l);
* ``kl_k3:mean``              k3 estimate, mean of (r - 1 - log r), never negative;
* ``importance_ratio:{mean,max,min}`` of the per-token r;
* ``clip_fraction:mean``      ppo/gspo: share of positions whose clipped branch is taken (zero
                              gradient); cispo: share whose ratio was clamped;
* ``num_tokens:sum``          number of those positions (for cross_entropy: positions with a
                              non-zero weight);
* ``kl_penalty:sum``          stable_reinforce only: kl_coeff * sum over S of (lq - l).

Means are left out when no position qualifies. ``loss:sum`` is always present.

Memory: learner log-probs are computed by gathering the needed logits and subtracting a
row-chunked logsumexp; the backward pass writes the logit gradient straight into one buffer.
Beyond that gradient, nothing of size tokens x vocab is allocated (transients are bounded by
``_CHUNK_ELEMENTS``). When every datum's logits are row views of one contiguous padded batch,
the gradient is produced for the batch at once instead of one padded copy per datum.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import torch

from tinker_sr.engine.errors import EngineUserError
from tinker_sr.types.training import LossFnType

__all__ = [
    "LOSS_NAMES",
    "LossDatum",
    "LossResult",
    "compute_loss",
    "validate_request",
]

# The built-in losses: every public LossFnType except "custom" (server-side custom losses).
LOSS_NAMES: tuple[str, ...] = tuple(n for n in get_args(LossFnType) if n != "custom")

# Config keys each loss accepts, with their defaults.
_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "stable_reinforce": {"kl_coeff": 0.01},
}

_RL_INPUTS = ("logprobs", "advantages")
_CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")
# loss_fn_inputs keys (besides target_tokens) each loss requires, and the optional ones it honours.
_REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "gspo": _RL_INPUTS,
    "stable_reinforce": _RL_INPUTS,
}
_OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    "ppo": _CLIP_INPUTS,
    "cispo": _CLIP_INPUTS,
    # Without it the ratio is taken over the datum's sampled positions (see the module doc).
    "gspo": (*_CLIP_INPUTS, "sequence_ratio_mask"),
}

# Upper bound on the elements of any transient rows x vocab tensor (64 MiB in float32).
_CHUNK_ELEMENTS = 1 << 24


@dataclass
class LossDatum:
    """One datum as the loss sees it.

    ``inputs`` holds the user's ``loss_fn_inputs`` other than ``target_tokens``. ``draws`` and
    ``sampled_mask`` come from the provenance validator: the recorded stability draws aligned
    to datum positions (-1 where none) and the positions under a SampledProvenanceSpan.
    """

    target_tokens: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    draws: torch.Tensor | None = None
    sampled_mask: torch.Tensor | None = None


@dataclass
class LossResult:
    loss: torch.Tensor
    outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


# ---------------------------------------------------------------------------------------------
# Validation


def _accepted_inputs(loss_fn: str) -> tuple[str, ...]:
    return ("target_tokens", *_REQUIRED_INPUTS[loss_fn], *_OPTIONAL_INPUTS.get(loss_fn, ()))


def _normalise_config(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    defaults = _CONFIG_DEFAULTS[loss_fn]
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise EngineUserError(
            f"loss_fn_config must be a mapping of names to numbers, got {type(config).__name__}"
        )
    out = dict(defaults)
    for key, value in config.items():
        if key not in defaults:
            accepted = ", ".join(defaults) if defaults else "none"
            raise EngineUserError(
                f"loss_fn_config key {key!r} is not accepted by {loss_fn} "
                f"(accepted keys: {accepted}); remove it"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EngineUserError(
                f"loss_fn_config[{key!r}] must be a number, got {value!r} ({type(value).__name__})"
            )
        value = float(value)
        if not math.isfinite(value):
            raise EngineUserError(f"loss_fn_config[{key!r}] must be finite, got {value}")
        out[key] = value
    if out.get("kl_coeff", 0.0) < 0:
        raise EngineUserError(
            f"loss_fn_config['kl_coeff'] must be >= 0, got {out['kl_coeff']}; "
            "use 0 to switch the KL term off"
        )
    if out.get("beta", 0.0) < 0:
        raise EngineUserError(f"loss_fn_config['beta'] must be >= 0, got {out['beta']}")
    if "clip_low_threshold" in out and out["clip_low_threshold"] > out["clip_high_threshold"]:
        raise EngineUserError(
            f"loss_fn_config clip_low_threshold ({out['clip_low_threshold']}) is above "
            f"clip_high_threshold ({out['clip_high_threshold']}); both are ratio bounds, "
            "e.g. 0.8 and 1.2"
        )
    return out


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ("," if t.dim() == 1 else "") + ")"


def _first_true(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


def _validate_datum(i: int, loss_fn: str, d: LossDatum, vocab_size: int | None) -> None:
    tt = d.target_tokens
    if not isinstance(tt, torch.Tensor):
        raise EngineUserError(f"datum {i}: target_tokens must be a tensor")
    if tt.dtype.is_floating_point or tt.dtype.is_complex or tt.dtype == torch.bool:
        raise EngineUserError(f"datum {i}: target_tokens must hold integers, got {tt.dtype}")
    if tt.dim() == 2 and loss_fn != "cross_entropy":
        raise EngineUserError(
            f"datum {i}: target_tokens has shape {_shape(tt)} but {loss_fn} takes one target "
            "per position (shape (N,)); only cross_entropy takes (N, K) targets"
        )
    if tt.dim() not in (1, 2):
        raise EngineUserError(
            f"datum {i}: target_tokens must have shape (N,) or (N, K), got {_shape(tt)}"
        )
    if tt.numel() == 0:
        raise EngineUserError(f"datum {i}: target_tokens is empty; every datum needs a target")
    if bool((tt < 0).any()):
        t = _first_true(tt < 0)
        raise EngineUserError(
            f"datum {i}: target_tokens holds {int(tt.reshape(-1)[t])} at flat index {t}; "
            "token ids must be >= 0"
        )
    if vocab_size is not None and bool((tt >= vocab_size).any()):
        t = _first_true(tt >= vocab_size)
        raise EngineUserError(
            f"datum {i}: target_tokens holds token {int(tt.reshape(-1)[t])} at flat index {t} "
            f"but the vocabulary has {vocab_size} tokens"
        )
    n = tt.shape[0]

    required = _REQUIRED_INPUTS[loss_fn]
    accepted = _accepted_inputs(loss_fn)
    for key in required:
        if key not in d.inputs:
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs is missing {key!r}, which {loss_fn} requires "
                f"(required: {', '.join(('target_tokens', *required))})"
            )
    for key, value in d.inputs.items():
        if key not in accepted:
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs key {key!r} is not used by {loss_fn} "
                f"(accepted: {', '.join(accepted)}); remove it"
            )
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs[{key!r}] must be a float32 tensor, got {kind}"
            )
        want = tt.shape if key == "weights" else (n,)
        if value.shape != want:
            target_desc = (
                f"target_tokens has shape {_shape(tt)}"
                if key == "weights" or tt.dim() == 1
                else f"target_tokens has {n} rows"
            )
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape {_shape(value)} but "
                f"{target_desc}; every input needs one value per target"
            )
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            t = _first_true(~finite)
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs[{key!r}] holds a non-finite value "
                f"({float(value.reshape(-1)[t])}) at flat index {t}"
            )
    if "clip_low_threshold" in d.inputs and "clip_high_threshold" in d.inputs:
        bad = d.inputs["clip_low_threshold"] > d.inputs["clip_high_threshold"]
        if bool(bad.any()):
            t = _first_true(bad)
            raise EngineUserError(
                f"datum {i}: clip_low_threshold is above clip_high_threshold at position {t}"
            )
    if "sequence_ratio_mask" in d.inputs and not bool((d.inputs["sequence_ratio_mask"] != 0).any()):
        raise EngineUserError(
            f"datum {i}: sequence_ratio_mask is all zero, so the GSPO sequence ratio is "
            "undefined; mark the sampled tokens with 1"
        )

    if d.sampled_mask is not None:
        sm = d.sampled_mask
        if not isinstance(sm, torch.Tensor) or sm.dtype != torch.bool or sm.shape != (n,):
            raise EngineUserError(
                f"datum {i}: sampled_mask must be a bool tensor of shape ({n},)"
            )  # backend bug rather than user error, but say where
    if d.draws is not None:
        dr = d.draws
        if (
            not isinstance(dr, torch.Tensor)
            or dr.dtype.is_floating_point
            or dr.dim() != 2
            or dr.shape[0] != n
            or dr.shape[1] < 1
        ):
            raise EngineUserError(
                f"datum {i}: stability draws must be an integer tensor of shape ({n}, K)"
            )
        if vocab_size is not None and bool((dr >= vocab_size).any()):
            raise EngineUserError(
                f"datum {i}: recorded stability draws hold token ids >= the vocabulary size "
                f"{vocab_size}; the sequence was sampled from a different model"
            )

    if loss_fn == "stable_reinforce":
        _validate_stable_reinforce_datum(i, d)


def _validate_stable_reinforce_datum(i: int, d: LossDatum) -> None:
    sm = d.sampled_mask
    if sm is None:
        raise EngineUserError(
            f"datum {i}: stable_reinforce needs provenance on every datum (model_input_spans "
            "and loss_fn_input_spans); build datums with tinker_sr.provenance.build_datum"
        )
    if not bool(sm.any()):
        raise EngineUserError(
            f"datum {i}: stable_reinforce needs at least one target position under a "
            "SampledProvenanceSpan in loss_fn_input_spans"
        )
    adv = d.inputs["advantages"]
    outside = (adv != 0) & ~sm
    if bool(outside.any()):
        t = _first_true(outside)
        raise EngineUserError(
            f"datum {i}: advantages[{t}] = {float(adv[t])} but position {t} is not under a "
            "SampledProvenanceSpan; stable_reinforce accepts non-zero advantages only on "
            "sampled tokens (set the prompt advantages to 0)"
        )
    needs_draws = (adv != 0) & sm
    if bool(needs_draws.any()):
        if d.draws is None:
            no_draws = needs_draws
        else:
            no_draws = needs_draws & ~(d.draws >= 0).any(dim=1)
        if bool(no_draws.any()):
            t = _first_true(no_draws)
            raise EngineUserError(
                f"datum {i}: position {t} has advantage {float(adv[t])} but no recorded "
                "stability draws; sample with a client created with record_stability_info=True"
            )


def validate_request(
    loss_fn: str,
    data: Sequence[LossDatum],
    config: Mapping[str, float | str] | None,
    *,
    vocab_size: int | None = None,
) -> dict[str, float]:
    """Check a request before any compute; return the config with defaults filled in.

    Raises EngineUserError naming the datum and key. ``vocab_size``, when known, also checks
    that target and draw token ids fit the model.
    """
    if loss_fn not in _CONFIG_DEFAULTS:
        raise EngineUserError(
            f"unknown loss_fn {loss_fn!r}; expected one of: {', '.join(LOSS_NAMES)}"
        )
    cfg = _normalise_config(loss_fn, config)
    if len(data) == 0:
        raise EngineUserError("no data: a request needs at least one datum")
    for i, d in enumerate(data):
        _validate_datum(i, loss_fn, d, vocab_size)
    return cfg


# ---------------------------------------------------------------------------------------------
# Log-prob gathering


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
        chunk = max(1, _CHUNK_ELEMENTS // max(z.shape[1], 1))
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
        chunk = max(1, _CHUNK_ELEMENTS // max(z.shape[1], 1))
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


def _gather_logprobs(
    logits: Sequence[torch.Tensor], cols: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.dtype]:
    """Return per datum log_softmax(logits[i])[:, cols[i]] ([N_i, J_i], compute dtype)."""
    dtype = logits[0].dtype
    compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
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
    keeps a per-row logsumexp. Backward recomputes the logits of the rows whose incoming
    gradient is non-zero only (positions that carry no loss, e.g. prompts under zero weights
    or advantages, cost no backward unembedding), forms
    dL/dz = onehot-scatter(g) - softmax(z) * sum_j g, and back-propagates it through ``head``
    chunk by chunk.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")  # backward recomputes under the same autocast
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        cols: torch.Tensor,
        head: torch.nn.Module,
        compute_dtype: torch.dtype,
        vocab: int,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        chunk = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
        lse = torch.empty(h.shape[0], dtype=compute_dtype, device=h.device)
        picked = torch.empty(cols.shape, dtype=compute_dtype, device=h.device)
        with torch.no_grad():
            for a in range(0, h.shape[0], chunk):
                z = head(h[a : a + chunk]).to(compute_dtype)
                lse[a : a + chunk] = torch.logsumexp(z, dim=-1)
                picked[a : a + chunk] = z.gather(1, cols[a : a + chunk])
        ctx.save_for_backward(h, cols, lse)
        ctx.head, ctx.chunk, ctx.params = head, chunk, params
        return picked.sub_(lse[:, None])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        h, cols, lse = ctx.saved_tensors
        params: tuple[torch.Tensor, ...] = ctx.params
        grad = grad.to(lse.dtype)
        live = torch.nonzero(grad.ne(0).any(dim=1)).squeeze(1)  # rows that carry a loss
        dh = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
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
        return (dh, None, None, None, None, *dparams)


def _head_logprobs(
    hidden: Sequence[torch.Tensor], cols: list[torch.Tensor], head: torch.nn.Module
) -> tuple[list[torch.Tensor], torch.dtype]:
    """Per datum log_softmax(head(hidden[i]))[:, cols[i]] ([N_i, J_i]), chunked."""
    compute_dtype = torch.float64 if hidden[0].dtype == torch.float64 else torch.float32
    j_max = max(c.shape[1] for c in cols)
    h = torch.cat(list(hidden))
    padded = torch.cat([torch.nn.functional.pad(c, (0, j_max - c.shape[1])) for c in cols])
    vocab = int(getattr(head, "out_features", 0))
    params = [p for p in head.parameters() if p.requires_grad]
    logp = _HeadLogprobs.apply(h, padded.to(h.device), head, compute_dtype, vocab, *params)
    out, m = [], 0
    for x, c in zip(hidden, cols, strict=True):
        out.append(logp[m : m + x.shape[0], : c.shape[1]])
        m += x.shape[0]
    return out, compute_dtype


# ---------------------------------------------------------------------------------------------
# Losses (flat over all positions of the request)


def _clip_bounds(
    data: Sequence[LossDatum], cfg: Mapping[str, float], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    lo: list[torch.Tensor] = []
    hi: list[torch.Tensor] = []
    for d in data:
        n = d.target_tokens.shape[0]
        for key, acc in (("clip_low_threshold", lo), ("clip_high_threshold", hi)):
            per_pos = d.inputs.get(key)
            acc.append(
                per_pos.to(dtype)
                if per_pos is not None
                else torch.full((n,), cfg[key], dtype=dtype)
            )
    return torch.cat(lo), torch.cat(hi)


def _trust_region(
    ratio: torch.Tensor, adv: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """min(ratio A, clip(ratio) A) with the clipped branch detached; also the clipped mask."""
    clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    bounded = torch.minimum(torch.maximum(ratio.detach(), lo), hi)
    return torch.where(clipped, bounded * adv, ratio * adv), clipped


def _masked_stats(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float] | None:
    v = values.detach()[mask]
    if v.numel() == 0:
        return None
    return float(v.mean()), float(v.max()), float(v.min())


def compute_loss(
    loss_fn: str,
    logits: Sequence[torch.Tensor],
    data: Sequence[LossDatum],
    config: Mapping[str, float] | None,
    *,
    unembed: torch.nn.Module | None = None,
) -> LossResult:
    """Loss, per-datum outputs and metrics for one request.

    ``logits[i]`` is the learner's [N_i, V] logits for datum i (a view into a padded batch is
    fine). The returned ``loss`` is differentiable with respect to the logits.

    With ``unembed`` (the model's ``lm_head``), ``logits[i]`` are instead the [N_i, D] final
    hidden states: the unembedding runs chunk by chunk inside the loss (`_HeadLogprobs`), so
    no [N, V] tensor is ever allocated, and the backward pass skips positions without loss.
    """
    if len(logits) != len(data):
        raise ValueError(f"got {len(logits)} logits tensors for {len(data)} datums")
    vocab: int | None = logits[0].shape[-1] if logits else None
    width, what = vocab, "the vocabulary"
    if unembed is not None:
        vocab = int(getattr(unembed, "out_features", 0))
        width, what = int(getattr(unembed, "in_features", 0)), "the hidden width"
    cfg = validate_request(loss_fn, data, config, vocab_size=vocab)
    for i, (z, d) in enumerate(zip(logits, data, strict=True)):
        if z.dim() != 2 or z.shape[0] != d.target_tokens.shape[0] or z.shape[1] != width:
            raise ValueError(
                f"datum {i}: inputs have shape {tuple(z.shape)} but target_tokens has "
                f"{d.target_tokens.shape[0]} rows and {what} is {width}"
            )

    device = logits[0].device
    cols: list[torch.Tensor] = []
    for d in data:
        tt = d.target_tokens.to(device=device, dtype=torch.long)
        tt = tt[:, None] if tt.dim() == 1 else tt
        if loss_fn == "stable_reinforce" and d.draws is not None:
            tt = torch.cat([tt, d.draws.to(device=device, dtype=torch.long).clamp_min(0)], 1)
        cols.append(tt)
    if unembed is not None:
        logp, cd = _head_logprobs(logits, cols, unembed)
    else:
        logp, cd = _gather_logprobs(logits, cols)

    outputs = [
        {"logprobs": (lp[:, 0] if d.target_tokens.dim() == 1 else lp).detach().float()}
        for lp, d in zip(logp, data, strict=True)
    ]
    metrics: dict[str, float] = {}

    if loss_fn == "cross_entropy":
        loss = torch.zeros((), dtype=cd, device=device)
        n_tok = 0
        for lp, d in zip(logp, data, strict=True):
            w = d.inputs["weights"].to(device=device, dtype=cd)
            w2 = w[:, None] if w.dim() == 1 else w
            loss = loss - (w2 * lp).sum()
            n_tok += int((w2 != 0).any(dim=1).sum())
        metrics["loss:sum"] = float(loss.detach())
        metrics["num_tokens:sum"] = float(n_tok)
        return LossResult(loss=loss, outputs=outputs, metrics=metrics)

    def cat(key: str) -> torch.Tensor:
        return torch.cat([d.inputs[key] for d in data]).to(device=device, dtype=cd)

    lx = torch.cat([lp[:, 0] for lp in logp])
    lq = cat("logprobs")
    adv = cat("advantages")
    diag_parts = []
    for d in data:
        if d.sampled_mask is not None:
            diag_parts.append(d.sampled_mask.to(device))
        else:
            diag_parts.append((d.inputs["advantages"] != 0) | (d.inputs["logprobs"] != 0))
    diag = torch.cat(diag_parts).to(device)
    # Where A = 0 a position contributes nothing; keep its ratio at 1 there so an extreme sampler
    # log-prob cannot overflow to inf and turn the batch's gradient into NaN (inf * 0).
    active = adv != 0
    ratio = torch.exp(torch.where(active, lx - lq, torch.zeros_like(lx)))
    clipped: torch.Tensor | None = None

    if loss_fn == "importance_sampling":
        per_tok = -ratio * adv
    elif loss_fn == "ppo":
        lo, hi = _clip_bounds(data, cfg, cd)
        surrogate, clipped = _trust_region(ratio, adv, lo.to(device), hi.to(device))
        per_tok = -surrogate
    elif loss_fn == "cispo":
        lo, hi = _clip_bounds(data, cfg, cd)
        lo, hi = lo.to(device), hi.to(device)
        r = ratio.detach()
        clipped = (r < lo) | (r > hi)
        per_tok = -torch.minimum(torch.maximum(r, lo), hi) * adv * lx
    elif loss_fn == "dro":
        beta = cfg["beta"]
        per_tok = -(adv * lx - 0.5 * beta * (lx - lq) ** 2)
    elif loss_fn == "gspo":
        lo, hi = _clip_bounds(data, cfg, cd)
        sizes = [d.target_tokens.shape[0] for d in data]
        seg = torch.repeat_interleave(
            torch.arange(len(data), device=device), torch.tensor(sizes, device=device)
        )
        mask = torch.cat(
            [
                d.inputs["sequence_ratio_mask"].to(device) != 0
                if "sequence_ratio_mask" in d.inputs
                else part
                for d, part in zip(data, diag_parts, strict=True)
            ]
        )
        log_ratio = torch.where(mask, lx.detach() - lq, torch.zeros_like(lq))
        totals = torch.zeros(len(data), dtype=cd, device=device).index_add_(0, seg, log_ratio)
        counts = torch.zeros(len(data), dtype=cd, device=device).index_add_(0, seg, mask.to(cd))
        # counts is 0 only for a datum with no sampled position, hence no advantage: s unused.
        s = torch.where(active, torch.exp(totals / counts.clamp_min(1))[seg], torch.ones_like(lx))
        s_tok = s * torch.exp(lx - lx.detach())
        surrogate, clipped = _trust_region(s_tok, adv, lo.to(device), hi.to(device))
        per_tok = -surrogate
    elif loss_fn == "stable_reinforce":
        beta = cfg["kl_coeff"]
        sampled = diag
        for_ly = []
        for lp, d in zip(logp, data, strict=True):
            if d.draws is None:
                for_ly.append(torch.zeros(lp.shape[0], dtype=cd, device=device))
                continue
            valid = (d.draws >= 0).to(device=device, dtype=cd)
            count = valid.sum(dim=1)
            mean = (lp[:, 1:] * valid).sum(dim=1) / count.clamp_min(1)
            for_ly.append(mean)
        ly = torch.cat(for_ly)
        kl_k1 = lq - lx
        per_tok = -adv * (lx - ly) + beta * kl_k1
        per_tok = torch.where(sampled, per_tok, torch.zeros_like(per_tok))
        metrics["kl_penalty:sum"] = float(beta * kl_k1.detach()[sampled].sum())
    else:  # pragma: no cover - validate_request rejects unknown names
        raise AssertionError(loss_fn)

    loss = per_tok.sum()
    metrics["loss:sum"] = float(loss.detach())
    metrics["num_tokens:sum"] = float(int(diag.sum()))
    log_r = (lx - lq).detach()
    stats = _masked_stats(-log_r, diag)
    if stats is not None:
        r_det = torch.exp(log_r)
        metrics["kl_sampler_learner:mean"] = stats[0]
        metrics["kl_k3:mean"] = float((r_det - 1 - log_r)[diag].mean())
        r_mean, r_max, r_min = _masked_stats(r_det, diag) or (0.0, 0.0, 0.0)
        metrics["importance_ratio:mean"] = r_mean
        metrics["importance_ratio:max"] = r_max
        metrics["importance_ratio:min"] = r_min
        if clipped is not None:
            metrics["clip_fraction:mean"] = float(clipped[diag].to(cd).mean())
    return LossResult(loss=loss, outputs=outputs, metrics=metrics)
