"""Checkpoint endpoints: publish/unpublish, weights info, copy_weights, TTL, external weights.

Client-level tests run on the embedded engine and on a real server (the ``service`` fixture);
wire-level tests check the server's answers to bad input and cross-key access; one test
drives the endpoints with the unmodified official SDK; one opens a store written before
``Checkpoint.public`` existed.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.engine.store import Store

MODEL = "tinker-sr/tiny"
PROBE = types.Datum(
    model_input=types.ModelInput.from_ints([3, 1, 4, 1, 5, 9]),
    loss_fn_inputs={"target_tokens": [1, 4, 1, 5, 9, 2], "weights": [1.0] * 6},
)
PROMPT = types.ModelInput.from_ints([7, 8, 9])
# Errors of a plain call: RequestFailedError on the embedded engine, the HTTP status error
# from a server.
NOT_FOUND = (tinker.RequestFailedError, tinker.NotFoundError)
BAD_INPUT = (tinker.RequestFailedError, tinker.BadRequestError)


def _rest(service: Any) -> tinker.RestClient:
    return tinker.RestClient(service.holder)


def _trained(service: Any, **lora: Any) -> Any:
    """A training client whose adapters are no longer at their (zero-effect) init."""
    tc = service.create_lora_training_client(MODEL, **{"rank": 2, "seed": 5, **lora}).result()
    tc.forward_backward([PROBE], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return tc


def _logprobs(tc: Any) -> list[float]:
    out = tc.forward([PROBE], "cross_entropy").result()
    return list(out.loss_fn_outputs[0]["logprobs"].tolist())


def _checkpoint(rest: tinker.RestClient, path: str) -> types.Checkpoint:
    run = types.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id
    [found] = [c for c in rest.list_checkpoints(run).result().checkpoints if c.tinker_path == path]
    return found


# ---- publish / unpublish --------------------------------------------------------------------


def test_publish_and_unpublish_set_the_public_flag(service: Any) -> None:
    tc = service.create_lora_training_client(MODEL, rank=2).result()
    state = tc.save_state("pub").result().path
    sampler = tc.save_weights_for_sampler("pub-s").result().path
    rest = _rest(service)
    assert _checkpoint(rest, state).public is False

    rest.publish_checkpoint_from_tinker_path(state).result()
    assert _checkpoint(rest, state).public is True
    assert rest.get_checkpoint_by_tinker_path(state).result().public is True
    assert _checkpoint(rest, sampler).public is False  # only the one named
    mine = {
        c.tinker_path: c.public for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
    }
    assert mine[state] is True and mine[sampler] is False
    rest.publish_checkpoint_from_tinker_path(state).result()  # already public: a no-op
    assert _checkpoint(rest, state).public is True

    rest.unpublish_checkpoint_from_tinker_path(state).result()
    assert _checkpoint(rest, state).public is False
    rest.unpublish_checkpoint_from_tinker_path(state).result()  # already private: a no-op

    # The deprecated coroutine twins work too (and say they are deprecated).
    with pytest.warns(FutureWarning, match="publish_checkpoint_from_tinker_path_async"):
        asyncio.run(rest.publish_checkpoint_from_tinker_path_async(sampler))
    assert _checkpoint(rest, sampler).public is True
    with pytest.warns(FutureWarning, match="unpublish_checkpoint_from_tinker_path_async"):
        asyncio.run(rest.unpublish_checkpoint_from_tinker_path_async(sampler))
    assert _checkpoint(rest, sampler).public is False


def test_publish_bad_input(service: Any) -> None:
    tc = service.create_lora_training_client(MODEL, rank=2).result()
    rest = _rest(service)
    with pytest.raises(ValueError, match="Invalid tinker path"):
        rest.publish_checkpoint_from_tinker_path("tinker://no-segments")
    with pytest.raises(ValueError, match="Invalid tinker path"):
        rest.unpublish_checkpoint_from_tinker_path("s3://bucket/weights/x")
    with pytest.raises(NOT_FOUND, match="does not exist"):
        rest.publish_checkpoint_from_tinker_path(f"tinker://{tc.model_id}/weights/nope").result()


# ---- weights info ---------------------------------------------------------------------------


def test_weights_info_reports_base_model_and_lora_config(service: Any) -> None:
    tc = service.create_lora_training_client(MODEL, rank=3, train_mlp=False).result()
    rest = _rest(service)
    for path in (
        tc.save_state("info").result().path,
        tc.save_weights_for_sampler("info-s").result().path,
    ):
        info = rest.get_weights_info_by_tinker_path(path).result()
        assert isinstance(info, types.WeightsInfoResponse)
        assert info.base_model == MODEL and info.is_lora is True and info.lora_rank == 3
        assert (info.train_mlp, info.train_attn, info.train_unembed) == (False, True, True)
        assert info.optimizer_config == types.AdamOptimizerConfig()
    with pytest.raises(NOT_FOUND, match="does not exist"):
        rest.get_weights_info_by_tinker_path(f"tinker://{tc.model_id}/weights/nope").result()
    with pytest.raises(tinker.BadRequestError, match="(Invalid tinker|not a checkpoint) path"):
        rest.get_weights_info_by_tinker_path(f"tinker://{tc.model_id}/checkpoints/x").result()


# ---- copy_weights ---------------------------------------------------------------------------


def test_copied_checkpoints_load_like_the_originals(service: Any) -> None:
    tc = _trained(service)
    state = tc.save_state("orig", user_metadata={"step": "1"}).result().path
    weights = tc.save_weights_for_sampler("orig-s").result().path
    expected = _logprobs(tc)
    rest = _rest(service)

    state_copy = service.copy_weights(state).result()
    weights_copy = service.copy_weights(weights, ttl_seconds=7200).result()
    session_id = tc.model_id.split(":train:")[0]
    for src, dst in ((state, state_copy), (weights, weights_copy)):
        a = types.ParsedCheckpointTinkerPath.from_tinker_path(src)
        b = types.ParsedCheckpointTinkerPath.from_tinker_path(dst)
        # A new training run of this session, same kind and name.
        assert b.training_run_id.startswith(f"{session_id}:train:")
        assert b.training_run_id != a.training_run_id
        assert (b.checkpoint_type, b.checkpoint_id) == (a.checkpoint_type, a.checkpoint_id)

    # The copies: private, the source's metadata, their own expiry.
    copied = _checkpoint(rest, state_copy)
    assert copied.public is False and copied.user_metadata == {"step": "1"}
    assert copied.expires_at is None
    copied_weights = _checkpoint(rest, weights_copy)
    assert copied_weights.expires_at is not None
    assert copied_weights.expires_at > copied_weights.time
    run = rest.get_training_run_by_tinker_path(state_copy).result()
    assert run.base_model == MODEL and run.lora_rank == 2
    assert rest.get_weights_info_by_tinker_path(weights_copy).result().lora_rank == 2

    # A training client from the copied state computes what the original does ...
    assert _logprobs(service.create_training_client_from_state(state_copy).result()) == expected
    resumed = service.create_training_client_from_state_with_optimizer(state_copy).result()
    assert _logprobs(resumed) == expected
    # ... and a sampler on the copied weights samples what one on the source does.
    params = types.SamplingParams(max_tokens=5, seed=17, temperature=1.0)
    samplers = [
        service.create_sampling_client(model_path=p).result() for p in (weights, weights_copy)
    ]
    outs = [s.sample(PROMPT, 2, params).result() for s in samplers]
    assert [q.tokens for q in outs[0].sequences] == [q.tokens for q in outs[1].sequences]
    assert (
        samplers[0].compute_logprobs(PROMPT).result()
        == samplers[1].compute_logprobs(PROMPT).result()
    )
    assert samplers[1].get_base_model() == MODEL

    # The copy survives deleting its source, and can itself be copied.
    rest.delete_checkpoint_from_tinker_path(state).result()
    again = service.copy_weights(state_copy).result()
    assert _logprobs(service.create_training_client_from_state(again).result()) == expected

    # RestClient.copy_weights: into a new session owned by the same key.
    elsewhere = rest.copy_weights(weights, "proj-archive").result()
    other = types.ParsedCheckpointTinkerPath.from_tinker_path(elsewhere)
    assert other.training_run_id.endswith(":train:0")
    assert not other.training_run_id.startswith(session_id)
    assert other.checkpoint_id == "sampler_weights/orig-s"
    sampler = service.create_sampling_client(model_path=elsewhere).result()
    assert [q.tokens for q in sampler.sample(PROMPT, 2, params).result().sequences] == [
        q.tokens for q in outs[0].sequences
    ]
    with pytest.warns(FutureWarning, match="copy_weights_async"):
        via_async = asyncio.run(rest.copy_weights_async(state_copy, ttl_seconds=3600))
    assert _checkpoint(rest, via_async).expires_at is not None
    paths = {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    assert {state_copy, weights_copy, again, elsewhere, via_async} <= paths


def test_copied_run_numbers_share_the_training_client_sequence(service: Any) -> None:
    tc = service.create_lora_training_client(MODEL, rank=2).result()  # run 0
    copy = service.copy_weights(tc.save_state("n").result().path).result()  # run 1
    later = service.create_lora_training_client(MODEL, rank=2).result()  # run 2
    run = types.ParsedCheckpointTinkerPath.from_tinker_path(copy).training_run_id
    assert [run.rsplit(":", 1)[1], later.model_id.rsplit(":", 1)[1]] == ["1", "2"]


def test_copy_weights_bad_input(service: Any) -> None:
    tc = service.create_lora_training_client(MODEL, rank=2).result()
    state = tc.save_state("bad").result().path
    rest = _rest(service)
    for ttl in (10, 3599, 10 * 365 * 24 * 3600 + 1):
        with pytest.raises(BAD_INPUT, match="ttl_seconds must be between 3600"):
            service.copy_weights(state, ttl_seconds=ttl).result()
        with pytest.raises(BAD_INPUT, match="ttl_seconds must be between 3600"):
            rest.copy_weights(state, ttl_seconds=ttl).result()
    with pytest.raises(NOT_FOUND, match="does not exist"):
        service.copy_weights(f"tinker://{tc.model_id}/weights/missing").result()
    pending = service.copy_weights("tinker://x/weights")  # as the SDK: a future that fails
    with pytest.raises(tinker.BadRequestError, match="(Invalid tinker|not a checkpoint) path"):
        pending.result()
    with pytest.raises(tinker.BadRequestError, match="(Invalid tinker|not a checkpoint) path"):
        rest.copy_weights("weights/x", destination_project_id="p").result()  # as the SDK: late
    with pytest.raises(BAD_INPUT, match="weights_access_token is not supported"):
        service.copy_weights(state, weights_access_token="secret").result()
    # Nothing was copied by the failed calls.
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [
        state
    ]


# ---- TTL and the deprecated RestClient twins ------------------------------------------------


def test_checkpoint_ttl_and_rest_coroutine_twins(service: Any) -> None:
    tc = service.create_lora_training_client(MODEL, rank=2).result()
    state = tc.save_state("ttl").result().path
    rest = _rest(service)
    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    assert _checkpoint(rest, state).expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    assert _checkpoint(rest, state).expires_at is None
    for ttl in (0, 3599, 10 * 365 * 24 * 3600 + 1):
        with pytest.raises(BAD_INPUT, match="ttl_seconds must be between 3600"):
            rest.set_checkpoint_ttl_from_tinker_path(state, ttl).result()

    async def twins() -> None:
        await rest.set_checkpoint_ttl_from_tinker_path_async(state, 7200)
        run = await rest.get_training_run_async(tc.model_id)
        assert run.training_run_id == tc.model_id
        runs = await rest.list_training_runs_async(limit=1000)
        assert tc.model_id in {r.training_run_id for r in runs.training_runs}
        listing = await rest.list_user_checkpoints_async(limit=1000)
        assert state in {c.tinker_path for c in listing.checkpoints}
        await rest.delete_checkpoint_async(tc.model_id, "weights/ttl")

    with pytest.warns(FutureWarning) as warned:
        asyncio.run(twins())
    names = " ".join(str(w.message) for w in warned)
    for name in (
        "set_checkpoint_ttl_from_tinker_path_async",
        "get_training_run_async",
        "list_training_runs_async",
        "list_user_checkpoints_async",
        "delete_checkpoint_async",
    ):
        assert name in names
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


class _Clock:
    """``time`` for the store modules, ``ahead`` seconds in the future (both clocks: time
    that passed)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def time(self) -> float:
        return time.time() + self.ahead

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_expired_checkpoints_are_deleted_files_and_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TTL bounds what a run keeps on disk. Expired checkpoints were only hidden (not listed,
    not loadable) while their files and rows stayed for ever, and with them hidden nobody
    could delete them. Now they are deleted when the store opens and before later saves; a
    new checkpoint may take an expired one's name, and its file is not the one removed."""
    from tinker_sr.engine import checkpoint_store, store

    clock = _Clock()
    monkeypatch.setattr(store, "time", clock)
    monkeypatch.setattr(checkpoint_store, "time", clock)
    backend = LocalBackend(tmp_path / "store")
    service = tinker.ServiceClient(backend=backend)
    tc = service.create_lora_training_client(MODEL, rank=2, seed=0).result()
    kept = tc.save_state("kept").result().path
    short = tc.save_state("short", ttl_seconds=3600).result().path
    sampler = tc.save_weights_for_sampler("s", ttl_seconds=3600).result().path
    files = {
        p: backend.checkpoints.path_of(backend.checkpoints.live(p)) for p in (kept, short, sampler)
    }
    assert all(f.is_file() for f in files.values())

    clock.ahead = 3601.0  # an hour later, in the same process: the next save purges
    assert tc.save_state("short").result().path == short  # the expired name, reused
    assert not files[sampler].exists()
    assert files[short].is_file() and files[kept].is_file()  # the new "short"
    listed = {
        c.tinker_path for c in _rest(service).list_checkpoints(tc.model_id).result().checkpoints
    }
    assert listed == {kept, short}
    tc.save_weights_for_sampler("s2", ttl_seconds=3600).result()
    service.close().result()
    backend.close()

    clock.ahead = 2 * 3601.0  # the process is gone; the store opens again later
    backend = LocalBackend(tmp_path / "store")
    try:
        rows = backend.store.list_checkpoints(None)[0]
        assert {r.tinker_path for r in rows} == {kept, short}  # s2 expired: row and file gone
        on_disk = sorted(
            p.name for p in (tmp_path / "store" / "checkpoints").rglob("*.safetensors")
        )
        assert on_disk == ["kept.safetensors", "short.safetensors"]
    finally:
        backend.close()


