"""A backward pass that never leaves a model in a state the next request cannot use.

Finite but huge inputs (weights 3e38, advantages 1e38) overflow the loss or the gradient to
inf. Accumulating that would make every later ``optim_step`` fail, so the request that
produces it is refused instead, naming the datum, and the accumulated gradients stay exactly
as they were: the client's next ``forward_backward`` + ``optim_step`` run as if the refused
request had never been sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from tinker_sr.engine import losses as engine_losses
from tinker_sr.engine.optim import Adam
from tinker_sr.user_errors import EngineUserError

__all__ = ["DIVERGED", "check_finite_outputs", "checked_backward", "nonfinite_datum"]


DIVERGED = (
    "the model's log-probs are not finite (NaN or inf) on finite inputs: its weights have "
    "diverged, most likely in an optim_step with too large a learning_rate (or, in float16, its "
    "activations overflow). Nothing is wrong with the request; load_state a checkpoint saved "
    "before that step (or start a new training client) and train with a smaller learning_rate "
    "(or load the model in bfloat16 or float32)"
)


def check_finite_outputs(what: str, outputs: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """EngineUserError if a datum's ``logprobs`` output is not finite: a log-softmax of
    finite logits always is, so the model itself is broken (weights grown past float32's
    range), which every later call would otherwise return as NaN without a word."""
    lps = [(i, out["logprobs"]) for i, out in enumerate(outputs) if "logprobs" in out]
    if not lps or bool(torch.isfinite(torch.cat([v.reshape(-1) for _, v in lps])).all()):
        return
    i = next(i for i, v in lps if not bool(torch.isfinite(v).all()))
    raise EngineUserError(f"{what}: datum {i}: {DIVERGED}")


def checked_backward(
    result: engine_losses.LossResult,
    optim: Adam,
    loss_fn: str,
    logits: Sequence[torch.Tensor],
    data: Sequence[engine_losses.LossDatum],
    config: Mapping[str, float] | None,
    *,
    unembed: torch.nn.Module | None = None,
) -> None:
    """``result.loss.backward()`` into ``optim``'s parameters, or EngineUserError (gradients
    unchanged) if the loss or the gradient it adds is not finite; a backward that fails
    midway (out of memory) also leaves the gradients as they were. ``logits`` and ``unembed``
    are what `compute_loss` got (hidden states with the model's head, or logits)."""
    loss = float(result.loss.detach())
    if not math.isfinite(loss):
        raise _refusal(f"the loss is {loss}", loss_fn, logits, data, config, unembed)
    before = optim.grads()
    try:
        result.loss.backward()
    except BaseException:  # some parameters' gradients were added, others not
        optim.restore_grads(before)
        raise
    if not optim.grads_finite():
        optim.restore_grads(before)
        raise _refusal(
            "the gradient is not finite (or its norm overflows float32)",
            loss_fn,
            logits,
            data,
            config,
            unembed,
        )


def nonfinite_datum(
    loss_fn: str,
    logits: Sequence[torch.Tensor],
    data: Sequence[engine_losses.LossDatum],
    config: Mapping[str, float] | None,
    unembed: torch.nn.Module | None = None,
) -> tuple[int, float]:
    """The datum whose own loss is non-finite (else the largest in magnitude), and that loss.
    Recomputes each datum alone: only called once a request is already being refused."""
    worst, worst_loss = 0, 0.0
    with torch.no_grad():
        for i, (z, d) in enumerate(zip(logits, data, strict=True)):
            one = engine_losses.compute_loss(loss_fn, [z.detach()], [d], config, unembed=unembed)
            value = float(one.loss)
            if not math.isfinite(value):
                return i, value
            if abs(value) > abs(worst_loss):
                worst, worst_loss = i, value
    return worst, worst_loss


LOSS_SCALES = frozenset({"kl_coeff", "beta"})
"""``loss_fn_config`` keys that multiply a loss's terms (stable_reinforce's KL, dro's penalty);
the clip thresholds bound a ratio and scale nothing."""


def _refusal(
    what: str,
    loss_fn: str,
    logits: Sequence[torch.Tensor],
    data: Sequence[engine_losses.LossDatum],
    config: Mapping[str, float] | None,
    unembed: torch.nn.Module | None,
) -> EngineUserError:
    i, value = nonfinite_datum(loss_fn, logits, data, config, unembed)
    coefficients = ""
    scaling = {k: v for k, v in (config or {}).items() if k in LOSS_SCALES}
    if scaling and math.isfinite(value):  # a finite loss, an overflowing gradient: its scale
        named = ", ".join(f"{k}={v:g}" for k, v in scaling.items())
        coefficients = f", or lower the loss_fn_config coefficients that scale it ({named})"
    return EngineUserError(
        f"forward_backward: {what}; datum {i} alone gives loss {value:g}. Nothing was "
        "accumulated and the model is unchanged. Scale that datum's loss inputs (weights, "
        f"advantages) down to a sane range{coefficients} and send it again"
    )
