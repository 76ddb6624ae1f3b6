"""Off-policy stress knobs of the embedded engine are real: stale weights, bfloat16 sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend

PROMPT = types.ModelInput.from_ints(list(b"stress test: abcdefgh"))


def sft(tc: tinker.TrainingClient) -> None:
    toks = list(b"stress test: abcdefgh")
    d = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
    )
    tc.forward_backward([d], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def scores(tc: tinker.TrainingClient) -> list[float | None]:
    return tc.save_weights_and_get_sampling_client().result().compute_logprobs(PROMPT).result()


def test_stale_sampler_uses_weights_k_steps_old(tmp_path: Path) -> None:
    fresh = tinker.ServiceClient(backend=LocalBackend(tmp_path / "a"))
    stale = tinker.ServiceClient(backend=LocalBackend(tmp_path / "b", sampler_staleness=2))
    a = fresh.create_lora_training_client("tinker-sr/tiny", rank=4, seed=0).result()
    b = stale.create_lora_training_client("tinker-sr/tiny", rank=4, seed=0).result()
    history = [scores(a)]
    for _ in range(3):
        sft(a)
        sft(b)
        history.append(scores(a))
    # After 3 steps the stale sampler serves the weights after step 1 (3 - 2).
    assert scores(b) == history[1]
    assert scores(b) != history[3]


def test_bfloat16_sampler_differs_slightly_from_the_float32_learner(tmp_path: Path) -> None:
    svc = tinker.ServiceClient(backend=LocalBackend(tmp_path, sampler_dtype="bfloat16"))
    tc = svc.create_lora_training_client("tinker-sr/tiny", rank=4, seed=0).result()
    sft(tc)
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seq = (
        sc.sample(PROMPT, 1, types.SamplingParams(max_tokens=8, seed=0, stop=[]))
        .result()
        .sequences[0]
    )
    from tinker_sr.provenance import build_datum

    out = tc.forward([build_datum(PROMPT, seq, 0.5)], "stable_reinforce").result()
    learner = np.array(out.loss_fn_outputs[0]["logprobs"].tolist()[PROMPT.length - 1 :])
    diff = np.abs(learner - np.array(seq.logprobs))
    assert diff.max() > 0 and diff.max() < 0.1
    assert out.metrics["kl_sampler_learner:mean"] != 0.0


def test_stress_options_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sampler_dtype"):
        LocalBackend(tmp_path, sampler_dtype="int8")
    with pytest.raises(ValueError, match="sampler_staleness"):
        LocalBackend(tmp_path, sampler_staleness=-1)