def test_external_weights_urls_of_a_missing_export(service: Any) -> None:
    tc = service.create_lora_training_client(MODEL, rank=2).result()
    rest = _rest(service)
    path = f"tinker://{tc.model_id}/external_weights/hf"
    with pytest.raises(NOT_FOUND, match="does not exist"):
        rest.get_external_weights_urls(path).result()
    with pytest.raises(ValueError, match="only accepts external weights"):
        rest.get_external_weights_urls(f"tinker://{tc.model_id}/sampler_weights/x")


# ---- the wire: bad input, ownership, public checkpoints ------------------------------------


class _Key:
    """Raw HTTP under one API key."""

    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(
            base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=60
        )

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kw)


def _detail(resp: httpx.Response) -> str:
    return str(resp.json()["detail"])


@pytest.fixture
def owned(remote_server: Any) -> dict[str, Any]:
    """A checkpoint pair saved by key ``tml-owner`` (through our client)."""
    service = tinker.ServiceClient(base_url=remote_server.base_url, api_key="tml-owner")
    tc = service.create_lora_training_client(MODEL, rank=2).result()
    out = {
        "service": service,
        "model_id": tc.model_id,
        "session_id": tc.model_id.split(":train:")[0],
        "state": tc.save_state(f"w-{uuid.uuid4().hex[:6]}").result().path,
        "weights": tc.save_weights_for_sampler(f"s-{uuid.uuid4().hex[:6]}").result().path,
    }
    yield out
    service.close().result()


