"""The chunked unembedding path of `compute_loss` (hidden states + lm_head, no [N, V] logits)
against the reference path on full logits: same loss, outputs, metrics and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.test_losses import random_batch
from tinker_sr.engine import lora_head, loss_logprobs
from tinker_sr.engine.lora import LoraLinear
from tinker_sr.engine.losses import LOSS_NAMES, LossDatum, compute_loss

D, V = 6, 11


def _head(dtype: torch.dtype, adapter: bool = True) -> torch.nn.Module:
    """A LoRA-wrapped head, or (``adapter=False``) a plain frozen Linear."""
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(D, V, bias=False).to(dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(V, D, generator=gen))
    base.weight.requires_grad_(False)
    if not adapter:
        return base
    head = LoraLinear(base, rank=2, alpha=4.0, generator=gen).to(dtype)
    with torch.no_grad():
        head.lora_B.weight.copy_(torch.randn(V, 2, generator=gen) * 0.1)
    return head


def _run(
    loss_fn: str, chunked: bool, dtype: torch.dtype, adapter: bool = True
) -> tuple[object, list[torch.Tensor]]:
    _, data = random_batch(loss_fn, seed=7)
    gen = torch.Generator().manual_seed(1)
    hidden = [torch.randn(d.target_tokens.shape[0], D, generator=gen, dtype=dtype) for d in data]
    hidden = [h.requires_grad_() for h in hidden]
    head = _head(dtype, adapter)
    if chunked:
        result = compute_loss(loss_fn, hidden, data, {}, unembed=head)
    else:
        result = compute_loss(loss_fn, [head(h) for h in hidden], data, {})
    result.loss.backward()
    grads = [h.grad for h in hidden]
    if isinstance(head, LoraLinear):
        grads += [head.lora_A.weight.grad, head.lora_B.weight.grad]
    return result, grads  # type: ignore[return-value]


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("adapter", [True, False], ids=["lora-head", "frozen-head"])
def test_chunked_matches_full_logits(
    loss_fn: str, dtype: torch.dtype, adapter: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen head takes the path that needs no backward unembedding (softmax @ W done in
    forward); a LoRA head recomputes its live rows in backward."""
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 3 * V)  # 3 rows per chunk: many chunks
    ref, ref_grads = _run(loss_fn, chunked=False, dtype=dtype, adapter=adapter)
    got, got_grads = _run(loss_fn, chunked=True, dtype=dtype, adapter=adapter)
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-5}
    assert got.metrics.keys() == ref.metrics.keys()  # type: ignore[attr-defined]
    for k, v in ref.metrics.items():  # type: ignore[attr-defined]
        assert got.metrics[k] == pytest.approx(v, abs=tol["atol"], rel=tol["rtol"])  # type: ignore[attr-defined]
    for a, b in zip(got.outputs, ref.outputs, strict=True):  # type: ignore[attr-defined]
        torch.testing.assert_close(a["logprobs"], b["logprobs"], **tol)
    for a, b in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("known", [True, False], ids=["known-gradient", "recompute"])
