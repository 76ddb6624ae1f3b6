"""The `tinker_server` fixtures: a real `tinker-sr serve` process with offline model names,
wire faults added at run time (a real TCP reset, a real read timeout) and a JSONL trace."""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

import httpx
import pytest

from tinker_sr.testing import (
    ServerProcess,
    connection_reset,
    http_error,
    rate_limited,
    request_timeout,
    session_expires,
)

MODEL = "meta-llama/Llama-3.1-8B"
PROMPT = [256, 265, 117, 115, 101, 114, 266]  # <|begin_of_text|><|start_header_id|>user<|end_..|>


def close(service: Any) -> None:
    with contextlib.suppress(Exception):  # an expired session may refuse to finish
        service.close("success").result(timeout=30)


def _service(name: str, srv: ServerProcess, *, timeout: float | None = None) -> Any:
    module = importlib.import_module(name)
    if name == "tinker_sr" and timeout is not None:
        from tinker_sr.backend.remote import RemoteBackend

        backend = RemoteBackend(srv.base_url, srv.api_key, timeout=timeout)
        return module, module.ServiceClient(backend=backend)
    return module, module.ServiceClient(base_url=srv.base_url, api_key=srv.api_key)


def _sample(module: Any, sampler: Any) -> Any:
    params = module.types.SamplingParams(max_tokens=3, seed=0)
    return sampler.sample(module.types.ModelInput.from_ints(PROMPT), 1, params).result(timeout=120)


@pytest.mark.parametrize("client", ["tinker", "tinker_sr"])
def test_real_server_faults_are_retried_and_traced(
    client: str, tinker_server_session: ServerProcess
) -> None:
    srv = tinker_server_session
    module, service = _service(client, srv)
    training = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    # Any model name is the offline chat model, with the Llama-3 header tokens.
    tok = training.get_tokenizer()
    assert tok.encode("<|start_header_id|>", add_special_tokens=False) == [265]
    sampler = training.save_weights_and_get_sampling_client().result()
    by_name = service.create_sampling_client(base_model=MODEL).result()
    for other in (sampler.get_tokenizer(), by_name.get_tokenizer()):
        assert other.encode("<|eot_id|>", add_special_tokens=False) == [267]
    start = len(srv.trace)
    reset = srv.add_fault(connection_reset("asample"))  # a TCP RST from the server's socket
    srv.add_fault(rate_limited("asample", retry_after=0.1, after=1))
    srv.add_fault(http_error("retrieve_future", 502))
    try:
        assert len(_sample(module, sampler).sequences) == 1
        # The server counts; the fault add_fault answers reads its counters (before: 0, 0).
        assert (reset.seen, reset.fired, reset.endpoint) == (3, 1, "asample")
    finally:
        faults = srv.faults()
        srv.clear_faults()
    close(service)
    assert [f["fired"] for f in faults] == [1, 1, 1]
    entries = srv.trace.entries[start:]
    asample = [e["status"] for e in entries if e["endpoint"] == "asample"]
    polls = [e["status"] for e in entries if e["endpoint"] == "retrieve_future"]
    # The trace is in completion order, so on a loaded machine a poll can finish before the
    # faulted one; what matters is that the 502 was answered and polling then succeeded.
    faulted = [e["status"] for e in entries if e["endpoint"] == "retrieve_future" and e["fault"]]
    assert asample == [None, 429, 200] and faulted == [502] and polls[-1] == 200