def test_server_copy_weights_bad_input(remote_server: Any, owned: dict[str, Any]) -> None:
    me = _Key(remote_server.base_url, "tml-owner")
    src = owned["state"]
    cases = [
        ({"source_path": src, "overwrite": True}, "unknown field 'overwrite'"),
        ({}, "missing required field 'source_path'"),
        ({"source_path": 5}, "field 'source_path'"),
        ({"source_path": "tinker://x"}, "source_path 'tinker://x' is not a checkpoint path"),
        ({"source_path": src, "session_id": owned["session_id"]}, "together"),
        ({"source_path": src, "model_seq_id": 3}, "together"),
        (
            {
                "source_path": src,
                "session_id": owned["session_id"],
                "model_seq_id": 90,
                "destination_project_id": "p",
            },
            "not both",
        ),
        (
            {"source_path": src, "session_id": owned["session_id"], "model_seq_id": -1},
            "model_seq_id must be >= 0",
        ),
        ({"source_path": src, "ttl_seconds": 60}, "ttl_seconds must be between 3600"),
        ({"source_path": src, "weights_access_token": "t"}, "weights_access_token"),
        ({"source_path": src.replace("weights/", "external_weights/")}, "external_weights"),
    ]
    for body, message in cases:
        resp = me.post("/copy_weights", body)
        assert resp.status_code == 400 and message in _detail(resp), (body, resp.text)
    resp = me.post(
        "/copy_weights", {"source_path": src}, headers={"X-Tinker-Weights-Access-Token": "t"}
    )
    assert resp.status_code == 400 and "weights_access_token" in _detail(resp)
    resp = me.post("/copy_weights", content=b"{not json")
    assert resp.status_code == 400 and "not valid JSON" in _detail(resp)
    # Into a slot of a session this key does not have, or one already taken.
    resp = me.post("/copy_weights", {"source_path": src, "session_id": "nope", "model_seq_id": 1})
    assert resp.status_code == 404 and "unknown session_id" in _detail(resp)
    taken = {"source_path": src, "session_id": owned["session_id"], "model_seq_id": 0}
    resp = me.post("/copy_weights", taken)
    assert resp.status_code == 400 and "already used" in _detail(resp)
    resp = me.post("/copy_weights", {"source_path": owned["state"].replace("/w-", "/gone-")})
    assert resp.status_code == 404 and "does not exist" in _detail(resp)


