from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from tinker_sr.engine.model import Transformer, build_model
from tinker_sr.engine.sampler import (
    generate,
    prompt_alt_tokens,
    prompt_logprobs,
    prompt_top_k_logprobs,
    score_tokens,
    target_logprobs,
)
from tinker_sr.tokenization.byte import ByteTokenizer
from tinker_sr.tokenization.hf import byte_token_table
from tinker_sr.user_errors import EngineUserError

TOK = ByteTokenizer()
PROMPT = TOK.encode("Once upon a time", add_special_tokens=True)


@pytest.fixture(scope="module")
def model() -> Transformer:
    """Tiny model with sharpened logits (std ~0.5 instead of ~0.17 at init) so that temperature,
    top_k and top_p change the distribution visibly."""
    m = build_model("tinker-sr/tiny", seed=11)
    with torch.no_grad():
        m.model.norm.weight.mul_(3.0)
    return m.eval()


def reference_logq(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> np.ndarray:
    """Independent numpy reference for log q: sort, cut top-k, cut top-p, renormalise."""
    z = logits.double().numpy() / temperature
    out = np.full_like(z, -np.inf)
    for r in range(z.shape[0]):
        order = np.argsort(-z[r], kind="stable")
        if top_k > 0:
            order = order[:top_k]
        p = np.exp(z[r, order] - z[r, order].max())
        p /= p.sum()
        keep = (np.cumsum(p) - p) < top_p
        kept = order[keep]
        zk = z[r, kept]
        out[r, kept] = zk - (zk.max() + np.log(np.exp(zk - zk.max()).sum()))
    return out


def full_logits(model: Transformer, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits predicting each sampled token, from one uncached forward."""
    with torch.no_grad():
        seq = torch.tensor([prompt + tokens])
        return model(seq)[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square goodness of fit, bins with expected < 5 merged into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


SAMPLE_KW = dict(temperature=0.7, top_k=20, top_p=0.9, stability_k=8)


def test_same_seed_is_bit_identical_and_rows_differ(model: Transformer) -> None:
    a = generate(model, PROMPT, num_samples=4, max_tokens=24, seed=5, **SAMPLE_KW)
    b = generate(model, PROMPT, num_samples=4, max_tokens=24, seed=5, **SAMPLE_KW)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens and x.logprobs == y.logprobs
        assert np.array_equal(x.draws, y.draws) and x.draws.dtype == np.int32
    assert len({tuple(o.tokens) for o in a}) == 4
    c = generate(model, PROMPT, num_samples=4, max_tokens=24, seed=6, **SAMPLE_KW)
    assert [o.tokens for o in a] != [o.tokens for o in c]


def test_row_stream_does_not_depend_on_num_samples(model: Transformer) -> None:
    one = generate(model, PROMPT, num_samples=1, max_tokens=8, seed=3, **SAMPLE_KW)[0]
    many = generate(model, PROMPT, num_samples=3, max_tokens=8, seed=3, **SAMPLE_KW)[0]
    assert one.tokens == many.tokens


def test_sampled_logprobs_are_log_q_of_a_full_forward(model: Transformer) -> None:
    outs = generate(model, PROMPT, num_samples=3, max_tokens=20, seed=1, **SAMPLE_KW)
    for o in outs:
        logq = reference_logq(full_logits(model, PROMPT, o.tokens), 0.7, 20, 0.9)
        want = logq[np.arange(len(o.tokens)), o.tokens]
        np.testing.assert_allclose(o.logprobs, want, atol=1e-4)
        # every draw lies inside the support of q at its position
        assert np.isfinite(np.take_along_axis(logq, o.draws.astype(np.int64), 1)).all()


def test_max_tokens_and_length_stop_reason(model: Transformer) -> None:
    outs = generate(model, PROMPT, num_samples=2, max_tokens=7, seed=0)
    assert all(len(o.tokens) == 7 and o.stop_reason == "length" for o in outs)
    assert all(o.draws is None for o in outs)


def test_temperature_zero_is_greedy_with_zero_logprobs(model: Transformer) -> None:
    outs = generate(
        model, PROMPT, num_samples=2, max_tokens=10, temperature=0.0, seed=0, stability_k=4
    )
    assert outs[0].tokens == outs[1].tokens
    argmax = full_logits(model, PROMPT, outs[0].tokens).argmax(-1).tolist()
    assert outs[0].tokens == argmax
    assert outs[0].logprobs == [0.0] * 10
    assert (outs[0].draws == np.array(argmax)[:, None]).all()


def test_top_k_one_and_tiny_top_p_are_greedy(model: Transformer) -> None:
    greedy = generate(model, PROMPT, num_samples=1, max_tokens=10, temperature=0.0, seed=0)[0]
    k1 = generate(model, PROMPT, num_samples=3, max_tokens=10, top_k=1, seed=4)
    p0 = generate(model, PROMPT, num_samples=3, max_tokens=10, top_p=1e-6, seed=4)
    for o in k1 + p0:
        assert o.tokens == greedy.tokens
        assert o.logprobs == [0.0] * 10  # q is a point mass


def test_stop_token_is_kept_and_finishes_only_that_row(model: Transformer) -> None:
    free = generate(model, PROMPT, num_samples=6, max_tokens=30, seed=2, temperature=1.5)
    stop = free[0].tokens[4]  # a token row 0 produces at step 4
    outs = generate(
        model, PROMPT, num_samples=6, max_tokens=30, seed=2, temperature=1.5, stop_token_ids=[stop]
    )
    for f, o in zip(free, outs, strict=True):
        if stop in f.tokens:
            cut = f.tokens.index(stop) + 1
            assert o.tokens == f.tokens[:cut] and o.stop_reason == "stop"
            assert o.logprobs == f.logprobs[:cut]
        else:
            assert o.tokens == f.tokens and o.stop_reason == "length"


def test_stop_string_truncates_after_completing_token(model: Transformer) -> None:
    free = generate(model, PROMPT, num_samples=4, max_tokens=30, seed=9, temperature=1.5)
    # Stop strings match the text of the bytes (special tokens add none): take a valid one.
    row = free[0].tokens
    needle = next(bytes(row[a : a + 2]).decode() for a in range(5, 28) if max(row[a : a + 2]) < 128)
    outs = generate(
        model, PROMPT, num_samples=4, max_tokens=30, seed=9, temperature=1.5,
        stop_strings=[needle], token_bytes=byte_token_table(),
    )  # fmt: skip
    for f, o in zip(free, outs, strict=True):
        full = TOK.decode(f.tokens, skip_special_tokens=True)
        if needle in full:
            assert o.stop_reason == "stop" and needle in TOK.decode(o.tokens)
            assert needle not in TOK.decode(o.tokens[:-1], skip_special_tokens=True)
            assert o.tokens == f.tokens[: len(o.tokens)]
        else:
            assert o.tokens == f.tokens and o.stop_reason == "length"
    assert outs[0].stop_reason == "stop" and len(outs[0].tokens) < 30


def _first_position(
    model: Transformer, n: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    outs = generate(model, PROMPT, num_samples=n, max_tokens=1, seed=seed, **SAMPLE_KW)
    x = np.array([o.tokens[0] for o in outs])
    y = np.stack([o.draws[0] for o in outs])
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]))[:, -1]
    q = np.exp(reference_logq(logits, 0.7, 20, 0.9)[0])
    return x, y, q


def test_stability_draws_follow_q_chi_square(model: Transformer) -> None:
    x, y, q = _first_position(model, n=600, seed=123)
    support = np.flatnonzero(q > 0)
    assert 3 <= len(support) <= 20  # top_k and top_p both cut
    assert np.isin(y, support).all() and np.isin(x, support).all()
    counts = np.bincount(y.ravel(), minlength=len(q))[support]
    assert chi2_pvalue(counts, y.size * q[support]) > 1e-3
    token_counts = np.bincount(x, minlength=len(q))[support]
    assert chi2_pvalue(token_counts, x.size * q[support]) > 1e-3


def test_stability_draws_follow_q_at_every_position(model: Transformer) -> None:
    """Across positions q changes; bin each draw by the rank of its token under that
    position's q and compare with the expected rank mass summed over positions."""
    outs = generate(model, PROMPT, num_samples=8, max_tokens=40, seed=77, **SAMPLE_KW)
    observed = np.zeros(20)
    expected = np.zeros(20)
    for o in outs:
        q = np.exp(reference_logq(full_logits(model, PROMPT, o.tokens), 0.7, 20, 0.9))
        order = np.argsort(-q, axis=1, kind="stable")
        rank = np.argsort(order, axis=1)
        for t in range(len(o.tokens)):
            np.add.at(observed, rank[t, o.draws[t]], 1)
            expected += o.draws.shape[1] * q[t, order[t, :20]]
    assert chi2_pvalue(observed, expected) > 1e-3


def test_stability_draws_are_independent_of_the_chosen_token(model: Transformer) -> None:
    x, y, q = _first_position(model, n=600, seed=321)
    # Under independence P(y == x) = sum q^2; a shared uniform would make it ~1.
    matches = (y == x[:, None]).sum()
    p_match = float((q**2).sum())
    sd = math.sqrt(y.size * p_match * (1 - p_match) * 8)  # draws of a row share x: inflate
    assert abs(matches - y.size * p_match) < 4 * sd
    # contingency of (x, y) over the 3 likeliest tokens + "other"
    top = np.argsort(-q)[:3]
    xb = np.array([np.flatnonzero(top == v)[0] if v in top else 3 for v in x])
    yb = np.vectorize(lambda v: np.flatnonzero(top == v)[0] if v in top else 3)(y)
    table = np.zeros((4, 4))
    np.add.at(table, (np.repeat(xb, y.shape[1]), yb.ravel()), 1)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    p = float(torch.special.gammaincc(torch.tensor(9 / 2), torch.tensor(stat / 2)))
    assert p > 1e-3


def test_bfloat16_sampler_runs(model: Transformer) -> None:
    bf16 = build_model("tinker-sr/tiny", seed=11, dtype=torch.bfloat16)
    outs = generate(bf16, PROMPT, num_samples=2, max_tokens=8, seed=0, **SAMPLE_KW)
    assert all(len(o.tokens) == 8 and np.isfinite(o.logprobs).all() for o in outs)


def test_top_k_sample_logprobs_are_the_head_of_log_q(model: Transformer) -> None:
    o = generate(model, PROMPT, num_samples=1, max_tokens=6, seed=0, top_k=3, top_k_logprobs=5)[0]
    assert o.topk_token_ids.shape == (6, 5) and o.topk_logprobs.dtype == np.float32
    # only 3 tokens are in q's support; the remaining cells hold the sentinel
    assert (o.topk_logprobs[:, 3:] == -99999.0).all() and (o.topk_token_ids[:, 3:] == 0).all()
    np.testing.assert_allclose(o.topk_logprobs[np.arange(6), 0] >= np.array(o.logprobs), True)
    assert np.allclose(np.exp(o.topk_logprobs[:, :3]).sum(1), 1.0, atol=1e-5)


def test_logprobs_modes_report_q_or_the_models_own(model: Transformer) -> None:
    """The three ``logprobs_mode``s draw the same tokens and stability draws; "sampled" (the
    Tinker API's) and "processed_logprobs" report q at temperature 0.7 with top_k 3, while
    "raw_logprobs" reports the model's own log-softmax (every alternative, no sentinel);
    at temperature 0 only "sampled" reports the point mass's 0.0."""
    kw = dict(num_samples=2, max_tokens=6, seed=3, top_k=3, top_k_logprobs=4, stability_k=4)
    out = {
        mode: generate(model, PROMPT, temperature=0.7, logprobs_mode=mode, **kw)
        for mode in ("sampled", "processed_logprobs", "raw_logprobs")
    }
    sampled, processed, raw = out.values()
    for a, b, c in zip(sampled, processed, raw, strict=True):
        assert a.tokens == b.tokens == c.tokens and (a.draws == c.draws).all()
        assert a.logprobs == b.logprobs and (a.topk_logprobs == b.topk_logprobs).all()
        with torch.no_grad():
            logp = model(torch.tensor([PROMPT + c.tokens]))[0].log_softmax(-1)
        want = [float(logp[len(PROMPT) - 1 + t, tok]) for t, tok in enumerate(c.tokens)]
        np.testing.assert_allclose(c.logprobs, want, atol=1e-5)
        assert (c.topk_logprobs > -99999.0).all() and (np.exp(c.topk_logprobs).sum(1) < 1).all()
        assert not np.allclose(c.logprobs, a.logprobs, atol=1e-3)
    greedy = {
        mode: generate(model, PROMPT, temperature=0.0, logprobs_mode=mode, **kw)[0]
        for mode in ("sampled", "processed_logprobs", "raw_logprobs")
    }
    assert greedy["sampled"].logprobs == [0.0] * 6
    assert greedy["processed_logprobs"].logprobs == greedy["raw_logprobs"].logprobs
    assert max(greedy["raw_logprobs"].logprobs) < 0
    with pytest.raises(ValueError, match="logprobs_mode 'raw'"):
        generate(model, PROMPT, logprobs_mode="raw", **kw)


def test_prompt_scoring(model: Transformer) -> None:
    lp = prompt_logprobs(model, PROMPT)
    assert lp[0] is None and len(lp) == len(PROMPT)
    with torch.no_grad():
        logp = model(torch.tensor([PROMPT]))[0].log_softmax(-1)
    want = [float(logp[t - 1, PROMPT[t]]) for t in range(1, len(PROMPT))]
    np.testing.assert_allclose(lp[1:], want, atol=1e-6)
    np.testing.assert_allclose(score_tokens(model, PROMPT), want, atol=1e-6)
    ids, top = prompt_top_k_logprobs(model, PROMPT, 4)
    assert ids.shape == (len(PROMPT), 4) and (top[0] == -99999.0).all()
    assert np.allclose(top[1:, 0], logp[:-1].max(-1).values.numpy(), atol=1e-6)
    targets = np.array([[PROMPT[t], -1] for t in range(1, len(PROMPT))])
    got = target_logprobs(model, PROMPT, targets)
    np.testing.assert_allclose(got[:, 0], want, atol=1e-6)
    assert (got[:, 1] == 0.0).all()
    alt, alt_lp = prompt_alt_tokens(model, PROMPT, 3, temperature=1.0, seed=0)
    assert alt.shape == (len(PROMPT) - 1, 3) and alt.dtype == np.int64
    np.testing.assert_allclose(
        alt_lp, logp[:-1].gather(-1, torch.as_tensor(alt)).numpy(), atol=1e-5
    )


def test_prompt_scoring_unembeds_a_few_rows_at_a_time(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt log-probs (scores, top-k, targets, alternative tokens) never hold the prompt's
    [T, V] logits: the head runs `chunk_rows` rows at a time (here 4, so chunk edges fall
    inside the prompt), with the whole-prompt results. Before: full logits and their
    log-softmax (a 16k-token prompt of a 152k vocabulary: 2 x 10 GB, an internal error)."""
    from tinker_sr.engine import sampler

    def results() -> dict[str, Any]:
        return {
            "scores": score_tokens(model, PROMPT),
            "topk": prompt_top_k_logprobs(model, PROMPT, 4),
            "targets": target_logprobs(model, PROMPT, np.array([[t, -1] for t in PROMPT[1:]])),
            "alt": prompt_alt_tokens(model, PROMPT, 3, temperature=0.7, seed=5),
            "greedy": prompt_alt_tokens(model, PROMPT, 2, temperature=0.0, seed=5),
        }

    whole = results()
    rows: list[int] = []
    head = sampler.apply_linear

    def counted(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[-2])
        return head(layer, x)

    monkeypatch.setattr(sampler, "apply_linear", counted)
    monkeypatch.setattr(sampler, "chunk_rows", lambda vocab: 4)
    chunked = results()
    assert rows and max(rows) == 4 and len(PROMPT) - 1 > 8, rows
    for name, want in whole.items():
        for got_part, want_part in zip(
            chunked[name] if isinstance(want, tuple) else [chunked[name]],
            want if isinstance(want, tuple) else [want],
            strict=True,
        ):
            assert got_part.shape == want_part.shape, name
            if got_part.dtype.kind in "iu":
                assert (got_part == want_part).all(), name
            else:
                np.testing.assert_allclose(got_part, want_part, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompt=[]), "prompt: expected at least one token"),
        (dict(prompt=[1, 259]), "token id 259 at position 1"),
        (dict(prompt=[-1]), "token id -1"),
        (dict(num_samples=0), "num_samples"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=600), "context window: .* > 512; cut .* by 100"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(stop_token_ids=[999]), "stop: token id 999"),
        (dict(stop_strings=["x"]), "token_bytes"),
        (dict(stability_k=-1), "stability_k"),
    ],
)
def test_bad_requests_are_user_errors(model: Transformer, kwargs: dict, match: str) -> None:
    args = dict(prompt=[1] * 12, num_samples=1, max_tokens=4, seed=0) | kwargs
    with pytest.raises(EngineUserError, match=match):
        generate(model, args.pop("prompt"), **args)
