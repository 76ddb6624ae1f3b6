"""Tinker's built-in `forward_backward` losses, summed over tokens and datums.

Every loss is a plain sum over positions and over the datums of a request, as Tinker defines
its losses. Notation per position t: ``l_t`` learner log-prob of ``target_tokens[t]``, ``lq_t``
the sampler log-prob (input ``logprobs``), ``A_t`` the advantage, ``r_t = exp(l_t - lq_t)``.

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

Request checks (names, configs, inputs) live in `engine.loss_checks`; learner log-probs,
gathered without materialising tokens x vocab, in `engine.loss_logprobs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tinker_sr.engine.loss_checks import LOSS_NAMES, validate_request
from tinker_sr.engine.loss_grads import clip_bounds, flat_input, known_grads, sampled_positions
from tinker_sr.engine.loss_grads import ratio as ratio_of
from tinker_sr.engine.loss_logprobs import compute_dtype_of, gather_logprobs, head_logprobs

__all__ = [
    "LOSS_NAMES",
    "LossDatum",
    "LossResult",
    "compute_loss",
    "validate_request",
]


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
# Losses (flat over all positions of the request)


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
    cfg = _check_request(loss_fn, logits, data, config, unembed)
    logp, cd = _learner_logprobs(loss_fn, logits, data, unembed, cfg)
    outputs = [
        {"logprobs": (lp[:, 0] if d.target_tokens.dim() == 1 else lp).detach().float()}
        for lp, d in zip(logp, data, strict=True)
    ]
    if loss_fn == "cross_entropy":
        loss, metrics = _cross_entropy(logp, data, cd)
    else:
        loss, metrics = _policy_loss(loss_fn, logp, data, cfg, cd)
    return LossResult(loss=loss, outputs=outputs, metrics=metrics)


def _check_request(
    loss_fn: str,
    logits: Sequence[torch.Tensor],
    data: Sequence[LossDatum],
    config: Mapping[str, float] | None,
    unembed: torch.nn.Module | None,
) -> dict[str, float]:
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
    return cfg


def _learner_logprobs(
    loss_fn: str,
    logits: Sequence[torch.Tensor],
    data: Sequence[LossDatum],
    unembed: torch.nn.Module | None,
    cfg: Mapping[str, float],
) -> tuple[list[torch.Tensor], torch.dtype]:
    """Per datum [N_i, J_i] log-probs of its target columns (then its draws, for
    stable_reinforce), and the compute dtype."""
    device = logits[0].device
    cols: list[torch.Tensor] = []
    for d in data:
        tt = d.target_tokens.to(device=device, dtype=torch.long)
        tt = tt[:, None] if tt.dim() == 1 else tt
        if loss_fn == "stable_reinforce" and d.draws is not None:
            tt = torch.cat([tt, d.draws.to(device=device, dtype=torch.long).clamp_min(0)], 1)
        cols.append(tt)
    if unembed is not None:
        grad_of = None
        if torch.is_grad_enabled() and any(p.requires_grad for p in unembed.parameters()):
            cd = compute_dtype_of(logits[0].dtype)
            width = max(c.shape[1] for c in cols)
            grad_of = known_grads(loss_fn, data, cfg, width, device, cd)  # a LoRA head's
        return head_logprobs(logits, cols, unembed, _may_carry_loss(loss_fn, data), grad_of)
    return gather_logprobs(logits, cols)


def _may_carry_loss(loss_fn: str, data: Sequence[LossDatum]) -> list[torch.Tensor] | None:
    """Per datum, the positions whose loss gradient may be non-zero (None: all may).

    Only a hint for where the unembedding's backward work is done ahead (`head_logprobs`);
    a position outside it that still gets a gradient is handled, just later.
    """
    if loss_fn == "cross_entropy":
        w = [d.inputs["weights"] for d in data]
        return [(x != 0) if x.dim() == 1 else (x != 0).any(dim=1) for x in w]
    if loss_fn in ("importance_sampling", "ppo", "cispo", "gspo"):
        return [d.inputs["advantages"] != 0 for d in data]
    return None


def _cross_entropy(
    logp: Sequence[torch.Tensor], data: Sequence[LossDatum], cd: torch.dtype
) -> tuple[torch.Tensor, dict[str, float]]:
    device = logp[0].device
    loss = torch.zeros((), dtype=cd, device=device)
    n_tok = 0
    for lp, d in zip(logp, data, strict=True):
        w = d.inputs["weights"].to(device=device, dtype=cd)
        w2 = w[:, None] if w.dim() == 1 else w
        loss = loss - (w2 * lp).sum()
        n_tok += int((w2 != 0).any(dim=1).sum())
    return loss, {"loss:sum": float(loss.detach()), "num_tokens:sum": float(n_tok)}


@dataclass
class _Flat:
    """A policy loss's inputs, flat over every position of the request."""

    lx: torch.Tensor  # learner log-prob of the target
    lq: torch.Tensor  # sampler log-prob
    adv: torch.Tensor
    diag_parts: list[torch.Tensor]  # per datum: the positions diagnostics run over
    diag: torch.Tensor
    active: torch.Tensor  # adv != 0
    ratio: torch.Tensor


