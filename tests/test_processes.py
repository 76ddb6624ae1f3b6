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
