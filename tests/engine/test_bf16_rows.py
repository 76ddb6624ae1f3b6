"""The bf16 row kernels (`engine.bf16_rows`, ``csrc/rows_bf16.c``) against torch's eager bf16
ops they replace under CPU mixed precision: the loss's softmax statistics bit for bit against
the float32 kernel on the widened logits, the others within one bf16 rounding of the eager
ops (and of the float32 formula's rounding), independent of the thread count; a bf16 step
runs them and still matches the float32 step; with the C kernels off, the eager ops run."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tinker_sr.engine import attention_inputs, bf16_rows, compiled, fused, native

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("clang") is None,
    reason="the C kernels need a C compiler",
)


@pytest.fixture(scope="module")
def module_kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's kernel cache: each C library is built once for the module's tests."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(autouse=True)
def kernel_cache(monkeypatch: pytest.MonkeyPatch, module_kernels: Path) -> Iterator[None]:
    monkeypatch.setenv(native.CACHE_ENV, str(module_kernels))
    caches = (native.load, bf16_rows._library, compiled._rows_library)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's last bf16 place (b's exponent; 2^-133 floor for zeros)."""
    b32 = b.float()
    unit = torch.ldexp(torch.ones_like(b32), torch.frexp(b32).exponent - 8).clamp_min(2.0**-133)
    return (a.float() - b32).abs() / unit


def _threads(n: int, fn: Any) -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_softmax_rows_equal_the_float32_kernel_on_widened_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    z0 = (torch.randn(40, 4096, generator=gen) * 6).bfloat16()
    z0[3, 7] = 80.0  # a dominant logit
    wide = z0.float()
    lse_ref = torch.empty(40)
    total_ref = compiled.softmax_rows(wide, lse_ref)
    assert total_ref is not None

    def run() -> tuple[torch.Tensor, ...]:
        z, lse = z0.clone(), torch.empty(40)
        total = bf16_rows.softmax_rows(z, lse)
        assert total is not None
        return z, lse, total

    for got in (_threads(1, run), _threads(2, run)):
        z, lse, total = got
        assert torch.equal(lse, lse_ref) and torch.equal(total, total_ref)
        assert torch.equal(z, wide.bfloat16())  # e rounded once, as torch's narrowing rounds
    torch.testing.assert_close(lse_ref, torch.logsumexp(z0.double(), -1).float())


def test_softmax_rows_refuses_what_it_cannot_take() -> None:
    lse = torch.empty(40)
    assert bf16_rows.softmax_rows(torch.zeros(40, 4100, dtype=torch.bfloat16), lse) is None
    assert bf16_rows.softmax_rows(torch.zeros(40, 4096), lse) is None  # float32: rows.c's
    with torch.inference_mode():
        assert bf16_rows.softmax_rows(torch.zeros(40, 4096, dtype=torch.bfloat16), lse) is None


