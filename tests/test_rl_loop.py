"""A Tinker RL script, unchanged but for its import, learns on the embedded engine."""

from __future__ import annotations

import asyncio

import numpy as np

import tinker_sr as tinker
from tinker_sr import types

TARGET = set(b"0123456789")


def reward(tokens: list[int]) -> float:
    """Verifiable reward: fraction of sampled bytes that are digits."""
    return sum(t in TARGET for t in tokens) / max(1, len(tokens))


async def rl_loop(service_client: tinker.ServiceClient, steps: int) -> list[float]:
    training_client = await service_client.create_lora_training_client(
        "tinker-sr/tiny", rank=8, seed=0
    )
    tokenizer = training_client.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in ("count: ", "n=", "id ", "#")]
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=0, stop=[])
    history = []
    for step in range(steps):
        sampling_client = await training_client.save_weights_and_get_sampling_client(
            record_stability_info=True
        )
        futures = [
            sampling_client.sample(
                prompt=types.ModelInput.from_ints(p),
                num_samples=8,
                sampling_params=params.model_copy(update={"seed": step * 100 + i}),
            )
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*futures)
        data, rewards = [], []
        for p, res in zip(prompts, results, strict=True):
            rs = np.array([reward(s.tokens) for s in res.sequences])
            adv = rs - rs.mean()
            rewards.extend(rs.tolist())
            for s, a in zip(res.sequences, adv, strict=True):
                assert s.logprobs is not None and s.sequence_id
                full = p + s.tokens
                n_prompt = len(p) - 1
                datum = types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": [0.0] * n_prompt + s.logprobs,
                        "advantages": [0.0] * n_prompt + [float(a)] * len(s.tokens),
                    },
                )
                data.append(datum)
        history.append(float(np.mean(rewards)))
        fb = training_client.forward_backward(data, loss_fn="importance_sampling")
        op = training_client.optim_step(types.AdamParams(learning_rate=3e-2))
        fb_out, _ = await fb, await op
        assert "loss:sum" in fb_out.metrics
    return history


def test_tinker_style_rl_loop_learns_rewarded_behaviour(service: tinker.ServiceClient) -> None:
    history = asyncio.run(rl_loop(service, steps=12))
    start, end = np.mean(history[:3]), np.mean(history[-3:])
    assert end > start + 0.15, f"reward did not rise: {history}"