def test_server_copy_weights_is_idempotent_per_key(
    remote_server: Any, owned: dict[str, Any]
) -> None:
    me = _Key(remote_server.base_url, "tml-owner")
    body = {"source_path": owned["weights"], "destination_project_id": "p1"}
    headers = {"X-Idempotency-Key": f"k-{uuid.uuid4()}"}
    first = me.post("/copy_weights", body, headers=headers)
    again = me.post("/copy_weights", body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json()
    assert set(first.json()) == {"tinker_path"}
    fresh = me.post("/copy_weights", body, headers={"X-Idempotency-Key": f"k-{uuid.uuid4()}"})
    assert fresh.json()["tinker_path"] != first.json()["tinker_path"]


def test_server_publish_and_external_urls_bad_input(
    remote_server: Any, owned: dict[str, Any]
) -> None:
    me = _Key(remote_server.base_url, "tml-owner")
    someone = _Key(remote_server.base_url, "tml-someone-else")
    run, name = owned["model_id"], owned["state"].rsplit("/", 1)[1]
    publish = f"/training_runs/{run}/checkpoints/weights/{name}/publish"
    resp = me.http.post(f"/training_runs/{run}/checkpoints/bogus/{name}/publish")
    assert resp.status_code == 404 and "unknown checkpoint kind 'bogus'" in _detail(resp)
    resp = me.http.post(f"/training_runs/{run}/checkpoints/weights/missing/publish")
    assert resp.status_code == 404 and "does not exist" in _detail(resp)
    resp = someone.http.post(publish)  # not theirs: the same 404 as a missing run
    assert resp.status_code == 404 and "unknown training run" in _detail(resp)
    assert me.http.post(publish).status_code == 204
    resp = someone.http.delete(publish)  # nor may they unpublish it
    assert resp.status_code == 404
    assert me.http.delete(publish).status_code == 204

    urls = f"/training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls"
    resp = me.http.get(urls)
    assert resp.status_code == 404 and "does not exist" in _detail(resp)
    resp = me.http.get(urls.replace("external_weights/", "weights/", 1))
    assert resp.status_code == 400 and "only for external_weights" in _detail(resp)
    assert someone.http.get(urls).status_code == 404

    resp = me.post("/weights_info", {"tinker_path": "nope"})
    assert resp.status_code == 400 and "tinker_path 'nope' is not a checkpoint path" in _detail(
        resp
    )
    resp = me.post("/weights_info", {"path": owned["state"]})
    assert resp.status_code == 400 and "unknown field 'path'" in _detail(resp)


def test_published_checkpoints_are_readable_by_other_keys(
    remote_server: Any, owned: dict[str, Any]
) -> None:
    someone = _Key(remote_server.base_url, "tml-reader")
    state, weights = owned["state"], owned["weights"]
    rest = tinker.RestClient(owned["service"].holder)

    def reads() -> list[int]:
        return [
            someone.post("/weights_info", {"tinker_path": state}).status_code,
            someone.post("/copy_weights", {"source_path": weights}).status_code,
        ]

    assert reads() == [404, 404]  # private: indistinguishable from missing
    rest.publish_checkpoint_from_tinker_path(state).result()
    rest.publish_checkpoint_from_tinker_path(weights).result()
    assert reads() == [200, 200]
    reader = tinker.ServiceClient(base_url=remote_server.base_url, api_key="tml-reader")
    try:
        tc = reader.create_training_client_from_state(state).result()
        assert tc.get_info().lora_rank == 2
        sampler = reader.create_sampling_client(model_path=weights).result()
        assert (
            len(sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=2)).result().sequences)
            == 1
        )
        # Reading is all: the owner's listings, deletion and flags stay theirs.
        reader_rest = tinker.RestClient(reader.holder)
        with pytest.raises(tinker.NotFoundError):
            reader_rest.list_checkpoints(owned["model_id"]).result()
        with pytest.raises(tinker.NotFoundError):
            reader_rest.delete_checkpoint_from_tinker_path(state).result()
        with pytest.raises(tinker.NotFoundError):
            reader_rest.unpublish_checkpoint_from_tinker_path(state).result()
        rest.unpublish_checkpoint_from_tinker_path(state).result()
        with pytest.raises(tinker.NotFoundError):
            reader.create_training_client_from_state(state).result()
    finally:
        reader.close().result()


