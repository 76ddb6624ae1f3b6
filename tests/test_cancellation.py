"""A caller that stops waiting (``asyncio.wait_for`` timing out, a cancelled task) does not
undo a training request it already made: as on a Tinker server, the request runs in its
turn, and the model's later requests run after it. Before: on the embedded engine, cancelling
the wait for a request still queued behind earlier ones dropped its sequence number, and
every later request of the model waited forever."""

from __future__ import annotations

import asyncio

import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.ordering import SeqOrdering

MODEL = "tinker-sr/tiny"
IDS = list(range(1, 60))
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints(IDS),
    loss_fn_inputs={"target_tokens": IDS, "weights": [1.0] * len(IDS)},
)


async def _grad_norm(service: tinker.ServiceClient, abandon: bool) -> float:
    tc = await service.create_lora_training_client_async(MODEL, rank=4, seed=3)
    await tc.forward_backward_async([DATUM], "cross_entropy")
    queued = await tc.forward_backward_async([DATUM], "cross_entropy")  # behind `first`
    if abandon:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(queued, 0.001)
    last = await tc.forward_backward_async([DATUM], "cross_entropy")
    await asyncio.wait_for(last, 120)
    step = await asyncio.wait_for(
        await tc.optim_step_async(types.AdamParams(learning_rate=1e-3)), 120
    )
    return float(step.metrics["grad_norm:mean"])


def test_an_abandoned_wait_neither_drops_nor_blocks_the_request(
    service: tinker.ServiceClient,
) -> None:
    """All three backward passes count (the abandoned one included), and nothing hangs."""
    abandoned = asyncio.run(_grad_norm(service, abandon=True))
    awaited = asyncio.run(_grad_norm(service, abandon=False))
    assert abandoned == awaited


def test_a_cancelled_sample_leaves_the_sampler_serving(service: tinker.ServiceClient) -> None:
    async def run() -> int:
        tc = await service.create_lora_training_client_async(MODEL, rank=4)
        sampler = await tc.save_weights_and_get_sampling_client_async()
        prompt = types.ModelInput.from_ints(IDS[:5])
        task = asyncio.ensure_future(
            sampler.sample_async(prompt, 8, types.SamplingParams(max_tokens=400, stop=[]))
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Longer than the cancelled one: before, when that one finished, the sampling thread
        # died setting its cancelled future, and this one never finished.
        again = sampler.sample_async(prompt, 2, types.SamplingParams(max_tokens=450, stop=[]))
        return len((await asyncio.wait_for(again, 120)).sequences)

    assert asyncio.run(run()) == 2


def test_seq_ordering_runs_a_number_whose_caller_was_cancelled() -> None:
    async def run() -> list[int]:
        ordering, ran = SeqOrdering(), []
        ordering.add("m")
        gate = asyncio.Event()

        async def work(n: int) -> int:
            if n == 1:
                await gate.wait()
            ran.append(n)
            return n

        one = asyncio.ensure_future(ordering.run("m", 1, lambda: work(1)))
        two = asyncio.ensure_future(ordering.run("m", 2, lambda: work(2)))
        await asyncio.sleep(0)
        two.cancel()  # its caller gives up while it waits for 1
        gate.set()
        assert await one == 1
        assert await asyncio.wait_for(ordering.run("m", 3, lambda: work(3)), 5) == 3
        return ran

    assert asyncio.run(run()) == [1, 2, 3]


def test_seq_ordering_stopped_starts_nothing_more_but_finishes_the_running_one() -> None:
    """A server's shutdown (`stop_starting`): the request running finishes; one waiting its
    turn, and one waiting for a number that never arrives (3 behind a missing 2), end at once
    with `WorkNotStarted` instead of running or holding the shutdown."""
    from tinker_sr.backend.base import WorkNotStarted

    async def run() -> list[int]:
        ordering, ran = SeqOrdering(), []
        ordering.add("m")
        gate, started = asyncio.Event(), asyncio.Event()

        async def work(n: int) -> int:
            if n == 1:
                started.set()
                await gate.wait()
            ran.append(n)
            return n

        one = asyncio.ensure_future(ordering.run("m", 1, lambda: work(1)))
        after_gap = asyncio.ensure_future(ordering.run("m", 3, lambda: work(3)))
        await started.wait()
        await ordering.stop_starting()
        with pytest.raises(WorkNotStarted):
            await asyncio.wait_for(after_gap, 5)
        gate.set()
        assert await one == 1
        with pytest.raises(WorkNotStarted):
            await asyncio.wait_for(ordering.run("m", 2, lambda: work(2)), 5)
        return ran

    assert asyncio.run(run()) == [1]
