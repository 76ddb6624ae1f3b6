"""APIFuture semantics (spec §3): await, result, timeouts, caching, errors, back-compat future.

The futures under test wrap concurrent futures completed from another thread, the way the
clients complete them from their background event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from tinker_sr.futures import APIFuture, AwaitableConcurrentFuture, BackcompatConcurrentFuture
from tinker_sr.lib.public_interfaces import APIFuture as ReexportedAPIFuture
from tinker_sr.lib.public_interfaces import AwaitableConcurrentFuture as ReexportedACF
from tinker_sr.lib.retry_handler import RetryConfig, is_retryable_status_code


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """A background event loop, like the one the clients run backend coroutines on."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def submit(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> cf.Future[Any]:
    return asyncio.run_coroutine_threadsafe(coro, loop)


async def value_after(value: Any, delay: float = 0.0) -> Any:
    await asyncio.sleep(delay)
    return value


async def fail_after(exc: BaseException, delay: float = 0.0) -> Any:
    await asyncio.sleep(delay)
    raise exc


WRAPPERS: list[Callable[[cf.Future[Any]], APIFuture[Any]]] = [
    AwaitableConcurrentFuture,
    BackcompatConcurrentFuture,
]


@pytest.fixture(params=WRAPPERS, ids=lambda w: w.__name__)
def wrap(request: pytest.FixtureRequest) -> Callable[[cf.Future[Any]], APIFuture[Any]]:
    return request.param


def test_public_interfaces_reexports() -> None:
    assert ReexportedAPIFuture is APIFuture
    assert ReexportedACF is AwaitableConcurrentFuture


def test_api_future_is_abstract() -> None:
    with pytest.raises(TypeError):
        APIFuture()  # type: ignore[abstract]


def test_result_blocks_until_done_and_is_cached(loop_thread: Any, wrap: Any) -> None:
    fut = wrap(submit(loop_thread, value_after({"x": 1}, 0.05)))
    first = fut.result()
    assert first == {"x": 1}
    assert fut.result() is first
    assert fut.result(timeout=0) is first


def test_result_timeout_raises_timeout_error(wrap: Any) -> None:
    # The operation only finishes when the test says so (or the guard timer, 30 s on, does):
    # a result() that ignored its timeout would get the guard's value instead of raising.
    inner: cf.Future[Any] = cf.Future()
    guard = threading.Timer(30, lambda: inner.done() or inner.set_result("guard"))
    guard.start()
    try:
        fut = wrap(inner)
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.02)
        assert not inner.done()  # a sync timeout leaves the operation running
        inner.set_result(1)
        assert fut.result() == 1
    finally:
        guard.cancel()


def test_exceptions_are_re_raised_every_time(loop_thread: Any, wrap: Any) -> None:
    fut = wrap(submit(loop_thread, fail_after(ValueError("bad datum 3"))))
    with pytest.raises(ValueError, match="bad datum 3"):
        fut.result()
    with pytest.raises(ValueError, match="bad datum 3"):
        fut.result()
    with pytest.raises(ValueError, match="bad datum 3"):
        asyncio.run(fut.result_async())


def test_await_and_result_async(loop_thread: Any, wrap: Any) -> None:
    async def main() -> tuple[Any, Any]:
        a = wrap(submit(loop_thread, value_after("a", 0.01)))
        b = wrap(submit(loop_thread, value_after("b", 0.01)))
        return await a, await b.result_async()

    assert asyncio.run(main()) == ("a", "b")


def test_result_async_timeout_raises_and_cancels_operation(loop_thread: Any, wrap: Any) -> None:
    inner = submit(loop_thread, value_after(1, 5.0))
    fut = wrap(inner)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await fut.result_async(timeout=0.02)

    asyncio.run(main())
    deadline = time.monotonic() + 2
    while not inner.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inner.cancelled()


def test_waiting_does_not_block_the_callers_event_loop(wrap: Any) -> None:
    # The operation finishes only once the caller's loop has ticked three times while the
    # waiter awaits it, so the order is fixed without any timing. A waiter that blocked the
    # loop would stop the ticks; the guard timer then finishes the operation, and "done"
    # comes first (the test fails instead of hanging).
    inner: cf.Future[Any] = cf.Future()
    guard = threading.Timer(30, lambda: inner.done() or inner.set_result(None))
    guard.start()

    async def main() -> list[str]:
        order: list[str] = []

        async def ticker() -> None:
            for _ in range(3):
                await asyncio.sleep(0)
                order.append("tick")
            inner.set_result(None)

        async def waiter() -> None:
            await wrap(inner)
            order.append("done")

        await asyncio.gather(waiter(), ticker())
        return order

    try:
        assert asyncio.run(main()) == ["tick", "tick", "tick", "done"]
    finally:
        guard.cancel()


def test_coroutine_works_with_gather_and_create_task(loop_thread: Any, wrap: Any) -> None:
    async def main() -> list[Any]:
        futs = [wrap(submit(loop_thread, value_after(i, 0.01 * (3 - i)))) for i in range(3)]
        task = asyncio.create_task(futs[0].coroutine())
        gathered = await asyncio.gather(*(f.coroutine() for f in futs[1:]))
        return [await task, *gathered]

    assert asyncio.run(main()) == [0, 1, 2]


def test_future_returns_the_standard_future(loop_thread: Any, wrap: Any) -> None:
    inner = submit(loop_thread, value_after(7, 0.01))
    fut = wrap(inner)
    assert fut.future() is inner
    done, _ = cf.wait([fut.future()], timeout=2)
    assert inner in done and fut.result() == 7