# ---- the official SDK against our server ----------------------------------------------------


def test_official_sdk_checkpoint_endpoints(
    remote_server: Any, owned: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sdk = pytest.importorskip("tinker")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.delenv("TINKER_PROJECT_ID", raising=False)
    rest = sdk.RestClient(base_url=remote_server.base_url, api_key="tml-owner")
    state, weights = owned["state"], owned["weights"]
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.lora_rank, info.train_mlp) == (MODEL, 2, True)
    rest.publish_checkpoint_from_tinker_path(weights).result()
    listing = rest.list_checkpoints(owned["model_id"]).result().checkpoints
    assert {c.tinker_path: c.public for c in listing} == {state: False, weights: True}
    rest.unpublish_checkpoint_from_tinker_path(weights).result()
    copy = rest.copy_weights(state, "proj-sdk", ttl_seconds=3600).result()
    assert sdk.types.ParsedCheckpointTinkerPath.from_tinker_path(copy).checkpoint_id.startswith(
        "weights/"
    )
    service = sdk.ServiceClient(
        base_url=remote_server.base_url, api_key="tml-owner", project_id="proj-sdk"
    )
    try:
        copy2 = service.copy_weights(weights).result()
        sampler = service.create_sampling_client(model_path=copy2).result()
        assert sampler.get_base_model() == MODEL
        tc = service.create_training_client_from_state(copy).result()
        assert tc.get_info().lora_rank == 2
    finally:
        service.close("success").result()
    with pytest.raises(sdk.BadRequestError, match="ttl_seconds"):
        rest.copy_weights(state, "proj-sdk", ttl_seconds=5).result()


