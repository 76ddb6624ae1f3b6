"""`tinker-sr serve` on an address it cannot listen on says so, naming the flag and the fix,
before it opens the store or loads anything (before: a port out of range was an
OverflowError traceback, and a held port or a foreign host a uvicorn log line after start-up,
exit status 3 or 1)."""

from __future__ import annotations

import socket
import subprocess
import sys
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
