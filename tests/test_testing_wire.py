"""Wire faults and traces of `mock_tinker`, against both clients: the official SDK (`tinker`)
and `tinker_sr` over HTTP. Each row of docs/testing.md's fault table is one case here."""

from __future__ import annotations

import contextlib
import importlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tinker_sr.provenance import build_datum
from tinker_sr.testing import (
    MockTinker,
    WireFault,
    connection_reset,
    future_stays_pending,
    http_error,
    mock_tinker,
    rate_limited,
    request_timeout,
    sequence_expired,
    session_expires,
    slow_response,
)

MODEL = "Qwen/Qwen3-8B"
PROMPT = [259, 117, 115, 101, 114, 10]  # "<|im_start|>user\n" in the offline tokenizer


def close(service: Any) -> None:
    """Finish the session so no heartbeat outlives the mock (an expired one may refuse)."""
    with contextlib.suppress(Exception):
        service.close("success").result(timeout=30)


@dataclass
class Clients:
    name: str
    tinker: Any  # the `tinker` or `tinker_sr` module
    service: Any
    training: Any
    sampler: Any


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockTinker]:
    with mock_tinker(store=tmp_path_factory.mktemp("mock")) as m:
        yield m


@pytest.fixture(scope="module", params=["tinker", "tinker_sr"])
def clients(request: pytest.FixtureRequest, mock: MockTinker) -> Iterator[Clients]:
    module = importlib.import_module(request.param)
    service = module.ServiceClient()
    training = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    yield Clients(request.param, module, service, training, sampler)
    close(service)


@pytest.fixture(autouse=True)
def _no_leftover_faults(mock: MockTinker) -> Iterator[None]:
    yield
    mock.faults.clear()


def _sample(c: Clients) -> Any:
    params = c.tinker.types.SamplingParams(max_tokens=3, seed=0)
    return c.sampler.sample(c.tinker.types.ModelInput.from_ints(PROMPT), 2, params).result(
        timeout=120
    )


def _forward_backward(c: Clients) -> Any:
    types = c.tinker.types
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 1.0, 1.0]},
    )
    return c.training.forward_backward([datum], "cross_entropy").result(timeout=120)


OPS: dict[str, Callable[[Clients], Any]] = {
    "sample": _sample,
    "forward_backward": _forward_backward,
}

# (fault, the call that meets it, the endpoint it hits, statuses seen there: None = no answer)
TRANSIENT: dict[str, tuple[Callable[[], WireFault], str, str, list[int | None]]] = {
    "429_retry_after": (lambda: rate_limited("asample", 0.1), "sample", "asample", [429, 200]),
    "500": (lambda: http_error("asample", 500), "sample", "asample", [500, 200]),
    "502": (lambda: http_error("forward_backward", 502), "forward_backward",
            "forward_backward", [502, 200]),
    "503_on_poll": (lambda: http_error("retrieve_future", 503), "forward_backward",
                    "retrieve_future", [503, 200]),
    "connection_reset": (lambda: connection_reset("asample"), "sample", "asample", [None, 200]),
    "request_timeout": (lambda: request_timeout("retrieve_future"), "forward_backward",
                        "retrieve_future", [None, 200]),
    "slow_response": (lambda: slow_response("forward_backward", 0.3), "forward_backward",
                      "forward_backward", [200]),
    "try_again_3x": (lambda: future_stays_pending(times=3), "sample", "retrieve_future",
                     [200, 200, 200, 200]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TRANSIENT))
def test_transient_fault_is_retried_transparently(
    case: str, clients: Clients, mock: MockTinker
) -> None:
    make, op, endpoint, statuses = TRANSIENT[case]
    start = len(mock.trace)
    fault = mock.add_fault(make())

    result = OPS[op](clients)  # no exception reaches the user's code

    assert result is not None and fault.fired == fault.times
    seen = [e for e in mock.trace.entries[start:] if e["endpoint"] == endpoint]
    assert [e["status"] for e in seen] == statuses
    assert seen[0]["fault"] == fault.name
    assert seen[-1]["fault"] is None or fault.kind == "slow"  # a slow answer is still the answer


def test_official_sdk_retries_429_and_5xx_and_the_trace_counts_them(
    clients: Clients, mock: MockTinker
) -> None:
    start = len(mock.trace)
    mock.add_fault(rate_limited("asample", retry_after=0.05, times=2))
    mock.add_fault(http_error("asample", 503, after=2, times=1))

    assert len(_sample(clients).sequences) == 2

    calls = [e for e in mock.trace.entries[start:] if e["endpoint"] == "asample"]
    assert [e["status"] for e in calls] == [429, 429, 503, 200]  # 3 retried requests
    assert [e["fault"] for e in calls] == ["http_429", "http_429", "http_503", None]
    # Every retry resubmitted the same request (same seq_id), so the server ran it once.
    assert len({e["request"]["seq_id"] for e in calls}) == 1
    assert all(e["duration_s"] >= 0 and e["started"] > 0 for e in calls)