# ---- a store written before Checkpoint.public existed -----------------------------------------

_OLD_CHECKPOINTS_TABLE = """
CREATE TABLE checkpoints (
    run_id TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    checkpoint_type TEXT NOT NULL,
    tinker_path TEXT NOT NULL UNIQUE,
    file_path TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_bytes INTEGER,
    user_metadata TEXT,
    expires_at REAL,
    PRIMARY KEY (run_id, checkpoint_id)
);
"""


def test_stores_without_the_public_column_still_open(tmp_path: Path) -> None:
    store_dir = tmp_path / "old"
    store_dir.mkdir()
    db = sqlite3.connect(store_dir / "engine.sqlite")
    db.executescript(_OLD_CHECKPOINTS_TABLE)
    db.execute(
        "INSERT INTO checkpoints VALUES (?,?,?,?,?,?,?,?,?)",
        (
            "r:train:0",
            "weights/a",
            "training",
            "tinker://r:train:0/weights/a",
            "/f",
            1.0,
            3,
            None,
            None,
        ),
    )
    db.commit()
    db.close()

    store = Store(store_dir / "engine.sqlite")
    row = store.get_checkpoint("tinker://r:train:0/weights/a", now=time.time())
    assert row is not None and row.public is False and row.size_bytes == 3
    assert store.set_checkpoint_public("tinker://r:train:0/weights/a", True)
    assert store.list_checkpoints("r:train:0")[0][0].public is True
    store.close()
    Store(store_dir / "engine.sqlite").close()  # opening it again adds nothing twice

    # The embedded engine opens it and works as usual.
    backend = LocalBackend(store_dir)
    try:
        service = tinker.ServiceClient(backend=backend)
        tc = service.create_lora_training_client(MODEL, rank=2).result()
        path = tc.save_state("new").result().path
        rest = _rest(service)
        rest.publish_checkpoint_from_tinker_path(path).result()
        assert _checkpoint(rest, path).public is True
        service.close().result()
    finally:
        backend.close()
    columns = [
        r[1]
        for r in sqlite3.connect(store_dir / "engine.sqlite").execute(
            "PRAGMA table_info(checkpoints)"
        )
    ]
    assert columns.count("public") == 1


