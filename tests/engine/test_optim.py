from __future__ import annotations

import pytest
import torch
from torch import nn

from tinker_sr.engine.optim import Adam, AdamHParams
from tinker_sr.user_errors import EngineUserError


def make_params(seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", nn.Parameter(torch.randn(5, 3, generator=gen))),
        ("b.weight", nn.Parameter(torch.randn(7, generator=gen))),
        ("c.weight", nn.Parameter(torch.randn(2, 2, generator=gen))),
    ]


def set_grads(params: list[tuple[str, nn.Parameter]], step: int, skip_c: bool = False) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for name, p in params:
        g = torch.randn(p.shape, generator=gen) * (1 + step)
        p.grad = None if (skip_c and name == "c.weight" and step % 2) else g


# Hyperparameters change every step, as Tinker allows.
SCHEDULE = [
    AdamHParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12),
    AdamHParams(learning_rate=5e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1),
    AdamHParams(
        learning_rate=2e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01, grad_clip_norm=1.0
    ),
    AdamHParams(learning_rate=1e-3, beta1=0.0, beta2=0.5, eps=1e-12, grad_clip_norm=100.0),
    AdamHParams(learning_rate=0.0),
]


@pytest.mark.parametrize("skip_c", [False, True])
def test_matches_torch_adamw_with_changing_hparams(skip_c: bool) -> None:
    """A parameter left without a gradient (an expert no token was routed to) steps as a row
    of a stacked tensor does: with a zero gradient (the reference is given zeros)."""
    ours, ref = make_params(), make_params()
    opt = Adam(ours)
    torch_opt = torch.optim.AdamW([p for _, p in ref])
    for step, hp in enumerate(SCHEDULE * 2):
        set_grads(ours, step, skip_c)
        set_grads(ref, step, skip_c)
        for _, q in ref:
            q.grad = torch.zeros_like(q) if q.grad is None else q.grad
        metrics = opt.step(hp)
        ref_norm = torch.nn.utils.clip_grad_norm_(
            [p for _, p in ref if p.grad is not None],
            hp.grad_clip_norm if hp.grad_clip_norm > 0 else float("inf"),
        )
        for group in torch_opt.param_groups:
            group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                         weight_decay=hp.weight_decay)  # fmt: skip
        torch_opt.step()
        torch_opt.zero_grad()
        assert metrics["grad_norm:mean"] == pytest.approx(float(ref_norm), rel=1e-6)
        assert metrics["learning_rate:mean"] == hp.learning_rate
        for (_, p), (_, q) in zip(ours, ref, strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
            assert p.grad is None


def test_state_round_trip_continues_bit_identically() -> None:
    a_params, b_params = make_params(), make_params()
    a = Adam(a_params)
    for step in range(3):
        set_grads(a_params, step, skip_c=True)
        a.step(SCHEDULE[step])
    with torch.no_grad():
        for (_, p), (_, q) in zip(a_params, b_params, strict=True):
            q.copy_(p)
    b = Adam(b_params)
    b.load_state_dict(a.state_dict())
    assert b.steps == a.steps and b.steps["c.weight"] == 3  # every step counts (see above)
    for step in range(3, 6):
        set_grads(a_params, step)
        set_grads(b_params, step)
        a.step(SCHEDULE[step % 5])
        b.step(SCHEDULE[step % 5])
    for (_, p), (_, q) in zip(a_params, b_params, strict=True):
        assert torch.equal(p, q)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_mismatched_state_is_a_user_error() -> None:
    opt = Adam(make_params())
    sd = opt.state_dict()
    with pytest.raises(EngineUserError, match="missing"):
        opt.load_state_dict({k: v for k, v in sd.items() if not k.startswith("a.")})
    with pytest.raises(EngineUserError, match="shape"):
        opt.load_state_dict(sd | {"b.weight.exp_avg": torch.zeros(3)})


def test_bad_hparams_and_nan_grads_change_nothing() -> None:
    params = make_params()
    opt = Adam(params)
    before = [p.detach().clone() for _, p in params]
    set_grads(params, 0)
    with pytest.raises(EngineUserError, match="beta2"):
        opt.step(AdamHParams(beta2=1.0))
    with pytest.raises(EngineUserError, match="learning_rate"):
        opt.step(AdamHParams(learning_rate=float("nan")))
    params[0][1].grad[0, 0] = float("inf")
    with pytest.raises(EngineUserError, match="not finite"):
        opt.step(AdamHParams())
    assert all(torch.equal(b, p) for b, (_, p) in zip(before, params, strict=True))
    assert all(v == 0 for v in opt.steps.values())
    # Non-finite gradients are discarded, so the next forward_backward + step work (issue 10).
    assert all(p.grad is None for _, p in params)


@pytest.mark.parametrize(
    ("hp", "message"),
    [
        # finite numbers whose per-step scalars float32 cannot hold: the update used to fail
        # half-way (steps, moments and decayed weights already written, gradients kept)
        (AdamHParams(learning_rate=1e39, weight_decay=1e-40), "bias-corrected step"),
        (AdamHParams(learning_rate=1e37, beta1=0.99), "bias-corrected step"),
        (AdamHParams(learning_rate=1e20, weight_decay=1e20), "1 - learning_rate"),
        # an eps that rounds to 0 used to turn every zero-gradient entry into NaN, silently
        (AdamHParams(learning_rate=1e-3, eps=1e-50), "AdamParams.eps"),
    ],
)
def test_out_of_range_hparams_are_refused_before_anything_changes(
    hp: AdamHParams, message: str
) -> None:
    params, ref = make_params(), make_params()
    opt, ref_opt = Adam(params), Adam(ref)
    for ps, o in ((params, opt), (ref, ref_opt)):
        set_grads(ps, 0)
        o.step(SCHEDULE[0])
        set_grads(ps, 1)
    params[0][1].grad[0, 0] = 0.0  # a zero gradient entry, as LoRA's A has on its first step
    ref[0][1].grad[0, 0] = 0.0
    with pytest.raises(EngineUserError, match=message):
        opt.step(hp)
    for o in (opt, ref_opt):  # the refused step left everything as it was: the next one agrees
        o.step(SCHEDULE[1])
    assert opt.steps == ref_opt.steps
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(params, ref, strict=True))