def test_a_future_that_stays_pending_times_out_in_user_code(
    clients: Clients, mock: MockTinker
) -> None:
    fault = mock.add_fault(future_stays_pending(times=None))
    params = clients.tinker.types.SamplingParams(max_tokens=2, seed=0)
    future = clients.sampler.sample(clients.tinker.types.ModelInput.from_ints(PROMPT), 1, params)
    with pytest.raises(TimeoutError):
        future.result(timeout=1.0)
    assert fault.fired >= 1
    mock.faults.clear()
    assert len(future.result(timeout=120).sequences) == 1  # the work itself was done


def test_an_expired_sampling_session_is_a_bad_request(mock: MockTinker) -> None:
    for name in ("tinker", "tinker_sr"):
        module = importlib.import_module(name)
        service = module.ServiceClient()
        sampler = service.create_sampling_client(base_model=MODEL).result()
        mock.add_fault(session_expires("asample"))
        params = module.types.SamplingParams(max_tokens=2, seed=0)
        with pytest.raises(module.BadRequestError, match="expired"):
            sampler.sample(module.types.ModelInput.from_ints(PROMPT), 1, params).result(timeout=120)
        mock.faults.clear()
        close(service)
        calls = mock.trace.calls("asample")
        assert calls[-1]["status"] == 400 and calls[-1]["fault"] == "expire_session"


def test_an_expired_recorded_sequence_fails_the_training_request(
    clients: Clients, mock: MockTinker
) -> None:
    types = clients.tinker.types
    seq = _sample(clients).sequences[0]
    datum = build_datum(PROMPT, seq, 1.0, types=types)
    mock.add_fault(sequence_expired("forward_backward"))

    with pytest.raises(clients.tinker.RequestFailedError, match="expired") as failure:
        clients.training.forward_backward([datum], "importance_sampling").result(timeout=120)

    assert failure.value.category == types.RequestErrorCategory.User
    # The trace shows what the code sent: the datum carried provenance spans.
    (fb,) = [e for e in mock.trace.calls("forward_backward") if seq.sequence_id in str(e)]
    assert fb["fault"] == "expire_sequence"
    spans = fb["request"]["data"][0]["model_input_spans"]
    assert [next(iter(s)) for s in spans] == ["prompt_tokens", "sampled_tokens"]
    assert {s[k]["sequence_id"] for s in spans for k in s} == {seq.sequence_id}


def test_trace_is_jsonl_on_disk(clients: Clients, mock: MockTinker) -> None:
    from tinker_sr.testing import read_trace

    _forward_backward(clients)
    assert mock.trace.path is not None and Path(mock.trace.path).exists()
    on_disk = read_trace(mock.trace.path)
    assert 0 < len(on_disk) <= len(mock.trace)
    assert on_disk.calls("forward_backward")[-1]["request"]["loss_fn"] == "cross_entropy"


def test_sdk_rest_clients_made_in_a_mock_do_not_outlive_it(tmp_path: Path) -> None:
    """The official SDK caches ``RestClient()``'s connections by its arguments, not by the
    ``$TINKER_BASE_URL`` it read: without `fresh_sdk_rest_clients`, the next fixture's
    ``RestClient()`` would still talk to this mock's URL (tinker_sr/testing/sdk_state.py)."""
    tinker = pytest.importorskip("tinker")
    from tinker_sr.testing import mock_tinker

    with mock_tinker(store=tmp_path / "a"):
        inside = tinker.RestClient()
        assert inside.list_user_checkpoints().result().checkpoints == []
        assert tinker.RestClient().holder is inside.holder  # the SDK's sharing, within a block
    from tinker.lib.internal_client_holder import sessionless_holder_cache

    assert inside.holder not in sessionless_holder_cache._holders.values()


