"""The gradient a built-in loss will deliver to each position's log-probs, known before the
loss is computed, for the losses where it depends on that position alone.

A LoRA adapter on the unembedding (``train_unembed=True``, the official SDK's default) needs
the logits again in backward for its own gradients; `loss_logprobs.head_logprobs` avoids
recomputing them when it is told, chunk by chunk in forward, what ``dL/dlogp`` will be
(`loss_logprobs.GradOf`). These functions say it, as the same float32 operations autograd
runs through `losses` (so the values are equal bit for bit; the head checks that they are
and recomputes if not, so a mismatch costs time, never correctness):

* ``cross_entropy``        g = -w (``w`` the weights, one column per target column);
* ``importance_sampling``  g = -A r where A != 0, r = exp(l - lq); else 0;
* ``ppo``                  the same where the unclipped branch is taken, else 0;
* ``cispo``                g = -clip(r, lo, hi) A;
* ``dro``                  g = -A + beta (l - lq);
* ``stable_reinforce``     on sampled positions: -A - kl_coeff for the target's column,
                           A / n * valid for each of the n valid draws' columns; else 0.

gspo (its ratio is a mean over the whole datum, which a chunk of rows may split) returns
None: the head keeps its recompute path for it. The ratio losses and these functions compute
r with the same `ratio`, the loss over the whole request and these chunk by chunk: torch's
exp gives an element the same bits either way on the builds we pin (checked by the tests,
which would see the recompute path taken otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinker_sr.engine.loss_logprobs import GradOf

if TYPE_CHECKING:
    from tinker_sr.engine.losses import LossDatum

# Losses whose known gradient is a function of the ratio r (`ratio`).
RATIO_LOSSES = ("importance_sampling", "ppo", "cispo")

__all__ = ["clip_bounds", "flat_input", "known_grads", "ratio", "sampled_positions"]


def known_grads(
    loss_fn: str,
    data: Sequence[LossDatum],
    cfg: Mapping[str, float],
    width: int,
    device: torch.device,
    cd: torch.dtype,
) -> GradOf | None:
    """``grad_of(start, stop, logp)`` for rows ``start:stop`` of the request's datums laid end
    to end (log-probs ``[n, width]``, columns past a datum's own zero), or None."""
    req = _Request(data, width, device, cd)
    if loss_fn == "cross_entropy":
        g = torch.cat([req.widen(-req.cols(d.inputs["weights"])) for d in data])
        return lambda start, stop, logp: g[start:stop]
    if loss_fn in RATIO_LOSSES:
        return _ratio_loss(loss_fn, req, cfg)
    if loss_fn == "stable_reinforce":
        return _stable_reinforce(req, cfg["kl_coeff"])
    if loss_fn == "dro":
        return _dro(req, cfg["beta"])
    return None


@dataclass
class _Request:
    data: Sequence[LossDatum]
    width: int  # log-prob columns of the widest datum
    device: torch.device
    cd: torch.dtype  # the loss's compute dtype

    def cols(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(device=self.device, dtype=self.cd)
        return x[:, None] if x.dim() == 1 else x

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, self.width - x.shape[1]))

    def flat(self, key: str) -> torch.Tensor:
        return flat_input(self.data, key, self.device, self.cd)

    def zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros((rows, self.width), dtype=self.cd, device=self.device)


def flat_input(
    data: Sequence[LossDatum], key: str, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The datums' per-position input ``key`` laid end to end, on ``device`` in ``dtype``."""
    return torch.cat([d.inputs[key] for d in data]).to(device=device, dtype=dtype)


def clip_bounds(
    data: Sequence[LossDatum], cfg: Mapping[str, float], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position clip thresholds (ppo, cispo, gspo): the datum's own
    ``clip_low_threshold`` / ``clip_high_threshold`` inputs where given, else the config's."""
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


def sampled_positions(d: LossDatum) -> torch.Tensor:
    """Where the datum was sampled: its SampledProvenanceSpan positions when provenance is
    given, else the positions with a non-zero advantage or sampler log-prob."""
    if d.sampled_mask is not None:
        return d.sampled_mask
    return (d.inputs["advantages"] != 0) | (d.inputs["logprobs"] != 0)


def ratio(lx: torch.Tensor, lq: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """r = exp(l - lq) where A != 0, and 1 where A = 0 (no gradient there: an extreme sampler
    log-prob cannot overflow to inf and turn the gradient into NaN through inf * 0)."""
    return torch.exp(torch.where(active, lx - lq, torch.zeros_like(lx)))


def _ratio_loss(loss_fn: str, req: _Request, cfg: Mapping[str, float]) -> GradOf:
    adv, lq = req.flat("advantages"), req.flat("logprobs")
    active = adv != 0
    lo = hi = adv  # not read by importance_sampling
    if loss_fn != "importance_sampling":
        lo, hi = (x.to(req.device) for x in clip_bounds(req.data, cfg, req.cd))

    def grad_of(start: int, stop: int, logp: torch.Tensor) -> torch.Tensor:
        on, a = active[start:stop], adv[start:stop]
        r = ratio(logp[:, 0], lq[start:stop], on)  # as the loss computes it
        g = req.zeros(stop - start)
        if loss_fn == "cispo":  # -sg[clip(r)] A l
            low, high = lo[start:stop], hi[start:stop]
            g[:, 0] = -torch.minimum(torch.maximum(r, low), high) * a
            return g
        if loss_fn == "ppo":  # no gradient where the clipped branch is taken
            low, high = lo[start:stop], hi[start:stop]
            on = on & ~(((a > 0) & (r > high)) | ((a < 0) & (r < low)))
        g[:, 0] = torch.where(on, -a * r, 0.0)
        return g

    return grad_of


def _stable_reinforce(req: _Request, kl_coeff: float) -> GradOf:
    data, device, cd = req.data, req.device, req.cd
    adv = req.flat("advantages")
    sampled = torch.cat([sampled_positions(d) for d in data]).to(device)
    m = torch.where(sampled, 1.0, 0.0).to(cd)  # the loss's where(), as its gradient
    g = req.zeros(adv.shape[0])
    g[:, 0] = m * -adv + -(m * torch.tensor(kl_coeff, dtype=cd, device=device))
    rows = 0
    for d in data:
        n = d.target_tokens.shape[0]
        if d.draws is not None:
            valid = (d.draws >= 0).to(device=device, dtype=cd)
            per_row = (m[rows : rows + n] * adv[rows : rows + n]) / valid.sum(dim=1).clamp_min(1)
            g[rows : rows + n, 1 : 1 + valid.shape[1]] = per_row[:, None] * valid
        rows += n
    return lambda start, stop, logp: g[start:stop]


def _dro(req: _Request, beta: float) -> GradOf:
    """-A + (beta / 2) * 2 (l - lq), in the order the loss's autograd multiplies."""
    adv, lq = req.flat("advantages"), req.flat("logprobs")
    half_beta = torch.tensor(0.5 * beta, dtype=req.cd, device=req.device)

    def grad_of(start: int, stop: int, logp: torch.Tensor) -> torch.Tensor:
        g = req.zeros(stop - start)
        g[:, 0] = -adv[start:stop] + half_beta * (2.0 * (logp[:, 0] - lq[start:stop]))
        return g

    return grad_of
