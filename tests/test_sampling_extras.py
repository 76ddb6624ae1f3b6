"""SamplingClient.sample extras on every backend: top-k prompt/sample logprobs,
target_prompt_logprobs (dense and CSR) and prompt_alt_tokens, checked against a direct forward."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.engine.model import build_model

MODEL = "tinker-sr/tiny"
PROMPT = [5, 10, 20, 30, 40, 50]
SENTINEL = (0, -99999.0)


@pytest.fixture(scope="module")
def ref_model() -> torch.nn.Module:
    m = build_model(MODEL, seed=0)
    m.eval()
    return m


def _logp(model: torch.nn.Module, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(tokens), V]: row t = log softmax(logits / T) of the token after tokens[:t+1]."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]))[0].float()
    return (logits / temperature).log_softmax(-1)


def _sp(seed: int = 3, temperature: float = 1.0, n: int = 4) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=n, temperature=temperature, seed=seed, stop=[])


def test_topk_prompt_and_sample_logprobs_match_a_full_forward(
    service: tinker.ServiceClient, ref_model: torch.nn.Module
) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    k = 5
    r = sc.sample(
        types.ModelInput.from_ints(PROMPT),
        2,
        _sp(),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=k,
    ).result()

    tp = r.topk_prompt_logprobs_np
    assert tp is not None
    assert tp.token_ids.dtype == np.int32 and tp.logprobs.dtype == np.float32
    assert tp.token_ids.shape == tp.logprobs.shape == (len(PROMPT), k)
    assert (tp.token_ids[0] == SENTINEL[0]).all() and (tp.logprobs[0] == SENTINEL[1]).all()
    ref = _logp(ref_model, PROMPT)[:-1]
    lp, ids = ref.topk(k, dim=-1)
    np.testing.assert_array_equal(tp.token_ids[1:], ids.numpy())
    np.testing.assert_allclose(tp.logprobs[1:], lp.numpy(), rtol=0, atol=1e-5)
    lists = r.topk_prompt_logprobs
    assert lists is not None and lists[0] is None and len(lists[1]) == k
    # The prompt token's own logprob appears in its top-k row when it is in the top-k.
    assert r.prompt_logprobs is not None
    for t in range(1, len(PROMPT)):
        row = dict(lists[t] or [])
        if PROMPT[t] in row:
            assert row[PROMPT[t]] == pytest.approx(r.prompt_logprobs[t], abs=1e-5)

    for seq in r.sequences:
        top = seq.topk_logprobs_np
        assert top is not None and seq.logprobs is not None
        assert top.token_ids.dtype == np.int32 and top.logprobs.dtype == np.float32
        assert top.token_ids.shape == (len(seq.tokens), k)
        full = _logp(ref_model, PROMPT + seq.tokens)[len(PROMPT) - 1 : -1]
        lp, ids = full.topk(k, dim=-1)
        np.testing.assert_array_equal(top.token_ids, ids.numpy())
        np.testing.assert_allclose(top.logprobs, lp.numpy(), rtol=0, atol=1e-4)
        for t, (tok, tok_lp) in enumerate(zip(seq.tokens, seq.logprobs, strict=True)):
            row = dict(seq.topk_logprobs[t] or [])  # type: ignore[index]
            if tok in row:
                assert row[tok] == pytest.approx(tok_lp, abs=1e-6)
            else:
                assert tok_lp <= min(row.values()) + 1e-6


def test_topk_prompt_rows_follow_prompt_logprobs_last_n(service: tinker.ServiceClient) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    full = sc.sample(prompt, 1, _sp(), include_prompt_logprobs=True, topk_prompt_logprobs=3)
    last = sc.sample(
        prompt,
        1,
        _sp(),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        prompt_logprobs_last_n=2,
    )
    a, b = full.result().topk_prompt_logprobs, last.result().topk_prompt_logprobs
    assert a is not None and b is not None and len(b) == len(PROMPT)
    assert b[: len(PROMPT) - 2] == [None] * (len(PROMPT) - 2)
    assert b[-2:] == a[-2:]
    assert last.result().prompt_logprobs[: len(PROMPT) - 2] == [None] * (len(PROMPT) - 2)  # type: ignore[index]


def test_greedy_topk_sample_row_is_a_point_mass(service: tinker.ServiceClient) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    r = sc.sample(
        types.ModelInput.from_ints(PROMPT), 1, _sp(temperature=0.0), topk_sample_logprobs=3
    ).result()
    seq = r.sequences[0]
    assert seq.topk_logprobs == [[(tok, 0.0)] for tok in seq.tokens]


@pytest.mark.parametrize("sparse", [False, True])
def test_target_prompt_logprobs_dense_and_csr(
    service: tinker.ServiceClient, ref_model: torch.nn.Module, sparse: bool
) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    ids = torch.full((len(PROMPT) - 1, 3), -1, dtype=torch.long)
    ids[2, 0], ids[3, 1], ids[3, 2], ids[4, 0] = 7, 9, 33, PROMPT[5]
    td = (
        types.TensorData.from_torch_sparse(ids, pad_value=-1)
        if sparse
        else types.TensorData.from_torch(ids)
    )
    assert td.is_sparse == sparse
    r = sc.sample(types.ModelInput.from_ints(PROMPT), 1, _sp(), target_prompt_logprobs=td).result()
    out = r.target_prompt_logprobs
    assert out is not None and out.dtype == "float32" and out.shape == list(ids.shape)
    assert out.is_sparse == sparse
    if sparse:
        assert out.sparse_crow_indices == td.sparse_crow_indices
        assert out.sparse_col_indices == td.sparse_col_indices
    got = out.to_numpy()
    ref = _logp(ref_model, PROMPT)[:-1].gather(-1, ids.clamp_min(0)).masked_fill(ids < 0, 0.0)
    np.testing.assert_allclose(got, ref.numpy(), rtol=0, atol=1e-5)
    assert (got[ids.numpy() < 0] == 0.0).all()


def test_prompt_alt_tokens_shapes_values_and_determinism(
    service: tinker.ServiceClient, ref_model: torch.nn.Module
) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    k, temp = 6, 0.7

    def alt(seed: int, temperature: float = temp) -> types.PromptAltTokens:
        r = sc.sample(prompt, 1, _sp(seed, temperature), prompt_alt_tokens_k=k).result()
        assert r.prompt_alt_tokens is not None
        return r.prompt_alt_tokens

    a, b, c = alt(11), alt(11), alt(12)
    assert a.tokens.dtype == "int64" and a.logprobs.dtype == "float32"
    assert a.tokens.shape == a.logprobs.shape == [len(PROMPT) - 1, k]
    ta = a.tokens.to_numpy()
    np.testing.assert_array_equal(ta, b.tokens.to_numpy())
    np.testing.assert_array_equal(a.logprobs.to_numpy(), b.logprobs.to_numpy())
    assert not np.array_equal(ta, c.tokens.to_numpy())
    ref = _logp(ref_model, PROMPT, temp)[:-1]
    expect = ref.gather(-1, torch.as_tensor(ta)).numpy()
    np.testing.assert_allclose(a.logprobs.to_numpy(), expect, rtol=0, atol=1e-5)

    greedy = alt(11, 0.0)
    argmax = _logp(ref_model, PROMPT)[:-1].argmax(-1).numpy()
    np.testing.assert_array_equal(greedy.tokens.to_numpy(), np.repeat(argmax[:, None], k, 1))
    assert (greedy.logprobs.to_numpy() == 0.0).all()


def _bad_requests() -> Iterator[tuple[dict[str, object], str]]:
    n = len(PROMPT) - 1
    yield {"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"
    yield {"topk_prompt_logprobs": 10**6}, "topk_prompt_logprobs"
    yield {"topk_sample_logprobs": 10**6}, "topk_sample_logprobs"
    yield {"topk_sample_logprobs": -3}, "topk_sample_logprobs"  # was silently 0 (recording)
    yield {"prompt_alt_tokens_k": 10**6}, "prompt_alt_tokens_k"
    rows = types.TensorData.from_numpy(np.zeros((n + 1, 2), dtype=np.int64))
    yield {"target_prompt_logprobs": rows}, r"target_prompt_logprobs.*shape"
    vocab = types.TensorData.from_numpy(np.full((n, 1), 10**6, dtype=np.int64))
    yield {"target_prompt_logprobs": vocab}, r"target_prompt_logprobs.*vocabulary"
    empty = types.TensorData.from_numpy(np.full((n, 2), -1, dtype=np.int64))
    yield {"target_prompt_logprobs": empty}, r"target_prompt_logprobs.*no token id"


def test_bad_extras_fail_with_clear_user_errors(service: tinker.ServiceClient) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    for kwargs, match in _bad_requests():
        with pytest.raises(tinker.RequestFailedError, match=match) as ei:
            sc.sample(prompt, 1, _sp(), **kwargs).result()  # type: ignore[arg-type]
        assert ei.value.category == types.RequestErrorCategory.User, kwargs
    with pytest.raises(ValueError, match="prompt_alt_tokens_k"):
        sc.sample(prompt, 1, _sp(), prompt_alt_tokens_k=-1)


def test_official_sdk_receives_every_extra(
    remote_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    ref_model: torch.nn.Module,
) -> None:
    sdk = pytest.importorskip("tinker")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    st = sdk.types
    # On the suite's server (tests/conftest.py): a start-up of its own cost ~4 s.
    service = sdk.ServiceClient(base_url=remote_server.base_url, api_key="tml-test")
    sc = service.create_sampling_client(base_model=MODEL).result()
    ids = torch.full((len(PROMPT) - 1, 2), -1, dtype=torch.long)
    ids[1, 0], ids[4, 1] = 3, 44
    r = sc.sample(
        st.ModelInput.from_ints(PROMPT),
        num_samples=2,
        sampling_params=st.SamplingParams(max_tokens=3, temperature=1.0, seed=5),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=4,
        topk_sample_logprobs=2,
        target_prompt_logprobs=st.TensorData.from_torch_sparse(ids, pad_value=-1),
        prompt_alt_tokens_k=3,
    ).result()
    service.close("success").result()  # its heartbeats would outlive the test

    ref = _logp(ref_model, PROMPT)[:-1]
    assert r.topk_prompt_logprobs_np is not None
    lp, top = ref.topk(4, dim=-1)
    np.testing.assert_array_equal(r.topk_prompt_logprobs_np.token_ids[1:], top.numpy())
    np.testing.assert_allclose(r.topk_prompt_logprobs_np.logprobs[1:], lp.numpy(), atol=1e-5)
    assert r.topk_prompt_logprobs[0] is None
    for seq in r.sequences:
        assert seq.topk_logprobs_np is not None
        assert seq.topk_logprobs_np.token_ids.shape == (3, 2)
        assert len(seq.topk_logprobs) == 3
    t = r.target_prompt_logprobs
    assert t is not None and t.dtype == "float32" and t.shape == [len(PROMPT) - 1, 2]
    expect = ref.gather(-1, ids.clamp_min(0)).masked_fill(ids < 0, 0.0).numpy()
    np.testing.assert_allclose(t.to_numpy(), expect, atol=1e-5)
    alt = r.prompt_alt_tokens
    assert alt is not None
    assert alt.tokens.dtype == "int64" and alt.tokens.shape == [len(PROMPT) - 1, 3]
    assert alt.logprobs.dtype == "float32" and alt.logprobs.shape == [len(PROMPT) - 1, 3]
    expect_alt = ref.gather(-1, torch.as_tensor(alt.tokens.to_numpy())).numpy()
    np.testing.assert_allclose(alt.logprobs.to_numpy(), expect_alt, atol=1e-5)
