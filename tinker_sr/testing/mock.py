"""`mock_tinker`: the `tinker-sr serve` app in this process, reached by any httpx client.

    with mock_tinker() as mock:                  # sets TINKER_BASE_URL / TINKER_API_KEY
        import tinker                            # the unmodified official SDK
        svc = tinker.ServiceClient()
        tc = svc.create_lora_training_client("Qwen/Qwen3-8B", rank=8)
        ...
        assert mock.trace.count("asample") <= 4

`respx` routes every request an httpx client sends to ``base_url`` into the app. It patches
``httpx.Client``/``httpx.AsyncClient`` at the transport-selection level (respx's "httpx"
mocker), not httpcore, because the official SDK may build its client on a non-httpcore
transport (pyqwest) when a server asks for it; requests to any other URL pass through
untouched. The app runs on its own event loop thread, the same single loop a real server
has, whichever loops and threads the clients use. No socket is opened and nothing is
downloaded: every base model name is the offline chat model (`offline_model`), and so is
every tokenizer name `AutoTokenizer.from_pretrained` is asked for while the mock is active.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from tinker_sr.backend.transport import DEFAULT_BASE_URL as PRODUCTION_BASE_URL
from tinker_sr.testing.offline_model import hub_names_resolve_to, offline_model_dir
from tinker_sr.testing.sdk_state import clients_closed_after, fresh_sdk_rest_clients
from tinker_sr.testing.wire import (
    API_PREFIX,
    FaultPlan,
    Trace,
    TransportFault,
    WireFault,
    WireMiddleware,
)

DEFAULT_BASE_URL = "http://tinker.mock.invalid"
DEFAULT_API_KEY = "tml-tinker-sr-mock"
T = TypeVar("T")


class MockTinker:
    """A running mock: its URL and key, store, fault plan and trace."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        store: Path,
        *,
        faults: Sequence[WireFault],
        trace_path: Path | None,
        model_aliases: Mapping[str, str] | None,
        app_options: Mapping[str, Any],
    ) -> None:
        from tinker_sr.backend.local import LocalBackend
        from tinker_sr.server.app import create_app

        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.store = store
        self.model_dir = offline_model_dir(store / "models")
        self.faults = FaultPlan(faults)
        self.trace = Trace(trace_path if trace_path is not None else store / "trace.jsonl")
        aliases = {"*": str(self.model_dir), **dict(model_aliases or {})}
        self.backend = LocalBackend(store, model_aliases=aliases)
        # Download URLs of exports are file:// URLs into the store: no HTTP GET reaches a mock.
        # Unseeded LoRA clients and samples seeded from 0: code that seeds nothing repeats.
        options = {"file_download_urls": True, "seed_unseeded": 0, **app_options}
        self.app = create_app(self.backend, store_dir=store, close_backend=True, **options)
        self._asgi = WireMiddleware(
            self.app, self.faults, self.trace, in_process=True, server=self.server
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tinker-sr-mock", daemon=True
        )
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._lifespan: Any = None
        self._closed = False

    def add_fault(self, fault: WireFault) -> WireFault:
        """Plan ``fault`` from now on (see `tinker_sr.testing.wire` for the kinds)."""
        return self.faults.add(fault)

    def clear_faults(self) -> None:
        """Drop every planned fault (as `ServerProcess.clear_faults`)."""
        self.faults.clear()

    def server(self) -> Any:
        """The app's `TinkerServer` (its state and backend)."""
        return self.app.state.tinker_server

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._lifespan = self.app.router.lifespan_context(self.app)
        self._on_loop(self._lifespan.__aenter__()).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fut in list(self._pending):  # clients still waiting get a connection error
            fut.cancel()
        try:
            self._on_loop(self._lifespan.__aexit__(None, None, None)).result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    # ---- request routing ---------------------------------------------------------------------

    def side_effect(self, request: httpx.Request) -> Any:
        """respx side effect: an awaitable for async clients, a response for sync ones."""
        if _for_async_client():
            return self._dispatch_async(request)
        return self._finish(request, lambda: self._submit(request).result())

    async def _dispatch_async(self, request: httpx.Request) -> httpx.Response:
        fut = self._submit(request)
        return await self._afinish(request, fut)

    async def _afinish(
        self, request: httpx.Request, fut: concurrent.futures.Future[httpx.Response]
    ) -> httpx.Response:
        try:
            return await asyncio.wrap_future(fut)
        except TransportFault as e:
            raise _transport_error(e, request) from None
        except concurrent.futures.CancelledError:
            if self._closed:
                raise httpx.ConnectError("tinker_sr mock is closed", request=request) from None
            raise

    def _finish(self, request: httpx.Request, wait: Any) -> httpx.Response:
        try:
            return wait()  # type: ignore[no-any-return]
        except TransportFault as e:
            raise _transport_error(e, request) from None
        except concurrent.futures.CancelledError:
            raise httpx.ConnectError("tinker_sr mock is closed", request=request) from None

    def _submit(self, request: httpx.Request) -> concurrent.futures.Future[httpx.Response]:
        if self._closed:
            raise httpx.ConnectError("tinker_sr mock is closed", request=request)
        return self._on_loop(self._call_app(request))

    async def _call_app(self, request: httpx.Request) -> httpx.Response:
        path = request.url.raw_path.decode("ascii")
        start = path.find(API_PREFIX)  # a base URL may carry a path (the production one does)
        if start > 0:
            path = path[start:]
        inner = httpx.Request(
            request.method,
            httpx.URL(f"http://{request.url.netloc.decode('ascii')}{path}"),
            headers=request.headers,
            content=request.content,
        )
        transport = httpx.ASGITransport(app=self._asgi)
        resp = await transport.handle_async_request(inner)
        content = await resp.aread()
        return httpx.Response(resp.status_code, headers=resp.headers, content=content)


