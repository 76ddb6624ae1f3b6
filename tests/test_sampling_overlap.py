"""Sampling runs on its own thread: a sample request does not wait behind a training request
of the same model (issue 11, goal 7), and training keeps its seq_id order."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.engine import training
from tinker_sr.engine.lora import LoraSpec
from tinker_sr.engine.optim import AdamHParams
from tinker_sr.engine.registry import ModelRegistry, Sampler, snapshot
from tinker_sr.engine.sampler import DecodeGroup, generate

PROMPT = types.ModelInput.from_ints(list(b"overlap: "))
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
# Guards the test against hanging forever if sampling ever queues behind training again:
# the blocked training request then gives up and reports that it was never released.
DEADLOCK_GUARD_S = 120


async def _model_and_sampler(backend: LocalBackend) -> tuple[str, str]:
    session = await backend.create_session()
    model_id = await backend.create_model(
        session, 0, base_model="tinker-sr/tiny", lora_config=types.LoraConfig(rank=4, seed=0)
    )
    saved = await backend.save_weights_for_sampler(model_id, 1, sampling_session_seq_id=0)
    assert saved.sampling_session_id is not None
    return model_id, saved.sampling_session_id


def test_sample_completes_while_a_training_request_of_the_model_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampled = threading.Event()
    order: list[str] = []
    real = training.forward_backward

    def blocking_forward_backward(*args: Any, **kwargs: Any) -> Any:
        order.append("fb-start")
        released = sampled.wait(DEADLOCK_GUARD_S)
        order.append(f"fb-end released={released}")
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "forward_backward", blocking_forward_backward)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(b"abc")),
        loss_fn_inputs={"target_tokens": list(b"bcd"), "weights": [1.0, 1.0, 1.0]},
    )

    async def main() -> tuple[types.SampleResponse, types.ForwardBackwardOutput]:
        backend = LocalBackend(tmp_path)
        try:
            model_id, sampler_id = await _model_and_sampler(backend)
            fb = asyncio.ensure_future(
                backend.forward_backward(model_id, 2, [datum], "cross_entropy")
            )
            while not order:  # the training request holds the engine worker
                await asyncio.sleep(0.01)
            res = await backend.sample(
                sampler_id, 1, prompt=PROMPT, num_samples=2, sampling_params=PARAMS
            )
            order.append("sampled")
            sampled.set()
            return res, await fb
        finally:
            backend.close()

    res, fb_out = asyncio.run(main())
    assert order == ["fb-start", "sampled", "fb-end released=True"]
    assert len(res.sequences) == 2 and all(len(s.tokens) == 6 for s in res.sequences)
    assert fb_out.loss_fn_outputs


# A training datum and optimizer step shared by the out-of-order run and its in-order twin.
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints(list(b"abcdef")),
    loss_fn_inputs={"target_tokens": list(b"bcdefg"), "weights": [1.0] * 6},
)
ADAM = types.AdamParams(learning_rate=5e-2)


def test_training_keeps_seq_id_order_while_sampling(tmp_path: Path) -> None:
    """Training requests submitted out of order, interleaved with samples, run by seq_id."""

    async def main() -> list[float]:
        backend = LocalBackend(tmp_path)
        try:
            model_id, sampler_id = await _model_and_sampler(backend)
            calls = [
                backend.optim_step(model_id, 5, ADAM),
                backend.sample(sampler_id, 1, prompt=PROMPT, num_samples=2, sampling_params=PARAMS),
                backend.forward_backward(model_id, 4, [DATUM], "cross_entropy"),
                backend.optim_step(model_id, 3, ADAM),
                backend.sample(sampler_id, 2, prompt=PROMPT, num_samples=1, sampling_params=PARAMS),
                backend.forward_backward(model_id, 2, [DATUM], "cross_entropy"),
                backend.forward_backward(model_id, 6, [DATUM], "cross_entropy", forward_only=True),
            ]
            out = await asyncio.gather(*calls)
            return [float(out[i].metrics["loss:sum"]) for i in (5, 2, 6)]
        finally:
            backend.close()

    async def in_order() -> list[float]:
        backend = LocalBackend(tmp_path / "ref")
        try:
            model_id, _ = await _model_and_sampler(backend)
            losses = []
            for seq in (2, 3, 4, 5, 6):
                if seq % 2:
                    await backend.optim_step(model_id, seq, ADAM)
                else:
                    fb = await backend.forward_backward(
                        model_id, seq, [DATUM], "cross_entropy", forward_only=seq == 6
                    )
                    losses.append(float(fb.metrics["loss:sum"]))
            return losses
        finally:
            backend.close()

    got, want = asyncio.run(main()), asyncio.run(in_order())
    assert got == want
    assert got[0] != got[1] != got[2]  # each optimizer step changed the weights


def test_a_sampler_evicted_while_it_decodes_finishes_its_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session keeping one LoRA sampler evicts the decoding one when it makes the next: the
    decode holds its weights and finishes with exactly the result it has undisturbed."""
    monkeypatch.setenv("TINKER_SR_SAMPLERS_PER_SESSION", "1")
    params = types.SamplingParams(max_tokens=40, temperature=1.0, seed=3, stop=[])
    decoding, evicted_now = threading.Event(), threading.Event()
    receive = DecodeGroup.receive

    def held_receive(self: DecodeGroup, logits: torch.Tensor) -> None:
        if self.t == 5:  # mid-decode: wait until the test has evicted the sampler
            decoding.set()
            evicted_now.wait(DEADLOCK_GUARD_S)
        receive(self, logits)

    monkeypatch.setattr(DecodeGroup, "receive", held_receive)

    async def main(evict: bool) -> tuple[types.SampleResponse, list[str]]:
        backend = LocalBackend(tmp_path / str(evict))
        decoding.clear()
        evicted_now.clear()
        try:
            model_id, sampler_id = await _model_and_sampler(backend)
            task = asyncio.ensure_future(
                backend.sample(sampler_id, 1, prompt=PROMPT, num_samples=4, sampling_params=params)
            )
            await asyncio.get_running_loop().run_in_executor(None, decoding.wait, DEADLOCK_GUARD_S)
            if evict:
                await backend.save_weights_for_sampler(model_id, 2, sampling_session_seq_id=1)
            evicted_now.set()
            res = await task
            return res, [k for k in backend.models._samplers]
        finally:
            backend.close()

    undisturbed, _ = asyncio.run(main(False))
    evicted, live = asyncio.run(main(True))
    assert not any(k.endswith(":sample:0") for k in live)  # the decoding sampler was evicted
    assert [s.tokens for s in evicted.sequences] == [s.tokens for s in undisturbed.sequences]
    assert [s.logprobs for s in evicted.sequences] == [s.logprobs for s in undisturbed.sequences]


