"""Server polish: asample backpressure (429, spec §8.3) and expiry of quiet sessions (§4.2).

In-process, over a fake backend whose sampling waits for a gate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tinker_sr import types
from tinker_sr.backend.remote import RemoteBackend
from tinker_sr.server import create_app
from tinker_sr.server.app import TinkerServer
from tinker_sr.wire import proto


class _FakeBackend:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sampled: list[int] = []
        self.closed: list[tuple[str, str]] = []
        self._sessions = 0

    async def create_session(self, **_: Any) -> str:
        self._sessions += 1
        return f"sess-{self._sessions}"

    async def create_sampling_session(
        self, session_id: str, sampling_session_seq_id: int, **_: Any
    ) -> str:
        return f"{session_id}:sample:{sampling_session_seq_id}"

    async def sample(
        self, sampler_id: str, seq_id: int, *, num_samples: int, **kw: Any
    ) -> types.SampleResponse:
        await self.gate.wait()
        self.sampled.append(seq_id)
        ids = kw.get("sequence_ids") or [f"s{i}" for i in range(num_samples)]
        return types.SampleResponse(
            sequences=[
                types.SampledSequence(
                    stop_reason="length",
                    sequence_id=ids[i],
                    tokens_np=np.array([7], dtype=np.int32),
                    logprobs_np=np.array([-0.5], dtype=np.float32),
                )
                for i in range(num_samples)
            ]
        )

    async def close_session(self, session_id: str, status: str, detail: str | None = None) -> None:
        self.closed.append((session_id, status))

    async def aclose(self) -> None:
        pass


def _server(app: Starlette) -> TinkerServer:
    server = app.state.tinker_server
    assert isinstance(server, TinkerServer)
    return server


def _sample_body(sampler: str, seq_id: int) -> dict[str, Any]:
    return {
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 1},
        "sampling_session_id": sampler,
        "seq_id": seq_id,
        "type": "sample",
    }


def _sampler(client: TestClient, session_id: str, seq: int = 0) -> str:
    resp = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session_id, "sampling_session_seq_id": seq, "base_model": "m"},
    )
    assert resp.status_code == 200, resp.text
    return str(resp.json()["sampling_session_id"])


@pytest.fixture
def backend() -> _FakeBackend:
    return _FakeBackend()


@pytest.fixture
def client(backend: _FakeBackend, tmp_path: Any) -> Iterator[TestClient]:
    app = create_app(backend, store_dir=tmp_path, long_poll_s=0.05, max_pending_samples=2)  # type: ignore[arg-type]
    with TestClient(app, headers={"X-API-Key": "tml-x"}) as c:
        yield c


def _wait_done(
    client: TestClient, promise: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    for _ in range(200):
        resp = client.post(
            "/api/v1/retrieve_future", json={"request_id": promise["request_id"]}, headers=headers
        )
        if resp.headers["content-type"] == "application/x-protobuf":
            return resp
        assert resp.json()["type"] == "try_again", resp.text
    raise AssertionError("sample never finished")


def test_asample_above_the_limit_is_429_and_records_nothing(
    client: TestClient, backend: _FakeBackend
) -> None:
    sid = client.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    sampler = _sampler(client, sid)
    first = [client.post("/api/v1/asample", json=_sample_body(sampler, i)) for i in (0, 1)]
    assert [r.status_code for r in first] == [200, 200]

    refused = client.post("/api/v1/asample", json=_sample_body(sampler, 2))
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert "limit is 2 per key" in refused.json()["detail"]
    state = _server(client.app).state  # type: ignore[arg-type]
    assert state.find_future(f"sample|{sampler}|seq_id 2") is None
    # An HTTP retry of an accepted request still gets its future while the server is full.
    assert client.post("/api/v1/asample", json=_sample_body(sampler, 0)).json() == first[0].json()
    # The limit is per API key: another key is not refused for this one's pending samples.
    other = {"X-API-Key": "tml-other"}
    sid2 = client.post("/api/v1/create_session", json={"tags": []}, headers=other).json()
    sampler2 = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": sid2["session_id"], "sampling_session_seq_id": 0, "base_model": "m"},
        headers=other,
    ).json()["sampling_session_id"]
    theirs = client.post("/api/v1/asample", json=_sample_body(sampler2, 0), headers=other)
    assert theirs.status_code == 200, theirs.text

    client.portal.call(backend.gate.set)  # type: ignore[union-attr]
    for r in first:
        _wait_done(client, r.json())
    _wait_done(client, theirs.json(), other)
    assert not _server(client.app).futures.pending_samples  # type: ignore[arg-type]
    again = client.post("/api/v1/asample", json=_sample_body(sampler, 2))
    assert again.status_code == 200, again.text  # the refused seq_id was not consumed
    got = proto.decode_sample_response(
        _wait_done(client, again.json()).content, again.json()["sample_sequence_ids"]
    )
    assert [s.tokens for s in got.sequences] == [[7], [7]]
    assert sorted(backend.sampled) == [0, 0, 1, 2]


def test_remote_backend_waits_and_resubmits_the_same_seq_id_on_429(
    backend: _FakeBackend, tmp_path: Any
) -> None:
    app = create_app(backend, store_dir=tmp_path, long_poll_s=0.05, max_pending_samples=1)  # type: ignore[arg-type]
    server = _server(app)

    async def main() -> None:
        async with app.router.lifespan_context(app):
            remote = RemoteBackend("http://asgi", "tml-x", transport=httpx.ASGITransport(app=app))
            sleeps: list[float] = []

            async def sleep(seconds: float) -> None:
                sleeps.append(seconds)
                backend.gate.set()  # the first sample finishes while the second waits
                while server._pending_samples:
                    await asyncio.sleep(0.01)

            remote._sleep = sleep  # type: ignore[method-assign]
            try:
                sid = await remote.create_session()
                sampler = await remote.create_sampling_session(sid, 0, base_model="m")
                params = types.SamplingParams(max_tokens=1)
                prompt = types.ModelInput.from_ints([1, 2])
                first = asyncio.create_task(
                    remote.sample(sampler, 0, prompt=prompt, num_samples=1, sampling_params=params)
                )
                while not server._pending_samples:
                    await asyncio.sleep(0.01)
                second = await remote.sample(
                    sampler, 1, prompt=prompt, num_samples=2, sampling_params=params
                )
                assert len((await first).sequences) == 1 and len(second.sequences) == 2
                assert sleeps[0] == 1.0  # Retry-After: 1
                assert sorted(backend.sampled) == [0, 1]
            finally:
                await remote.aclose()

    asyncio.run(main())


class _Clock:
    """``time`` for `tinker_sr.server.sessions`, its monotonic clock ``ahead`` seconds on."""

    ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_a_new_session_is_not_quiet_on_a_server_up_for_long(
    backend: _FakeBackend, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its creation is its first activity (review: after quiet time moved to the monotonic
    clock, a session made on a server up longer than the timeout counted quiet since the
    server started, and was finished at the next check, before its first heartbeat)."""
    from tinker_sr.server import sessions

    clock = _Clock()
    monkeypatch.setattr(sessions, "time", clock)
    app = create_app(backend, store_dir=tmp_path, session_timeout_s=60)  # type: ignore[arg-type]
    with TestClient(app, headers={"X-API-Key": "tml-x"}) as client:
        clock.ahead = 3600.0  # the server has been up an hour
        session = client.post("/api/v1/create_session", json={}).json()["session_id"]
        assert client.portal is not None
        client.portal.call(_server(app).sessions.expire_quiet)
        assert backend.closed == []
        clock.ahead += 61  # and now it is quiet
        client.portal.call(_server(app).sessions.expire_quiet)
        assert backend.closed == [(session, "interrupted")]


