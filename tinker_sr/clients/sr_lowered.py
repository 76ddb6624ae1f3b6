"""The lowering itself, pure numpy: StableReinforce datums + provenance views → weighted
``cross_entropy`` targets ``[N, 1+K]`` (`lowered_inputs`), and the learner logprobs of those
columns → the output native ``stable_reinforce`` returns (`lowered_result`). See
`sr_lowering` for the derivation and for when it runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinker_sr import types
from tinker_sr.errors import RequestFailedError
from tinker_sr.provenance.validate import ProvenanceView

__all__ = [
    "LoweredDatum",
    "ce_datum",
    "datum_inputs",
    "k3_mean",
    "kl_coeff_of",
    "lowered_inputs",
    "lowered_result",
    "user_error",
]


def k3_mean(log_r: np.ndarray) -> float:
    """The mean of the k3 estimate's terms r - 1 - log r over log-ratios ``log_r``: numpy's
    twin of `tinker_sr.engine.losses.k3_terms` (expm1, clamped at 0: never negative)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.mean(np.maximum(np.expm1(log_r) - log_r, 0)))


_DEFAULT_KL = 0.01


@dataclass
class LoweredDatum:
    """One datum in lowered form: the cross_entropy targets/weights and what the loss
    value needs (numpy, float64 where arithmetic happens)."""

    targets: np.ndarray  # int64 [N, 1+K]
    weights: np.ndarray  # float32 [N, 1+K]
    sampled: np.ndarray  # bool [N]
    valid: np.ndarray  # bool [N, K]
    lq: np.ndarray  # float64 [N]
    adv: np.ndarray  # float64 [N]
    tail: np.ndarray  # float64 [N]; NaN where the draws are the engine's (no tail)


def user_error(message: str) -> RequestFailedError:
    return RequestFailedError(
        f"Request failed: {message}", request_id="", category=types.RequestErrorCategory.User
    )


def kl_coeff_of(config: Mapping[str, float | str] | None) -> float:
    cfg = dict(config or {})
    unknown = sorted(set(cfg) - {"kl_coeff"})
    if unknown:
        raise user_error(
            f"loss_fn_config key {unknown[0]!r} is not accepted by stable_reinforce "
            "(accepted keys: kl_coeff); remove it"
        )
    value = cfg.get("kl_coeff", _DEFAULT_KL)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise user_error(f"loss_fn_config['kl_coeff'] must be a number, got {value!r}")
    beta = float(value)
    if not math.isfinite(beta) or beta < 0:
        raise user_error(
            f"loss_fn_config['kl_coeff'] must be finite and >= 0, got {beta}; use 0 to switch "
            "the KL term off"
        )
    return beta


