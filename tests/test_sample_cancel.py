"""Sample work nobody will read is stopped on the server: a request its client abandoned
(the official SDK's ``cancel_future``, sent because the server's dynamic config says
``sample_cancel_enabled``), the requests of a session its client finished, and those of a
session whose client went quiet (no heartbeat or request for ``sample_abandon_s``). Before,
each ran to its end: a client that exited left up to 64 requests per key decoding (35-72 s
of work in a hunt), its key refused with 429 meanwhile.

Each test holds the server's sampling worker behind a barrier, so the request is still
queued when it is abandoned; once the barrier lifts, no decode step may run for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tinker_sr.testing import mock_tinker
from tinker_sr.wire import messages as m

pytest.importorskip("tinker")

MODEL = "Qwen/Qwen3-8B"  # the offline chat model, in a mock
PROMPT = [1, 2, 3, 4]


def _wait(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextmanager
def _held_worker(mock: Any) -> Iterator[Any]:
    """The mock's sampling worker stopped until the block ends; yields its scheduler."""
    scheduler = mock.server().backend._scheduler
    release, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(60)

    scheduler.barrier(hold)
    entered.wait(30)
    try:
        yield scheduler
    finally:
        release.set()


def _failure(mock: Any, request_id: str) -> str:
    row = mock.server().state.get_future(request_id)
    assert row is not None and row.status == "failed", row
    return str(row.error)


def _only_sample_future(mock: Any) -> str:
    (call,) = mock.trace.calls("asample")
    return str(call["response"]["request_id"])


def _after_release(mock: Any, scheduler: Any) -> None:
    """No sample request is left, and none decoded once the worker was free again."""
    srv = mock.server()
    _wait(lambda: not srv.futures.pending_samples, "the pending samples to clear")
    time.sleep(0.3)  # a request that escaped cancellation would have prefilled by now
    assert list(scheduler.rows_per_step) == []
    assert not srv.backend._session_samples._pending  # nothing for close_session to wait for


def test_an_abandoned_official_sdk_sample_is_cancelled_on_the_server() -> None:
    import tinker

    with mock_tinker() as mock:
        svc = tinker.ServiceClient()
        sampler = svc.create_sampling_client(base_model=MODEL).result()
        polls = mock.faults.calls.get("retrieve_future", 0)
        with _held_worker(mock) as scheduler:
            future = sampler.sample(
                tinker.ModelInput.from_ints(PROMPT), 4, tinker.SamplingParams(max_tokens=64)
            )
            # The SDK sends cancel_future only for a request it is polling (a cancel while
            # the asample answer is still on its way is dropped), so wait for the first poll
            # to reach the server; the trace records a call only once it is answered.
            _wait(lambda: mock.faults.calls.get("retrieve_future", 0) > polls, "the first poll")
            future.future().cancel()  # the caller gives up on it
            _wait(lambda: mock.trace.count("cancel_future") == 1, "the SDK's cancel_future")
            rid = _only_sample_future(mock)
            _wait(lambda: not mock.server().futures.pending_samples, "the cancellation")
            assert "cancel_future" in _failure(mock, rid)
        _after_release(mock, scheduler)
        # The sampler serves on.
        again = sampler.sample(
            tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=3)
        )
        assert len(again.result(timeout=120).sequences) == 1
        svc.close("success").result(timeout=30)


def test_finishing_a_session_cancels_its_queued_samples() -> None:
    import tinker

    with mock_tinker() as mock:
        svc = tinker.ServiceClient()
        sampler = svc.create_sampling_client(base_model=MODEL).result()
        with _held_worker(mock) as scheduler:
            sampler.sample(
                tinker.ModelInput.from_ints(PROMPT), 4, tinker.SamplingParams(max_tokens=64)
            )
            _wait(lambda: mock.trace.count("asample") == 1, "the asample request")
            svc.close("success").result(timeout=30)
            rid = _only_sample_future(mock)
            _wait(lambda: not mock.server().futures.pending_samples, "the cancellation")
            assert "was finished (success)" in _failure(mock, rid)
        _after_release(mock, scheduler)


def _raw_client(mock: Any) -> httpx.Client:
    """A client that does only what a test tells it (no heartbeats), routed into the mock."""
    return httpx.Client(base_url=mock.base_url, headers={"X-API-Key": mock.api_key})


