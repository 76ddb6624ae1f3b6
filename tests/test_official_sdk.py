"""The unmodified official ``tinker`` SDK 0.38 runs a full RL loop against our server."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests._server import ServerProcess, running_server
from tests._train import rl_datum_with_provenance

tinker = pytest.importorskip("tinker")
types = tinker.types

MODEL = "tinker-sr/tiny"
PROMPT = [10, 20, 30]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("store")) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)


def _ce_datum(tokens: list[int]) -> object:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _forward_logprobs(training_client: object, datum: object) -> list[float]:
    out = training_client.forward([datum], "cross_entropy").result()  # type: ignore[attr-defined]
    return list(out.loss_fn_outputs[0]["logprobs"].tolist())


def test_official_sdk_rl_loop(server: ServerProcess) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    assert training.get_info().model_id.endswith(":train:0")

    # Supervised step: forward_backward + optim_step, both submitted before waiting.
    datum = _ce_datum([1, 2, 3, 4, 5, 6])
    fb = training.forward_backward([datum], "cross_entropy")
    step = training.optim_step(types.AdamParams(learning_rate=1e-2))
    assert fb.result().metrics["loss:sum"] > 0
    assert len(fb.result().loss_fn_outputs[0]["logprobs"].tolist()) == 5
    step.result()

    # Sample with stability info recorded, then train on it with provenance spans.
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=7, stop=[])  # 4 tokens
    samples = sampler.sample(
        types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params
    ).result()
    assert len(samples.sequences) == 2
    seq = samples.sequences[0]
    assert seq.sequence_id and seq.sequence_id != samples.sequences[1].sequence_id
    assert len(seq.tokens) == 4 and seq.logprobs is not None and len(seq.logprobs) == 4

    rl_datum = rl_datum_with_provenance(types, PROMPT, seq)
    rl = training.forward_backward([rl_datum], "stable_reinforce", {"kl_coeff": 0.01}).result()
    assert "loss:sum" in rl.metrics
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    # A span naming a sequence that was never sampled is the caller's mistake.
    bogus = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT),
        loss_fn_inputs={
            "target_tokens": [20, 30, 40],
            "logprobs": [0.0] * 3,
            "advantages": [0.0] * 3,
        },
    ).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="nope", length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="nope", length=3)],
    )
    with pytest.raises(tinker.RequestFailedError) as failure:
        training.forward_backward([bogus], "stable_reinforce").result()
    assert failure.value.category == tinker.types.RequestErrorCategory.User

    # save_state -> a new training client from it computes exactly the same logprobs.
    state_path = training.save_state("st1").result().path
    assert state_path == f"tinker://{training.get_info().model_id}/weights/st1"
    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    assert resumed.get_info().model_id.endswith(":train:1")
    probe = _ce_datum([5, 6, 7, 8, 9])
    assert _forward_logprobs(resumed, probe) == _forward_logprobs(training, probe)

    # compute_logprobs: None at the first prompt position, numbers after it.
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints([1, 2, 3, 4])).result()
    assert logprobs[0] is None and all(isinstance(x, float) for x in logprobs[1:])

    # Named sampler weights -> a sampling client created from the path.
    sampler_path = training.save_weights_for_sampler("s1").result().path
    from_path = service.create_sampling_client(model_path=sampler_path).result()
    assert from_path.get_base_model() == MODEL
    out = from_path.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=3)
    ).result()
    assert len(out.sequences[0].tokens) <= 3

    # Checkpoint listing and run info through the RestClient.
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-test")
    run_id = training.get_info().model_id
    ids = {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert {"weights/st1", "sampler_weights/s1"} <= ids
    assert rest.get_training_run_by_tinker_path(state_path).result().training_run_id == run_id
    assert rest.get_weights_info_by_tinker_path(state_path).result().lora_rank == 4
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    ids = {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert "sampler_weights/s1" not in ids

    service.close("success").result()


def test_official_get_tokenizer_works_offline(server: ServerProcess) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    training = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    tokenizer = training.get_tokenizer()
    ids = tokenizer.encode("hi", add_special_tokens=False)
    assert ids == [ord("h"), ord("i")]
    assert tokenizer.decode(ids) == "hi"
    info = training.get_info()
    assert ":" not in (info.model_data.tokenizer_id or ":")
    service.close("success").result()


def test_official_sdk_lists_and_reads_its_sessions(server: ServerProcess) -> None:
    """The SDK's ``RestClient.list_sessions`` / ``get_session`` on our server; another key sees
    none of them (not even as "forbidden")."""
    service = tinker.ServiceClient(
        {"exp": "sdk"}, display_name="sdk-run", base_url=server.base_url, api_key="tml-test"
    )
    training = service.create_lora_training_client(base_model=MODEL, rank=2).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sid = training.model_id.split(":")[0]
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-test")
    assert rest.list_sessions(limit=1).result().sessions == [sid]
    info = rest.get_session(sid).result()
    assert info.training_run_ids == [training.model_id]
    assert info.sampler_ids == [sampler._sampling_session_id]  # the SDK keeps it private
    assert (info.user_metadata, info.display_name) == ({"exp": "sdk"}, "sdk-run")
    with pytest.raises(tinker.BadRequestError, match="access_scope must be"):
        rest.list_sessions(access_scope="everyone").result()  # type: ignore[arg-type]
    stranger = tinker.RestClient(base_url=server.base_url, api_key="tml-stranger")
    assert sid not in stranger.list_sessions(limit=1000).result().sessions
    with pytest.raises(tinker.NotFoundError, match="unknown session_id"):
        stranger.get_session(sid).result()
    service.close("success").result()


def test_official_sdk_sees_our_errors_as_its_exceptions(server: ServerProcess) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    with pytest.raises(tinker.RequestFailedError, match="rank must be >= 1") as bad_rank:
        service.create_lora_training_client(base_model=MODEL, rank=0).result()
    assert bad_rank.value.category == tinker.types.RequestErrorCategory.User
    with pytest.raises(tinker.NotFoundError):
        service.create_sampling_client(
            model_path="tinker://sess-x:train:0/sampler_weights/a"
        ).result()
    training = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    before = _forward_logprobs(training, _ce_datum([1, 2, 3, 4]))
    with pytest.raises(tinker.RequestFailedError):
        training.forward_backward([_ce_datum([1, 2, 3, 4])], "ppo").result()  # missing inputs
    assert np.allclose(_forward_logprobs(training, _ce_datum([1, 2, 3, 4])), before)
    service.close("success").result()
