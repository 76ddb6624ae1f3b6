"""A real `tinker-sr serve` process on a free 127.0.0.1 port, for tests.

    with tinker_server_process(tmp_path / "store") as srv:
        client = tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key)
        srv.add_fault(rate_limited("asample"))
        ...
        assert srv.trace.count("asample") == 2

``testing=True`` (the default here; the `tinker_server` fixture) runs
this module's `main` in a new interpreter: the same app as ``tinker-sr serve`` with every base
model name served by the offline chat model, wrapped in the wire-fault / trace middleware, with
faults added at run time through ``/_tinker_sr_testing/faults`` and the trace appended to
``<store>/trace.jsonl``. ``testing=False`` runs plain ``python -m tinker_sr.server``.
`ServerProcess.kill()` sends SIGKILL (a crash); `start()` brings it back on the same port and
store.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tinker_sr.exit_with_parent import PARENT_ENV
from tinker_sr.testing.wire import CONTROL_PREFIX, Trace, WireFault, read_trace

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding tinker_sr/
_STARTUP_LIMIT_S = 120.0  # importing torch on a busy 2-core machine can take a while
DEFAULT_TEST_KEY = "tml-tinker-sr-test"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _PortTaken(Exception):
    pass


class ServerProcess:
    """One server subprocess. ``api_keys``: accept only these (``api_key`` is the first, else
    `DEFAULT_TEST_KEY`, which any key-less server accepts). ``extra_args``: more command-line
    flags (plain mode: any `tinker-sr serve` flag)."""

    def __init__(
        self,
        store: Path,
        *,
        port: int | None = None,
        api_keys: Sequence[str] | None = None,
        max_body_bytes: int | None = None,
        long_poll_s: float | None = None,
        env: Mapping[str, str] | None = None,
        testing: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.store = Path(store)
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.api_keys = list(api_keys or [])
        self.max_body_bytes = max_body_bytes
        self.long_poll_s = long_poll_s
        self.env = dict(env or {})
        self.testing = testing
        self.extra_args = list(extra_args)  # more `tinker-sr serve` flags (feature-less mode)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.store.parent / f"server-{self.store.name}.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        return self.api_keys[0] if self.api_keys else DEFAULT_TEST_KEY

    @property
    def trace_path(self) -> Path:
        return self.store / "trace.jsonl"

    # ---- testing-mode controls ---------------------------------------------------------------

    @property
    def trace(self) -> Trace:
        """The requests this server saw so far (testing mode), read from its JSONL trace."""
        return read_trace(self.trace_path)

    def add_fault(self, fault: WireFault) -> ServerFault:
        """Plan ``fault`` on the running server (testing mode). The answer reads as ``fault``,
        its ``seen`` / ``fired`` counted by the server (``fault``'s own stay 0: the server
        holds its copy)."""
        planned = self._control("POST", json=fault.to_json()).json()
        return ServerFault(self, fault, len(planned) - 1)

    def clear_faults(self) -> None:
        self._control("DELETE")

    def faults(self) -> list[dict[str, Any]]:
        """The server's planned faults with their ``seen``/``fired`` counters."""
        return list(self._control("GET").json())

    def _control(self, method: str, **kw: Any) -> httpx.Response:
        if not self.testing:
            raise RuntimeError("faults need a testing server: ServerProcess(..., testing=True)")
        url = f"{self.base_url}{CONTROL_PREFIX}faults"
        resp = httpx.request(method, url, timeout=10, trust_env=False, **kw)  # never a proxy
        resp.raise_for_status()
        return resp

    # ---- lifecycle -----------------------------------------------------------------------------

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

    def _command(self) -> list[str]:
        # Not ``-m tinker_sr.testing.server``: runpy warns that the package imported that
        # module already, and under PYTHONWARNINGS=error the server exited at start-up.
        main = "import sys; from tinker_sr.testing.server import main; sys.exit(main())"
        cmd = [sys.executable, *(("-c", main) if self.testing else ("-m", "tinker_sr.server"))]
        cmd += ["--port", str(self.port), "--store", str(self.store)]
        cmd += ["--log-level", "warning"]
        if self.api_keys:
            cmd += ["--api-keys", ",".join(self.api_keys)]
        if self.max_body_bytes is not None:
            cmd += ["--max-body-bytes", str(self.max_body_bytes)]
        if self.long_poll_s is not None:
            cmd += ["--long-poll-s", str(self.long_poll_s)]
        return cmd + self.extra_args

    def _start_once(self) -> None:
        env = {**os.environ, **self.env}
        # The child imports the same tinker_sr as this process (a checkout or an install).
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")])
        )
        if not self.api_keys:  # a developer's own key list must not leak into the test
            env.pop("TINKER_SR_API_KEYS", None)
        env[PARENT_ENV] = str(os.getpid())  # it stops if this process dies without teardown
        self.store.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            self._command(), cwd=self.store, env=env, stdout=log, stderr=subprocess.STDOUT
        )
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
                # trust_env=False: $HTTP_PROXY (without 127.0.0.1 in $NO_PROXY) kept the
                # readiness check away from a running server for the whole start-up limit.
                url = f"{self.base_url}/api/v1/healthz"
                if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
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
def running_server(store: Path, **kwargs: Any) -> Iterator[ServerProcess]:
    """Start a server on ``store``; stop it on exit (keyword arguments: `ServerProcess`)."""
    srv = ServerProcess(Path(store), **kwargs)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def tinker_server_process(store: Path, **kwargs: Any) -> Iterator[ServerProcess]:
    """`running_server` in testing mode: offline model names, wire faults, trace. While it
    runs, ``AutoTokenizer.from_pretrained(<hub name>)`` in this process loads the offline
    model's tokenizer (the official SDK's ``SamplingClient.get_tokenizer()`` does that)."""
    with (
        running_server(store, testing=True, **kwargs) as srv,
        offline_clients(srv, drop_faults=True),
    ):
        yield srv


