"""Clients across processes, as multi-process rollouts use them: a pickled sampler in a spawned
worker, and a forked child (multiprocessing's default start method on Linux)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from pathlib import Path
from typing import Any

import pytest

import tinker_sr as tinker
from tinker_sr import types

MODEL = "tinker-sr/tiny"
PROMPT = [5, 6, 7]
PARAMS = types.SamplingParams(max_tokens=4, seed=11, stop=[])


def _tokens(sampler: Any) -> list[int]:
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result(timeout=120)
    return list(out.sequences[0].tokens)


def _sample_pickled(blob: bytes) -> list[int]:
    return _tokens(pickle.loads(blob))


def test_a_pickled_remote_sampler_keeps_its_key_in_a_worker(
    remote_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its key passed as an argument, not in the environment. Before: the worker used its own
    default key, which the server took for another user: "404 unknown sampling_session_id".
    The official SDK's pickle carries the key too (a sampler handle does not)."""
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    service = tinker.ServiceClient(base_url=remote_server.base_url, api_key="tml-pickled-key")
    try:
        tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        assert "tml-pickled-key" not in sampler.get_sampler_handle()
        with mp.get_context("spawn").Pool(1) as pool:
            theirs = pool.apply(_sample_pickled, (pickle.dumps(sampler),))
        assert theirs == _tokens(sampler)
    finally:
        service.close().result()


def _in_forked_child(sampler: Any, conn: Any) -> None:
    try:
        try:
            _tokens(sampler)
            inherited = "sampled"
        except RuntimeError as e:
            inherited = str(e)
        service = tinker.ServiceClient()  # the embedded engine on $TINKER_SR_STORE
        fresh = _tokens(service.create_sampling_client(base_model=MODEL).result())
        conn.send((inherited, fresh))
    except BaseException as e:  # the parent reports it
        conn.send((repr(e), []))
    finally:
        conn.close()


def test_a_forked_child_gets_a_clear_error_or_fresh_clients_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every call in a forked child waited forever (on the parent's event-loop and
    engine threads, which a fork does not copy), even a new ServiceClient's."""
    monkeypatch.setenv("TINKER_SR_STORE", str(tmp_path))
    for name in ("TINKER_BASE_URL", "TINKER_SR_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    service = tinker.ServiceClient()
    try:
        sampler = service.create_sampling_client(base_model=MODEL).result()
        ours = _tokens(sampler)
        parent_end, child_end = mp.Pipe(duplex=False)
        child = mp.get_context("fork").Process(target=_in_forked_child, args=(sampler, child_end))
        child.start()
        child_end.close()
        assert parent_end.poll(120), "the forked child hung"
        inherited, fresh = parent_end.recv()
        child.join(30)
    finally:
        service.close().result()
    assert "made before the process forked" in inherited
    assert fresh == ours


def _child_writes(path: Path, k: int, conn: Any) -> None:
    from tinker_sr.engine.store import Store

    try:
        Store(path).add_session(f"child{k}", user_metadata=None, project_id=None, display_name=None)
        conn.send("ok")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(repr(e))
    finally:
        conn.close()


def test_children_forked_while_the_store_is_busy_open_it_again(tmp_path: Path) -> None:
    """A child forked while another thread was inside SQLite inherited its mutexes and lock
    records: its own connection to the same store hung or failed "database is locked" (12 of
    40 forks before; a new embedded ServiceClient in a fork pool's worker does this)."""
    import threading

    from tinker_sr.engine.store import Store

    path = tmp_path / "engine.sqlite"
    store, stop = Store(path), threading.Event()

    def busy() -> None:
        for i in range(10**9):
            if stop.is_set():
                return
            store.add_session(f"s{i}", user_metadata=None, project_id=None, display_name=None)

    writer = threading.Thread(target=busy)
    writer.start()
    outcomes = []
    try:
        for k in range(40):
            parent_end, child_end = mp.Pipe(duplex=False)
            child = mp.get_context("fork").Process(target=_child_writes, args=(path, k, child_end))
            child.start()
            child_end.close()
            outcomes.append(parent_end.recv() if parent_end.poll(20) else "hung")
            child.kill()
            child.join(10)
    finally:
        stop.set()
        writer.join(30)
    assert outcomes == ["ok"] * 40, [o for o in outcomes if o != "ok"][:3]