def test_positions_without_loss_skip_the_backward_unembedding(
    known: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA head multiplies a logit gradient back only for rows that carry a loss: in
    forward when the loss's gradient is known ahead (importance_sampling; no logits in
    backward), else in backward, where only those rows' logits are recomputed."""
    monkeypatch.setattr(loss_logprobs, "PRECOMPUTE_HEAD_GRAD", known)
    logits_rows: list[int] = []
    grad_rows: list[int] = []
    head = _head(torch.float64)
    logits = lora_head._lora_logits  # a LoRA head's logits, forward and backward
    dz_grads = lora_head._lora_dz_grads  # a chunk's products with its logit gradient

    def counting(lora: object, x: torch.Tensor, rows: int) -> object:
        logits_rows.append(x.shape[0])
        return logits(lora, x, rows)  # type: ignore[arg-type]

    def counting_dz(lora: object, dz: torch.Tensor, *rest: object) -> object:
        grad_rows.append(dz.shape[0])
        return dz_grads(lora, dz, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(lora_head, "_lora_logits", counting)
    monkeypatch.setattr(lora_head, "_lora_dz_grads", counting_dz)
    _, data = random_batch("importance_sampling", seed=7)  # advantages are 0 on 2 rows each
    hidden = [torch.randn(d.target_tokens.shape[0], D, dtype=torch.float64) for d in data]
    result = compute_loss("importance_sampling", hidden, data, {}, unembed=head)
    forward = sum(logits_rows), sum(grad_rows)
    logits_rows.clear()
    grad_rows.clear()
    result.loss.backward()
    live = sum(int((d.inputs["advantages"] != 0).sum()) for d in data)
    assert forward[0] == sum(h.shape[0] for h in hidden) > live
    if known:
        assert forward[1] == live and logits_rows == grad_rows == []
    else:
        assert forward[1] == 0 and sum(logits_rows) == sum(grad_rows) == live
    # Only the head's adapter is trainable here (hidden states need no gradient): it gets one.
    assert head.lora_B.weight.grad is not None and head.lora_B.weight.grad.abs().sum() > 0


def test_frozen_head_backward_unembeds_only_rows_outside_the_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows in the hint get their input gradient from the forward's softmax @ W; a live row
    the hint missed is recomputed; both agree with the full-logits reference."""
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 2 * V)
    head = _head(torch.float64, adapter=False)
    calls: list[int] = []
    original = head.forward
    monkeypatch.setattr(head, "forward", lambda x: calls.append(x.shape[0]) or original(x))
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(7, D, generator=gen, dtype=torch.float64, requires_grad=True)
    cols = torch.randint(0, V, (7, 2), generator=gen)
    g = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    g[[1, 4]] = 0.0  # rows without loss
    hint = torch.tensor([True, False, True, True, False, False, True])  # row 5 is missed
    (got,), _ = loss_logprobs.head_logprobs([h], [cols], head, [hint])
    calls.clear()
    (dh,) = torch.autograd.grad(got, h, g)
    assert calls == [1]  # only row 5 was unembedded again
    ref_h = h.detach().requires_grad_()
    ref = torch.log_softmax(original(ref_h), -1).gather(1, cols)
    (ref_dh,) = torch.autograd.grad(ref, ref_h, g)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(dh, ref_dh, atol=1e-12, rtol=1e-10)


def test_live_rows_is_a_slice_where_the_rows_are_consecutive() -> None:
    rows = lora_head.live_rows
    assert rows(torch.tensor([False, False, True, True, True])) == slice(2, 5)
    assert rows(torch.tensor([True, True, True])) == slice(0, 3)
    assert rows(torch.tensor([False, True, False])) == slice(1, 2)
    assert rows(torch.tensor([False, False])) == slice(0, 0)
    got = rows(torch.tensor([True, False, True, True]))
    assert isinstance(got, torch.Tensor) and got.tolist() == [0, 2, 3]


@pytest.mark.parametrize("adapter", [True, False], ids=["lora-head", "frozen-head"])
def test_a_prompts_rows_are_left_out_of_the_head_products_without_a_copy(
    adapter: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk whose rows that carry a loss are consecutive (a prompt without loss, then the
    completion) multiplies those rows as a view of the chunk's logit gradient, not a gathered
    copy (which cost ~5 ms a 256 x 32,000 chunk); the gradients are the full-logits ones."""
    from tinker_sr.engine import gemm

    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 8 * V)  # 8 rows per chunk
    operands: list[torch.Tensor] = []
    if adapter:
        dz_grads = lora_head._lora_dz_grads

        def recording(lora: object, dz: torch.Tensor, *rest: object) -> object:
            operands.append(dz)
            return dz_grads(lora, dz, *rest)  # type: ignore[arg-type]

        monkeypatch.setattr(lora_head, "_lora_dz_grads", recording)
    else:
        mm = gemm.mm
        monkeypatch.setattr(gemm, "mm", lambda a, b: operands.append(a) or mm(a, b))
    head = _head(torch.float64, adapter)
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(8, D, generator=gen, dtype=torch.float64, requires_grad=True)
    cols = torch.randint(0, V, (8, 1), generator=gen)
    g = torch.randn(8, 1, generator=gen, dtype=torch.float64)
    g[:3] = 0.0  # a prompt
    hint = g[:, 0] != 0
    grad_of = None
    if adapter:  # the loss's gradient known ahead: the LoRA head forms dz in forward
        monkeypatch.setattr(loss_logprobs, "PRECOMPUTE_HEAD_GRAD", True)
        grad_of = lambda a, b, lp: g[a:b]  # noqa: E731
    (got,), _ = loss_logprobs.head_logprobs([h], [cols], head, [hint], grad_of=grad_of)
    (dh,) = torch.autograd.grad(got, h, g)
    assert [x.shape[0] for x in operands] == [5]
    assert operands[0]._base is not None  # a view of the chunk's [8, V] rows
    ref_h = h.detach().requires_grad_()
    ref = torch.log_softmax(head(ref_h), -1).gather(1, cols)
    (ref_dh,) = torch.autograd.grad(ref, ref_h, g)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(dh, ref_dh, atol=1e-12, rtol=1e-10)


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


