"""StableReinforce lowered by the client to weighted cross_entropy (issue 13).

Same datums, same draws: native ``stable_reinforce`` and the lowered form (2-D targets, and
one 1-D call per column) must give the same gradients (read back exactly: with beta1 = 0
Adam's first moment after one step *is* the gradient, and save_state writes it), the same
weights after ``optim_step``, the same outputs and the same metrics. Client-side draws must
follow the sampler's distribution like the engine's own draws (chi-square).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import tinker_sr as tinker
from tests.engine.test_sampler import chi2_pvalue
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.clients import sr_draws, sr_lowering
from tinker_sr.clients.sr_lowering import LoweringOptions, client_draws
from tinker_sr.provenance import SequenceRecord, build_datum

MODEL = "tinker-sr/tiny"
PROMPT = list(b"Q: 2+2=")
KL = {"kl_coeff": 0.05}
# Gradients of the 1-D path are sums of K+1 backward passes: equal up to float32 rounding.
GRAD_TOL = 1e-6  # relative to the largest gradient entry of the model


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[tinker.ServiceClient, Path]]:
    store = tmp_path / "store"
    backend = LocalBackend(store)
    client = tinker.ServiceClient(backend=backend, stable_reinforce_lowering="never")
    yield client, store
    client.close().result()
    backend.close()


def _data(sc: tinker.SamplingClient, seed: int = 1) -> list[types.Datum]:
    res = sc.sample(
        types.ModelInput.from_ints(PROMPT),
        4,
        types.SamplingParams(max_tokens=6, seed=seed, stop=[]),
    ).result()
    rng = np.random.default_rng(seed)
    # Per-token advantages, one sequence with all-zero advantages (KL term only).
    advs = [rng.normal(size=len(s.tokens)).tolist() for s in res.sequences[:-1]] + [0.0]
    return [build_datum(PROMPT, s, a) for s, a in zip(res.sequences, advs, strict=True)]


def _step_and_read(
    tc: tinker.TrainingClient, store: Path, name: str, data: list[types.Datum]
) -> tuple[types.ForwardBackwardOutput, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """forward_backward + one Adam step with beta1 = 0 → (output, gradients, new weights)."""
    # Submitted back to back: the step must run after every (lowered) gradient call.
    fb = tc.forward_backward(data, "stable_reinforce", KL)
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3, beta1=0.0))
    out = fb.result()
    step.result()
    tc.save_state(name).result()
    tensors = load_file(str(next(store.rglob(f"{name}.safetensors"))))
    grads = {
        k[len("optim.") : -len(".exp_avg")]: v for k, v in tensors.items() if k.endswith(".exp_avg")
    }
    weights = {k[len("lora.") :]: v for k, v in tensors.items() if k.startswith("lora.")}
    return out, grads, weights


def assert_same_training(
    ref: tuple[types.ForwardBackwardOutput, dict[str, np.ndarray], dict[str, np.ndarray]],
    got: tuple[types.ForwardBackwardOutput, dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    (out_a, g_a, w_a), (out_b, g_b, w_b) = ref, got
    assert g_a.keys() == g_b.keys() and w_a.keys() == w_b.keys()
    scale = max(float(np.abs(g).max()) for g in g_a.values())
    assert scale > 0
    worst = max(float(np.abs(g_a[k] - g_b[k]).max()) for k in g_a) / scale
    assert worst <= GRAD_TOL, worst
    for k in w_a:
        np.testing.assert_allclose(w_b[k], w_a[k], rtol=0, atol=1e-6)
    for a, b in zip(out_a.loss_fn_outputs, out_b.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(b["logprobs"].to_numpy(), a["logprobs"].to_numpy())
    assert out_b.metrics.keys() >= out_a.metrics.keys()
    for key, value in out_a.metrics.items():
        assert out_b.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_lowered_equals_native_on_the_embedded_engine(
    embedded: tuple[tinker.ServiceClient, Path], caplog: pytest.LogCaptureFixture
) -> None:
    client, store = embedded
    tcs = [client.create_lora_training_client(MODEL, rank=4, seed=0).result() for _ in range(3)]
    sc = tcs[0].save_weights_and_get_sampling_client(record_stability_info=True).result()
    data = _data(sc)
    state = sr_lowering.session_of(client.holder)
    results = {}
    with caplog.at_level(logging.WARNING, logger="tinker_sr"):
        for tc, (mode, targets) in zip(
            tcs, (("never", "auto"), ("always", "2d"), ("always", "1d")), strict=True
        ):
            state.options = LoweringOptions(mode=mode, targets=targets)  # type: ignore[arg-type]
            results[(mode, targets)] = _step_and_read(tc, store, f"{mode}-{targets}", data)
            assert (
                client.stable_reinforce_path
                == {
                    "auto": "native",
                    "2d": "lowered-2d",
                    "1d": "lowered-1d",
                }[targets]
            )
    native = results[("never", "auto")]
    # The engine's draws are used: the lowered form has no tail mass to report.
    assert "draw_tail_mass:mean" not in results[("always", "2d")][0].metrics
    assert_same_training(native, results[("always", "2d")])
    assert_same_training(native, results[("always", "1d")])
    # The 2-D path is one cross_entropy over the same logit gradient: bit-identical.
    for k, g in native[1].items():
        np.testing.assert_array_equal(results[("always", "2d")][1][k], g)
    said = [r.getMessage() for r in caplog.records if "lowered by the client" in r.getMessage()]
    assert len(said) == 2 and "2-D targets" in said[0] and "1-D targets" in said[1]
    # The engine takes 2-D targets: 1-D was the caller's choice, and the message says so.
    assert "targets='1d' was asked for" in said[1], said[1]


def test_auto_mode_probes_once_and_runs_natively_here(
    embedded: tuple[tinker.ServiceClient, Path],
) -> None:
    client, _ = embedded
    state = sr_lowering.session_of(client.holder)
    state.options = LoweringOptions(mode="auto")
    tc = client.create_lora_training_client(MODEL, rank=4, seed=0).result()
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    data = _data(sc)
    before = tc.forward(data, "stable_reinforce", KL).result()
    assert state.caps.native is True and client.stable_reinforce_path == "native"
    # The probe changed nothing: the same forward gives the same values.
    again = tc.forward(data, "stable_reinforce", KL).result()
    assert again.metrics == before.metrics
    # Once a native call went through, samples are no longer recorded client-side.
    plan = state.plan_sample(True, types.SamplingParams(max_tokens=2), 0)
    assert not plan.keep and plan.topk == 0


class _Holder:
    backend = object()  # declares nothing


def test_the_embedded_engine_needs_no_client_records_from_the_start(tmp_path: Path) -> None:
    """The embedded engine implements stable_reinforce and records its own draws: in auto
    mode a recording sampler's requests ask for no extra top-k and keep nothing client-side,
    before any training call (they cost ~5 % of an RL sampling run), and the first
    stable_reinforce call runs natively without a probe."""
    backend = LocalBackend(tmp_path / "store")
    client = tinker.ServiceClient(backend=backend)  # auto mode
    try:
        state = sr_lowering.session_of(client.holder)
        assert state.options.mode == "auto"
        assert state.caps.native is True and state.caps.native_confirmed is True
        plan = state.plan_sample(True, types.SamplingParams(max_tokens=4, temperature=1.0), 0)
        assert not plan.keep and plan.topk == 0 and plan.head_k == 0
        tc = client.create_lora_training_client(MODEL, rank=4, seed=0).result()
        sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        data = _data(sc)
        assert not state.records._records  # nothing kept client-side
        tc.forward(data, "stable_reinforce", KL).result()
        assert client.stable_reinforce_path == "native"
        # A backend that does not declare it (a remote service) still starts unknown.
        other = sr_lowering.configure(_Holder(), None)
        assert other.caps.native is None and not other.caps.native_confirmed
    finally:
        client.close().result()
        backend.close()


def test_client_side_provenance_validation(embedded: tuple[tinker.ServiceClient, Path]) -> None:
    client, _ = embedded
    sr_lowering.session_of(client.holder).options = LoweringOptions(mode="always")
    tc = client.create_lora_training_client(MODEL, rank=4, seed=0).result()
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    d = _data(sc)[0]
    targets = d.loss_fn_inputs["target_tokens"].tolist()
    targets[-1] = (targets[-1] + 1) % 256
    bad = types.Datum(
        model_input=d.model_input,
        loss_fn_inputs={**d.loss_fn_inputs, "target_tokens": targets},
        model_input_spans=d.model_input_spans,
        loss_fn_input_spans=d.loss_fn_input_spans,
    )
    with pytest.raises(tinker.RequestFailedError, match="recorded sampled token") as e:
        tc.forward_backward([bad], "stable_reinforce").result()
    assert e.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError, match="kl_coeff"):
        tc.forward_backward([d], "stable_reinforce", {"kl_coeff": -1.0}).result()
    # The client keeps working after a refused request.
    tc.forward_backward([d], "stable_reinforce").result()


def _first_position_draws(
    client: tinker.ServiceClient, backend: LocalBackend, n: int, top_k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """n one-token samples at temperature 0.8, top_k: (q over its support, support ids,
    client draws, engine draws, client tail masses)."""
    tc = client.create_lora_training_client(MODEL, rank=4, seed=0).result()
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=1, seed=123, temperature=0.8, top_k=top_k, stop=[])
    res = sc.sample(types.ModelInput.from_ints(PROMPT), n, params, topk_sample_logprobs=top_k)
    seqs = res.result().sequences
    top = seqs[0].topk_logprobs_np
    assert top is not None and top.token_ids.shape[1] == top_k  # trimmed back to the request
    support = np.asarray(top.token_ids[0], dtype=np.int64)
    q = np.exp(np.asarray(top.logprobs[0], dtype=np.float64))
    state = sr_lowering.session_of(client.holder)
    ours = np.stack([state.records.get(s.sequence_id).draws[0] for s in seqs])  # type: ignore[union-attr]
    engine = np.stack([backend.store.get(s.sequence_id).draws[0] for s in seqs])  # type: ignore[union-attr]
    tails = np.stack([state.records.tail(s.sequence_id) for s in seqs])  # type: ignore[misc]
    return q, support, ours, engine, tails


def test_client_draws_follow_q_like_the_engine_draws(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "store")
    client = tinker.ServiceClient(
        backend=backend, stable_reinforce_lowering=LoweringOptions(mode="always")
    )
    try:
        q, support, ours, engine, tails = _first_position_draws(client, backend, n=400, top_k=12)
    finally:
        client.close().result()
        backend.close()
    assert ours.shape == engine.shape == (400, 8)
    assert np.all(tails == 0)  # top_k <= k: the head is q's whole support
    assert abs(q.sum() - 1) < 1e-5
    for draws in (ours, engine):
        assert np.isin(draws, support).all()
        counts = np.array([(draws == t).sum() for t in support])
        assert chi2_pvalue(counts, draws.size * q) > 1e-3
    # Independent streams: the client's draws are not the engine's.
    assert not np.array_equal(ours, engine)


def test_client_draws_follow_q_at_every_position_like_the_engine_draws(tmp_path: Path) -> None:
    """As tests/engine/test_sampler.py does for the engine's draws: q changes with the
    position, so bin each draw by its token's rank under that position's q (the top-k the
    sampler returned, which is q's whole support here: top_k = 12 <= k)."""
    backend = LocalBackend(tmp_path / "store")
    client = tinker.ServiceClient(
        backend=backend, stable_reinforce_lowering=LoweringOptions(mode="always")
    )
    try:
        tc = client.create_lora_training_client(MODEL, rank=4, seed=0).result()
        sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = types.SamplingParams(max_tokens=40, seed=77, temperature=0.7, top_k=12, stop=[])
        res = sc.sample(types.ModelInput.from_ints(PROMPT), 8, params, topk_sample_logprobs=12)
        seqs = res.result().sequences
        state = sr_lowering.session_of(client.holder)
        for draws_of in (
            lambda sid: state.records.get(sid).draws,  # type: ignore[union-attr]
            lambda sid: backend.store.get(sid).draws,  # type: ignore[union-attr]
        ):
            observed, expected = np.zeros(12), np.zeros(12)
            for seq in seqs:
                top = seq.topk_logprobs_np
                assert top is not None
                draws = draws_of(seq.sequence_id)
                for t in range(len(seq.tokens)):
                    rank = {int(v): r for r, v in enumerate(top.token_ids[t])}
                    np.add.at(observed, [rank[int(y)] for y in draws[t]], 1)
                    expected += draws.shape[1] * np.exp(top.logprobs[t].astype(np.float64))
            assert chi2_pvalue(observed, expected) > 1e-3
            assert state.records.tail(seqs[0].sequence_id) is not None
            assert all(float(state.records.tail(s.sequence_id).max()) == 0 for s in seqs)  # type: ignore[union-attr]
    finally:
        client.close().result()
        backend.close()


def test_client_records_expire_and_stay_bounded() -> None:
    records = sr_lowering._Records(max_tokens=10)

    def rec(sid: str, n: int, used: float) -> SequenceRecord:
        tokens, prompt = np.zeros(n, dtype=np.int32), np.zeros(0, dtype=np.int32)
        return SequenceRecord(sid, "s", prompt, tokens, tokens.astype(np.float32), None, used, used)

    records.put(rec("a", 4, 0.0), None)
    records.put(rec("b", 4, 1.0), None)
    records.touch({"a"}, 2.0)  # "a" is now the most recently used
    records.put(rec("c", 4, 3.0), None)  # 12 tokens > 10: the least recently used goes
    assert records.get("b") is None and records.get("a") is not None
    records.put(rec("d", 1, 3.0 + sr_lowering.RECORD_TTL_SECONDS + 10), None)
    assert records.get("a") is None and records.get("c") is None  # idle for over a day
    assert records.get("d") is not None


def test_client_records_count_prompts_once_per_request() -> None:
    """Prompts were not counted: 2,000 requests of an 8,000-token prompt held 64 MiB while
    64,000 tokens were counted, so the budget allowed ~20 GB. A request's samples share one
    prompt array, counted once."""
    records = sr_lowering._Records(max_tokens=100)

    def group(name: str, prompt_len: int, n: int, used: float) -> None:
        prompt = np.zeros(prompt_len, dtype=np.int32)  # one array for the request's samples
        for i in range(n):
            tokens = np.zeros(5, dtype=np.int32)
            rec = SequenceRecord(
                f"{name}{i}", "s", prompt, tokens, tokens.astype(np.float32), None, used, used
            )
            records.put(rec, None)

    group("a", 40, 4, 0.0)  # 40 + 4 x 5 = 60 tokens
    assert records._tokens == 60 and all(records.get(f"a{i}") for i in range(4))
    group("b", 30, 2, 1.0)  # 60 + 40 = 100: still within
    assert records._tokens == 100 and records.get("a0") is not None

    def afresh() -> int:
        kept = records._records.values()
        prompts = {id(r.prompt_tokens): len(r.prompt_tokens) for r in kept}
        return sum(len(r.sampled_tokens) for r in kept) + sum(prompts.values())

    group("c", 1, 1, 2.0)  # 106: the oldest go first; "a"'s prompt stays while a2, a3 hold it
    assert records.get("a1") is None and records.get("a2") is not None
    assert records._tokens == afresh() == 96
    group("d", 0, 2, 3.0)  # 106 again: a2 and a3 go, and "a"'s prompt with the last of them
    assert records.get("a3") is None and records._tokens == afresh() == 56


def test_client_draws_report_the_missing_tail() -> None:
    p = np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    ids = np.array([[7, 3, 9]])
    lps = np.log(p[:3])[None, :].astype(np.float32)
    draws, tail = client_draws(ids, lps, 20_000, np.random.default_rng(0))
    assert tail[0] == pytest.approx(0.2, abs=1e-6)
    counts = np.array([(draws == t).sum() for t in (7, 3, 9)])
    assert chi2_pvalue(counts, draws.size * p[:3] / 0.8) > 1e-3
    # An empty cell means the head is the whole support; top_k <= k says the same.
    padded_ids = np.array([[7, 3, 0]])
    padded = np.array([[np.log(0.6), np.log(0.4), -99999.0]], dtype=np.float32)
    assert client_draws(padded_ids, padded, 4, np.random.default_rng(0))[1][0] == 0
    assert client_draws(ids, lps, 4, np.random.default_rng(0), sampling_top_k=3)[1][0] == 0


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "exact"),
    [(0.7, 5, 0.9, True), (1.0, -1, 0.3, True), (1.0, -1, 1.0, False), (1.3, 8, 1.0, True)],
)
def test_head_from_raw_top_k_matches_the_sampling_distribution(
    temperature: float, top_k: int, top_p: float, exact: bool
) -> None:
    """The fallback turns the raw model's top-k into log q (temperature, top_k, top_p) as the
    engine's sampler does; where the head is q's support the result is q itself."""
    from tests.engine.test_sampler import reference_logq

    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.normal(scale=2.0, size=(6, 40)), dtype=torch.float32)
    raw = torch.log_softmax(logits, -1).numpy().astype(np.float64)
    k = 8
    ids = np.argsort(-raw, axis=1, kind="stable")[:, :k]
    params = types.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = sr_lowering.head_from_raw(ids, np.take_along_axis(raw, ids, 1), params)
    want = np.take_along_axis(reference_logq(logits, temperature, top_k, top_p), ids, 1)
    _, tail = client_draws(ids, got, 4, np.random.default_rng(0), sampling_top_k=top_k)
    if exact:
        np.testing.assert_allclose(np.exp(got), np.exp(want), atol=1e-6)
        assert np.all(tail == 0)
    else:  # temperature 1, no filter: the head is exact and the tail is what it misses
        np.testing.assert_allclose(got, want, atol=1e-6)
        np.testing.assert_allclose(tail, 1 - np.exp(want).sum(axis=1), atol=1e-6)
        assert np.all(tail > 0)


