"""The merged-LoRA projection groups (`engine.fused`) against the per-layer LoRA path."""

from __future__ import annotations

import copy
import dataclasses
import statistics

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
    assert len(calls) == 3 * 2  # groups q/k/v, o and gate/up in each of 2 layers (down: swiglu_mlp)
    for a, b in zip(got, ref, strict=True):
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
        else:  # rounding differs (one merged GEMM vs two products): compare as vectors
            assert float((a - b).norm() / b.norm()) < 1e-5


def test_a_one_member_group_is_its_merged_output_unsplit() -> None:
    """The output projection alone: its merged GEMM's result itself, not a one-piece split of
    it (whose backward would copy the whole gradient to concatenate that one piece)."""
    model = _model()
    attn = model.model.layers[0].self_attn
    x = torch.randn(4, 64, attn.o_proj.in_features, requires_grad=True)
    (y,) = fused.linear_group(x, [attn.o_proj])
    assert type(y.grad_fn).__name__ == "_MergedLoraGroupBackward"
    q, k, v = fused.linear_group(
        x[..., : attn.q_proj.in_features], [attn.q_proj, attn.k_proj, attn.v_proj]
    )
    assert type(q.grad_fn).__name__ == "SplitWithSizesBackward0"  # a real split stays one


def test_backward_reuses_the_merged_weights_only_where_they_are_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A merged weight no larger than its node's saved input is kept for backward (one merge
    per group and step); a larger one is merged again there. Gradients are bit-identical."""
    merges: list[int] = []
    original = fused.merged_weight

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        merges.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused, "merged_weight", counted)
    # 512 rows of 64: gate/up's merged [512, 64] weight is as large as its saved input.
    tokens = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    kept = _grads(True, tokens, torch.float32, monkeypatch)
    assert len(merges) == 4 * 2  # q/k/v, o, gate/up and down, once each in each of 2 layers
    merges.clear()
    rule = fused._kept
    monkeypatch.setattr(fused, "_kept", lambda merged, saved: None)
    again = _grads(True, tokens, torch.float32, monkeypatch)
    assert len(merges) == 2 * 4 * 2 - 1  # merged again in backward (layer 0's q/k/v needs no dx)
    for a, b in zip(kept, again, strict=True):
        assert torch.equal(a, b)
    # The rule itself: a weight larger than the saved activation is not kept.
    w = torch.zeros(64, 32)
    assert rule(w, torch.zeros(64, 32)) is w
    assert rule(w, torch.zeros(8, 32)) is None


def test_small_batches_keep_the_per_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-sized inputs (a few tokens) never pay for a weight-sized merge."""
    model = _model()
    calls: list[int] = []
    original = fused._MergedLoraGroup.apply
    monkeypatch.setattr(fused._MergedLoraGroup, "apply", lambda *a: calls.append(1) or original(*a))
    model(torch.zeros((2, 3), dtype=torch.long))
    assert not calls