def test_a_quiet_sessions_samples_are_cancelled_and_the_session_lives_on() -> None:
    """A client that stops heartbeating and polling (it exited, or its machine slept): its
    requests are cancelled after ``sample_abandon_s``; the session is not finished (that
    takes ``session_timeout_s``), so a client that comes back samples again."""
    with mock_tinker(sample_abandon_s=0.5) as mock:
        http = _raw_client(mock)
        session, sampler = _session_and_sampler(http)
        with _held_worker(mock) as scheduler:
            promise = http.post("/api/v1/asample", json=_sample_body(sampler, 1)).json()
            # ... and nothing more from this client: after 0.5 s it counts as gone.
            _wait(lambda: not mock.server().futures.pending_samples, "the cancellation", 30)
            error = _failure(mock, promise["request_id"])
            assert "no heartbeat or request for 0.5 s" in error, error
        _after_release(mock, scheduler)
        assert mock.server().state.session(session["session_id"]).finished is None
        again = http.post("/api/v1/asample", json=_sample_body(sampler, 2)).json()
        reply = http.post("/api/v1/retrieve_future", json={"request_id": again["request_id"]})
        assert reply.status_code == 200 and "error" not in reply.text


def test_a_client_waiting_on_its_sample_is_not_quiet() -> None:
    """A long poll under way counts as its session's activity for as long as it waits: a
    client with no heartbeats polling a slow sample had it cancelled as abandoned while it
    waited (the poll counted only as it arrived; found as a flaky test on a busy machine)."""
    import concurrent.futures

    with mock_tinker(sample_abandon_s=1.5, long_poll_s=10.0) as mock:
        http, poller = _raw_client(mock), _raw_client(mock)
        session, sampler = _session_and_sampler(http)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with _held_worker(mock):
                promise = http.post("/api/v1/asample", json=_sample_body(sampler, 1)).json()
                body = {"request_id": promise["request_id"]}
                reply = pool.submit(poller.post, "/api/v1/retrieve_future", json=body)
                _wait(lambda: mock.faults.calls.get("retrieve_future", 0) == 1, "the poll")
                time.sleep(3.5)  # over twice the quiet limit, the poll waiting
                row = mock.server().state.get_future(promise["request_id"])
                assert row is not None and row.status == "pending", row
            answer = reply.result(timeout=60)
        assert answer.status_code == 200 and "error" not in answer.text, answer.text


def _future_row(store: Any, request_id: str) -> tuple[str, str | None]:
    """(status, error) of a server's future, read from its state file."""
    import sqlite3

    with sqlite3.connect(f"file:{store / 'server.sqlite'}?mode=ro", uri=True) as db:
        row = db.execute(
            "SELECT status, error FROM futures WHERE request_id=?", (request_id,)
        ).fetchone()
    return (str(row[0]), row[1]) if row is not None else ("unknown", None)


def test_a_client_that_hangs_up_its_poll_is_quiet_at_once(tmp_path: Any) -> None:
    """A client killed while its long poll waits (`kill -9`, a crash): its sample is cancelled
    ``sample_abandon_s`` after it went, not once the poll would have ended (a hunt: 26.7 s for
    a 3 s limit, its samples decoding meanwhile and every other key waiting). A real server
    (a socket that closes); its long poll is 10 minutes and the sample takes ~30 s here, so
    the old behaviour lets it complete."""
    import json
    import socket

    from tinker_sr.testing.server import running_server

    store = tmp_path / "store"
    flags = ["--sample-abandon-s", "1", "--long-poll-s", "600"]
    with running_server(store, extra_args=flags) as srv:
        http = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": "tml-gone"}, timeout=60)
        session = http.post("/api/v1/create_session", json=_session_body()).json()
        sampler = http.post(
            "/api/v1/create_sampling_session",
            json={"session_id": session["session_id"], "sampling_session_seq_id": 0,
                  "base_model": "tinker-sr/small", "type": "create_sampling_session"},
        ).json()  # fmt: skip
        body = _sample_body(sampler, 1)
        body.update(num_samples=64, sampling_params={"max_tokens": 500, "stop": []})
        request_id = http.post("/api/v1/asample", json=body).json()["request_id"]
        poll = json.dumps({"request_id": request_id}).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:  # its last poll
            sock.sendall(
                b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"X-API-Key: tml-gone\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(poll)}\r\n\r\n".encode()
                + poll
            )
            time.sleep(1.0)  # the poll waits; then the client is gone
        _wait(lambda: _future_row(store, request_id)[0] != "pending", "the request's end", 120)
        status, error = _future_row(store, request_id)
        assert status == "failed" and "no heartbeat or request for 1 s" in str(error), status


