"""`tinker-sr serve` on an address it cannot listen on says so, naming the flag and the fix,
before it opens the store or loads anything (before: a port out of range was an
OverflowError traceback, and a held port or a foreign host a uvicorn log line after start-up,
exit status 3 or 1)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tinker_sr.server.run import UnusableAddressError, check_address


@pytest.mark.parametrize(
    ("host", "port", "message"),
    [
        ("127.0.0.1", 70000, "--port 70000: a TCP port is a number from 0 to 65535"),
        ("127.0.0.1", -1, "--port -1: a TCP port"),
        ("192.0.2.1", 8000, "cannot listen on 192.0.2.1:8000 .*--host"),  # not this machine's
    ],
)
def test_an_address_that_cannot_be_served_is_refused(host: str, port: int, message: str) -> None:
    with pytest.raises(UnusableAddressError, match=message):
        check_address(host, port)


def test_a_host_name_that_does_not_resolve_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def unresolved(*_: object, **__: object) -> None:  # no lookup leaves this machine
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    with pytest.raises(UnusableAddressError, match="--host 'gpu-box' is not an address .*127"):
        check_address("gpu-box", 8000)


def test_a_held_port_is_refused_before_the_store_opens(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(UnusableAddressError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_address("127.0.0.1", port)
        store = tmp_path / "store"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tinker_sr",
                "serve",
                "--port",
                str(port),
                "--store",
                str(store),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"tinker-sr serve: cannot listen on 127.0.0.1:{port}")
    assert "pick another with --port" in proc.stderr and not store.exists()


def test_a_server_open_beyond_this_machine_without_keys_is_warned_about() -> None:
    from tinker_sr.server.run import loopback_only, open_server_warning

    assert loopback_only("127.0.0.1") and loopback_only("localhost") and loopback_only("::1")
    assert not loopback_only("0.0.0.0") and not loopback_only("::")
    for host in ("127.0.0.1", "localhost"):
        assert open_server_warning(host, None) is None
    assert open_server_warning("0.0.0.0", ["tml-a"]) is None  # keys set: only their holders
    warning = open_server_warning("0.0.0.0", None)
    assert warning is not None and "--api-keys" in warning and "127.0.0.1" in warning


def test_the_store_lock_file_keeps_no_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock file names the server that holds a store (a second server prints it); it is
    readable by others and outlives the server, so the key flags' values are not in it."""
    from tinker_sr.server.store_lock import StoreInUseError, StoreLock

    argv = ["tinker-sr", "serve", "--api-keys", "tml-a1,tml-b2", "--api-key=tml-c3", "--port", "0"]
    monkeypatch.setattr(sys, "argv", argv)
    lock = StoreLock(tmp_path)
    try:
        text = (tmp_path / "server.lock").read_text()
        assert "--api-keys *** --api-key=*** --port 0" in text
        with pytest.raises(StoreInUseError) as e:
            StoreLock(tmp_path)
        assert "tml-" not in text and "tml-" not in str(e.value)
    finally:
        lock.release()


def test_a_refused_start_is_said_before_torch_or_the_server_loads(tmp_path: Path) -> None:
    """A held port, a key no client can send, a store another server holds, a setting in
    the environment it cannot use and a --model-dir that is not one (before: after torch)
    each stop ``tinker-sr serve`` before it imports torch and
    the server (before: after them, 4-6 s on a slow host for a one-line refusal); and `serve`
    called from Python the same way, its checks run once (before: twice from the CLI)."""
    from tinker_sr.server.store_lock import StoreLock

    held_store = tmp_path / "held"
    code = textwrap.dedent(
        """
        import os, sys
        from tinker_sr import cli
        from tinker_sr.server import preflight, run

        calls = []
        checked = preflight.check_address
        preflight.check_address = lambda *a: (calls.append(a), checked(*a))[1]
        store = sys.argv[1].split()[-1]

        def say(call, *args, **kwargs):
            try:
                call(*args, **kwargs)
            except (SystemExit, ValueError) as e:
                print(type(e).__name__, e)

        for argv in sys.argv[1:]:
            name, _, value = argv.partition("=")
            if value:  # a setting in the environment, from Python and from the CLI
                os.environ[name] = value
                say(run.serve, port=0, store=store)
                say(cli.main, ["serve", "--store", store, "--port", "0"])
                del os.environ[name]
            else:
                say(cli.main, ["serve", "--store", store, *argv.split()])
        heavy = ("torch", "tinker_sr.server.app")
        print("loaded", sorted(m for m in sys.modules if m in heavy), len(calls))
        """
    )
    lock = StoreLock(held_store)  # a live server's lock, as far as the child can tell
    no_vocabulary = tmp_path / "no-vocabulary"
    no_vocabulary.mkdir()
    (no_vocabulary / "config.json").write_text("{}")
    settings = {
        "TINKER_SR_REQUEST_START_S=abc": "$TINKER_SR_REQUEST_START_S must be a number",
        "TINKER_SR_MODEL_DTYPE=fp8": "$TINKER_SR_MODEL_DTYPE: 'fp8' is not a supported dtype",
        "TINKER_SR_TORCH_THREADS=many": "TINKER_SR_TORCH_THREADS",
        "TINKER_SR_ACTIVATION_CHECKPOINTING=2": "TINKER_SR_ACTIVATION_CHECKPOINTING must be 0, 1",
        "TINKER_SR_SAMPLERS_PER_SESSION=x": "TINKER_SR_SAMPLERS_PER_SESSION must be a whole",
    }
    try:
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            tries = [
                f"--port 0 --store {held_store}",
                f"--port {port}",
                "--port 0 --api-key abc",
                *settings,
                f"--port 0 --model-dir {tmp_path / 'nowhere'}",
                f"--port 0 --model-dir {no_vocabulary}",
            ]
            proc = subprocess.run(
                [sys.executable, "-c", code, *tries],
                capture_output=True,
                text=True,
                timeout=120,
            )
    finally:
        lock.release()
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 6 + 2 * len(settings), proc.stdout
    assert all(line.startswith("SystemExit tinker-sr serve: ") for line in lines[:3])
    assert f"store {held_store} is in use by another tinker-sr server" in lines[0]
    assert f"cannot listen on 127.0.0.1:{port}" in lines[1]
    assert "do not start with 'tml-'" in lines[2]
    for i, message in enumerate(settings.values()):
        python, cli = lines[3 + 2 * i : 5 + 2 * i]
        assert python.startswith("UnusableSettingError ") and message in python, proc.stdout
        assert cli.startswith("SystemExit tinker-sr serve: ") and message in cli, proc.stdout
    assert lines[-3].startswith("SystemExit tinker-sr serve: --model-dir ") and (
        "no config.json in" in lines[-3]
    )
    assert "holds no tokenizer vocabulary" in lines[-2]
    # each start checked its address once: 3 from the CLI, 2 for each setting; a missing
    # --model-dir is refused before the address is checked
    assert lines[-1] == f"loaded [] {3 + 2 * len(settings)}", proc.stdout