def test_lowering_options_are_checked() -> None:
    with pytest.raises(ValueError, match="'auto', 'always' or 'never'"):
        LoweringOptions(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="targets"):
        LoweringOptions(targets="3d")  # type: ignore[arg-type]
    assert LoweringOptions.parse("always").mode == "always"


def test_bad_environment_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_SR_LOWERING", "sometimes")
    with pytest.raises(ValueError, match=r"^\$TINKER_SR_LOWERING: .*'auto', 'always' or"):
        LoweringOptions.parse(None)
    assert LoweringOptions.parse("never").mode == "never"  # an argument wins
    monkeypatch.setenv("TINKER_SR_BACKEND", "elsewhere")
    with pytest.raises(ValueError, match=r"^\$TINKER_SR_BACKEND must be 'local', 'remote'"):
        tinker.ServiceClient()


# ---- against a real server playing an engine without StableReinforce -----------------------

FEATURELESS = ["--without-stable-reinforce", "--ignore-stability-info"]
TOPK_PARAMS = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0, top_k=12, stop=[])


@pytest.fixture(scope="module")
def featureless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests._server import running_server

    with running_server(tmp_path_factory.mktemp("featureless"), extra_args=FEATURELESS) as srv:
        yield srv


def _native_reference(
    tmp_path: Path, data: list[types.Datum], records: list[SequenceRecord]
) -> tuple[types.ForwardBackwardOutput, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Native stable_reinforce on the embedded engine, on the same datums and the same draws
    (the client's records put into the engine's store under its session)."""
    store = tmp_path / "native"
    backend = LocalBackend(store)
    client = tinker.ServiceClient(backend=backend, stable_reinforce_lowering="never")
    try:
        tc = client.create_lora_training_client(MODEL, rank=4, seed=0).result()
        session_id = client.holder._session_id
        assert session_id is not None
        backend.store.put_sequences(
            [dataclasses.replace(r, session_id=session_id) for r in records]
        )
        return _step_and_read(tc, store, "native", data)
    finally:
        client.close().result()
        backend.close()


@contextlib.contextmanager
def _remote_sample(
    srv: Any, options: LoweringOptions, n: int
) -> Iterator[tuple[tinker.ServiceClient, tinker.TrainingClient, types.SampleResponse]]:
    """A client of ``srv`` with ``options``, a training client and n samples of PROMPT."""
    client = tinker.ServiceClient(
        base_url=srv.base_url, api_key="tml-test", stable_reinforce_lowering=options
    )
    try:
        tc = client.create_lora_training_client(MODEL, rank=4, seed=0).result()
        sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        yield client, tc, sc.sample(types.ModelInput.from_ints(PROMPT), n, TOPK_PARAMS).result()
    finally:
        client.close().result()


def test_a_sample_drawn_in_another_process_is_refused_naming_that(featureless: Any) -> None:
    """A pickled sampler's sample in a worker process: its id is this session's, its draws are
    the worker's. Before: "not known in this session ... sample and train through clients of
    one ServiceClient", which the user had done."""
    with _remote_sample(featureless, LoweringOptions(), 2) as (client, tc, res):
        data = [build_datum(PROMPT, s, 1.0) for s in res.sequences]
        state = sr_lowering.session_of(client.holder)
        state.records = sr_draws.Records()  # what this process holds when a worker sampled
        with pytest.raises(tinker.RequestFailedError, match="holds no draws for it") as e:
            tc.forward_backward(data, "stable_reinforce").result()
        assert "one ServiceClient" not in str(e.value)
        assert "drawn in another process" in str(e.value) and "tinker-sr serve" in str(e.value)
        assert e.value.category == types.RequestErrorCategory.User


@pytest.mark.parametrize("targets", ["auto", "1d"])
def test_lowered_on_a_featureless_server_equals_native(
    featureless: Any, tmp_path: Path, targets: str
) -> None:
    options = LoweringOptions(targets=targets)  # type: ignore[arg-type]
    with _remote_sample(featureless, options, 4) as (client, tc, res):
        assert all(s.topk_logprobs_np is None for s in res.sequences)  # not asked for: trimmed
        rng = np.random.default_rng(3)
        data = [
            build_datum(PROMPT, s, rng.normal(size=len(s.tokens)).tolist()) for s in res.sequences
        ]
        name = f"lowered-{targets}"
        lowered = _step_and_read(tc, featureless.store, name, data)
        state = sr_lowering.session_of(client.holder)
        assert state.caps.native is False  # the server refused the loss (422)
        assert client.stable_reinforce_path == ("lowered-1d" if targets == "1d" else "lowered-2d")
        records = [state.records.get(s.sequence_id) for s in res.sequences]
    assert all(r is not None and r.draws is not None for r in records)
    # top_k = 12 <= the 12 returned: exact draws, nothing missing.
    assert lowered[0].metrics["draw_tail_mass:max"] == 0.0
    reference = _native_reference(tmp_path, data, [r for r in records if r is not None])
    assert_same_training(reference, lowered)


def test_featureless_server_refuses_and_the_client_detects_1d_only(tmp_path: Path) -> None:
    from tests._server import running_server

    flags = [*FEATURELESS, "--only-1d-targets", "--ignore-topk-sample-logprobs"]
    with running_server(tmp_path / "store", extra_args=flags) as srv:
        client = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-test")
        try:
            tc = client.create_lora_training_client(MODEL, rank=4, seed=0).result()
            sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
            res = sc.sample(types.ModelInput.from_ints(PROMPT), 2, TOPK_PARAMS).result()
            data = [build_datum(PROMPT, s, 1.0) for s in res.sequences]
            two_d = types.Datum(
                model_input=data[0].model_input,
                loss_fn_inputs={
                    "target_tokens": np.zeros((len(PROMPT) + 5, 2), dtype=np.int64),
                    "weights": np.zeros((len(PROMPT) + 5, 2), dtype=np.float32),
                },
            )
            with pytest.raises(tinker.UnprocessableEntityError, match="1-D"):
                tc.forward([two_d], "cross_entropy").result()
            # The native loss is refused at submit; with lowering forbidden the user sees it.
            sr_lowering.session_of(client.holder).options = LoweringOptions(mode="never")
            with pytest.raises(tinker.UnprocessableEntityError, match="stable_reinforce"):
                tc.forward_backward(data, "stable_reinforce").result()
            sr_lowering.session_of(client.holder).options = LoweringOptions()
            out = tc.forward_backward(data, "stable_reinforce").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            assert client.stable_reinforce_path == "lowered-1d"
            assert out.metrics["num_tokens:sum"] == 2 * TOPK_PARAMS.max_tokens
            # No sample top-k from this server: the draws came from a compute_logprobs-style
            # pass (topk_prompt_logprobs), still exact with top_k <= k.
            state = sr_lowering.session_of(client.holder)
            assert state.caps.topk_sample is False
            assert out.metrics["draw_tail_mass:max"] == 0.0
            raw = sc.sample(
                types.ModelInput.from_ints(PROMPT + res.sequences[0].tokens),
                1,
                types.SamplingParams(max_tokens=1),
                topk_prompt_logprobs=TOPK_PARAMS.top_k,
            ).result()
            assert raw.topk_prompt_logprobs_np is not None
            head = np.asarray(raw.topk_prompt_logprobs_np.token_ids)[len(PROMPT) :]
            draws = state.records.get(res.sequences[0].sequence_id).draws  # type: ignore[union-attr]
            assert draws is not None
            assert all(np.isin(draws[t], head[t]).all() for t in range(len(draws)))
        finally:
            client.close().result()


def test_demo_against_the_featureless_server_says_which_path_ran(
    featureless: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tinker_sr.cli import main

    argv = ["demo", "--steps", "2", "--group-size", "4", "--quiet", "--no-plot"]
    assert main([*argv, "--base-url", featureless.base_url, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stable_reinforce ran: lowered by the client to cross_entropy with 2-D targets" in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Client-side draws over the whole vocabulary: exact, nothing left out.
    assert all(r["loss_metrics"]["draw_tail_mass:max"] == 0.0 for r in records)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["stable_reinforce_path"] == "lowered-2d"


def test_a_service_refusing_the_extra_top_k_still_samples(featureless: Any) -> None:
    """The top-k the lowering adds to a sample request must never break the user's sample:
    refused (here: more than the vocabulary), the request is sent again as the user made
    it; without any top-k the lowered loss then says why it has no draws."""
    options = LoweringOptions(draw_topk=1000)  # the tiny vocabulary has 259
    with _remote_sample(featureless, options, 2) as (client, tc, res):
        assert len(res.sequences) == 2
        caps = sr_lowering.session_of(client.holder).caps
        assert caps.topk_sample is False and caps.topk_prompt is False
        data = [build_datum(PROMPT, s, 1.0) for s in res.sequences]
        with pytest.raises(tinker.RequestFailedError, match="neither topk_sample_logprobs"):
            tc.forward_backward(data, "stable_reinforce").result()
