"""pytest plugin: offline Tinker fixtures (registered through the ``pytest11`` entry point).

``tinker_sr_service`` gives a `ServiceClient` on the embedded engine with a fresh store in a
temporary directory and every base model name aliased to the tiny built-in model, so an RL
script under test runs in seconds with no key, network or GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


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
