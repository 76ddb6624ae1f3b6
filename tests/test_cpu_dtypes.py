"""A half-precision checkpoint on a CPU without hardware for its products computes in float32.

Found by a hunt on CPUs without fast bf16 (oneDNN capped to AVX2, and AVX-512 without BF16):
a bf16 Hugging Face directory loaded in bf16, as it is stored, and a training step took 38 s
instead of 1.07 s in float32 (1.7-2.0 s instead of 0.4-0.6 s on AVX-512 without BF16), with
nothing said. Most Hub checkpoints are bf16; many CPUs (AMD Zen 2/3, Intel Skylake) have no
bf16 products. The detection itself is tested in tests/engine/test_cpu.py; here it is patched.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tinker_sr
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.engine import hf
from tinker_sr.engine.export import export_checkpoint

pytest.importorskip("transformers")

from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402


@pytest.fixture
def bf16_dir(tmp_path: Path) -> Path:
    return make_tiny_hf_model_dir(tmp_path / "model", "qwen3", dtype="bfloat16")


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This CPU has no hardware for bf16 or fp16 products (as AVX2 or AVX-512 without BF16)."""
    monkeypatch.setattr(hf, "has_fast_half", lambda dtype: False, raising=False)
    return monkeypatch


def _train_and_save(backend: LocalBackend, model_dir: Path) -> tuple[torch.dtype, str]:
    """The base model's dtype in the engine, and a trained checkpoint's tinker path."""
    service = tinker_sr.ServiceClient(backend=backend)
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training.save_state("s").result().path
    dtype = backend.models.trainer(training.model_id).model.dtype
    service.close().result()
    return dtype, path


def test_a_bf16_checkpoint_computes_in_float32_where_bf16_is_emulated(
    bf16_dir: Path, tmp_path: Path, emulated: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backend = LocalBackend(tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="tinker_sr.engine"):
        dtype, path = _train_and_save(backend, bf16_dir)
    backend.close()
    assert dtype == torch.float32
    assert "stored in bfloat16, which this CPU computes without hardware support" in caplog.text
    assert "loading it in float32" in caplog.text
    assert "TINKER_SR_MODEL_DTYPE=bfloat16 keeps bfloat16" in caplog.text
    # A merged export is still written in the checkpoint's own dtype.
    out = export_checkpoint(path, tmp_path / "merged", merge=True, store_dir=tmp_path / "store")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_a_chosen_dtype_and_a_cpu_with_bf16_keep_the_checkpoints(
    bf16_dir: Path, tmp_path: Path, emulated: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tinker_sr.engine"):
        backend = LocalBackend(tmp_path / "chosen", model_dtype="bfloat16")
        assert _train_and_save(backend, bf16_dir)[0] == torch.bfloat16
        backend.close()
        emulated.setattr(hf, "has_fast_half", lambda dtype: True)
        backend = LocalBackend(tmp_path / "fast")
        assert _train_and_save(backend, bf16_dir)[0] == torch.bfloat16
        backend.close()
    assert "stored in bfloat16" not in caplog.text


def test_float32_that_would_not_fit_keeps_the_stored_dtype(
    tmp_path: Path, emulated: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    emulated.setattr(hf, "available_memory", lambda: 3 << 30)
    with caplog.at_level(logging.WARNING, logger="tinker_sr.engine"):
        assert hf.cpu_dtype(tmp_path, torch.bfloat16, 10**9) == torch.bfloat16  # 4 GB in fp32
        assert hf.cpu_dtype(tmp_path, torch.float16, 10**8) == torch.float32
        assert hf.cpu_dtype(tmp_path, torch.float32, 10**9) == torch.float32
    assert "kept in bfloat16: twice its float32 size does not fit in the 3.00 GiB" in caplog.text
    emulated.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    with caplog.at_level(logging.WARNING, logger="tinker_sr.engine"):
        hf.cpu_dtype(tmp_path, torch.bfloat16, 10)
    assert "without hardware support (oneDNN is capped to AVX2)" in caplog.text
    assert "stored in float16" in caplog.text and "loading it in float32" in caplog.text