def test_quiet_sessions_expire_as_interrupted(
    backend: _FakeBackend, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A minute passes on the server's clock (moved, so that a busy machine cannot make the
    active sessions look quiet, as a 0.4 s timeout in real time did): the session with
    neither a heartbeat nor a request in it is finished; the others are not."""
    from tinker_sr.server import sessions

    clock = _Clock()
    monkeypatch.setattr(sessions, "time", clock)
    backend.gate.set()
    app = create_app(backend, store_dir=tmp_path, session_timeout_s=60)  # type: ignore[arg-type]
    with TestClient(app, headers={"X-API-Key": "tml-x"}) as client:

        def session() -> str:
            return str(client.post("/api/v1/create_session", json={}).json()["session_id"])

        beating, busy, quiet = session(), session(), session()
        quiet_sampler = _sampler(client, quiet)
        clock.ahead = 61.0
        hb = client.post(
            "/api/v1/session_heartbeat", json={"session_id": beating, "type": "session_heartbeat"}
        )
        assert hb.status_code == 200, hb.text
        _sampler(client, busy)  # requests count as activity too
        assert client.portal is not None
        client.portal.call(_server(app).sessions.expire_quiet)

        assert backend.closed == [(quiet, "interrupted")]
        hb = client.post("/api/v1/session_heartbeat", json={"session_id": quiet})
        assert hb.status_code == 410 and "expired" in hb.json()["detail"]
        for resp in (
            client.post("/api/v1/asample", json=_sample_body(quiet_sampler, 0)),
            client.post(
                "/api/v1/create_sampling_session",
                json={"session_id": quiet, "sampling_session_seq_id": 1, "base_model": "m"},
            ),
        ):
            assert resp.status_code == 400
            assert "expired after 60 s without a heartbeat or request" in resp.json()["detail"]
        busy_sampler = _sampler(client, busy, 1)
        assert client.post("/api/v1/asample", json=_sample_body(busy_sampler, 0)).status_code == 200
