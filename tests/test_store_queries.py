"""Reads that a key's requests make stay off full-table scans, however many sessions the
stores have seen (churn hunt, 100,000 past sessions: ``list_sessions`` 37 ms and
``get_session`` 18 ms on the server's event loop, billing usage 4.8 s holding the engine's
store while one query per session ran). Checked on SQLite's own query plans, not on time."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from tinker_sr.engine.store import Store
from tinker_sr.server.state import ServerState

MODEL = "tinker-sr/tiny"


def _plan(db: sqlite3.Connection, sql: str, args: tuple[object, ...]) -> str:
    return " | ".join(row[-1] for row in db.execute(f"EXPLAIN QUERY PLAN {sql}", args))


def test_a_keys_sessions_and_a_sessions_runs_are_read_by_index(tmp_path: Path) -> None:
    state = ServerState(tmp_path / "server.sqlite")
    try:
        db = state._db
        newest = _plan(
            db,
            "SELECT session_id FROM sessions WHERE owner=? ORDER BY rowid DESC LIMIT ? OFFSET ?",
            ("k", 20, 0),
        )  # `ServerState.session_ids_of`: no sort of all the key's sessions per page
        assert "USING INDEX sessions_of_owner" in newest and "TEMP B-TREE" not in newest, newest
        models = _plan(
            db,
            "SELECT m.model_id FROM models m JOIN sessions s ON m.session_id = s.session_id "
            "WHERE s.owner=?",
            ("k",),
        )
        assert "sessions_" in models and "models_session" in models, models
        # The index before `sessions_of_owner` (owner, created_at) was read by no query and
        # written with every session: a store that has it loses it.
        db.execute("CREATE INDEX sessions_owner ON sessions(owner, created_at)")
    finally:
        state.close()
    state = ServerState(tmp_path / "server.sqlite")
    try:
        indexes = {r[0] for r in state._db.execute("SELECT name FROM sqlite_master")}
        assert "sessions_of_owner" in indexes and "sessions_owner" not in indexes, indexes
    finally:
        state.close()
    store = Store(tmp_path / "engine.sqlite")
    try:
        runs = _plan(
            store._db,
            "SELECT run_id FROM training_runs WHERE session_id=? ORDER BY created_at, run_id",
            ("s",),
        )
        assert "USING INDEX training_runs_session" in runs, runs
    finally:
        store.close()


def test_session_attributes_of_many_sessions_in_few_queries(tmp_path: Path) -> None:
    store = Store(tmp_path / "engine.sqlite")
    try:
        for i in range(1200):
            store.add_session(
                f"s{i}", user_metadata={"i": str(i)}, project_id=f"p{i % 3}", display_name=None
            )
        queries: list[str] = []
        store._db.set_trace_callback(queries.append)
        got = store.session_attributes({f"s{i}" for i in range(1200)} | {"missing"})
        store._db.set_trace_callback(None)
        assert len(got) == 1200 and got["s7"] == ({"i": "7"}, "p1")
        assert sum("FROM sessions" in q for q in queries) == 3  # 1201 ids, 500 a query
    finally:
        store.close()


def test_a_callers_listings_read_its_own_runs_by_index(tmp_path: Path) -> None:
    """Before: a server listed one key's runs and checkpoints by building every owner's (a
    run's listing is a query per run) and filtering them in Python: 0.45 s and 0.35 s for 5,000
    runs of 20,000 checkpoints, holding the engine's store, per `tinker run list`."""
    from tinker_sr.engine.checkpoint_store import CheckpointStore
    from tinker_sr.engine.store import CheckpointRow

    store = Store(tmp_path / "engine.sqlite")
    try:
        for i in range(300):
            store.add_run(f"r{i}", f"s{i % 30}", "m", {"rank": 2}, None)
            path = f"tinker://r{i}/weights/w"
            row = CheckpointRow(f"r{i}", "weights/w", "training", path, f"f{i}", i, 1, None, None)
            store.put_checkpoint(row)
        mine = {"r3", "r150", "r299"}
        checkpoints = CheckpointStore(store, tmp_path / "ck", purge=False)
        queries: list[str] = []
        store._db.set_trace_callback(queries.append)
        runs = checkpoints.training_runs(limit=2, offset=1, runs=mine)
        listing = checkpoints.list_all(limit=2, offset=0, runs=mine)
        store._db.set_trace_callback(None)
        assert runs.cursor.total_count == 3 and listing.cursor.total_count == 3
        assert [r.training_run_id for r in runs.training_runs] == ["r150", "r3"]
        assert [c.tinker_path for c in listing.checkpoints] == [
            "tinker://r299/weights/w",
            "tinker://r150/weights/w",
        ]
        assert len(queries) <= 10, queries  # the pages' runs, not a query per run
        for table, sql in (
            ("training_runs", "SELECT * FROM training_runs WHERE run_id IN "),
            ("checkpoints", "SELECT * FROM checkpoints WHERE run_id IN "),
        ):
            plan = _plan(store._db, sql + "(SELECT value FROM json_each(?))", ('["r3"]',))
            assert f"SEARCH {table} USING" in plan, plan
    finally:
        store.close()


def test_a_backend_that_ignores_the_runs_filter_fails_closed(tmp_path: Path) -> None:
    """The server checks its backend's listings: a wrapping backend that drops ``runs=``
    answers an error, never another key's runs (before, they were listed)."""
    from collections.abc import Collection

    from starlette.testclient import TestClient

    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.server.app import create_app

    class Careless(LocalBackend):
        async def list_training_runs(  # type: ignore[override]
            self, *, limit: int = 20, offset: int = 0, runs: Collection[str] | None = None
        ) -> Any:
            return await super().list_training_runs(limit=limit, offset=offset)

        async def list_user_checkpoints(  # type: ignore[override]
            self, *, limit: int = 100, offset: int = 0, runs: Collection[str] | None = None
        ) -> Any:
            return await super().list_user_checkpoints(limit=limit, offset=offset)

    app = create_app(Careless(tmp_path), store_dir=tmp_path, close_backend=True, long_poll_s=0.5)
    with TestClient(app, raise_server_exceptions=False) as client:
        owner = {"X-API-Key": "tml-owner"}
        sid = client.post("/api/v1/create_session", json={"tags": []}, headers=owner).json()
        body = {"session_id": sid["session_id"], "model_seq_id": 0, "base_model": MODEL}
        made = client.post(
            "/api/v1/create_model", json=body | {"lora_config": {"rank": 2}}, headers=owner
        ).json()
        for _ in range(100):
            done = client.post(
                "/api/v1/retrieve_future", json={"request_id": made["request_id"]}, headers=owner
            ).json()
            if done.get("type") != "try_again":
                break
        run_id = done["model_id"]
        ckpt = {"model_id": run_id, "path": "mine", "seq_id": 1}
        saved = client.post("/api/v1/save_weights", json=ckpt, headers=owner).json()
        for _ in range(100):
            if (
                client.post(
                    "/api/v1/retrieve_future",
                    json={"request_id": saved["request_id"]},
                    headers=owner,
                )
                .json()
                .get("type")
                != "try_again"
            ):
                break
        assert run_id in client.get("/api/v1/training_runs", headers=owner).text
        other = {"X-API-Key": "tml-other"}
        for path in ("/api/v1/training_runs", "/api/v1/checkpoints"):
            resp = client.get(path, headers=other)
            assert resp.status_code == 500, (path, resp.text)
            assert run_id not in resp.text
