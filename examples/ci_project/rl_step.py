"""One RL step written against the official Tinker SDK: sample a group of answers to a chat
prompt, score them, and train on them with importance sampling.

Nothing here knows about tinker_sr: the same code runs against the hosted Tinker service,
against `tinker-sr serve`, or, in its tests, against the in-process mock (`tinker_mock`).
"""

from __future__ import annotations

from dataclasses import dataclass

import tinker
from tinker import types

QUESTION = "Name a fruit."


@dataclass
class StepStats:
    mean_reward: float
    num_datums: int
    loss: float


def reward(text: str) -> float:
    """Toy reward: the share of letters in the answer (real recipes grade the answer)."""
    return sum(c.isalpha() for c in text) / max(len(text), 1)


def chat_prompt(tokenizer: object, question: str) -> list[int]:
    """A Qwen-style chat prompt, built from the tokenizer's own special tokens."""
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]


def rl_step(
    training: tinker.TrainingClient,
    *,
    group_size: int = 4,
    max_tokens: int = 12,
    learning_rate: float = 1e-4,
    seed: int = 0,
) -> StepStats:
    tokenizer = training.get_tokenizer()
    prompt = chat_prompt(tokenizer, QUESTION)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, stop=[end_of_turn], seed=seed
    )
    samples = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=group_size, sampling_params=params
    ).result()

    rewards = [reward(tokenizer.decode(seq.tokens)) for seq in samples.sequences]
    baseline = sum(rewards) / len(rewards)
    datums = []
    for seq, r in zip(samples.sequences, rewards, strict=True):
        tokens = prompt + list(seq.tokens)
        n_prompt = len(prompt) - 1  # targets that are prompt tokens carry no advantage
        assert seq.logprobs is not None
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [r - baseline] * len(seq.tokens),
                },
            )
        )
    fb = training.forward_backward(datums, "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
    return StepStats(mean_reward=baseline, num_datums=len(datums), loss=fb.metrics["loss:sum"])


def main() -> None:
    service = tinker.ServiceClient()  # TINKER_BASE_URL / TINKER_API_KEY from the environment
    training = service.create_lora_training_client("Qwen/Qwen3-8B", rank=8).result()
    for step in range(3):
        print(step, rl_step(training, seed=step))


if __name__ == "__main__":
    main()
