"""A real ``python -m tinker_sr.server`` subprocess on a free 127.0.0.1 port, for tests.

    with running_server(tmp_path / "store") as srv:
        client = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-test")

`ServerProcess.kill()` sends SIGKILL (a crash); `start()` brings it back on the same port
and store.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
_STARTUP_LIMIT_S = 120.0  # importing torch on a busy 2-core machine can take a while


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _PortTaken(Exception):
    pass


class ServerProcess:
    def __init__(
        self,
        store: Path,
        *,
        port: int | None = None,
        api_keys: Sequence[str] | None = None,
        max_body_bytes: int | None = None,
        long_poll_s: float | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.store = Path(store)
        self.extra_args = list(extra_args)  # e.g. the feature-less flags
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.api_keys = list(api_keys or [])
        self.max_body_bytes = max_body_bytes
        self.long_poll_s = long_poll_s
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.store.parent / f"server-{self.store.name}.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        for _ in range(3):
            try:
                self._start_once()
                return
            except _PortTaken:
                if self._fixed_port:
                    raise RuntimeError(f"port {self.port} is taken:\n{self.log()}") from None
                self.port = free_port()  # another process grabbed it between probe and bind
        raise RuntimeError(f"could not find a free port:\n{self.log()}")

    def _start_once(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tinker_sr.server",
            "--port",
            str(self.port),
            "--store",
            str(self.store),
            "--log-level",
            "warning",
        ]
        if self.api_keys:
            cmd += ["--api-keys", ",".join(self.api_keys)]
        if self.max_body_bytes is not None:
            cmd += ["--max-body-bytes", str(self.max_body_bytes)]
        if self.long_poll_s is not None:
            cmd += ["--long-poll-s", str(self.long_poll_s)]
        cmd += self.extra_args
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if not self.api_keys:  # a developer's own key list must not leak into the test
            env.pop("TINKER_SR_API_KEYS", None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + _STARTUP_LIMIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log().lower():
                    raise _PortTaken
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up:\n{self.log()}"
                )
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(
            f"server did not answer healthz within {_STARTUP_LIMIT_S} s:\n{self.log()}"
        )

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@contextmanager
def running_server(store: Path, **kwargs: object) -> Iterator[ServerProcess]:
    """Start a server on ``store``; stop it on exit (keyword arguments: `ServerProcess`)."""
    srv = ServerProcess(Path(store), **kwargs)  # type: ignore[arg-type]
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