def _flatten(logp: Sequence[torch.Tensor], data: Sequence[LossDatum], cd: torch.dtype) -> _Flat:
    device = logp[0].device
    lx = torch.cat([lp[:, 0] for lp in logp])
    lq = flat_input(data, "logprobs", device, cd)
    adv = flat_input(data, "advantages", device, cd)
    diag_parts = [sampled_positions(d).to(device) for d in data]
    diag = torch.cat(diag_parts).to(device)
    active = adv != 0
    ratio = ratio_of(lx, lq, active)  # 1 where A = 0: see `loss_grads.ratio`
    return _Flat(lx, lq, adv, diag_parts, diag, active, ratio)


def _policy_loss(
    loss_fn: str,
    logp: Sequence[torch.Tensor],
    data: Sequence[LossDatum],
    cfg: Mapping[str, float],
    cd: torch.dtype,
) -> tuple[torch.Tensor, dict[str, float]]:
    f = _flatten(logp, data, cd)
    metrics: dict[str, float] = {}
    if loss_fn == "stable_reinforce":
        ly = _draw_logprob_means(logp, data, cd)
        per_tok, clipped = _stable_reinforce(f, ly, cfg["kl_coeff"], metrics), None
    elif loss_fn == "gspo":
        per_tok, clipped = _gspo(f, data, cfg, cd)
    else:
        per_tok, clipped = _token_loss(loss_fn, f, data, cfg, cd)
    loss = per_tok.sum()
    metrics["loss:sum"] = float(loss.detach())
    metrics["num_tokens:sum"] = float(int(f.diag.sum()))
    _diagnostics(f, clipped, cd, metrics)
    return loss, metrics