@contextmanager
def offline_clients(srv: ServerProcess, *, drop_faults: bool = False) -> Iterator[None]:
    """While active, this process's clients see ``srv`` as `tinker_server_process` promises:
    hub tokenizer names load the offline model's tokenizer, and the official SDK's cached
    REST connections (from other servers) are set aside; the clients made meanwhile that a
    test left open are closed as the server stops (`sdk_state.clients_closed_after`), after
    its faults are dropped when ``drop_faults`` (a server shared by tests keeps them)."""
    from tinker_sr.testing.offline_model import MODEL_DIR_NAME, hub_names_resolve_to
    from tinker_sr.testing.sdk_state import clients_closed_after, fresh_sdk_rest_clients

    with (
        hub_names_resolve_to(srv.store / "models" / MODEL_DIR_NAME),
        fresh_sdk_rest_clients(),
        clients_closed_after(
            srv.base_url, before_closing=srv.clear_faults if drop_faults else None
        ),
        loopback_without_proxy(),
    ):
        yield


_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@contextmanager
def loopback_without_proxy() -> Iterator[None]:
    """While active, clients made in this process (the official SDK's included: httpx reads
    the variables) reach 127.0.0.1 directly even where ``$HTTP_PROXY`` / ``$ALL_PROXY`` is set
    (company machines, CI runners): loopback joins ``$NO_PROXY``. Restored on exit."""
    if not any(os.environ.get(v) for v in _PROXY_VARS):
        yield
        return
    before = {v: os.environ.get(v) for v in ("NO_PROXY", "no_proxy")}
    kept = [h for h in (before["NO_PROXY"] or before["no_proxy"] or "").split(",") if h.strip()]
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = ",".join(
        [*kept, "127.0.0.1", "localhost", "::1"]
    )
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- the testing server itself: ``python -m tinker_sr.testing.server`` ------------------------