def test_automatic_checkpointing_turns_on_when_activations_crowd_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tinker_sr.engine import env_settings
    from tinker_sr.engine import model as model_mod

    config = model_mod.BUILTIN_CONFIGS["tinker-sr/small"]
    need = model_mod.activation_bytes(config, 4096)
    # 4096 tokens x 8 layers x 7,424 floats per token and layer (hidden 512, FFN 1408 here).
    assert need == 4 * 4096 * 8 * (4 * 512 + 3 * 512 + 3 * 256 + 2 * 1408)
    monkeypatch.setattr(model_mod, "free_memory", lambda _device: 100 * need)
    assert not model_mod.checkpoint_pays(config, 4096)
    monkeypatch.setattr(model_mod, "free_memory", lambda _device: 3 * need)
    assert model_mod.checkpoint_pays(config, 4096)
    monkeypatch.setattr(model_mod, "free_memory", lambda _device: None)
    assert not model_mod.checkpoint_pays(config, 4096)

    used: list[int] = []
    monkeypatch.setattr(model_mod, "checkpoint", lambda *a, **k: used.append(1) or a[0](*a[1:]))
    model = model_mod.build_model("tinker-sr/tiny")
    model.checkpoint_layers = None  # automatic
    monkeypatch.setattr(model_mod, "free_memory", lambda _device: 0)
    model(torch.zeros((1, 4), dtype=torch.long)).sum().backward()
    assert len(used) == model.config.n_layers

    for raw, want in (("", None), ("auto", None), ("0", False), ("1", True)):
        monkeypatch.setenv(env_settings.CHECKPOINTING_ENV, raw)
        assert env_settings.checkpointing_setting() is want
    monkeypatch.setenv(env_settings.CHECKPOINTING_ENV, "yes")
    with pytest.raises(ValueError, match="TINKER_SR_ACTIVATION_CHECKPOINTING must be"):
        env_settings.checkpointing_setting()


