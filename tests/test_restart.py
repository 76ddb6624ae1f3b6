"""SIGKILL the server after acknowledged work; a restart on the same store keeps it usable."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._server import ServerProcess
from tinker_sr import errors, types
from tinker_sr.backend.remote import RemoteBackend
from tinker_sr.provenance import build_datum
from tinker_sr.wire import proto
from tinker_sr.wire import tinker_public_pb2 as pb

MODEL = "tinker-sr/tiny"
PROMPT = [7, 8, 9]
PROBE = types.Datum(
    model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
    loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
)


async def _before_crash(url: str) -> dict[str, Any]:
    backend = RemoteBackend(url, "tml-restart")
    session = await backend.create_session()
    model = await backend.create_model(
        session, 0, base_model=MODEL, lora_config=types.LoraConfig(rank=4, seed=1)
    )
    await backend.forward_backward(model, 1, [PROBE], "cross_entropy")
    await backend.optim_step(model, 2, types.AdamParams(learning_rate=0.02))
    state = await backend.save_state(model, 3, "st")
    probe = await backend.forward_backward(model, 4, [PROBE], "cross_entropy", forward_only=True)
    sampler = (
        await backend.save_weights_for_sampler(model, 5, sampling_session_seq_id=0)
    ).sampling_session_id
    assert sampler
    sample = await backend.sample(
        sampler,
        0,
        prompt=types.ModelInput.from_ints(PROMPT),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=4, seed=3),
        record_stability_info=True,
    )
    named = await backend.save_weights_for_sampler(model, 6, name="s1")
    await backend.aclose()
    return {
        "session": session,
        "model": model,
        "state": state.path,
        "named": named.path,
        "probe": probe.loss_fn_outputs[0]["logprobs"].tolist(),
        "seq": sample.sequences[0],
        "sampler": sampler,
    }


def _raw_forward(url: str, model: str, seq_id: int) -> tuple[str, bytes]:
    """Submit a forward over raw HTTP and wait for it: (request_id, result bytes)."""
    http = _http(url)
    body = proto.encode_forward_backward_request(
        model, seq_id, [PROBE], "cross_entropy", forward_only=True
    )
    rid = http.post(
        "/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}
    ).json()["request_id"]
    while True:
        resp = http.post("/retrieve_future", json={"request_id": rid})
        if resp.headers["content-type"] == "application/x-protobuf":
            return rid, resp.content
        assert resp.json().get("type") == "try_again", resp.text


def _retrieve_once_done(url: str, rid: str) -> httpx.Response:
    http = _http(url)
    while True:
        resp = http.post("/retrieve_future", json={"request_id": rid})
        assert resp.status_code == 200, resp.text
        if "json" not in resp.headers["content-type"] or resp.json().get("type") != "try_again":
            return resp


async def _after_restart(url: str, before: dict[str, Any]) -> None:
    backend = RemoteBackend(url, "tml-restart")
    session = before["session"]
    # The training state checkpoint: a new model from it computes the same logprobs.
    resumed = await backend.create_model_from_state(
        session, 1, path=before["state"], with_optimizer=True
    )
    probe = await backend.forward_backward(resumed, 1, [PROBE], "cross_entropy", forward_only=True)
    assert probe.loss_fn_outputs[0]["logprobs"].tolist() == before["probe"]
    # The sequence recorded before the crash still backs provenance spans.
    out = await backend.forward_backward(
        resumed, 2, [build_datum(PROMPT, before["seq"], 1.0)], "stable_reinforce"
    )
    assert "loss:sum" in out.metrics
    # Named sampler weights still sample.
    sampler = await backend.create_sampling_session(session, 7, model_path=before["named"])
    sample = await backend.sample(
        sampler,
        0,
        prompt=types.ModelInput.from_ints(PROMPT),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=2),
    )
    assert len(sample.sequences[0].tokens) <= 2
    listing = await backend.list_checkpoints(before["model"])
    assert {c.checkpoint_id for c in listing.checkpoints} == {"weights/st", "sampler_weights/s1"}
    # The crashed process's in-memory model is gone; using it fails at once (no hang), saying
    # why and how to resume (before: "unknown model_id ...; create a training client first",
    # and only once the accepted request had failed).
    with pytest.raises(errors.NotFoundError, match="restarted.*create_training_client_from"):
        await backend.forward_backward(before["model"], 8, [PROBE], "cross_entropy")
    # So is a sampling client's (before: "unknown sampling session ...; a session keeps the
    # weights of its 64 most recently used LoRA sampling clients", the wrong cause).
    with pytest.raises(errors.NotFoundError, match="created before the server restarted"):
        await backend.sample(
            before["sampler"],
            1,
            prompt=types.ModelInput.from_ints(PROMPT),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=2),
        )
    # RestClient.get_sampler on it says the same (before: the eviction message above)
    with pytest.raises(errors.NotFoundError, match="created before the server restarted"):
        await backend.get_sampler(before["sampler"])
    await backend.close_session(session, "success")
    await backend.aclose()


def _http(url: str, timeout: float = 60) -> httpx.Client:
    return httpx.Client(
        base_url=f"{url}/api/v1", headers={"X-API-Key": "tml-restart"}, timeout=timeout
    )


def _start_sample(
    http: httpx.Client, session: str, weights: dict[str, str], n: int, max_tokens: int
) -> str:
    """A new sampling session on ``weights`` (model_path or base_model) and an n x max_tokens
    sample started on it (no stop); the sample's request id."""
    sampler = http.post(
        "/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 3, **weights},
    ).json()["sampling_session_id"]
    return str(
        http.post(
            "/asample",
            json={
                "num_samples": n,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                "sampling_params": {"max_tokens": max_tokens, "stop": []},
                "sampling_session_id": sampler,
                "seq_id": 0,
            },
        ).json()["request_id"]
    )