def _token_loss(
    loss_fn: str, f: _Flat, data: Sequence[LossDatum], cfg: Mapping[str, float], cd: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position loss of importance_sampling, ppo, cispo and dro (and the clipped mask)."""
    device, ratio, adv, lx = f.lx.device, f.ratio, f.adv, f.lx
    if loss_fn == "importance_sampling":
        return -ratio * adv, None
    if loss_fn == "ppo":
        lo, hi = clip_bounds(data, cfg, cd)
        surrogate, clipped = _trust_region(ratio, adv, lo.to(device), hi.to(device))
        return -surrogate, clipped
    if loss_fn == "cispo":
        lo, hi = clip_bounds(data, cfg, cd)
        lo, hi = lo.to(device), hi.to(device)
        r = ratio.detach()
        clipped = (r < lo) | (r > hi)
        return -torch.minimum(torch.maximum(r, lo), hi) * adv * lx, clipped
    if loss_fn == "dro":
        beta = cfg["beta"]
        return -(adv * lx - 0.5 * beta * (lx - f.lq) ** 2), None
    raise AssertionError(loss_fn)  # pragma: no cover - validate_request rejects unknown names


def _gspo(
    f: _Flat, data: Sequence[LossDatum], cfg: Mapping[str, float], cd: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    device, lx, lq = f.lx.device, f.lx, f.lq
    lo, hi = clip_bounds(data, cfg, cd)
    sizes = [d.target_tokens.shape[0] for d in data]
    seg = torch.repeat_interleave(
        torch.arange(len(data), device=device), torch.tensor(sizes, device=device)
    )
    mask = torch.cat(
        [
            d.inputs["sequence_ratio_mask"].to(device) != 0
            if "sequence_ratio_mask" in d.inputs
            else part
            for d, part in zip(data, f.diag_parts, strict=True)
        ]
    )
    log_ratio = torch.where(mask, lx.detach() - lq, torch.zeros_like(lq))
    totals = torch.zeros(len(data), dtype=cd, device=device).index_add_(0, seg, log_ratio)
    counts = torch.zeros(len(data), dtype=cd, device=device).index_add_(0, seg, mask.to(cd))
    # counts is 0 only for a datum with no sampled position, hence no advantage: s unused.
    s = torch.where(f.active, torch.exp(totals / counts.clamp_min(1))[seg], torch.ones_like(lx))
    s_tok = s * torch.exp(lx - lx.detach())
    surrogate, clipped = _trust_region(s_tok, f.adv, lo.to(device), hi.to(device))
    return -surrogate, clipped


def _draw_logprob_means(
    logp: Sequence[torch.Tensor], data: Sequence[LossDatum], cd: torch.dtype
) -> torch.Tensor:
    """Per position, the learner's mean log-prob over the datum's valid draws (0 without draws)."""
    device = logp[0].device
    for_ly = []
    for lp, d in zip(logp, data, strict=True):
        if d.draws is None:
            for_ly.append(torch.zeros(lp.shape[0], dtype=cd, device=device))
            continue
        valid = (d.draws >= 0).to(device=device, dtype=cd)
        count = valid.sum(dim=1)
        mean = (lp[:, 1:] * valid).sum(dim=1) / count.clamp_min(1)
        for_ly.append(mean)
    return torch.cat(for_ly)


def _stable_reinforce(
    f: _Flat, ly: torch.Tensor, beta: float, metrics: dict[str, float]
) -> torch.Tensor:
    sampled = f.diag
    kl_k1 = f.lq - f.lx
    per_tok = -f.adv * (f.lx - ly) + beta * kl_k1
    per_tok = torch.where(sampled, per_tok, torch.zeros_like(per_tok))
    metrics["kl_penalty:sum"] = float(beta * kl_k1.detach()[sampled].sum())
    return per_tok


def k3_terms(log_r: torch.Tensor) -> torch.Tensor:
    """The k3 estimate's terms r - 1 - log r, as expm1(log r) - log r and at least 0: in
    float32 the plain form rounds below 0 near r = 1 (-6e-8 at log r ~ -2.5e-4)."""
    return (torch.expm1(log_r) - log_r).clamp_min_(0)


def _diagnostics(
    f: _Flat, clipped: torch.Tensor | None, cd: torch.dtype, metrics: dict[str, float]
) -> None:
    """Sampler-vs-learner statistics over the diagnostic positions (means only if any)."""
    diag = f.diag
    log_r = (f.lx - f.lq).detach()
    stats = _masked_stats(-log_r, diag)
    if stats is None:
        return
    r_det = torch.exp(log_r)
    metrics["kl_sampler_learner:mean"] = stats[0]
    metrics["kl_k3:mean"] = float(k3_terms(log_r)[diag].mean())
    r_mean, r_max, r_min = _masked_stats(r_det, diag) or (0.0, 0.0, 0.0)
    metrics["importance_ratio:mean"] = r_mean
    metrics["importance_ratio:max"] = r_max
    metrics["importance_ratio:min"] = r_min
    if clipped is not None:
        metrics["clip_fraction:mean"] = float(clipped[diag].to(cd).mean())
