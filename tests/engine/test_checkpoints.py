from __future__ import annotations

import os

import pytest
import torch

from tinker_sr.engine.checkpoints import load_tensors, save_tensors
from tinker_sr.engine.lora import LoraSpec, apply_lora, load_lora_state_dict, lora_state_dict
from tinker_sr.engine.model import build_model
from tinker_sr.engine.optim import Adam, AdamHParams
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError


def test_round_trip_with_metadata_and_no_temp_files(tmp_path) -> None:
    path = tmp_path / "sub" / "weights.safetensors"
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
    size = save_tensors(path, tensors, {"kind": "lora", "rank": "4"})
    assert size == path.stat().st_size
    got, meta = load_tensors(path)
    assert meta == {"kind": "lora", "rank": "4"}
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert os.listdir(path.parent) == ["weights.safetensors"]


def test_overwrite_replaces_whole_file(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    save_tensors(path, {"x": torch.zeros(1000)}, {"v": "1"})
    save_tensors(path, {"y": torch.ones(2)}, {"v": "2"})
    got, meta = load_tensors(path)
    assert list(got) == ["y"] and meta == {"v": "2"}
    assert os.listdir(tmp_path) == ["w.safetensors"]


def test_failed_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch) -> None:
    path = tmp_path / "w.safetensors"
    save_tensors(path, {"x": torch.zeros(3)}, {})

    def boom(*_a: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_tensors(path, {"x": torch.ones(3)}, {})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["w.safetensors"]
    assert torch.equal(load_tensors(path)[0]["x"], torch.zeros(3))


def test_missing_file_is_not_found_with_path(tmp_path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(EngineNotFoundError, match="nope.safetensors"):
        load_tensors(missing)


def test_metadata_must_be_strings(tmp_path) -> None:
    with pytest.raises(EngineUserError, match="str"):
        save_tensors(tmp_path / "w.safetensors", {"x": torch.zeros(1)}, {"rank": 4})  # type: ignore[dict-item]


def test_shared_storage_tensors_are_saved(tmp_path) -> None:
    base = torch.randn(4, 4)
    save_tensors(tmp_path / "t.safetensors", {"a": base, "b": base, "c": base[1]}, {})
    save_tensors(tmp_path / "v.safetensors", {"row": base[2]}, {})
    assert torch.equal(load_tensors(tmp_path / "v.safetensors")[0]["row"], base[2])
    got, _ = load_tensors(tmp_path / "t.safetensors")
    assert (
        torch.equal(got["a"], base)
        and torch.equal(got["b"], base)
        and torch.equal(got["c"], base[1])
    )


def test_lora_and_optimizer_state_survive_a_checkpoint(tmp_path) -> None:
    model = build_model("tinker-sr/tiny")
    apply_lora(model, LoraSpec(rank=2, seed=0))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = Adam(params)
    model(torch.tensor([[1, 2, 3]])).logsumexp(-1).sum().backward()
    opt.step(AdamHParams(learning_rate=1e-2))
    save_tensors(tmp_path / "lora.safetensors", lora_state_dict(model), {"rank": "2"})
    save_tensors(tmp_path / "optim.safetensors", opt.state_dict(), {})

    fresh = build_model("tinker-sr/tiny")
    apply_lora(fresh, LoraSpec(rank=2, seed=1))
    load_lora_state_dict(fresh, load_tensors(tmp_path / "lora.safetensors")[0])
    fresh_opt = Adam([(n, p) for n, p in fresh.named_parameters() if p.requires_grad])
    fresh_opt.load_state_dict(load_tensors(tmp_path / "optim.safetensors")[0])
    tokens = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))
    assert fresh_opt.steps == opt.steps