def test_get_sampler_names_the_base_model_and_checkpoint(service: Any) -> None:
    tc = service.create_lora_training_client(MODEL, rank=2).result()
    path = tc.save_weights_for_sampler("for-get-sampler").result().path
    rest = _rest(service)
    from_path = service.create_sampling_client(model_path=path).result()
    info = rest.get_sampler(from_path.sampler_id).result()
    assert (info.sampler_id, info.base_model, info.model_path) == (
        from_path.sampler_id,
        MODEL,
        path,
    )
    from_base = service.create_sampling_client(base_model=MODEL).result()
    info = rest.get_sampler(from_base.sampler_id).result()
    assert (info.base_model, info.model_path) == (MODEL, None)
    with pytest.raises(NOT_FOUND, match="unknown sampl"):
        rest.get_sampler("sess-nope:sample:0").result()


def test_list_and_get_sessions(service: Any) -> None:
    """``RestClient.list_sessions`` (newest first, paged) and ``get_session`` (training runs,
    samplers, metadata, display name), as the SDK has them; unknown ids are not found and a bad
    page is refused by field."""
    mine = tinker.ServiceClient(
        {"exp": "sessions"}, display_name="nightly", backend=service.holder.backend
    )
    tc = mine.create_lora_training_client(MODEL, rank=2).result()
    sid = tc.model_id.split(":")[0]
    sampler = tc.save_weights_and_get_sampling_client().result()
    from_base = mine.create_sampling_client(base_model=MODEL).result()
    rest = _rest(service)
    assert rest.list_sessions(limit=1).result().sessions == [sid]  # the newest
    older = rest.list_sessions(limit=3, offset=1).result().sessions
    assert sid not in older and len(older) <= 3
    info = rest.get_session(sid).result()
    assert info.training_run_ids == [tc.model_id]
    assert info.sampler_ids == [sampler.sampler_id, from_base.sampler_id]
    assert (info.user_metadata, info.display_name) == ({"exp": "sessions"}, "nightly")
    with pytest.warns(FutureWarning):
        assert asyncio.run(rest.get_session_async(sid)) == info
    with pytest.raises(NOT_FOUND, match="unknown session"):
        rest.get_session("sess-nope").result()
    with pytest.raises((tinker.BadRequestError, ValueError), match="limit must be"):
        rest.list_sessions(limit=-1).result()
    mine.close().result()


def test_what_a_killed_save_left_is_deleted_when_the_store_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed mid-save leaves its temporary file (up to a whole checkpoint), never
    listed and so never deletable; before, it stayed for ever. Now the store deletes it when it
    opens, once it is old enough not to be a save another engine is writing right now; a
    checkpoint merely named like a temporary (an export is a folder under its own name) stays."""
    import subprocess
    import sys

    from tinker_sr.engine import checkpoint_store

    store = tmp_path / "store"
    killed_mid_save = f"""
