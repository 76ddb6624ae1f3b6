"""pytest plugin: offline Tinker fixtures (registered through the ``pytest11`` entry point).

A top-level module, not in the tinker_sr package: pytest loads every installed plugin in
every project, and importing tinker_sr sets the environment its engine wants (passive OpenMP
waits, bounded oneDNN caches) and takes ~0.6 s. So loading this plugin imports nothing of
tinker_sr; its fixtures import what they use when a test uses them.

- ``tinker_mock``: `mock_tinker` for one test: any httpx client (the official SDK's,
  `tinker_sr`'s) that talks to ``$TINKER_BASE_URL`` reaches the `tinker-sr serve` app in this
  process; fresh store, offline model names, wire faults, trace. No socket, no key.
- ``tinker_server`` / ``tinker_server_session``: a real `tinker-sr serve` process on a free
  127.0.0.1 port (per test / per session), with the same faults and trace.
- ``tinker_sr_service`` and the fixtures after it: `tinker_sr` clients on the embedded engine
  with no HTTP at all (every base model name aliased to ``tinker-sr/tiny``).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Every fixture, for ``from tinker_sr_pytest_plugin import *`` (`tinker_sr.testing.plugin`):
# the autouse one's leading underscore would keep it out of a star import.
__all__ = [
    "_tinker_server_session_names",
    "tinker_mock",
    "tinker_server",
    "tinker_server_session",
    "tinker_sr_backend",
    "tinker_sr_faulty_service",
    "tinker_sr_service",
    "tinker_sr_store",
]


@pytest.fixture
def tinker_mock(tmp_path: Path) -> Iterator[Any]:
    """A `tinker_sr.testing.mock.MockTinker` serving ``$TINKER_BASE_URL`` in-process."""
    from tinker_sr.testing.mock import mock_tinker

    with mock_tinker(store=tmp_path / "tinker_mock") as mock:
        yield mock


_SERVER_FIXTURES = frozenset({"tinker_server", "tinker_server_session"})
_UNCLOSED = r"unclosed (transport|<socket|<ssl|<asyncio)"


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """A test using a server fixture, under ``-W error`` (``filterwarnings = error``): the
    official SDK closes its connections in ``__del__``, on no schedule, and the unclosed-socket
    warnings failed this test or whichever later one the collector happened to run in. Such
    warnings are ignored while the test runs, and what it left is collected before the next
    one. Other resource warnings (a test's own leaks) are raised as before."""
    if not (_SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))):
        return (yield)
    collect = _resource_warnings_are_errors()  # inside pytest's own filters (tryfirst)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _UNCLOSED, ResourceWarning)
        try:
            return (yield)
        finally:
            if collect:
                gc.collect()


def _resource_warnings_are_errors() -> bool:
    """Whether the first warnings filter for the category ``ResourceWarning`` (any message)
    raises it."""
    for action, _message, category, _module, _line in warnings.filters:
        if issubclass(ResourceWarning, category):
            return action == "error"
    return False


@pytest.fixture
def tinker_server(tmp_path: Path) -> Iterator[Any]:
    """A `tinker_sr.testing.server.ServerProcess` (testing mode) for one test: ``base_url``,
    ``api_key``, ``add_fault``, ``trace``. Stopped afterwards; its store is the test's."""
    from tinker_sr.testing.server import tinker_server_process

    with tinker_server_process(tmp_path / "tinker_server") as srv:
        yield srv


@pytest.fixture(scope="session")
def tinker_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`tinker_server` shared by the whole session (start-up paid once; faults you add stay
    planned until you ``clear_faults()``). Hub tokenizer names load the offline tokenizer in
    the tests that use it, and only there (`_tinker_server_session_names`)."""
    from tinker_sr.testing.server import running_server

    with running_server(tmp_path_factory.mktemp("tinker_server"), testing=True) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _tinker_server_session_names(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a test that uses `tinker_server_session` (directly or through its own fixtures):
    offline tokenizer names and fresh SDK connections for that test's duration. Other tests of
    the session load tokenizers as they would without the plugin (the patch used to last from
    the fixture's first use to the end of the session)."""
    if "tinker_server_session" not in request.fixturenames:
        yield
        return
    from tinker_sr.testing.server import offline_clients

    with offline_clients(request.getfixturevalue("tinker_server_session")):
        yield


@pytest.fixture
def tinker_sr_store(tmp_path: Path) -> Path:
    """A fresh store directory for checkpoints and recorded sequences."""
    store = tmp_path / "tinker_sr_store"
    store.mkdir()
    return store


@pytest.fixture
def tinker_sr_backend(tinker_sr_store: Path) -> Iterator[Any]:
    """An embedded backend on a fresh store, aliasing every base model to ``tinker-sr/tiny``."""
    from tinker_sr.backend.local import LocalBackend

    backend = LocalBackend(tinker_sr_store, model_aliases={"*": "tinker-sr/tiny"})
    yield backend
    backend.close()


@pytest.fixture
def tinker_sr_service(tinker_sr_backend: Any) -> Iterator[Any]:
    """A `tinker_sr.ServiceClient` on `tinker_sr_backend`; closed after the test."""
    from tinker_sr import ServiceClient

    client = ServiceClient(backend=tinker_sr_backend)
    yield client
    client.close().result()


@pytest.fixture
def tinker_sr_faulty_service(tinker_sr_backend: Any) -> Iterator[Any]:
    """``(service_client, faulty_backend)``: add `tinker_sr.testing.faults.Fault`s to
    ``faulty_backend`` to make chosen backend calls fail or stall."""
    from tinker_sr import ServiceClient
    from tinker_sr.testing.faults import FaultyBackend

    faulty = FaultyBackend(tinker_sr_backend)
    client = ServiceClient(backend=faulty)
    yield client, faulty
    client.close().result()
