"""Issue 10: every defect a hostile user found gets a test named after it (test_NN_...).

Each test failed before its fix. Server tests speak raw HTTP to a real server on 127.0.0.1;
embedded tests use `LocalBackend`. The "twin" tests check the issue's closing promise: after a
refused or non-finite request, the same training client trains normally and its weights equal
those of a twin that never saw the bad request.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

import tinker_sr as tinker
from tests._server import ServerProcess, running_server
from tests._train import service_where_a_gap_hangs
from tests.test_server import MODEL, Wire
from tinker_sr import types, validation
from tinker_sr.backend.local import LocalBackend
from tinker_sr.engine import sampler as engine_sampler
from tinker_sr.errors import RequestFailedError
from tinker_sr.limits import Limits

JSON_ENDPOINTS = [
    "create_session",
    "session_heartbeat",
    "create_model",
    "get_info",
    "optim_step",
    "save_weights",
    "asample",
    "retrieve_future",
    "load_weights",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ["--model-alias", "house-model=tinker-sr/tiny", "--max-lora-rank", "64"]
    with running_server(tmp_path_factory.mktemp("hardening_store"), extra_args=flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def wire(server: ServerProcess) -> Wire:
    return Wire(server.base_url)


@pytest.fixture(scope="module")
def session_id(wire: Wire) -> str:
    return wire.session()


@pytest.fixture(scope="module")
def sampler_id(wire: Wire, session_id: str) -> str:
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": MODEL}
    return str(wire.ok("create_sampling_session", body)["sampling_session_id"])


_SAMPLE_SEQ = itertools.count()


def sample_body(sampler_id: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2, "seed": 1},
        "sampling_session_id": sampler_id,
        "seq_id": next(_SAMPLE_SEQ),
        "type": "sample",
    }
    body.update(extra)
    return body


def wire_refused(wire: Wire, resp: httpx.Response, *needles: str) -> str:
    """Refused at once (4xx) or as a failed future of category "user"."""
    if resp.status_code == 200 and "request_id" in resp.json():
        failed = wire.wait(resp.json()).json()
        assert failed.get("category") == "user", failed
        for needle in needles:
            assert needle in failed["error"], failed
        return str(failed["error"])
    return user_error(resp, *needles)


def user_error(resp: httpx.Response, *needles: str) -> str:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    detail = str(resp.json()["detail"])
    for needle in needles:
        assert needle in detail, detail
    return detail


DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
    loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
)


def lora_weights(tc: Any) -> list[np.ndarray]:
    """The trained weights, read back through a saved state (works on every backend)."""
    fwd = tc.forward([DATUM], "cross_entropy").result()
    return [np.asarray(fwd.loss_fn_outputs[0]["logprobs"].to_numpy())]


def train_step(tc: Any) -> None:
    tc.forward_backward([DATUM], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()


# ---- 1. deeply nested JSON ---------------------------------------------------------------


def test_01_deeply_nested_json_is_a_400(wire: Wire) -> None:
    for path in JSON_ENDPOINTS:
        user_error(wire.post(path, b"[" * 2000), "deeper than")
        user_error(wire.post(path, b"[" * 100 + b"]" * 100), "deeper than")
    wire.session()  # still serving


# ---- 5. lone surrogates --------------------------------------------------------------------


def test_05_lone_surrogate_in_a_json_string_is_a_400(wire: Wire, session_id: str) -> None:
    user_error(wire.post("session_heartbeat", b'{"session_id":"\\ud800"}'), "surrogate")
    body = json.dumps({"tags": ["x\udfff"], "type": "create_session"}).encode()
    user_error(wire.post("create_session", body), "surrogate")
    # A properly paired surrogate is just a character.
    ok = wire.post(
        "session_heartbeat", json.dumps({"session_id": session_id + "\U0001f600"}).encode()
    )
    assert ok.status_code == 404


@pytest.mark.parametrize("way", ["embedded", "remote"])
def test_05_clients_refuse_text_utf8_cannot_carry_before_numbering(
    way: str, tmp_path: Path
) -> None:
    """A lone surrogate in any string a client sends (metadata, a loss config or datum key, a
    stop string) is a ValueError naming the field, raised before the request is numbered: the
    remote client would otherwise fail to encode a numbered request and leave a gap that holds
    the model's next request for the server's grace period (600 s here, so a gap would hang)."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    odd_key = types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={**datum.loss_fn_inputs, "w\udc80": np.zeros(3, dtype=np.float32)},
    )
    with service_where_a_gap_hangs(way, tmp_path / "store") as service:
        with pytest.raises(ValueError, match=r"ServiceClient: display_name = .* lone surrogate"):
            tinker.ServiceClient(display_name="run\ud800", backend=service.holder.backend)
        with pytest.raises(ValueError, match=r"user_metadata\['a'\] .* lone surrogate"):
            service.create_lora_training_client(MODEL, rank=2, user_metadata={"a": "\ud800"})
        tc = service.create_lora_training_client(MODEL, rank=2).result()
        for call, field in (
            (lambda: tc.forward_backward([datum], "cross_entropy", {"\ud800": 1.0}), "loss_fn_config"),
            (lambda: tc.forward([odd_key], "cross_entropy"), r"data\[0\].loss_fn_inputs key"),
            (lambda: tc.save_state("s", user_metadata={"k": "\udfff"}), "save_state: user_metadata"),
        ):  # fmt: skip
            with pytest.raises(ValueError, match=field):
                call()
        tc.forward_backward([datum], "cross_entropy").result(timeout=60)  # no gap to wait out
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=2, stop=["ok", "x\ud800"])
        with pytest.raises(ValueError, match=r"sampling_params.stop\[1\]"):
            sampler.sample(datum.model_input, 1, params)
        service.close().result()


