"""A few supervised steps through a training client of either SDK, for tests that only need
to see a LoRA learn."""

from __future__ import annotations

from typing import Any


def cross_entropy_steps(
    training: Any, types: Any, ids: list[int], steps: int, lr: float
) -> list[float]:
    """`steps` forward_backward + optim_step rounds on one next-token datum over `ids`
    (`types` is the SDK's types module); the summed loss of each round."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    losses = []
    for _ in range(steps):
        out = training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(out.metrics["loss:sum"])
    return losses