def _packed_lora_head(
    seed: int,
) -> tuple[LoraLinear, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 LoRA head at a size whose products run on the packed oneDNN path (64 -> 4096,
    rank 8, B non-zero), 96 hidden rows, one target column each and their gradients."""
    d, v, n = 64, 4096, 96
    gen = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(d, v, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(v, d, generator=gen) * 0.2)
    base.weight.requires_grad_(False)
    head = LoraLinear(base, rank=8, alpha=16.0, generator=gen)
    with torch.no_grad():
        head.lora_B.weight.copy_(torch.randn(v, 8, generator=gen) * 0.05)
    h = torch.randn(n, d, generator=gen)
    cols = torch.randint(0, v, (n, 1), generator=gen)
    return head, h, cols, torch.randn(n, 1, generator=gen)


@pytest.mark.parametrize("live_rows", ["all", "some"])
def test_lora_head_by_hand_matches_its_own_forward_and_autograd(
    live_rows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA head (the SDK's default ``train_unembed=True``) at a size where its products run on
    the packed oneDNN path: logprobs, dh, dA and dB by hand (`_lora_backward`) against the head's
    own forward and autograd (`_lora_parts` switched off), float32, several chunks."""
    head, h, cols, g = _packed_lora_head(5)
    v = head.out_features
    if live_rows == "some":
        g[::3] = 0.0
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 40 * v)  # 40 rows per chunk
    taken: list[int] = []
    by_hand = lora_head._lora_backward
    monkeypatch.setattr(lora_head, "_lora_backward", lambda *a: taken.append(1) or by_hand(*a))

    def run() -> list[torch.Tensor]:
        x = h.clone().requires_grad_()
        (logp,), _ = loss_logprobs.head_logprobs([x], [cols], head)
        params = [head.lora_A.weight, head.lora_B.weight]
        return [logp.detach(), *torch.autograd.grad(logp, [x, *params], g)]

    got = run()
    assert taken == [1]
    monkeypatch.setattr(loss_logprobs, "_lora_parts", lambda *a: None)
    want = run()
    assert taken == [1]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("adapter", [False, True])
