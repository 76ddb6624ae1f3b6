"""What a training step's forward really keeps for backward, beside the engine's estimate.

`model.activation_bytes` is what the automatic activation checkpointing decides on
(`model.checkpoint_pays`): an estimate under the real size lets a long datum run out of memory
instead of checkpointing. `counting_saved_activations` counts, for each ``forward_backward``
(or ``forward``) the embedded engine runs while it is open, every tensor autograd saves during
the model's forward (saved-tensor hooks; weights left out; each storage once), beside the
estimate for the same call. Used by tests/engine/test_activation_estimate.py and
benchmarks/activation_estimate.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["counting_saved_activations"]


@contextlib.contextmanager
def counting_saved_activations() -> Iterator[dict[str, int]]:
    """Yields a dict that each engine training call made inside the block fills with "saved"
    (bytes autograd saved for backward during the model's forward) and "estimate"
    (`model.activation_bytes` for the call's padded tokens); the last call's values win."""
    import torch

    from tinker_sr.engine import model as model_mod
    from tinker_sr.engine import training

    counted: dict[str, int] = {}
    hidden_rows = training._hidden_rows

    def counting(model: Any, batch: Any, groups: Any, kept: int) -> Any:
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}
        alive = []  # no storage freed (and its address reused) while counting

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            alive.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = hidden_rows(model, batch, groups, kept)
        counted["saved"] = sum(saved.values())
        counted["estimate"] = model_mod.activation_bytes(model.config, kept, model.device)
        return out

    training._hidden_rows = counting  # type: ignore[assignment]  # read per call
    try:
        yield counted
    finally:
        training._hidden_rows = hidden_rows  # type: ignore[assignment]
