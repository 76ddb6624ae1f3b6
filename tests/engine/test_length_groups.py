"""A forward_backward call of datums of very different lengths runs them in length groups, each
padded only to its own longest (`training.length_groups`), with the same outputs and
gradients as the same datums one per call."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tinker_sr import types
from tinker_sr.engine import model as model_mod
from tinker_sr.engine import training
from tinker_sr.engine.registry import ModelRegistry, Trainer
from tinker_sr.engine.store import Store


def _check_groups(lengths: list[int], slack: float) -> list[list[int]]:
    groups = training.length_groups(lengths, slack)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    longest = [max(lengths[i] for i in g) for g in groups]
    assert longest == sorted(longest, reverse=True)
    for g in groups:
        assert g == sorted(g)  # call order inside a group
        assert len(g) * max(lengths[i] for i in g) <= slack * sum(lengths[i] for i in g)
    return groups


def test_length_groups_partition_the_call_within_the_slack() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        lengths = rng.integers(1, 5000, n).tolist()
        slack = float(rng.choice([1.0, 1.1, 1.25, 2.0]))
        _check_groups(lengths, slack)
    assert _check_groups([256] * 16, 1.0) == [list(range(16))]  # equal lengths: one batch
    assert training.length_groups([14700, 36300, 1300, 1300]) == [[1], [0], [2, 3]]
    # A long datum among short ones: never padded together.
    assert training.length_groups([64, 2048, 60, 62]) == [[1], [0, 2, 3]]


def _trainer() -> Trainer:
    registry = ModelRegistry({}, sampler_dtype=torch.float32)
    spec = training.lora_spec(types.LoraConfig(rank=4, seed=0))
    model, optim = registry.new_trainable("tinker-sr/tiny", spec)
    with torch.no_grad():  # B non-zero, so every adapter factor has a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    return Trainer("s:train:0", "s", "tinker-sr/tiny", "tinker-sr/tiny", spec, model, optim)


def _data(lengths: list[int]) -> list[types.Datum]:
    gen = torch.Generator().manual_seed(0)
    data = []
    for n in lengths:
        row = torch.randint(0, 256, (n + 1,), generator=gen).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={
                    "target_tokens": row[1:],
                    "logprobs": [-1.0] * n,
                    "advantages": torch.linspace(-1, 1, n).tolist(),
                },
            )
        )
    return data


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_a_mixed_length_call_pads_each_group_only_and_matches_one_per_call(
    loss_fn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = [300, 40, 37, 8, 290]
    data = _data(lengths)
    shapes: list[tuple[int, int]] = []
    kept: list[int | None] = []
    forward = model_mod.Transformer.hidden_states

    def recorded(self: Any, tokens: torch.Tensor, **kw: Any) -> torch.Tensor:
        shapes.append(tuple(tokens.shape))  # type: ignore[arg-type]
        kept.append(kw.get("kept_tokens"))
        return forward(self, tokens, **kw)

    monkeypatch.setattr(model_mod.Transformer, "hidden_states", recorded)
    one = _trainer()
    together = training.forward_backward(one, Store(None), data, loss_fn, None, False)
    padded = sum(b * t for b, t in shapes)
    # Padding everything to 300 would run 1,500 tokens for these 675.
    assert sorted(shapes) == [(1, 8), (2, 40), (2, 300)], shapes
    assert padded <= training.PAD_SLACK * sum(lengths)
    assert kept == [padded] * len(shapes)  # the checkpointing policy sees the whole call

    each = _trainer()
    outputs = [
        training.forward_backward(each, Store(None), [d], loss_fn, None, False).loss_fn_outputs[0]
        for d in data
    ]
    for got, want in zip(together.loss_fn_outputs, outputs, strict=True):
        for key in want:
            torch.testing.assert_close(
                got[key].to_torch(), want[key].to_torch(), atol=1e-5, rtol=1e-5
            )
    grads = [(g, w) for g, w in zip(one.optim.grads(), each.optim.grads(), strict=True)]
    assert grads and all(g is not None and w is not None for g, w in grads)
    for g, w in grads:
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
