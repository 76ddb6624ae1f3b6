"""Clients dropped without ``close()``, as scripts and notebooks drop them: once the last
client of a session (the ServiceClient, its training, sampling and REST clients) is gone, the
session ends as "interrupted" and its trainers and samplers leave memory, as a server ends a
session whose SDK client stopped sending heartbeats. Before, the embedded engine (one per
process) kept every dropped client's models until the process exited."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tinker_sr as tinker
from tests._server import ServerProcess
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend

MODEL = "tinker-sr/tiny"


def _until(check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not released in time"
        gc.collect()
        time.sleep(0.05)


def _status(backend: LocalBackend, session_id: str) -> str | None:
    row = backend.store._db.execute(
        "SELECT status FROM sessions WHERE session_id=?", (session_id,)
    ).fetchone()
    return None if row is None else str(row[0])


def _train_and_sample(service: Any) -> tuple[Any, Any]:
    training = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2))
    return training, sampler


def test_a_dropped_session_ends_when_its_last_client_goes(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "store")
    try:
        service = tinker.ServiceClient(backend=backend)
        training, sampler = _train_and_sample(service)
        session_id = training.holder._session_id
        del service
        gc.collect()  # its training and sampling clients still use the session
        assert backend.models.stats()["trainers"] == 1
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        del training, sampler
        _until(lambda: backend.models.stats()["trainers"] == 0)
        _until(lambda: backend.models.stats()["samplers"] == 0)
        assert _status(backend, session_id) == "interrupted"
        # One closed before it is dropped keeps its own status, and nothing ends twice.
        service = tinker.ServiceClient(backend=backend)
        _train_and_sample(service)
        closed_id = service.holder._session_id
        service.close().result()
        del service
        gc.collect()
        assert _status(backend, closed_id) == "success"
    finally:
        backend.close()


def test_many_dropped_clients_leave_nothing_behind(tmp_path: Path) -> None:
    """200 short-lived clients each used for one step and dropped (a sweep in a notebook)
    held 200 trainers and samplers; now none outlive their clients."""
    backend = LocalBackend(tmp_path / "store")
    try:
        for _ in range(20):
            _train_and_sample(tinker.ServiceClient(backend=backend))
        _until(lambda: backend.models.stats()["trainers"] == 0)
        assert backend.models.stats()["samplers"] == 0
    finally:
        backend.close()


def test_a_dropped_remote_client_stops_its_heartbeats(remote_server: ServerProcess) -> None:
    """Through our remote client a dropped session's connection closes and its heartbeats
    stop (they ran until exit), so the server expires it once nothing uses it; it is not
    finished from the client, since a sampler handle in another process may still use it."""
    import httpx

    service = tinker.ServiceClient(base_url=remote_server.base_url, api_key="tml-test")
    training, sampler = _train_and_sample(service)
    session_id = training.holder._session_id
    handle = sampler.get_sampler_handle()
    backend = service.holder.backend
    assert backend._heartbeats  # type: ignore[attr-defined]
    del service, training, sampler
    _until(lambda: backend._closed and not backend._heartbeats)  # type: ignore[attr-defined]
    r = httpx.post(
        f"{remote_server.base_url}/api/v1/session_heartbeat",
        json={"session_id": session_id, "type": "session_heartbeat"},
        headers={"X-API-Key": "tml-test"},
    )
    assert r.status_code == 200, r.text  # still live on the server
    other = tinker.SamplingClient.from_sampler_handle(handle, api_key="tml-test")
    params = types.SamplingParams(max_tokens=2, seed=0)
    assert other.sample(types.ModelInput.from_ints([5, 6]), 1, params).result().sequences


def test_a_call_on_a_client_dropped_at_once_completes(remote_server: ServerProcess) -> None:
    """``RestClient(...).list_training_runs().result()``, as the SDK's deprecation message
    suggests writing it: the client is gone before its call ends, and the call must not see
    its session's connection closed ("RemoteBackend is closed")."""
    url = remote_server.base_url
    for _ in range(10):  # (not inside `assert`: pytest's rewriting would keep the client)
        runs = tinker.RestClient(base_url=url, api_key="tml-test").list_training_runs().result()
        assert runs.training_runs is not None
        caps = tinker.ServiceClient(base_url=url, api_key="tml-test").get_server_capabilities()
        assert caps.supported_models


