"""Client behaviour a Tinker user relies on, on every backend (local and remote)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import pickle
import warnings
from typing import Any

import numpy as np
import pytest

import tinker_sr as tinker
from tinker_sr import types

MODEL = "tinker-sr/tiny"


def sft_datum(text: bytes) -> types.Datum:
    toks = list(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
    )


def params(seed: int = 0, n: int = 6) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=n, temperature=1.0, seed=seed, stop=[])


def test_create_training_client_result_await_and_info(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=1).result()
    assert isinstance(tc, tinker.TrainingClient)
    session = tc.model_id.split(":train:")[0]
    assert tc.model_id == f"{session}:train:0"
    info = tc.get_info()
    assert info.model_data.model_name == MODEL and info.lora_rank == 4

    async def main() -> tinker.TrainingClient:
        return await service.create_lora_training_client(MODEL, rank=4)

    tc2 = asyncio.run(main())
    assert tc2.model_id == f"{session}:train:1"


def test_forward_backward_then_optim_step_pipelined_in_order(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    data = [sft_datum(b"hello world"), sft_datum(b"abc")]
    first = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    futs = []
    for _ in range(3):
        futs.append(tc.forward_backward(data, "cross_entropy"))
        futs.append(tc.optim_step(types.AdamParams(learning_rate=1e-2)))
    outs = [f.result() for f in futs]
    losses = [o.metrics["loss:sum"] for o in outs[::2]]
    # Each forward_backward ran after the optim_step submitted before it.
    assert losses[0] == pytest.approx(first, rel=1e-5)
    assert losses[0] > losses[1] > losses[2]
    fb = outs[0]
    assert fb.loss_fn_output_type == "ArrayRecord"
    assert [o["logprobs"].shape for o in fb.loss_fn_outputs] == [[10], [2]]
    assert all(":" in k for k in fb.metrics)


def test_cross_entropy_without_weights_weighs_every_target_1(
    service: tinker.ServiceClient,
) -> None:
    """As the official SDK's own `forward` example sends it (spec/wire.md: only
    target_tokens). Before: "loss_fn_inputs is missing 'weights', which cross_entropy
    requires"."""
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    data = [sft_datum(b"hello world"), sft_datum(b"abc")]
    bare = [
        types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": t})
        for d in data
        for t in [d.loss_fn_inputs["target_tokens"]]
    ]
    ones = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={"target_tokens": t, "weights": np.ones(t.shape, np.float32)},
        )
        for d in data
        for t in [d.loss_fn_inputs["target_tokens"]]
    ]
    with_ones = tc.forward_backward(ones, "cross_entropy").result()
    without = tc.forward_backward(bare, "cross_entropy").result()
    assert without.metrics == with_ones.metrics
    for a, b in zip(without.loss_fn_outputs, with_ones.loss_fn_outputs, strict=True):
        assert a["logprobs"].tolist() == b["logprobs"].tolist()
    # The same gradients: two equal steps' worth accumulated, then one step of each twin.
    twin = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    for batch in (ones, ones):
        twin.forward_backward(batch, "cross_entropy").result()
    step = types.AdamParams(learning_rate=1e-2)
    assert tc.optim_step(step).result().metrics == twin.optim_step(step).result().metrics