def _eager_norm_rope(
    x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The eager bf16 path: HF's RMSNorm (float32 statistics, rounded to bf16 before the float32
    gain), then rotate_half RoPE in float32, as [B, H, T, D]."""
    if w is not None:
        x32 = x.float()
        n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        x = w * n
    x = x.float().transpose(1, 2)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


@pytest.mark.parametrize("norm", [True, False])
def test_norm_rope_within_a_bf16_rounding_of_the_eager_path(norm: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    b, t, h, kv, d = 4, 128, 4, 2, 64  # over compiled.MIN_ELEMENTS
    qkv = (torch.randn(b, t, (h + 2 * kv) * d, generator=gen) * 3).bfloat16()
    xq = qkv[..., : h * d].view(b, t, h, d)  # a strided view, as the model passes it
    w = torch.randn(d, generator=gen) if norm else None
    pos = torch.arange(t, dtype=torch.float32)[:, None] / (
        10000 ** (torch.arange(d // 2) / (d // 2))
    )
    cos, sin = torch.cat([pos.cos()] * 2, -1), torch.cat([pos.sin()] * 2, -1)
    assert attention_inputs.use_norm_rope(xq, w, cos, sin)
    wide = torch.zeros(1, t, 1, 1056, dtype=torch.bfloat16)  # over the kernels' 1024
    assert not attention_inputs.use_norm_rope(wide, None, torch.ones(t, 1056), torch.ones(t, 1056))

    x_ref = xq.detach().clone().requires_grad_()
    want = _eager_norm_rope(x_ref, w, 1e-6, cos, sin)
    g = torch.randn(want.shape, generator=gen).bfloat16()
    (want * g.float()).sum().backward()
    assert x_ref.grad is not None

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x = xq.detach().clone().requires_grad_()
        y = attention_inputs.norm_rope(x, w, 1e-6, cos, sin)
        assert y is not None and y.dtype == torch.bfloat16 and y.shape == (b, h, t, d)
        (dx,) = torch.autograd.grad(y, x, g)
        return y, dx

    y, dx = _threads(2, run)
    y1, dx1 = _threads(1, run)
    assert torch.equal(y, y1) and torch.equal(dx, dx1)
    assert float(_ulps(y, want.detach().bfloat16()).max()) <= 1.0  # FMA contraction: one place
    assert dx.dtype == torch.bfloat16
    err = (dx.float() - x_ref.grad.float()).abs().max() / x_ref.grad.float().abs().max()
    assert float(err) < 1e-2


def test_qkv_heads_in_bf16_give_the_norm_rope_kernel_results() -> None:
    gen = torch.Generator().manual_seed(2)
    b, t, h, kv, d = 4, 128, 4, 2, 64
    qkv = torch.randn(b, t, (h + 2 * kv) * d, generator=gen).bfloat16().requires_grad_()
    wq, wk = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    pos = torch.arange(t, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1, d // 2)
    cos, sin = torch.cat([pos.cos()] * 2, -1), torch.cat([pos.sin()] * 2, -1)
    got = attention_inputs.qkv_heads(qkv, (h, kv, d), wq, wk, 1e-6, cos, sin)
    assert got is not None
    q, k, v = got
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    xq, xk, xv = attention_inputs._split_heads(qkv.detach(), (h, kv, d))
    q_ref = attention_inputs.norm_rope(xq, wq, 1e-6, cos, sin)
    k_ref = attention_inputs.norm_rope(xk, wk, 1e-6, cos, sin)
    assert q_ref is not None and k_ref is not None
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, xv.transpose(1, 2))
    (q.float().sum() + k.float().square().sum() + v.float().sum()).backward()
    assert qkv.grad is not None and qkv.grad.dtype == torch.bfloat16
    assert torch.equal(qkv.grad[..., (h + kv) * d :], torch.ones(b, t, kv * d).bfloat16())


def test_a_bf16_checkpoints_norm_weight_and_tables_take_the_kernel_widened() -> None:
    """A bf16 checkpoint's training step: q/k, the norm weight and the rotary tables all bf16.
    The kernel takes them widened to float32 (exact) and gives the result for those float32
    operands bit for bit, gradient included; torch's eager bf16 ops round after each op, the
    kernel once, so it lands within a bf16 place of float64 math where eager bf16 is further."""
    gen = torch.Generator().manual_seed(5)
    b, t, h, kv, d = 4, 128, 4, 2, 64
    qkv = (torch.randn(b, t, (h + 2 * kv) * d, generator=gen) * 3).bfloat16()
    xq = qkv[..., : h * d].view(b, t, h, d)
    w16 = torch.nn.Parameter(torch.randn(d, generator=gen).bfloat16(), requires_grad=False)
    pos = torch.arange(t, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1, d // 2)
    cos16, sin16 = (
        torch.cat([pos.cos()] * 2, -1).bfloat16(),
        torch.cat([pos.sin()] * 2, -1).bfloat16(),
    )
    assert attention_inputs.use_norm_rope(xq, w16, cos16, sin16)
    g = torch.randn(b, h, t, d, generator=gen).bfloat16()

    def run(w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
        x = xq.detach().clone().requires_grad_()
        y = attention_inputs.norm_rope(x, w, 1e-6, cos, sin)
        assert y is not None and y.dtype == torch.bfloat16
        return [y, *torch.autograd.grad(y, x, g)]

    got = run(w16, cos16, sin16)
    widened = run(w16.float(), cos16.float(), sin16.float())
    assert all(torch.equal(a, b) for a, b in zip(got, widened, strict=True))
    # As the kernel's float32 arithmetic goes (`_eager_norm_rope`: HF's norm rounded to bf16
    # before the gain, the rest in float32): within one bf16 place.
    want = _eager_norm_rope(xq, w16.float(), 1e-6, cos16.float(), sin16.float())
    assert float(_ulps(got[0], want.bfloat16()).max()) <= 1.0
    # torch's eager bf16 ops (the gain and each RoPE op rounded to bf16) stray further from
    # float64 arithmetic on the same operands than the kernel's one rounding does.
    x32 = xq.float()
    n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    exact = _eager_norm_rope(w16.double() * n.double(), None, 0.0, cos16.double(), sin16.double())
    y16 = (w16 * n).transpose(1, 2)
    half = d // 2
    eager = y16 * cos16 + torch.cat([-y16[..., half:], y16[..., :half]], -1) * sin16
    kernel_err = float((got[0].double() - exact).abs().mean())
    eager_err = float((eager.double() - exact).abs().mean())
    assert kernel_err < eager_err


def test_silu_mul_and_swiglu_backward_within_a_bf16_rounding_of_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(96, 2 * 1024, generator=gen) * 4).bfloat16()
    dh = torch.randn(96, 1024, generator=gen).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    h = bf16_rows.silu_mul(gate, up)
    assert h is not None and h.dtype == torch.bfloat16
    want_h = F.silu(gate) * up  # torch's two bf16 ops
    assert float(_ulps(h, want_h).max()) <= 1.0
    assert float((h == want_h).float().mean()) > 0.99
    assert torch.equal(_threads(1, lambda: bf16_rows.silu_mul(gate, up)), h)

    g32, u32 = gate.float(), up.float()
    sig = torch.sigmoid(g32)
    want_dgate = torch.ops.aten.silu_backward(dh * up, gate)  # torch's eager bf16 backward
    want_dup = F.silu(gate) * dh
    both = bf16_rows.swiglu_backward(gate_up.clone(), dh)
    assert both is not None and both.dtype == torch.bfloat16
    d_gate, d_up = both.chunk(2, -1)
    assert float(_ulps(d_up, want_dup).max()) <= 1.0
    assert float(_ulps(d_gate, want_dgate).max()) <= 1.0
    exact = dh.float() * u32 * sig * (1 + g32 * (1 - sig))
    torch.testing.assert_close(d_gate.float(), exact, rtol=2e-2, atol=1e-2)
    assert bf16_rows.swiglu_backward(gate_up.float(), dh) is None  # float32: rows.c's


SMALL_2L = "tinker-sr/small-2-layers"


def _train_step(tmp: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> tuple[float, Any]:
    """One LoRA step of `tinker-sr/small`'s shape with 2 of its 8 layers (a CPU without
    hardware bf16 emulates the products: 74 s for the whole model on an AVX2 host) on
    8 x 100 tokens (enough rows for the merged gate/up GEMM and the kernels' size floor):
    (loss, the adapters' gradients)."""
    import dataclasses

    import numpy as np

    import tinker_sr as tinker
    from tinker_sr import types
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine import device
    from tinker_sr.engine.model import BUILTIN_CONFIGS

    small = dataclasses.replace(BUILTIN_CONFIGS["tinker-sr/small"], name=SMALL_2L, n_layers=2)
    monkeypatch.setitem(BUILTIN_CONFIGS, SMALL_2L, small)
    monkeypatch.setenv(device.TRAIN_DTYPE_ENV, dtype)
    backend = LocalBackend(tmp / dtype)
    service = tinker.ServiceClient(backend=backend)
    training = service.create_lora_training_client(base_model=SMALL_2L, rank=4, seed=0).result()
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (8, 101), generator=gen).tolist()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * 100},
        )
        for r in rows
    ]
    out = training.forward_backward(data, "cross_entropy").result()
    trainer = backend.models.trainer(training.model_id)
    grads = [p.grad.flatten() for _, p in trainer.optim.params if p.grad is not None]
    service.close().result()
    backend.close()
    return out.metrics["loss:sum"], np.concatenate([g.numpy() for g in grads])


