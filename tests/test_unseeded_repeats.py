"""Under the offline mock, code that seeds nothing repeats bit for bit: a LoRA client created
without ``seed`` and samples without ``SamplingParams.seed`` are seeded from the mock's seed
(by the client's own order of sessions and requests, never the server's random ids), where
before each run drew them at random (tinker-cookbook 0.6.1's completers seed no sample, so its
recipes ran offline but differently each time). Randomness is kept: two samples of one prompt
still differ. ``seed_unseeded=None`` draws at random as the hosted service does."""

from __future__ import annotations

from typing import Any

import pytest

from tinker_sr.testing import mock_tinker

tinker = pytest.importorskip("tinker")

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _unseeded_run(**mock_options: Any) -> tuple[Any, ...]:
    """One step of an RL-shaped loop that seeds nothing, through the official SDK."""
    with mock_tinker(**mock_options):
        service = tinker.ServiceClient()
        tc = service.create_lora_training_client("Qwen/Qwen3-8B", rank=4).result()
        datum = tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(PROMPT[:-1]),
            loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 7},
        )
        loss = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = tinker.types.SamplingParams(max_tokens=12, temperature=1.0)
        prompt = tinker.types.ModelInput.from_ints(PROMPT)
        # A second sampler of the same weights (the RL loop's next step): its draws its own.
        other = tc.save_weights_and_get_sampling_client().result()
        first, second, third = (
            *(sampler.sample(prompt, 2, params) for _ in range(2)),
            other.sample(prompt, 2, params),
        )
        rows = tuple(tuple(s.tokens) for f in (first, second, third) for s in f.result().sequences)
    return loss, rows


def test_unseeded_code_repeats_under_the_mock_and_still_varies() -> None:
    once, again = _unseeded_run(), _unseeded_run()
    assert once == again
    _, rows = once
    assert len(set(rows)) == len(rows), rows  # every sample of the prompt its own draw


def test_the_mock_can_draw_unseeded_requests_at_random() -> None:
    runs = [_unseeded_run(seed_unseeded=None) for _ in range(2)]
    assert runs[0][0] != runs[1][0] or runs[0][1] != runs[1][1]
