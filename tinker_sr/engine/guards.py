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

__all__ = ["checked_backward", "nonfinite_datum"]


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
    unchanged) if the loss or the gradient it adds is not finite. ``logits`` and ``unembed``
    are what `compute_loss` got (hidden states with the model's head, or logits)."""
    loss = float(result.loss.detach())
    if not math.isfinite(loss):
        raise _refusal(f"the loss is {loss}", loss_fn, logits, data, config, unembed)
    before = optim.grads()
    result.loss.backward()
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


def _refusal(
    what: str,
    loss_fn: str,
    logits: Sequence[torch.Tensor],
    data: Sequence[engine_losses.LossDatum],
    config: Mapping[str, float] | None,
    unembed: torch.nn.Module | None,
) -> EngineUserError:
    i, value = nonfinite_datum(loss_fn, logits, data, config, unembed)
    return EngineUserError(
        f"forward_backward: {what}; datum {i} alone gives loss {value:g}. Nothing was "
        "accumulated and the model is unchanged. Scale that datum's loss inputs (weights, "
        "advantages) down to a sane range and send it again"
    )
