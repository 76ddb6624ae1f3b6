"""Device selection (`engine.device`): cpu by default, cuda only when there is one, and the
explicit CPU path identical to the default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.cli import build_parser, device_from_args
from tinker_sr.engine import device as engine_device

from .small_lora import small_lora_client

TOKENS = [256, *b"the same step on every device"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_default_explicit_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(engine_device.DEVICE_ENV, raising=False)
    assert engine_device.resolve_device() == torch.device("cpu")
    assert engine_device.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_device.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setenv(engine_device.DEVICE_ENV, "auto")
    assert engine_device.resolve_device() == torch.device("cpu")


def test_cuda_without_cuda_names_the_setting_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda' but CUDA is not available.*'cpu'"):
        engine_device.resolve_device("cuda")
    monkeypatch.setenv(engine_device.DEVICE_ENV, "cuda")
    with pytest.raises(ValueError, match=r"TINKER_SR_DEVICE='cuda' but CUDA is not available"):
        engine_device.resolve_device()
    with pytest.raises(ValueError, match=r"device='tpu' is not a device; use one of cpu, cuda"):
        engine_device.resolve_device("tpu")


def test_cuda_index_beyond_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"1 CUDA device\(s\); use cuda:0 .. cuda:0"):
        engine_device.resolve_device("cuda:3")


@no_cuda
def test_backend_and_serve_refuse_cuda_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"LocalBackend\(device=\.\.\.\)='cuda' but CUDA"):
        LocalBackend(tmp_path, device="cuda")
    args = build_parser().parse_args(["serve", "--device", "cuda"])
    with pytest.raises(SystemExit, match="tinker-sr serve: --device='cuda' but CUDA"):
        device_from_args(args)
    assert device_from_args(build_parser().parse_args(["serve", "--device", "cpu"])) == "cpu"


def _train_and_sample(backend: LocalBackend) -> tuple[float, list[np.ndarray], list[object]]:
    service, training, datum = small_lora_client(backend, TOKENS)
    fb = training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    out = sampler.sample(
        types.ModelInput.from_ints(TOKENS[:8]), num_samples=3, sampling_params=params
    ).result()
    logprobs = [o["logprobs"].to_numpy() for o in fb.loss_fn_outputs]
    sequences = [(s.tokens, s.logprobs) for s in out.sequences]
    service.close().result()
    backend.close()
    return fb.metrics["loss:sum"], logprobs, sequences


def test_explicit_cpu_is_bit_identical_to_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(engine_device.DEVICE_ENV, raising=False)
    ref = _train_and_sample(LocalBackend(tmp_path / "default"))
    got = _train_and_sample(LocalBackend(tmp_path / "cpu", device="cpu"))
    assert got[0] == ref[0]
    assert all(np.array_equal(a, b) for a, b in zip(got[1], ref[1], strict=True))
    assert got[2] == ref[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_train_step_and_sample_match_cpu(tmp_path: Path) -> None:
    """Same seeds on a GPU: the loss and log-probs within float tolerance of the CPU's; the
    sampled tokens may differ once a GPU rounding flips a draw, so only their count and the
    log-probs of a shared prefix are compared."""
    ref = _train_and_sample(LocalBackend(tmp_path / "cpu", device="cpu"))
    got = _train_and_sample(LocalBackend(tmp_path / "cuda", device="cuda"))
    assert got[0] == pytest.approx(ref[0], rel=1e-3)
    for a, b in zip(got[1], ref[1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-3, rtol=1e-3)
    for (tok_g, lp_g), (tok_r, lp_r) in zip(got[2], ref[2], strict=True):  # type: ignore[misc]
        same = 0
        while same < min(len(tok_g), len(tok_r)) and tok_g[same] == tok_r[same]:
            same += 1
        assert same >= 1  # the first token's uniforms and logits agree
        np.testing.assert_allclose(lp_g[:same], lp_r[:same], atol=1e-3, rtol=1e-3)