import os, tinker_sr
from tinker_sr.backend.local import LocalBackend
service = tinker_sr.ServiceClient(backend=LocalBackend({str(store)!r}))
tc = service.create_lora_training_client({MODEL!r}, rank=2, seed=0).result()
os.replace = lambda *a: os._exit(9)  # killed just before the save's final rename
tc.save_state("st").result()
"""
    proc = subprocess.run([sys.executable, "-c", killed_mid_save], timeout=300, check=False)
    assert proc.returncode == 9
    (left,) = (store / "checkpoints").glob("*/*/.*.tmp")
    backend = LocalBackend(store)
    assert left.exists()  # recent: it may be a save in progress
    service = tinker.ServiceClient(backend=backend)
    tc = service.create_lora_training_client(MODEL, rank=2, seed=0).result()
    exports = [tc.save_weights_external(n).result().path for n in (".e.tmp", ".e.abcd0123.tmp")]
    service.close().result()
    backend.close()

    clock = _Clock()
    clock.ahead = 2 * 3600.0  # the store opens again two hours later
    monkeypatch.setattr(checkpoint_store, "time", clock)
    backend = LocalBackend(store)
    assert not left.exists()
    rest = tinker.RestClient(tinker.ServiceClient(backend=backend).holder)
    for path in exports:
        assert rest.get_external_weights_urls(path).result().urls
    backend.close()


def test_a_malformed_path_never_reaches_another_checkpoint(tmp_path: Path) -> None:
    """Found by a differential fuzzer: the clients put a tinker path's run and name into the
    URL unquoted, so ``unpublish("tinker://RUN/weights/victim?x=1")`` sent DELETE
    .../checkpoints/weights/victim (the delete route: the checkpoint was deleted), and ``#`` or
    ``..`` did the same. Our client quotes each segment; the server refuses a query string on
    checkpoint routes (the official SDK's ``?`` case); names with ``?``, ``#`` or ``%``, which no
    REST call could address, are refused at save."""
    import tinker as sdk

    from tests._server import running_server

    with running_server(tmp_path / "store") as srv:
        ours = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-a")
        theirs = sdk.ServiceClient(base_url=srv.base_url, api_key="tml-a")
        tc = ours.create_lora_training_client(MODEL, rank=2, seed=0).result()
        victim = tc.save_state("victim").result().path
        for service, lib in ((ours, tinker), (theirs, sdk)):
            rest = service.create_rest_client()
            for odd in (f"{victim}?x=1", f"{victim}#f"):
                if lib is sdk and odd.endswith("#f"):
                    continue  # httpx drops a fragment before it is sent: no server can tell
                with pytest.raises((lib.BadRequestError, lib.NotFoundError)):
                    rest.unpublish_checkpoint_from_tinker_path(odd).result()
                with pytest.raises((lib.BadRequestError, lib.NotFoundError)):
                    rest.delete_checkpoint_from_tinker_path(odd).result()
            if lib is tinker:
                with pytest.raises(tinker.NotFoundError):
                    rest.delete_checkpoint(tc.model_id, "weights/../weights/victim").result()
                with pytest.raises(tinker.NotFoundError):
                    rest.list_checkpoints("..").result()
            listed = rest.list_checkpoints(tc.model_id).result().checkpoints
            assert [c.tinker_path for c in listed] == [victim]
        for name in ("q?x", "h#x", "p%2Fx"):
            with pytest.raises(tinker.RequestFailedError, match="is invalid"):
                tc.save_state(name).result()
        ours.close().result()
        theirs.close("success").result()


def test_a_name_taken_twice_is_refused_with_a_fix_the_save_offers(service: Any) -> None:
    """save_state has overwrite=True; save_weights_for_sampler has no such parameter (in the
    official SDK either). Before, both refusals advised it: the sampler's sent users to a
    TypeError."""
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    tc.save_state("taken").result()
    with pytest.raises(BAD_INPUT, match=r"already exists; pick another name \(or pass overwrite"):
        tc.save_state("taken").result()
    assert tc.save_state("taken", overwrite=True).result().path.endswith("/weights/taken")
    tc.save_weights_for_sampler("taken").result()
    with pytest.raises(BAD_INPUT, match="already exists") as err:
        tc.save_weights_for_sampler("taken").result()
    assert "overwrite" not in str(err.value)
    assert "delete it first with RestClient.delete_checkpoint_from_tinker_path" in str(err.value)


def test_a_checkpoint_named_without_its_kind_gets_the_fix_on_every_path(service: Any) -> None:
    """`delete_checkpoint(run, "step-1")`: the name save_state took, not the checkpoint id.
    Before, a server said "no such endpoint: DELETE ..." (read as a version mismatch), while
    the embedded engine named the id's form."""
    tc = service.create_lora_training_client(MODEL, rank=2, seed=0).result()
    run = types.ParsedCheckpointTinkerPath.from_tinker_path(
        tc.save_state("step-1").result().path
    ).training_run_id
    with pytest.raises(NOT_FOUND, match=r"a checkpoint_id is <weights\|sampler_weights"):
        _rest(service).delete_checkpoint(run, "step-1").result()
    _rest(service).delete_checkpoint(run, "weights/step-1").result()  # the id it meant


def test_deleting_a_runs_last_checkpoints_leaves_no_empty_folders(tmp_path: Path) -> None:
    """Before: each run's ``checkpoints/<run>/<kind>/`` folders stayed after its checkpoints
    were deleted (4 KB each, one pair per run for good: a sweep's thousands of runs)."""
    backend = LocalBackend(tmp_path / "store")
    service = tinker.ServiceClient(backend=backend)
    try:
        tc = service.create_lora_training_client(MODEL, rank=2).result()
        paths = [
            tc.save_state("a").result().path,
            tc.save_state("b").result().path,
            tc.save_weights_for_sampler("s").result().path,
        ]
        root = tmp_path / "store" / "checkpoints"
        (run,) = root.iterdir()
        rest = _rest(service)
        for i, path in enumerate(paths):
            rest.delete_checkpoint_from_tinker_path(path).result()
            kinds = sorted(p.name for p in run.iterdir()) if run.exists() else []
            assert kinds == [["sampler_weights", "weights"], ["sampler_weights"], []][i], kinds
        assert not run.exists() and root.exists()
        # The run saves again into a new folder.
        assert tc.save_state("c").result().path.endswith("/weights/c")
    finally:
        service.close().result()
        backend.close()
