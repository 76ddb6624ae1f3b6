"""A few supervised steps through a training client of either SDK, for tests that only need
to see a LoRA learn."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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


def rl_datum_with_provenance(types: Any, prompt: list[int], seq: Any) -> Any:
    """An RL datum over `prompt` + the sampled sequence `seq` (advantage 1 on its tokens, 0 on
    the prompt's) with the provenance spans StableReinforce needs, built with `types` (the
    SDK's types module), as an RL script writes it by hand."""
    full = prompt + list(seq.tokens)
    n = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n + list(seq.logprobs),
            "advantages": [0.0] * n + [1.0] * len(seq.tokens),
        },
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens)),
        ],
    )


def assert_sampled_logprobs_are_the_learners(
    sampler: Any, types: Any, prompt: Any, num_samples: int, params: Any
) -> None:
    """Each sample's log-probabilities (and its sequence id) against `compute_logprobs` of the
    prompt plus the sample, to 1e-4: what the sampler reports is what the learner computes."""
    for seq in sampler.sample(prompt, num_samples, params).result().sequences:
        full = types.ModelInput.from_ints(prompt.to_ints() + list(seq.tokens))
        tail = sampler.compute_logprobs(full).result()[-len(seq.tokens) :]
        assert seq.logprobs is not None and seq.sequence_id is not None
        assert max(abs(a - b) for a, b in zip(tail, seq.logprobs, strict=True)) < 1e-4


def official_sdk_trains_and_samples(tinker: Any, base_url: str, base_model: str, text: str) -> None:
    """The official SDK against a server: a LoRA on `base_model` learns `text` in 3 steps, and
    a sampler of it gives the same 6 tokens twice for the same seed."""
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-test")
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    ids = training.get_tokenizer().encode(text)
    losses = cross_entropy_steps(training, tinker.types, ids, steps=3, lr=1e-2)
    assert losses[-1] < losses[0], losses
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tinker.types.ModelInput.from_ints(ids[:-2])
    params = tinker.types.SamplingParams(max_tokens=6, seed=1, stop=[])
    first = sampler.sample(prompt, 2, params).result().sequences
    again = sampler.sample(prompt, 2, params).result().sequences
    assert [s.tokens for s in first] == [s.tokens for s in again]  # same seed, same samples
    assert all(len(s.tokens) == 6 for s in first)
    service.close("success").result()


def learns_and_samples_as_the_learner(
    training: Any, types: Any, ids: list[int], *, max_tokens: int = 10
) -> list[float]:
    """Five supervised steps on `ids` lower the loss below 0.8x; then a sampler of the trained
    weights reports the learner's log-probabilities (`assert_sampled_logprobs_are_the_learners`,
    3 samples after all but the last two tokens). Returns the losses."""
    losses = cross_entropy_steps(training, types, ids, steps=5, lr=1e-2)
    assert losses[-1] < 0.8 * losses[0], losses
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = types.ModelInput.from_ints(ids[:-2])
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3, stop=[])
    assert_sampled_logprobs_are_the_learners(sampler, types, prompt, 3, params)
    return losses


@contextlib.contextmanager
def service_where_a_gap_hangs(way: str, store: Any) -> Iterator[Any]:
    """A tinker_sr ServiceClient on the embedded engine (``way="embedded"``) or through an
    in-process server whose seq_id grace period is 600 s (``"remote"``), so a training request
    that leaves a gap in its model's seq_ids holds the next one long enough to fail a test."""
    import tinker_sr
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.testing import mock_tinker

    with contextlib.ExitStack() as stack:
        if way == "remote":
            stack.enter_context(mock_tinker(store=store, seq_gap_grace_s=600.0))
            yield tinker_sr.ServiceClient()
        else:
            yield tinker_sr.ServiceClient(backend=LocalBackend(store))
