"""A model's training requests leave a remote client in seq_id order (`SubmitOrder`).

A server gives up a missing seq_id after a grace period so a refused request cannot hold a
model forever; a slow upload overtaken by the next call must therefore not happen on the client
side, or the next call runs first (an optim_step with no gradients) and the slow request is
refused when it lands. The official SDK submits one request after another; so must we.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from typing import Any

import pytest

from tinker_sr.backend.submit_order import SubmitOrder
from tinker_sr.testing import mock_tinker, slow_response

MODEL = "Qwen/Qwen3-8B"


def _pipelined_step(module_name: str, tmp_path: Any) -> tuple[Any, Any, Any]:
    """forward_backward (its upload held 1.5 s by the wire) then optim_step, both in flight,
    on a server that gives a missing number up after 0.3 s."""
    tinker = importlib.import_module(module_name)
    types = tinker.types
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
    )
    # after=1: the first forward_backward request is the `forward` below (forward_only).
    slow = slow_response("forward_backward", 1.5, after=1)
    with mock_tinker(store=tmp_path / module_name, seq_gap_grace_s=0.3, faults=[slow]) as mock:
        service = tinker.ServiceClient()
        try:
            tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
            tc.forward([datum], "cross_entropy").result(timeout=120)
            fb = tc.forward_backward([datum], "cross_entropy")
            op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
            fb_out, op_out = fb.result(timeout=120), op.result(timeout=120)
            after = tc.forward([datum], "cross_entropy").result(timeout=120)
            assert slow.fired == 1, mock.faults
        finally:
            with contextlib.suppress(Exception):
                service.close("success").result(timeout=30)
    return fb_out, op_out, after


def test_a_slow_upload_is_not_overtaken_by_the_call_after_it(tmp_path: Any) -> None:
    """Before: the optim_step arrived first, the server gave the forward_backward's number up
    after its grace, the step ran with grad_norm 0.0 and the forward_backward failed ("seq_id
    2 ... was already executed"). The official SDK's run of the same calls is the oracle."""
    fb, op, after = _pipelined_step("tinker_sr", tmp_path)
    sdk_fb, sdk_op, sdk_after = _pipelined_step("tinker", tmp_path)
    assert op.metrics["grad_norm:mean"] > 0
    assert op.metrics == sdk_op.metrics
    assert fb.metrics == sdk_fb.metrics
    assert after.metrics == sdk_after.metrics
    assert after.metrics["loss:sum"] < fb.metrics["loss:sum"]  # the step used the gradients


async def _submission_log(slow_seq: int, skipped: frozenset[int] = frozenset()) -> list[str]:
    order = SubmitOrder()
    log: list[str] = []

    async def request(seq: int) -> None:
        async with order.turn("m", seq):
            log.append(f"start {seq}")
            await asyncio.sleep(0.05 if seq == slow_seq else 0)
            if seq == 2:
                raise RuntimeError("refused")  # a failed submission frees its turn too
            log.append(f"sent {seq}")

    tasks = [asyncio.ensure_future(request(s)) for s in range(1, 6) if s not in skipped]
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order.waiting("m") == 0
    return log


def test_submissions_go_one_after_another_in_seq_order() -> None:
    log = asyncio.run(_submission_log(slow_seq=1))
    assert log == ["start 1", "sent 1", "start 2", "start 3", "sent 3", "start 4", "sent 4",
                   "start 5", "sent 5"]  # fmt: skip


def test_a_number_that_never_reaches_the_backend_holds_nothing_up() -> None:
    log = asyncio.run(_submission_log(slow_seq=3, skipped=frozenset({1, 4})))
    assert log == ["start 2", "start 3", "sent 3", "start 5", "sent 5"]


@pytest.mark.parametrize("cancelled", [True, False])
def test_a_cancelled_submission_frees_its_turn(cancelled: bool) -> None:
    async def main() -> list[int]:
        order = SubmitOrder()
        sent: list[int] = []
        gate = asyncio.Event()

        async def request(seq: int) -> None:
            async with order.turn("m", seq):
                if seq == 1:
                    await gate.wait()
                sent.append(seq)

        first = asyncio.ensure_future(request(1))
        second = asyncio.ensure_future(request(2))
        await asyncio.sleep(0.01)
        assert sent == []
        if cancelled:
            first.cancel()
        else:
            gate.set()
        await asyncio.gather(first, second, return_exceptions=True)
        return sent

    assert asyncio.run(main()) == ([2] if cancelled else [1, 2])