def test_a_bf16_step_runs_the_kernels_and_matches_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 LoRA step runs the q/k norm + RoPE pass and the SwiGLU passes in C, and loss and
    gradients stay within bf16 tolerance of the float32 step (the mixed-precision oracle of
    tests/engine/test_mixed_precision.py)."""
    import numpy as np

    ran: list[str] = []
    for module, name in (
        (bf16_rows, "silu_mul"),
        (bf16_rows, "swiglu_backward"),
        (attention_inputs, "_norm_rope_forward"),
    ):
        real = getattr(module, name)

        def wrapper(*args: Any, _real: Any = real, _name: str = name) -> Any:
            out = _real(*args)
            first = out[0] if isinstance(out, tuple) else out  # (y, r) from the norm + RoPE
            if first is not None and first.dtype == torch.bfloat16:
                ran.append(_name)
            return out

        monkeypatch.setattr(module, name, wrapper)
    ref_loss, ref_grad = _train_step(tmp_path, "float32", monkeypatch)
    assert not ran  # float32: rows.c's kernels
    ran.clear()
    loss, grad = _train_step(tmp_path, "bf16-force", monkeypatch)
    assert {"silu_mul", "swiglu_backward", "_norm_rope_forward"} <= set(ran), ran
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    cosine = float(grad @ ref_grad / (np.linalg.norm(grad) * np.linalg.norm(ref_grad)))
    assert cosine > 0.99
    assert np.linalg.norm(grad - ref_grad) / np.linalg.norm(ref_grad) < 0.1


def test_the_head_under_bf16_autocast_takes_the_c_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """`loss_logprobs.head_logprobs` under bf16 autocast at a vocabulary the kernel takes: the
    C softmax runs, and log-probs and the hidden state's gradient match torch's eager passes
    (C kernels off) to float32 rounding of the statistics."""
    from tinker_sr.engine import loss_logprobs

    gen = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(64, 4096, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(4096, 64, generator=gen) * 0.3)
    h0 = torch.randn(96, 64, generator=gen)
    cols = torch.randint(0, 4096, (96, 1), generator=gen)
    calls: list[int] = []
    real = bf16_rows.softmax_rows
    monkeypatch.setattr(
        bf16_rows,
        "softmax_rows",
        lambda *a: (lambda out: calls.append(out is not None) or out)(real(*a)),
    )

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        h = h0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (logp,), _ = loss_logprobs.head_logprobs([h], [cols], head)
        (dh,) = torch.autograd.grad(logp.sum(), (h,))
        return logp.detach(), dh

    got = run()
    assert calls and all(calls)
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    calls.clear()
    want = run()
    assert calls == [False] * len(calls)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-2)


def test_with_the_c_kernels_off_a_bf16_step_runs_torchs_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    gate_up = torch.randn(64, 2048).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    assert bf16_rows.silu_mul(gate, up) is None
    assert bf16_rows.swiglu_backward(gate_up, torch.randn(64, 1024).bfloat16()) is None
    assert torch.equal(fused._silu_mul(gate, up), F.silu(gate) * up)


def test_causal_softmax_and_its_gradient_within_a_bf16_rounding_of_torch() -> None:
    """The bf16 attention's mask + softmax and softmax gradient (one C pass each) against
    torch's masked_fill_, bf16 softmax and _softmax_backward_data on the same scores."""
    gen = torch.Generator().manual_seed(5)
    n, g, t = 6, 2, 96
    s0 = (torch.randn(n, g * t, t, generator=gen) * 4).bfloat16()
    mask = torch.ones(t, t, dtype=torch.bool).triu_(1).repeat(g, 1)
    want = torch.softmax(s0.masked_fill(mask, float("-inf")), dim=-1)
    p = bf16_rows.causal_softmax(s0.clone())
    assert p is not None and p.dtype == torch.bfloat16
    assert torch.equal(
        p.masked_select(mask.expand_as(p)), torch.zeros(int(mask.sum()) * n).bfloat16()
    )
    assert float(_ulps(p, want).max()) <= 1.0
    assert torch.equal(_threads(1, lambda: bf16_rows.causal_softmax(s0.clone())), p)

    dp0 = torch.randn(n, g * t, t, generator=gen).bfloat16()
    want_ds = torch._softmax_backward_data(dp0, want, -1, torch.bfloat16)
    ds = bf16_rows.causal_softmax_backward(want, dp0.clone())
    assert ds is not None
    # Rounded once from float32 sums in another order: within two bf16 places of torch's,
    # and of the same size as the float64 formula's error.
    exact = want.double() * (dp0.double() - (want.double() * dp0.double()).sum(-1, keepdim=True))
    assert (
        float((ds.double() - exact).abs().max())
        <= 2 * float((want_ds.double() - exact).abs().max()) + 1e-6
    )
    assert bf16_rows.causal_softmax(torch.zeros(6, 2 * 90, 90, dtype=torch.bfloat16)) is None


