"""Stores and checkpoints across tinker_sr versions (hunt: old versions' stores opened by
this one, and this one's by old ones). A store or checkpoint of a later layout than this
version reads is refused saying so, and left as it is; an old store that a reader cannot
update reads as what it holds."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tinker_sr as tinker
from tinker_sr.engine.store import Store

from .conftest import embedded_client

MODEL = "tinker-sr/tiny"


def _rewrite_meta(tmp_path: Path, name: str, **changes: str) -> dict[str, str]:
    """Give checkpoint ``name``'s file the metadata ``changes`` (as another version would have
    written it); returns what it held."""
    (file,) = (tmp_path / "store").rglob(f"{name}.safetensors")
    with safe_open(str(file), framework="pt") as f:
        meta = dict(f.metadata())
    save_file(load_file(str(file)), str(file), metadata=meta | changes)
    return meta


def _user_version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def test_a_store_of_a_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    from tinker_sr.engine.store import StoreTooNewError
    from tinker_sr.engine.store_files import STORE_SCHEMA

    store = tmp_path / "store"
    with embedded_client(store.parent) as service:  # the fixture's store: <tmp>/store
        service.create_lora_training_client(MODEL, rank=2).result().save_state("a").result()
    database = store / "engine.sqlite"
    assert _user_version(database) == STORE_SCHEMA  # stamped by this version
    with sqlite3.connect(database) as db:
        db.execute(f"PRAGMA user_version = {STORE_SCHEMA + 1}")
        tables = db.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall()
    for read_only in (False, True):
        with pytest.raises(StoreTooNewError, match="written by a newer tinker_sr"):
            Store(database, read_only=read_only)
    done = subprocess.run(
        [sys.executable, "-m", "tinker_sr", "serve", "--port", "0", "--store", str(store)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "upgrade tinker_sr" in done.stderr
    with sqlite3.connect(database) as db:  # nothing was changed
        assert db.execute("PRAGMA user_version").fetchone()[0] == STORE_SCHEMA + 1
        assert db.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall() == tables


def test_a_server_state_of_a_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    """server.sqlite is versioned as engine.sqlite is (it was not: a later change to it would
    have been misread, not refused)."""
    from tinker_sr.engine.store import StoreTooNewError
    from tinker_sr.server.state import SERVER_SCHEMA, ServerState

    database = tmp_path / "server.sqlite"
    ServerState(database).close()
    assert _user_version(database) == SERVER_SCHEMA  # stamped
    with sqlite3.connect(database) as db:
        db.execute(f"PRAGMA user_version = {SERVER_SCHEMA + 1}")
    with pytest.raises(StoreTooNewError, match=f"reads up to {SERVER_SCHEMA}\\); upgrade"):
        ServerState(database)
    assert _user_version(database) == SERVER_SCHEMA + 1  # left as it is
    with sqlite3.connect(database) as db:
        db.execute(f"PRAGMA user_version = {SERVER_SCHEMA}")
    ServerState(database).close()  # the refusal let go of the store


def _add_a_column_to_every_table(db_path: Path) -> None:
    """What a later version does to a store it opens (new fields: ALTER TABLE ADD COLUMN)."""
    db = sqlite3.connect(db_path)
    tables = [
        r[0]
        for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
        if not r[0].startswith("sqlite_")  # SQLite's own (sqlite_sequence: AUTOINCREMENT's)
    ]
    for table in tables:
        db.execute(f"ALTER TABLE {table} ADD COLUMN later_field TEXT")
    db.commit()
    db.close()


def test_a_store_a_later_version_added_columns_to_is_used_as_before(tmp_path: Path) -> None:
    """Downgrade hunt: older versions inserted rows without naming columns and failed "table
    ... has 10 columns but 9 values were supplied" on a store a newer one had opened; every
    row is now read and written by column name."""
    from tinker_sr.server.state import ServerState

    with embedded_client(tmp_path) as service:  # a whole run: sessions, runs, sequences, usage
        training = service.create_lora_training_client(MODEL, rank=2).result()
        training.save_state("before").result()
    state = ServerState(tmp_path / "server.sqlite")
    state.close()
    for name in ("engine.sqlite", "server.sqlite"):
        _add_a_column_to_every_table(tmp_path / "store" / name if name == "engine.sqlite"
                                     else tmp_path / name)  # fmt: skip

    with embedded_client(tmp_path) as service:
        training = service.create_training_client_from_state(
            f"tinker://{training.model_id}/weights/before"
        ).result()
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
        prompt = tinker.ModelInput.from_ints([1, 2, 3])
        sampled = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=3)).result()
        assert sampled.sequences[0].sequence_id
        rest = tinker.RestClient(service.holder)
        assert [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    state = ServerState(tmp_path / "server.sqlite")
    state.add_session("s", "owner")
    state.add_model("m", "s")
    state.save_reply("owner", "k", "h", {"ok": True})
    assert state.session_ids_of("owner", limit=5, offset=0) == ["s"]
    state.close()


def test_a_checkpoint_of_a_newer_format_is_refused_saying_so(tmp_path: Path) -> None:
    """Before: a checkpoint saying format tinker_sr/2 loaded as if it were /1."""
    with embedded_client(tmp_path) as service:
        tc = service.create_lora_training_client(MODEL, rank=2).result()
        path = tc.save_state("a").result().path
        assert _rewrite_meta(tmp_path, "a", format="tinker_sr/2")["format"] == "tinker_sr/1"
        with pytest.raises(tinker.RequestFailedError, match="written by a newer tinker_sr"):
            service.create_training_client_from_state(path).result()


def test_an_old_read_only_store_without_usage_reports_no_usage(tmp_path: Path) -> None:
    """A store from before usage was recorded, read where it cannot be updated: before,
    `tinker-sr usage` failed "no such table: usage"."""
    database = tmp_path / "engine.sqlite"
    Store(database).close()
    with sqlite3.connect(database) as db:
        db.execute("DROP TABLE usage")
    store = Store(database, read_only=True)
    try:
        assert store.usage_rows(0, 2**40) == []
    finally:
        store.close()


def test_a_checkpoint_naming_its_base_by_a_relative_path_warns_where_it_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """tinker_sr before 493d695 recorded ``base_model="./model"`` as typed; loaded from another
    directory holding another ``./model`` of the same shapes, it ran on the wrong weights
    without a word (hunt). This version records the absolute directory; an old record says
    where it resolves now, and how to name the right model."""
    from tinker_sr.testing.offline_model import offline_model_dir

    model = offline_model_dir(tmp_path)
    monkeypatch.chdir(model.parent)
    relative = f"./{model.name}"
    with embedded_client(tmp_path) as service:
        tc = service.create_lora_training_client(relative, rank=2).result()
        path = tc.save_state("old").result().path
        was = _rewrite_meta(tmp_path, "old", base_model=relative)
        assert was["base_model"] == str(model)  # recorded as its absolute directory
        with caplog.at_level("WARNING", logger="tinker_sr"):
            service.create_training_client_from_state(path).result()
    assert f"relative path {relative!r}" in caplog.text and str(model.parent) in caplog.text


def test_the_official_sdk_deletes_an_old_percent_named_checkpoint_not_its_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Older tinker_sr accepted "%" in checkpoint names. The official SDK puts a name into
    the URL unquoted, so deleting "pct%41" reached the server as "pct%41", decoded "pctA":
    the other checkpoint was deleted (hunt)."""
    import tinker

    from tinker_sr.engine import checkpoint_store
    from tinker_sr.testing import mock_tinker

    with mock_tinker() as mock:
        svc = tinker.ServiceClient()
        tc = svc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=2).result()
        with monkeypatch.context() as old_version:  # its saves took any name
            old_version.setattr(checkpoint_store, "check_name", lambda name: None)
            mock.backend.checkpoints.write(
                tc.model_id, "weights", "pct%41", {"x": torch.zeros(1)}, {},
                ttl_seconds=None, overwrite=False, user_metadata=None,
            )  # fmt: skip
        kept = tc.save_state("pctA").result().path
        rest = tinker.RestClient()
        rest.delete_checkpoint_from_tinker_path(f"tinker://{tc.model_id}/weights/pct%41").result()
        names = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        assert names == ["weights/pctA"], names
        assert rest.get_weights_info_by_tinker_path(kept).result() is not None
        svc.close("success").result(timeout=30)


def test_a_reader_leaves_an_older_stores_schema_version_as_it_is(tmp_path: Path) -> None:
    """`tinker-sr usage` or `export` beside an older server still running on its store: the
    reader adds what it reads but leaves the version, so that server starts again on it
    (before: stamped, and its next start was refused as "written by a newer tinker_sr", a
    hunt). A writer (an engine, a server) still stamps it."""
    path = tmp_path / "engine.sqlite"
    Store(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 1")
    Store.for_reading(path).close()
    assert _user_version(path) == 1
    Store(path).close()
    from tinker_sr.engine.store_files import STORE_SCHEMA

    assert _user_version(path) == STORE_SCHEMA
