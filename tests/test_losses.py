"""Built-in losses against the implementation-independent oracles of spec/losses.md §4."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tinker_sr.engine.losses import (
    LOSS_NAMES,
    LossDatum,
    compute_loss,
    validate_request,
)
from tinker_sr.user_errors import EngineUserError

f64 = torch.float64
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")

# ---------------------------------------------------------------------------------------------
# §4.2 setup: V=5, N=4, position 0 is a prompt position.

Z42 = torch.tensor(
    [
        [0.5, -0.2, 1.0, 0.0, -1.0],
        [1.2, 0.3, -0.5, 0.8, 0.0],
        [-0.3, 0.9, 0.1, 0.4, -0.6],
        [0.0, 0.0, 2.0, -1.0, 0.5],
    ],
    dtype=f64,
)
X42 = torch.tensor([2, 0, 1, 3])
LQ42 = torch.tensor([0.0, -0.9, -1.3, -2.9])
A42 = torch.tensor([0.0, 0.75, 0.75, -0.5])
W42 = torch.tensor([0.0, 1.0, 1.0, 0.5])
DRAWS42 = torch.tensor(
    [
        [-1] * 8,
        [0, 0, 3, 1, 0, 4, 0, 3],
        [1, 3, 1, 1, 0, 2, 1, 1],
        [2, 2, 4, 2, 0, 2, 2, 3],
    ]
)
SAMPLED42 = torch.tensor([False, True, True, True])
MASK42 = torch.tensor([0.0, 1.0, 1.0, 1.0])


def datum42(loss_fn: str) -> LossDatum:
    if loss_fn == "cross_entropy":
        return LossDatum(X42, {"weights": W42})
    inputs = {"logprobs": LQ42, "advantages": A42}
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = MASK42
    if loss_fn == "stable_reinforce":
        return LossDatum(X42, inputs, draws=DRAWS42, sampled_mask=SAMPLED42)
    return LossDatum(X42, inputs)


def run(loss_fn, logits, data, config=None):
    """compute_loss + backward; returns (result, [grad per logits tensor])."""
    leaves = [z.detach().clone().requires_grad_() for z in logits]
    result = compute_loss(loss_fn, leaves, data, config or {})
    result.loss.backward()
    return result, [z.grad for z in leaves]


def coefficients(z: torch.Tensor, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dL/dl_t from a logit gradient of the form c_t (e_x - p_t); checks that form."""
    p = torch.softmax(z, -1)
    px = p.gather(1, x[:, None]).squeeze(1)
    c = grad.gather(1, x[:, None]).squeeze(1) / (1 - px)
    expected = c[:, None] * (F.one_hot(x, z.shape[1]).to(z.dtype) - p)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    return c


TABLE_42 = [
    ("cross_entropy", {}, 3.605222, (0, -1, -1, -0.5)),
    ("importance_sampling", {}, -1.493855, (0, -0.720371, -1.066580, 0.293096)),
    ("ppo", {}, -1.220371, (0, -0.720371, 0, 0)),
    ("cispo", {}, 0.681817, (0, -0.720371, -1.066580, 0.293096)),
    (
        "cispo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        0.156801,
        (0, -0.720371, -0.9, 0.4),
    ),
    ("dro", {"beta": 0.05}, -0.271296, (-0.044001, -0.752015, -0.732393, 0.473295)),
    ("dro", {}, -0.271296, (-0.044001, -0.752015, -0.732393, 0.473295)),
    ("gspo", {}, -0.928586, (0, -0.696439, -0.696439, 0.464293)),
    ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, -1.220371, None),
]


@pytest.mark.parametrize(("loss_fn", "config", "loss_sum", "coef"), TABLE_42)
def test_multi_position_oracle_table(loss_fn, config, loss_sum, coef) -> None:
    result, (grad,) = run(loss_fn, [Z42], [datum42(loss_fn)], config)
    assert result.metrics["loss:sum"] == pytest.approx(loss_sum, abs=1e-5)
    if coef is not None:
        c = coefficients(Z42, X42, grad)
        np.testing.assert_allclose(c.numpy(), coef, atol=1e-6)
    np.testing.assert_allclose(
        result.outputs[0]["logprobs"].numpy(), [-0.880017, -0.940307, -0.947861, -3.434109], 1e-6
    )


SR_GRAD_42 = {
    0.0: [
        [0, 0, 0, 0, 0],
        [-0.375, 0.09375, 0, 0.1875, 0.09375],
        [0.09375, -0.28125, 0.09375, 0.09375, 0],
        [-0.0625, 0, -0.3125, 0.4375, -0.0625],
    ],
    0.01: [
        [0, 0, 0, 0, 0],
        [-0.381095, 0.095338, 0.000713, 0.190118, 0.094926],
        [0.094917, -0.287374, 0.095491, 0.096101, 0.000865],
        [-0.061623, 0.000877, -0.306022, 0.427823, -0.061054],
    ],
}


@pytest.mark.parametrize(("kl_coeff", "loss_sum"), [(0.0, -1.6), (0.01, -1.597777)])
def test_stable_reinforce_multi_position_oracle(kl_coeff, loss_sum) -> None:
    result, (grad,) = run(
        "stable_reinforce", [Z42], [datum42("stable_reinforce")], {"kl_coeff": kl_coeff}
    )
    assert result.metrics["loss:sum"] == pytest.approx(loss_sum, abs=1e-5)
    np.testing.assert_allclose(grad.numpy(), SR_GRAD_42[kl_coeff], atol=1e-6)
    assert torch.all(grad[0] == 0)  # prompt row, even though lq = 0 there
    # Checks listed under the table: mean draw log-probs and the summed k1 KL.
    logp = torch.log_softmax(Z42, -1)
    mean_draws = logp[1:].gather(1, DRAWS42[1:]).mean(1)
    np.testing.assert_allclose(mean_draws.numpy(), [-1.302807, -1.260361, -1.246609], atol=1e-6)
    assert result.metrics["kl_penalty:sum"] == pytest.approx(kl_coeff * 0.222277, abs=1e-7)