def test_adapters_on_base_sampler_never_reads_the_trainers_live_adapters() -> None:
    """Over the merged-weights budget a sampler decodes through adapters on the shared base:
    its own copy, so a training step meanwhile cannot change what it samples."""
    registry = ModelRegistry({}, merged_budget_bytes=0)
    spec = LoraSpec(rank=4, seed=0)
    model, optim = registry.new_trainable("tinker-sr/tiny", spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    registry.register_sampler(
        Sampler("p", "s", "tinker-sr/tiny", "tinker-sr/tiny", spec, None), snapshot(model)
    )
    sampling_model = registry.sampler("p").model
    assert registry.stats()["merged"] == 0  # the adapters-on-base path
    live = {p.data_ptr() for n, p in model.named_parameters() if "lora_" in n}
    assert not live & {p.data_ptr() for n, p in sampling_model.named_parameters() if "lora_" in n}

    def tokens(m: torch.nn.Module) -> list[list[int]]:
        outs = generate(m, [1, 2, 3], num_samples=3, max_tokens=12, seed=7)  # type: ignore[arg-type]
        return [o.tokens for o in outs]

    before = tokens(sampling_model)
    model(torch.tensor([[1, 2, 3, 4, 5]])).sum().backward()
    optim.step(AdamHParams(learning_rate=0.5))
    assert tokens(model) != before  # the trainer moved
    assert tokens(sampling_model) == before
    assert tokens(registry.sampler("p").model) == before


def test_listings_answer_while_a_training_step_runs(tmp_path: Path) -> None:
    """Found by a hunt (a shared server): checkpoint and run listings ran on the engine's
    worker, so they waited for any key's training step (15-20 s behind a large one). They
    read the store on a thread of their own; writes (delete, TTL) keep the worker's order."""
    busy, release = threading.Event(), threading.Event()

    async def main() -> tuple[int, int, bool]:
        backend = LocalBackend(tmp_path)
        try:
            model_id, _ = await _model_and_sampler(backend)
            step = asyncio.ensure_future(
                backend._run(lambda: (busy.set(), release.wait(DEADLOCK_GUARD_S))[1])
            )
            await asyncio.to_thread(busy.wait, 60)  # the worker is held, as by a long step
            runs = await asyncio.wait_for(backend.list_training_runs(), 30)
            checkpoints = await asyncio.wait_for(backend.list_user_checkpoints(), 30)
            await asyncio.wait_for(backend.get_training_run(model_id), 30)
            release.set()
            return len(runs.training_runs), len(checkpoints.checkpoints), await step
        finally:
            release.set()
            await backend.aclose()

    assert asyncio.run(main()) == (1, 0, True)  # one run; its sampler weights are not listed