def test_sqrt_all_equals_foreach_sqrt_bit_for_bit() -> None:
    """The update's sqrt over all tensors at once (one parallel region instead of one per
    tensor) gives torch._foreach_sqrt's bits: sizes past the vector-math parallel threshold,
    odd sizes, a non-contiguous tensor, and mixed dtypes (which take foreach itself)."""
    from tinker_sr.engine.optim import _sqrt_all

    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 1536), (512, 8), (4097,), (3, 5), (1,)]
    ts = [
        torch.rand(s, generator=gen) * 10.0 ** torch.randint(-30, 30, s, generator=gen)
        for s in shapes
    ]
    ts.append(torch.rand(16, 24, generator=gen).t())  # non-contiguous
    for got, want in zip(_sqrt_all(ts), torch._foreach_sqrt(ts), strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    mixed = [ts[0], ts[1].double()]
    for got, want in zip(_sqrt_all(mixed), torch._foreach_sqrt(mixed), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_grads_finite_is_what_step_accepts() -> None:
    """A NaN, an inf, or finite values whose norm overflows float32 (which `step` would refuse
    with every gradient accumulated so far) all count as not finite."""
    for bad in (float("nan"), float("inf"), 1e30):
        params = make_params()
        opt = Adam(params)
        set_grads(params, 0)
        assert opt.grads_finite()
        params[1][1].grad[3] = bad  # type: ignore[index]
        assert not opt.grads_finite()
        with pytest.raises(EngineUserError, match="not finite"):
            opt.step(AdamHParams())