def test_k3_is_never_negative_where_sampler_and_learner_agree_to_rounding() -> None:
    """Near r = 1 (on-policy log-ratios are rounding noise) float32's r - 1 - log r rounds
    below 0 (-1e-8 seen in RL runs' kl_k3:mean), though documented never negative: each term
    is now expm1(x) - x, at least 0, and still x^2 / 2 to first order."""
    from tinker_sr.engine.losses import k3_terms

    x = torch.linspace(-3e-4, 3e-4, 20001, dtype=torch.float32)
    assert bool((torch.exp(x) - 1 - x < 0).any())  # the plain form's rounding
    got = k3_terms(x)
    assert bool((got >= 0).all())
    torch.testing.assert_close(got.double(), x.double() ** 2 / 2, atol=2e-11, rtol=0)


def test_derived_ratios_and_diagnostic_metrics() -> None:
    result, _ = run("ppo", [Z42], [datum42("ppo")])
    m = result.metrics
    lx = torch.tensor([-0.940307, -0.947861, -3.434109], dtype=f64)
    lq = LQ42[1:].to(f64)
    r = torch.exp(lx - lq)
    np.testing.assert_allclose(r.numpy(), [0.960495, 1.422107, 0.586191], atol=1e-6)
    assert m["num_tokens:sum"] == 3
    assert m["kl_sampler_learner:mean"] == pytest.approx(float((lq - lx).mean()), abs=1e-6)
    assert m["kl_k3:mean"] == pytest.approx(float((r - 1 - (lx - lq)).mean()), abs=1e-6)
    assert m["importance_ratio:mean"] == pytest.approx(float(r.mean()), abs=1e-6)
    assert m["importance_ratio:max"] == pytest.approx(1.422107, abs=1e-6)
    assert m["importance_ratio:min"] == pytest.approx(0.586191, abs=1e-6)
    assert m["clip_fraction:mean"] == pytest.approx(2 / 3)
    for loss_fn in LOSS_NAMES:
        result, _ = run(loss_fn, [Z42], [datum42(loss_fn)])
        assert "loss:sum" in result.metrics
        assert all(k.count(":") == 1 for k in result.metrics)
        assert all(math.isfinite(v) for v in result.metrics.values())


# ---------------------------------------------------------------------------------------------
# §4.1: one position, V=10.

Z41 = torch.tensor([[2, 1, 0.5, 0, -0.5, -1, -1.5, -2, -3, 0.3]], dtype=f64)
X41 = torch.tensor([1])
Y41 = torch.tensor([[0, 0, 2, 9, 1, 3, 0, 5]])


def sr41(adv=1.5, draws=Y41, lq=-0.7) -> LossDatum:
    return LossDatum(
        X41,
        {"logprobs": torch.tensor([lq]), "advantages": torch.tensor([adv])},
        draws=draws,
        sampled_mask=torch.tensor([True]),
    )


def test_single_position_oracle() -> None:
    r0, (g0,) = run("stable_reinforce", [Z41], [sr41()], {"kl_coeff": 0.0})
    expected0 = [0.5625, -1.3125, 0.1875, 0.1875, 0, 0.1875, 0, 0, 0, 0.1875]
    np.testing.assert_allclose(g0[0].numpy(), expected0, atol=1e-12)
    assert int((g0 != 0).sum()) == 6
    r1, (g1,) = run("stable_reinforce", [Z41], [sr41()], {"kl_coeff": 0.01})
    expected1 = [0.567271, -1.320745, 0.188564, 0.188146, 0.000392]
    expected1 += [0.187738, 0.000144, 0.000087, 0.000032, 0.188372]
    np.testing.assert_allclose(g1[0].numpy(), expected1, atol=1e-6)
    assert int((g1 != 0).sum()) == 10
    assert float(r1.outputs[0]["logprobs"][0]) == pytest.approx(-1.740103, abs=1e-6)
    assert float(torch.log_softmax(Z41, -1)[0, Y41[0]].mean()) == pytest.approx(-1.890103, abs=1e-6)
    assert r1.metrics["loss:sum"] == pytest.approx(-0.214599, abs=1e-6)
    for g in (g0, g1):
        assert abs(float(g.sum())) < 1e-12


def test_single_position_central_differences() -> None:
    for beta in (0.0, 0.01):
        _, (g,) = run("stable_reinforce", [Z41], [sr41()], {"kl_coeff": beta})
        fd = torch.zeros_like(Z41)
        for v in range(10):
            e = torch.zeros_like(Z41)
            e[0, v] = 1e-6
            hi = compute_loss("stable_reinforce", [Z41 + e], [sr41()], {"kl_coeff": beta})
            lo = compute_loss("stable_reinforce", [Z41 - e], [sr41()], {"kl_coeff": beta})
            fd[0, v] = (hi.metrics["loss:sum"] - lo.metrics["loss:sum"]) / 2e-6
        assert float((fd - g).abs().max()) < 2e-9


def test_distinct_draws_give_nine_fixed_entries_for_any_logits() -> None:
    draws = torch.tensor([[0, 2, 3, 4, 5, 6, 7, 8]])
    gen = torch.Generator().manual_seed(1)
    for z in (Z41, torch.randn(1, 10, generator=gen, dtype=f64) * 3):
        _, (g,) = run("stable_reinforce", [z], [sr41(draws=draws)], {"kl_coeff": 0.0})
        expected = torch.zeros(10, dtype=f64)
        expected[1] = -1.5
        expected[draws[0]] = 1.5 / 8
        torch.testing.assert_close(g[0], expected, atol=1e-15, rtol=0)
        assert int((g != 0).sum()) == 9


def test_all_draws_equal_target_give_zero_gradient() -> None:
    _, (g,) = run("stable_reinforce", [Z41], [sr41(draws=torch.full((1, 8), 1))], {"kl_coeff": 0.0})
    assert torch.all(g == 0)


