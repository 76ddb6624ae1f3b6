"""Property: the engine answers any loss request or sampling parameters with a result (finite
where it must be) or an EngineUserError; and a refused training request leaves the model,
its gradients and its optimizer exactly as they were."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ
from tinker_sr import types
from tinker_sr.engine import sampler as engine_sampler
from tinker_sr.engine import training
from tinker_sr.engine.registry import ModelRegistry, Trainer
from tinker_sr.engine.store import Store
from tinker_sr.user_errors import EngineUserError

LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
N = 5


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    registry = ModelRegistry({}, sampler_dtype=torch.float32)
    spec = training.lora_spec(types.LoraConfig(rank=2, seed=0))
    model, optim = registry.new_trainable("tinker-sr/tiny", spec)
    return Trainer("s:train:0", "s", "tinker-sr/tiny", "tinker-sr/tiny", spec, model, optim)


def _state(t: Trainer) -> list[torch.Tensor]:
    grads = [g if g is not None else torch.zeros(0) for g in t.optim.grads()]
    return [p.detach().clone() for _, p in t.optim.params] + grads


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
columns = st.one_of(
    st.lists(floats, min_size=N, max_size=N),
    st.lists(st.floats(-3, 3, width=32), min_size=N, max_size=N),
    st.lists(floats, max_size=7),
)
targets = st.one_of(
    st.lists(st.integers(0, 258), min_size=N, max_size=N),
    st.lists(st.integers(-3, 400), min_size=1, max_size=7),
    st.lists(st.lists(st.integers(0, 258), min_size=2, max_size=2), min_size=N, max_size=N),
)
config_values = st.one_of(floats, st.text(max_size=3), st.integers(-5, 5))
configs = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta", "kl_coeff", "x"]),
        config_values,
        max_size=3,
    ),
)


@FUZZ
@given(
    loss_fn=st.sampled_from([*LOSSES, "nope"]),
    tt=targets,
    cols=st.dictionaries(
        st.sampled_from(["weights", "advantages", "logprobs", "sequence_ratio_mask"]), columns
    ),
    config=configs,
)
def test_forward_backward_answers_or_refuses_and_a_refusal_changes_nothing(
    trainer: Trainer, loss_fn: str, tt: Any, cols: dict[str, Any], config: Any
) -> None:
    try:
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
            loss_fn_inputs={"target_tokens": tt, **cols},
        )
    except (ValueError, TypeError, KeyError):
        return
    before = _state(trainer)
    try:
        out = training.forward_backward(trainer, Store(None), [datum], loss_fn, config, False)
    except EngineUserError:
        after = _state(trainer)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        return
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
    trainer.optim.zero_grad()


@FUZZ
@given(
    temperature=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
        [0.0, 1e-300, 5e-324, 1e-45, 1e-7, 1e-6, 1e-5, 1.0, 1e30])),
    top_p=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
        [1e-300, 1e-45, 1.0, 0.5])),
    top_k=st.integers(-3, 300),
    n=st.integers(-1, 3),
    max_tokens=st.integers(-1, 4),
)  # fmt: skip
def test_sampling_parameters_give_finite_logprobs_or_a_user_error(
    trainer: Trainer, temperature: float, top_p: float, top_k: int, n: int, max_tokens: int
) -> None:
    try:
        outs = engine_sampler.generate(
            trainer.model, [1, 2, 3], num_samples=n, max_tokens=max_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=0, stability_k=2,
        )  # fmt: skip
    except EngineUserError:
        return
    for o in outs:
        assert all(math.isfinite(lp) and lp <= 0 for lp in o.logprobs), o.logprobs
        assert o.draws is not None and np.all((o.draws >= 0) & (o.draws < 259))
