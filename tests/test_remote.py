"""`RemoteBackend`: the Backend protocol against a real server (same results as running the
engine in-process), and its HTTP behaviour (retries, polling, error mapping) against a
scripted transport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests._server import ServerProcess
from tinker_sr import errors, types
from tinker_sr.backend.remote import RemoteBackend
from tinker_sr.provenance import build_datum
from tinker_sr.wire import compression, proto

MODEL = "tinker-sr/tiny"
LORA = types.LoraConfig(rank=4, seed=3)
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5, 6]),
    loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6, 7], "weights": [1.0] * 6},
)


@pytest.fixture(scope="module")
def server(remote_server: ServerProcess) -> ServerProcess:
    """The suite's server (tests/conftest.py): no start-up of the module's own."""
    return remote_server


async def _training_script(backend: Any) -> dict[str, Any]:
    """The same calls on any Backend; returns what a user would look at."""
    session = await backend.create_session(tags=["t"])
    model = await backend.create_model(session, 0, base_model=MODEL, lora_config=LORA)
    out: dict[str, Any] = {"model_id_suffix": model.removeprefix(session)}
    fb = await backend.forward_backward(model, 1, [DATUM], "cross_entropy")
    out["loss"] = fb.metrics["loss:sum"]
    out["logprobs"] = fb.loss_fn_outputs[0]["logprobs"].tolist()
    await backend.optim_step(model, 2, types.AdamParams(learning_rate=0.01))
    saved = await backend.save_weights_for_sampler(model, 3, sampling_session_seq_id=0)
    sampler = saved.sampling_session_id
    assert sampler
    sample = await backend.sample(
        sampler,
        0,
        prompt=types.ModelInput.from_ints([1, 2, 3]),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=5, seed=11),
        include_prompt_logprobs=True,
        record_stability_info=True,
    )
    out["samples"] = [s.tokens for s in sample.sequences]
    out["prompt_logprobs"] = sample.prompt_logprobs
    seq = sample.sequences[0]
    rl = build_datum([1, 2, 3], seq, 1.0)
    rl_out = await backend.forward_backward(model, 4, [rl], "stable_reinforce", {"kl_coeff": 0.01})
    out["rl_loss"] = rl_out.metrics["loss:sum"]
    state = await backend.save_state(model, 5, "st")
    resumed = await backend.create_model_from_state(
        session, 1, path=state.path, with_optimizer=True
    )
    again = await backend.forward_backward(resumed, 1, [DATUM], "cross_entropy", forward_only=True)
    now = await backend.forward_backward(model, 6, [DATUM], "cross_entropy", forward_only=True)
    out["resumed_matches"] = (
        again.loss_fn_outputs[0]["logprobs"].tolist() == now.loss_fn_outputs[0]["logprobs"].tolist()
    )
    out["checkpoints"] = sorted(
        c.checkpoint_id for c in (await backend.list_checkpoints(model)).checkpoints
    )
    info = await backend.get_info(model)
    out["info"] = (info.model_id.removeprefix(session), info.lora_rank, info.model_data.model_name)
    named = await backend.save_weights_for_sampler(model, 7, name="s1")
    assert named.path
    sampler2 = await backend.create_sampling_session(session, 1, model_path=named.path)
    out["sampler_base"] = await backend.get_sampler_base_model(sampler2)
    run = await backend.get_training_run(model)
    out["run"] = (run.base_model, run.is_lora, run.lora_rank)
    await backend.set_checkpoint_ttl(state.path, 7200)
    ckpt = await backend.get_checkpoint(state.path)
    out["ttl_set"] = ckpt.expires_at is not None
    await backend.delete_checkpoint(model, "sampler_weights/s1")
    out["after_delete"] = sorted(
        c.checkpoint_id for c in (await backend.list_checkpoints(model)).checkpoints
    )
    await backend.close_session(session, "success")
    return out


def test_remote_backend_gives_the_same_results_as_the_engine_in_process(
    server: ServerProcess, tmp_path: Path
) -> None:
    from tinker_sr.backend.local import LocalBackend

    async def remote() -> dict[str, Any]:
        backend = RemoteBackend(server.base_url, "tml-test")
        try:
            return await _training_script(backend)
        finally:
            await backend.aclose()

    async def local() -> dict[str, Any]:
        backend = LocalBackend(tmp_path / "local")
        try:
            return await _training_script(backend)
        finally:
            await backend.aclose()

    got, want = asyncio.run(remote()), asyncio.run(local())
    assert got["resumed_matches"] and want["resumed_matches"]
    assert got["checkpoints"] == ["sampler_weights/s1", "weights/st"] or got["checkpoints"] == [
        "weights/st"
    ]
    assert got["after_delete"] == ["weights/st"]
    assert got["ttl_set"]
    assert got["info"] == (":train:0", 4, MODEL)
    assert got["sampler_base"] == MODEL
    assert got["run"] == (MODEL, True, 4)
    assert got["samples"] == want["samples"]
    np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        [got["loss"], got["rl_loss"]], [want["loss"], want["rl_loss"]], rtol=1e-5
    )
    assert got["prompt_logprobs"][0] is None


def test_remote_errors_map_to_tinker_exceptions(server: ServerProcess) -> None:
    async def main() -> None:
        backend = RemoteBackend(server.base_url, "tml-test")
        session = await backend.create_session()
        with pytest.raises(errors.NotFoundError, match="unknown model_id"):
            await backend.get_info(f"{session}:train:9")
        model = await backend.create_model(session, 0, base_model=MODEL, lora_config=LORA)
        bad = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]),
            loss_fn_inputs={
                "target_tokens": [2, 3],
                "logprobs": [0.0, 0.0],
                "advantages": [1.0, 1.0],
            },
        ).with_provenance(
            model_input=[types.SampledProvenanceSpan(sequence_id="ghost", length=2)],
            loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="ghost", length=2)],
        )
        with pytest.raises(errors.RequestFailedError) as failure:
            await backend.forward_backward(model, 1, [bad], "stable_reinforce")
        assert failure.value.category == types.RequestErrorCategory.User
        assert failure.value.message.startswith("Request failed: ")
        # The failed request did not poison the model: the next seq_id runs.
        ok = await backend.forward_backward(model, 2, [DATUM], "cross_entropy")
        assert ok.metrics["loss:sum"] > 0
        with pytest.raises(errors.AuthenticationError):
            other = RemoteBackend(server.base_url, "tml-x", default_headers={"X-API-Key": ""})
            await other.get_server_capabilities()
        await backend.aclose()

    asyncio.run(main())


def test_tinker_sr_clients_run_over_the_remote_backend(server: ServerProcess) -> None:
    import tinker_sr

    service = tinker_sr.ServiceClient(base_url=server.base_url, api_key="tml-test")
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    fb = training.forward_backward([DATUM], "cross_entropy").result()
    assert fb.metrics["loss:sum"] > 0
    training.optim_step(types.AdamParams(learning_rate=0.01)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        types.ModelInput.from_ints([1, 2]), 2, types.SamplingParams(max_tokens=3)
    ).result()
    assert len(out.sequences) == 2 and all(s.sequence_id for s in out.sequences)
    service.close().result()


# ---- scripted transport -------------------------------------------------------------------------


Route = Callable[[httpx.Request], httpx.Response]


class Script:
    """A fake server: per path, a list of responses (the last one repeats)."""

    def __init__(self, routes: dict[str, list[Any]]) -> None:
        self.routes = routes
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path.removeprefix("/api/v1/")
        queue = self.routes.get(path)
        if queue is None:
            return httpx.Response(404, json={"detail": f"no route {path}"})
        item = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(item, Exception):
            raise item
        if callable(item):
            return item(request)
        status, body = item
        if isinstance(body, bytes):
            return httpx.Response(
                status, content=body, headers={"content-type": "application/x-protobuf"}
            )
        return httpx.Response(status, json=body)

    def sent(self, path: str) -> list[httpx.Request]:
        return [r for r in self.requests if r.url.path == f"/api/v1/{path}"]


BOOT = {"client/config": [(200, {})], "client/dynamic_config": [(404, {"detail": "no"})]}


def _backend(script: Script, **kw: Any) -> tuple[RemoteBackend, list[float]]:
    backend = RemoteBackend("http://fake", "tml-test", transport=httpx.MockTransport(script), **kw)
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    backend._sleep = sleep  # type: ignore[method-assign]
    return backend, sleeps


def _fb_result() -> bytes:
    return proto.encode_forward_backward_output(
        types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=[{"logprobs": types.TensorData(data=[-1.0] * 6, dtype="float32")}],
            metrics={"loss:sum": 6.0},
        )
    )


def test_submissions_are_retried_under_one_idempotency_key_and_polls_handle_every_status() -> None:
    script = Script(
        {
            **BOOT,
            "forward_backward": [
                (503, {"detail": "busy"}),
                httpx.ConnectError("reset"),
                (200, {"request_id": "r1"}),
            ],
            "retrieve_future": [
                (200, {"type": "try_again", "request_id": "r1"}),
                (408, {"queue_state": "active"}),
                (500, {"detail": "oops"}),
                (429, {"detail": "slow down"}),
                (200, _fb_result()),
            ],
        }
    )
    backend, sleeps = _backend(script)
    out = asyncio.run(backend.forward_backward("m", 1, [DATUM], "cross_entropy"))
    assert out.metrics == {"loss:sum": 6.0}
    posts = script.sent("forward_backward")
    assert len(posts) == 3
    assert len({r.headers["X-Idempotency-Key"] for r in posts}) == 1
    assert [r.headers["x-stainless-retry-count"] for r in posts] == ["0", "1", "2"]
    assert posts[0].headers["content-type"] == "application/x-protobuf"
    assert proto.decode_forward_backward_request(posts[0].content).seq_id == 1
    polls = script.sent("retrieve_future")
    assert [p.headers["X-Tinker-Request-Iteration"] for p in polls] == ["0", "1", "2", "3", "4"]
    assert all(p.headers["X-Tinker-Request-Type"] == "ForwardBackward" for p in polls)
    assert polls[0].headers["Accept"] == "application/x-protobuf"
    # Two submission backoffs (0.5 s then 1 s, minus up to 25 % jitter), a short one after
    # the polled 500 (50 ms) and one 429 backoff; the 408 and try_again re-poll at once.
    assert len(sleeps) == 4
    assert 0.375 <= sleeps[0] <= 0.5 and 0.75 <= sleeps[1] <= 1.0
    assert 0.0375 <= sleeps[2] <= 0.05 and sleeps[3] == 1.0


def test_polls_back_off_on_repeated_server_errors() -> None:
    # A failing server is re-polled with growing delays (50 ms doubling, capped at 2 s),
    # not thousands of times a second; the result still arrives when the server recovers.
    script = Script(
        {
            **BOOT,
            "forward_backward": [(200, {"request_id": "r1"})],
            "retrieve_future": [*[(503, {"detail": "down"})] * 8, (200, _fb_result())],
        }
    )
    backend, sleeps = _backend(script)
    out = asyncio.run(backend.forward_backward("m", 1, [DATUM], "cross_entropy"))
    assert out.metrics == {"loss:sum": 6.0}
    assert len(script.sent("retrieve_future")) == 9
    assert len(sleeps) == 8
    nominal = [min(0.05 * 2**i, 2.0) for i in range(8)]
    assert all(0.75 * n <= s <= n for s, n in zip(sleeps, nominal, strict=True))
    assert sleeps[-1] >= 1.5  # capped at 2 s minus jitter


def test_retry_after_is_obeyed_and_exhausted_retries_raise() -> None:
    script = Script({**BOOT, "get_info": [(429, {"detail": "later"})]})
    script.routes["get_info"] = [
        lambda r: httpx.Response(429, json={"detail": "later"}, headers={"retry-after": "2"}),
    ]
    backend, sleeps = _backend(script, max_retries=2)
    with pytest.raises(errors.RateLimitError, match="later"):
        asyncio.run(backend.get_info("m"))
    assert sleeps == [2.0, 2.0]
    assert len(script.sent("get_info")) == 3


def test_client_errors_are_not_retried_and_map_to_status_errors() -> None:
    for status, exc in [
        (400, errors.BadRequestError),
        (404, errors.NotFoundError),
        (422, errors.UnprocessableEntityError),
    ]:
        script = Script({**BOOT, "get_info": [(status, {"detail": "nope: model_id"})]})
        backend, _ = _backend(script)
        with pytest.raises(exc, match="nope: model_id") as info:
            asyncio.run(backend.get_info("m"))
        assert info.value.status_code == status
        assert len(script.sent("get_info")) == 1


def test_connection_failures_become_api_connection_errors() -> None:
    script = Script({**BOOT, "get_info": [httpx.ConnectError("refused")]})
    backend, sleeps = _backend(script, max_retries=3)
    with pytest.raises(errors.APIConnectionError):
        asyncio.run(backend.get_info("m"))
    assert len(sleeps) == 3


@pytest.mark.parametrize(
    ("category", "expected"),
    [("user", "user"), ("server", "server"), ("weird", "unknown"), (None, "unknown")],
)
def test_failed_futures_raise_request_failed_with_their_category(
    category: str | None, expected: str
) -> None:
    failure: dict[str, Any] = {"error": "bad datum 3"}
    if category is not None:
        failure["category"] = category
    script = Script(
        {**BOOT, "optim_step": [(200, {"request_id": "r"})], "retrieve_future": [(200, failure)]}
    )
    backend, _ = _backend(script)
    with pytest.raises(errors.RequestFailedError, match="Request failed: bad datum 3") as info:
        asyncio.run(backend.optim_step("m", 2, types.AdamParams()))
    assert info.value.category == expected
    assert info.value.request_id == "r"
    body = json.loads(script.sent("optim_step")[0].content)
    assert body == {
        "model_id": "m",
        "seq_id": 2,
        "adam_params": types.AdamParams().model_dump(),
        "type": "optim_step",
    }


def test_sample_needs_sequence_ids_in_the_promise_and_stamps_them() -> None:
    response = types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason="length", sequence_id="", _tokens_list=[4], _logprobs_list=[-0.5]
            )
        ]
    )
    script = Script(
        {
            **BOOT,
            "asample": [
                (200, {"request_id": "r"}),
                (200, {"request_id": "r", "sample_sequence_ids": ["s:0"]}),
            ],
            "retrieve_future": [(200, proto.encode_sample_response(response))],
        }
    )
    backend, _ = _backend(script)
    kwargs: dict[str, Any] = {
        "prompt": types.ModelInput.from_ints([1]),
        "num_samples": 1,
        "sampling_params": types.SamplingParams(max_tokens=1),
    }
    with pytest.raises(errors.APIResponseValidationError, match="sample_sequence_ids"):
        asyncio.run(backend.sample("s", 0, **kwargs))
    got = asyncio.run(backend.sample("s", 1, **kwargs))
    assert got.sequences[0].sequence_id == "s:0" and got.sequences[0].tokens == [4]
    sent = script.sent("asample")[-1]
    assert sent.headers["X-Tinker-Sampling-Backpressure"] == "1"
    assert json.loads(sent.content)["sampling_session_id"] == "s"


def test_forward_backward_is_zstd_compressed_when_the_server_asks() -> None:
    def accept(request: httpx.Request) -> httpx.Response:
        assert request.headers["content-encoding"] == "zstd"
        call = proto.decode_forward_backward_request(
            compression.zstd_decompress(request.content, 1 << 20)
        )
        return httpx.Response(200, json={"request_id": f"r{call.seq_id}"})

    script = Script(
        {
            "client/config": [(200, {"proto_compress_fwdbwd": True})],
            "client/dynamic_config": [(200, {})],
            "forward_backward": [accept],
            "retrieve_future": [(200, _fb_result())],
        }
    )
    backend, _ = _backend(script)
    asyncio.run(backend.forward_backward("m", 3, [DATUM], "cross_entropy"))
    assert backend.client_config == {"proto_compress_fwdbwd": True}


def test_keys_without_the_tml_prefix_are_refused_before_sending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(errors.TinkerError, match="tml-"):
        RemoteBackend("http://x", "sk-123")
    with pytest.raises(errors.TinkerError, match="needs an API key"):
        RemoteBackend("http://x", None)
