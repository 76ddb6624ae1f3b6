"""Shared fixtures: every client test runs against each backend in `BACKENDS`.

The remote variant starts a real `tinker-sr serve` subprocess on a free 127.0.0.1 port
(see tests/_server.py) and points the same client code at it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# Never let a developer's environment point the suite at a hosted service.
os.environ.pop("TINKER_BASE_URL", None)
os.environ.pop("TINKER_SR_BACKEND", None)
os.environ.setdefault("TINKER_TELEMETRY", "0")
# The tiny test models run fastest on one thread, and two processes (a test and its server)
# each spinning two threads on two cores slow torch down by orders of magnitude.
os.environ.setdefault("TINKER_SR_TORCH_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The engine's C kernels (built at first use) go to a cache of the suite's own, shared by its
# server subprocesses and removed at exit, not the user's ~/.cache.
if "TINKER_SR_KERNEL_CACHE" not in os.environ:
    _kernels = tempfile.mkdtemp(prefix="tinker_sr_kernels_")
    os.environ["TINKER_SR_KERNEL_CACHE"] = _kernels
    atexit.register(shutil.rmtree, _kernels, True)


@pytest.fixture(autouse=True)
def _merged_copies_regardless_of_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that count merged sampler copies get the default two whatever this machine has
    free (the registry's memory probe sees "unknown"); the probe's own tests patch it."""
    from tinker_sr.engine import registry

    monkeypatch.setattr(registry, "free_memory", lambda _device: None)


@pytest.fixture(autouse=True)
def _no_stored_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests never see the developer's ``tinker auth login`` key (~/.tinker/credentials.json)."""
    import tinker_sr.auth

    monkeypatch.setattr(tinker_sr.auth, "credentials_path", lambda: tmp_path / "no-credentials")


BACKENDS = ["local"]
try:  # the remote backend joins the matrix once its server fixture exists
    from tests import _server  # noqa: F401

    BACKENDS.append("remote")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="session")
def remote_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests._server import running_server

    store = tmp_path_factory.mktemp("server_store")
    with running_server(store) as srv:
        yield srv


@pytest.fixture(params=BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def service(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A `tinker_sr.ServiceClient` on the embedded engine or on a real local server."""
    import tinker_sr as tinker

    if backend_kind == "local":
        with embedded_client(tmp_path) as client:
            yield client
    else:
        srv = request.getfixturevalue("remote_server")
        client = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-test")
        yield client
        client.close().result()


@contextmanager
def embedded_client(tmp_path: Path) -> Iterator[Any]:
    """A `tinker_sr.ServiceClient` on a fresh embedded engine (store under ``tmp_path``),
    closed with its backend afterwards."""
    import tinker_sr as tinker
    from tinker_sr.backend.local import LocalBackend

    backend = LocalBackend(tmp_path / "store")
    client = tinker.ServiceClient(backend=backend)
    try:
        yield client
    finally:
        client.close().result()
        backend.close()


@pytest.fixture
def embedded_service(tmp_path: Path) -> Iterator[Any]:
    """A `tinker_sr.ServiceClient` on the embedded engine only (see `service` for both)."""
    with embedded_client(tmp_path) as client:
        yield client