def _sample_in_flight(url: str, before: dict[str, Any]) -> str:
    """Start a sample of 4 x 400 tokens on the named weights; its request id."""
    return _start_sample(_http(url), before["session"], {"model_path": before["named"]}, 4, 400)


def test_acknowledged_work_survives_a_sigkill(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "store")
    srv.start()
    try:
        before = asyncio.run(_before_crash(srv.base_url))
        rid, result = _raw_forward(srv.base_url, before["model"], 7)
        # A request that may still be running when the process dies.
        inflight = _sample_in_flight(srv.base_url, before)

        srv.kill()
        srv.start()

        # An acknowledged result is still there, byte for byte.
        resp = _retrieve_once_done(srv.base_url, rid)
        assert resp.content == result
        # The in-flight one resolved either way: its result, or a failure saying why.
        resp = _retrieve_once_done(srv.base_url, inflight)
        if "json" in resp.headers["content-type"]:
            assert resp.json()["category"] == "server" and "restarted" in resp.json()["error"]
        asyncio.run(_after_restart(srv.base_url, before))
    finally:
        srv.stop()


def test_a_second_server_on_a_live_store_is_refused(tmp_path: Path) -> None:
    """A second server's start-up would fail the first one's pending requests as left over
    from a crash while the first is still running them (and a client's resubmitted optim_step
    would then run twice), so it is refused, naming the server that holds the store."""
    import subprocess
    import sys

    from tinker_sr.server.state import ServerState
    from tinker_sr.server.store_lock import StoreInUseError

    srv = ServerProcess(tmp_path / "store")
    srv.start()
    try:
        before = asyncio.run(_before_crash(srv.base_url))
        inflight = _sample_in_flight(srv.base_url, before)
        second = subprocess.run(
            [sys.executable, "-m", "tinker_sr", "serve", "--store", str(srv.store), "--port", "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0, second.stdout + second.stderr
        assert srv.proc is not None
        assert f"in use by another tinker-sr server (pid {srv.proc.pid}" in second.stderr
        assert "--store DIR" in second.stderr and "Traceback" not in second.stderr
        with pytest.raises(StoreInUseError, match=f"pid {srv.proc.pid}"):
            ServerState(srv.store / "server.sqlite")
        # The first server's request was not failed as an orphan: it runs to its result.
        resp = _retrieve_once_done(srv.base_url, inflight)
        assert "json" not in resp.headers["content-type"], resp.text  # a result, not a failure
        assert len(pb.SampleResponse.FromString(resp.content).sequences) == 4
    finally:
        srv.stop()
    # Stopped, it no longer holds the store.
    ServerState(srv.store / "server.sqlite").close()


def test_a_graceful_stop_answers_open_long_polls(tmp_path: Path) -> None:
    """SIGTERM with a client long-polling a running request. Before: uvicorn waited for the
    poll (up to its 60 s here), cut it at 5 s with "Exception in ASGI application ...
    timeout graceful shutdown exceeded" in the log, and the client got no answer at all. Now
    the poll answers at once ("try again": the restarted server fails or finishes it)."""
    import signal
    import threading

    srv = ServerProcess(tmp_path / "store", long_poll_s=60.0)
    srv.start()
    try:
        http = _http(srv.base_url, timeout=90)
        session = http.post("/create_session", json={"tags": []}).json()["session_id"]
        # 16 x 500 tokens on tinker-sr/small: seconds of decoding
        rid = _start_sample(http, session, {"base_model": "tinker-sr/small"}, 16, 500)
        answers: list[httpx.Response] = []
        poll = threading.Thread(
            target=lambda: answers.append(http.post("/retrieve_future", json={"request_id": rid}))
        )
        poll.start()
        time.sleep(1.0)  # the poll is waiting on the server
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=60)
        poll.join(timeout=60)
        assert answers and answers[0].status_code == 200, answers
        assert answers[0].json()["type"] in ("try_again", "RequestFailedResponse"), answers[0].text
        assert "graceful shutdown exceeded" not in srv.log(), srv.log()
    finally:
        srv.stop()


async def _small_model(url: str) -> tuple[str, str]:
    backend = RemoteBackend(url, "tml-restart")
    session = await backend.create_session()
    model = await backend.create_model(
        session, 0, base_model="tinker-sr/small", lora_config=types.LoraConfig(rank=4, seed=1)
    )
    await backend.aclose()
    return session, model


def test_a_graceful_stop_keeps_the_result_of_the_request_running(tmp_path: Path) -> None:
    """SIGTERM while a training request runs and another waits behind it. Before: the stop
    waited for the running one, then threw its result away, so after the restart both failed
    as interrupted ("submit it again", though the first had run). Now the running one's result
    is recorded, and the waiting one is not started: it alone fails as interrupted."""
    import signal

    srv = ServerProcess(
        tmp_path / "store",
        env={"TINKER_SR_SLOW_REQUEST_S": "0.05"},
        extra_args=["--log-level", "info"],
    )
    srv.start()
    try:
        _, model = asyncio.run(_small_model(srv.base_url))
        http = _http(srv.base_url)
        ids = [i % 250 + 1 for i in range(512)]
        heavy = types.Datum(  # 8 x 512 tokens on tinker-sr/small: seconds of work
            model_input=types.ModelInput.from_ints(ids),
            loss_fn_inputs={"target_tokens": [i + 1 for i in ids], "weights": [1.0] * 512},
        )
        rids = []
        for seq_id in (1, 2):
            body = proto.encode_forward_backward_request(
                model, seq_id, [heavy] * 8, "cross_entropy", forward_only=False
            )
            resp = http.post(
                "/forward_backward",
                content=body,
                headers={"Content-Type": "application/x-protobuf"},
            )
            rids.append(resp.json()["request_id"])
        deadline = time.monotonic() + 120
        while f"{rids[0]} still running" not in srv.log():
            assert srv.proc is not None and srv.proc.poll() is None, srv.log()
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.02)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=120)
        stop_log = srv.log()
        srv.start()
        done = _retrieve_once_done(srv.base_url, rids[0])
        assert done.headers["content-type"] == "application/x-protobuf", done.text
        assert "loss:sum" in proto.decode_forward_backward_output(done.content).metrics
        waiting = _retrieve_once_done(srv.base_url, rids[1]).json()
        assert waiting["category"] == "server" and "restarted" in waiting["error"], waiting
        assert "waiting for the request in progress to finish" in stop_log, stop_log
    finally:
        srv.stop()


def test_a_call_during_the_stop_is_asked_to_retry_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once a graceful stop began (before uvicorn waits for open connections), a plain call
    that needs the engine (a sampler's creation, a query) was a 500 with a traceback in the
    log ("WorkNotStarted: the server is stopping"); it is a 503 the clients retry, and the
    restarted server answers them."""
    import logging

    from starlette.testclient import TestClient

    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.server import create_app

    app = create_app(LocalBackend(tmp_path / "store"), close_backend=True)
    with TestClient(app, headers={"X-API-Key": "tml-stop"}) as client:
        session = client.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        client.portal.call(app.state.tinker_server.begin_stop)
        with caplog.at_level(logging.ERROR, logger="tinker_sr"):
            resp = client.post(
                "/api/v1/create_sampling_session",
                json={"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL},
            )
        assert resp.status_code == 503, resp.text
        assert "the server is stopping" in resp.json()["detail"]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