def datum_inputs(i: int, d: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(input tokens, target tokens, sampler logprobs, advantages) of datum ``i``."""
    lfi = d.loss_fn_inputs
    accepted = ("target_tokens", "logprobs", "advantages")
    for key in lfi:
        if key not in accepted:
            raise user_error(
                f"datum {i}: loss_fn_inputs key {key!r} is not used by stable_reinforce "
                f"(accepted: {', '.join(accepted)}); remove it"
            )
    for key in accepted:
        if key not in lfi:
            raise user_error(
                f"datum {i}: loss_fn_inputs is missing {key!r}, which stable_reinforce requires "
                f"(required: {', '.join(accepted)})"
            )
    tokens = np.asarray(d.model_input.to_ints(), dtype=np.int64)
    tt = np.asarray(lfi["target_tokens"].to_numpy())
    if tt.ndim != 1:
        raise user_error(
            f"datum {i}: target_tokens has shape {tuple(tt.shape)} but stable_reinforce takes "
            "one target per position (shape (N,))"
        )
    out = [np.asarray(lfi[k].to_numpy(), dtype=np.float64) for k in ("logprobs", "advantages")]
    for key, arr in zip(("logprobs", "advantages"), out, strict=True):
        if arr.shape != tt.shape:
            raise user_error(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape {tuple(arr.shape)} but "
                f"target_tokens has shape {tuple(tt.shape)}; every input needs one value per target"
            )
        if not np.isfinite(arr).all():
            raise user_error(f"datum {i}: loss_fn_inputs[{key!r}] holds a non-finite value")
    return tokens, tt.astype(np.int64), out[0], out[1]


def lowered_inputs(
    data: Sequence[Any],
    kl_coeff: float,
    views: Sequence[ProvenanceView],
    tails: Sequence[np.ndarray],
) -> list[LoweredDatum]:
    """Datums + their provenance views → cross_entropy targets/weights ``[N, 1+K]``.

    Weight ``A_t + β`` on the sampled token and ``-A_t / K_t`` on each of its ``K_t`` valid
    draws, on sampled positions only; K is the request's widest row (narrower rows are
    padded with token 0, weight 0).
    """
    k = max((v.draws.shape[1] for v in views if v.draws is not None), default=0)
    out = []
    for i, (d, view, tail) in enumerate(zip(data, views, tails, strict=True)):
        _, tt, lq, adv = datum_inputs(i, d)
        n = tt.shape[0]
        draws = np.full((n, k), -1, dtype=np.int64)
        if view.draws is not None:
            draws[:, : view.draws.shape[1]] = view.draws
        sampled = view.sampled_mask
        valid = (draws >= 0) & sampled[:, None]
        count = valid.sum(axis=1)
        missing = sampled & (adv != 0) & (count == 0)
        if missing.any():
            t = int(np.flatnonzero(missing)[0])
            raise user_error(
                f"datum {i}: position {t} has advantage {adv[t]} but no stability draws; sample "
                "with a client created with record_stability_info=True"
            )
        # Same float32 arithmetic as the engine's gradient: -(A + β) on x, A / K_t per draw.
        adv32 = adv.astype(np.float32)
        weights = np.zeros((n, 1 + k), dtype=np.float32)
        weights[:, 0] = np.where(sampled, adv32 + np.float32(kl_coeff), 0)
        per_draw = -adv32 / np.maximum(count, 1).astype(np.float32)
        weights[:, 1:] = np.where(valid, per_draw[:, None], 0)
        targets = np.concatenate([tt[:, None], np.where(valid, draws, 0)], axis=1)
        out.append(LoweredDatum(targets, weights, sampled, valid[:, :k], lq, adv, np.asarray(tail)))
    return out


def ce_datum(d: Any, targets: np.ndarray, weights: np.ndarray) -> types.Datum:
    """A provenance-free cross_entropy datum (foreign engines know no spans; we checked them)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(d.model_input.to_ints())),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.ascontiguousarray(targets)),
            "weights": types.TensorData.from_numpy(np.ascontiguousarray(weights)),
        },
    )


def lowered_result(
    lowered: Sequence[LoweredDatum], logprobs: Sequence[np.ndarray], kl_coeff: float
) -> types.ForwardBackwardOutput:
    """The output native stable_reinforce returns, from the learner logprobs of every column
    (``logprobs[i]`` is ``[N_i, 1+K]``; columns without weight may hold anything)."""
    outputs = []
    per_tok_all, lx_all, lq_all, tail_all = [], [], [], []
    for low, lp in zip(lowered, logprobs, strict=True):
        lp64 = np.asarray(lp, dtype=np.float64)
        lx = lp64[:, 0]
        count = low.valid.sum(axis=1)
        ly = np.where(low.valid, lp64[:, 1:], 0.0).sum(axis=1) / np.maximum(count, 1)
        per_tok = -low.adv * (lx - ly) + kl_coeff * (low.lq - lx)
        per_tok_all.append(per_tok[low.sampled])
        lx_all.append(lx[low.sampled])
        lq_all.append(low.lq[low.sampled])
        tail_all.append(low.tail[low.sampled])
        outputs.append({"logprobs": types.TensorData.from_numpy(lp[:, 0].astype(np.float32))})
    per_tok = np.concatenate(per_tok_all)
    lx = np.concatenate(lx_all)
    lq = np.concatenate(lq_all)
    metrics = {
        "loss:sum": float(per_tok.sum()),
        "kl_penalty:sum": float(kl_coeff * (lq - lx).sum()),
        "num_tokens:sum": float(lx.size),
    }
    if lx.size:
        log_r = lx - lq
        with np.errstate(over="ignore"):
            r = np.exp(log_r)
        metrics.update(
            {
                "kl_sampler_learner:mean": float(np.mean(-log_r)),
                "kl_k3:mean": k3_mean(log_r),
                "importance_ratio:mean": float(r.mean()),
                "importance_ratio:max": float(r.max()),
                "importance_ratio:min": float(r.min()),
            }
        )
        tail = np.concatenate(tail_all)
        tail = tail[np.isfinite(tail)]
        if tail.size:
            metrics["draw_tail_mass:mean"] = float(tail.mean())
            metrics["draw_tail_mass:max"] = float(tail.max())
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=metrics
    )
