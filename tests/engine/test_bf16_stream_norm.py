"""A bf16 checkpoint's residual add + RMSNorm in C (`bf16_rows.bf16_stream_rms_norm`): its
weights and residual stream in bf16 outside autocast, rounded where torch's eager bf16 ops
round (`fused.rms_norm`'s form: the normalised row cast to bf16 before the gain)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.test_bf16_rows import _ulps
from tinker_sr.engine import bf16_rows, compiled, fused

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_the_kernels() -> None:
    if compiled.native_mode() == "off" or bf16_rows.library() is None:
        pytest.skip("no C compiler here")


def _eager(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor) -> Any:
    """torch's bf16 ops: the residual add, then `fused`'s RMSNorm node (eager for bf16)."""
    h = x if y is None else x + y
    return h, fused._RMSNorm.apply(h, w, 1e-6)


def _run(fn: Any, with_y: bool, shape: tuple[int, ...] = (4, 80, 256)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, y, gh, gout = (torch.randn(shape, generator=gen).to(BF16).requires_grad_() for _ in "1234")
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(BF16)
    h, out = fn(x, y if with_y else None, w)
    grads = [gout] + ([gh] if with_y else [])
    torch.autograd.backward([out] + ([h] if with_y else []), grads)
    got = [h.detach(), out.detach(), x.grad]
    return got + ([y.grad] if with_y else [])  # type: ignore[list-item]


@pytest.mark.parametrize("with_y", [True, False], ids=["add and norm", "norm alone"])
def test_a_bf16_residual_norm_is_torchs_eager_bf16_within_a_unit(with_y: bool) -> None:
    """h, the normalised row and the inputs' gradients (the residual path's included): each
    within one bf16 unit of torch's eager ops and nearly all their very bits (the mean of
    squares and the gradient's dot product summed in another order); the same bits at one
    and two threads."""

    def kernel(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor) -> Any:
        got = bf16_rows.bf16_stream_rms_norm(x, y, w, 1e-6)
        assert got is not None
        return got

    got, want = _run(kernel, with_y), _run(_eager, with_y)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == BF16 and a.shape == b.shape
        assert float(_ulps(a, b).max()) <= 1.0
        assert float((a == b).float().mean()) > 0.999
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _run(kernel, with_y)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(alone, got, strict=True):
        assert torch.equal(a, b)


def test_a_bf16_models_layers_take_the_c_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model outside autocast (a bf16 checkpoint as loaded), trained as LoRA keeps its
    base frozen: every residual add + RMSNorm of its forward goes through the C pass, its
    output and input gradient within bf16 rounding of torch's ops."""
    from tinker_sr.engine.model import build_model

    model = build_model("tinker-sr/tiny", seed=0).to(BF16).requires_grad_(False)
    tokens = torch.randint(
        0, model.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0)
    )
    calls: list[int] = []
    real = bf16_rows.bf16_stream_rms_norm

    def counting(*args: Any) -> Any:
        got = real(*args)
        calls.append(got is not None)
        return got

    embedding = model.model.embed_tokens.weight

    def run() -> list[torch.Tensor]:
        embedding.requires_grad_(True).grad = None  # the gradient reaches it through every layer
        out = model.hidden_states(tokens)
        out.float().square().mean().backward()
        assert embedding.grad is not None
        return [out.detach(), embedding.grad]

    monkeypatch.setattr(bf16_rows, "bf16_stream_rms_norm", counting)
    got = run()
    assert calls and all(calls)
    monkeypatch.setattr(bf16_rows, "bf16_stream_rms_norm", lambda *a: None)
    want = run()
    for a, b in zip(got, want, strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2


def test_the_c_norm_leaves_what_it_cannot_take_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = torch.randn(4, 80, 256).to(BF16), torch.randn(4, 80, 256).to(BF16)
    w = torch.rand(256).to(BF16)
    assert bf16_rows.bf16_stream_rms_norm(x, y, w, 1e-6) is not None
    assert bf16_rows.bf16_stream_rms_norm(x.float(), y.float(), w.float(), 1e-6) is None
    assert bf16_rows.bf16_stream_rms_norm(x, y, w.float(), 1e-6) is None
    assert (
        bf16_rows.bf16_stream_rms_norm(*(t[..., :248].contiguous() for t in (x, y, w)), 1e-6)
        is None
    )
    assert bf16_rows.bf16_stream_rms_norm(x, y, w.clone().requires_grad_(), 1e-6) is None
    assert bf16_rows.bf16_stream_rms_norm(x.transpose(0, 1), y.transpose(0, 1), w, 1e-6) is None
    with torch.autocast("cpu", dtype=BF16):
        assert bf16_rows.bf16_stream_rms_norm(x, y, w, 1e-6) is None
    with torch.inference_mode():  # a sampler's forward keeps torch's ops
        assert bf16_rows.bf16_stream_rms_norm(x, y, w, 1e-6) is None
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    assert bf16_rows.bf16_stream_rms_norm(x, y, w, 1e-6) is None
