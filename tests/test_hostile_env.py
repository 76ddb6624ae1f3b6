"""What users' machines have in their environment (a hunt): proxy variables, warnings as
errors, an API key read from a file with its newline, an upper-case URL scheme."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tinker_sr
from tinker_sr.backend.transport import WireTransport, is_loopback_url
from tinker_sr.errors import TinkerError
from tinker_sr.testing import ServerProcess, http_error, tinker_server_process

DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing answers there


@pytest.fixture
def dead_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every proxy variable points at a port where nothing answers, with no $NO_PROXY: a
    company machine or CI runner whose proxy cannot reach this machine's loopback."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, DEAD_PROXY)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_clients_of_a_local_server_go_around_the_proxy(
    dead_proxy: None, remote_server: Any
) -> None:
    """Before: each call went to the proxy, then after ~58 s of retries "Connection error."."""
    rest = tinker_sr.RestClient(base_url=remote_server.base_url, api_key="tml-test")
    assert rest.get_server_capabilities().result().supported_models
    assert is_loopback_url("http://localhost:1") and is_loopback_url("http://[::1]:8000")
    assert is_loopback_url("http://127.0.0.2:80/") and not is_loopback_url("https://example.com")


def test_the_testing_server_starts_and_serves_the_official_sdk_behind_a_proxy(
    dead_proxy: None, tmp_path: Path
) -> None:
    """Before: the fixture's readiness check went to the proxy, and the server "did not answer
    healthz within 120 s"; its fault controls did too. The official SDK's clients, made while
    it runs, reach it as well (loopback joins $NO_PROXY until it stops)."""
    tinker = pytest.importorskip("tinker")
    with tinker_server_process(tmp_path / "store") as srv:
        assert "127.0.0.1" in os.environ["NO_PROXY"].split(",")
        srv.add_fault(http_error("get_server_capabilities", 500, times=1))
        rest = tinker.RestClient(base_url=srv.base_url, api_key=srv.api_key)
        assert rest.get_server_capabilities().result().supported_models  # retried past it
        assert srv.faults()[0]["fired"] == 1
    assert "NO_PROXY" not in os.environ  # restored


def test_the_testing_server_starts_with_warnings_as_errors(tmp_path: Path) -> None:
    """Before: ``python -m tinker_sr.testing.server`` warned that the package had imported the
    module already, and with PYTHONWARNINGS=error (a strict CI) the server exited at once."""
    srv = ServerProcess(tmp_path / "store", testing=True, env={"PYTHONWARNINGS": "error"})
    srv.start()
    try:
        assert srv.faults() == []
    finally:
        srv.stop()


def test_python_m_the_testing_server_is_clean_under_warnings_as_errors() -> None:
    """Its usage line says ``python -m tinker_sr.testing.server``, which failed under
    ``-W error``: the package imported the module before runpy ran it (RuntimeWarning)."""
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-m", "tinker_sr.testing.server", "--help"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m"), proc.stderr


@pytest.mark.parametrize("key", ["tml-x\n", "tml-x ", "tml-x\t", " tml-x", "tml-é"])
def test_an_api_key_that_cannot_be_sent_is_refused_at_once(key: str) -> None:
    """Before: a key read from a file with its newline failed as "Connection error." after
    ~55 s of retries (httpx refuses the header value; the official SDK hangs)."""
    with pytest.raises(TinkerError, match="an API key is printable ASCII without spaces"):
        WireTransport("http://127.0.0.1:1", key)


def test_an_upper_case_scheme_is_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """The official SDK connects to HTTP://host; tinker_sr refused it."""
    assert WireTransport("HTTP://127.0.0.1:8000/", "tml-x").base_url == "HTTP://127.0.0.1:8000"
    monkeypatch.setenv("TINKER_BASE_URL", "ftp://127.0.0.1")
    with pytest.raises(TinkerError, match=r"\$TINKER_BASE_URL 'ftp://127.0.0.1' must start"):
        WireTransport(None, "tml-x")


def test_a_c_locale_server_on_a_non_ascii_store_trains_and_names_what_it_cannot_write(
    tmp_path: Path,
) -> None:
    """Under LC_ALL=C without UTF-8 mode the file system encoding is ASCII. Before: with a
    store path like ``dé mo``, creating any training client was a 500 (the tokenizers library
    could not take the path), and a checkpoint named ``ck-é`` an "internal error"."""
    c_locale = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    srv = ServerProcess(tmp_path / "dé mo ü" / "store", env=c_locale)
    srv.start()
    try:
        service = tinker_sr.ServiceClient(base_url=srv.base_url, api_key="tml-test")
        training = service.create_lora_training_client("tinker-sr/tiny", rank=2).result()
        assert training.get_tokenizer().encode("hi")
        assert training.save_state("plain").result().path.endswith("/weights/plain")
        with pytest.raises(tinker_sr.RequestFailedError) as refused:
            training.save_state("ck-é").result()
        assert "cannot be a file name here: the engine's file system encoding is ascii" in str(
            refused.value
        )
        assert "run the engine in UTF-8 mode (PYTHONUTF8=1)" in str(refused.value)
        service.close().result()
    finally:
        srv.stop()


def test_checkpoint_files_follow_the_umask(tmp_path: Path) -> None:
    """Before: every checkpoint and exported weights file was 0600 (mkstemp's mode), so a
    teammate or a vLLM service under another user could not read an exported adapter."""
    import torch

    from tinker_sr.engine.checkpoints import save_tensors

    for mask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        old = os.umask(mask)
        try:
            save_tensors(tmp_path / f"w{mask:o}.safetensors", {"w": torch.ones(2)})
        finally:
            os.umask(old)
        assert (tmp_path / f"w{mask:o}.safetensors").stat().st_mode & 0o777 == mode, oct(mask)


def test_omp_num_threads_lowers_the_engines_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the engine set torch to every usable CPU for each request, overriding a
    machine's OMP_NUM_THREADS=1 (many worker processes) for the whole process."""
    from tinker_sr.engine import cpu

    monkeypatch.delenv(cpu.THREADS_ENV, raising=False)
    monkeypatch.setattr(cpu, "available_cpus", lambda: 8)
    for omp, want in (("1", 1), ("3", 3), ("64", 8), ("0", 8), ("abc", 8), ("", 8)):
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
        assert cpu.default_torch_threads() == want, omp
    monkeypatch.setenv(cpu.THREADS_ENV, "5")  # tinker_sr's own setting wins
    assert cpu.default_torch_threads() == 5


@pytest.mark.parametrize("value", ["0", "abc"])
def test_a_bad_thread_setting_is_one_line_from_the_cli(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tinker_sr.cli import main

    monkeypatch.setenv("TINKER_SR_TORCH_THREADS", value)
    assert main(["demo", "--steps", "1", "--quiet", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert f"TINKER_SR_TORCH_THREADS must be a positive integer, got {value!r}" in err
    assert "Traceback" not in err