def test_cancel_future_refuses_training_requests_and_others_keys() -> None:
    with mock_tinker() as mock:
        http = _raw_client(mock)
        session = http.post("/api/v1/create_session", json=_session_body()).json()
        model = http.post(
            "/api/v1/create_model",
            json={"session_id": session["session_id"], "model_seq_id": 0, "base_model": MODEL,
                  "lora_config": {"rank": 4}, "type": "create_model"},
        ).json()  # fmt: skip
        training = http.post("/api/v1/cancel_future", json={"request_id": model["request_id"]})
        assert training.status_code == 400 and "only sample requests" in training.text
        other = http.post(
            "/api/v1/cancel_future",
            json={"request_id": model["request_id"]},
            headers={"X-API-Key": "tml-someone-else"},
        )
        assert other.status_code == 404
        unknown = http.post("/api/v1/cancel_future", json={"request_id": "req-nope"})
        assert unknown.status_code == 404
        flags = http.post("/api/v1/client/dynamic_config", json={"sdk_version": m.SDK_VERSION})
        assert flags.json()["sample_cancel_enabled"] is True


@pytest.mark.parametrize("when", ["polling", "answer_in_flight"])
def test_a_tinker_sr_remote_client_cancels_an_abandoned_sample_too(when: str) -> None:
    """Also when it is abandoned before the server's answer to ``asample`` arrived (the
    request reached the server, or will): it is cancelled once its id arrives, where the
    official SDK sends nothing and the work ran to its end."""
    import tinker_sr
    from tinker_sr.testing.wire import slow_response

    with mock_tinker() as mock:
        svc = tinker_sr.ServiceClient()  # TINKER_BASE_URL: the remote backend
        sampler = svc.create_sampling_client(base_model=MODEL).result()
        polls = mock.faults.calls.get("retrieve_future", 0)
        if when == "answer_in_flight":
            mock.add_fault(slow_response("asample", 1.0))
            started = lambda: mock.faults.calls.get("asample", 0) == 1  # noqa: E731
        else:
            started = lambda: mock.faults.calls.get("retrieve_future", 0) > polls  # noqa: E731

        async def abandon() -> None:
            params = tinker_sr.SamplingParams(max_tokens=64)
            prompt = tinker_sr.ModelInput.from_ints(PROMPT)

            async def sample() -> Any:
                return await sampler.sample(prompt, 4, params)

            task = asyncio.ensure_future(sample())
            await asyncio.to_thread(_wait, started, f"the sample request ({when})")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(
                _wait, lambda: mock.trace.count("cancel_future") == 1, "cancel_future"
            )

        with _held_worker(mock) as scheduler:
            asyncio.run(abandon())
            rid = _only_sample_future(mock)
            _wait(lambda: not mock.server().futures.pending_samples, "the cancellation")
            assert "cancel_future" in _failure(mock, rid)
        _after_release(mock, scheduler)
        svc.close("success").result(timeout=30)


def _session_and_sampler(http: httpx.Client) -> tuple[dict[str, Any], dict[str, Any]]:
    session = http.post("/api/v1/create_session", json=_session_body()).json()
    sampler = http.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session["session_id"], "sampling_session_seq_id": 0,
              "base_model": MODEL, "type": "create_sampling_session"},
    ).json()  # fmt: skip
    return session, sampler


def _session_body() -> dict[str, Any]:
    return {"tags": [], "user_metadata": None, "sdk_version": m.SDK_VERSION,
            "type": "create_session"}  # fmt: skip


def _sample_body(sampler: dict[str, Any], seq_id: int) -> dict[str, Any]:
    return {
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 8},
        "sampling_session_id": sampler["sampling_session_id"],
        "seq_id": seq_id,
        "type": "sample",
    }