def test_kl_only_is_beta_times_cross_entropy_gradient() -> None:
    result, (g,) = run("stable_reinforce", [Z41], [sr41(adv=0.0)], {"kl_coeff": 0.01})
    p = torch.softmax(Z41, -1)
    torch.testing.assert_close(g, -0.01 * (F.one_hot(X41, 10).to(f64) - p), atol=1e-15, rtol=0)
    lx = float(torch.log_softmax(Z41, -1)[0, 1])
    lq = float(torch.tensor(-0.7))  # inputs travel as float32
    assert result.metrics["loss:sum"] == pytest.approx(0.01 * (lq - lx), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# §4.3: finite differences through a softmax-linear model, logits = H W.


def fd_setup(dtype=f64):
    gen = torch.Generator().manual_seed(7)
    n, d, v, k = 6, 5, 7, 8
    h = torch.randn(n, d, generator=gen, dtype=f64)
    w = torch.randn(d, v, generator=gen, dtype=f64) * 0.5
    x = torch.randint(0, v, (n,), generator=gen)
    draws = torch.randint(0, v, (n, k), generator=gen)
    draws[:2] = -1
    sampled = torch.tensor([False, False, True, True, True, True])
    adv = torch.tensor([0, 0, 1.0, -0.5, 0.75, -1.25]) * sampled
    lx = torch.log_softmax(h @ w, -1).gather(1, x[:, None]).squeeze(1)
    # Sampler log-probs: a fixed offset, keeping every ratio well away from 0.8 / 1.2 / 4.0.
    offsets = torch.tensor([0, 0, 0.05, -0.35, 0.4, -0.1], dtype=f64)
    lq = torch.where(sampled, lx + offsets, torch.zeros_like(lx)).float()
    inputs = {"logprobs": lq, "advantages": adv}
    return h.to(dtype), w.to(dtype), x, draws, sampled, inputs


def fd_datum(loss_fn, x, draws, sampled, inputs) -> LossDatum:
    inputs = dict(inputs)
    if loss_fn == "cross_entropy":
        inputs = {"weights": torch.tensor([0, 0.5, 1, 1, -0.5, 2.0])}
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = sampled.float()
    if loss_fn == "stable_reinforce":
        return LossDatum(x, inputs, draws=draws, sampled_mask=sampled)
    return LossDatum(x, inputs)


def sr_analytic_logit_grad(z, x, draws, sampled, adv, beta):
    """The boxed §2.3 formula: -A (e_x - mean_k e_y) - beta (e_x - p), on sampled rows."""
    v = z.shape[1]
    e_x = F.one_hot(x, v).to(z.dtype)
    e_y = torch.zeros_like(z).scatter_add_(
        1, draws.clamp_min(0), torch.ones_like(draws, dtype=z.dtype)
    )
    g = -adv[:, None].to(z.dtype) * (e_x - e_y / draws.shape[1]) - beta * (
        e_x - torch.softmax(z, -1)
    )
    return g * sampled[:, None]


# CISPO and GSPO carry a stop-gradient, so their loss value is not the potential of the applied
# gradient: differentiate sum_t c_t l_t(W) with the coefficients c_t frozen at W0 (spec formulas).
FROZEN = ("cispo", "gspo")


def fd_objective(loss_fn, datum, config, h, w0):
    if loss_fn not in FROZEN:
        return lambda w: compute_loss(loss_fn, [h @ w], [datum], config).metrics["loss:sum"]
    x = datum.target_tokens
    lx0 = torch.log_softmax((h @ w0).to(f64), -1).gather(1, x[:, None]).squeeze(1)
    lq, adv = datum.inputs["logprobs"].to(f64), datum.inputs["advantages"].to(f64)
    if loss_fn == "cispo":
        coef = -torch.clamp(torch.exp(lx0 - lq), 0.0, 4.0) * adv
    else:
        mask = datum.inputs["sequence_ratio_mask"] != 0
        s = torch.exp((lx0 - lq)[mask].mean())
        assert 0.8 + 1e-3 < float(s) < 1.2 - 1e-3  # unclipped branch everywhere
        coef = -s * adv

    def objective(w: torch.Tensor) -> float:
        lx = torch.log_softmax(h @ w, -1).gather(1, x[:, None]).squeeze(1)
        return float((coef.to(lx.dtype) * lx).sum())

    return objective


def central_differences(f, w: torch.Tensor, eps: float) -> torch.Tensor:
    fd = torch.zeros_like(w)
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            e = torch.zeros_like(w)
            e[i, j] = eps
            fd[i, j] = (f(w + e) - f(w - e)) / (2 * eps)
    return fd


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_autograd_matches_central_differences_float64(loss_fn) -> None:
    h, w, x, draws, sampled, inputs = fd_setup()
    datum = fd_datum(loss_fn, x, draws, sampled, inputs)
    lx = torch.log_softmax(h @ w, -1).gather(1, x[:, None]).squeeze(1)
    ratios = torch.exp(lx - inputs["logprobs"].to(f64))[sampled]
    for bound in (0.8, 1.2, 4.0):
        assert float((ratios - bound).abs().min()) > 1e-3  # away from the PPO/CISPO kinks
    config = {"kl_coeff": 0.01} if loss_fn == "stable_reinforce" else {}
    w_leaf = w.clone().requires_grad_()
    compute_loss(loss_fn, [h @ w_leaf], [datum], config).loss.backward()
    fd = central_differences(fd_objective(loss_fn, datum, config, h, w), w, 1e-6)
    assert float((w_leaf.grad - fd).abs().max()) < 1e-7
    if loss_fn == "stable_reinforce":
        adv = inputs["advantages"]
        analytic = h.T @ sr_analytic_logit_grad(h @ w, x, draws, sampled, adv, 0.01)
        assert float((analytic - fd).abs().max()) < 1e-7


@pytest.mark.parametrize("loss_fn", ["stable_reinforce", "importance_sampling", "gspo"])
def test_autograd_matches_central_differences_float32(loss_fn) -> None:
    h, w, x, draws, sampled, inputs = fd_setup(torch.float32)
    datum = fd_datum(loss_fn, x, draws, sampled, inputs)
    w_leaf = w.clone().requires_grad_()
    result = compute_loss(loss_fn, [h @ w_leaf], [datum], {})
    assert result.loss.dtype == torch.float32
    result.loss.backward()
    fd = central_differences(fd_objective(loss_fn, datum, {}, h, w), w, 1e-3)
    assert float((w_leaf.grad - fd).abs().max()) < 1e-3 * float(fd.abs().max())


# ---------------------------------------------------------------------------------------------
# §4.4 and §4.6-9: Monte-Carlo unbiasedness of the sampled centering.

Z44 = torch.tensor([1.0, 0.2, -0.3, -1.0, 0.5], dtype=f64)
DELTA44 = torch.tensor([0.8, -0.5, 0.4, 0.0, -0.9], dtype=f64)
ADV44 = torch.tensor([1.0, -0.5, 0.3, -2.0, 0.2], dtype=f64)
EXACT_CENTERING = [-0.267166, 0.091668, 0.037787, 0.107288, 0.030422]
PLAIN_REINFORCE = [-0.431411, 0.151884, 0.029863, 0.115615, 0.134049]


def mc_gradients(q: torch.Tensor, k: int, trials: int, seed: int) -> torch.Tensor:
    """Per-trial StableReinforce logit gradients (beta=0) at one context, from compute_loss:
    every trial is one position of a single datum, so logits.grad row t is trial t."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(5, size=(trials, 1 + k), p=q.numpy())  # x and K independent draws from q
    ids = torch.from_numpy(ids)
    x, draws = ids[:, 0], ids[:, 1:]
    datum = LossDatum(
        x,
        {"logprobs": torch.zeros(trials), "advantages": ADV44[x].float()},
        draws=draws,
        sampled_mask=torch.ones(trials, dtype=torch.bool),
    )
    logits = Z44.expand(trials, 5).clone().requires_grad_()
    compute_loss("stable_reinforce", [logits], [datum], {"kl_coeff": 0.0}).loss.backward()
    return logits.grad


def within_standard_errors(samples: torch.Tensor, target, n_se: float = 4.0) -> float:
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(samples.shape[0])
    dev = ((mean - torch.tensor(target, dtype=f64)).abs() / se).max()
    return float(dev)


def test_sampled_centering_is_unbiased_off_policy() -> None:
    p = torch.softmax(Z44, -1)
    q = torch.softmax(Z44 + DELTA44, -1)
    np.testing.assert_allclose(
        p.numpy(), [0.405889, 0.182378, 0.110618, 0.054931, 0.246184], atol=1e-6
    )
    np.testing.assert_allclose(
        q.numpy(), [0.677161, 0.082923, 0.123706, 0.041178, 0.075032], atol=1e-6
    )
    assert float(q @ ADV44) == pytest.approx(0.605462, abs=1e-6)
    exact = -(q * ADV44 - (q @ ADV44) * q)
    np.testing.assert_allclose(exact.numpy(), EXACT_CENTERING, atol=1e-6)
    np.testing.assert_allclose((-(q * ADV44 - (q @ ADV44) * p)).numpy(), PLAIN_REINFORCE, atol=1e-6)
    g8 = mc_gradients(q, k=8, trials=1_000_000, seed=0)
    assert within_standard_errors(g8, EXACT_CENTERING) < 4
    # The same samples are far from plain REINFORCE's mean: the drift is what centering removes.
    assert within_standard_errors(g8, PLAIN_REINFORCE) > 20
    g1 = mc_gradients(q, k=1, trials=1_000_000, seed=1)
    assert within_standard_errors(g1, EXACT_CENTERING) < 4
    # Variance: K=1 adds E_q[A^2](1 - |q|^2) / K on top of exact centering (spec §2.7).
    added = float((q * ADV44**2).sum() * (1 - (q**2).sum()))
    assert float(g1.var(0).sum() - g8.var(0).sum()) == pytest.approx(added * (1 - 1 / 8), rel=0.03)


def test_on_policy_mean_equals_reinforce_mean() -> None:
    p = torch.softmax(Z44, -1)
    reinforce_mean = -(p * ADV44 - (p @ ADV44) * p)  # E_p[-A(x)(e_x - p)]
    g = mc_gradients(p, k=8, trials=1_000_000, seed=2)
    assert within_standard_errors(g, reinforce_mean.tolist()) < 4


# ---------------------------------------------------------------------------------------------
# §4.6 properties.


def random_batch(loss_fn: str, seed: int, n_datums: int = 3, v: int = 11):
    gen = torch.Generator().manual_seed(seed)
    logits, data = [], []
    for i in range(n_datums):
        n = 4 + 2 * i
        z = torch.randn(n, v, generator=gen, dtype=f64)
        x = torch.randint(0, v, (n,), generator=gen)
        sampled = torch.arange(n) >= 2
        adv = torch.randn(n, generator=gen) * sampled
        lq = (torch.randn(n, generator=gen) * 0.3 - 2) * sampled
        inputs = {"logprobs": lq, "advantages": adv}
        if loss_fn == "cross_entropy":
            inputs = {"weights": torch.rand(n, generator=gen)}
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = sampled.float()
        draws = torch.randint(0, v, (n, 8), generator=gen)
        draws[~sampled] = -1
        if loss_fn == "stable_reinforce":
            data.append(LossDatum(x, inputs, draws=draws, sampled_mask=sampled))
        else:
            data.append(LossDatum(x, inputs))
        logits.append(z)
    return logits, data


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_sum_semantics_duplicate_and_split(loss_fn) -> None:
    logits, data = random_batch(loss_fn, seed=3)
    full, grads = run(loss_fn, logits, data)
    # Duplicating a datum doubles its loss and its gradient (same logits tensor twice too).
    one, (g_one,) = run(loss_fn, logits[:1], data[:1])
    z = logits[0].clone().requires_grad_()
    twice = compute_loss(loss_fn, [z, z], [data[0], data[0]], {})
    twice.loss.backward()
    assert twice.metrics["loss:sum"] == pytest.approx(2 * one.metrics["loss:sum"], abs=1e-12)
    torch.testing.assert_close(z.grad, 2 * g_one, atol=1e-12, rtol=0)
    # Splitting the batch across two calls sums to the same loss and gradients.
    a, ga = run(loss_fn, logits[:1], data[:1])
    b, gb = run(loss_fn, logits[1:], data[1:])
    assert a.metrics["loss:sum"] + b.metrics["loss:sum"] == pytest.approx(
        full.metrics["loss:sum"], abs=1e-12
    )
    for got, want in zip(ga + gb, grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_rows_sum_to_zero_shift_invariance_and_loss_independent_outputs(loss_fn) -> None:
    logits, data = random_batch(loss_fn, seed=4)
    result, grads = run(loss_fn, logits, data)
    shifted, shifted_grads = run(
        loss_fn, [z + 3.7 * torch.arange(len(z))[:, None] for z in logits], data
    )
    assert shifted.metrics["loss:sum"] == pytest.approx(result.metrics["loss:sum"], abs=1e-10)
    for g, gs, z, out, d in zip(grads, shifted_grads, logits, result.outputs, data, strict=True):
        assert float(g.sum(1).abs().max()) < 1e-12
        torch.testing.assert_close(g, gs, atol=1e-10, rtol=0)
        want = torch.log_softmax(z, -1).gather(1, d.target_tokens[:, None]).squeeze(1)
        assert out["logprobs"].dtype == torch.float32
        torch.testing.assert_close(out["logprobs"], want.float())
        ce, _ = run(
            "cross_entropy", [z], [LossDatum(d.target_tokens, {"weights": torch.ones(len(z))})]
        )
        assert torch.equal(ce.outputs[0]["logprobs"], out["logprobs"])


def one_position(loss_fn: str, ratio: float, adv: float, config=None):
    """A single sampled position whose learner/sampler ratio is exactly ``ratio``."""
    z = torch.tensor([[0.3, -0.2, 0.9, 0.0]], dtype=f64)
    x = torch.tensor([2])
    lx = float(torch.log_softmax(z, -1)[0, 2])
    inputs = {
        "logprobs": torch.tensor([lx - math.log(ratio)], dtype=f64).float(),
        "advantages": torch.tensor([adv]),
    }
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = torch.ones(1)
    result, (g,) = run(loss_fn, [z], [LossDatum(x, inputs)], config)
    r = math.exp(lx - float(inputs["logprobs"][0]))
    return float(coefficients(z, x, g)[0]), r, result.metrics


@pytest.mark.parametrize("loss_fn", ["ppo", "gspo"])
def test_trust_region_clip_boundaries(loss_fn) -> None:
    lo, hi = 0.8, 1.2
    cases = [  # (ratio, advantage, clipped?)
        (hi * 0.999, 1.0, False),
        (hi * 1.001, 1.0, True),
        (lo * 1.001, 1.0, False),
        (lo * 0.999, 1.0, False),  # below lo with A>0: unclipped branch is the min
        (lo * 1.001, -1.0, False),
        (lo * 0.999, -1.0, True),
        (hi * 0.999, -1.0, False),
        (hi * 1.001, -1.0, False),  # above hi with A<0 stays unclipped (unbounded)
    ]
    for ratio, adv, clipped in cases:
        c, r, metrics = one_position(loss_fn, ratio, adv)
        assert c == pytest.approx(0.0 if clipped else -r * adv, abs=1e-9), (ratio, adv)
        assert metrics["clip_fraction:mean"] == (1.0 if clipped else 0.0)


def test_cispo_clip_boundaries_bound_the_coefficient() -> None:
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    for adv in (1.0, -1.0):
        for ratio, bounded in (
            (1.2 * 0.999, None),
            (1.2 * 1.001, 1.2),
            (0.8 * 1.001, None),
            (0.8 * 0.999, 0.8),
        ):
            c, r, metrics = one_position("cispo", ratio, adv, config)
            want = -(bounded if bounded is not None else r) * adv
            assert c == pytest.approx(want, abs=1e-9)
            assert metrics["clip_fraction:mean"] == (0.0 if bounded is None else 1.0)
    # Defaults are the one-sided (0, 4): a ratio of 3.9 is not clipped, 4.1 is.
    assert one_position("cispo", 3.9, 1.0)[0] == pytest.approx(-3.9, abs=1e-5)
    assert one_position("cispo", 4.1, 1.0)[0] == pytest.approx(-4.0, abs=1e-9)


@pytest.mark.parametrize("loss_fn", RL_LOSSES)
def test_extreme_sampler_logprob_at_zero_advantage_stays_finite(loss_fn) -> None:
    datum = datum42(loss_fn)
    datum.inputs["logprobs"] = torch.tensor([0.0, -0.9, -1.3, -200.0])
    datum.inputs["advantages"] = torch.tensor([0.0, 0.75, 0.75, 0.0])
    result, (g,) = run(loss_fn, [Z42], [datum])
    assert math.isfinite(result.metrics["loss:sum"])
    assert bool(torch.isfinite(g).all())


def test_per_position_clip_inputs_override_config() -> None:
    datum = datum42("ppo")
    datum.inputs["clip_high_threshold"] = torch.tensor([1.2, 1.2, 1.5, 1.2])
    datum.inputs["clip_low_threshold"] = torch.tensor([0.8, 0.8, 0.8, 0.5])
    result, (g,) = run("ppo", [Z42], [datum], {"clip_high_threshold": 1.1})
    c = coefficients(Z42, X42, g)
    np.testing.assert_allclose(c.numpy(), [0, -0.720371, -1.066580, 0.293096], atol=1e-6)
    assert result.metrics["clip_fraction:mean"] == 0.0


def test_stable_reinforce_beta0_support_values_and_duplicates() -> None:
    logits, data = random_batch("stable_reinforce", seed=5)
    _, grads = run("stable_reinforce", logits, data, {"kl_coeff": 0.0})
    _, grads_other = run(
        "stable_reinforce", [torch.randn_like(z) * 4 for z in logits], data, {"kl_coeff": 0.0}
    )
    for g, g2, d in zip(grads, grads_other, data, strict=True):
        torch.testing.assert_close(g, g2, atol=1e-12, rtol=0)  # independent of the logits
        support = torch.zeros_like(g, dtype=torch.bool)
        support.scatter_(1, d.target_tokens[:, None], True)
        support.scatter_(1, d.draws.clamp_min(0), True)
        assert torch.all(g[~support] == 0)
        # Scatter-add: entry v gets A (m_v / K) - A [v == x] exactly.
        adv = d.inputs["advantages"].to(f64)
        counts = torch.zeros_like(g).scatter_add_(
            1, d.draws.clamp_min(0), torch.ones_like(d.draws, dtype=f64)
        )
        want = adv[:, None] * (counts / 8 - F.one_hot(d.target_tokens, g.shape[1]).to(f64))
        torch.testing.assert_close(g, want * d.sampled_mask[:, None], atol=1e-12, rtol=0)


def test_stable_reinforce_is_linear_in_advantage_and_beta() -> None:
    logits, data = random_batch("stable_reinforce", seed=6, n_datums=1)
    d = data[0]

    def grad(adv_scale: float, beta: float) -> torch.Tensor:
        scaled = LossDatum(
            d.target_tokens,
            {"logprobs": d.inputs["logprobs"], "advantages": d.inputs["advantages"] * adv_scale},
            draws=d.draws,
            sampled_mask=d.sampled_mask,
        )
        return run("stable_reinforce", logits, [scaled], {"kl_coeff": beta})[1][0]

    pg, kl = grad(1.0, 0.0), grad(0.0, 1.0)
    # Powers of two keep the float32 advantages exact.
    torch.testing.assert_close(grad(2.0, 0.0), 2.0 * pg, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad(0.0, 0.3), 0.3 * kl, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad(-0.5, 0.02), -0.5 * pg + 0.02 * kl, atol=1e-12, rtol=0)
    # KL-only equals beta x cross_entropy on the sampled tokens, and loss:sum = beta sum(lq - l).
    no_adv = LossDatum(
        d.target_tokens,
        {"logprobs": d.inputs["logprobs"], "advantages": torch.zeros(len(d.target_tokens))},
        draws=d.draws,
        sampled_mask=d.sampled_mask,
    )
    sr, (g_sr,) = run("stable_reinforce", logits, [no_adv], {"kl_coeff": 0.05})
    ce, (g_ce,) = run(
        "cross_entropy", logits, [LossDatum(d.target_tokens, {"weights": d.sampled_mask.float()})]
    )
    torch.testing.assert_close(g_sr, 0.05 * g_ce, atol=1e-12, rtol=0)
    lx = sr.outputs[0]["logprobs"].to(f64)
    want = 0.05 * float(((d.inputs["logprobs"].to(f64) - lx) * d.sampled_mask).sum())
    assert sr.metrics["loss:sum"] == pytest.approx(want, abs=1e-6)
    assert sr.metrics["kl_penalty:sum"] == pytest.approx(want, abs=1e-6)


def test_stable_reinforce_ignores_positions_outside_sampled_provenance() -> None:
    logits, data = random_batch("stable_reinforce", seed=7, n_datums=1)
    d = data[0]
    base, (g,) = run("stable_reinforce", logits, [d])
    assert torch.all(g[~d.sampled_mask] == 0)
    lq = d.inputs["logprobs"].clone()
    lq[~d.sampled_mask] = -5.0  # a sampler log-prob outside S changes nothing
    other = LossDatum(
        d.target_tokens, {**d.inputs, "logprobs": lq}, draws=d.draws, sampled_mask=d.sampled_mask
    )
    result, (g2,) = run("stable_reinforce", logits, [other])
    assert result.metrics["loss:sum"] == base.metrics["loss:sum"]
    torch.testing.assert_close(g, g2, atol=0, rtol=0)
    adv = d.inputs["advantages"].clone()
    adv[0] = 0.5
    bad = LossDatum(
        d.target_tokens, {**d.inputs, "advantages": adv}, draws=d.draws, sampled_mask=d.sampled_mask
    )
    with pytest.raises(
        EngineUserError,
        match=r"datum 0: advantages\[0\] = 0.5 but position 0 is not under a SampledProvenanceSpan",
    ):
        validate_request("stable_reinforce", [bad], {})


def test_stable_reinforce_kl_coeff_rules() -> None:
    d = datum42("stable_reinforce")
    assert validate_request("stable_reinforce", [d], None) == {"kl_coeff": 0.01}
    assert validate_request("stable_reinforce", [d], {}) == {"kl_coeff": 0.01}
    assert validate_request("stable_reinforce", [d], {"kl_coeff": 0}) == {"kl_coeff": 0.0}
    with pytest.raises(
        EngineUserError, match=r"loss_fn_config\['kl_coeff'\] must be >= 0, got -0.1"
    ):
        validate_request("stable_reinforce", [d], {"kl_coeff": -0.1})
    for value in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(EngineUserError, match=r"loss_fn_config\['kl_coeff'\] must be finite"):
            validate_request("stable_reinforce", [d], {"kl_coeff": value})


def test_stable_reinforce_advantage_shift_changes_gradient_by_centred_score() -> None:
    logits, data = random_batch("stable_reinforce", seed=8, n_datums=1)
    d = data[0]
    _, (g,) = run("stable_reinforce", logits, [d])
    t, b = 3, 0.7
    adv = d.inputs["advantages"].clone()
    adv[t] += b
    shifted = LossDatum(
        d.target_tokens, {**d.inputs, "advantages": adv}, draws=d.draws, sampled_mask=d.sampled_mask
    )
    _, (g2,) = run("stable_reinforce", logits, [shifted])
    v = g.shape[1]
    e_x = F.one_hot(d.target_tokens[t], v).to(f64)
    e_y = torch.zeros(v, dtype=f64).scatter_add_(0, d.draws[t], torch.full((8,), 1 / 8, dtype=f64))
    delta = torch.zeros_like(g)
    delta[t] = -b * (e_x - e_y)
    torch.testing.assert_close(g2 - g, delta, atol=1e-7, rtol=0)  # advantages travel as float32


def test_stable_reinforce_equals_2d_cross_entropy() -> None:
    logits, data = random_batch("stable_reinforce", seed=9)
    beta = 0.01
    _, g_sr = run("stable_reinforce", logits, data, {"kl_coeff": beta})
    ce_data = []
    for d in data:
        adv = d.inputs["advantages"].to(f64)
        targets = torch.cat([d.target_tokens[:, None], d.draws.clamp_min(0)], 1)
        weights = torch.cat([(adv + beta)[:, None], (-adv / 8)[:, None].expand(-1, 8)], 1)
        weights = weights * d.sampled_mask[:, None]
        ce_data.append(LossDatum(targets, {"weights": weights}))
    ce, g_ce = run("cross_entropy", logits, ce_data)
    for a, b in zip(g_sr, g_ce, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)  # weights travel as float32
    assert ce.outputs[0]["logprobs"].shape == data[0].draws.shape[:1] + (9,)


def test_2d_cross_entropy_gradient_and_output_shape() -> None:
    targets = torch.tensor([[2, 0, 2], [1, 4, 3]])
    weights = torch.tensor([[0.5, 0.25, 1.0], [1.0, -0.5, 0.0]])
    z = Z42[:2]
    result, (g,) = run("cross_entropy", [z], [LossDatum(targets, {"weights": weights})])
    logp = torch.log_softmax(z, -1)
    assert result.outputs[0]["logprobs"].shape == (2, 3)
    torch.testing.assert_close(result.outputs[0]["logprobs"], logp.gather(1, targets).float())
    p = torch.softmax(z, -1)
    want = torch.zeros_like(z)
    for t in range(2):
        for j in range(3):
            want[t] -= float(weights[t, j]) * (F.one_hot(targets[t, j], 5).to(f64) - p[t])
    torch.testing.assert_close(g, want, atol=1e-12, rtol=0)
    assert result.metrics["loss:sum"] == pytest.approx(
        -float((weights.to(f64) * logp.gather(1, targets)).sum())
    )
    assert result.metrics["num_tokens:sum"] == 2


# ---------------------------------------------------------------------------------------------
# Engine behaviour: padded-batch views, dtypes, memory.


@pytest.mark.parametrize("loss_fn", ["stable_reinforce", "cross_entropy", "gspo"])
def test_views_into_a_padded_batch_match_separate_tensors(loss_fn) -> None:
    _, data = random_batch(loss_fn, seed=10)
    sizes = [len(d.target_tokens) for d in data]
    base = torch.randn(
        len(data), max(sizes) + 1, 11, dtype=f64, generator=torch.Generator().manual_seed(0)
    )
    leaf = base.clone().requires_grad_()
    batch = leaf * 1.0  # non-leaf, like a model's output
    result = compute_loss(loss_fn, [batch[i, :n] for i, n in enumerate(sizes)], data, {})
    result.loss.backward()
    separate, grads = run(loss_fn, [base[i, :n] for i, n in enumerate(sizes)], data)
    assert result.metrics == separate.metrics
    want = torch.zeros_like(base)
    for i, n in enumerate(sizes):
        want[i, :n] = grads[i]
    torch.testing.assert_close(leaf.grad, want, atol=0, rtol=0)


def test_detached_alias_of_a_batch_keeps_its_own_gradient() -> None:
    _, data = random_batch("importance_sampling", seed=11, n_datums=1)
    base = torch.randn(2, 8, 11, dtype=f64, requires_grad=True)
    alias = base[0, :4].detach().requires_grad_()
    compute_loss("importance_sampling", [alias], data, {}).loss.backward()
    assert alias.grad is not None and base.grad is None


def test_low_precision_logits_give_same_dtype_gradient() -> None:
    logits, data = random_batch("stable_reinforce", seed=12, n_datums=2)
    for dtype in (torch.float32, torch.bfloat16):
        zs = [z.to(dtype).requires_grad_() for z in logits]
        result = compute_loss("stable_reinforce", zs, data, {})
        assert result.loss.dtype == torch.float32
        result.loss.backward()
        assert all(z.grad.dtype == dtype for z in zs)
        assert all(o["logprobs"].dtype == torch.float32 for o in result.outputs)


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_no_tokens_by_vocab_tensor_is_saved_besides_the_logits(loss_fn) -> None:
    _, data = random_batch(loss_fn, seed=13)
    v = 4096
    n_total = sum(len(d.target_tokens) for d in data)
    zs = [torch.randn(len(d.target_tokens), v, requires_grad=True) for d in data]
    big: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() >= v:
            big.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = compute_loss(loss_fn, zs, data, {})
    # Each datum's own logits (saved by reference) and nothing else of vocabulary width.
    assert sorted(big) == sorted(z.numel() for z in zs)
    assert sum(big) == n_total * v
    result.loss.backward()


# ---------------------------------------------------------------------------------------------
# Request errors.


def test_unknown_loss_lists_the_valid_ones() -> None:
    with pytest.raises(
        EngineUserError,
        match="unknown loss_fn 'reinforce'; expected one of: cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce",
    ):
        validate_request("reinforce", [datum42("ppo")], {})


def test_config_errors() -> None:
    d = datum42("ppo")
    with pytest.raises(
        EngineUserError,
        match=r"loss_fn_config key 'kl_coeff' is not accepted by ppo \(accepted keys: clip_low_threshold, clip_high_threshold\)",
    ):
        validate_request("ppo", [d], {"kl_coeff": 0.1})
    with pytest.raises(
        EngineUserError,
        match=r"key 'beta' is not accepted by importance_sampling \(accepted keys: none\)",
    ):
        validate_request("importance_sampling", [d], {"beta": 0.1})
    with pytest.raises(
        EngineUserError, match=r"loss_fn_config\['clip_low_threshold'\] must be a number, got 'low'"
    ):
        validate_request("ppo", [d], {"clip_low_threshold": "low"})
    with pytest.raises(EngineUserError, match="must be a number, got True"):
        validate_request("ppo", [d], {"clip_low_threshold": True})
    with pytest.raises(EngineUserError, match=r"loss_fn_config\['beta'\] must be finite, got nan"):
        validate_request("dro", [d], {"beta": float("nan")})
    with pytest.raises(
        EngineUserError, match=r"clip_low_threshold \(1.5\) is above clip_high_threshold \(1.2\)"
    ):
        validate_request("ppo", [d], {"clip_low_threshold": 1.5})
    with pytest.raises(EngineUserError, match="no data"):
        validate_request("ppo", [], {})


def test_defaults_are_filled_in() -> None:
    assert validate_request("ppo", [datum42("ppo")], None) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    assert validate_request("cispo", [datum42("cispo")], {}) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 4.0,
    }
    assert validate_request("gspo", [datum42("gspo")], {"clip_high_threshold": 1.3}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.3,
    }
    assert validate_request("dro", [datum42("dro")], {}) == {"beta": 0.05}
    assert validate_request("cross_entropy", [datum42("cross_entropy")], {}) == {}


def test_input_errors_name_the_datum_and_key() -> None:
    good = datum42("ppo")
    missing = LossDatum(X42, {"logprobs": LQ42})
    with pytest.raises(
        EngineUserError,
        match=r"datum 1: loss_fn_inputs is missing 'advantages', which ppo requires \(required: target_tokens, logprobs, advantages\)",
    ):
        validate_request("ppo", [good, missing], {})
    extra = LossDatum(X42, {"logprobs": LQ42, "advantages": A42, "mask": W42})
    with pytest.raises(
        EngineUserError,
        match=r"datum 0: loss_fn_inputs key 'mask' is not used by ppo \(accepted: target_tokens, logprobs, advantages, clip_low_threshold, clip_high_threshold\); remove it",
    ):
        validate_request("ppo", [extra], {})
    # an RL datum sent to cross_entropy (the cookbook's SDFT with its default loss_fn): the
    # losses that take the key are named, not only "remove it"
    rl = LossDatum(X42, {"logprobs": LQ42, "advantages": A42})
    with pytest.raises(EngineUserError, match=r"remove it, or use a loss_fn that takes it \(imp"):
        validate_request("cross_entropy", [rl], {})
    short = LossDatum(X42, {"logprobs": LQ42[:3], "advantages": A42})
    with pytest.raises(
        EngineUserError,
        match=r"datum 0: loss_fn_inputs\['logprobs'\] has shape \(3,\) but target_tokens has shape \(4,\)",
    ):
        validate_request("ppo", [short], {})
    nonfinite = LossDatum(
        X42, {"logprobs": LQ42, "advantages": torch.tensor([0, 1, float("nan"), 0])}
    )
    with pytest.raises(
        EngineUserError,
        match=r"datum 0: loss_fn_inputs\['advantages'\] holds a non-finite value \(nan\) at flat index 2",
    ):
        validate_request("ppo", [nonfinite], {})
    two_d = LossDatum(torch.zeros(4, 2, dtype=torch.long), {"logprobs": LQ42, "advantages": A42})
    with pytest.raises(
        EngineUserError,
        match=r"datum 0: target_tokens has shape \(4, 2\) but importance_sampling takes one target per position",
    ):
        validate_request("importance_sampling", [two_d], {})
    weights_2d = LossDatum(torch.zeros(4, 2, dtype=torch.long), {"weights": W42})
    with pytest.raises(
        EngineUserError,
        match=r"datum 0: loss_fn_inputs\['weights'\] has shape \(4,\) but target_tokens has shape \(4, 2\)",
    ):
        validate_request("cross_entropy", [weights_2d], {})
    with pytest.raises(
        EngineUserError,
        match="datum 0: target_tokens holds token 5 at flat index 2 but the vocabulary has 5 tokens",
    ):
        compute_loss(
            "cross_entropy", [Z42], [LossDatum(torch.tensor([0, 1, 5, 2]), {"weights": W42})], {}
        )
    with pytest.raises(EngineUserError, match="datum 0: target_tokens must hold integers"):
        validate_request("cross_entropy", [LossDatum(X42.float(), {"weights": W42})], {})


def test_gspo_with_an_empty_mask_is_an_error() -> None:
    d = datum42("gspo")
    d.inputs["sequence_ratio_mask"] = torch.zeros(4)
    with pytest.raises(
        EngineUserError,
        match="datum 0: sequence_ratio_mask is all zero, so the GSPO sequence ratio is undefined",
    ):
        validate_request("gspo", [d], {})


def test_gspo_without_a_mask_takes_the_ratio_over_the_sampled_positions() -> None:
    """The cookbook's generic rl.train sends no sequence_ratio_mask; the ratio then runs over
    the sampled positions (non-zero advantage or sampler log-prob; the provenance mask when
    given), which for §4.2 is exactly MASK42, so the oracle row still holds."""
    bare = LossDatum(X42, {"logprobs": LQ42, "advantages": A42})
    assert validate_request("gspo", [bare], {}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    result, (grad,) = run("gspo", [Z42], [bare], {})
    assert result.metrics["loss:sum"] == pytest.approx(-0.928586, abs=1e-5)
    np.testing.assert_allclose(
        coefficients(Z42, X42, grad).numpy(), (0, -0.696439, -0.696439, 0.464293), atol=1e-6
    )
    # A different set of positions gives a different ratio: the mask is really used.
    only_first = LossDatum(
        X42, {"logprobs": LQ42, "advantages": A42}, sampled_mask=torch.tensor([0, 1, 0, 0]) == 1
    )
    other, _ = run("gspo", [Z42], [only_first], {})
    assert other.metrics["loss:sum"] != pytest.approx(-0.928586, abs=1e-3)
    # An explicit mask still wins over the default.
    explicit = datum42("gspo")
    explicit.inputs["sequence_ratio_mask"] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    same, _ = run("gspo", [Z42], [explicit], {})
    assert same.metrics["loss:sum"] == pytest.approx(other.metrics["loss:sum"], abs=1e-9)


def test_stable_reinforce_request_errors() -> None:
    no_prov = LossDatum(X42, {"logprobs": LQ42, "advantages": A42})
    with pytest.raises(
        EngineUserError, match="datum 0: stable_reinforce needs provenance on every datum"
    ):
        validate_request("stable_reinforce", [no_prov], {})
    no_draws = LossDatum(X42, {"logprobs": LQ42, "advantages": A42}, sampled_mask=SAMPLED42)
    with pytest.raises(
        EngineUserError,
        match="datum 0: position 1 has advantage 0.75 but no recorded stability draws; sample with a client created with record_stability_info=True",
    ):
        validate_request("stable_reinforce", [no_draws], {})
    nothing_sampled = LossDatum(
        X42,
        {"logprobs": LQ42, "advantages": torch.zeros(4)},
        sampled_mask=torch.zeros(4, dtype=torch.bool),
    )
    with pytest.raises(
        EngineUserError, match="needs at least one target position under a SampledProvenanceSpan"
    ):
        validate_request("stable_reinforce", [nothing_sampled], {})
    # Zero advantages need no draws: the KL term alone trains.
    kl_only = LossDatum(
        X42, {"logprobs": LQ42, "advantages": torch.zeros(4)}, sampled_mask=SAMPLED42
    )
    result, (g,) = run("stable_reinforce", [Z42], [kl_only])
    assert result.metrics["kl_penalty:sum"] == pytest.approx(0.01 * 0.222277, abs=1e-7)