@pytest.mark.parametrize("client", ["tinker", "tinker_sr"])
def test_real_server_request_timeout_is_retried(
    client: str, tinker_server_session: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = tinker_server_session
    if client == "tinker":  # the SDK's 60 s default read timeout, shortened for the test
        monkeypatch.setattr("tinker._base_client.DEFAULT_TIMEOUT", httpx.Timeout(2.0))
    module, service = _service(client, srv, timeout=2.0)
    sampler = service.create_sampling_client(base_model=MODEL).result()
    start = len(srv.trace)
    srv.add_fault(request_timeout("asample"))
    try:
        assert len(_sample(module, sampler).sequences) == 1
    finally:
        srv.clear_faults()
        close(service)
    asample = [e for e in srv.trace.entries[start:] if e["endpoint"] == "asample"]
    assert [e["status"] for e in asample] == [None, 200]
    assert asample[0]["fault"] == "timeout"


def test_real_server_session_expiry(tinker_server: ServerProcess) -> None:
    for name in ("tinker", "tinker_sr"):
        module, service = _service(name, tinker_server)
        sampler = service.create_sampling_client(base_model=MODEL).result()
        tinker_server.add_fault(session_expires("asample"))
        with pytest.raises(module.BadRequestError, match="expired"):
            _sample(module, sampler)
        close(service)
    assert [e["status"] for e in tinker_server.trace.calls("asample")] == [400, 400]


def test_faults_need_a_testing_server(tmp_path: Any) -> None:
    srv = ServerProcess(tmp_path / "store")  # plain `tinker-sr serve`, not started
    with pytest.raises(RuntimeError, match="testing=True"):
        srv.add_fault(http_error("asample", 500))


def test_docs_real_server_example(tinker_server: ServerProcess) -> None:
    # docs/testing.md, "Against a real server": the ci_project script, unmodified, in a subprocess.
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "ci_project" / "rl_step.py"
    tinker_server.add_fault(connection_reset("forward_backward"))  # a real TCP RST
    env = {**os.environ, "TINKER_BASE_URL": tinker_server.base_url,
           "TINKER_API_KEY": tinker_server.api_key}  # fmt: skip
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=300)
    assert tinker_server.trace.count("optim_step") == 3  # its 3 steps
    assert tinker_server.trace.calls("forward_backward")[0]["status"] is None  # the reset


def test_tests_without_the_session_server_load_tokenizers_unpatched(
    request: pytest.FixtureRequest,
) -> None:
    """After the tests above that used `tinker_server_session` (file order), a test that does
    not use it gets transformers' own ``AutoTokenizer.from_pretrained``: the offline-name patch
    lasts only for the tests that use the session server. It lasted to the end of the session,
    so a later test loading a Hub name silently got the offline model's tokenizer."""
    from transformers.models.auto.tokenization_auto import AutoTokenizer

    assert "tinker_server_session" not in request.fixturenames
    loader = AutoTokenizer.__dict__["from_pretrained"].__func__
    assert loader.__module__.startswith("transformers."), loader.__module__


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("testing", [True, False], ids=["testing-server", "tinker-sr-serve"])
def test_a_fixtures_server_does_not_outlive_the_test_run(tmp_path: Any, testing: bool) -> None:
    """A test run that dies without teardown (a CI job cancelled, pytest-timeout's os._exit,
    a crashed xdist worker) takes its server with it. Before, the server lived on, holding
    its port, store and ~1 GB, until someone killed it."""
    import os
    import subprocess
    import time
    from pathlib import Path

    script = (
        "import os\n"
        "from tinker_sr.testing.server import ServerProcess\n"
        f"srv = ServerProcess({str(tmp_path / 'store')!r}, testing={testing})\n"
        "srv.start()\n"
        "print(srv.proc.pid, flush=True)\n"
        "os._exit(0)  # no teardown\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[-1])

    def alive() -> bool:  # a zombie nobody reaps has exited
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    deadline = time.monotonic() + 60
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive():
        os.kill(pid, 9)
        pytest.fail(f"the server (pid {pid}) outlived the process that started it")


def test_a_strict_ci_is_not_failed_by_the_official_sdks_left_connections(tmp_path: Any) -> None:
    """With ``-W error`` (``filterwarnings = error``), a test that used the official SDK
    against `tinker_server` failed a later test: the SDK closes its connections when it is
    collected, and the unclosed-socket warnings were raised wherever that happened."""
    import subprocess
    import textwrap

    (tmp_path / "test_strict.py").write_text(
        textwrap.dedent(
            """
            import gc

            import tinker


            def test_uses_the_server(tinker_server):
                service = tinker.ServiceClient(
                    base_url=tinker_server.base_url, api_key=tinker_server.api_key
                )
                service.create_lora_training_client("Qwen/Qwen3-8B", rank=8, seed=0).result()


            def test_after_it():
                gc.collect()
            """
        )
    )
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TINKER_"))}
    proc = subprocess.run(  # a pytest of its own: no xdist worker's or benchmark's settings
        [sys.executable, "-m", "pytest", "-q", "-W", "error", "-p", "no:cacheprovider",
         "-p", "no:xdist", "-p", "no:randomly", "-p", "no:benchmark", "test_strict.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
