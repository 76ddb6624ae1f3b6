"""The merged-LoRA projection groups (`engine.fused`) against the per-layer LoRA path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinker_sr.engine import fused
from tinker_sr.engine.lora import LoraSpec, apply_lora, trainable_parameters
from tinker_sr.engine.model import BUILTIN_CONFIGS, build_model


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    # Projection biases (attention_bias) too, so the merged path's bias handling is covered.
    config = dataclasses.replace(BUILTIN_CONFIGS["tinker-sr/tiny"], attention_bias=True)
    model = build_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    apply_lora(model, LoraSpec(rank=2, seed=seed))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in trainable_parameters(model):
            if "lora_B" in name:  # B = 0 at init would hide the adapter's part of the math
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.to(dtype)


def _grads(
    enabled: bool, tokens: torch.Tensor, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> list[torch.Tensor]:
    monkeypatch.setattr(fused, "ENABLED", enabled)
    model = _model(dtype=dtype)
    logits = model(tokens)
    (logits.logsumexp(-1) - logits[..., 3]).sum().backward()
    return [logits.detach()] + [p.grad for _, p in trainable_parameters(model)]  # type: ignore[misc]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merged_groups_match_the_per_layer_adapters(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    calls: list[int] = []
    original = fused._MergedLoraGroup.apply
    monkeypatch.setattr(fused._MergedLoraGroup, "apply", lambda *a: calls.append(1) or original(*a))
    ref = _grads(False, tokens, dtype, monkeypatch)
    assert not calls
    got = _grads(True, tokens, dtype, monkeypatch)
    assert len(calls) == 3 * 2  # groups q/k/v, o and gate/up in each of 2 layers (down: mlp_down)
    for a, b in zip(got, ref, strict=True):
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
        else:  # rounding differs (one merged GEMM vs two products): compare as vectors
            assert float((a - b).norm() / b.norm()) < 1e-5


def test_small_batches_keep_the_per_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-sized inputs (a few tokens) never pay for a weight-sized merge."""
    model = _model()
    calls: list[int] = []
    original = fused._MergedLoraGroup.apply
    monkeypatch.setattr(fused._MergedLoraGroup, "apply", lambda *a: calls.append(1) or original(*a))
    model(torch.zeros((2, 3), dtype=torch.long))
    assert not calls


def test_merged_forward_equals_sampling_on_merged_weights() -> None:
    """The merged group forms W + (B A) s exactly as a merged sampler's weights are formed."""
    from tinker_sr.engine.lora import clone_for_sampling

    model = _model()
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = clone_for_sampling(model)(tokens)
        got = model(tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_swiglu_gradients_equal_autograd_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(4)
    gate, up, dh = (torch.randn(5, 7, generator=gen) for _ in range(3))
    grads = []
    for fn in (fused.swiglu, lambda g, u: torch.nn.functional.silu(g) * u):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = fn(g, u)
        out.backward(dh)
        grads.append((out.detach(), g.grad, u.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_mlp_down_matches_swiglu_then_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused SwiGLU + merged down projection (recomputing its input in backward)."""
    model = _model(dtype=torch.float64)
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    gen = torch.Generator().manual_seed(5)
    gate, up, dy = (torch.randn(64, 256, generator=gen, dtype=torch.float64) for _ in range(3))
    dy = dy[:, :64]
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(fused, "ENABLED", enabled)
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = fused.mlp_down(g, u, down)
        wrt = [g, u, down.lora_A.weight, down.lora_B.weight]
        results.append([out, *torch.autograd.grad(out, wrt, dy)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_frozen_cast_is_kept_until_the_weight_changes() -> None:
    w = torch.randn(4, 3)
    low = fused.frozen_cast(w, torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low, w.to(torch.bfloat16))
    assert fused.frozen_cast(w, torch.bfloat16) is low  # cast once
    with torch.no_grad():
        w.add_(1.0)  # a weight changed in place is cast again
    again = fused.frozen_cast(w, torch.bfloat16)
    assert again is not low and torch.equal(again, w.to(torch.bfloat16))
