"""The chunked unembedding path of `compute_loss` (hidden states + lm_head, no [N, V] logits)
against the reference path on full logits: same loss, outputs, metrics and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.test_losses import random_batch
from tinker_sr.engine import loss_logprobs
from tinker_sr.engine.lora import LoraLinear
from tinker_sr.engine.losses import LOSS_NAMES, compute_loss

D, V = 6, 11


def _head(dtype: torch.dtype) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(D, V, bias=False).to(dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(V, D, generator=gen))
    base.weight.requires_grad_(False)
    head = LoraLinear(base, rank=2, alpha=4.0, generator=gen).to(dtype)
    with torch.no_grad():
        head.lora_B.weight.copy_(torch.randn(V, 2, generator=gen) * 0.1)
    return head


def _run(loss_fn: str, chunked: bool, dtype: torch.dtype) -> tuple[object, list[torch.Tensor]]:
    _, data = random_batch(loss_fn, seed=7)
    gen = torch.Generator().manual_seed(1)
    hidden = [torch.randn(d.target_tokens.shape[0], D, generator=gen, dtype=dtype) for d in data]
    hidden = [h.requires_grad_() for h in hidden]
    head = _head(dtype)
    if chunked:
        result = compute_loss(loss_fn, hidden, data, {}, unembed=head)
    else:
        result = compute_loss(loss_fn, [head(h) for h in hidden], data, {})
    result.loss.backward()
    grads = [h.grad for h in hidden] + [head.lora_A.weight.grad, head.lora_B.weight.grad]
    return result, grads  # type: ignore[return-value]


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_matches_full_logits(
    loss_fn: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 3 * V)  # 3 rows per chunk: many chunks
    ref, ref_grads = _run(loss_fn, chunked=False, dtype=dtype)
    got, got_grads = _run(loss_fn, chunked=True, dtype=dtype)
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-5}
    assert got.metrics.keys() == ref.metrics.keys()  # type: ignore[attr-defined]
    for k, v in ref.metrics.items():  # type: ignore[attr-defined]
        assert got.metrics[k] == pytest.approx(v, abs=tol["atol"], rel=tol["rtol"])  # type: ignore[attr-defined]
    for a, b in zip(got.outputs, ref.outputs, strict=True):  # type: ignore[attr-defined]
        torch.testing.assert_close(a["logprobs"], b["logprobs"], **tol)
    for a, b in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_positions_without_loss_skip_the_backward_unembedding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    head = _head(torch.float64)
    original = head.forward

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return original(x)

    monkeypatch.setattr(head, "forward", counting)
    _, data = random_batch("importance_sampling", seed=7)  # advantages are 0 on 2 rows each
    hidden = [torch.randn(d.target_tokens.shape[0], D, dtype=torch.float64) for d in data]
    result = compute_loss("importance_sampling", hidden, data, {}, unembed=head)
    forward_rows = sum(calls)
    calls.clear()
    result.loss.backward()
    live = sum(int((d.inputs["advantages"] != 0).sum()) for d in data)
    assert forward_rows == sum(h.shape[0] for h in hidden) and sum(calls) == live < forward_rows
    # Only the head's adapter is trainable here (hidden states need no gradient): it gets one.
    assert head.lora_B.weight.grad is not None and head.lora_B.weight.grad.abs().sum() > 0


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    from tinker_sr.engine.lora import LoraSpec, apply_lora, trainable_parameters
    from tinker_sr.engine.model import build_model

    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        model = build_model("tinker-sr/tiny")
        apply_lora(model, LoraSpec(rank=2, seed=0))
        with torch.no_grad():
            for name, p in trainable_parameters(model):
                if "lora_B" in name:
                    p.fill_(0.01)
        model.checkpoint_layers = recompute
        model(tokens).logsumexp(-1).sum().backward()
        grads.append([p.grad for _, p in trainable_parameters(model)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
