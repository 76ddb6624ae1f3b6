"""Property: a real server answers any request, on any route of its own route table, with a
status below 500 (an error carrying a JSON ``detail``), and any request it accepts ends as a
result or a user error, never a "server" error. Ids in the requests are real ones half the
time, so the checks behind ownership are reached too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._server import ServerProcess, running_server
from tests.fuzz.conftest import FUZZ
from tests.test_server import MODEL, Wire
from tinker_sr.backend.local import LocalBackend
from tinker_sr.server.app import create_app
from tinker_sr.testing.adversary import Adversary, AttackRequest, judge, route_table, send


def _routes() -> list[tuple[str, str]]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        backend = LocalBackend(Path(d), persistent=False)
        try:
            return route_table(create_app(backend))
        finally:
            backend.close()


ROUTES = _routes()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("fuzz_store")) as srv:
        yield srv


@pytest.fixture(scope="module")
def ids(server: ServerProcess) -> dict[str, Any]:
    wire = Wire(server.base_url)
    session_id = wire.session()
    model_id = wire.model(session_id)
    save = {"model_id": model_id, "path": "ck", "seq_id": wire.next_seq(model_id)}
    path = wire.wait(wire.ok("save_weights", save)).json()["path"]
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": MODEL}
    sampler = wire.ok("create_sampling_session", body)["sampling_session_id"]
    return {
        "session_id": session_id,
        "model_id": model_id,
        "run_id": model_id,
        "sampler_id": sampler,
        "checkpoint": path,
        "kind": "weights",
        "name": "ck",
    }


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.base_url, headers={"X-API-Key": "tml-fuzz"}, timeout=120
    ) as c:
        yield c


def test_the_route_table_is_read_from_the_app() -> None:
    paths = {p for _, p in ROUTES}
    assert "/api/v1/asample" in paths and "/api/v1/training_runs/{run_id}" in paths


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), route=st.sampled_from(ROUTES))
def test_any_request_on_any_route_is_answered_below_500(
    http: httpx.Client, ids: dict[str, Any], seed: int, route: tuple[str, str]
) -> None:
    req = Adversary(seed, ROUTES, ids).request(route)
    problem = judge(http, send(http, req))
    assert problem is None, (req, problem)


json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10,
)  # fmt: skip
JSON_POSTS = [p for m, p in ROUTES if m == "POST" and "{" not in p and "forward_backward" not in p]


@FUZZ
@given(path=st.sampled_from(JSON_POSTS), body=json_values)
def test_any_json_body_is_answered_below_500(
    http: httpx.Client, ids: dict[str, Any], path: str, body: Any
) -> None:
    req = AttackRequest("POST", path, json.dumps(body).encode())
    problem = judge(http, send(http, req))
    assert problem is None, (req, problem)
    assert http.get("/api/v1/healthz").status_code == 200
