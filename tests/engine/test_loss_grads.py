"""A LoRA head's backward formed in forward from the loss's gradient known ahead
(`engine.loss_grads` + `lora_head._KnownGrads`): the closed forms equal what autograd
delivers bit for bit (else the fast path would not be taken), the gradients agree with the
recompute path and with full logits, a different delivered gradient falls back to
recomputing, and the real training step takes the path."""

from __future__ import annotations

import pytest
import torch

import tinker_sr as tinker
from tests.test_losses import random_batch
from tinker_sr.engine import lora_head, loss_logprobs
from tinker_sr.engine.lora import LoraLinear
from tinker_sr.engine.loss_grads import known_grads
from tinker_sr.engine.losses import LOSS_NAMES, LossDatum, compute_loss

D, V = 8, 37
KNOWN = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "stable_reinforce")


def _head(dtype: torch.dtype) -> LoraLinear:
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(D, V, bias=False).to(dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(V, D, generator=gen))
    base.weight.requires_grad_(False)
    head = LoraLinear(base, rank=4, alpha=8.0, generator=gen).to(dtype)
    with torch.no_grad():
        head.lora_B.weight.copy_(torch.randn(V, 4, generator=gen) * 0.1)
    return head


def _batch(loss_fn: str) -> list[LossDatum]:
    """Datums of 24 to 62 rows (150 in all: chunks of 64 leave a ragged last one), prompts
    without loss, 2-D targets for cross_entropy, draws with invalid (-1) entries."""
    _, data = random_batch(loss_fn, seed=11, n_datums=3, v=V)
    gen = torch.Generator().manual_seed(12)
    out = []
    for i, d in enumerate(data):
        n = (24, 62, 64)[i]
        rep = -(-n // d.target_tokens.shape[0])

        def stretch(x: torch.Tensor, n: int = n, rep: int = rep) -> torch.Tensor:
            return x.repeat(rep, *([1] * (x.dim() - 1)))[:n].clone()

        inputs = {k: stretch(v) for k, v in d.inputs.items()}
        target = stretch(d.target_tokens)
        if loss_fn == "cross_entropy" and i == 1:  # [N, K] targets and weights
            target = torch.randint(0, V, (n, 3), generator=gen)
            inputs["weights"] = torch.rand(n, 3, generator=gen)
        if "weights" in inputs:
            inputs["weights"][:5] = 0.0  # a prompt
        if loss_fn in ("ppo", "cispo") and i == 2:  # per-position thresholds, some binding
            inputs["clip_low_threshold"] = torch.full((n,), 0.9)
            inputs["clip_high_threshold"] = torch.full((n,), 1.05)
        draws = None if d.draws is None else stretch(d.draws)[:, : 8 - 2 * i]
        if draws is not None:
            draws[::4, -1] = -1
        mask = None if d.sampled_mask is None else stretch(d.sampled_mask)
        out.append(LossDatum(target, inputs, draws=draws, sampled_mask=mask))
    return out


def _grads(
    loss_fn: str, dtype: torch.dtype, known: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[torch.Tensor], int]:
    """(loss, dh per datum, dA, dB) and how many chunks backward recomputed."""
    monkeypatch.setattr(loss_logprobs, "PRECOMPUTE_HEAD_GRAD", known)
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 64 * V)  # 64 rows per chunk
    recomputed: list[int] = []
    by_hand = lora_head._lora_backward
    monkeypatch.setattr(lora_head, "_lora_backward", lambda *a: recomputed.append(1) or by_hand(*a))
    data = _batch(loss_fn)
    gen = torch.Generator().manual_seed(3)
    hidden = [
        torch.randn(d.target_tokens.shape[0], D, generator=gen, dtype=dtype).requires_grad_()
        for d in data
    ]
    head = _head(dtype)
    result = compute_loss(loss_fn, hidden, data, {}, unembed=head)
    result.loss.backward()
    grads = [result.loss.detach()] + [h.grad for h in hidden]
    grads += [head.lora_A.weight.grad, head.lora_B.weight.grad]
    return grads, len(recomputed)  # type: ignore[return-value]


