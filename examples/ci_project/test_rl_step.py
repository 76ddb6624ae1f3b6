"""The RL step, tested offline: `tinker_mock` (from the tinker_sr pytest plugin) serves Tinker
in this process, so `tinker.ServiceClient()` needs no key, network, GPU or server."""

from __future__ import annotations

import tinker
from rl_step import QUESTION, rl_step

from tinker_sr.testing import rate_limited


def test_rl_step_trains_on_a_sampled_group(tinker_mock) -> None:
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client("Qwen/Qwen3-8B", rank=8, seed=0).result()
        stats = rl_step(training, group_size=4)
        tokenizer = training.get_tokenizer()

    assert stats.num_datums == 4 and 0.0 <= stats.mean_reward <= 1.0
    # What the code sent, read from the mock's trace:
    assert tinker_mock.trace.count("asample") == 1  # one batched request, not one per answer
    (sample,) = tinker_mock.trace.calls("asample")
    assert sample["request"]["num_samples"] == 4
    assert QUESTION in tokenizer.decode(sample["request"]["prompt"]["chunks"][0]["tokens"])
    (fb,) = tinker_mock.trace.calls("forward_backward")
    assert fb["request"]["loss_fn"] == "importance_sampling"
    assert len(fb["request"]["data"]) == 4
    assert tinker_mock.trace.count("optim_step") == 1


def test_rl_step_rides_out_a_rate_limit(tinker_mock) -> None:
    tinker_mock.add_fault(rate_limited("asample", retry_after=0.1))
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client("Qwen/Qwen3-8B", rank=8, seed=0).result()
        assert rl_step(training).num_datums == 4  # the SDK retried; our code saw nothing

    statuses = [c["status"] for c in tinker_mock.trace.calls("asample")]
    assert statuses == [429, 200]
