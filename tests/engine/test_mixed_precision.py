"""bf16 mixed-precision training (``TINKER_SR_TRAIN_DTYPE``) against the fp32 reference."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tinker_sr.backend.local import LocalBackend
from tinker_sr.engine import cpu
from tinker_sr.engine import device as engine_device

from .small_lora import small_lora_client

TOKENS = [256, *b"mixed precision keeps fp32 master weights"]


def _step(
    tmp: Path, dtype: str, monkeypatch: pytest.MonkeyPatch, device: str | None = None
) -> tuple[float, np.ndarray]:
    """One step on ``device`` (default: ``$TINKER_SR_DEVICE``, so the suite also runs on a GPU
    with ``TINKER_SR_DEVICE=cuda``)."""
    monkeypatch.setenv(engine_device.TRAIN_DTYPE_ENV, dtype)
    backend = LocalBackend(tmp / dtype, device=device)
    service, training, datum = small_lora_client(backend, TOKENS)
    out = training.forward_backward([datum], "cross_entropy").result()
    trainer = backend.models.trainer(training.model_id)
    assert trainer.model.autocast_dtype == (torch.bfloat16 if dtype != "float32" else None)
    params = [p for _, p in trainer.optim.params]
    grads = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    assert all(p.dtype == torch.float32 for p in params)  # fp32 master weights
    service.close().result()
    backend.close()
    return out.metrics["loss:sum"], grads.cpu().numpy()


def test_bf16_step_matches_fp32_within_tolerance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref_loss, ref_grad = _step(tmp_path, "float32", monkeypatch)
    loss, grad = _step(tmp_path, "bf16-force", monkeypatch)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    cosine = float(grad @ ref_grad / (np.linalg.norm(grad) * np.linalg.norm(ref_grad)))
    assert cosine > 0.99
    assert np.linalg.norm(grad - ref_grad) / np.linalg.norm(ref_grad) < 0.1


def test_train_dtype_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_device.TRAIN_DTYPE_ENV, "bf16")
    expected = torch.bfloat16 if cpu.has_fast_bf16() else None
    assert engine_device.train_autocast_dtype() == expected
    monkeypatch.setenv(engine_device.TRAIN_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="TINKER_SR_TRAIN_DTYPE must be"):
        engine_device.train_autocast_dtype()


def test_bf16_asked_for_where_it_is_emulated_says_float32_runs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: ``TINKER_SR_TRAIN_DTYPE=bf16`` on a CPU without AMX / AVX512-BF16 trained in
    float32 without a word (a hunt found nothing in the log, the metrics or serve's output)."""
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    monkeypatch.setattr(engine_device, "has_fast_bf16", lambda: False)
    monkeypatch.setenv(engine_device.TRAIN_DTYPE_ENV, "bf16")
    engine_device._note_bf16_declined.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tinker_sr.engine"):
        assert engine_device.train_autocast_dtype() is None
        assert engine_device.train_autocast_dtype() is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "TINKER_SR_TRAIN_DTYPE=bf16 but this CPU has no AMX or AVX512-BF16" in said[0]
    assert "training in float32; TINKER_SR_TRAIN_DTYPE=bf16-force" in said[0]
    monkeypatch.setenv(engine_device.TRAIN_DTYPE_ENV, "bf16-force")
    assert engine_device.train_autocast_dtype() == torch.bfloat16


def test_bf16_logits_widened_in_pieces_equal_the_whole_chunk_widened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under bf16 autocast the head's logits are exponentiated in float32 a few rows at a
    time (`loss_logprobs._exp_rows`): bit-identical to widening the whole chunk at once."""
    from tinker_sr.engine import loss_logprobs

    gen = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(48, 300, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 48, generator=gen))
    h0 = torch.randn(77, 48, generator=gen)  # 77 rows: pieces of 32, 32 and 13
    cols = torch.randint(0, 300, (77, 2), generator=gen)
    grad = torch.randn(77, 2, generator=gen)
    got = []
    for rows in (loss_logprobs._EXP_ROWS, 10**9):  # pieces; one piece = the whole chunk
        monkeypatch.setattr(loss_logprobs, "_EXP_ROWS", rows)
        h = h0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (logp,), _ = loss_logprobs.head_logprobs([h], [cols], head)
        (dh,) = torch.autograd.grad(logp, (h,), grad)
        got.append((logp.detach(), dh))
    assert got[0][0].dtype == torch.float32
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (4, 4, 32), (6, 2, 48)])
def test_bf16_attention_matches_float64_sdpa_to_bf16_rounding(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """`bf16_attention.bf16_causal_attention` (bf16 GEMMs, float32 softmax) against float64 SDPA:
    output and all three gradients within bf16 rounding (the error of torch's own bf16 SDPA
    on the same inputs is of the same size: ~1 % of the largest entry)."""
    from tinker_sr.engine.bf16_attention import bf16_causal_attention

    gen = torch.Generator().manual_seed(heads)
    b, t = 3, 80
    q0 = torch.randn(b, heads, t, head_dim, generator=gen) * 2
    k0 = torch.randn(b, kv_heads, t, head_dim, generator=gen) * 2
    v0 = torch.randn(b, kv_heads, t, head_dim, generator=gen)
    do = torch.randn(b, heads, t, head_dim, generator=gen)
    ref_in = [x.double().requires_grad_() for x in (q0, k0, v0)]
    ref_o = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    ref = [ref_o, *torch.autograd.grad(ref_o, ref_in, do.double())]
    low_in = [x.bfloat16().requires_grad_() for x in (q0, k0, v0)]
    o = bf16_causal_attention(*low_in)
    got = [o, *torch.autograd.grad(o, low_in, do.bfloat16())]
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == r.shape
        err = (a.double() - r).abs().max() / r.abs().max()
        assert err < 3e-2, (name, float(err))
    # A query may only see its past: perturbing the last key moves no earlier output.
    k1 = low_in[1].detach().clone()
    k1[:, :, -1] += 5
    o1 = bf16_causal_attention(low_in[0].detach(), k1, low_in[2].detach())
    assert torch.equal(o1[:, :, :-1], o.detach()[:, :, :-1])


def test_bf16_training_runs_attention_through_the_gemm_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinker_sr.engine import bf16_attention

    calls = []
    real = bf16_attention._BF16CausalAttention.apply
    monkeypatch.setattr(
        bf16_attention._BF16CausalAttention, "apply", lambda *a: calls.append(1) or real(*a)
    )
    _step(tmp_path, "bf16-force", monkeypatch, device="cpu")  # a CPU kernel: CUDA has SDPA's
    assert calls