@pytest.mark.parametrize("loss_fn", KNOWN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_known_gradient_path_is_taken_and_matches_recompute(
    loss_fn: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    got, recomputed = _grads(loss_fn, dtype, True, monkeypatch)
    assert recomputed == 0  # the closed form equalled autograd's gradient bit for bit
    want, recomputed = _grads(loss_fn, dtype, False, monkeypatch)
    assert recomputed == 1
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-4}
    assert torch.equal(got[0], want[0])  # the forward is the same either way
    for a, b in zip(got[1:], want[1:], strict=True):
        assert a is not None and b is not None and b.abs().sum() > 0
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("loss_fn", KNOWN)
def test_known_gradients_match_full_logits(loss_fn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against autograd through full [N, V] logits of the head's own forward (float64)."""
    got, recomputed = _grads(loss_fn, torch.float64, True, monkeypatch)
    assert recomputed == 0
    data = _batch(loss_fn)
    gen = torch.Generator().manual_seed(3)
    hidden = [
        torch.randn(
            d.target_tokens.shape[0], D, generator=gen, dtype=torch.float64
        ).requires_grad_()
        for d in data
    ]
    head = _head(torch.float64)
    result = compute_loss(loss_fn, [head(h) for h in hidden], data, {})
    result.loss.backward()
    want = [result.loss.detach()] + [h.grad for h in hidden]
    want += [head.lora_A.weight.grad, head.lora_B.weight.grad]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_losses_without_a_closed_form_keep_the_recompute_path() -> None:
    data = _batch("ppo")
    for loss_fn in sorted(set(LOSS_NAMES) - set(KNOWN)):
        assert known_grads(loss_fn, data, {}, 1, torch.device("cpu"), torch.float32) is None


def test_a_different_delivered_gradient_is_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``grad_of`` is a promise the head checks: when backward gets another gradient (here
    the promise is wrong), the adapter's and the input's gradients are those of the delivered
    one, as without the promise."""
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 16 * V)
    head = _head(torch.float64)
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(40, D, generator=gen, dtype=torch.float64)
    cols = torch.randint(0, V, (40, 2), generator=gen)
    g = torch.randn(40, 2, generator=gen, dtype=torch.float64)
    params = [head.lora_A.weight, head.lora_B.weight]

    def run(grad_of: loss_logprobs.GradOf | None) -> list[torch.Tensor]:
        x = h.clone().requires_grad_()
        (logp,), _ = loss_logprobs.head_logprobs([x], [cols], head, None, grad_of)
        return list(torch.autograd.grad(logp, [x, *params], g))

    promised = run(lambda start, stop, logp: torch.ones_like(logp))
    for a, b in zip(promised, run(None), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    kept = run(lambda start, stop, logp: g[start:stop])  # the promise kept: forward did it
    for a, b in zip(kept, run(None), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_training_step_with_the_sdk_default_lora_head_takes_the_known_path(
    loss_fn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the public client (``train_unembed=True``, the default): no logits recomputed,
    and the adapters after two steps agree with the recompute path's."""
    recomputed: list[int] = []
    by_hand = lora_head._lora_backward
    monkeypatch.setattr(lora_head, "_lora_backward", lambda *a: recomputed.append(1) or by_hand(*a))
    types = tinker.types
    gen = torch.Generator().manual_seed(5)
    data = []
    for _ in range(3):
        row = torch.randint(0, 256, (41,), generator=gen).tolist()
        inputs: dict[str, list[float] | list[int]] = {"target_tokens": row[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = [0.0] * 8 + [1.0] * 32
        else:
            inputs["logprobs"] = [-3.0] * 40
            inputs["advantages"] = [0.0] * 8 + [0.7] * 32
        model_input = types.ModelInput.from_ints(row[:-1])
        data.append(types.Datum(model_input=model_input, loss_fn_inputs=inputs))

    def train(known: bool) -> list[float]:
        monkeypatch.setattr(loss_logprobs, "PRECOMPUTE_HEAD_GRAD", known)
        client = (
            tinker.ServiceClient()
            .create_lora_training_client(base_model="tinker-sr/tiny", rank=4, seed=0)
            .result()
        )
        losses = []
        for _ in range(3):
            out = client.forward_backward(data, loss_fn).result()
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(out.metrics["loss:sum"])
        return losses

    got = train(True)
    assert recomputed == []
    want = train(False)
    assert len(recomputed) == 3
    assert got[0] == want[0]
    assert got != pytest.approx(got[0])  # the adapters moved
    assert got == pytest.approx(want, rel=1e-4)


def test_importance_sampling_beyond_torchs_parallel_grain_keeps_the_known_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """40,010 positions: torch's exp runs the loss's ratios split between threads (past
    32,768 elements, with a scalar tail mid-request) and the promise's chunk by chunk, and
    the promised gradient still holds bit for bit."""
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 64 * V)
    recomputed: list[int] = []
    by_hand = lora_head._lora_backward
    monkeypatch.setattr(lora_head, "_lora_backward", lambda *a: recomputed.append(1) or by_hand(*a))
    gen = torch.Generator().manual_seed(6)
    n = 20005
    data = [
        LossDatum(
            torch.randint(0, V, (n,), generator=gen),
            {
                "logprobs": torch.randn(n, generator=gen) - 3,
                "advantages": torch.randn(n, generator=gen),
            },
        )
        for _ in range(2)
    ]
    head = _head(torch.float32)
    hidden = [torch.randn(n, D, generator=gen) for _ in data]
    compute_loss("importance_sampling", hidden, data, {}, unembed=head).loss.backward()
    assert recomputed == []
    assert head.lora_A.weight.grad is not None and head.lora_A.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("known", [True, False], ids=["known-gradient", "recompute"])
def test_lora_head_under_bf16_autocast_multiplies_in_bf16_within_its_rounding(
    known: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 autocast (``TINKER_SR_TRAIN_DTYPE=bf16``) the by-hand LoRA head runs its two
    unembedding products in bf16, as a frozen head does, and the adapter's and the softmax in
    float32 (it had fallen back to its own forward and autograd, ~1.45x the step): loss and
    gradients within bf16 rounding of float32, the known-gradient path still taken."""
    monkeypatch.setattr(loss_logprobs, "PRECOMPUTE_HEAD_GRAD", known)
    recomputed: list[int] = []
    by_hand = lora_head._lora_backward
    monkeypatch.setattr(lora_head, "_lora_backward", lambda *a: recomputed.append(1) or by_hand(*a))
    low_products: list[torch.dtype] = []
    for name in ("base_logits", "base_grad"):
        real = getattr(lora_head._Lora, name)

        def counting(self: object, x: torch.Tensor, rows: int, real: object = real) -> object:
            low = getattr(self, "low", None)
            low_products.append(torch.float32 if low is None else low.dtype)
            return real(self, x, rows)  # type: ignore[operator]

        monkeypatch.setattr(lora_head._Lora, name, counting)
    data = _batch("importance_sampling")
    gen = torch.Generator().manual_seed(3)
    hidden0 = [torch.randn(d.target_tokens.shape[0], D, generator=gen) for d in data]

    def run(autocast: bool) -> list[torch.Tensor]:
        hidden = [h.clone().requires_grad_() for h in hidden0]
        head = _head(torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            result = compute_loss("importance_sampling", hidden, data, {}, unembed=head)
        result.loss.backward()
        return [result.loss.detach(), torch.cat([h.grad for h in hidden])] + [
            head.lora_A.weight.grad,
            head.lora_B.weight.grad,
        ]  # type: ignore[list-item]

    got = run(True)
    # forward: the logits (and, known, dz W); recompute: the logits again and dz W in backward
    assert set(low_products) == {torch.bfloat16} and len(low_products) == (2 if known else 3)
    assert len(recomputed) == (0 if known else 1)
    low_products.clear()
    want = run(False)
    assert set(low_products) == {torch.float32}
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        err = float((a - b).norm() / b.norm())
        assert 0 < err < 2e-2, err  # bf16 products: not the float32 bits, within their rounding
