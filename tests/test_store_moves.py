"""A store is self-contained: moved, copied (a backup restored), or opened from another
directory, it finds its own checkpoint files. Before, each row named its file by the path
the store had been opened with, so a moved store listed checkpoints it could not load ("file
not found"), a relative `--store` broke when started from elsewhere, and a copy read, and
deleted, the original's files."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend

DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]}
)


def _save(store: Path) -> tuple[str, float]:
    """A trained state saved in ``store``: its path, and the loss its weights give."""
    backend = LocalBackend(store)
    service = tinker.ServiceClient(backend=backend)
    try:
        tc = service.create_lora_training_client("tinker-sr/tiny", rank=4, seed=1).result()
        tc.forward_backward([DATUM], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        path = tc.save_state("s").result().path
        return path, tc.forward([DATUM], "cross_entropy").result().metrics["loss:sum"]
    finally:
        service.close().result()
        backend.close()


def _loss_after_load(store: Path, path: str, *, delete: bool = False) -> float:
    backend = LocalBackend(store)
    service = tinker.ServiceClient(backend=backend)
    try:
        tc = service.create_training_client_from_state(path).result()
        loss = tc.forward([DATUM], "cross_entropy").result().metrics["loss:sum"]
        if delete:
            tinker.RestClient(service.holder).delete_checkpoint_from_tinker_path(path).result()
        return loss
    finally:
        service.close().result()
        backend.close()


def _file(store: Path) -> Path:
    (found,) = store.glob("checkpoints/*/weights/s.safetensors")
    return found


def test_a_moved_or_copied_store_loads_and_deletes_its_own_files(tmp_path: Path) -> None:
    path, loss = _save(tmp_path / "a")
    (tmp_path / "a").rename(tmp_path / "b")  # moved
    assert _loss_after_load(tmp_path / "b", path) == loss
    shutil.copytree(tmp_path / "b", tmp_path / "c")  # a backup, restored beside it
    assert _loss_after_load(tmp_path / "c", path, delete=True) == loss
    assert list((tmp_path / "c").glob("checkpoints/*/weights/s.safetensors")) == []
    assert _file(tmp_path / "b").is_file()  # the original kept its file
    assert _loss_after_load(tmp_path / "b", path) == loss


def test_a_relative_store_opened_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "proj").mkdir()
    monkeypatch.chdir(tmp_path / "proj")
    path, loss = _save(Path("store"))  # `tinker-sr serve --store store`, run in proj/
    monkeypatch.chdir(tmp_path)
    assert _loss_after_load(Path("proj/store"), path) == loss


def test_rows_written_with_full_paths_are_rebased_when_the_store_opens(tmp_path: Path) -> None:
    """A store written before: its rows hold the full path of where it was then."""
    path, loss = _save(tmp_path / "old")
    db = sqlite3.connect(tmp_path / "old" / "engine.sqlite")
    rel = db.execute("SELECT file_path FROM checkpoints").fetchone()[0]
    assert rel.startswith("checkpoints/") and not Path(rel).is_absolute()
    db.execute("UPDATE checkpoints SET file_path=?", (f"/gone/elsewhere/store/{rel}",))
    db.commit()
    db.close()
    assert _loss_after_load(tmp_path / "old", path) == loss
    db = sqlite3.connect(tmp_path / "old" / "engine.sqlite")
    assert db.execute("SELECT file_path FROM checkpoints").fetchone()[0] == rel
    db.close()
