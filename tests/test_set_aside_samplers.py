"""A LoRA sampling client made from a saved checkpoint that its session let go (it keeps its
most recently used ones, `registry.SAMPLERS_PER_SESSION`) is loaded again from the checkpoint
on its next use, as the hosted service's keeps working: a self-play league's old opponent.
Before, it failed with "unknown sampling session" (found by a hunt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.engine import env_settings

MODEL = "tinker-sr/tiny"
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8, 9, 10])


def _step(training: Any, i: int, t: Any = types) -> None:
    """One step on the training client; ``t``: the types of its SDK (tinker_sr's, or the
    official one's)."""
    datum = t.Datum(
        model_input=t.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9 + i], "weights": [1.0] * 4},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(t.AdamParams(learning_rate=1e-2)).result()


def _logprobs(sampler: Any, t: Any = types) -> list[float | None]:
    return list(sampler.compute_logprobs(t.ModelInput.from_ints(PROMPT.to_ints())).result())


def test_a_let_go_sampler_of_a_checkpoint_comes_back_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env_settings.SAMPLERS_PER_SESSION_ENV, "2")
    backend = LocalBackend(tmp_path / "store")
    try:
        service = tinker.ServiceClient(backend=backend)
        training = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
        opponents, before, paths = [], [], []
        for i in range(2):  # two league opponents, each from a checkpoint of its own
            _step(training, i)
            path = training.save_weights_for_sampler(f"opponent-{i}").result().path
            paths.append(path)
            opponents.append(service.create_sampling_client(model_path=path).result())
            before.append(_logprobs(opponents[-1]))
        for i in range(2, 5):  # newer samplers push both out of the session's two
            _step(training, i)
            training.save_weights_and_get_sampling_client().result()
        ids = [o.sampler_id for o in opponents]
        assert all(i in backend.models.set_aside for i in ids)  # let go
        session = service.create_rest_client().get_session(training.holder._session_id).result()
        assert set(ids) <= set(session.sampler_ids)  # still the session's
        assert _logprobs(opponents[0]) == before[0]  # read again: the same weights, bit for bit
        assert ids[0] not in backend.models.set_aside
        # a prompt too long for its context: refused before it is queued, as a live one's
        too_long = types.ModelInput.from_ints([5] * 100_000)
        with pytest.raises(tinker.BadRequestError, match="context window"):
            opponents[1].sample(too_long, 1, types.SamplingParams(max_tokens=1)).result()
        rest = service.create_rest_client()
        assert rest.get_sampler(ids[1]).result().model_path == paths[1]  # its record answers
        assert ids[1] in backend.models.set_aside  # (not loaded again, pushing another out)
        # a checkpoint deleted since: said, naming why, at each use
        rest.delete_checkpoint_from_tinker_path(paths[1]).result()
        refused = (tinker.NotFoundError, tinker.RequestFailedError)  # as an unknown sampler's
        for _ in range(2):
            with pytest.raises(refused, match="cannot be loaded again from its checkpoint"):
                _logprobs(opponents[1])
    finally:
        backend.close()


def test_a_let_go_sampler_is_not_brought_back_onto_a_changed_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its adapters were trained for the base as it was: a directory saved again since is
    refused, not sampled as if nothing had changed (review)."""
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    monkeypatch.setenv(env_settings.SAMPLERS_PER_SESSION_ENV, "1")
    model = make_tiny_hf_model_dir(tmp_path / "model", seed=0)
    backend = LocalBackend(tmp_path / "store")
    try:
        service = tinker.ServiceClient(backend=backend)
        training = service.create_lora_training_client(str(model), rank=4, seed=0).result()
        path = training.save_weights_for_sampler("opponent").result().path
        opponent = service.create_sampling_client(model_path=path).result()
        training.save_weights_and_get_sampling_client().result()  # the opponent let go
        assert opponent.sampler_id in backend.models.set_aside
        make_tiny_hf_model_dir(model, seed=1)
        refused = (tinker.NotFoundError, tinker.RequestFailedError)
        with pytest.raises(refused, match="base model's directory .* changed since"):
            _logprobs(opponent)
    finally:
        backend.close()


def test_the_official_sdk_uses_a_let_go_sampler_through_serve(tmp_path: Path) -> None:
    """The same through ``tinker-sr serve``, driven by the official SDK (tinker 0.38)."""
    official = pytest.importorskip("tinker")
    from tests._server import running_server

    env = {env_settings.SAMPLERS_PER_SESSION_ENV: "1"}
    with running_server(tmp_path / "store", env=env) as srv:
        service = official.ServiceClient(base_url=srv.base_url, api_key="tml-set-aside")
        try:
            training = service.create_lora_training_client(MODEL, rank=4, seed=0)
            _step(training, 0, official.types)
            path = training.save_weights_for_sampler("opponent").result().path
            opponent = service.create_sampling_client(model_path=path)
            before = _logprobs(opponent, official.types)
            _step(training, 1, official.types)
            newer = training.save_weights_and_get_sampling_client()
            _logprobs(newer, official.types)  # made on the server: the opponent let go
            assert _logprobs(opponent, official.types) == before  # read again from its checkpoint
            assert opponent.get_base_model() == MODEL
        finally:
            service.holder.close()


def test_a_let_go_sampler_is_read_back_while_other_samplers_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its checkpoint is read off the sampling thread and outside the registry's lock: a live
    sampler's request is answered while the read is held up (before: the read ran under the
    lock on the sampling thread, and every other decode waited for it); requests that want it
    at the same time share one read (a review: one read each, filling the thread pool)."""
    import threading

    monkeypatch.setenv(env_settings.SAMPLERS_PER_SESSION_ENV, "2")
    backend = LocalBackend(tmp_path / "store")
    release = threading.Event()
    try:
        service = tinker.ServiceClient(backend=backend)
        training = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
        _step(training, 0)
        path = training.save_weights_for_sampler("opponent").result().path
        opponent = service.create_sampling_client(model_path=path).result()
        before = _logprobs(opponent)
        for i in (1, 2):  # two newer samplers push it out of the session's two
            _step(training, i)
            live = training.save_weights_and_get_sampling_client().result()
        assert opponent.sampler_id in backend.models.set_aside
        entered, real_load, reads = threading.Event(), backend.checkpoints.load, []

        def held_load(*args: Any, **kwargs: Any) -> Any:
            reads.append(args)
            entered.set()
            release.wait(120)
            return real_load(*args, **kwargs)

        monkeypatch.setattr(backend.checkpoints, "load", held_load)
        pending = [opponent.compute_logprobs(PROMPT) for _ in range(4)]
        assert entered.wait(60)
        answered = live.sample(PROMPT, 1, types.SamplingParams(max_tokens=4)).result(timeout=60)
        assert not release.is_set() and len(answered.sequences[0].tokens) == 4
        release.set()
        for each in pending:  # then it is back, bit for bit
            assert list(each.result(timeout=60)) == before
        assert len(reads) == 1  # one read for the four requests that wanted it at once
    finally:
        release.set()
        backend.close()
