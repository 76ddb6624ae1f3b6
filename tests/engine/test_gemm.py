"""The engine's float32 GEMMs (`engine.gemm`): oneDNN where the build has it, torch's BLAS
otherwise; the same products either way, to float32 rounding."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinker_sr.engine import batching, cpu, fused, gemm
from tinker_sr.engine.model import BUILTIN_CONFIGS, Transformer, build_model

needs_onednn = pytest.mark.skipif(
    not gemm.onednn_fp32(), reason="this torch build has no usable oneDNN float32 GEMM"
)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 rounding of a length-K dot product, against a float64 reference."""
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_onednn
@pytest.mark.parametrize(
    ("m", "n", "k"), [(4096, 1280, 512), (256, 512, 1536), (8, 32000, 512), (130, 96, 2000)]
)
def test_linear_matches_float64_and_repeats_bit_for_bit(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    assert gemm.uses_onednn(x, w)
    got = gemm.linear(x, w)
    _close(got, _reference(x, w))
    assert torch.equal(got, gemm.linear(x, w))  # deterministic


@needs_onednn
def test_strided_operands_bias_and_batch_dims() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(300, 700, generator=gen)[:, 100:612]  # row stride 700
    b = torch.randn(512, 400, generator=gen).t()  # [400, 512] transposed view
    w = torch.randn(640, 512, generator=gen) / 512**0.5
    bias = torch.randn(640, generator=gen)
    _close(gemm.linear(a, w, bias), _reference(a, w, bias))
    _close(gemm.mm(b, w.t()), _reference(b, w))
    x3 = torch.randn(4, 75, 512, generator=gen)
    got = gemm.linear(x3, w)
    assert got.shape == (4, 75, 640)
    _close(got, _reference(x3, w))


def test_torch_op_where_onednn_does_not_apply() -> None:
    x, w = torch.randn(64, 512), torch.randn(512, 512)
    assert not gemm.uses_onednn(x.double(), w.double())
    assert not gemm.uses_onednn(x.bfloat16(), w.bfloat16())
    assert not gemm.uses_onednn(x[:1, :8], w[:8, :8])  # too small to pay for the call
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gemm.uses_onednn(x, w)
        assert gemm.linear(x, w).dtype == torch.bfloat16  # autocast still applies
    assert torch.equal(gemm.linear(x.double(), w.double()), F.linear(x.double(), w.double()))


def test_backend_env_blas_and_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv(gemm.BACKEND_ENV, "blas")
        gemm.onednn_fp32.cache_clear()
        assert not gemm.onednn_fp32()
        x, w = torch.randn(256, 512), torch.randn(512, 512)
        assert torch.equal(gemm.linear(x, w), F.linear(x, w))
        monkeypatch.setenv(gemm.BACKEND_ENV, "mkl2")
        gemm.onednn_fp32.cache_clear()
        with pytest.raises(ValueError, match="TINKER_SR_GEMM='mkl2'.*'onednn'.*'blas'"):
            gemm.onednn_fp32()
    finally:
        monkeypatch.delenv(gemm.BACKEND_ENV)
        gemm.onednn_fp32.cache_clear()


@needs_onednn
def test_packed_weight_is_reused_and_refreshed_after_an_in_place_change() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(1024, 512, generator=gen) / 512**0.5
    x = torch.randn(8, 512, generator=gen)
    first = gemm.packed_linear(x, w)
    _close(first, _reference(x, w))
    packed = gemm.packed_weight(w, 8)
    assert torch.equal(gemm.packed_linear(x, w), first)
    assert gemm.packed_weight(w, 8) is packed
    # One copy per (rows, transposed): the unembedding's chunks and decode share a weight.
    assert gemm.packed_weight(w, 256) is not packed
    assert gemm.packed_weight(w, 8, transpose=True) is not packed
    with torch.no_grad():
        w.mul_(2)
    torch.testing.assert_close(gemm.packed_linear(x, w), 2 * first)
    assert gemm.packed_weight(w, 8) is not packed
    # The choice is made at 8 rows whatever the batch: a 256-row batch takes the same path.
    assert torch.equal(gemm.packed_linear(x.repeat(32, 1), w)[:8], gemm.packed_linear(x, w))


@needs_onednn
def test_packed_mm_multiplies_by_the_weight_itself() -> None:
    """``a @ w`` through w's packed transpose (the unembedding's softmax @ W), refreshed after
    an in-place change like `packed_linear`'s copy."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(4000, 512, generator=gen) / 512**0.5  # [V, D]
    e = torch.rand(100, 4000, generator=gen)
    got = gemm.packed_mm(e, w, 128)
    _close(got, e.double() @ w.double())
    assert torch.equal(gemm.packed_mm(e, w, 128), got)
    with torch.no_grad():
        w.neg_()
    torch.testing.assert_close(gemm.packed_mm(e, w, 128), -got)
    # Where oneDNN does not apply (float64 here), torch's product.
    assert torch.equal(gemm.packed_mm(e.double(), w.double(), 128), e.double() @ w.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_frozen_linear_gradients_equal_autograd(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(768, 512, generator=gen) / 512**0.5).to(dtype)
    bias = torch.randn(768, generator=gen).to(dtype)
    x = torch.randn(3, 200, 512, generator=gen, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 200, 768, generator=gen, dtype=dtype)
    y = fused.frozen_linear(x, w, bias)
    (dx,) = torch.autograd.grad(y, x, dy)
    x_ref = x.detach().double().requires_grad_(True)
    y_ref = F.linear(x_ref, w.double(), bias.double())
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=tol, atol=tol)


def _wide_model() -> Transformer:
    """Wide enough that its projections and unembedding take the oneDNN path (k/v stay on
    the BLAS: both paths in one model)."""
    config = dataclasses.replace(
        BUILTIN_CONFIGS["tinker-sr/tiny"], dim=384, n_heads=6, n_kv_heads=2, ffn_dim=1024
    )
    return build_model(config, seed=5).eval()


@needs_onednn
def test_decode_rows_do_not_depend_on_the_batch_on_the_onednn_path() -> None:
    """Each row's logits from a batched decode equal those of the row in an 8-row slice of
    other rows, for batches of 8..64 rows (the property continuous batching relies on)."""
    model = _wide_model()
    layer = model.model.layers[0].mlp.up_proj
    assert gemm.uses_onednn(torch.empty(8, 384), layer.weight, rows=8)
    gen = torch.Generator().manual_seed(4)
    for m in (8, 16, 64):
        x = torch.randn(m, 384, generator=gen)
        whole = batching.linear_rows(layer, x)
        for i in range(0, m, 3):
            others = torch.randn(batching.CHUNK, 384, generator=gen)
            others[i % batching.CHUNK] = x[i]
            alone = batching.linear_rows(layer, others)[i % batching.CHUNK]
            assert torch.equal(whole[i], alone), (m, i)


def test_training_step_agrees_with_the_blas_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss and the LoRA gradients of one step on the oneDNN GEMMs equal those on torch's
    BLAS to float32 rounding."""
    from tinker_sr.engine.lora import LoraSpec, apply_lora, trainable_parameters

    tokens = torch.randint(0, 256, (4, 96), generator=torch.Generator().manual_seed(6))

    def grads() -> list[torch.Tensor]:
        model = _wide_model().train()
        apply_lora(model, LoraSpec(rank=4, seed=1))
        with torch.no_grad():
            for name, p in trainable_parameters(model):
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
        logits = model(tokens)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].flatten()
        )
        loss.backward()
        return [loss.detach()] + [p.grad for _, p in trainable_parameters(model)]  # type: ignore[misc]

    default = grads()
    monkeypatch.setattr(gemm, "onednn_fp32", lambda: False)
    blas = grads()
    for a, b in zip(default, blas, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=1e-6)


