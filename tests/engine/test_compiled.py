"""The compiled kernels (`engine.compiled`: the C attention kernel, on by default, and the
opt-in ``$TINKER_SR_COMPILE=1`` inductor loops) against the eager engine: same forward values
and gradients to float32 rounding, the kernels really ran, one compile serves every batch
shape, and a failed compile or build falls back to eager. Skipped where torch.compile cannot
build C++ here (no compiler)."""

from __future__ import annotations

import dataclasses
import math
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tinker_sr.engine import attention_inputs, compiled, fused, native
from tinker_sr.engine.lora import LoraSpec, apply_lora, trainable_parameters
from tinker_sr.engine.model import BUILTIN_CONFIGS, build_model

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None,
    reason="torch.compile's CPU backend needs a C++ compiler",
)

KERNELS = {"rms_norm", "rms_norm_backward", "rope", "rope_inverse", "silu_mul", "swiglu_backward"}


@pytest.fixture(scope="module")
def module_kernels(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The module's kernel cache: each C library is built once for the module's tests (a
    build takes about a second; what a test checks is the kernels' results, not the build)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch, module_kernels: Any) -> Iterator[list[str]]:
    """Names of the compiled kernels that ran (and returned a result). The C kernels are
    built into (or loaded from) the module's kernel cache, reloaded for each test."""
    monkeypatch.setenv(native.CACHE_ENV, str(module_kernels))
    caches = (native.load, compiled._attention_library, compiled._rows_library)
    for cached in caches:
        cached.cache_clear()
    names: list[str] = []

    def record(attr: str, label: Callable[[tuple[Any, ...]], str], module: Any = compiled) -> None:
        """Wrap ``module.<attr>`` to note ``label(args)`` each time it returns a result."""
        original = getattr(module, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if out is not None:
                names.append(label(args))
            return out

        monkeypatch.setattr(module, attr, wrapper)

    record("call", lambda args: args[0])  # inductor's loops, by kernel name
    record("call_native", lambda args: f"c:{args[0]}")  # the C row kernels
    record("norm_rope", lambda args: "c:norm_rope", attention_inputs)
    record("qkv_heads", lambda args: "c:qkv_heads", attention_inputs)
    record("swiglu_backward_da", lambda args: "c:swiglu_backward_da")
    record("silu_mul_xa", lambda args: "c:silu_mul_xa")
    record("attention", lambda args: "attention")
    record("lora_grads", lambda args: "c:lora_grads", fused)
    record("swiglu_backward_lora", lambda args: "c:swiglu_backward_lora", fused)
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 1024)  # the tiny model's tensors qualify
    monkeypatch.setattr(compiled, "_failure", None)
    monkeypatch.setattr(compiled, "_native_failure", None)
    yield names
    compiled.enabled.cache_clear()
    compiled.native_mode.cache_clear()
    for cached in caches:
        cached.cache_clear()


def _close_to(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Each result within float32 rounding of its reference: 1e-5 relative, or 1e-5 of the
    reference's largest magnitude (shapes and dtypes equal)."""
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))


def _at_threads(n: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` with torch on ``n`` threads (the C kernels take torch's count), then back."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(threads)


def _switch(monkeypatch: pytest.MonkeyPatch, on: bool, inductor: bool | None = None) -> None:
    """The C kernels on (required: ``$TINKER_SR_NATIVE=1``) or off, and the inductor loops
    the same unless ``inductor`` says otherwise."""
    monkeypatch.setenv(compiled.ENV, "1" if (on if inductor is None else inductor) else "0")
    monkeypatch.setenv(compiled.NATIVE_ENV, "1" if on else "0")
    compiled.enabled.cache_clear()
    compiled.native_mode.cache_clear()


def _model(head_dim: int | None = None) -> torch.nn.Module:
    config = dataclasses.replace(
        BUILTIN_CONFIGS["tinker-sr/tiny"], qk_norm=True, explicit_head_dim=head_dim
    )
    model = build_model(config)
    apply_lora(model, LoraSpec(rank=4, seed=0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainable_parameters(model):
            if "lora_B" in name:  # B = 0 at init would hide the adapter's gradient paths
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _step(tokens: torch.Tensor, head_dim: int | None = None) -> list[torch.Tensor]:
    model = _model(head_dim)
    logits = model(tokens)
    (logits.logsumexp(-1) - logits[..., 3]).sum().backward()
    return [logits.detach()] + [p.grad for _, p in trainable_parameters(model)]  # type: ignore[misc]


def test_a_training_step_matches_the_eager_engine(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = torch.randint(0, 256, (4, 96), generator=torch.Generator().manual_seed(0))
    _switch(monkeypatch, False)
    want = _step(tokens)
    assert not ran
    _switch(monkeypatch, True)
    got = _step(tokens)
    # The C kernels first; inductor's loops for what they do not take (the rotations, and the
    # norms of q/k's strided views at this head size).
    assert C_KERNELS | {"attention", "rope", "rope_inverse", "rms_norm"} <= set(ran), set(ran)
    for a, b in zip(got, want, strict=True):
        assert float((a - b).norm() / b.norm()) < 1e-5
    ran.clear()
    again = _step(tokens)  # the same compiled kernels: bit-identical
    for a, b in zip(again, got, strict=True):
        assert torch.equal(a, b)


def test_activation_checkpointing_keeps_the_c_passes_and_their_bits(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With each layer recomputed in backward, the SwiGLU gradient's pass still forms the
    gate/up group's adapter gradients (reading that node's recomputed saved input) and the
    fused residual-add norms still run: the same gradients, bit for bit, as keeping every
    activation."""
    _switch(monkeypatch, True)
    tokens = torch.randint(0, 256, (4, 96), generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in (False, True):
        ran.clear()
        model = _model()
        model.checkpoint_layers = recompute
        model(tokens).logsumexp(-1).sum().backward()
        assert {"c:swiglu_backward_lora", "c:rms_norm_backward"} <= set(ran), set(ran)
        results.append([p.grad for _, p in trainable_parameters(model)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_each_kernel_matches_its_eager_twin(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, 4, 32, generator=gen)
    w = torch.randn(32, generator=gen)
    angles = torch.randn(40, 16, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    gate_up = torch.randn(2, 300, 64, generator=gen)

    def run() -> list[torch.Tensor]:
        xs = x.clone().requires_grad_()
        y = fused.rms_norm(xs, w, 1e-6)
        z = fused.rope(y.transpose(1, 2), cos, sin)  # a strided view, as in attention
        g = gate_up.clone().requires_grad_()
        h = fused.swiglu(*g.chunk(2, -1))
        (z.square().sum() + (h * h.detach().sin()).sum()).backward()
        assert xs.grad is not None and g.grad is not None
        return [y.detach(), z.detach(), h.detach(), xs.grad, g.grad]

    _switch(monkeypatch, False)
    want = run()
    _switch(monkeypatch, False, inductor=True)  # inductor's loops alone
    got = run()
    assert {"rms_norm", "rms_norm_backward", "rope", "rope_inverse", "silu_mul"} <= set(ran)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# What a LoRA training step runs in C (attention and q/k aside): its SwiGLU and SwiGLU
# gradient are the variants that also run the down projection's adapter products, and the
# SwiGLU gradient's pass (swiglu_backward_da) also runs the gate/up group's (through
# swiglu_backward_lora).
C_KERNELS = {
    "c:rms_norm",
    "c:rms_norm_backward",
    "c:silu_mul_xa",
    "c:swiglu_backward_da",
    "c:swiglu_backward_lora",
    "c:lora_grads",
}


def test_the_c_row_kernels_match_their_eager_twins(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default engine (no inductor): RMSNorm, silu * up and their gradients in C, with row
    lengths off the vector width (40, 24: scalar tails), chunks of [gate | up] (strided rows),
    against eager; bit-identical at 1 and 2 threads."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 40, 3, 40, generator=gen) * 3
    w = torch.randn(40, generator=gen)
    gate_up = torch.randn(2, 300, 2 * 24, generator=gen) * 4
    down = torch.randn(24, 8, generator=gen)

    def run() -> list[torch.Tensor]:
        xs = x.clone().requires_grad_()
        y = fused.rms_norm(xs, w, 1e-6)
        g = gate_up.clone().requires_grad_()
        h = fused.swiglu(*g.chunk(2, -1))
        ((y * y.detach().cos()).sum() + (h @ down).square().sum()).backward()
        assert xs.grad is not None and g.grad is not None
        return [y.detach(), h.detach(), xs.grad, g.grad]

    _switch(monkeypatch, False)
    want = run()
    assert not ran
    _switch(monkeypatch, True, inductor=False)
    got = run()
    assert {"c:rms_norm", "c:rms_norm_backward", "c:silu_mul"} <= set(ran), ran
    assert not set(ran) & KERNELS  # no inductor loop ran
    _close_to(got, want)
    again = _at_threads(2, run)
    for a, b in zip(again, got, strict=True):
        assert torch.equal(a, b)
    # The merged LoRA MLP's backward: both halves of the gate/up gradient from one C loop.
    gu = gate_up.clone()
    dh = torch.randn(2, 300, 24, generator=gen)
    both = compiled.call_native("swiglu_backward", gu.clone(), dh)
    gate, up = gu.chunk(2, -1)
    sig = torch.sigmoid(gate)
    torch.testing.assert_close(
        both, torch.cat([dh * up * sig * (1 + gate * (1 - sig)), gate * sig * dh], -1)
    )
    assert compiled.call_native("swiglu_backward", gu.transpose(0, 1), dh) is None  # layout


def test_bf16_autocast_normalises_the_float32_residual_in_c(ran: list[str]) -> None:
    """Under CPU bf16 autocast the residual stream stays float32: its RMSNorms, alone and after
    adding a bf16 sublayer output, run the C forward passes (which stand aside under autocast
    otherwise), with the values of the same passes in a float32 step; backward, outside
    autocast as the engine runs it, gives the bf16 operand the float32 gradient rounded to
    bf16, as a promoting add does."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, 48, generator=gen)
    y = torch.randn(4, 64, 48, generator=gen).bfloat16()
    w = torch.randn(48, generator=gen)

    def run(autocast: bool) -> list[torch.Tensor]:
        xs = x.clone().requires_grad_()
        ys = (y if autocast else y.float()).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h, n = fused.add_rms_norm(xs, ys, w, 1e-6)
            m = fused.rms_norm(h, w, 1e-6)
        ((n * n.detach().cos()).sum() + m.square().sum()).backward()  # outside, as the engine
        assert xs.grad is not None and ys.grad is not None
        return [h.detach(), n.detach(), m.detach(), xs.grad, ys.grad]

    got = run(autocast=True)
    assert {"c:rms_norm", "c:rms_norm_backward"} <= set(ran), ran
    assert [t.dtype for t in got] == [torch.float32] * 4 + [torch.bfloat16]
    ran.clear()
    want = run(autocast=False)
    assert {"c:rms_norm", "c:rms_norm_backward"} <= set(ran), ran
    for a, b in zip(got[:4], want[:4], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[4], want[4].bfloat16())


def test_the_default_training_step_runs_every_c_kernel(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$TINKER_SR_NATIVE`` unset (the default), no inductor: the tiny model's LoRA step runs
    attention and every row kernel in C, within float32 rounding of torch's kernels, and
    bit-identical when repeated."""
    tokens = torch.randint(0, 256, (4, 96), generator=torch.Generator().manual_seed(0))
    for head_dim in (None, 32):  # 16 (tiny's own): q/k norm and RoPE eager; 32: in C
        _switch(monkeypatch, False)
        want = _step(tokens, head_dim)
        monkeypatch.delenv(compiled.NATIVE_ENV)
        compiled.native_mode.cache_clear()
        ran.clear()
        got = _step(tokens, head_dim)
        c_ran = C_KERNELS | {"attention"} | ({"c:qkv_heads"} if head_dim else set())
        assert set(ran) == c_ran, set(ran)
        for a, b in zip(got, want, strict=True):
            assert float((a - b).norm() / b.norm()) < 1e-5
        again = _step(tokens, head_dim)
        for a, b in zip(again, got, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("normed", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize("used", ["qkv", "qk"])
def test_qkv_heads_matches_the_split_views(
    normed: bool, used: str, ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`attention_inputs.qkv_heads` (one node: q and k through the C norm + RoPE, v a view; backward
    writing every gradient into its slice of one q/k/v gradient) against splitting the
    projection output into views and the eager norm and RoPE nodes: q, k, v and the q/k/v
    gradient, also when v takes no gradient (its slice then zero)."""
    from tinker_sr.engine.model import rope_angles

    b, t, h, kv, d = 2, 70, 4, 2, 64
    gen = torch.Generator().manual_seed(31)
    qkv = torch.randn(b, t, (h + 2 * kv) * d, generator=gen) * 2
    wq, wk = (torch.randn(d, generator=gen) if normed else None for _ in range(2))
    cos, sin = rope_angles(torch.rand(d // 2, generator=gen), 5, t, torch.float32, qkv.device)
    grads = [torch.randn(b, n, t, d, generator=gen) for n in (h, kv, kv)]

    def run(c_kernel: bool) -> list[torch.Tensor]:
        src = qkv.clone().requires_grad_()
        if c_kernel:
            got = attention_inputs.qkv_heads(src, (h, kv, d), wq, wk, 1e-6, cos, sin)
            assert got is not None
            q, k, v = got
        else:
            xq, xk, xv = src.split([h * d, kv * d, kv * d], dim=-1)
            parts = []
            for x, n, w in ((xq, h, wq), (xk, kv, wk)):
                x = x.view(b, t, n, d)
                x = x if w is None else fused.rms_norm(x, w, 1e-6)
                parts.append(fused.rope(x.transpose(1, 2), cos, sin))
            q, k = parts
            v = xv.view(b, t, kv, d).transpose(1, 2)
        outs = [q, k, v] if used == "qkv" else [q, k]
        torch.autograd.backward(outs, grads[: len(outs)])
        assert src.grad is not None
        return [q.detach(), k.detach(), v.detach(), src.grad]

    _switch(monkeypatch, True, inductor=False)
    want = run(c_kernel=False)
    got = run(c_kernel=True)
    assert ran.count("c:qkv_heads") == 1
    _close_to(got, want)
    if used == "qk":
        assert torch.equal(got[3][..., (h + kv) * d :], torch.zeros(b, t, kv * d))
    bad = qkv[..., :-d]  # not (H + 2 KV) x D wide: refused, the caller splits
    assert attention_inputs.qkv_heads(bad, (h, kv, d), wq, wk, 1e-6, cos, sin) is None


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("normed", [True, False], ids=["qk-norm", "rope-only"])
def test_norm_rope_matches_the_eager_nodes(
    d: int, normed: bool, ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """q from a fused q/k/v projection (a strided view), Qwen3's per-head RMSNorm (or none),
    RoPE, into attention's [B, H, T, D] layout: one C pass each way against fused.rms_norm +
    fused.rope, forward and input gradient; bit-identical at 1 and 2 threads."""
    from tinker_sr.engine.model import rope_angles

    b, t, h, kv = 3, 70, 4, 2
    gen = torch.Generator().manual_seed(d)
    qkv = torch.randn(b, t, (h + 2 * kv) * d, generator=gen) * 2
    weight = torch.randn(d, generator=gen) if normed else None
    cos, sin = rope_angles(torch.rand(d // 2, generator=gen), 5, t, torch.float32, qkv.device)
    go = torch.randn(b, h, t, d, generator=gen)

    def run(c_kernel: bool) -> list[torch.Tensor]:
        src = qkv.clone().requires_grad_()
        x = src[..., : h * d].view(b, t, h, d)  # a strided view, as the model's q
        if c_kernel:
            assert attention_inputs.use_norm_rope(x, weight, cos, sin)
            y = attention_inputs.norm_rope(x, weight, 1e-6, cos, sin)
            assert y is not None
        else:
            n = x if weight is None else fused.rms_norm(x, weight, 1e-6)
            y = fused.rope(n.transpose(1, 2), cos, sin)
        y.backward(go)
        assert y.is_contiguous() and src.grad is not None
        return [y.detach(), src.grad]

    _switch(monkeypatch, True, inductor=False)
    want = run(c_kernel=False)
    got = run(c_kernel=True)
    assert ran.count("c:norm_rope") == 1
    _close_to(got, want)
    again = _at_threads(2, lambda: run(c_kernel=True))
    for a, w in zip(again, got, strict=True):
        assert torch.equal(a, w)
    x = qkv[..., : h * d].view(b, t, h, d)
    assert not attention_inputs.use_norm_rope(x[..., :16], None, cos[:, :16], sin[:, :16])  # D % 32
    assert not attention_inputs.use_norm_rope(x, None, cos[:-1], sin[:-1])  # tables for other T
    trainable = torch.ones(d, requires_grad=True)  # a norm weight that trains: eager
    assert not attention_inputs.use_norm_rope(x, trainable, cos, sin)


def test_one_compile_serves_every_batch_shape(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters

    _switch(monkeypatch, False, inductor=True)
    w = torch.randn(64)
    for batch in (1, 2):  # warm: dynamic shapes still specialise a size of 1 (and 0)
        fused.rms_norm(torch.randn(batch, 40, 64), w, 1e-6)
    before = counters["stats"]["unique_graphs"]
    for shape in ((3, 77, 64), (5, 130, 64), (1, 999, 64), (16, 256, 64)):
        x = torch.randn(shape)
        torch.testing.assert_close(
            fused.rms_norm(x, w, 1e-6),
            x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w,
        )
    assert counters["stats"]["unique_graphs"] == before
    assert ran.count("rms_norm") == 6


def test_a_failed_compile_warns_once_and_keeps_eager(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("InductorError: CppCompileError: C++ compile error\nmore lines")

    monkeypatch.setattr(compiled, "_kernels", lambda: dict.fromkeys(KERNELS, broken))
    monkeypatch.setattr(compiled, "_attention_library", lambda: None)
    monkeypatch.setattr(compiled, "_rows_library", lambda: None)
    monkeypatch.setattr(native, "failure", lambda name: "RuntimeError: no C compiler on PATH")
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    _switch(monkeypatch, False)
    want = _step(tokens)
    _switch(monkeypatch, True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _step(tokens)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages  # once for each kind of kernel, naming its variable
    inductor = [m for m in messages if f"${compiled.ENV}=1" in m]
    c_kernels = [m for m in messages if f"${compiled.NATIVE_ENV}=1" in m]
    assert len(inductor) == len(c_kernels) == 1, messages
    assert "C++ compiler" in inductor[0] and "C compiler" in c_kernels[0]
    assert "CppCompileError" in (compiled.failure() or "")
    assert "no C compiler" in (compiled.native_failure() or "")
    assert not ran
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)  # the eager path exactly


@pytest.mark.parametrize("raw", ["2", "yes please"])
@pytest.mark.parametrize("which", ["compile", "native"])
def test_a_bad_setting_names_the_variable(
    raw: str, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env, read = {
        "compile": (compiled.ENV, compiled.enabled),
        "native": (compiled.NATIVE_ENV, compiled.native_mode),
    }[which]
    monkeypatch.setenv(env, raw)
    read.cache_clear()
    try:
        with pytest.raises(ValueError, match=env):
            read()
    finally:
        monkeypatch.delenv(env)
        read.cache_clear()


def test_off_by_default_and_never_for_small_or_non_float32_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inductor loops are opt-in; the C attention is on by default (``auto``) and off with
    ``$TINKER_SR_NATIVE=0``; neither for small, float64, autocast or inference-mode tensors."""
    monkeypatch.delenv(compiled.ENV, raising=False)
    monkeypatch.delenv(compiled.NATIVE_ENV, raising=False)
    monkeypatch.setattr(compiled, "_native_failure", None)
    compiled.enabled.cache_clear()
    compiled.native_mode.cache_clear()
    big = torch.randn(compiled.MIN_ELEMENTS)
    assert not compiled.use(big)
    q = torch.randn(2, 4, compiled.MIN_ELEMENTS // 256, 64)
    assert compiled.native_mode() == "auto" and compiled.use_attention(q, q[:, :2], q[:, :2])
    for tiny_or_not_float32 in (q[:, :, :4], q.double()):
        assert not compiled.use_attention(*[tiny_or_not_float32] * 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not compiled.use_attention(q, q, q)
    with torch.inference_mode():
        assert not compiled.use_attention(q, q, q)
    monkeypatch.setenv(compiled.NATIVE_ENV, "0")
    compiled.native_mode.cache_clear()
    assert not compiled.use_attention(q, q, q)
    compiled.native_mode.cache_clear()
    _switch(monkeypatch, True)
    try:
        assert compiled.use(big)
        assert not compiled.use(big[:100])
        assert not compiled.use(big.double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not compiled.use(big)
        with torch.inference_mode():  # sampling
            assert not compiled.use(big)
    finally:
        compiled.enabled.cache_clear()


def test_the_public_client_trains_and_samples_with_compiled_kernels(
    ran: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """``$TINKER_SR_COMPILE=1`` and ``$TINKER_SR_NATIVE=1`` as a user sets them: the embedded
    engine's training step runs the compiled kernels on its worker thread and gives the eager
    loss to float32 rounding;
    a sampler beside it keeps the eager kernels (inference mode)."""
    from tests.conftest import embedded_client
    from tinker_sr import types

    rows = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0)).tolist()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * 64},
        )
        for r in rows
    ]

    def run(on: bool, store: str) -> tuple[float, list[str]]:
        _switch(monkeypatch, on)
        with embedded_client(tmp_path / store) as service:
            training = service.create_lora_training_client("tinker-sr/tiny", rank=4, seed=0)
            out = training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            trained = len(ran)
            sampler = training.save_weights_and_get_sampling_client()
            params = types.SamplingParams(max_tokens=8, seed=0)
            prompt = types.ModelInput.from_ints(rows[0][:40])
            got = sampler.sample(prompt, num_samples=8, sampling_params=params).result()
            assert len(ran) == trained  # sampling ran no compiled kernel
            return float(out.metrics["loss:sum"]), [s.tokens for s in got.sequences]

    want, _ = run(False, "eager")
    got, tokens = run(True, "compiled")
    # The C kernels take the norms and SwiGLU first, inductor the rotations (head size 16).
    assert C_KERNELS | {"attention", "rope", "rope_inverse"} <= set(ran), set(ran)
    assert abs(got - want) <= 1e-5 * abs(want)
    assert all(len(t) == 8 for t in tokens)


# ---- the C attention kernel --------------------------------------------------------------------


@pytest.fixture
def kernel_cache(ran: list[str], module_kernels: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The kernels switched on, with the module's kernel cache directory `ran` set up."""
    _switch(monkeypatch, True)
    return module_kernels


@pytest.fixture
def fresh_kernel_cache(kernel_cache: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`kernel_cache`, but an empty directory of this test's own (for what a build leaves)."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "kernels"))
    return tmp_path / "kernels"


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor, native_kernel: bool
) -> list[torch.Tensor]:
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    if native_kernel:
        out = compiled.attention(q, k, v)
        assert out is not None
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
    out.backward(go)
    return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


@pytest.mark.parametrize(
    "shape",  # B, H, KV, T, D: grouped and plain heads, T off the 64-block, head sizes
    [
        (2, 4, 2, 100, 64),
        (1, 2, 1, 37, 32),
        (3, 6, 3, 130, 48),
        (1, 2, 2, 64, 128),
        (4, 8, 4, 1, 64),
    ],
)
def test_attention_kernel_matches_float64_sdpa(shape: tuple[int, ...], kernel_cache: Any) -> None:
    b, h, kv, t, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q, k, v = (torch.randn(b, n, t, d, generator=gen) for n in (h, kv, kv))
    go = torch.randn(b, h, t, d, generator=gen)
    got = _attend(q, k, v, go, native_kernel=True)
    want = _attend(q.double(), k.double(), v.double(), go.double(), native_kernel=False)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float((a.double() - w).abs().max() / max(float(w.abs().max()), 1.0))
        assert err < 2e-6, (name, err)
    assert got[0].transpose(1, 2).is_contiguous()  # [B, T, H, D] underneath: no copy for o_proj


def test_attention_reads_a_strided_v_in_place(kernel_cache: Any) -> None:
    """V as the model passes it (a [B, KV, T, D] view of the q/k/v projection's output, heads
    strided) gives the same bits as a contiguous copy; T off the 64-row blocks (padding)."""
    gen = torch.Generator().manual_seed(3)
    b, h, kv, t, d = 2, 4, 2, 90, 64
    qkv = torch.randn(b, t, (h + 2 * kv) * d, generator=gen)
    v = qkv[..., (h + kv) * d :].view(b, t, kv, d).transpose(1, 2)
    q, k = (torch.randn(b, n, t, d, generator=gen) for n in (h, kv))
    go = torch.randn(b, h, t, d, generator=gen)
    assert not v.is_contiguous()
    strided = compiled.attention(q, k, v)
    assert strided is not None
    assert torch.equal(strided, _attend(q, k, v.contiguous(), go, True)[0])


def test_attention_kernel_is_bit_identical_whatever_the_thread_count(kernel_cache: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, n, 200, 64, generator=gen) for n in (4, 2, 2))
    go = torch.randn(3, 4, 200, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(q, k, v, go, native_kernel=True)
        torch.set_num_threads(max(2, threads))
        more = _attend(q, k, v, go, native_kernel=True)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, more, strict=True):
        assert torch.equal(a, b)


def test_the_kernel_library_is_cached_per_cpu(
    fresh_kernel_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_cache = fresh_kernel_cache
    compiler = native._compiler()
    assert compiler is not None
    assert native.load("causal_attention") is not None
    built = native.library_path("causal_attention", compiler)
    assert built.exists() and built.parent == kernel_cache
    assert [p.name for p in kernel_cache.iterdir()] == [built.name]  # no temporary left over
    from tinker_sr.engine import cpu

    real = cpu._cpuinfo_field
    monkeypatch.setattr(cpu, "_cpuinfo_field", lambda f: "other flags" if f == "flags" else real(f))
    assert native.library_path("causal_attention", compiler) != built  # never reused there


def test_a_build_variants_failure_is_kept_apart_from_the_main_builds(
    fresh_kernel_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library built with macros (``native.load(name, defines)``: a benchmark's or a test's
    baseline) that fails does not replace why the main build failed, nor vice versa."""
    monkeypatch.setattr(native, "load", native.load.__wrapped__)  # uncached, for this test
    monkeypatch.setattr(native, "_failures", {})  # what it records goes with it

    def fails(name: str, defines: tuple[str, ...] = ()) -> Any:
        raise RuntimeError(f"{name} built with {list(defines)} failed")

    monkeypatch.setattr(native, "_build_and_load", fails)
    assert native.load("delta_rule") is None
    assert native.load("delta_rule", ("TSR_RULE_NARROW",)) is None
    assert native.failure("delta_rule") == "RuntimeError: delta_rule built with [] failed"
    assert native.failure("delta_rule", ("TSR_RULE_NARROW",)) == (
        "RuntimeError: delta_rule built with ['TSR_RULE_NARROW'] failed"
    )
    assert native.failure("delta_rule", ("TSR_RULE_PLAIN_BACKWARD",)) is None


def test_no_compiler_falls_back_to_torch_attention(
    fresh_kernel_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$TINKER_SR_NATIVE=1`` warns; the default (``auto``) only logs it."""
    kernel_cache = fresh_kernel_cache
    monkeypatch.setattr(native, "_compiler", lambda: None)
    q = torch.randn(1, 2, 64, 16)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert compiled.attention(q, q[:, :1], q[:, :1]) is None
    assert "no C compiler" in (compiled.native_failure() or "")
    assert compiled.failure() is None  # the inductor loops are another matter
    assert not compiled.use_attention(q, q[:, :1], q[:, :1])  # torch's from now on
    assert not list(kernel_cache.glob("*.so"))


def test_by_default_a_missing_compiler_only_logs(
    ran: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(compiled.NATIVE_ENV, raising=False)
    compiled.native_mode.cache_clear()
    monkeypatch.setattr(native, "_compiler", lambda: None)
    model = _model()
    tokens = torch.randint(0, 256, (4, 96), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        with caplog.at_level("INFO", logger="tinker_sr.engine"):
            model(tokens).sum().backward()
    assert "no C compiler" in caplog.text and compiled.NATIVE_ENV in caplog.text
    assert "no C compiler" in (compiled.native_failure() or "") and not ran


def test_attention_scale_and_unsupported_shapes(kernel_cache: Any) -> None:
    q = torch.randn(1, 2, 64, 24)  # head size not a multiple of 16: torch's kernel
    assert not compiled.use_attention(q, q, q)
    q = torch.randn(1, 3, 64, 32)  # 3 query heads over 2 KV heads
    assert not compiled.use_attention(q, q[:, :2], q[:, :2])
    threads = torch.get_num_threads()
    try:  # fewer (batch row, KV head) pairs than threads: the backward would leave threads idle
        torch.set_num_threads(2)
        q = torch.randn(1, 2, 64, 32)
        assert not compiled.use_attention(q, q[:, :1], q[:, :1])
        assert compiled.use_attention(q, q, q)
    finally:
        torch.set_num_threads(threads)
    q = torch.randn(1, 1, 64, 32)
    out = compiled.attention(q, q, q)
    assert out is not None
    scores = (q @ q.transpose(-1, -2)) / math.sqrt(32)
    scores = scores.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ q, rtol=1e-5, atol=1e-5)


def test_attention_kernel_on_random_shapes_and_strided_inputs(kernel_cache: Any) -> None:
    """Shapes drawn at random (batch, groups, length across block edges, head sizes), with
    q/k/v as the strided views a fused q/k/v projection hands attention."""
    rng = torch.Generator().manual_seed(11)
    checked = 0
    for _ in range(12):
        b, kv, group = (int(torch.randint(1, 4, (1,), generator=rng)) for _ in range(3))
        t = int(torch.randint(1, 200, (1,), generator=rng))
        d = 16 * int(torch.randint(1, 9, (1,), generator=rng))
        h = kv * group
        qkv = torch.randn(b, t, h + 2 * kv, d, generator=rng)  # [B, T, heads, D] side by side
        q, k, v = (x.transpose(1, 2) for x in qkv.split([h, kv, kv], dim=2))
        go = torch.randn(b, h, t, d, generator=rng)
        if q.numel() < compiled.MIN_ELEMENTS:
            continue
        got = _attend(q, k, v, go, native_kernel=True)
        want = _attend(q.double(), k.double(), v.double(), go.double(), native_kernel=False)
        for a, w in zip(got, want, strict=True):
            err = float((a.double() - w).abs().max() / max(float(w.abs().max()), 1.0))
            assert err < 2e-6, ((b, h, kv, t, d), err)
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("t", [48, 128, 130])
def test_attention_reads_v_in_place_where_no_row_past_t_is_read(t: int, kernel_cache: Any) -> None:
    """V as the strided slice of a fused q/k/v output: read in place (not copied, and that
    view is what backward keeps) where T % 16 == 0, a zero-padded copy otherwise; results
    within float32 rounding of float64 either way."""
    rng = torch.Generator().manual_seed(t)
    b, h, kv, d = 2, 4, 2, 32
    qkv = torch.randn(b, t, h + 2 * kv, d, generator=rng)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([h, kv, kv], dim=2))
    go = torch.randn(b, h, t, d, generator=rng)
    got = _attend(q, k, v, go, native_kernel=True)
    want = _attend(q.double(), k.double(), v.double(), go.double(), native_kernel=False)
    for a, w in zip(got, want, strict=True):
        assert float((a.double() - w).abs().max() / max(float(w.abs().max()), 1.0)) < 2e-6
    v = v.detach().requires_grad_()
    out = compiled.attention(q.detach().requires_grad_(), k.detach().requires_grad_(), v)
    assert out is not None and out.grad_fn is not None
    kept = out.grad_fn.saved_tensors[2]
    assert (kept.data_ptr() == v.data_ptr()) == (t % 16 == 0)


@pytest.mark.parametrize("rank", [8, 12])
def test_c_silu_mul_with_the_down_adapters_xa(
    rank: int, ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compiled.silu_mul_xa`: h = silu(gate) * up bit-identical to the C `silu_mul`, and
    xa = h a^T from the same pass against torch (an odd row count, a width off the vector
    width, ranks in and off groups of 8); bit-identical at 1 and 2 threads; layouts it does
    not take are refused."""
    _switch(monkeypatch, True, inductor=False)
    gen = torch.Generator().manual_seed(43)
    gate_up = torch.randn(3, 201, 2 * 40, generator=gen) * 2
    gate, up = gate_up.chunk(2, -1)
    a = torch.randn(rank, 40, generator=gen)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        got = compiled.silu_mul_xa(gate, up, a)
        assert got is not None
        return got

    h, xa = run()
    assert torch.equal(h, compiled.call_native("silu_mul", gate, up))
    want = h.double().reshape(-1, 40) @ a.double().t()
    torch.testing.assert_close(xa.double(), want, rtol=1e-5, atol=1e-5)
    one = _at_threads(1, run)
    assert torch.equal(one[0], h) and torch.equal(one[1], xa)
    assert compiled.silu_mul_xa(gate, up, a.t().contiguous().t()) is None  # a not row-major
    assert compiled.silu_mul_xa(gate, up, a[:, :32].contiguous()) is None  # a too narrow


def test_c_swiglu_backward_with_the_down_adapters_da(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compiled.swiglu_backward_da`: the SwiGLU gradient written over [gate | up] and
    dA = yb^T (silu(gate) * up) from the same pass, against torch (rows off the 64-row blocks
    and the 4-row steps, a width off the vector width); bit-identical at 1 and 2 threads;
    layouts it does not take are refused."""
    _switch(monkeypatch, True, inductor=False)
    gen = torch.Generator().manual_seed(41)
    gate_up = torch.randn(3, 203, 2 * 40, generator=gen) * 2
    dh = torch.randn(3, 203, 40, generator=gen)
    yb = torch.randn(3 * 203, 8, generator=gen)
    gate, up = gate_up.double().chunk(2, -1)
    sig = torch.sigmoid(gate)
    h = gate * sig * up
    want_dgu = torch.cat([dh * up * sig * (1 + gate * (1 - sig)), gate * sig * dh], -1)
    want_da = yb.double().t() @ h.reshape(-1, 40)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        got = compiled.swiglu_backward_da(gate_up.clone(), dh, yb)
        assert got is not None
        return got

    d_gate_up, da = run()
    torch.testing.assert_close(d_gate_up.double(), want_dgu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(da.double(), want_da, rtol=1e-5, atol=1e-4)
    one = _at_threads(1, run)
    assert torch.equal(one[0], d_gate_up) and torch.equal(one[1], da)
    assert compiled.swiglu_backward_da(gate_up.transpose(0, 1), dh, yb) is None  # layout
    assert compiled.swiglu_backward_da(gate_up.double(), dh.double(), yb.double()) is None


@pytest.mark.parametrize("rank", [8, 4])
def test_c_swiglu_backward_with_the_gate_up_adapters_is_the_two_passes(
    ran: list[str], monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """`fused.swiglu_backward_lora` (the gate/up group's adapter products inside the SwiGLU
    gradient's pass) gives the same bits as `compiled.swiglu_backward_da` followed by
    `fused.lora_grads` on the gradient it wrote: rows off the 64-row blocks, rank 4 padded to
    the kernel's 8; 1 and 2 threads alike; a group that is not [gate | up] is refused."""
    _switch(monkeypatch, True, inductor=False)
    gen = torch.Generator().manual_seed(43)
    rows, f, k = 150, 48, 32
    gate_up = torch.randn(rows, 2 * f, generator=gen) * 2
    dh, yb = torch.randn(rows, f, generator=gen), torch.randn(rows, 8, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    a = [torch.randn(rank, k, generator=gen) for _ in range(2)]
    b = [torch.randn(f, rank, generator=gen) for _ in range(2)]

    def two_passes() -> list[torch.Tensor]:
        got = compiled.swiglu_backward_da(gate_up.clone(), dh, yb)
        assert got is not None
        lg = fused.lora_grads(got[0], b, 0.75, x=x, a=a)
        assert lg is not None and lg.da is not None
        return [*got, lg.dy_b, *lg.db, *lg.da]

    def one_pass() -> list[torch.Tensor]:
        got = fused.swiglu_backward_lora(gate_up.clone(), dh, yb, b, 0.75, x, a)
        assert got is not None and got[2].da is not None
        return [got[0], got[1], got[2].dy_b, *got[2].db, *got[2].da]

    want = two_passes()
    for got in (one_pass(), _at_threads(1, one_pass)):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    uneven = [b[0], torch.randn(f + 16, rank, generator=gen)]  # widths not [F, F]
    assert fused.swiglu_backward_lora(gate_up.clone(), dh, yb, uneven, 0.75, x, a) is None


def _group_products(
    x: torch.Tensor, dy: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], s: float
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """(s dy B, dB_i, dA_i, s x A^T) of a LoRA group in float64, member by member."""
    x, dy = x.double(), dy.double()
    xa = x @ torch.cat(a).double().t() * s
    r, col, dyb, db, da = b[0].shape[1], 0, [], [], []
    for i, b_i in enumerate(b):
        d = dy[:, col : col + b_i.shape[0]]
        col += b_i.shape[0]
        dyb.append(d @ b_i.double() * s)
        db.append(d.t() @ xa[:, i * r : (i + 1) * r])
        da.append(dyb[-1].t() @ x)
    return torch.cat(dyb, 1), db, da, xa


@pytest.mark.parametrize(
    ("rows", "k", "widths", "rank"),
    [
        (203, 80, [64, 32, 32], 8),  # q/k/v-shaped; rows off the 64-row blocks and 3-row steps
        (130, 48, [48, 48], 16),  # gate/up-shaped; widths off the 32-column tiles
        (67, 32, [96], 4),  # a rank off the 8-rank steps: padded
        (70, 272, [320, 16], 8),  # rows and members wider than the kernel's 256-column steps
        (1, 16, [16, 16, 16], 12),
    ],
)
def test_c_lora_grads_match_the_group_products(
    ran: list[str], monkeypatch: pytest.MonkeyPatch, rows: int, k: int, widths: list[int], rank: int
) -> None:
    """`fused.lora_grads`: a LoRA group's s dy B, dB_i and dA_i (from x, or from a given s x
    A^T) in one C pass, each member meeting only its own ranks, against float64 products
    member by member; bit-identical at 1 and 2 threads; layouts it does not take refused."""
    _switch(monkeypatch, True, inductor=False)
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 1)  # a single row qualifies too
    gen = torch.Generator().manual_seed(rows + rank)
    x = torch.randn(rows, k, generator=gen)
    dy = torch.randn(rows, sum(widths), generator=gen)
    a = [torch.randn(rank, k, generator=gen) for _ in widths]
    b = [torch.randn(w, rank, generator=gen) for w in widths]
    want_dyb, want_db, want_da, xa = _group_products(x, dy, a, b, 0.5)

    def run() -> list[torch.Tensor]:
        got = fused.lora_grads(dy, b, 0.5, x=x, a=a)
        given = fused.lora_grads(dy, b, 0.5, xa=xa.float())
        assert got is not None and got.da is not None and given is not None
        assert given.da is None and torch.equal(given.dy_b, got.dy_b)
        # Each gradient in its parameter's layout (autograd would copy a strided one).
        for grad, param in zip([*got.db, *got.da, *given.db], [*b, *a, *b], strict=True):
            assert grad.shape == param.shape and grad.is_contiguous()
        return [got.dy_b, *got.db, *got.da, *given.db]

    got = run()
    want = [want_dyb, *want_db, *want_da, *want_db]
    _close_to([g.double() for g in got], want)
    for one, two in zip(_at_threads(1, run), got, strict=True):
        assert torch.equal(one, two)
    assert fused.lora_grads(dy.double(), [t.double() for t in b], 0.5, xa=xa) is None
    assert fused.lora_grads(dy[:, 1:], [b[0][1:], *b[1:]], 0.5, x=x, a=a) is None  # a width
    if rows > 1:  # columns of unit stride only
        assert fused.lora_grads(dy.t().contiguous().t(), b, 0.5, x=x, a=a) is None


def test_a_second_backward_through_the_c_swiglu_gradient_fails_loudly(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C SwiGLU gradient is written over the node's saved [gate | up] (dead after its
    backward); a second backward through the same graph must fail as autograd does for any
    in-place change, never read the overwritten values."""
    monkeypatch.delenv(compiled.NATIVE_ENV, raising=False)
    compiled.native_mode.cache_clear()
    model = _model()
    tokens = torch.randint(0, 256, (4, 96), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).logsumexp(-1).sum()
    loss.backward(retain_graph=True)
    assert "c:swiglu_backward_lora" in ran  # the gate/up group's adapter products in its pass
    with pytest.raises(RuntimeError, match="inplace"):  # autograd's own check
        loss.backward()


def test_c_softmax_rows_match_torch(ran: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss's softmax passes in C (`softmax_rows`: exp(z - max), its sums and the
    logsumexp, in place; `softmax_scale_rows`: softmax times a per-row scale) against torch,
    with rows of huge, tiny and -inf logits; shapes they do not take are left to torch."""
    _switch(monkeypatch, True, inductor=False)
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(40, 4096, generator=gen) * 10
    z[1] = float("-inf")
    z[1, 7] = 3.0  # one finite logit
    z[2] += 1e4
    z[3] *= 1e-3
    lse = torch.empty(40)
    e = z.clone()
    total = compiled.softmax_rows(e, lse)
    assert total is not None
    want_lse = torch.logsumexp(z.double(), -1)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    top = z.amax(-1, keepdim=True)
    torch.testing.assert_close(e, torch.exp(z - top), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        total.double(), torch.exp(z.double() - top).sum(-1), rtol=1e-5, atol=0
    )
    scale = torch.randn(40, generator=gen)
    scale[5] = 0.0
    got = z.clone()
    assert compiled.softmax_scale_rows(got, want_lse.float(), scale)
    want = torch.exp(z - want_lse.float()[:, None]) * scale[:, None]  # torch's float32 ops
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    assert torch.equal(got[5], torch.zeros(4096))
    odd = torch.randn(40, 4004, generator=gen)  # V not a multiple of 16
    assert compiled.softmax_rows(odd, lse) is None
    assert not compiled.softmax_scale_rows(odd, lse, scale)
    assert compiled.softmax_rows(z.double(), lse.double()) is None


def test_c_exp_matches_torch_over_its_range(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C kernels' vector exp (csrc/vec.h; seen through `softmax_scale_rows` with lse 0 and
    scale 1, i.e. exp(z)) against torch's over every float32 input: normal results within
    3e-7 relative, results below FLT_MIN (x < -87.3) tiny or 0, exp(-inf) exactly 0, overflow
    +inf as torch's (it was clamped to ~2.4e38 once, which made silu of a gate under -88.7 a
    wrong finite value), NaN kept NaN (never clamped away); and a NaN logit makes its row's
    logsumexp NaN."""
    _switch(monkeypatch, True, inductor=False)
    z = torch.linspace(-120.0, 88.3, 64 * 1024).view(64, 1024)
    z[0, :4] = torch.tensor([float("-inf"), float("nan"), float("inf"), 1e30])
    got = z.clone()
    assert compiled.softmax_scale_rows(got, torch.zeros(64), torch.ones(64))
    want = torch.exp(z.double())
    special = torch.zeros_like(z, dtype=torch.bool)
    special[0, :4] = True
    normal = (want > torch.finfo(torch.float32).tiny) & ~special
    rel = ((got.double() - want).abs() / want)[normal]
    assert rel.max().item() < 3e-7
    small = ~normal & ~special
    assert (got[small] >= 0).all() and (got[small] <= 1.2e-38).all()
    assert got[0, 0].item() == 0.0
    assert torch.isnan(got[0, 1])
    assert torch.isposinf(got[0, 2:4]).all()  # exp(inf), exp(1e30): +inf, as torch.exp
    logits = torch.randn(16, 1024)
    logits[3, 100] = float("nan")
    lse = torch.empty(16)
    assert compiled.softmax_rows(logits, lse) is not None
    assert torch.isnan(lse[3]) and torch.isfinite(lse[torch.arange(16) != 3]).all()


def test_c_lora_merge_matches_addmm(ran: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``W + s B A`` (a merged LoRA weight) in one C pass against torch's addmm, with a row
    length off the vector width; bit-identical at 1 and 2 threads; layouts it does not take
    are refused (the caller keeps addmm)."""
    _switch(monkeypatch, True, inductor=False)
    gen = torch.Generator().manual_seed(12)
    w, b, a = (
        torch.randn(300, 520, generator=gen),
        torch.randn(300, 8, generator=gen),
        torch.randn(8, 520, generator=gen),
    )
    out = torch.empty_like(w)
    assert compiled.lora_merge(w, b, a, 2.5, out)
    torch.testing.assert_close(out, torch.addmm(w, b, a, alpha=2.5), rtol=1e-5, atol=1e-5)
    again = torch.empty_like(w)
    assert _at_threads(2, lambda: compiled.lora_merge(w, b, a, 2.5, again))
    assert torch.equal(again, out)
    assert not compiled.lora_merge(w.t(), b, a, 2.5, out)  # not [N, K] contiguous
    assert not compiled.lora_merge(w, b.double(), a, 2.5, out)
    # A bfloat16 weight: accumulated in float32 and rounded once to nearest even (vector body
    # and tail: 520 = 32 x 16 + 8). Against addmm's float32 rounded by torch: within half a
    # bfloat16 step but for float32's own rounding (another summation order), equal but for a
    # few near-ties; NaN stays NaN.
    wh = w.bfloat16()
    wh[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    outh = torch.empty_like(wh)
    assert compiled.lora_merge(wh, b, a, 2.5, outh)
    want = torch.addmm(wh.float(), b, a, alpha=2.5)
    assert outh.dtype == torch.bfloat16 and outh[0, 0].isnan() and outh[0, 1] == float("inf")
    torch.testing.assert_close(outh[:, 2:].float(), want[:, 2:], rtol=1.01 * 2**-8, atol=1e-5)
    assert (outh[:, 2:] == want[:, 2:].bfloat16()).float().mean() > 0.999
    # Mixed dtypes: a bf16 weight merged into float32 (the float32 accumulation itself), a
    # float32 one into bf16 (bf16 mixed precision's merged weight: the float32 merge rounded).
    wide = torch.empty_like(w)
    assert compiled.lora_merge(wh, b, a, 2.5, wide)
    assert torch.equal(wide.bfloat16()[:, 1:], outh[:, 1:]) and wide[0, 0].isnan()
    low = torch.empty_like(wh)
    assert compiled.lora_merge(w, b, a, 2.5, low)
    assert torch.equal(low, out.bfloat16())


def test_random_models_match_torch_kernels(ran: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A small fuzzer over model shapes: head sizes (16-128, on and off the C kernels' sizes),
    query groups, q/k norm or not, q/k/v bias or not, odd hidden and MLP widths, batch and
    length across the attention's 64-blocks; a LoRA step's logits and every gradient with the
    default C kernels against torch's kernels (``$TINKER_SR_NATIVE=0``), 1e-5 relative."""
    rng = torch.Generator().manual_seed(2026)

    def pick(options: tuple[int, ...]) -> int:
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    base = BUILTIN_CONFIGS["tinker-sr/tiny"]
    for case in range(6):
        kv = pick((1, 2))
        config = dataclasses.replace(
            base,
            dim=pick((48, 64, 80)),
            n_heads=kv * pick((1, 2, 4)),
            n_kv_heads=kv,
            explicit_head_dim=pick((16, 32, 64, 128)),
            ffn_dim=pick((72, 128, 200)),
            qk_norm=bool(case % 2),
            attention_bias=case % 3 == 0,  # Qwen2-style q/k/v bias
        )
        tokens = torch.randint(0, 256, (pick((1, 2, 3)), pick((9, 64, 70, 130))), generator=rng)

        _switch(monkeypatch, False)
        want = _fuzz_step(config, case, tokens)
        _switch(monkeypatch, True, inductor=False)
        got = _fuzz_step(config, case, tokens)
        for a, b in zip(got, want, strict=True):
            assert float((a - b).norm() / b.norm().clamp_min(1e-30)) < 1e-5, (case, config)
    assert {"attention", "c:rms_norm", "c:silu_mul"} <= set(ran), set(ran)
    assert {"c:norm_rope", "c:qkv_heads"} <= set(ran), set(ran)  # short and long batches


def _fuzz_step(config: Any, seed: int, tokens: torch.Tensor) -> list[torch.Tensor]:
    model = build_model(config)
    apply_lora(model, LoraSpec(rank=4, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainable_parameters(model):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    logits = model(tokens)
    (logits.logsumexp(-1) - logits[..., 3]).sum().backward()
    return [logits.detach()] + [p.grad for _, p in trainable_parameters(model)]  # type: ignore[misc]
