"""A wall clock stepped back (NTP correcting a clock that ran ahead, a VM restored) while the
monotonic clock runs on, as the hunt for clock jumps did it: ``time.time`` moved by an
offset. Before, the server's quiet-session expiry and abandoned-sample cancellation stopped
for as long as the step, listings sorted the newest checkpoint and run oldest (a resume took
``checkpoints[-1]``, an older one), a sampler this process made was called one from before
its restart, ``tinker-sr usage`` hid what was recorded, and rows written while the clock ran
ahead outlived their time by the step (their purges throttled by the wall clock too).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

import tinker_sr
from tests.conftest import embedded_client
from tests.test_backpressure import _FakeBackend, _sample_body, _sampler, _server
from tinker_sr.server import create_app

DAY = 86_400.0
MODEL = "tinker-sr/tiny"


class _Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def step(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Clock]:
    real, c = time.time, _Clock()
    monkeypatch.setattr(time, "time", lambda: real() + c.offset)
    yield c


def test_quiet_sessions_expire_and_their_samples_stop_after_a_backward_step(
    clock: _Clock, tmp_path: Path
) -> None:
    backend = _FakeBackend()  # its sampling never finishes: the gate stays shut
    app = create_app(  # type: ignore[arg-type]
        backend, store_dir=tmp_path, session_timeout_s=0.6, sample_abandon_s=0.3,
        long_poll_s=0.05,
    )  # fmt: skip
    with TestClient(app, headers={"X-API-Key": "tml-x"}) as client:
        session = str(client.post("/api/v1/create_session", json={}).json()["session_id"])
        resp = client.post("/api/v1/asample", json=_sample_body(_sampler(client, session), 0))
        assert resp.status_code == 200, resp.text
        clock.step(-3600)  # and the client goes quiet
        deadline = time.monotonic() + 30
        while not backend.closed or _server(app).futures.pending_samples:
            assert time.monotonic() < deadline, "still waiting on a client that left"
            time.sleep(0.05)
        assert backend.closed == [(session, "interrupted")]
        assert not _server(app).futures.pending_samples


def test_listings_keep_creation_order_across_a_backward_step(clock: _Clock, tmp_path: Path) -> None:
    with embedded_client(tmp_path) as service:
        first = service.create_lora_training_client(base_model=MODEL, rank=2).result()
        first.save_state("step-100").result()
        clock.step(-120)
        first.save_state("step-200").result()
        second = service.create_lora_training_client(base_model=MODEL, rank=2).result()
        rest = tinker_sr.RestClient(service.holder)
        run = first.model_id
        names = [c.checkpoint_id for c in rest.list_checkpoints(run).result().checkpoints]
        assert names == ["weights/step-100", "weights/step-200"]
        mine = rest.list_user_checkpoints().result().checkpoints
        assert [c.checkpoint_id for c in mine] == ["weights/step-200", "weights/step-100"]
        runs = [r.training_run_id for r in rest.list_training_runs().result().training_runs]
        assert runs == [second.model_id, run]  # newest first
        last = rest.get_training_run(run).result().last_checkpoint
        assert last is not None and last.checkpoint_id == "weights/step-200"


def test_a_sampler_of_this_process_is_not_called_one_from_before_its_restart(
    clock: _Clock, tmp_path: Path
) -> None:
    from tinker_sr.server.state import ServerState

    state = ServerState(tmp_path / "server.sqlite")
    state.add_session("s", "o")
    state.add_sampler("before", "s", None)
    clock.step(-60)
    state.add_sampler("after-step", "s", None)
    assert not state.sampler_predates_start("before")
    assert not state.sampler_predates_start("after-step")
    state.close()

    clock.step(-60)  # the restart, the clock further back still
    state = ServerState(tmp_path / "server.sqlite")
    state.add_sampler("new", "s", None)
    assert state.sampler_predates_start("before") and state.sampler_predates_start("after-step")
    assert not state.sampler_predates_start("new")
    state.close()


def test_usage_recorded_before_a_backward_step_is_reported(
    clock: _Clock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from tinker_sr.cli import main
    from tinker_sr.engine.store import Store

    store = Store(tmp_path / "engine.sqlite")
    clock.step(30 * DAY)  # the clock runs a month ahead ...
    store.add_usage("sess", MODEL, {"training": 1000})
    clock.step(-30 * DAY)  # ... and is corrected
    store.add_usage("sess", MODEL, {"training": 500})
    store.close()
    assert main(["usage", "--store", str(tmp_path), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["training"] == 1500


def _record(sequence_id: str, now: float) -> Any:
    from tinker_sr.provenance.validate import SequenceRecord

    one = np.zeros(1, dtype=np.int32)
    return SequenceRecord(sequence_id, "sess", one, one, np.zeros(1, np.float32), None, now, now)


def test_rows_written_while_the_clock_ran_ahead_expire_in_time(
    clock: _Clock, tmp_path: Path
) -> None:
    """Written 30 days ahead, then the clock is corrected: each row lives one TTL from the
    correction, not 30 days more."""
    from tinker_sr.engine.store import Store
    from tinker_sr.provenance.validate import RECORD_TTL_SECONDS
    from tinker_sr.server.state import RESULT_TTL_S, ServerState

    store = Store(tmp_path / "engine.sqlite")
    state = ServerState(tmp_path / "server.sqlite")
    clock.step(30 * DAY)
    store.put_sequences([_record("ahead", time.time())])
    state.add_session("s", "o")
    assert state.add_future("r", owner="o", session_id="s", kind="Sample", dedupe_key=None,
                            body_hash=None, promise={})  # fmt: skip
    state.complete_future("r", "json", b"{}")
    clock.step(-30 * DAY)
    store.purge_expired_sequences(time.time() - RECORD_TTL_SECONDS)
    state.prune()
    assert store.get("ahead") is not None and state.get_future("r") is not None

    clock.step(max(RECORD_TTL_SECONDS, RESULT_TTL_S) + 60)
    store.purge_expired_sequences(time.time() - RECORD_TTL_SECONDS)
    state.prune()
    assert store.get("ahead") is None and state.get_future("r") is None
    store.close()
    state.close()


def test_expired_checkpoints_are_purged_after_a_backward_step(
    clock: _Clock, tmp_path: Path
) -> None:
    from tinker_sr.engine.checkpoint_store import CheckpointStore
    from tinker_sr.engine.store import CheckpointRow, Store

    store = Store(tmp_path / "engine.sqlite")
    checkpoints = CheckpointStore(store, tmp_path)
    checkpoints.purge_expired(every=0.05)
    clock.step(-DAY)
    path = checkpoints.file("run", "weights", "old")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x")
    store.put_checkpoint(
        CheckpointRow("run", "weights/old", "training", "tinker://run/weights/old",
                      checkpoints.relative(str(path)), time.time() - 10, 1, None,
                      time.time() - 1)
    )  # fmt: skip
    time.sleep(0.1)
    assert checkpoints.purge_expired(every=0.05) == 1
    assert not path.exists()
    store.close()