def test_merged_sampler_budget_counts_the_packed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A merged sampler's weights are packed again for decode where oneDNN applies: the
    merged-cache budget counts both copies."""
    from tinker_sr.engine.lora import LoraLinear, LoraSpec, apply_lora
    from tinker_sr.engine.registry import _merged_bytes

    model = build_model("tinker-sr/tiny", seed=0)
    apply_lora(model, LoraSpec(rank=2, seed=0))
    one = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, LoraLinear))
    expected = 2 * one if gemm.onednn_fp32() else one
    assert _merged_bytes(model, torch.float32) == expected
    monkeypatch.setattr(gemm, "onednn_fp32", lambda: False)
    assert _merged_bytes(model, torch.float32) == one


def test_linear_keeps_autograd_where_a_graph_is_recorded() -> None:
    """Called with an operand that needs a gradient (outside a custom node), `linear` is
    torch's op, so the gradient still flows."""
    x = torch.randn(64, 512, requires_grad=True)
    w = torch.randn(512, 512)
    y = gemm.linear(x, w)
    assert y.grad_fn is not None
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, w.sum(0).expand(64, -1), rtol=1e-4, atol=1e-4)
    assert gemm.packed_linear(x, w).grad_fn is not None


@needs_onednn
@pytest.mark.parametrize("pack", [True, False])
def test_frozen_head_logprobs_and_gradient_through_packed_weights(
    pack: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunked unembedding multiplies a frozen head through packed copies of its weight
    (forward) and its transpose (softmax @ W) when the weight is small enough, as it is
    otherwise: log-probs and dL/dh against float64 autograd either way."""
    from tinker_sr.engine import loss_logprobs

    if not pack:
        monkeypatch.setattr(loss_logprobs, "PACK_HEAD_MAX_BYTES", 0)
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 128 * 4000)  # chunks of 128 rows
    gen = torch.Generator().manual_seed(8)
    head = torch.nn.Linear(512, 4000, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(4000, 512, generator=gen) / 512**0.5)
    h = torch.randn(300, 512, generator=gen, requires_grad=True)
    cols = torch.randint(0, 4000, (300, 1), generator=gen)
    g = torch.randn(300, 1, generator=gen)
    (logp,), _ = loss_logprobs.head_logprobs([h], [cols], head)
    (dh,) = torch.autograd.grad(logp, h, g)

    h64 = h.detach().double().requires_grad_()
    want = torch.log_softmax(h64 @ head.weight.double().t(), -1).gather(1, cols)
    (want_dh,) = torch.autograd.grad(want, h64, g.double())
    torch.testing.assert_close(logp.double(), want, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(dh.double(), want_dh, rtol=1e-4, atol=2e-5)
    packed = getattr(head.weight, "_tinker_sr_packed", {})
    assert sorted(packed) == ([(128, False), (128, True)] if pack else [])


@needs_onednn
def test_stacked_linear_is_the_projections_side_by_side_and_follows_their_changes() -> None:
    """Decode's q/k/v in one product: the columns of each weight's own packed product (the same
    bits here, which `batching` checks per shape before using it), the stacked copy reused
    while the weights are unchanged and rebuilt after an in-place change; None where oneDNN
    does not apply, and nothing plain kept beside the reordered copy."""
    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(n, 512, generator=gen) / 512**0.5 for n in (512, 256, 256)]
    x = torch.randn(8, 512, generator=gen)
    got = gemm.stacked_linear(x, ws, 8)
    assert got is not None and got.shape == (8, 1024)
    separate = torch.cat([gemm.packed_linear(x, w, None, 8) for w in ws], dim=1)
    _close(got, torch.cat([_reference(x, w) for w in ws], dim=1))
    torch.testing.assert_close(got, separate, rtol=0, atol=1e-6)
    cache = ws[0]._tinker_sr_stacked  # type: ignore[attr-defined]
    copy = cache[8][1]
    assert torch.equal(gemm.stacked_linear(x, ws, 8), got)  # type: ignore[arg-type]
    assert cache[8][1] is copy and len(cache) == 1
    with torch.no_grad():
        ws[2].mul_(2)  # the last weight: the copy hangs on the first
    again = gemm.stacked_linear(x, ws, 8)
    assert again is not None and cache[8][1] is not copy
    assert torch.equal(again[:, :768], got[:, :768])
    torch.testing.assert_close(again[:, 768:], 2 * got[:, 768:])
    assert gemm.stacked_linear(x.double(), [w.double() for w in ws], 8) is None
    assert gemm.stacked_linear(x[:, :64], [w[:4, :64] for w in ws], 8) is None  # too small


def test_bucket_rows_are_few_and_waste_at_most_a_sixteenth() -> None:
    buckets = {gemm.bucket_rows(m) for m in range(1, 40_001)}
    for m in range(1, 40_001):
        got = gemm.bucket_rows(m)
        assert got >= m and got % 8 == 0 and gemm.bucket_rows(got) == got
        assert got - m < 8 or (got - m) * 16 <= m
    assert all(gemm.bucket_rows(m) == m for m in range(8, 256, 8))  # decode's padded batches
    assert len(buckets) <= 32 + 16 * 8  # 8..248 by 8, then 16 per octave to 2**16


@needs_onednn
def test_onednn_meets_few_shapes_over_many_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's varying token counts (sequence lengths, per-expert rows) reach oneDNN at a
    few bucketed row counts: each new shape is a kernel compiled and cached for good."""
    real, seen = gemm._op(), set()

    def recording(x: torch.Tensor, w: torch.Tensor, *rest: object) -> torch.Tensor:
        seen.add((tuple(x.shape), tuple(w.shape)))
        return real(x, w, *rest)  # type: ignore[no-any-return]

    monkeypatch.setattr(gemm, "_op", lambda: recording)
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(256, 96, generator=gen) / 96**0.5, torch.randn(256, generator=gen)
    counts = sorted({int(m) for m in torch.randint(40, 1500, (300,), generator=gen)})
    for m in counts:
        x = torch.randn(m, 96, generator=gen)
        _close(gemm.linear(x, w, bias), _reference(x, w, bias))
        _close(gemm.packed_linear(x, w, rows=64), _reference(x, w))
        a = torch.randn(m, 24, generator=gen) / m**0.5
        _close(gemm.mm_over_rows(a, x), a.double().t() @ x.double())
    rows = {shape[0][0] for shape in seen}
    assert rows <= {gemm.bucket_rows(m) for m in range(1, 1501)} | {24}  # 24: mm_over_rows' a^T
    summed = {shape[0][1] for shape in seen if shape[0][0] == 24}
    assert len(counts) > 250 and len(seen) < 160, (len(counts), len(seen))
    assert summed <= {gemm.bucket_rows(m) for m in range(1, 1501)}


@needs_onednn
@pytest.mark.parametrize("m", [1, 7, 8, 255, 256, 257, 271, 272, 4097])
def test_mm_over_rows_is_the_transposed_product(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    a, b = torch.randn(m, 16, generator=gen) / m**0.5, torch.randn(m, 3000, generator=gen)
    got = gemm.mm_over_rows(a, b)
    assert got.shape == (16, 3000)
    torch.testing.assert_close(got.double(), a.double().t() @ b.double(), rtol=1e-5, atol=1e-4)
    assert torch.equal(got, gemm.mm_over_rows(a, b))


_CACHE_PROBE = """
import os, sys
import tinker_sr
import torch
from tinker_sr.engine import gemm

print("caps", os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), os.environ["LRU_CACHE_CAPACITY"])
w = torch.randn(64, 32)
for m in range(1000, 1201):  # 1000 then 200 other shapes
    gemm._op()(torch.ones(m, 32), w, None, "none", [], "")
print("MARK", flush=True)
gemm._op()(torch.ones(1000, 32), w, None, "none", [], "")  # the first shape again
print("MARK", flush=True)
"""


@needs_onednn
@pytest.mark.parametrize("user_set", [False, True])
def test_kernel_caches_are_capped_unless_the_user_set_them(user_set: bool) -> None:
    """oneDNN keeps a compiled kernel per product shape; ``import tinker_sr`` caps its caches
    (`cpu.bound_kernel_caches`) so a run whose shapes vary cannot grow them without end: the
    first shape, 200 shapes later, is compiled again (a cache miss). A user's own setting
    wins: at 1,024 entries it is still cached."""
    env = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    env["ONEDNN_VERBOSE"] = "all"  # prints each kernel creation: cache_hit / cache_miss
    if user_set:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = "1024"
    out = subprocess.run(
        [sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    caps = next(line for line in out.splitlines() if line.startswith("caps"))
    want = "1024" if user_set else str(cpu.KERNEL_CACHE_ENTRIES)
    assert caps == f"caps {want} {want}"
    last = out.split("MARK")[-2]  # the first shape's second use
    creates = [line for line in last.splitlines() if ",create:cache_" in line]
    if not creates:
        pytest.skip("this oneDNN prints no kernel creations (ONEDNN_VERBOSE=all)")
    assert ("create:cache_hit" if user_set else "create:cache_miss") in creates[0]


_MODEL_THEN_PROBE = """
import os, sys
from pathlib import Path
import tinker_sr
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

path = make_tiny_hf_model_dir(Path(sys.argv[1]), sys.argv[2])
service = tinker_sr.ServiceClient()
service.create_lora_training_client(base_model=str(path), rank=4).result()
""" + _CACHE_PROBE.replace("import tinker_sr", "")


@needs_onednn
@pytest.mark.parametrize(
    ("family", "user_set", "want"),
    [("qwen3_moe", None, "512"), ("qwen3", None, "128"), ("qwen3_moe", "128", "128")],
)
def test_a_mixture_of_experts_widens_the_kernel_caches(
    tmp_path: Path, family: str, user_set: str | None, want: str
) -> None:
    """Building a mixture-of-experts model (a training client on a Qwen3-MoE directory, as a
    user makes one) raises the caps to `cpu.MOE_KERNEL_CACHE_ENTRIES` before oneDNN's first
    kernel: its steps take 256-512 shapes (``benchmarks/moe_kernel_cache.py``), which at 128
    entries were recompiled every step. The first shape is still cached 200 shapes later. A
    dense model keeps 128; a user's own setting is kept."""
    env = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    env["ONEDNN_VERBOSE"] = "all"
    if user_set:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = user_set
    out = subprocess.run(
        [sys.executable, "-c", _MODEL_THEN_PROBE, str(tmp_path / "model"), family],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert next(line for line in out.splitlines() if line.startswith("caps")) == (
        f"caps {want} {want}"
    )
    creates = [line for line in out.split("MARK")[-2].splitlines() if ",create:cache_" in line]
    if not creates:
        pytest.skip("this oneDNN prints no kernel creations (ONEDNN_VERBOSE=all)")
    assert ("create:cache_hit" if want == "512" else "create:cache_miss") in creates[0]


@needs_onednn
def test_a_run_with_varying_lengths_reaches_onednn_at_bucketed_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training and sampling a tiny Qwen3-MoE directory on batches and prompts whose lengths
    change every step: every oneDNN product's row count is a bucket, and so is every summed
    size that is not one of the model's own widths (the tokens of a LoRA weight gradient)."""
    import tinker_sr as tinker
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    model_dir = make_tiny_hf_model_dir(tmp_path / "model", "qwen3_moe")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    real, seen = gemm._op(), set()

    def recording(x: torch.Tensor, w: torch.Tensor, *rest: object) -> torch.Tensor:
        seen.add((x.shape[0], x.shape[1]))
        return real(x, w, *rest)  # type: ignore[no-any-return]

    monkeypatch.setattr(gemm, "_op", lambda: recording)
    types = tinker.types
    training = tinker.ServiceClient().create_lora_training_client(str(model_dir), rank=8, seed=0)
    training = training.result()
    gen = torch.Generator().manual_seed(0)
    for step, seq in enumerate((37, 91, 58, 113, 70, 149)):
        rows = torch.randint(0, vocab, (3, seq + 1), generator=gen).tolist()
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * seq},
            )
            for row in rows
        ]
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints(rows[0][: seq + 3])
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=step)
        sampler.sample(prompt, 3, params).result()
    assert len(seen) > 5
    assert all(gemm.bucket_rows(m) == m for m, _ in seen), sorted(seen)
    assert all(gemm.bucket_rows(k) == k or k == vocab for _, k in seen), sorted(seen)