def test_unbound_rows_of_one_batch_join_as_a_view_with_the_same_results(adapter: bool) -> None:
    """Datums that are the whole rows of one [B, T, D] tensor (training's unbind, no padding)
    reach the head as a view of it: no copy forward, no stack in backward; the loss, outputs
    and gradient equal those of the concatenated copies. Padded rows are concatenated."""
    torch.manual_seed(0)
    b, t = 3, 5
    gen = torch.Generator().manual_seed(5)
    base_data = [
        LossDatum(
            torch.randint(0, V, (t,), generator=gen), {"weights": torch.rand(t, generator=gen)}
        )
        for _ in range(b)
    ]
    head = _head(torch.float64, adapter)

    def run(joined: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(b, t, D, generator=gen, dtype=torch.float64, requires_grad=True)
        hidden = (x * 2).unbind(0) if joined else [(x * 2)[i].clone() for i in range(b)]
        res = compute_loss("cross_entropy", list(hidden), base_data, None, unembed=head)
        res.loss.backward()
        assert x.grad is not None
        return res.loss.detach(), [o["logprobs"] for o in res.outputs], x.grad

    rows = torch.randn(b, t, D, dtype=torch.float64).unbind(0)
    assert loss_logprobs._joined(rows).data_ptr() == rows[0].data_ptr()  # a view: no copy
    padded = [rows[0], rows[1][:3], rows[2]]
    assert loss_logprobs._joined(padded).shape == (t + 3 + t, D)
    assert loss_logprobs._joined(list(reversed(rows))).data_ptr() != rows[0].data_ptr()
    tail = loss_logprobs._joined(list(rows[1:]))  # not from the base's first row: a copy
    assert tail.shape == ((b - 1) * t, D) and tail.data_ptr() != rows[1].data_ptr()
    (la, outs_a, ga), (lb, outs_b, gb) = run(True), run(False)
    assert torch.equal(la, lb) and torch.equal(ga, gb)
    for p, q in zip(outs_a, outs_b, strict=True):
        assert torch.equal(p, q)


def test_rows_of_weight_equals_advanced_indexing() -> None:
    w = torch.randn(50, 7)
    cols = torch.randint(0, 50, (9, 3))
    assert torch.equal(loss_logprobs._rows_of(w, cols), w[cols])


@pytest.mark.parametrize("known", [True, False], ids=["formed-in-forward", "recomputed"])
def test_lora_head_of_a_bf16_checkpoint_runs_by_hand_closer_to_float64(
    known: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 checkpoint's LoRA head (bf16 base weight and hidden states, the float32 adapter
    `LoraLinear` keeps) takes the by-hand path: the base products in bf16, widened, the
    adapter, logits and gradients in float32. Against float64 math on the same bf16 values it
    is within float32 + bf16-product rounding, and closer than the head's own eager forward,
    which rounds the logits to bf16 (that path still gives the same values to that rounding).
    ``known``: the loss promises its gradient (`_KnownGrads`), else backward recomputes."""
    head, h, cols, g = _packed_lora_head(11)
    v = head.out_features
    head.weight = torch.nn.Parameter(head.weight.bfloat16(), requires_grad=False)
    h = h.bfloat16()
    g[::3] = 0.0
    assert (got_parts := loss_logprobs._lora_parts(head, h)) is not None
    assert got_parts.low is head.weight
    monkeypatch.setattr(loss_logprobs, "_CHUNK_ELEMENTS", 40 * v)  # 40 rows per chunk
    params = [head.lora_A.weight, head.lora_B.weight]
    recomputed: list[int] = []
    by_hand_backward = lora_head._lora_backward
    monkeypatch.setattr(
        lora_head, "_lora_backward", lambda *a: recomputed.append(1) or by_hand_backward(*a)
    )

    def run() -> list[torch.Tensor]:
        x = h.clone().requires_grad_()
        grad_of = (lambda a, b, logp: g[a:b].to(logp.dtype)) if known else None
        (logp,), _ = loss_logprobs.head_logprobs([x], [cols], head, grad_of=grad_of)
        return [logp.detach(), *torch.autograd.grad(logp, [x, *params], g)]

    def reference() -> list[torch.Tensor]:
        x = h.double().requires_grad_()
        a, b = (p.detach().double().requires_grad_() for p in params)
        z = x @ head.weight.double().t() + head.scaling * (x @ a.t()) @ b.t()
        logp = torch.log_softmax(z, dim=-1).gather(1, cols)
        return [logp.detach(), *torch.autograd.grad(logp, [x, a, b], g.double())]

    by_hand, want = run(), reference()
    assert recomputed == ([] if known else [1])
    if known:  # dz W deferred over several chunks (`lora_head._DeferredDh`), in small batches
        products: list[int] = []
        real = lora_head._Lora.base_grad

        def counted(self: lora_head._Lora, dz: torch.Tensor, rows: int) -> torch.Tensor:
            products.append(dz.shape[0])
            return real(self, dz, rows)

        monkeypatch.setattr(lora_head._Lora, "base_grad", counted)
        assert [a.equal(b) for a, b in zip(run(), by_hand, strict=True)] == [True] * 4
        assert products == [int(g.ne(0).sum())]  # every live row in one product
        products.clear()
        monkeypatch.setattr(lora_head, "DEFER_BYTES", 10 * v * 2)  # a buffer of one chunk's rows
        for a, b in zip(run(), by_hand, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * float(b.abs().max()))
        assert len(products) > 1 and sum(products) == int(g.ne(0).sum())
    monkeypatch.setattr(loss_logprobs, "_lora_parts", lambda *a: None)
    eager = run()
    for mine, theirs, exact in zip(by_hand, eager, want, strict=True):
        assert mine.dtype == theirs.dtype  # dh in the hidden states' bf16, the rest float32
        scale = float(exact.abs().max())
        mine_err = float((mine.double() - exact).abs().max())
        eager_err = float((theirs.double() - exact).abs().max())
        assert mine_err <= 1e-2 * scale and eager_err <= 2e-2 * scale
        if mine.dtype == torch.float32:  # dh rounds to bf16 either way
            assert mine_err <= eager_err