def _bf16_base_model() -> torch.nn.Module:
    """A bf16 checkpoint as the engine trains it: bf16 base, float32 adapters (B non-zero)."""
    model = build_model(BUILTIN_CONFIGS["tinker-sr/tiny"]).to(torch.bfloat16)
    apply_lora(model, LoraSpec(rank=2, seed=0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainable_parameters(model):
            assert p.dtype == torch.float32
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_a_bf16_base_with_float32_adapters_merges_from_fewer_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per token, the float32 adapters of a bf16 base cost `MIXED_ADAPTER_COST` times the
    passes an all-float32 layer does, so its groups merge from that many times fewer tokens;
    under autocast (which casts anyway) the plain count holds. Merged or not, the gradients
    agree to bf16 rounding."""
    from tinker_sr.engine import bf16_attention

    # Attention as on a CPU with bf16 products (elsewhere torch's SDPA in bf16 runs, its
    # gradients ~0.22 from float64's: a hunt, with this host's bf16 hidden from tinker_sr).
    monkeypatch.setattr(bf16_attention, "_fast_bf16", lambda: True)
    model = _bf16_base_model()
    attn = model.model.layers[0].self_attn
    mixed = [fused._lora_parts(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    plain = [dataclasses.replace(p, weight=p.weight.float()) for p in mixed]  # type: ignore[type-var]
    width = attn.q_proj.in_features
    rows = next(m for m in range(1, 1 << 16) if fused._merge_pays(torch.empty(m, width), plain))
    few = -(-rows // fused.MIXED_ADAPTER_COST)  # ceil
    assert fused._merge_pays(torch.empty(few, width), mixed)  # type: ignore[arg-type]
    assert not fused._merge_pays(torch.empty(few - 1, width), mixed)  # type: ignore[arg-type]
    assert not fused._merge_pays(torch.empty(few, width), plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused._merge_pays(torch.empty(few, width), mixed)  # type: ignore[arg-type]

    tokens = torch.randint(0, 256, (2, -(-few // 2)), generator=torch.Generator().manual_seed(0))
    calls: list[int] = []
    original = fused._MergedLoraGroup.apply
    monkeypatch.setattr(fused._MergedLoraGroup, "apply", lambda *a: calls.append(1) or original(*a))

    def grads(m: torch.nn.Module, enabled: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(fused, "ENABLED", enabled)
        m.zero_grad()
        logits = m(tokens).double()
        (logits.logsumexp(-1) - logits[..., 3]).sum().backward()
        return [logits.detach()] + [p.grad.double() for _, p in trainable_parameters(m)]  # type: ignore[union-attr]

    exact = grads(copy.deepcopy(model).double(), False)  # the same values in float64
    calls.clear()
    plain = grads(model, False)
    assert not calls
    merged = grads(model, True)
    assert calls
    # Both in bf16's regime: the merged weights round W + s B A to bf16 (as a sampler's do),
    # the per-layer path rounds each output; neither is far from float64 or from the other.
    err = {
        name: [float((g - e).norm() / e.norm()) for g, e in zip(got, exact, strict=True)]
        for name, got in (("plain", plain), ("merged", merged))
    }
    assert max(err["merged"]) < 0.15 and max(err["plain"]) < 0.15
    assert statistics.median(err["merged"]) < 3 * statistics.median(err["plain"]) + 1e-3


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_swiglu_mlp_matches_the_per_layer_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gate/up as one unsplit merged GEMM into the SwiGLU + down node (which recomputes its
    input in backward and writes both halves of its gradient into one buffer)."""
    model = _model(dtype=dtype)
    mlp = model.get_submodule("model.layers.0.mlp")
    x0 = torch.randn(4, 64, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(4, 64, mlp.down_proj.out_features, generator=torch.Generator().manual_seed(6))
    calls: list[int] = []
    original = fused._SwiGLUDown.apply
    monkeypatch.setattr(fused._SwiGLUDown, "apply", lambda *a: calls.append(1) or original(*a))
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(fused, "ENABLED", enabled)
        x = x0.to(dtype).requires_grad_()
        out = fused.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        wrt = [x] + [p for _, p in trainable_parameters(mlp)]
        results.append([out, *torch.autograd.grad(out, wrt, dy.to(dtype))])
    assert calls == [1]  # the fused node ran, once
    for a, b in zip(*results, strict=True):
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
        else:
            assert float((a - b).detach().norm() / b.detach().norm()) < 1e-5


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen3's RMSNorm, op by op."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),  # a bf16 model
        (torch.bfloat16, torch.float32),  # q/k norms under bf16 autocast
        (torch.float64, torch.float64),
    ],
)
def test_rms_norm_forward_is_hf_bit_for_bit_and_backward_matches_autograd(
    x_dtype: torch.dtype, w_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(7)
    x0 = (torch.randn(3, 5, 64, generator=gen) * 3).to(x_dtype)
    w0 = (1 + torch.randn(64, generator=gen) * 0.1).to(w_dtype)
    g = torch.randn(3, 5, 64, generator=gen).to(torch.result_type(x0, w0))
    got, ref = [], []
    for fn, out in ((fused.rms_norm, got), (_hf_rms_norm, ref)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w, 1e-6)
        out += [y.detach(), *torch.autograd.grad(y, (x, w), g)]
    assert got[0].dtype == ref[0].dtype and torch.equal(got[0], ref[0])
    with torch.no_grad():  # the no-grad path (sampling) computes the same values
        assert torch.equal(fused.rms_norm(x0, w0, 1e-6), ref[0])
    # HF normalises in float32 whatever the input dtype (float64 too): float32 tolerances.
    tol = 2e-2 if x_dtype == torch.bfloat16 else 1e-5
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_rms_norm_gradcheck() -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    # The normalisation runs in float32 (as HF's does): float32-sized finite differences.
    assert torch.autograd.gradcheck(
        lambda a, b: fused.rms_norm(a, b, 1e-5), (x, w), eps=1e-3, atol=1e-3, rtol=1e-3
    )


@pytest.mark.parametrize("use_h", [True, False])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, use_h: bool
) -> None:
    """The residual add folded into the norm (one C pass each way) against h = x + y and
    rms_norm(h) with autograd summing h's two gradients: the same bits forward and backward,
    also when h feeds nothing but the norm (the last layer: no residual gradient)."""
    gen = torch.Generator().manual_seed(9)
    x0, y0 = torch.randn(4, 96, 512, generator=gen), torch.randn(4, 96, 512, generator=gen)
    w = 1 + torch.randn(512, generator=gen) * 0.1
    g_out, g_h = torch.randn(4, 96, 512, generator=gen), torch.randn(4, 96, 512, generator=gen)
    calls = []
    real = fused.compiled.call_native
    monkeypatch.setattr(
        fused.compiled, "call_native", lambda name, *a: calls.append(name) or real(name, *a)
    )

    def two_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + y
        return h, fused.rms_norm(h, w, 1e-6)

    got, ref = [], []
    for fn, out in ((lambda a, b: fused.add_rms_norm(a, b, w, 1e-6), got), (two_step, ref)):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        h, n = fn(x, y)
        loss = (n * g_out).sum() + ((h * g_h).sum() if use_h else 0)
        out += [h.detach(), n.detach(), *torch.autograd.grad(loss, (x, y))]
    assert calls.count("rms_norm") >= 1 and "rms_norm_backward" in calls  # the C passes ran
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # the no-grad path: the C forward straight away
        h, n = fused.add_rms_norm(x0, y0, w, 1e-6)
    assert torch.equal(h, ref[0]) and torch.equal(n, ref[1])


def test_add_rms_norm_falls_back_where_the_pass_does_not_apply() -> None:
    gen = torch.Generator().manual_seed(10)
    x, y = torch.randn(2, 8, 64, generator=gen), torch.randn(2, 8, 64, generator=gen)
    w = torch.nn.Parameter(1 + torch.randn(64, generator=gen) * 0.1)  # a trained gain
    h, n = fused.add_rms_norm(x, y.requires_grad_(), w, 1e-6)
    assert torch.equal(h, x + y) and torch.equal(n, fused.rms_norm(x + y, w, 1e-6))
    n.sum().backward()
    assert w.grad is not None and y.grad is not None
    h, n = fused.add_rms_norm(x, None, w, 1e-6)  # the first layer: no add
    assert h is x and torch.equal(n, fused.rms_norm(x, w, 1e-6))


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize(
    ("x_dtype", "angle_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # q/k from a bf16 autocast GEMM, fp32 angles
        (torch.float64, torch.float64),
    ],
)
def test_rope_forward_is_rotate_half_bit_for_bit_and_backward_matches_autograd(
    x_dtype: torch.dtype, angle_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(9)
    freqs = torch.outer(torch.arange(7.0), torch.rand(16, generator=gen))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(angle_dtype), emb.sin().to(angle_dtype)
    # [B, T, H, D] transposed to [B, H, T, D], as attention hands it over (a strided view)
    x0 = torch.randn(2, 7, 3, 32, generator=gen).to(x_dtype).transpose(1, 2)
    g = torch.randn(2, 3, 7, 32, generator=gen).to(torch.result_type(x0, cos))
    got, ref = [], []
    for fn, out in ((fused.rope, got), (_hf_rope, ref)):
        x = x0.detach().clone().requires_grad_()
        y = fn(x, cos, sin)
        out += [y.detach(), *torch.autograd.grad(y, (x,), g)]
    assert got[0].dtype == ref[0].dtype and torch.equal(got[0], ref[0])
    with torch.no_grad():
        assert torch.equal(fused.rope(x0, cos, sin), ref[0])
    assert got[1].dtype == ref[1].dtype == x_dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(x_dtype, 1e-2)
    torch.testing.assert_close(got[1], ref[1], atol=tol, rtol=tol)


def test_frozen_cast_is_kept_until_the_weight_changes() -> None:
    w = torch.randn(4, 3)
    low = fused.frozen_cast(w, torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low, w.to(torch.bfloat16))
    assert fused.frozen_cast(w, torch.bfloat16) is low  # cast once
    with torch.no_grad():
        w.add_(1.0)  # a weight changed in place is cast again
    again = fused.frozen_cast(w, torch.bfloat16)
    assert again is not low and torch.equal(again, w.to(torch.bfloat16))