def test_bf16_attention_with_and_without_the_c_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker_sr.engine.bf16_attention import bf16_causal_attention

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 8, 128, 64, generator=gen).bfloat16()
    k, v = (torch.randn(2, 4, 128, 64, generator=gen).bfloat16() for _ in range(2))
    do = torch.randn(2, 8, 128, 64, generator=gen).bfloat16()

    def run() -> list[torch.Tensor]:
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = bf16_causal_attention(*inputs)
        return [o.detach(), *torch.autograd.grad(o, inputs, do)]

    calls: list[bool] = []
    real = bf16_rows.causal_softmax
    monkeypatch.setattr(
        bf16_rows,
        "causal_softmax",
        lambda s: (lambda out: calls.append(out is not None) or out)(real(s)),
    )
    got = run()
    assert calls == [True]
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    want = run()
    for a, b in zip(got, want, strict=True):
        err = (a.float() - b.float()).abs().max() / b.float().abs().max()
        assert float(err) < 2e-2


def test_the_c_bf16_conversion_rounds_as_torch_subnormals_and_nans_included() -> None:
    """float -> bf16 in the C kernels (one instruction where the CPU has AVX512_BF16, the
    arithmetic form for vectors holding a NaN or a subnormal): through the bf16 LoRA merge
    with a zero weight and a unit adapter, out = bf16(a) exactly, on random bit patterns."""
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (64 * 1024,), generator=gen, dtype=torch.int64)
    bits[::5] &= 0x807FFFFF  # every fifth a subnormal (or zero)
    a = bits.to(torch.int32).view(torch.float32).view(1, -1).clone()
    w = torch.zeros(2, a.shape[1], dtype=torch.bfloat16)
    out = torch.empty_like(w)
    assert compiled.lora_merge(w, torch.ones(2, 1), a, 1.0, out)
    want = a.bfloat16().expand_as(out)
    nan = a.isnan().expand_as(out)
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("native", [True, False])
def test_a_merged_weight_in_bf16_is_the_float32_merge_rounded_once(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 autocast the merged LoRA groups form their weight in bf16 directly
    (`fused.merged_weight(..., dtype)`): the bits autocast's cast of the float32 merge gave."""
    if not native:
        monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    gen = torch.Generator().manual_seed(8)
    weights = [torch.randn(n, 96, generator=gen) for n in (512, 256)]
    a = [torch.randn(4, 96, generator=gen) for _ in weights]
    b = [torch.randn(w.shape[0], 4, generator=gen) for w in weights]
    want = fused.merged_weight(weights, a, b, 0.5).bfloat16()
    got = fused.merged_weight(weights, a, b, 0.5, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_the_bf16_residual_norm_gives_the_float32_passes_bits() -> None:
    """Under bf16 autocast a decoder layer's residual add + RMSNorm (`fused.add_rms_norm(...,
    low_out=True)`) reads the bf16 sublayer output and hands the next sublayer a bf16 row; its
    backward reads that row's bf16 gradient: every value equals the float32 form's with the
    casts autocast and autograd would add (the C pass on the widened operands, rounded once)."""
    gen = torch.Generator().manual_seed(9)
    x0 = torch.randn(8, 64, 256, generator=gen)
    y0 = torch.randn(8, 64, 256, generator=gen).bfloat16()
    w = torch.randn(256, generator=gen)
    g_out = torch.randn(8, 64, 256, generator=gen).bfloat16()
    g_h = torch.randn(8, 64, 256, generator=gen)

    def run(low_out: bool) -> list[torch.Tensor]:
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, out = fused.add_rms_norm(x, y, w, 1e-6, low_out=low_out)
            assert out.dtype == (torch.bfloat16 if low_out else torch.float32)
            out = out.to(torch.bfloat16)  # what the next product reads (a cast where float32)
        torch.autograd.backward([h, out], [g_h, g_out])
        assert x.grad is not None and y.grad is not None
        return [h.detach(), out.detach(), x.grad, y.grad]

    got, want = run(True), run(False)
    assert [t.dtype for t in got] == [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(_threads(1, lambda: run(True))[2], got[2])


def test_a_bf16_checkpoints_training_attention_runs_as_gemms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 model outside autocast (a checkpoint as loaded): its training forward's attention
    runs as the bf16 batched GEMMs (torch's bf16 flash attention backward was 4-11x slower),
    within bf16 rounding of torch's SDPA; inference, float32, a CPU without fast bf16 and sizes
    whose kept probabilities exceed `KEPT_BYTES` keep SDPA."""
    from tinker_sr.engine import bf16_attention, model

    monkeypatch.setattr(bf16_attention, "_fast_bf16", lambda: True)  # as measured (AMX)
    gen = torch.Generator().manual_seed(10)
    q0 = torch.randn(4, 8, 40, 64, generator=gen).bfloat16()
    k0, v0 = (torch.randn(4, 4, 40, 64, generator=gen).bfloat16() for _ in range(2))
    do = torch.randn(4, 8, 40, 64, generator=gen).bfloat16()
    calls: list[int] = []
    real = bf16_attention._BF16CausalAttention.apply
    monkeypatch.setattr(
        bf16_attention._BF16CausalAttention, "apply", lambda *a: calls.append(1) or real(*a)
    )

    def run(attend: Any) -> list[torch.Tensor]:
        inputs = [x.clone().requires_grad_() for x in (q0, k0, v0)]
        o = attend(*inputs)
        return [o.detach(), *torch.autograd.grad(o, inputs, do)]

    got = run(model._causal_attention)
    assert calls == [1]
    want = run(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) < 3e-2
    calls.clear()
    with torch.no_grad():
        model._causal_attention(q0, k0, v0)
    run(lambda q, k, v: model._causal_attention(q.float(), k.float(), v.float()).bfloat16())
    monkeypatch.setattr(bf16_attention, "_fast_bf16", lambda: False)  # bf16 emulated: SDPA
    run(model._causal_attention)
    monkeypatch.setattr(bf16_attention, "_fast_bf16", lambda: True)
    monkeypatch.setattr(bf16_attention, "KEPT_BYTES", 4 * 8 * 40 * 40 * 2 - 1)
    run(model._causal_attention)
    assert calls == []