def _transport_error(e: TransportFault, request: httpx.Request) -> httpx.TransportError:
    if e.kind == "timeout":
        return httpx.ReadTimeout(f"timed out ({e})", request=request)
    return httpx.ReadError(f"[Errno 104] Connection reset by peer ({e})", request=request)


_RESPX_ROUTER = os.path.join("respx", "router.py")


def _for_async_client() -> bool:
    """Whether respx resolves the request being served for an async client (its ``aresolve``
    is on the stack) or a sync one (``resolve``). A sync client called while an event loop
    runs (a sync helper in an ``async def`` test, a notebook) is still a sync client."""
    frame = sys._getframe(2)
    while frame is not None:  # respx's Route.resolve (models.py) runs under either: skip it
        code = frame.f_code
        if code.co_name in ("resolve", "aresolve") and code.co_filename.endswith(_RESPX_ROUTER):
            return code.co_name == "aresolve"
        frame = frame.f_back  # type: ignore[assignment]
    try:  # not called by respx: decide by the thread, as before
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@contextmanager
def _env(values: Mapping[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        _set_env(values)
        yield
    finally:
        _set_env(saved)


def _set_env(values: Mapping[str, str | None]) -> None:
    """Set each variable; None unsets it."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextmanager
def _store_dir(store: str | os.PathLike[str] | None) -> Iterator[Path]:
    if store is not None:
        path = Path(store)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="tinker-sr-mock-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def mock_tinker(
    base_url: str = DEFAULT_BASE_URL,
    *,
    api_key: str = DEFAULT_API_KEY,
    store: str | os.PathLike[str] | None = None,
    faults: Sequence[WireFault] = (),
    trace_path: str | os.PathLike[str] | None = None,
    model_aliases: Mapping[str, str] | None = None,
    set_env: bool = True,
    intercept_production: bool = True,
    **app_options: Any,
) -> Iterator[MockTinker]:
    """Serve Tinker in-process at ``base_url`` for the duration of the block.

    ``store``: state directory (default: a temporary one, deleted afterwards).
    ``faults``: `WireFault`s planned from the start (add more with ``mock.add_fault``).
    ``trace_path``: where the JSONL trace goes (default ``<store>/trace.jsonl``).
    ``model_aliases``: extra ``name -> built-in or directory`` entries; every other base model
    name is the offline chat model. ``set_env``: set ``TINKER_BASE_URL``/``TINKER_API_KEY``
    (and unset ``TINKER_SR_BACKEND``) inside the block. Other keywords go to `create_app`
    (e.g. ``session_timeout_s``, ``max_pending_samples``, ``api_keys``; ``seed_unseeded``:
    what seeds the LoRA clients and samples a client left unseeded, 0 by default, so code
    that seeds nothing repeats bit for bit; None draws them at random as the hosted service
    does).
    ``intercept_production``: also serve requests to the hosted Tinker service's URL (the SDKs'
    default), so code that names it explicitly cannot reach the network from a test.
    """
    import respx

    with _store_dir(store) as path:
        mock = MockTinker(
            base_url,
            api_key,
            path,
            faults=faults,
            trace_path=Path(trace_path) if trace_path is not None else None,
            model_aliases=model_aliases,
            app_options=app_options,
        )
        router = respx.MockRouter(using="httpx", assert_all_called=False)
        urls = [mock.base_url] + ([PRODUCTION_BASE_URL] if intercept_production else [])
        for url in urls:
            parts = urlsplit(url)
            where: dict[str, Any] = {"scheme": parts.scheme, "host": parts.hostname}
            if parts.port is not None:
                where["port"] = parts.port
            router.route(**where).mock(side_effect=mock.side_effect)
        router.route().pass_through()  # every other URL goes out as usual
        env: dict[str, str | None] = {}
        if set_env:
            env = {"TINKER_BASE_URL": mock.base_url, "TINKER_API_KEY": api_key,
                   "TINKER_SR_BACKEND": None}  # fmt: skip
        mock.start()
        try:
            with (
                router,
                _env(env),
                hub_names_resolve_to(mock.model_dir, model_aliases),
                fresh_sdk_rest_clients(),
                # While the mock still answers, and without the test's faults.
                clients_closed_after(*urls, before_closing=mock.clear_faults),
            ):
                yield mock
        finally:
            with contextlib.suppress(Exception):
                mock.close()
