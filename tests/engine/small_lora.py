"""A LoRA training client on `tinker-sr/small` and a cross_entropy datum over given tokens:
the set-up the engine tests that compare two ways of running a step share."""

from __future__ import annotations

from collections.abc import Sequence

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend


def small_lora_client(
    backend: LocalBackend, tokens: Sequence[int]
) -> tuple[tinker.ServiceClient, tinker.TrainingClient, types.Datum]:
    service = tinker.ServiceClient(backend=backend)
    training = service.create_lora_training_client(
        base_model="tinker-sr/small", rank=4, seed=0
    ).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens[:-1])),
        loss_fn_inputs={"target_tokens": list(tokens[1:]), "weights": [1.0] * (len(tokens) - 1)},
    )
    return service, training, datum