def test_cancelling_future_cancels_the_operation(wrap: Any) -> None:
    inner: cf.Future[int] = cf.Future()
    fut = wrap(inner)
    assert fut.future().cancel()
    with pytest.raises(cf.CancelledError):
        fut.result()


def test_backcompat_future_is_a_concurrent_future_that_warns_once() -> None:
    inner: cf.Future[int] = cf.Future()
    fut = BackcompatConcurrentFuture(inner)
    assert isinstance(fut, cf.Future) and isinstance(fut, APIFuture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not fut.done()
        assert not fut.running()
        assert not fut.cancelled()
        inner.set_result(5)
        assert fut.done()
        assert fut.exception() is None
        assert fut.result() == 5
    assert [w.category for w in caught] == [FutureWarning]
    assert ".done()" in str(caught[0].message)


def test_backcompat_result_never_warns() -> None:
    inner: cf.Future[int] = cf.Future()
    inner.set_result(3)
    fut = BackcompatConcurrentFuture(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fut.result() == 3
        assert fut.future() is inner
        assert asyncio.run(fut.result_async()) == 3


def test_backcompat_state_mirrors_for_stdlib_machinery(loop_thread: Any) -> None:
    ok = BackcompatConcurrentFuture(submit(loop_thread, value_after("v", 0.02)))
    bad = BackcompatConcurrentFuture(submit(loop_thread, fail_after(KeyError("k"), 0.02)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        done, not_done = cf.wait([ok, bad], timeout=2)
        assert not_done == set()
        assert [f.result() for f in cf.as_completed([ok])] == ["v"]
        seen: list[Any] = []
        ok.add_done_callback(lambda f: seen.append(f))
        assert seen == [ok]
        assert isinstance(bad.exception(), KeyError)


def test_backcompat_cancel_propagates_both_ways() -> None:
    inner: cf.Future[int] = cf.Future()
    fut = BackcompatConcurrentFuture(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert fut.cancel()
        assert inner.cancelled() and fut.cancelled()
    other: cf.Future[int] = cf.Future()
    mirrored = BackcompatConcurrentFuture(other)
    other.cancel()
    assert cf.Future.cancelled(mirrored)


def test_retry_config_defaults_validation_and_hash() -> None:
    cfg = RetryConfig()
    assert cfg.max_connections == 1000
    assert (cfg.progress_timeout, cfg.retry_delay_base, cfg.retry_delay_max) == (7200.0, 0.5, 10.0)
    assert (cfg.jitter_factor, cfg.enable_retry_logic, cfg.enable_stuck_detection) == (
        0.25,
        True,
        True,
    )
    assert asyncio.TimeoutError in cfg.retryable_exceptions
    assert RetryConfig(max_connections=None).max_connections is None
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_connections"):
            RetryConfig(max_connections=bad)
    assert hash(RetryConfig()) == hash(RetryConfig())
    assert {RetryConfig(): 1}[RetryConfig()] == 1
    assert RetryConfig(jitter_factor=0.0) != RetryConfig()


def test_retryable_status_codes() -> None:
    assert all(is_retryable_status_code(s) for s in (408, 409, 429, 500, 503, 599))
    assert not any(is_retryable_status_code(s) for s in (400, 401, 402, 404, 410, 422))


def test_retry_config_fields_match_sdk() -> None:
    sdk = pytest.importorskip("tinker.lib.retry_handler")
    import dataclasses

    ours = [(f.name, f.default) for f in dataclasses.fields(RetryConfig)]
    theirs = [(f.name, f.default) for f in dataclasses.fields(sdk.RetryConfig)]
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    assert ours[:-1] == theirs[:-1]  # the exception tuple names package-specific classes
    assert [e.__name__ for e in ours[-1][1]] == [e.__name__ for e in theirs[-1][1]]


def test_an_error_nobody_waits_for_any_more_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The caller's future was cancelled (`asyncio.run` ending cancels what is left of a
    `gather` whose first error it raised), and the SDK loop's task ended in an error all the
    same (Python 3.11's `asyncio.wait_for` raises the inner call's error when a cancel meets
    it finishing). Before: "Task exception was never retrieved" and a traceback per call."""
    import gc

    from tinker_sr.clients.holder import submit

    started = threading.Event()

    async def fails() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise ValueError("nobody waits for this") from None

    fut = submit(fails())
    assert started.wait(10)
    assert fut.cancel()
    submit(asyncio.sleep(0.05)).result(timeout=10)  # the task has ended, in its error
    del fut  # the last reference to the task: asyncio reports an unseen error as it goes
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_blocking_in_a_running_loop_warns_except_in_a_notebook(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A creation future's ``.result()`` inside a running event loop blocks it: a warning names
    the caller, as the official SDK's does; not in a Jupyter kernel, whose cells run with a
    loop running and wait this way (the official SDK does not warn there either)."""
    import builtins

    from tinker_sr.clients.holder import blocking_result

    def wait_in_a_loop() -> int:
        async def main() -> int:
            fut: cf.Future[int] = cf.Future()
            threading.Timer(0.05, fut.set_result, (7,)).start()
            return blocking_result(fut)

        return asyncio.run(main())

    with caplog.at_level("WARNING", logger="tinker_sr"):
        assert wait_in_a_loop() == 7
    assert "Blocking call to .result() at " in caplog.text and __file__ in caplog.text

    class ZMQInteractiveShell:  # what `get_ipython()` returns in a Jupyter kernel
        pass

    monkeypatch.setattr(builtins, "get_ipython", ZMQInteractiveShell, raising=False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tinker_sr"):
        assert wait_in_a_loop() == 7
    assert "Blocking call" not in caplog.text
