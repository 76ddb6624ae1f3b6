"""The official SDK's command line (``tinker``, from ``tinker==0.38.0``) manages checkpoints and
runs on a ``tinker-sr serve`` started here: list, info, set-ttl, publish, unpublish, delete,
download, run list / info and model list, with ``-f json`` output checked field by field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._server import ServerProcess, running_server

tinker = pytest.importorskip("tinker")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("cli") / "store") as srv:
        yield srv


@pytest.fixture(scope="module")
def run(server: ServerProcess) -> Iterator[dict[str, str]]:
    """One run with a training, a sampler and two external checkpoints."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    tc = service.create_lora_training_client(base_model="tinker-sr/tiny", rank=2).result()
    paths = {
        "run": tc.model_id,
        "state": tc.save_state("state").result().path,
        "sampler": tc.save_weights_for_sampler("sampler").result().path,
        "export": tc.save_weights_external("export").result().path,
        "doomed": tc.save_weights_external("doomed").result().path,  # deleted by a test
    }
    yield paths
    service.holder.close()


def cli(server: ServerProcess, *args: str, json_out: bool = True) -> Any:
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": server.api_key}
    fmt = ["-f", "json"] if json_out else []
    cmd = [sys.executable, "-m", "tinker.cli", *fmt, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"tinker {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout) if json_out and proc.stdout.strip() else proc.stdout


def test_checkpoints_are_listed_and_described(server: ServerProcess, run: dict[str, str]) -> None:
    listed = cli(server, "checkpoint", "list", "--run-id", run["run"])["checkpoints"]
    kinds = {c["tinker_path"]: c["checkpoint_type"] for c in listed}
    expected = {run["state"]: "training", run["sampler"]: "sampler", run["export"]: "external"}
    assert kinds.items() >= expected.items(), kinds
    assert all(c["size_bytes"] > 0 for c in listed)
    info = cli(server, "checkpoint", "info", run["state"])
    assert (info["tinker_path"], info["is_lora"], info["lora_rank"]) == (run["state"], True, 2)
    runs = cli(server, "run", "list")["runs"]
    assert run["run"] in {r["training_run_id"] for r in runs}
    described = cli(server, "run", "info", run["run"])
    assert described["base_model"] == "tinker-sr/tiny"
    assert described["last_checkpoint"]["tinker_path"] == run["state"]
    assert described["last_sampler_checkpoint"]["tinker_path"] == run["sampler"]
    models = {m["model_name"] for m in cli(server, "model", "list")["models"]}
    assert "tinker-sr/tiny" in models


def test_checkpoints_are_managed(server: ServerProcess, run: dict[str, str]) -> None:
    rest = tinker.RestClient(base_url=server.base_url, api_key=server.api_key)

    def checkpoint(path: str) -> Any:
        found = rest.list_checkpoints(run["run"]).result().checkpoints
        return next((c for c in found if c.tinker_path == path), None)

    cli(server, "checkpoint", "set-ttl", run["sampler"], "--ttl", "7200", json_out=False)
    assert checkpoint(run["sampler"]).expires_at is not None
    cli(server, "checkpoint", "publish", run["sampler"], json_out=False)
    assert checkpoint(run["sampler"]).public
    cli(server, "checkpoint", "unpublish", run["sampler"], json_out=False)
    assert not checkpoint(run["sampler"]).public
    assert checkpoint(run["doomed"]) is not None
    cli(server, "checkpoint", "delete", run["doomed"], "-y", json_out=False)
    assert checkpoint(run["doomed"]) is None


def test_a_training_checkpoint_downloads(
    server: ServerProcess, run: dict[str, str], tmp_path: Path
) -> None:
    cli(server, "checkpoint", "download", run["state"], "--output", str(tmp_path), json_out=False)
    [folder] = tmp_path.iterdir()
    assert {p.name for p in folder.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 2