def test_05_check_text_walks_nested_and_self_holding_values() -> None:
    from tinker_sr import validation

    loop: list[object] = ["fine", "é 😀"]
    loop.append(loop)  # a list that holds itself is walked once
    validation.check_text({"a": loop, "b": ("x", {"k": "v"})}, "cfg")
    loop.append({"deep": ["ok", "bad\udfff"]})
    with pytest.raises(ValueError, match=r"cfg\[3\]\['deep'\]\[1\] = 'bad\\udfff'"):
        validation.check_text(loop, "cfg")


# ---- 6. int64 infinity / overflow ----------------------------------------------------------


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e300", "9223372036854775808"])
def test_06_int64_tensor_data_holding_inf_or_overflow_is_a_400(
    wire: Wire, sampler_id: str, value: str
) -> None:
    tpl = f'{{"data":[{value}, 1],"dtype":"int64","shape":[2,1]}}'
    body = json.dumps(sample_body(sampler_id))[:-1] + f',"target_prompt_logprobs":{tpl}}}'
    user_error(wire.post("asample", body.encode()), "target_prompt_logprobs", "int64")


def test_06_int64_tensor_data_refuses_values_it_cannot_hold() -> None:
    for bad in ([math.inf], [1e300], [2**63], [math.nan]):
        with pytest.raises(ValueError, match="int64 range"):
            types.TensorData(data=bad, dtype="int64")
    assert types.TensorData(data=[-(2**63), 2.0], dtype="int64").tolist() == [-(2**63), 2]


# ---- 8. tiny temperature / top_p -------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1e-300, 1.0), (1e-45, 1.0), (5e-324, 1.0), (1.0, 1e-300)]
)
def test_08_tiny_temperature_or_top_p_samples_greedily_never_nan(
    embedded_service: tinker.ServiceClient, temperature: float, top_p: float
) -> None:
    sc = embedded_service.create_sampling_client(base_model="tinker-sr/tiny").result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    greedy = sc.sample(prompt, 2, types.SamplingParams(max_tokens=6, temperature=0)).result()
    params = types.SamplingParams(max_tokens=6, temperature=temperature, top_p=top_p, seed=3)
    out = sc.sample(prompt, 2, params).result()
    for seq, ref in zip(out.sequences, greedy.sequences, strict=True):
        assert all(math.isfinite(lp) for lp in seq.logprobs or [])
        if top_p == 1.0:  # below the threshold the temperature acts as 0: greedy
            assert seq.tokens == ref.tokens and seq.logprobs == ref.logprobs
        else:  # top_p keeps only the most likely token: greedy tokens, log q = 0
            assert seq.tokens == ref.tokens and seq.logprobs == [0.0] * len(seq.tokens)


def test_08_sampler_threshold_is_the_documented_one() -> None:
    assert engine_sampler.GREEDY_BELOW_TEMPERATURE == 1e-6
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    q = engine_sampler.sampling_logprobs(logits, 1.0, -1, 1e-300).exp()
    assert q.tolist() == [[0.0, 1.0, 0.0]]


# ---- 13/14. datum coercion and types -------------------------------------------------------


def test_13_float_target_tokens_are_refused_not_truncated() -> None:
    with pytest.raises(ValueError, match=r"target_tokens.*2\.9.*whole number"):
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]),
            loss_fn_inputs={"target_tokens": [2.9, 3.9]},
        )
    whole = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2.0, 3.0]},
    )
    assert whole.loss_fn_inputs["target_tokens"].tolist() == [2, 3]