def build_testing_app(store: Path, **app_options: Any) -> Any:
    """The `tinker-sr serve` app on ``store`` with offline model names, wrapped in the fault /
    trace middleware and the ``/_tinker_sr_testing/faults`` control endpoint."""
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.server.app import create_app
    from tinker_sr.testing.offline_model import offline_model_dir
    from tinker_sr.testing.wire import FaultPlan, WireMiddleware

    model_dir = offline_model_dir(store / "models")
    backend = LocalBackend(store, model_aliases={"*": str(model_dir)})
    app = create_app(backend, store_dir=store, close_backend=True, **app_options)
    plan = FaultPlan()
    wrapped = WireMiddleware(
        app,
        plan,
        Trace(store / "trace.jsonl"),
        in_process=False,
        server=lambda: app.state.tinker_server,
    )
    return _ControlApp(wrapped, plan, lambda: app.state.tinker_server)


class ServerFault:
    """A fault planned on a running server: the `WireFault`'s fields, and its ``seen`` /
    ``fired`` counters as the server has them now."""

    def __init__(self, server: ServerProcess, fault: WireFault, index: int) -> None:
        self._server, self._fault, self._index = server, fault, index

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fault, name)

    def __repr__(self) -> str:
        return f"ServerFault({self._fault!r}, seen={self.seen}, fired={self.fired})"

    @property
    def seen(self) -> int:
        return self._counter("seen")

    @property
    def fired(self) -> int:
        return self._counter("fired")

    def _counter(self, key: str) -> int:
        planned = self._server.faults()
        if self._index < len(planned) and _plan(planned[self._index]) == _plan(
            self._fault.to_json()
        ):
            return int(planned[self._index][key])
        return 0  # cleared since


def _plan(fault: dict[str, Any]) -> dict[str, Any]:
    """A fault's fields but its counters."""
    return {k: v for k, v in fault.items() if k not in ("seen", "fired")}


class _ControlApp:
    """Serves ``/_tinker_sr_testing/faults`` (GET list, POST add, DELETE clear)."""

    def __init__(self, app: Any, plan: Any, tinker_server: Any) -> None:
        self.app = app
        self.plan = plan
        self.tinker_server = tinker_server  # () -> the app's TinkerServer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(CONTROL_PREFIX):
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        status, answer = self._handle(scope["method"], body)
        data = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    def _handle(self, method: str, body: bytes) -> tuple[int, Any]:
        if method == "POST":
            try:
                fault = WireFault(**json.loads(body))
            except (TypeError, ValueError) as e:
                return 400, {"detail": f"bad fault: {e}"}
            self.plan.add(fault)
        elif method == "DELETE":
            self.plan.clear()
        elif method != "GET":
            return 405, {"detail": "use GET, POST or DELETE"}
        return 200, [f.to_json() for f in self.plan.faults]


def _seed_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def main(argv: Sequence[str] | None = None) -> int:
    from tinker_sr.cli import add_serve_arguments
    from tinker_sr.server.features import ServerFeatures
    from tinker_sr.server.run import run_uvicorn

    parser = argparse.ArgumentParser(prog="python -m tinker_sr.testing.server", description=__doc__)
    add_serve_arguments(parser)
    parser.add_argument(
        "--seed-unseeded", type=_seed_or_none, default=0, metavar="N|none",
        help="seed LoRA clients and samples left unseeded from N, so unseeded code repeats "
        "(default 0); none: draw them at random, as the hosted service does",
    )  # fmt: skip
    args = parser.parse_args(argv)
    store = Path(args.store or "tinker-sr-test-store")
    keys = [k.strip() for k in (args.api_keys or "").split(",") if k.strip()]
    keys += [k for k in args.api_key or [] if k]
    features = ServerFeatures(
        stable_reinforce=not args.without_stable_reinforce,
        record_stability_info=not args.ignore_stability_info,
        two_d_targets=not args.only_1d_targets,
    )
    app = build_testing_app(
        store, api_keys=keys or None, max_body_bytes=args.max_body_bytes,
        long_poll_s=args.long_poll_s, features=features, seed_unseeded=args.seed_unseeded,
    )  # fmt: skip
    run_uvicorn(app, app.tinker_server, host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