def test_serve_takes_the_quiet_limits_from_its_flags(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--sample-abandon-s 0`` keeps a quiet session's samples for a client that polls
    later without heartbeats (review: there was no way to); ``--session-timeout-s`` beside
    it. The flags reach the app; what it does with them is tested above."""
    from tinker_sr import cli
    from tinker_sr.server import app

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def create_app(backend: Any, **options: Any) -> Any:
        seen.update(options)
        raise Stop  # before serving

    monkeypatch.setattr(app, "create_app", create_app)
    argv = ["serve", "--port", "0", "--store", str(tmp_path), "--sample-abandon-s", "0"]
    with pytest.raises(Stop):
        cli.main([*argv, "--session-timeout-s", "3600"])
    assert seen["sample_abandon_s"] is None and seen["session_timeout_s"] == 3600.0
    with pytest.raises(SystemExit):
        cli.main(["serve", "--sample-abandon-s", "-1"])


def test_a_server_that_did_not_run_counts_no_client_quiet_for_that_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's own loop stopped (as a SIGSTOPped or suspended server; here a blocking
    call on it, 2 s against a pause threshold set to 1 s) while its client's heartbeat waited
    to be read. Before: as it woke, the overdue check cancelled that live client's samples
    (and past the session timeout ended its session), blaming the client for the server's
    pause (hunt: a server stopped for 40 s)."""
    from tinker_sr.server import app

    monkeypatch.setattr(app, "_PAUSE_S", 1.0, raising=False)
    with mock_tinker(sample_abandon_s=0.5) as mock:
        http = _raw_client(mock)
        session, sampler = _session_and_sampler(http)
        sid = session["session_id"]
        with _held_worker(mock):
            promise = http.post("/api/v1/asample", json=_sample_body(sampler, 1)).json()

            async def stall() -> None:
                time.sleep(2)  # the whole event loop stops, as the process would

            mock._on_loop(stall())
            time.sleep(0.5)
            beat = {"session_id": sid, "type": "session_heartbeat"}
            assert http.post("/api/v1/session_heartbeat", json=beat).status_code == 200
            time.sleep(0.2)  # a quiet-session check runs meanwhile
            row = mock.server().state.get_future(promise["request_id"])
            assert row is not None and row.status == "pending", row
        reply = http.post("/api/v1/retrieve_future", json={"request_id": promise["request_id"]})
        assert reply.status_code == 200 and "error" not in reply.text, reply.text


def test_an_abandoned_sample_submit_is_not_retried() -> None:
    """A submit abandoned while its key is rate limited (429) stops retrying: the answer
    awaited to cancel the request (above) must not keep the request coming."""
    import tinker_sr
    from tinker_sr.testing.wire import rate_limited

    with mock_tinker() as mock:
        svc = tinker_sr.ServiceClient()
        sampler = svc.create_sampling_client(base_model=MODEL).result()
        mock.add_fault(rate_limited("asample", retry_after=0.3, times=None))

        async def abandon() -> int:
            task = asyncio.ensure_future(
                sampler.sample(
                    tinker_sr.ModelInput.from_ints(PROMPT),
                    1,
                    tinker_sr.SamplingParams(max_tokens=2),
                )
            )
            await asyncio.to_thread(
                _wait, lambda: mock.faults.calls.get("asample", 0) >= 2, "a retried asample"
            )
            task.cancel()
            tried = mock.faults.calls["asample"]
            await asyncio.sleep(1.5)  # five more retries' time
            return tried

        tried = asyncio.run(abandon())
        assert mock.faults.calls["asample"] <= tried + 1  # at most the attempt under way
        svc.close("success").result(timeout=30)


def test_closing_the_client_lets_an_abandoned_samples_cancel_reach_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sample abandoned while the answer to its ``asample`` is in flight, and the client
    closed at once: the cancel is sent once the id arrives, before the connections close.
    Before, closing cut it off and the server sampled for nobody."""
    import tinker_sr
    from tinker_sr.backend import transport
    from tinker_sr.backend.remote import RemoteBackend
    from tinker_sr.testing.wire import slow_response

    monkeypatch.setattr(transport, "CANCEL_GRACE_S", 30.0)  # a loaded machine's margin

    with mock_tinker() as mock:
        backend = RemoteBackend(base_url=mock.base_url, api_key="tml-close-test")
        svc = tinker_sr.ServiceClient(backend=backend)
        sampler = svc.create_sampling_client(base_model=MODEL).result()
        mock.add_fault(slow_response("asample", 1.0))

        async def abandon_and_close() -> None:
            task = asyncio.ensure_future(
                sampler.sample(tinker_sr.ModelInput.from_ints(PROMPT), 4,
                               tinker_sr.SamplingParams(max_tokens=64))
            )  # fmt: skip
            await asyncio.to_thread(
                _wait, lambda: mock.faults.calls.get("asample", 0) == 1, "the asample"
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await backend.aclose()

        with _held_worker(mock) as scheduler:
            svc.holder.run(abandon_and_close()).result(timeout=60)
            assert mock.trace.count("cancel_future") == 1
            rid = _only_sample_future(mock)
            _wait(lambda: not mock.server().futures.pending_samples, "the cancellation")
            assert "cancel_future" in _failure(mock, rid)
        _after_release(mock, scheduler)