def test_14_one_span_list_alone_is_a_value_error_naming_the_pair() -> None:
    span = [types.SampledProvenanceSpan(sequence_id="s", length=2)]
    with pytest.raises(ValueError, match="only model_input_spans is set"):
        types.Datum(model_input=types.ModelInput.from_ints([1, 2]), model_input_spans=span)
    with pytest.raises(ValueError, match="only loss_fn_input_spans is set"):
        types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_input_spans=span)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"model_input": [1, 2]}, TypeError, "ModelInput"),
        ({"loss_fn_inputs": [1, 2]}, TypeError, "loss_fn_inputs must be a dict"),
        ({"loss_fn_inputs": {"weights": ["a", "b"]}}, ValueError, "numbers"),
        ({"model_input_spans": "x", "loss_fn_input_spans": "x"}, TypeError, "list of spans"),
    ],
)
def test_14_malformed_datum_fields_are_typed_errors(
    kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    fields: dict[str, Any] = {"model_input": types.ModelInput.from_ints([1, 2])} | kwargs
    with pytest.raises(error, match=needle):
        types.Datum(**fields)


# ---- 15. forward_backward_custom deadlock --------------------------------------------------


def test_15_failing_custom_loss_consumes_its_reserved_numbers(
    embedded_service: tinker.ServiceClient,
) -> None:
    tc = embedded_service.create_lora_training_client("tinker-sr/tiny", rank=4).result()

    queued_behind = threading.Event()

    def broken(data: list[types.Datum], logprobs: list[torch.Tensor]) -> Any:
        # Fail only once optim_step is queued behind this call: failing earlier poisons the
        # client before optim_step is called, whose future then fails at once instead.
        queued_behind.wait(timeout=120)
        raise ZeroDivisionError("user bug")

    fb = tc.forward_backward_custom([DATUM], broken)
    queued = tc.optim_step(types.AdamParams(learning_rate=0.1))  # queued behind the custom loss
    queued_behind.set()
    with pytest.raises(ZeroDivisionError) as e:
        fb.result(timeout=120)
    with pytest.raises(RuntimeError, match="poisoned") as poisoned:
        queued.result(timeout=120)  # before the fix: waited forever for seq_id 2
    assert poisoned.value.__cause__ is e.value  # as the SDK: chained to the failure
    backend = embedded_service.holder.backend
    assert isinstance(backend, LocalBackend)
    # Only the forward took a number (1, done): the backend waits for nothing.
    order = backend._ordering._orders[tc.model_id]
    assert order.next_seq == 2 and not order.released


# ---- the twin promise -----------------------------------------------------------------------


def fingerprint(tc: Any) -> list[float]:
    """Forward-only logprobs of a fixed datum: equal lists mean equal weights."""
    out = tc.forward([DATUM], "cross_entropy").result()
    return [float(x) for x in out.loss_fn_outputs[0]["logprobs"].to_numpy()]


def refused(fn: Any, *needles: str) -> str:
    """``fn()`` fails as the caller's error (typed, naming the problem); returns the message."""
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is checked below
        fn()
    err = info.value
    if isinstance(err, RequestFailedError):
        assert err.category == types.RequestErrorCategory.User, err
    else:
        assert isinstance(err, ValueError | TypeError | tinker.APIStatusError), repr(err)
        if isinstance(err, tinker.APIStatusError):
            assert 400 <= err.status_code < 500, err
    for needle in needles:
        assert needle in str(err), str(err)
    return str(err)


def assert_twin_unaffected(service: tinker.ServiceClient, bad: Any, *needles: str) -> None:
    """A client that saw ``bad`` (refused) between a forward_backward and its optim_step, then
    trains on, ends with the weights of a twin that never saw it."""
    a, b = (service.create_lora_training_client(MODEL, rank=4, seed=7).result() for _ in "ab")
    for tc in (a, b):
        tc.forward_backward([DATUM], "cross_entropy").result()
    refused(lambda: bad(a), *needles)
    for tc in (a, b):
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        train_step(tc)
    assert fingerprint(a) == fingerprint(b)


def huge(key: str, value: float) -> types.Datum:
    inputs: dict[str, Any] = {
        "target_tokens": [2, 3, 4, 5, 6],
        "logprobs": [-1.0] * 5,
        "advantages": [1.0] * 5,
        "weights": [1.0] * 5,
    }
    inputs[key] = [value] * 5
    if value != 1.0:  # sampled far less likely than the model now finds it: ratio >> 1
        inputs["logprobs"] = [-30.0] * 5
    if key == "weights":
        inputs = {k: inputs[k] for k in ("target_tokens", "weights")}
    else:
        inputs.pop("weights")
    return types.Datum(model_input=DATUM.model_input, loss_fn_inputs=inputs)


@pytest.mark.parametrize(
    ("loss_fn", "datum"),
    [("cross_entropy", huge("weights", 3e38)), ("importance_sampling", huge("advantages", 1e38))],
)
def test_09_non_finite_loss_is_refused_naming_the_datum_and_the_client_trains_on(
    service: tinker.ServiceClient, loss_fn: str, datum: types.Datum
) -> None:
    key = "weights" if loss_fn == "cross_entropy" else "advantages"

    def bad(tc: Any) -> None:
        tc.forward_backward([huge(key, 1.0), datum], loss_fn).result()

    assert_twin_unaffected(service, bad, "datum 1", "Nothing was accumulated")


def test_09_only_coefficients_that_scale_the_loss_are_named(
    embedded_service: tinker.ServiceClient,
) -> None:
    """PPO's clip thresholds bound a ratio; they scale nothing, so an overflow through the
    advantages does not send the caller to them (review)."""
    tc = embedded_service.create_lora_training_client(MODEL, rank=2, seed=0).result()
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    datum = huge("advantages", 1e36)  # a finite loss (~-5e34) whose gradient overflows
    datum.loss_fn_inputs["logprobs"] = types.TensorData.from_numpy(np.full(5, -1.0, np.float32))
    message = refused(
        lambda: tc.forward_backward([datum], "ppo", config).result(), "datum 0 alone gives loss -"
    )
    assert "loss_fn_config" not in message, message


def test_09_diverged_weights_are_named_not_returned_as_nan(service: tinker.ServiceClient) -> None:
    """An optim_step at learning_rate 1e20 leaves finite weights too large for float32's
    forward. Before: forward returned NaN log-probs and a sample NaN log-probs after token 0,
    without a word, and forward_backward blamed the datum ("Scale that datum's loss inputs")."""
    tc = service.create_lora_training_client(MODEL, rank=2, seed=0).result()
    saved = tc.save_state("before").result().path
    tc.forward_backward([DATUM], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e20)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    calls = {
        "forward": lambda: tc.forward([DATUM], "cross_entropy").result(),
        "forward_backward": lambda: tc.forward_backward([DATUM], "cross_entropy").result(),
        "sample": lambda: sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3)).result(),
        "prompt log-probs": lambda: sampler.compute_logprobs(prompt).result(),
    }
    # Greedy, and the prompt extras: before, token 0 with log-prob 0.0, and NaN (hunt).
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
    targets = types.TensorData.from_numpy(np.array([[2, 3], [3, 4]], dtype=np.int64))
    extras = {
        "sample": {},
        "top-k prompt log-probs": {"topk_prompt_logprobs": 2},
        "target prompt log-probs": {"target_prompt_logprobs": targets},
        "prompt alternative tokens' log-probs": {"prompt_alt_tokens_k": 2},
    }
    for what, kw in extras.items():
        refused(
            lambda kw=kw: sampler.sample(prompt, 1, greedy, **kw).result(),
            f"{what}: ",
            "weights have diverged",
            "smaller learning_rate",
        )
    for what, call in calls.items():
        message = refused(call, f"{what}: ", "weights have diverged", "smaller learning_rate")
        assert "Scale that datum" not in message
    tc.load_state(saved).result()  # the fix the message names
    logprobs = tc.forward([DATUM], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    assert np.isfinite(logprobs.to_numpy()).all()


def test_09_a_step_that_overflows_the_weights_says_so_and_nothing_saves_them(
    service: tinker.ServiceClient,
) -> None:
    """learning_rate 3.4e37 passes the scalar range check yet its update overflows float32.
    Before: the step answered normally, both saves wrote the infinite weights, and loading
    them said "damaged on disk" (hunt)."""
    tc = service.create_lora_training_client(MODEL, rank=2, seed=0).result()
    tc.forward_backward([DATUM], "cross_entropy").result()
    refused(
        lambda: tc.optim_step(types.AdamParams(learning_rate=3.4e37)).result(),
        "optim_step: ",
        "made the weights NaN or infinite",
        "smaller learning_rate",
    )
    for save in (tc.save_state, tc.save_weights_for_sampler):
        refused(lambda save=save: save("x").result(), "save: ", "diverged", "Nothing was saved")


def test_09_a_non_finite_gradient_refused_by_optim_step_is_discarded() -> None:
    from tinker_sr.engine.optim import Adam, AdamHParams
    from tinker_sr.user_errors import EngineUserError

    p = torch.nn.Parameter(torch.ones(3))
    opt = Adam([("p", p)])
    p.grad = torch.tensor([1.0, math.inf, 0.0])
    with pytest.raises(EngineUserError, match="discarded"):
        opt.step(AdamHParams())
    assert p.grad is None and opt.steps["p"] == 0
    p.grad = torch.ones(3)
    opt.step(AdamHParams())
    assert opt.steps["p"] == 1 and bool(torch.isfinite(p).all())


# ---- 4. sparse tensors are shape-checked before they are densified --------------------------


def test_04_huge_sparse_target_prompt_logprobs_is_refused_before_allocating(
    wire: Wire, sampler_id: str, embedded_service: tinker.ServiceClient
) -> None:
    for cols in (10**13, 10**9):
        tpl = {"data": [], "dtype": "int64", "shape": [2, cols]}
        tpl |= {"sparse_crow_indices": [0, 0, 0], "sparse_col_indices": []}
        resp = wire.post("asample", sample_body(sampler_id, target_prompt_logprobs=tpl))
        wire_refused(wire, resp, "target_prompt_logprobs", "1 <= K <= 259")
    sc = embedded_service.create_sampling_client(base_model=MODEL).result()
    sparse = types.TensorData(
        data=[], dtype="int64", shape=[2, 10**13], sparse_crow_indices=[0, 0, 0],
        sparse_col_indices=[],
    )  # fmt: skip
    prompt = types.ModelInput.from_ints([1, 2, 3])
    refused(
        lambda: sc.sample(
            prompt, 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=sparse
        ).result(),
        "1 <= K <= 259",
    )


def test_04_huge_sparse_loss_input_is_refused_before_allocating(
    service: tinker.ServiceClient,
) -> None:
    sparse = types.TensorData(
        data=[1.0], dtype="float32", shape=[5, 10**12], sparse_crow_indices=[0, 1, 1, 1, 1, 1],
        sparse_col_indices=[0],
    )  # fmt: skip
    bad = types.Datum(
        model_input=DATUM.model_input,
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": sparse},
    )
    assert_twin_unaffected(
        service,
        lambda tc: tc.forward_backward([bad], "cross_entropy").result(),
        "weights",
    )


# ---- 10. a seq_id far ahead can never run ---------------------------------------------------


def test_10_training_request_numbered_far_ahead_is_refused_not_left_pending(wire: Wire) -> None:
    model_id = wire.model(wire.session())
    step = {"model_id": model_id, "seq_id": 5000, "adam_params": {}, "type": "optim_step"}
    failed = wire.wait(wire.ok("optim_step", step)).json()
    assert failed["category"] == "user" and "ahead" in failed["error"], failed
    wire.train_step(model_id)  # numbers 1 and 2 still run


def test_10_embedded_request_numbered_far_ahead_is_refused(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "s")
    with tinker.ServiceClient(backend=backend) as service:
        tc = service.create_lora_training_client(MODEL, rank=4).result()
        fut = tc.holder.run(backend.forward_backward(tc.model_id, 5000, [DATUM], "cross_entropy"))
        refused(lambda: fut.result(timeout=60), "1024")
        train_step(tc)
    backend.close()


# ---- 11. limits: one place, configurable, the same on every path ---------------------------


def test_11_lora_rank_above_the_limit_is_refused(
    service: tinker.ServiceClient, wire: Wire, session_id: str
) -> None:
    refused(lambda: service.create_lora_training_client(MODEL, rank=10**9).result(), "rank")
    body = {"session_id": session_id, "model_seq_id": 50, "base_model": MODEL}
    body |= {"lora_config": {"rank": 65}, "type": "create_model"}
    failed = wire.wait(wire.ok("create_model", body)).json()  # this server: --max-lora-rank 64
    assert failed["category"] == "user" and "above this engine's limit of 64" in failed["error"]


def test_11_samples_times_tokens_above_the_limit_is_refused(service: tinker.ServiceClient) -> None:
    sc = service.create_sampling_client(base_model="tinker-sr/small").result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    for n, max_tokens in ((4096, 1000), (2**40, 1)):
        params = types.SamplingParams(max_tokens=max_tokens)
        refused(lambda n=n, p=params: sc.sample(prompt, n, p).result(), "num_samples")


def test_11_sample_token_limit_is_refused_before_the_request_is_accepted(
    wire: Wire, sampler_id: str, tmp_path: Path
) -> None:
    """Found by a hunt: num_samples x (prompt + max_tokens) over --max-sample-tokens was
    accepted, then failed as a future, while num_samples over its limit is refused at once
    (as the hosted service refuses an overlong sample: 400 at asample)."""
    params = {"max_tokens": 500, "seed": 1}  # 600 x (3 + 500) > 262,144, the default
    resp = wire.post("asample", sample_body(sampler_id, num_samples=600, sampling_params=params))
    assert resp.status_code == 400, resp.text
    assert "--max-sample-tokens" in resp.text and "600 x (3 + 500)" in resp.text, resp.text
    backend = LocalBackend(tmp_path / "s", limits=Limits(max_sample_tokens=100))
    with tinker.ServiceClient(backend=backend) as service:
        sc = service.create_sampling_client(base_model=MODEL)
        prompt = types.ModelInput.from_ints([1, 2, 3])
        with pytest.raises(tinker.BadRequestError, match="limit of 100"):
            sc.sample(prompt, 4, types.SamplingParams(max_tokens=40)).result()
        assert sc.sample(prompt, 2, types.SamplingParams(max_tokens=40)).result()  # 86 fits
    backend.close()


def test_11_limits_are_configurable_on_every_path(tmp_path: Path) -> None:
    from tinker_sr.cli import build_parser, limits_from_args
    from tinker_sr.limits import DEFAULT_LIMITS

    args = build_parser().parse_args(["serve", "--max-lora-rank", "8", "--max-train-tokens", "9"])
    assert limits_from_args(args) == Limits(max_lora_rank=8, max_train_tokens=9)
    assert limits_from_args(build_parser().parse_args(["serve"])) == DEFAULT_LIMITS
    backend = LocalBackend(tmp_path / "s", limits=Limits(max_lora_rank=8, max_train_tokens=9))
    with tinker.ServiceClient(backend=backend) as service:
        refused(lambda: service.create_lora_training_client(MODEL, rank=16).result(), "of 8")
        tc = service.create_lora_training_client(MODEL, rank=8).result()
        two = [DATUM, DATUM]  # 10 tokens
        refused(lambda: tc.forward_backward(two, "cross_entropy").result(), "limit of 9")
        train_step(tc)
    backend.close()
    with pytest.raises(ValueError, match="max_num_samples"):
        Limits(max_num_samples=0)


# ---- 12. a request cannot make the server load (or probe) its directories ------------------


def test_12_server_loads_model_dirs_only_from_its_operator(
    wire: Wire, session_id: str, tmp_path: Path
) -> None:
    real = tmp_path / "looks_like_a_model"
    real.mkdir()
    (real / "config.json").write_text("{}")
    answers = []
    for i, name in enumerate([str(real), str(tmp_path / "missing"), "/etc"]):
        body = {"session_id": session_id, "model_seq_id": 100 + i, "base_model": name}
        resp = wire.post("create_model", body | {"lora_config": {"rank": 4}})
        if resp.status_code == 200:
            resp = wire.wait(resp.json())
            answers.append(resp.json()["error"].replace(name, "NAME"))
        else:
            answers.append(user_error(resp).replace(name, "NAME"))
    assert len(set(answers)) == 1 and "--model-dir" in answers[0], answers  # no oracle
    body = {"session_id": session_id, "model_seq_id": 110, "base_model": "house-model"}
    body["lora_config"] = {"rank": 4}
    assert "model_id" in wire.wait(wire.ok("create_model", body)).json()


def test_12_model_dir_flag_serves_a_directory_under_its_names(tmp_path: Path) -> None:
    from tinker_sr.cli import build_parser, model_aliases_from_args
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    d = make_tiny_hf_model_dir(tmp_path / "my-model", n_layers=1)  # checked at start
    config = json.loads((d / "config.json").read_text())
    args = ["serve", "--model-dir", str(d), "--model-alias", "a=tinker-sr/tiny"]
    aliases = model_aliases_from_args(build_parser().parse_args(args))
    assert aliases["my-model"] == aliases[str(d)] == str(d) and aliases["a"] == "tinker-sr/tiny"
    with pytest.raises(SystemExit, match="no config.json"):
        model_aliases_from_args(build_parser().parse_args(["serve", "--model-dir", str(tmp_path)]))
    # Two runs' ".../final" folders: the short name would serve the last one only, silently.
    finals = [make_tiny_hf_model_dir(tmp_path / run / "final", n_layers=1) for run in "ab"]
    argv = ["serve", "--model-dir", str(finals[0]), "--model-dir", str(finals[1])]
    with pytest.raises(SystemExit, match="the name 'final' would serve both .*--model-alias"):
        model_aliases_from_args(build_parser().parse_args(argv))
    twice = ["serve", "--model-dir", str(finals[0]), "--model-dir", str(finals[0])]
    assert model_aliases_from_args(build_parser().parse_args(twice))["final"] == str(finals[0])
    # An alias whose target is nothing the server can load is refused at start, not at the
    # first request for it.
    with pytest.raises(SystemExit, match="--model-alias a=b: no config.json .* Hugging Face cache"):
        model_aliases_from_args(build_parser().parse_args(["serve", "--model-alias", "a=b"]))
    # A config the engine would refuse at first use is refused at start, by field.
    (d / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(SystemExit, match="--model-dir .*my-model: config.json hidden_act 'gel"):
        model_aliases_from_args(build_parser().parse_args(["serve", "--model-dir", str(d)]))
    with pytest.raises(SystemExit, match="--model-alias m=.*my-model: config.json hidden_act"):
        model_aliases_from_args(build_parser().parse_args(["serve", "--model-alias", f"m={d}"]))
    # Found by a hunt: a directory without tokenizer files was served, and the official SDK's
    # get_tokenizer() built an empty tokenizer from it (every text encoded to []).
    bare = make_tiny_hf_model_dir(tmp_path / "bare", n_layers=1)
    (bare / "tokenizer.json").unlink()  # its config and special-token map stay: no vocabulary
    with pytest.raises(SystemExit, match="--model-dir .*bare: .* holds no tokenizer vocabulary"):
        model_aliases_from_args(build_parser().parse_args(["serve", "--model-dir", str(bare)]))
    allowed = ["serve", "--allow-no-tokenizer", "--model-dir", str(bare)]  # token ids only
    assert model_aliases_from_args(build_parser().parse_args(allowed))["bare"] == str(bare)


def test_12_model_dir_flag_serves_a_hub_name_from_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model-dir Qwen/Qwen3-0.6B`` (no such directory) serves the model the local Hugging
    Face cache holds under that name, checked at start like a directory; an uncached name is
    refused at start, saying where it looked."""
    from tinker_sr.cli import build_parser, model_aliases_from_args
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    parse = build_parser().parse_args
    with pytest.raises(SystemExit, match=r"--model-dir org/m: no config.json .*models--org--m"):
        model_aliases_from_args(parse(["serve", "--model-dir", "org/m"]))
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / ("c" * 40)
    make_tiny_hf_model_dir(snap, n_layers=1)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("c" * 40)
    config = json.loads((snap / "config.json").read_text())
    aliases = model_aliases_from_args(parse(["serve", "--model-dir", "org/m"]))
    assert aliases == {"org/m": str(snap)}  # not the snapshot's folder name (a commit hash)
    aliases = model_aliases_from_args(parse(["serve", "--model-alias", "Qwen/Qwen3-8B=org/m"]))
    assert aliases == {"Qwen/Qwen3-8B": "org/m"}
    (snap / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(SystemExit, match="--model-dir org/m: config.json hidden_act 'gelu'"):
        model_aliases_from_args(parse(["serve", "--model-dir", "org/m"]))
    with pytest.raises(SystemExit, match="--model-alias Qwen/Qwen3-8B=org/m: config.json hidden"):
        model_aliases_from_args(parse(["serve", "--model-alias", "Qwen/Qwen3-8B=org/m"]))


# ---- 14. embedded bad input is the caller's error ------------------------------------------


def test_14_embedded_zero_size_and_malformed_sparse_targets_are_user_errors(
    embedded_service: tinker.ServiceClient,
) -> None:
    empty = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.zeros((4, 0), np.int64))},
    )
    broken = types.TensorData(
        data=[1], dtype="int64", shape=[5, 2], sparse_crow_indices=[0, 1], sparse_col_indices=[9]
    )
    csr = types.Datum(model_input=DATUM.model_input, loss_fn_inputs={"target_tokens": broken})
    assert_twin_unaffected(
        embedded_service,
        lambda tc: tc.forward_backward([empty], "cross_entropy").result(),
        "[4, 0]",
    )
    assert_twin_unaffected(
        embedded_service, lambda tc: tc.forward_backward([csr], "cross_entropy").result(), "CSR"
    )


@pytest.mark.parametrize("data", [None, [None], {"a": 1}, [DATUM, "x"]])
def test_14_embedded_malformed_data_is_a_typed_error(
    embedded_service: tinker.ServiceClient, data: Any
) -> None:
    def bad(tc: Any) -> None:
        tc.forward_backward(data, "cross_entropy").result()

    assert_twin_unaffected(embedded_service, bad)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("learning_rate", -1.0),
        ("learning_rate", math.nan),
        ("beta1", 1.0),
        ("eps", 0.0),
        ("weight_decay", -0.1),
        ("grad_clip_norm", -1.0),  # before: the message named eps for either
    ],
)
def test_14_bad_adam_params_are_refused_naming_the_field(
    service: tinker.ServiceClient, field: str, value: float
) -> None:
    params = types.AdamParams(learning_rate=0.05).model_copy(update={field: value})
    # Embedded/server: AdamParams.<field>; NaN never leaves our remote client (JSON has none).
    assert_twin_unaffected(service, lambda tc: tc.optim_step(params).result(), field)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((types.ModelInput.from_ints([1]), "2", {"max_tokens": 2}), None),  # coerced, as the SDK
        (([1, 2], 1, types.SamplingParams(max_tokens=2)), "prompt"),
        ((types.ModelInput.from_ints([1]), 1, "greedy"), "sampling_params"),
        ((types.ModelInput.from_ints([1]), True, types.SamplingParams(max_tokens=2)), None),
    ],
)
def test_14_embedded_sample_arguments_are_checked_like_the_sdk(
    embedded_service: tinker.ServiceClient, args: tuple[Any, ...], needle: str | None
) -> None:
    sc = embedded_service.create_sampling_client(base_model=MODEL).result()
    if needle is None:
        assert sc.sample(*args).result().sequences
    else:
        refused(lambda: sc.sample(*args).result(), needle)


# ---- 2. unicode digits in paging queries ----------------------------------------------------


@pytest.mark.parametrize("value", ["²", "٣", "10" * 15, "-1"])
def test_02_paging_query_with_unicode_digits_or_huge_numbers_is_a_400(
    wire: Wire, value: str
) -> None:
    for path in ("checkpoints", "training_runs"):
        for name in ("limit", "offset"):
            resp = wire.http.get(f"/api/v1/{path}", params={name: value})
            user_error(resp, "non-negative integer")


# ---- 3. user_metadata is typed as the SDK types it ------------------------------------------


@pytest.mark.filterwarnings("ignore:create_rest_client:FutureWarning")
def test_03_non_string_user_metadata_is_refused_and_listing_keeps_working(
    wire: Wire, session_id: str, service: tinker.ServiceClient
) -> None:
    body = {"session_id": session_id, "model_seq_id": 300, "base_model": MODEL}
    body |= {"lora_config": {"rank": 4}, "user_metadata": {"n": 1}}
    wire_refused(wire, wire.post("create_model", body), "user_metadata")
    user_error(wire.post("create_session", {"user_metadata": {"a": [1]}}), "user_metadata")
    assert wire.http.get("/api/v1/training_runs").status_code == 200
    tc = service.create_lora_training_client(MODEL, rank=4, seed=7).result()
    # from the future, as the SDK's, but before a sequence number is taken: no gap in the
    # model's numbers for the next call to wait on (the SDK's leaves one: ~5 s on a server)
    numbers = repr(tc._seq)  # itertools.count(next)
    refused(lambda: tc.save_state("m", user_metadata={"a": 1}).result(), "user_metadata")  # type: ignore[dict-item]
    assert repr(tc._seq) == numbers
    refused(
        lambda: service.create_lora_training_client(MODEL, rank=4, user_metadata={"n": 1}).result(),  # type: ignore[dict-item]
        "user_metadata",
    )
    rest = service.create_rest_client()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    assert rest.list_training_runs().result().training_runs


# ---- 7. checkpoint names -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a\x00b", "é" * 200, "a\\b", "..", "x" * 201])
def test_07_bad_checkpoint_names_are_user_errors_that_never_show_server_paths(
    service: tinker.ServiceClient, name: str, server: ServerProcess
) -> None:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=7).result()
    message = refused(lambda: tc.save_state(name).result(), "checkpoint name", "bytes")
    assert "/tmp" not in message and str(server.store) not in message
    assert tc.save_state("é" * 100).result().path.endswith("é" * 100)  # 200 bytes: fine


# ---- 16. no silently ignored parameters ---------------------------------------------------


def test_16_inflight_samplers_and_access_tokens_are_refused_on_every_path(
    service: tinker.ServiceClient, wire: Wire
) -> None:
    from tinker_sr.validation import INFLIGHT_UNSUPPORTED

    ACCESS_TOKEN_UNSUPPORTED = "load_weights: weights_access_token is not supported"

    tc = service.create_lora_training_client(MODEL, rank=4, seed=7).result()
    refused(lambda: tc.save_weights_and_get_sampling_client(kind="inflight"), INFLIGHT_UNSUPPORTED)
    path = tc.save_state("tok").result().path
    refused(lambda: tc.load_state(path, weights_access_token="t"), ACCESS_TOKEN_UNSUPPORTED)
    # Before: accepted and dropped by tinker_sr's client (the official SDK got the server's 400).
    for create in (
        service.create_training_client_from_state,
        service.create_training_client_from_state_with_optimizer,
    ):
        refused(lambda: create(path, weights_access_token="t").result(), ACCESS_TOKEN_UNSUPPORTED)  # noqa: B023
    model_id = wire.model(wire.session())
    body = {"model_id": model_id, "seq_id": 1, "kind": "inflight", "sampling_session_seq_id": 0}
    user_error(wire.post("save_weights_for_sampler", body), INFLIGHT_UNSUPPORTED)
    body = {"model_id": model_id, "seq_id": 2, "path": path, "optimizer": False}
    user_error(
        wire.post("load_weights", body | {"weights_access_token": "t"}), ACCESS_TOKEN_UNSUPPORTED
    )


def test_16_sampling_retry_config_is_honoured(tmp_path: Path) -> None:
    from tinker_sr.errors import APIConnectionError
    from tinker_sr.lib.retry_handler import RetryConfig
    from tinker_sr.testing.faults import Fault, FaultyBackend

    def flaky() -> Fault:
        return Fault("sample", error=APIConnectionError(httpx.Request("POST", "x")), times=2)

    inner = LocalBackend(tmp_path / "s")
    backend = FaultyBackend(inner, [flaky()])
    fast = RetryConfig(retry_delay_base=0.01, retry_delay_max=0.02)
    with tinker.ServiceClient(backend=backend) as service:  # type: ignore[arg-type]
        prompt, params = types.ModelInput.from_ints([1, 2]), types.SamplingParams(max_tokens=2)
        sc = service.create_sampling_client(base_model=MODEL, retry_config=fast).result()
        assert sc.sample(prompt, 1, params).result().sequences  # two failures retried
        backend.add(flaky())
        off = RetryConfig(enable_retry_logic=False)
        sc = service.create_sampling_client(base_model=MODEL, retry_config=off).result()
        with pytest.raises(APIConnectionError):
            sc.sample(prompt, 1, params).result()
    inner.close()


def test_16_session_tags_are_kept(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "s")
    import asyncio

    sid = asyncio.run(backend.create_session(tags=["exp-1", "exp-1", "b"]))
    assert backend.store.session_tags(sid) == ["exp-1", "b"]
    with pytest.raises(tinker.BadRequestError, match="tags must be"):  # a server's 400
        asyncio.run(backend.create_session(tags="abc"))
    # Free text is stored and listed with the session: bounded (20 MB names were kept).
    too_big: list[tuple[dict[str, Any], str]] = [
        ({"display_name": "x" * 1025}, "display_name is 1025 characters long, over the 1024"),
        ({"project_id": "p" * 5000}, "project_id is 5000 characters long"),
        ({"tags": ["t" * 2000]}, "tag 'tttt.* over the 1024"),
        ({"tags": [f"t{i}" for i in range(257)]}, "257 tags, over the 256"),
        ({"user_metadata": {"k": "v" * 70000}}, "user_metadata holds 70001 characters"),
        ({"display_name": 5}, "display_name must be a str"),
    ]
    for fields, message in too_big:
        with pytest.raises(tinker.BadRequestError, match=message):
            asyncio.run(backend.create_session(**fields))
    fine = {"display_name": "d" * 1024, "tags": ["t" * 1024] * 3, "user_metadata": {"k": "v"}}
    asyncio.run(backend.create_session(**fine))
    # the session copy_weights makes takes the same limit on its project_id
    from tinker_sr.user_errors import EngineUserError

    with pytest.raises(EngineUserError, match="destination_project_id is 5000 characters"):
        validation.check_copy_weights(
            session_id=None,
            model_seq_id=None,
            destination_project_id="p" * 5000,
            ttl_seconds=None,
            weights_access_token=None,
        )
    backend.close()


def test_13_fractional_float_target_tokens_are_refused_on_the_engine(
    service: tinker.ServiceClient,
) -> None:
    floats = types.TensorData.from_numpy(np.asarray([2.9, 3.9, 4.0, 5.0, 6.0], np.float32))
    bad = types.Datum(
        model_input=DATUM.model_input,
        loss_fn_inputs={"target_tokens": floats, "weights": [1.0] * 5},
    )
    assert_twin_unaffected(
        service,
        lambda tc: tc.forward_backward([bad], "cross_entropy").result(),
        "target_tokens",
        "whole number",
    )
    training = service.create_lora_training_client("tinker-sr/tiny", rank=4).result()
    with pytest.raises(tinker.RequestFailedError) as caught:
        training.forward_backward([bad], "cross_entropy").result()
    message = str(caught.value)  # the field once, and a fix for token ids (not "use float32")
    assert message.count("loss_fn_inputs['target_tokens']") == 1 and "as int64" in message


# ---- 17. provenance: trained in the context it was sampled in -------------------------------


def test_17_sampled_tokens_trained_after_another_sequences_prompt_are_refused() -> None:
    from tinker_sr.provenance.validate import DatumSpans, SequenceRecord, validate_provenance
    from tinker_sr.user_errors import EngineUserError

    def record(sid: str, prompt: list[int], sampled: list[int]) -> SequenceRecord:
        return SequenceRecord(
            sequence_id=sid, session_id="s", prompt_tokens=np.asarray(prompt, np.int32),
            sampled_tokens=np.asarray(sampled, np.int32),
            sampler_logprobs=np.zeros(len(sampled), np.float32),
            draws=np.zeros((len(sampled), 8), np.int32), created_at=0.0, last_used_at=0.0,
        )  # fmt: skip

    records = {"A": record("A", [1, 2, 3], [7, 8]), "B": record("B", [4, 5, 6], [9, 9])}

    class Lookup:
        def get(self, sid: str) -> SequenceRecord | None:
            return records.get(sid)

    P, S = types.PromptProvenanceSpan, types.SampledProvenanceSpan
    # B's prompt, then A's sampled tokens: each span is valid alone, the pair is not.
    datum = DatumSpans(
        input_tokens=np.asarray([4, 5, 6, 7], np.int64),
        target_tokens=np.asarray([0, 0, 7, 8], np.int64),
        advantages=np.asarray([0, 0, 1, 1], np.float32),
        model_input_spans=[P(sequence_id="B", length=3), S(sequence_id="A", length=1)],
        loss_fn_input_spans=[P(sequence_id="B", offset=1, length=2), S(sequence_id="A", length=2)],
    )
    for loss_fn in ("stable_reinforce", "importance_sampling"):
        with pytest.raises(EngineUserError, match="differs from the one it was sampled in"):
            validate_provenance([datum], session_id="s", lookup=Lookup(), loss_fn=loss_fn, now=1.0)
    # The same tokens after A's own prompt are fine.
    ok = DatumSpans(
        input_tokens=np.asarray([1, 2, 3, 7], np.int64),
        target_tokens=np.asarray([0, 0, 7, 8], np.int64),
        advantages=np.asarray([0, 0, 1, 1], np.float32),
        model_input_spans=[P(sequence_id="A", length=3), S(sequence_id="A", length=1)],
        loss_fn_input_spans=[P(sequence_id="A", offset=1, length=2), S(sequence_id="A", length=2)],
    )
    assert validate_provenance(
        [ok], session_id="s", lookup=Lookup(), loss_fn="stable_reinforce", now=1.0
    )


def test_ids_from_another_tokenizer_on_a_builtin_model_say_why(tmp_path: Path) -> None:
    """A cookbook recipe tokenizes with the real model's tokenizer; with that model's name
    aliased to a built-in (as the README once advised), every call failed with a bare
    "token id 657 is outside the vocabulary [0, 259)". The cause and the fixes are now said."""
    backend = LocalBackend(tmp_path / "s", model_aliases={"Qwen/Qwen3-8B": "tinker-sr/tiny"})
    service = tinker.ServiceClient(backend=backend)
    ids = [151644, 872, 198, 657]  # what Qwen3's tokenizer gives
    try:
        tc = service.create_lora_training_client("Qwen/Qwen3-8B", rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids), loss_fn_inputs={"target_tokens": ids}
        )
        with pytest.raises(tinker.RequestFailedError, match="259-id byte tokenizer") as e:
            tc.forward_backward([datum], "cross_entropy").result()
        assert "get_tokenizer()" in str(e.value) and "Hugging Face directory" in str(e.value)
        sc = service.create_sampling_client(base_model="Qwen/Qwen3-8B").result()
        params = types.SamplingParams(max_tokens=2)
        with pytest.raises(tinker.RequestFailedError, match="259-id byte tokenizer"):
            sc.sample(types.ModelInput.from_ints(ids), 1, params).result()
    finally:
        service.close().result()
        backend.close()
