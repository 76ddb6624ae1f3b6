"""StableReinforce end to end through the public API, and every provenance rule.

Each rejected request must raise `RequestFailedError` (category user) naming the datum, the
span and the rule, and leave the model and the session exactly as they were.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.provenance import build_datum

MODEL = "tinker-sr/tiny"
PROMPT = list(b"Q: 2+2=")


def sample(sc: tinker.SamplingClient, n: int = 2, seed: int = 0) -> list[types.SampledSequence]:
    res = sc.sample(
        types.ModelInput.from_ints(PROMPT),
        n,
        types.SamplingParams(max_tokens=5, seed=seed, stop=[]),
    ).result()
    return list(res.sequences)


@pytest.fixture
def setup(service: tinker.ServiceClient) -> dict[str, Any]:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sample(sc)
    data = [build_datum(PROMPT, s, a) for s, a in zip(seqs, (1.0, -1.0), strict=True)]
    return {"service": service, "tc": tc, "sc": sc, "seqs": seqs, "data": data}


def model_fingerprint(tc: tinker.TrainingClient, data: list[types.Datum]) -> list[float]:
    out = tc.forward(data, "stable_reinforce", {"kl_coeff": 0.0}).result()
    return [v for o in out.loss_fn_outputs for v in o["logprobs"].tolist()]


def test_stable_reinforce_end_to_end(setup: dict[str, Any]) -> None:
    tc, sc, seqs, data = setup["tc"], setup["sc"], setup["seqs"], setup["data"]
    fb = tc.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.01})
    op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    out, step = fb.result(), op.result()
    assert math.isfinite(out.metrics["loss:sum"])
    for key in ("kl_sampler_learner:mean", "importance_ratio:mean", "importance_ratio:max"):
        assert key in out.metrics, key
    # Sampler and learner share weights and numerics here: the KL estimate is ~0.
    assert abs(out.metrics["kl_sampler_learner:mean"]) < 1e-4
    assert step.metrics is not None
    # Returned logprobs are the learner's: equal to compute_logprobs on the same tokens.
    for seq, o in zip(seqs, out.loss_fn_outputs, strict=True):
        lps = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT + seq.tokens)).result()
        np.testing.assert_allclose(
            o["logprobs"].tolist()[len(PROMPT) - 1 :], lps[len(PROMPT) :], atol=1e-4
        )
        np.testing.assert_allclose(seq.logprobs, lps[len(PROMPT) :], atol=1e-4)
    # The step changed the model.
    assert model_fingerprint(tc, data) != [
        v for o in out.loss_fn_outputs for v in o["logprobs"].tolist()
    ]


def test_a_kl_coeff_too_large_for_the_gradient_is_named(setup: dict[str, Any]) -> None:
    """kl_coeff 1e30 is finite and >= 0, so accepted, but its gradient overflows. Before,
    the refusal blamed "datum 0" (whose own loss is finite) and its weights and advantages,
    never naming kl_coeff (hunt)."""
    tc, data = setup["tc"], setup["data"]
    before = model_fingerprint(tc, data)
    with pytest.raises(tinker.RequestFailedError) as ei:
        tc.forward_backward(data, "stable_reinforce", {"kl_coeff": 1e30}).result()
    assert "loss_fn_config coefficients that scale it (kl_coeff=1e+30)" in str(ei.value)
    assert model_fingerprint(tc, data) == before


def test_sequences_sampled_without_the_flag_have_ids_but_no_stability_info(
    setup: dict[str, Any],
) -> None:
    tc, service = setup["tc"], setup["service"]
    plain = tc.save_weights_and_get_sampling_client().result()
    seqs = sample(plain)
    assert all(s.sequence_id for s in seqs)
    data = [build_datum(PROMPT, s, 0.0) for s in seqs]
    # Provenance validates (tokens are recorded) for a loss that does not need stability info...
    tc.forward(data, "importance_sampling").result()
    # ...and zero-advantage StableReinforce datums need no draws either.
    tc.forward(data, "stable_reinforce").result()
    nonzero = [build_datum(PROMPT, s, 1.0) for s in seqs]
    with pytest.raises(tinker.RequestFailedError, match="without stability info"):
        tc.forward(nonzero, "stable_reinforce").result()
    del service


def _with_spans(d: types.Datum, mi: list[Any], lf: list[Any]) -> types.Datum:
    return dataclasses.replace(d, model_input_spans=mi, loss_fn_input_spans=lf)


def _bad_requests(setup: dict[str, Any]) -> dict[str, tuple[list[types.Datum], str, str]]:
    """name → (data, loss_fn, message regex)."""
    d0, d1 = setup["data"]
    s0 = setup["seqs"][0]
    sid = s0.sequence_id
    P, S = len(PROMPT), len(s0.tokens)
    Pr, Sa = types.PromptProvenanceSpan, types.SampledProvenanceSpan
    wrong_target = d0.loss_fn_inputs["target_tokens"].tolist()
    wrong_target[-1] = (wrong_target[-1] + 1) % 256
    wrong_input = d0.model_input.to_ints()
    wrong_input[0] = (wrong_input[0] + 1) % 256
    adv_on_prompt = d0.loss_fn_inputs["advantages"].tolist()
    adv_on_prompt[0] = 1.0
    return {
        "tiling": (
            [_with_spans(d0, [Pr(sequence_id=sid, length=P)], d0.loss_fn_input_spans)],
            "importance_sampling",
            "cover .* positions but model_input has",
        ),
        "unknown id": (
            [
                _with_spans(
                    d0,
                    [Pr(sequence_id="nope", length=P), Sa(sequence_id="nope", length=S - 1)],
                    d0.loss_fn_input_spans,
                )
            ],
            "importance_sampling",
            "not known in this session",
        ),
        "past the end": (
            [
                _with_spans(
                    d0,
                    [Pr(sequence_id=sid, length=P - 1), Sa(sequence_id=sid, offset=2, length=S)],
                    d0.loss_fn_input_spans,
                )
            ],
            "importance_sampling",
            "runs past the end",
        ),
        "input tokens differ": (
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(wrong_input),
                    loss_fn_inputs=d0.loss_fn_inputs,
                    model_input_spans=d0.model_input_spans,
                    loss_fn_input_spans=d0.loss_fn_input_spans,
                )
            ],
            "importance_sampling",
            "model_input token at position 0",
        ),
        "target differs": (
            [
                dataclasses.replace(
                    d0, loss_fn_inputs={**d0.loss_fn_inputs, "target_tokens": wrong_target}
                )
            ],
            "importance_sampling",
            "recorded sampled token",
        ),
        "SR without provenance": (
            [d1, types.Datum(model_input=d0.model_input, loss_fn_inputs=d0.loss_fn_inputs)],
            "stable_reinforce",
            "datum 1: .*needs provenance on every datum",
        ),
        "SR no sampled span": (
            [
                _with_spans(
                    d0,
                    d0.model_input_spans,
                    [Pr(sequence_id=sid, offset=1, length=P - 1), Pr(sequence_id=sid, length=S)],
                )
            ],
            "stable_reinforce",
            "at least one SampledProvenanceSpan",
        ),
        "SR partial sequence": (
            [
                _with_spans(
                    d0,
                    d0.model_input_spans,
                    [
                        Pr(sequence_id=sid, offset=1, length=P - 1),
                        Pr(sequence_id=sid, length=1),
                        Sa(sequence_id=sid, offset=1, length=S - 1),
                    ],
                )
            ],
            "stable_reinforce",
            "not covered",
        ),
        "SR advantage on prompt": (
            [
                dataclasses.replace(
                    d0, loss_fn_inputs={**d0.loss_fn_inputs, "advantages": adv_on_prompt}
                )
            ],
            "stable_reinforce",
            "on a prompt position",
        ),
        "SR negative kl_coeff": ([d0], "stable_reinforce", "kl_coeff"),
    }


def test_every_provenance_rule_rejects_and_changes_nothing(setup: dict[str, Any]) -> None:
    tc, data = setup["tc"], setup["data"]
    before = model_fingerprint(tc, data)
    for name, (bad, loss, pattern) in _bad_requests(setup).items():
        config = {"kl_coeff": -1.0} if "kl_coeff" in pattern else None
        with pytest.raises(tinker.RequestFailedError, match=pattern) as ei:
            tc.forward_backward(bad, loss, config).result()
        assert ei.value.category == types.RequestErrorCategory.User, name
        assert "datum" in str(ei.value) or "kl_coeff" in str(ei.value), name
    with pytest.raises(tinker.RequestFailedError, match="kl_coeff"):
        tc.forward_backward(data, "stable_reinforce", {"kl_coeff": float("nan")}).result()
    # No gradient leaked from the rejected requests into a later step.
    tc.optim_step(types.AdamParams(learning_rate=1.0)).result()
    assert model_fingerprint(tc, data) == before
    # And the session still trains on its sequences.
    tc.forward_backward(data, "stable_reinforce").result()


def test_provenance_pair_is_checked_client_side() -> None:
    span = [types.PromptProvenanceSpan(sequence_id="a", length=1)]
    with pytest.raises(AssertionError, match="pair"):
        types.Datum(model_input=types.ModelInput.from_ints([1]), model_input_spans=span)
    d = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]}
    )
    with pytest.raises(ValueError, match="cover"):
        d.with_provenance(model_input=span, loss_fn_inputs=span)


def test_sequence_ids_are_scoped_to_their_session(
    setup: dict[str, Any], backend_kind: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    service = setup["service"]
    if backend_kind == "local":
        other = tinker.ServiceClient(backend=service.holder.backend)
    else:
        other = tinker.ServiceClient(base_url=service.holder.base_url, api_key="tml-other")
    tc2 = other.create_lora_training_client(MODEL, rank=4, seed=0).result()
    with pytest.raises(tinker.RequestFailedError, match="not known in this session"):
        tc2.forward_backward(setup["data"], "stable_reinforce").result()
    other.close().result()


def test_records_expire_24h_after_last_use_and_use_refreshes(
    setup: dict[str, Any], backend_kind: str
) -> None:
    if backend_kind != "local":
        pytest.skip("the clock of a server process cannot be moved from the test")
    tc, data, seqs = setup["tc"], setup["data"], setup["seqs"]
    store = setup["service"].holder.backend.store
    ids = {s.sequence_id for s in seqs}
    store.touch_sequences(ids, time.time() - 23 * 3600)
    tc.forward(data, "stable_reinforce").result()  # 23 h idle: still usable, and refreshed
    assert all(time.time() - store.get(i).last_used_at < 60 for i in ids)
    store.touch_sequences(ids, time.time() - 25 * 3600)
    with pytest.raises(tinker.RequestFailedError, match="expired"):
        tc.forward(data, "stable_reinforce").result()


def test_stability_info_storage_is_compact(setup: dict[str, Any], backend_kind: str) -> None:
    if backend_kind != "local":
        pytest.skip("inspects the embedded store")
    store = setup["service"].holder.backend.store
    rec = store.get(setup["seqs"][0].sequence_id)
    assert rec.draws is not None and rec.draws.shape == (len(rec.sampled_tokens), 8)
    per_token = (rec.sampled_tokens.nbytes + rec.sampler_logprobs.nbytes + rec.draws.nbytes) / len(
        rec.sampled_tokens
    )
    assert per_token == 40  # 4 B token + 4 B logprob + 8 x 4 B draws (spec: ~36 B required)