def test_clients_a_test_leaves_open_are_closed_with_its_mock(tmp_path: Path) -> None:
    """docs/testing.md's examples leave ServiceClients open. Before: they went on
    heartbeating (and flushing the SDK's telemetry) into the next mock at the same URL, whose
    trace then held another test's calls and whose planned faults fired on them."""
    import tinker as sdk

    import tinker_sr

    with mock_tinker(store=tmp_path / "first"):
        theirs = sdk.ServiceClient()
        theirs.create_lora_training_client(MODEL, rank=4, seed=0).result(timeout=120)
        ours = tinker_sr.ServiceClient()
        ours.create_lora_training_client(MODEL, rank=4, seed=0).result(timeout=120)
    heartbeat = theirs.holder._session_heartbeat_task
    assert heartbeat is not None and heartbeat.done()
    assert ours.holder.closed and not ours.holder.backend._heartbeats
    with mock_tinker(store=tmp_path / "second") as second:
        time.sleep(0.5)
        assert list(second.trace) == []


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: connection_reset("sample"), "'sample' matches no endpoint"),
        (lambda: connection_reset("/v1/asample"), "matches no endpoint"),
        (lambda: future_stays_pending(request_type="sample"), "request_type 'sample'"),
        (lambda: http_error("asample", "500"), "status must be an HTTP error code"),  # type: ignore[arg-type]
        (lambda: connection_reset(None), "endpoint must be an endpoint name"),  # type: ignore[arg-type]
        (lambda: connection_reset("asample", times="1"), "times must be an integer"),
        (lambda: rate_limited("asample", retry_after="1"), "retry_after must be a number"),  # type: ignore[arg-type]
        (lambda: slow_response("asample", -5), "delay_s must be a number"),
        (lambda: connection_reset("asample", after=0.5), "after must be an integer"),
        # Found by a hunt: accepted, counted as fired, and nothing happened.
        (lambda: http_error("asample", 503, request_type="Sample"), "only retrieve_future"),
        (lambda: session_expires("retrieve_future"), "names none"),
        (lambda: session_expires("sessions/*"), "names none"),  # ids in the path: never read
        (lambda: session_expires("/oai/api/v1/completions"), "names none"),
        (lambda: sequence_expired("asample"), "carries none"),
        (lambda: WireFault("asample", "try_again"), "answers retrieve_future polls"),
    ],
)
def test_a_wire_fault_that_could_not_fire_as_meant_is_refused(make: Any, needle: str) -> None:
    """Before: accepted; a misnamed endpoint never fired (the test passed untested), and a
    string retry_after or delay turned the fault into a dropped connection."""
    with pytest.raises((ValueError, TypeError), match=needle):
        make()
    # What each can do is still taken: the poll of a request type, any pattern reaching one.
    http_error("retrieve_future", 503, request_type="Sample")
    session_expires("*"), sequence_expired("forward_*"), WireFault("*", "try_again")
    session_expires("save_weights*"), session_expires("session_heartbeat")
    from tinker_sr.testing import wire

    assert wire._NAMES_A_SESSION <= set(wire.KNOWN_ENDPOINTS)  # each can be faulted


def test_fault_patterns_still_take_every_route_of_the_server(tmp_path: Path) -> None:
    """`wire.KNOWN_ENDPOINTS` (what a fault's endpoint is checked against) is the app's."""
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.server.app import create_app
    from tinker_sr.testing.adversary import route_table
    from tinker_sr.testing.wire import KNOWN_ENDPOINTS

    app = create_app(LocalBackend(tmp_path), store_dir=tmp_path, close_backend=True)
    routes = {
        re.sub(r"\{[^}]+\}", "x", p.removeprefix("/api/v1/"))
        for _, p in route_table(app)
        if "rest:path" not in p
    }
    assert routes == set(KNOWN_ENDPOINTS)
    for pattern in ("*", "sessions/*", "/api/v1/asample", "/oai/api/v1/completions"):
        connection_reset(pattern)  # accepted


def test_a_sync_client_inside_a_running_loop_is_served(mock: MockTinker) -> None:
    """A sync helper in an async test: before, a bare AssertionError from respx."""
    import asyncio

    import httpx

    async def main() -> int:
        return httpx.get(f"{mock.base_url}/api/v1/healthz").status_code

    assert asyncio.run(main()) == 200


def test_an_async_client_is_served_without_blocking_its_loop(mock: MockTinker) -> None:
    """Before the review's fix, the mock served async clients as sync ones: each request held
    the client's event loop (heartbeats, pipelined calls, a slow fault's neighbours)."""
    import asyncio

    import httpx

    mock.add_fault(slow_response("healthz", 1.0))

    async def main() -> tuple[int, int]:
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        async with httpx.AsyncClient() as client:
            status = (await client.get(f"{mock.base_url}/api/v1/healthz")).status_code
        done = time.monotonic()
        task.cancel()
        return status, sum(t < done for t in ticks)

    status, ticks_meanwhile = asyncio.run(main())
    assert status == 200
    assert ticks_meanwhile > 10  # blocked, the loop ticks once before the request, then not


def test_fault_endpoints_may_name_ids_in_the_parameters_places() -> None:
    for pattern in ("sessions/sess-1", "samplers/s1", "training_runs/*/checkpoints/weights/*"):
        connection_reset(pattern)  # accepted