def test_futures_semantics(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    fut = tc.forward([sft_datum(b"hello")], "cross_entropy")
    assert isinstance(fut, tinker.APIFuture)
    assert isinstance(fut.future(), concurrent.futures.Future)
    r1 = fut.result(timeout=60)
    assert fut.result() is r1  # cached

    async def main() -> None:
        f2 = tc.forward([sft_datum(b"hello")], "cross_entropy")
        got = await f2
        assert got.metrics["loss:sum"] == pytest.approx(r1.metrics["loss:sum"])
        f3 = tc.forward([sft_datum(b"hello")], "cross_entropy")
        a, b = await asyncio.gather(f3.coroutine(), f3.result_async())
        assert a is b

    asyncio.run(main())


def test_deprecated_async_variants_need_two_awaits(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()

    async def main() -> float:
        with pytest.warns(FutureWarning):
            future = await tc.forward_backward_async([sft_datum(b"hey")], "cross_entropy")
        return (await future.result_async()).metrics["loss:sum"]

    assert asyncio.run(main()) > 0


def test_a_deprecated_coroutine_warns_at_the_callers_line(service: tinker.ServiceClient) -> None:
    """Before, the warning was raised when the coroutine ran: in a gather (a task), it named
    asyncio's own file (concurrency hunt). The SDK's ``@deprecated`` warns at the call."""
    sampler = service.create_sampling_client(base_model=MODEL).result()
    assert asyncio.iscoroutinefunction(sampler.sample_async)

    async def main() -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prompt = types.ModelInput.from_ints([5, 6])
            await asyncio.gather(*[sampler.sample_async(prompt, 1, params(i)) for i in range(2)])
        return caught

    caught = [w for w in asyncio.run(main()) if "sample_async" in str(w.message)]
    assert [w.filename for w in caught] == [__file__, __file__]
    assert all(w.category is FutureWarning for w in caught)


def test_blocking_in_async_code_warns_naming_the_callers_line(
    service: tinker.ServiceClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A blocking ``.result()`` on a pending creation inside a coroutine stalls its event loop:
    the warning names the line that did it (the official SDK prints the whole stack)."""

    async def main() -> int:
        future = service.create_lora_training_client(MODEL, rank=4, seed=0)
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        future.result()
        return line

    with caplog.at_level("WARNING", logger="tinker_sr"):
        line = asyncio.run(main())
    assert f"{__file__}:{line} (main)" in caplog.text, caplog.text


def test_sampling_tokens_logprobs_ids_and_determinism(service: tinker.ServiceClient) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(list(b"Hello"))
    r = sc.sample(prompt, num_samples=4, sampling_params=params(seed=7)).result()
    assert len(r.sequences) == 4
    ids = [s.sequence_id for s in r.sequences]
    assert len(set(ids)) == 4 and all(ids)
    for s in r.sequences:
        assert len(s.tokens) == 6 and s.logprobs is not None and len(s.logprobs) == 6
        assert s.stop_reason == "length"
    # Samples within one request differ; the same seed reproduces them bit for bit.
    assert len({tuple(s.tokens) for s in r.sequences}) > 1
    again = sc.sample(prompt, num_samples=4, sampling_params=params(seed=7)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in r.sequences]
    assert [s.logprobs for s in again.sequences] == [s.logprobs for s in r.sequences]
    other = sc.sample(prompt, num_samples=4, sampling_params=params(seed=8)).result()
    assert [s.tokens for s in other.sequences] != [s.tokens for s in r.sequences]


def test_sampled_logprobs_match_compute_logprobs(service: tinker.ServiceClient) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    prompt = list(b"The cat")
    r = sc.sample(types.ModelInput.from_ints(prompt), 1, params(seed=3)).result()
    seq = r.sequences[0]
    lps = sc.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
    assert lps[0] is None and len(lps) == len(prompt) + len(seq.tokens)
    np.testing.assert_allclose(lps[len(prompt) :], seq.logprobs, atol=1e-4)


def test_stop_strings_tokens_and_eos(service: tinker.ServiceClient) -> None:
    sc = service.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(list(b"x"))
    greedy = sc.sample(
        prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
    ).result()
    first = greedy.sequences[0].tokens[0]
    stopped = sc.sample(
        prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0, stop=[first])
    ).result()
    assert stopped.sequences[0].tokens == [first] and stopped.sequences[0].stop_reason == "stop"


def test_checkpoint_round_trip_restores_weights_and_optimizer(
    service: tinker.ServiceClient,
) -> None:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    data = [sft_datum(b"round trip")]
    adam = types.AdamParams(learning_rate=1e-2)
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(adam).result()
    saved = tc.save_state("s1").result()
    assert saved.path == f"tinker://{tc.model_id}/weights/s1"
    sampler_path = tc.save_weights_for_sampler("w1").result().path
    assert sampler_path == f"tinker://{tc.model_id}/sampler_weights/w1"
    # Continue training the original for one step...
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(adam).result()
    after = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    # ...and the same step from the restored state gives exactly the same model.
    tc2 = service.create_training_client_from_state_with_optimizer(saved.path).result()
    tc2.forward_backward(data, "cross_entropy")
    tc2.optim_step(adam).result()
    assert tc2.forward(data, "cross_entropy").result().metrics["loss:sum"] == after
    # Without the optimizer the first step differs (fresh Adam moments).
    tc3 = service.create_training_client_from_state(saved.path).result()
    tc3.forward_backward(data, "cross_entropy")
    tc3.optim_step(adam).result()
    assert tc3.forward(data, "cross_entropy").result().metrics["loss:sum"] != after
    # Sampler weights load into a sampling client of the same session.
    sc = service.create_sampling_client(model_path=sampler_path).result()
    assert sc.get_base_model() == MODEL
    with pytest.warns(FutureWarning):
        rest = service.create_rest_client()
    cks = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.checkpoint_id for c in cks} == {"weights/s1", "sampler_weights/w1"}
    run = rest.get_training_run_by_tinker_path(saved.path).result()
    assert run.training_run_id == tc.model_id and run.base_model == MODEL
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    cks = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.checkpoint_id for c in cks] == ["weights/s1"]


def test_load_state_resets_the_optimizer_as_the_sdk_documents(
    service: tinker.ServiceClient,
) -> None:
    """The SDK's `load_state` loads "weights only, optimizer resets". Before, the client's
    Adam moments and step counts went on from the steps after the checkpoint (found by a
    hunt: the next step 0.45 relative off the one from create_training_client_from_state)."""
    adam = types.AdamParams(learning_rate=1e-2)
    data = [sft_datum(b"roll back")]

    def step(tc: Any, text: bytes) -> None:
        tc.forward_backward([sft_datum(text)], "cross_entropy")
        tc.optim_step(adam).result()

    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    step(tc, b"first")
    saved = tc.save_state("mid").result().path
    for text in (b"second", b"third"):
        step(tc, text)
    # Without the optimizer (the deprecated load_state) the moments start afresh, as in
    # create_training_client_from_state; with it they are the checkpoint's.
    for load, create in (
        (tc.load_state, service.create_training_client_from_state),
        (tc.load_state_with_optimizer, service.create_training_client_from_state_with_optimizer),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            load(saved).result()
        step(tc, b"next")
        other = create(saved).result()
        step(other, b"next")
        got = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert got == other.forward(data, "cross_entropy").result().metrics["loss:sum"]


def test_same_seeds_give_identical_training(service: tinker.ServiceClient) -> None:
    def run() -> list[float]:
        tc = service.create_lora_training_client(MODEL, rank=4, seed=123).result()
        data = [sft_datum(b"determinism"), sft_datum(b"bits")]
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2))
        out = tc.forward(data, "cross_entropy").result()
        sc = tc.save_weights_and_get_sampling_client().result()
        s = sc.sample(types.ModelInput.from_ints(list(b"ab")), 2, params(seed=5)).result()
        return [
            out.metrics["loss:sum"],
            *out.loss_fn_outputs[0]["logprobs"].tolist(),
            *(t for q in s.sequences for t in q.tokens),
        ]

    assert run() == run()


def test_datum_dataclasses_replace_and_pickled_sampling_client(
    service: tinker.ServiceClient,
) -> None:
    d = sft_datum(b"hello")
    d2 = dataclasses.replace(d, loss_fn_inputs={**d.loss_fn_inputs, "weights": [0.5] * 4})
    assert d2.loss_fn_inputs["weights"].dtype == "float32"
    sc = service.create_sampling_client(base_model=MODEL).result()
    clone = pickle.loads(pickle.dumps(sc))
    r = clone.sample(types.ModelInput.from_ints([1, 2]), 1, params()).result()
    assert r.sequences[0].sequence_id


def _sample_in_a_worker(sc: tinker.SamplingClient) -> list[int]:
    return list(
        sc.sample(types.ModelInput.from_ints([1, 2]), 1, params()).result().sequences[0].tokens
    )


def test_an_embedded_sampling_client_in_a_spawned_worker_fails_with_the_way_out(
    embedded_service: tinker.ServiceClient,
) -> None:
    """Unpickling raised in the worker, which killed it: the parent saw only BrokenProcessPool
    ("a process in the pool was terminated abruptly"). Now its use raises, and the message
    reaches future.result()."""
    import multiprocessing

    from tinker_sr.clients.sampling import _unpickle

    sc = embedded_service.create_sampling_client(base_model=MODEL).result()
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        with pytest.raises(RuntimeError, match="embedded engine .* run a server"):
            pool.submit(_sample_in_a_worker, sc).result(timeout=300)
    # Such a clone (here: state from "another process") still pickles, copies and prints.
    elsewhere = _unpickle({**sc._state(), "pid": -1})
    again = pickle.loads(pickle.dumps(elsewhere))
    assert repr(again) == repr(sc) and hasattr(again.holder, "key")
    with pytest.raises(RuntimeError, match="cannot be used in another process"):
        again.get_tokenizer()
    handle = sc.get_sampler_handle()
    embedded_service.close().result()
    with pytest.raises(RuntimeError, match="ServiceClient is closed"):
        tinker.SamplingClient.from_sampler_handle(handle)


# ---- bad input: typed errors, nothing changed -------------------------------------------------


def test_bad_requests_fail_with_typed_errors_and_change_nothing(
    service: tinker.ServiceClient,
) -> None:
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    data = [sft_datum(b"stable")]
    before = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]

    with pytest.raises(ValueError, match="No data provided"):
        tc.forward_backward([], "cross_entropy")
    bad = {
        "mismatched lengths": types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]},
        ),
        "vocabulary": types.Datum(
            model_input=types.ModelInput.from_ints([1, 99999]),
            loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]},
        ),
    }
    for what, datum in bad.items():
        with pytest.raises(tinker.RequestFailedError) as ei:
            tc.forward_backward([*data, datum], "cross_entropy").result()
        assert ei.value.category == types.RequestErrorCategory.User, what
        assert "datum 1" in str(ei.value), what
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn"):
        tc.forward_backward(data, "not_a_loss").result()  # type: ignore[arg-type]
    with pytest.raises(tinker.RequestFailedError, match="bogus.*not accepted"):
        tc.forward_backward(data, "cross_entropy", {"bogus": 1.0}).result()
    # A later optim_step must find no gradient from the rejected requests.
    tc.optim_step(types.AdamParams(learning_rate=1.0)).result()
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] == before

    sc = service.create_sampling_client(base_model=MODEL).result()
    with pytest.raises(tinker.BadRequestError, match="context window"):  # as the service
        sc.sample(
            types.ModelInput.from_ints([1] * 10), 1, types.SamplingParams(max_tokens=100000)
        ).result()
    with pytest.raises(tinker.RequestFailedError, match="vocabulary"):
        sc.sample(types.ModelInput.from_ints([100000]), 1, params()).result()


def test_unknown_model_and_missing_checkpoint_are_clear(service: tinker.ServiceClient) -> None:
    with pytest.raises(tinker.RequestFailedError, match="tinker-sr/tiny"):
        service.create_lora_training_client("no/such-model").result()
    with pytest.raises(tinker.BadRequestError, match="not a checkpoint path"):
        service.create_training_client_from_state("tinker://bad").result()
    with pytest.raises(tinker.NotFoundError, match="does not exist"):
        service.create_training_client_from_state("tinker://no-run/weights/x").result()
    tc = service.create_lora_training_client(MODEL, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="does not exist"):
        service.create_training_client_from_state(f"tinker://{tc.model_id}/weights/nope").result()
    with pytest.raises(AssertionError):
        service.create_lora_training_client(
            MODEL, train_mlp=False, train_attn=False, train_unembed=False
        )
    with pytest.raises(ValueError, match="Either model_path or base_model"):
        service.create_sampling_client()


def test_closed_service_client_refuses_work(service: tinker.ServiceClient) -> None:
    service.create_sampling_client(base_model=MODEL).result()
    service.close().result()
    assert service.close().result() is None  # idempotent
    with pytest.raises(RuntimeError, match="ServiceClient is closed"):
        service.create_lora_training_client(MODEL)


def test_training_requests_pending_at_close_fail_naming_the_closed_session(
    service: tinker.ServiceClient, backend_kind: str
) -> None:
    """Requests still waiting their turn when the session closes fail saying so (they used to
    fail as 'unknown model_id ...; create a training client first', for a model that existed)."""
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    batch = [sft_datum(b"pending when the session closes " * 4)] * 8
    futs = [tc.forward_backward(batch, "cross_entropy") for _ in range(12)]
    service.close().result()
    failures = []
    for f in futs:
        try:
            f.result()
        except (tinker.RequestFailedError, tinker.BadRequestError) as e:
            failures.append(str(e))
        except tinker.TinkerError as e:  # our remote client, like the SDK, stops polling
            assert backend_kind == "remote" and "RemoteBackend is closed" in str(e), e
    if backend_kind == "local":
        assert failures, "twelve queued steps all ran before the close"
    for text in failures:
        assert "belongs to finished session" in text and tc.model_id in text, text


def test_a_training_request_reaching_the_engine_after_its_session_closed_says_so(
    tmp_path: object,
) -> None:
    """The deterministic form of the race above: a request that reaches the engine only after
    its session closed (on a busy machine, one of the twelve) failed as "unknown model_id ...;
    create a training client first", for a model that existed. It now names the finished
    session, as requests already waiting do."""
    from tinker_sr.backend.local import LocalBackend

    async def run() -> str:
        backend = LocalBackend(str(tmp_path))
        try:
            session = await backend.create_session()
            model = await backend.create_model(
                session, 0, base_model=MODEL, lora_config=types.LoraConfig(rank=4, seed=0)
            )
            await backend.close_session(session, "success")
            with pytest.raises(tinker.RequestFailedError) as e:
                await backend.forward_backward(model, 1, [sft_datum(b"late")], "cross_entropy")
            assert model in str(e.value)
            return str(e.value)
        finally:
            await backend.aclose()

    assert "belongs to finished session" in asyncio.run(run())


def test_a_call_interrupted_before_it_was_queued_does_not_wedge_the_client(
    service: tinker.ServiceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in a notebook cell can land inside a training call after it took its place in
    the model's order but before its work was queued: every later call of the client then
    waited forever for it. Now the interrupted call gives its place up."""
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    real, interrupts = tc.holder.run, [1]

    def interrupted(coro: Any) -> Any:
        if interrupts:
            interrupts.pop()
            coro.close()
            raise KeyboardInterrupt
        return real(coro)

    monkeypatch.setattr(tc.holder, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tc.forward([sft_datum(b"interrupted")], "cross_entropy")
    out = tc.forward([sft_datum(b"next")], "cross_entropy").result(timeout=120)
    assert out.loss_fn_outputs


def test_forward_backward_custom_matches_the_builtin_loss(service: tinker.ServiceClient) -> None:
    import torch

    data = [sft_datum(b"custom loss"), sft_datum(b"xyz")]
    adam = types.AdamParams(learning_rate=1e-2)

    def nll(
        batch: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(
            -(lp * d.loss_fn_inputs["weights"].to_torch()).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        return loss, {"custom/n:sum": float(len(batch))}  # type: ignore[return-value]

    a = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    out = a.forward_backward_custom(data, nll).result()
    a.optim_step(adam)
    b = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    ref = b.forward_backward(data, "cross_entropy").result()
    b.optim_step(adam)
    assert out.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    assert out.metrics["custom/n:sum"] == 2.0 and "surrogate_loss:sum" in out.metrics
    la = a.forward(data, "cross_entropy").result().metrics["loss:sum"]
    lb = b.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert la == pytest.approx(lb, rel=1e-4)


def test_released_seq_ids_do_not_block_later_requests(tmp_path: object) -> None:
    from tinker_sr.backend.local import LocalBackend

    backend = LocalBackend(tmp_path)  # type: ignore[arg-type]

    async def main() -> float:
        sid = await backend.create_session()
        mid = await backend.create_model(
            sid, 0, base_model=MODEL, lora_config=types.LoraConfig(rank=2)
        )
        later = asyncio.ensure_future(
            backend.forward_backward(mid, 3, [sft_datum(b"abc")], "cross_entropy")
        )
        await backend.release_seq(mid, 2)
        await backend.release_seq(mid, 1)
        out = await asyncio.wait_for(later, 60)
        return out.metrics["loss:sum"]

    assert asyncio.run(main()) > 0
    backend.close()


def test_a_scripts_own_random_streams_are_left_alone(tmp_path, embedded_service) -> None:
    """A script that seeds torch, `random` and numpy for its own shuffles and draws gets the
    numbers it gets with the official SDK (which builds nothing locally): training, sampling
    and a real model directory's client draw nothing from the global generators."""
    import random

    import torch

    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    root = make_tiny_hf_model_dir(tmp_path / "model")

    def seeded() -> None:
        torch.manual_seed(0), random.seed(0), np.random.seed(0)

    seeded()
    want = (torch.rand(3).tolist(), random.random(), np.random.rand())
    seeded()
    for base in (MODEL, str(root)):
        tc = embedded_service.create_lora_training_client(base_model=base, rank=4)
        tc.forward_backward([sft_datum(b"hello")], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = tc.save_weights_and_get_sampling_client("rng")
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params()).result()
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == want
