"""A disk that fills during a run (hunt on a 40 MB tmpfs): a request is reported failed only
if it changed nothing, and a failure leaves no file behind taking the space.

The store's writes fail here as they do on a full disk: SQLite's "database or disk is full"
raised where the engine writes a row."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest
from safetensors import SafetensorError

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.engine.checkpoint_store import CheckpointStore
from tinker_sr.engine.store import Store
from tinker_sr.engine.store_files import is_out_of_space

from .conftest import embedded_client

MODEL = "tinker-sr/tiny"
IDS = list(range(1, 40))
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints(IDS),
    loss_fn_inputs={"target_tokens": IDS, "weights": [1.0] * len(IDS)},
)


def _full(*_: object, **__: object) -> None:
    raise sqlite3.OperationalError("database or disk is full")


def _loss_after_a_step(service: tinker.ServiceClient) -> float:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=3).result()
    tc.forward_backward([DATUM], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return float(tc.forward([DATUM], "cross_entropy").result().metrics["loss:sum"])


def test_training_whose_usage_cannot_be_recorded_succeeds_and_counts_once(
    embedded_service: tinker.ServiceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: forward_backward failed "out of disk space ... then retry" after its gradients
    were added, so a retry (as advised) added them twice (the hunt's loss after the step
    equalled a run that trained on the datum twice)."""
    expected = _loss_after_a_step(embedded_service)
    for write in ("add_usage", "touch_run", "touch_sequences"):
        monkeypatch.setattr(Store, write, _full)
    assert _loss_after_a_step(embedded_service) == expected
    tc = embedded_service.create_lora_training_client(MODEL, rank=4, seed=3).result()
    path = tc.save_state("kept").result().path  # its usage row is lost, not the checkpoint
    assert embedded_service.create_training_client_from_state(path).result() is not None
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(IDS[:4])
    assert sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences


@pytest.mark.parametrize("kind", ["save_state", "save_weights_external"])
def test_a_checkpoint_that_cannot_be_recorded_leaves_no_file(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the checkpoint's file stayed, whole and unlisted, for good (no sweep knows
    it): each failed save on a nearly full disk kept the space the user was short of."""
    with embedded_client(tmp_path) as service:
        tc = service.create_lora_training_client(MODEL, rank=4).result()
        before = {p for p in tmp_path.rglob("*") if p.is_file()}
        monkeypatch.setattr(CheckpointStore, "_record", _full)
        with pytest.raises(tinker.RequestFailedError, match="out of disk space"):
            getattr(tc, kind)("lost").result()
        monkeypatch.undo()
        left = {p for p in tmp_path.rglob("*") if p.is_file()} - before
        assert not [p for p in left if "lost" in str(p)], left
        assert getattr(tc, kind)("lost").result().path.endswith("/lost")  # the name is free


def test_full_disks_in_other_words_are_said_as_such() -> None:
    """safetensors' errors are not OSErrors (a full TMPDIR while spilling sampler adapters
    was an "internal error: SafetensorError"), and a file-size limit (``ulimit -f``) is
    EFBIG."""
    for os_error in ("No space left on device (os error 28)", "File too large (os error 27)"):
        assert is_out_of_space(SafetensorError(f"Error while serializing: I/O error: {os_error}"))
    assert is_out_of_space(OSError(errno.EFBIG, "File too large"))
    assert not is_out_of_space(SafetensorError("Error while serializing: Is a directory"))