def test_exiting_with_undropped_clients_prints_nothing(tmp_path: Path) -> None:
    """A script that ends holding clients it never closed exits cleanly (no finalizer noise
    at interpreter shutdown)."""
    script = (
        "import tinker_sr as tinker\n"
        "from tinker_sr import types\n"
        "from tests.test_dropped_clients import _train_and_sample\n"
        "kept = _train_and_sample(tinker.ServiceClient())\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
        env={**os.environ, "TINKER_SR_STORE": str(tmp_path / "store")},
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr == "", out.stderr


def test_clients_dropped_as_the_script_exits_let_it_exit_cleanly(tmp_path: Path) -> None:
    """Clients in a function's locals, dropped as it returns just before the interpreter exits
    (benchmarks/mixed_lengths.py): ending their session (`_end_dropped`) on the SDK loop's
    thread let go of the whole engine there while Python finalized, torch released the GIL
    inside a tensor's deallocation, and the thread, killed as it retook it, aborted the process
    (`terminate called without an active exception`, exit status 134) in 4 of 5 runs of that
    benchmark and 6 of 8 of this script. The ballast stands for a big model's many tensors."""
    script = (
        "import sys, torch\n"
        "import tinker_sr as tinker\n"
        "from tinker_sr.backend.local import LocalBackend\n"
        "from tinker_sr import types\n"
        "def main():\n"
        "    backend = LocalBackend(sys.argv[1])\n"
        "    backend.ballast = [torch.ones(1) for _ in range(200_000)]\n"
        "    service = tinker.ServiceClient(backend=backend)\n"
        "    training = service.create_lora_training_client('tinker-sr/tiny', rank=4).result()\n"
        "    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),\n"
        "        loss_fn_inputs={'target_tokens': [6, 7, 8], 'weights': [1.0, 1.0, 1.0]})\n"
        "    training.forward_backward([datum], 'cross_entropy').result()\n"
        "    print('ok')\n"
        "main()\n"
    )
    for i in range(3):
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / f"store{i}")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).parents[1],
        )
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
        assert out.stderr == "", out.stderr[-2000:]


def test_a_dropped_training_client_frees_its_model_after_its_calls(tmp_path: Path) -> None:
    """Within one live ServiceClient, a training client made per trial (a sweep, an eval
    harness) and dropped kept its adapters and optimizer state until the session ended: ~2.6
    MB per client on the tiny model, hundreds of MB on a real one. Now its model is freed once
    it is collected, and its calls still made then finish first."""
    from tinker_sr import types
    from tinker_sr.backend.local import LocalBackend

    backend = LocalBackend(tmp_path)
    service = tinker.ServiceClient(backend=backend)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4]},
    )
    try:
        kept = service.create_lora_training_client("tinker-sr/tiny", rank=4).result()
        for _ in range(5):
            tc = service.create_lora_training_client("tinker-sr/tiny", rank=32).result()
            fb = tc.forward_backward([datum], "cross_entropy")
            step = tc.optim_step(types.AdamParams(learning_rate=0.01))
            del tc  # dropped with its calls in flight
            gc.collect()
            assert fb.result().metrics["loss:sum"] > 0 and step.result() is not None
        gc.collect()
        kept.forward_backward([datum], "cross_entropy").result()  # after the releases queued
        assert backend.models.stats()["trainers"] == 1  # the kept one only
        assert kept.optim_step(types.AdamParams(learning_rate=0.01)).result() is not None
    finally:
        service.close().result()
        backend.close()
