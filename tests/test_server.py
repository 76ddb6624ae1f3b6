"""The server over raw HTTP: bad input gets a 4xx with a JSON ``detail`` naming the problem,
and leaves the model exactly as it was; ids of other keys behave as unknown; futures,
idempotency and long-polling behave as spec/wire.md describes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._server import ServerProcess, running_server
from tinker_sr import types
from tinker_sr.wire import compression, proto

MODEL = "tinker-sr/tiny"
MAX_BODY = 1 << 20
PROTOBUF = {"Content-Type": "application/x-protobuf"}


class Wire:
    """Raw HTTP to the server, as the official SDK would send it."""

    def __init__(self, base_url: str, key: str = "tml-test") -> None:
        self.http = httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=60)
        self.seq: dict[str, int] = {}

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        if body is not None and not isinstance(body, bytes):
            kw["json"] = body
        elif body is not None:
            kw["content"] = body
        resp = self.http.post(f"/api/v1/{path}", **kw)
        if resp.status_code >= 400:  # never an empty-body error (the SDK would retry it)
            assert resp.headers["content-type"].startswith("application/json"), resp.text
            assert isinstance(resp.json()["detail"], str) and resp.json()["detail"]
        return resp

    def ok(self, path: str, body: Any = None, **kw: Any) -> Any:
        resp = self.post(path, body, **kw)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def wait(self, promise: dict[str, Any]) -> httpx.Response:
        while True:
            resp = self.post("retrieve_future", {"request_id": promise["request_id"]})
            assert resp.status_code == 200, resp.text
            if "json" in resp.headers["content-type"] and resp.json().get("type") == "try_again":
                continue
            return resp

    def session(self) -> str:
        body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}
        return str(self.ok("create_session", body)["session_id"])

    def model(self, session_id: str, model_seq_id: int = 0) -> str:
        promise = self.ok(
            "create_model",
            {
                "session_id": session_id,
                "model_seq_id": model_seq_id,
                "base_model": MODEL,
                "lora_config": {"rank": 4, "seed": 0},
                "type": "create_model",
            },
        )
        model_id = self.wait(promise).json()["model_id"]
        self.seq[model_id] = 0
        return str(model_id)

    def next_seq(self, model_id: str) -> int:
        self.seq[model_id] += 1
        return self.seq[model_id]

    def fb_body(self, model_id: str, data: list[types.Datum], **kw: Any) -> bytes:
        loss = kw.pop("loss_fn", "cross_entropy")
        return proto.encode_forward_backward_request(
            model_id, self.next_seq(model_id), data, loss, **kw
        )

    def logprobs(self, model_id: str) -> list[float]:
        """Forward-only logprobs of a fixed datum: a fingerprint of the model's weights."""
        resp = self.wait(
            self.ok(
                "forward_backward",
                self.fb_body(model_id, [DATUM], forward_only=True),
                headers=PROTOBUF,
            )
        )
        out = proto.decode_forward_backward_output(resp.content)
        return [float(x) for x in out.loss_fn_outputs[0]["logprobs"].to_numpy()]

    def train_step(self, model_id: str) -> None:
        self.wait(self.ok("forward_backward", self.fb_body(model_id, [DATUM]), headers=PROTOBUF))
        step = {
            "model_id": model_id,
            "seq_id": self.next_seq(model_id),
            "adam_params": {"learning_rate": 0.01},
            "type": "optim_step",
        }
        assert "error" not in self.wait(self.ok("optim_step", step)).json()


DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
    loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("store"), max_body_bytes=MAX_BODY) as srv:
        yield srv


@pytest.fixture(scope="module")
def wire(server: ServerProcess) -> Wire:
    return Wire(server.base_url)


@pytest.fixture(scope="module")
def model(wire: Wire) -> str:
    return wire.model(wire.session())


def detail(resp: httpx.Response) -> str:
    return str(resp.json()["detail"])


def test_healthz_needs_no_key_and_client_config_states_our_flags(
    wire: Wire, server: ServerProcess
) -> None:
    assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}
    config = wire.ok("client/config", {"sdk_version": "0.38.0"})
    assert config["proto_compress_fwdbwd"] is False
    assert config["parallel_fwdbwd_chunks"] is False
    assert config["pjwt_auth_enabled"] is False
    assert wire.ok("client/dynamic_config", {"sdk_version": "0.38.0"}) == {
        "refresh_interval_sec": 300,
        "sample_cancel_enabled": True,  # abandoned samples: cancel_future
    }
    assert wire.ok("telemetry", {"events": [], "session_id": "x"}) == {"status": "accepted"}


def test_requests_without_a_tml_key_are_refused(server: ServerProcess) -> None:
    for headers, needle in [
        ({}, "missing X-API-Key"),
        ({"X-API-Key": "sk-123"}, "must start with 'tml-'"),
    ]:
        resp = httpx.post(f"{server.base_url}/api/v1/client/config", json={}, headers=headers)
        assert resp.status_code == 401
        assert needle in detail(resp)


def test_configured_api_keys_are_the_only_ones_accepted(tmp_path: Path) -> None:
    with running_server(tmp_path / "store", api_keys=["tml-alpha", "tml-beta"]) as srv:
        assert Wire(srv.base_url, "tml-beta").post("client/config", {}).status_code == 200
        resp = Wire(srv.base_url, "tml-gamma").post("client/config", {})
        assert resp.status_code == 401 and "not accepted" in detail(resp)


@pytest.mark.parametrize("how", ["--api-key", "env"])
def test_serve_refuses_at_start_a_key_no_client_can_send(tmp_path: Path, how: str) -> None:
    """Before: `serve --api-key mysecret` started ("accepting 1 configured API key(s)") and
    every client, the official SDK too, refused the key before connecting."""
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "tinker_sr", "serve", "--port", "0", "--store", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "TINKER_SR_API_KEYS"}
    if how == "env":
        env["TINKER_SR_API_KEYS"] = "tml-fine,mysecret"
    else:
        argv += ["--api-key", "mysecret"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "do not start with 'tml-'" in done.stderr and "tml-<secret>" in done.stderr


def test_a_slow_request_is_reported_in_the_log_while_it_runs(tmp_path: Path) -> None:
    """users.md: tell a slow server from a hung client. Before, a 40 s forward_backward left
    nothing in the log at the default level between start-up and shutdown."""
    import tinker_sr

    env = {"TINKER_SR_SLOW_REQUEST_S": "0.05"}
    with running_server(tmp_path / "store", env=env, extra_args=["--log-level", "info"]) as srv:
        service = tinker_sr.ServiceClient(base_url=srv.base_url, api_key="tml-test")
        tc = service.create_lora_training_client("tinker-sr/small", rank=8, seed=0).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(list(range(255))),
            loss_fn_inputs={"target_tokens": list(range(1, 256)), "weights": [1.0] * 255},
        )
        tc.forward_backward([datum] * 8, "cross_entropy").result()
        service.close().result()
        log = srv.log()
    running = [line for line in log.splitlines() if "still running after" in line]
    assert any(f"ForwardBackward on {tc.model_id} req-" in line for line in running), log
    assert f"ForwardBackward on {tc.model_id} req-" in log and " finished in " in log


@pytest.mark.parametrize(
    ("raw", "zero", "expected", "warned"),
    [("2.5", False, 2.5, False), ("0", True, 0.0, False), ("0", False, 60.0, True),
     ("-1", True, 60.0, True), ("nan", True, 60.0, True), ("soon", False, 60.0, True)],
)  # fmt: skip
def test_server_seconds_from_the_environment(
    raw: str, zero: bool, expected: float, warned: bool,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """$TINKER_SR_BODY_STALL_S and $TINKER_SR_SLOW_REQUEST_S read alike: a value that is not a
    number of seconds is named in the log (once) and the default used. Before: silently
    ignored, and a NaN slow-request threshold became 0 (every request reported)."""
    from tinker_sr.server import http

    monkeypatch.setattr(http, "_WARNED", set())
    monkeypatch.setenv("TINKER_SR_TEST_S", raw)
    with caplog.at_level("WARNING", logger="tinker_sr.server"):
        assert http.env_seconds("TINKER_SR_TEST_S", 60.0, zero=zero) == expected
        assert http.env_seconds("TINKER_SR_TEST_S", 60.0, zero=zero) == expected
    named = [r for r in caplog.records if "$TINKER_SR_TEST_S" in r.getMessage()]
    assert len(named) == (1 if warned else 0), caplog.text


def test_malformed_json_is_a_400_and_changes_nothing(wire: Wire, model: str) -> None:
    before = wire.logprobs(model)
    resp = wire.post(
        "optim_step",
        b'{"model_id": "' + model.encode() + b'", "seq_id": 9',
        headers={"Content-Type": "application/json"},
    )
    assert resp.status_code == 400 and "not valid JSON" in detail(resp)
    resp = wire.post("create_model", b"[1, 2", headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "create_model: request body is not valid JSON" in detail(
        resp
    )
    assert wire.logprobs(model) == before


def test_bad_protobuf_is_a_400_and_later_requests_do_not_wait_for_its_seq_id(
    wire: Wire, model: str
) -> None:
    before = wire.logprobs(model)
    resp = wire.post("forward_backward", b"\xff\xfe not protobuf", headers=PROTOBUF)
    assert resp.status_code == 400 and "not a valid tinker_public.ForwardBackwardRequest" in detail(
        resp
    )
    # A well-formed envelope with a broken tensor: the error names the datum and field...
    msg = proto.pb.ForwardBackwardRequest.FromString(wire.fb_body(model, [DATUM, DATUM]))
    msg.data[1].loss_fn_inputs["weights"].dense = b"\x00\x00\x80"
    resp = wire.post("forward_backward", msg.SerializeToString(), headers=PROTOBUF)
    assert resp.status_code == 400
    assert "datum 1.loss_fn_inputs['weights'].dense: 3 bytes" in detail(resp)
    # ...and the seq_id it used up does not block the next request.
    assert wire.logprobs(model) == before


def test_wrong_field_types_are_400s_naming_the_field(wire: Wire, model: str) -> None:
    before = wire.logprobs(model)
    session_id = model.split(":train:")[0]
    resp = wire.post(
        "create_model",
        {
            "session_id": session_id,
            "model_seq_id": "7",
            "base_model": MODEL,
            "lora_config": {"rank": 4},
        },
    )
    assert resp.status_code == 400 and "field 'model_seq_id'" in detail(resp)
    step = {
        "model_id": model,
        "seq_id": wire.next_seq(model),
        "adam_params": {"learning_rate": "huge"},
    }
    resp = wire.post("optim_step", step)
    assert resp.status_code == 400 and "field 'adam_params.learning_rate'" in detail(resp)
    resp = wire.post("get_info", {"model_id": 12})
    assert resp.status_code == 400 and "field 'model_id'" in detail(resp)
    assert wire.logprobs(model) == before


def test_unknown_ids_are_404s(wire: Wire, model: str) -> None:
    ghost = model.replace(":train:0", ":train:99")
    cases = [
        ("get_info", {"model_id": ghost}, "unknown model_id"),
        ("optim_step", {"model_id": ghost, "seq_id": 1, "adam_params": {}}, "unknown model_id"),
        ("retrieve_future", {"request_id": "req-nope"}, "unknown request_id"),
        ("session_heartbeat", {"session_id": "sess-nope"}, "unknown session_id"),
        (
            "create_sampling_session",
            {"session_id": "sess-nope", "sampling_session_seq_id": 0, "base_model": MODEL},
            "unknown session_id",
        ),
        (
            "asample",
            {
                "prompt": {"chunks": []},
                "sampling_params": {},
                "sampling_session_id": "x:sample:0",
                "seq_id": 0,
            },
            "unknown sampling_session_id",
        ),
    ]
    for path, body, needle in cases:
        resp = wire.post(path, body)
        assert resp.status_code == 404, (path, resp.text)
        assert needle in detail(resp)
    resp = wire.post(
        "forward_backward",
        proto.encode_forward_backward_request(ghost, 1, [DATUM], "cross_entropy"),
        headers=PROTOBUF,
    )
    assert resp.status_code == 404 and "unknown model_id" in detail(resp)
    assert wire.http.get(f"/api/v1/training_runs/{ghost}/checkpoints").status_code == 404


def test_other_keys_ids_behave_exactly_as_unknown(
    wire: Wire, model: str, server: ServerProcess
) -> None:
    before = wire.logprobs(model)
    promise = wire.ok(
        "forward_backward", wire.fb_body(model, [DATUM], forward_only=True), headers=PROTOBUF
    )
    wire.wait(promise)
    intruder = Wire(server.base_url, "tml-intruder")
    ghost = model.replace(":train:0", ":train:99")
    for target in (model, ghost):
        resp = intruder.post("get_info", {"model_id": target})
        assert resp.status_code == 404
        assert detail(resp) == f"unknown model_id {target!r}; create a training client first"
    body = proto.encode_forward_backward_request(model, 100, [DATUM], "cross_entropy")
    assert intruder.post("forward_backward", body, headers=PROTOBUF).status_code == 404
    step = {"model_id": model, "seq_id": 100, "adam_params": {"learning_rate": 1.0}}
    assert intruder.post("optim_step", step).status_code == 404
    assert (
        intruder.post("retrieve_future", {"request_id": promise["request_id"]}).status_code == 404
    )
    assert (
        intruder.post("session_heartbeat", {"session_id": model.split(":train:")[0]}).status_code
        == 404
    )
    assert intruder.http.get(f"/api/v1/training_runs/{model}/checkpoints").status_code == 404
    assert intruder.http.get("/api/v1/checkpoints").json()["checkpoints"] == []
    assert wire.logprobs(model) == before


def test_oversized_bodies_are_413(wire: Wire, model: str) -> None:
    big = types.Datum(
        model_input=types.ModelInput.from_ints([1] * 300_000),
        loss_fn_inputs={"target_tokens": [1] * 300_000},
    )
    body = proto.encode_forward_backward_request(model, 500, [big], "cross_entropy")
    assert len(body) > MAX_BODY
    resp = wire.post("forward_backward", body, headers=PROTOBUF)
    assert resp.status_code == 413 and f"limit of {MAX_BODY} bytes" in detail(resp)
    resp = wire.post(
        "forward_backward",
        compression.zstd_compress(body),
        headers={**PROTOBUF, "Content-Encoding": "zstd"},
    )
    assert resp.status_code == 413 and "decompressed body exceeds" in detail(resp)


def test_zstd_forward_backward_bodies_are_accepted(wire: Wire, model: str) -> None:
    before = wire.logprobs(model)
    body = compression.zstd_compress(wire.fb_body(model, [DATUM], forward_only=True))
    resp = wire.wait(
        wire.ok("forward_backward", body, headers={**PROTOBUF, "Content-Encoding": "zstd"})
    )
    got = proto.decode_forward_backward_output(resp.content).loss_fn_outputs[0]["logprobs"]
    assert got.tolist() == before


def test_an_older_official_sdk_is_told_how_to_train_and_what_to_upgrade(wire: Wire) -> None:
    """Official SDKs 0.20-0.24 read client/config's proto_write_fwdbwd and fwd_via_fwdbwd
    (0.38 ignores both): without them they posted JSON forward_backward bodies (415) and
    forward() to /forward (404), so they could not train here (found by running 0.18-0.36
    against the server). Older ones are warned at create_session, as the SDK logs it; their
    remaining refusals, and checkpoint archives (SDK <= 0.35), name the way out."""
    config = wire.ok("client/config", {"sdk_version": "0.24.1"})
    assert config["proto_write_fwdbwd"] is True and config["fwd_via_fwdbwd"] is True
    for version, warned in (("0.22.0", True), ("0.18.2", True), ("0.24.0", True),
                            ("0.24.1", False), ("0.38.0", False), ("0.39.0.dev1", False),
                            ("0.1\u00b2.3", False), (None, False)):  # fmt: skip
        body = {"tags": [], "user_metadata": {}, "sdk_version": version}
        reply = wire.ok("create_session", body)
        assert ("warning_message" in reply) == warned, (version, reply)
        if warned:
            assert f"this client is tinker {version}" in reply["warning_message"]
            assert "pip install -U tinker" in reply["warning_message"]
    resp = wire.post("forward", {"model_id": "m", "seq_id": 1, "forward_input": {}})
    assert resp.status_code == 400 and "upgrade the SDK" in detail(resp)
    resp = wire.post("forward_backward", {"model_id": "m", "seq_id": 1})
    assert resp.status_code == 415 and "pip install -U tinker" in detail(resp)
    run = "sess-1:train:0"
    resp = wire.http.get(f"/api/v1/training_runs/{run}/checkpoints/weights/ck1/archive")
    assert resp.status_code == 400 and "get_external_weights_urls" in resp.json()["detail"]


def test_unsupported_features_and_options_are_refused_explicitly(wire: Wire, model: str) -> None:
    before = wire.logprobs(model)
    session_id = model.split(":train:")[0]
    create = {
        "session_id": session_id,
        "model_seq_id": 50,
        "base_model": MODEL,
        "lora_config": {"rank": 4},
    }
    resp = wire.post("create_model", {**create, "quantize": "int4"})
    assert resp.status_code == 400 and "unknown field 'quantize'" in detail(resp)
    resp = wire.post("create_model", {**create, "lora_config": None})
    assert resp.status_code == 400 and "LoRA adapters only" in detail(resp)
    resp = wire.post(
        "save_weights_for_sampler",
        {
            "model_id": model,
            "seq_id": wire.next_seq(model),
            "sampling_session_seq_id": 9,
            "kind": "inflight",
        },
    )
    assert resp.status_code == 400 and "kind 'inflight'" in detail(resp)
    resp = wire.post(
        "optim_step",
        {
            "model_id": model,
            "seq_id": wire.next_seq(model),
            "optimizer_params": {"type": "dimuon", "learning_rate": 0.1},
        },
    )
    assert resp.status_code == 400 and "'dimuon' are not supported" in detail(resp)
    # Loss names are the engine's to check (one validator for local and remote): the future
    # fails with category "user".
    custom = wire.fb_body(model, [DATUM], loss_fn="custom")
    failure = wire.wait(wire.ok("forward_backward", custom, headers=PROTOBUF)).json()
    assert failure["category"] == "user" and "loss_fn 'custom'" in failure["error"]
    resp = wire.post("forward_backward", {"model_id": model, "seq_id": 1})
    assert resp.status_code == 415 and "protobuf" in detail(resp)
    resp = wire.post(
        "forward_backward",
        wire.fb_body(model, [DATUM]),
        headers={**PROTOBUF, "Content-Encoding": "gzip"},
    )
    assert resp.status_code == 415 and "Content-Encoding 'gzip'" in detail(resp)
    resp = wire.post("retrieve_futures", {})
    assert resp.status_code == 400 and "session poller is disabled" in detail(resp)
    resp = wire.post(
        "load_weights",
        {
            "model_id": model,
            "seq_id": wire.next_seq(model),
            "path": "tinker://x/weights/y",
            "optimizer": True,
            "weights_access_token": "t",
        },
    )
    assert resp.status_code == 400
    assert wire.logprobs(model) == before


def test_a_resubmission_gets_the_same_future_and_a_reused_seq_id_is_refused(
    wire: Wire, model: str
) -> None:
    body = wire.fb_body(model, [DATUM], forward_only=True)
    first = wire.ok("forward_backward", body, headers=PROTOBUF)
    again = wire.ok("forward_backward", body, headers=PROTOBUF)
    assert first == again
    wire.wait(first)
    seq = proto.pb.ForwardBackwardRequest.FromString(body).seq_id
    resp = wire.post("optim_step", {"model_id": model, "seq_id": seq, "adam_params": {}})
    assert resp.status_code == 400 and f"seq_id {seq} was already used" in detail(resp)


def test_request_failures_come_back_through_the_future_with_a_category(
    wire: Wire, model: str
) -> None:
    before = wire.logprobs(model)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4],
            "logprobs": [0.0, -1.0, -1.0],
            "advantages": [0.0, 1.0, 1.0],
        },
    ).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="never-sampled", length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="never-sampled", length=3)],
    )
    promise = wire.ok(
        "forward_backward",
        wire.fb_body(model, [datum], loss_fn="stable_reinforce"),
        headers=PROTOBUF,
    )
    failure = wire.wait(promise).json()
    assert failure["category"] == "user"
    assert "never-sampled" in failure["error"]
    assert wire.logprobs(model) == before


def test_sampling_promise_carries_one_sequence_id_per_sample(wire: Wire, model: str) -> None:
    save = {
        "model_id": model,
        "seq_id": wire.next_seq(model),
        "sampling_session_seq_id": 0,
        "type": "save_weights_for_sampler",
    }
    sampler = wire.wait(wire.ok("save_weights_for_sampler", save)).json()["sampling_session_id"]
    req = {
        "num_samples": 3,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4, "seed": 1, "stop": []},  # no EOS stop: 4 tokens
        "sampling_session_id": sampler,
        "seq_id": 0,
        "prompt_logprobs": True,
        "record_stability_info": True,
        "type": "sample",
    }
    promise = wire.ok("asample", req, headers={"X-Tinker-Sampling-Backpressure": "1"})
    assert (
        len(promise["sample_sequence_ids"]) == 3 and len(set(promise["sample_sequence_ids"])) == 3
    )
    resp = wire.wait(promise)
    assert resp.headers["content-type"] == "application/x-protobuf"
    got = proto.decode_sample_response(resp.content, promise["sample_sequence_ids"])
    assert all(len(s.tokens) == 4 and len(s.logprobs or []) == 4 for s in got.sequences)
    assert got.prompt_logprobs is not None and got.prompt_logprobs[0] is None
    assert wire.ok("asample", req) == promise  # the same (sampler, seq_id): the same future
    info = wire.http.get(f"/api/v1/samplers/{sampler}").json()
    # tokenizer_id: not in the Tinker API (the SDK ignores it); tinker_sr's client reads it.
    assert info.pop("tokenizer_id").endswith("/tokenizers/byte-level")
    assert info == {"sampler_id": sampler, "base_model": MODEL}


def test_finished_sessions_refuse_work_and_heartbeats_get_410(wire: Wire) -> None:
    session_id = wire.session()
    model_id = wire.model(session_id)
    assert wire.ok("session_heartbeat", {"session_id": session_id, "type": "session_heartbeat"})
    resp = wire.post(
        f"sessions/{session_id}/finish", {"reason": {"type": "success"}, "detail": None}
    )
    assert resp.status_code == 204
    assert wire.post("session_heartbeat", {"session_id": session_id}).status_code == 410
    resp = wire.post("forward_backward", wire.fb_body(model_id, [DATUM]), headers=PROTOBUF)
    assert resp.status_code == 400 and "finished session" in detail(resp)


def test_checkpoint_rest_endpoints(wire: Wire) -> None:
    session_id = wire.session()
    model_id = wire.model(session_id)
    wire.train_step(model_id)
    save = {
        "model_id": model_id,
        "path": "ck1",
        "seq_id": wire.next_seq(model_id),
        "type": "save_weights",
    }
    path = wire.wait(wire.ok("save_weights", save)).json()["path"]
    assert path == f"tinker://{model_id}/weights/ck1"
    listing = wire.http.get(f"/api/v1/training_runs/{model_id}/checkpoints").json()
    assert [c["checkpoint_id"] for c in listing["checkpoints"]] == ["weights/ck1"]
    run = wire.http.get(
        f"/api/v1/training_runs/{model_id}", params={"access_scope": "owned"}
    ).json()
    assert run["training_run_id"] == model_id and run["base_model"] == MODEL
    assert wire.ok("weights_info", {"tinker_path": path}) == {
        "base_model": MODEL,
        "is_lora": True,
        "lora_rank": 4,
        "train_attn": True,
        "train_mlp": True,
        "train_unembed": True,
    }
    assert wire.http.get("/api/v1/get_server_capabilities").json()["supported_models"]
    assert (
        wire.http.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/ck1").status_code
        == 204
    )
    assert (
        wire.http.get(f"/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"] == []
    )
    resp = wire.http.get("/api/v1/training_runs", params={"limit": "ten"})
    assert (
        resp.status_code == 400 and "limit must be a non-negative integer" in resp.json()["detail"]
    )


# ---- in-process: futures semantics with a controllable fake backend ---------------------------


class _SlowBackend:
    """Only what the futures tests need: create_session, create_model that waits for a gate."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def create_session(self, **_: Any) -> str:
        return "sess-fake"

    async def create_model(self, session_id: str, model_seq_id: int, **_: Any) -> str:
        await self.gate.wait()
        if model_seq_id == 1:
            raise RuntimeError("boom")
        return f"{session_id}:train:{model_seq_id}"

    async def aclose(self) -> None:
        pass


def test_long_poll_answers_try_again_then_the_result_and_backend_crashes_are_server_failures(
    tmp_path: Path,
) -> None:
    from starlette.testclient import TestClient

    from tinker_sr.server import create_app

    backend = _SlowBackend()
    app = create_app(backend, store_dir=tmp_path, long_poll_s=0.05)  # type: ignore[arg-type]
    with TestClient(app, headers={"X-API-Key": "tml-x"}) as client:
        sid = client.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        promises = [
            client.post(
                "/api/v1/create_model",
                json={
                    "session_id": sid,
                    "model_seq_id": i,
                    "base_model": "m",
                    "lora_config": {"rank": 1},
                },
            ).json()
            for i in (0, 1)
        ]
        pending = client.post(
            "/api/v1/retrieve_future", json={"request_id": promises[0]["request_id"]}
        )
        assert pending.json() == {
            "type": "try_again",
            "request_id": promises[0]["request_id"],
            "queue_state": "active",
        }
        client.portal.call(backend.gate.set)  # type: ignore[union-attr]
        done = client.post(
            "/api/v1/retrieve_future", json={"request_id": promises[0]["request_id"]}
        )
        assert done.json() == {"model_id": "sess-fake:train:0", "type": "create_model"}
        failed = client.post(
            "/api/v1/retrieve_future", json={"request_id": promises[1]["request_id"]}
        )
        assert failed.json() == {
            "error": "internal error: RuntimeError: boom",
            "category": "server",
        }


def test_futures_pending_at_a_crash_are_failed_on_restart(tmp_path: Path) -> None:
    from tinker_sr.server.state import ServerState

    state = ServerState(tmp_path / "server.sqlite")
    state.add_future(
        "req-1",
        owner="o",
        session_id="s",
        kind="ForwardBackward",
        dedupe_key="train|m|seq_id 1",
        body_hash="h",
        promise={"request_id": "req-1"},
    )
    state.add_future(
        "req-2",
        owner="o",
        session_id="s",
        kind="OptimStep",
        dedupe_key="train|m|seq_id 2",
        body_hash="h",
        promise={"request_id": "req-2"},
    )
    state.complete_future("req-2", "json", json.dumps({"metrics": {}}).encode())
    state.close()
    state = ServerState(tmp_path / "server.sqlite")
    assert state.fail_orphans() == 1
    orphan = state.get_future("req-1")
    assert orphan is not None and orphan.status == "failed" and "restarted" in (orphan.error or "")
    assert state.find_future("train|m|seq_id 1") is None  # may be resubmitted
    done = state.get_future("req-2")
    assert (
        done is not None
        and done.status == "complete"
        and json.loads(done.result or b"") == {"metrics": {}}
    )


def test_sampler_rows_of_long_finished_sessions_are_pruned(tmp_path: Path) -> None:
    """The server keeps one row per sampler ever made (an RL loop makes one per step); those
    of a session finished and quiet for a day go when results do, live sessions' stay."""
    import time

    from tinker_sr.server.state import RESULT_TTL_S, ServerState

    state = ServerState(tmp_path / "server.sqlite")
    for sid in ("done", "live"):
        state.add_session(sid, "o")
        for i in range(3):
            state.add_sampler(f"{sid}-{i}", sid, None)
    state.finish_session("done", "success")
    state.prune()
    assert len(state.sampler_ids_of("done")) == 3  # finished just now: kept
    state.prune(now=time.time() + RESULT_TTL_S + 1)
    assert state.sampler_ids_of("done") == [] and len(state.sampler_ids_of("live")) == 3
    state.close()


def test_another_sessions_sequence_ids_behave_as_unknown(wire: Wire, model: str) -> None:
    save = {
        "model_id": model,
        "seq_id": wire.next_seq(model),
        "sampling_session_seq_id": 20,
        "type": "save_weights_for_sampler",
    }
    sampler = wire.wait(wire.ok("save_weights_for_sampler", save)).json()["sampling_session_id"]
    req = {
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 3, "seed": 5},
        "sampling_session_id": sampler,
        "seq_id": 0,
        "record_stability_info": True,
    }
    promise = wire.ok("asample", req)
    wire.wait(promise)
    theirs = promise["sample_sequence_ids"][0]

    other_model = wire.model(wire.session())  # same key, different session
    before = wire.logprobs(other_model)

    def failure_for(sequence_id: str) -> str:
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={
                "target_tokens": [2, 3, 4],
                "logprobs": [0.0, 0.0, 0.0],
                "advantages": [0.0, 0.0, 0.0],
            },
        ).with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=sequence_id, length=3)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence_id, length=3)],
        )
        body = wire.fb_body(other_model, [datum], loss_fn="stable_reinforce")
        result = wire.wait(wire.ok("forward_backward", body, headers=PROTOBUF)).json()
        assert result["category"] == "user"
        return str(result["error"]).replace(sequence_id, "<id>")

    assert failure_for(theirs) == failure_for("never-sampled-anywhere")
    assert wire.logprobs(other_model) == before


def test_the_seq_watcher_forgets_models_of_finished_sessions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: one entry per model ever trained, for the life of the server. Now the models of
    finished sessions are swept once the map doubles; live models keep their place (a live
    model's next seq_id opens no gap watch)."""
    import asyncio

    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.server import ordering
    from tinker_sr.server.futures import Background
    from tinker_sr.server.state import ServerState

    monkeypatch.setattr(ordering, "_SWEEP_AT", 8)
    state = ServerState(tmp_path / "server.sqlite")
    background = Background()
    watcher = ordering.SeqWatcher(state, LocalBackend(), background, grace_s=60.0)

    async def run() -> None:
        for sid in range(40):
            state.add_session(f"s{sid}", "o")
            state.add_model(f"m{sid}", f"s{sid}")
            watcher.note(f"m{sid}", 1)
            if sid % 2 == 0:
                state.finish_session(f"s{sid}", "success")
        assert len(watcher._floor) < 40
        assert all(watcher._floor[f"m{sid}"] == 2 for sid in range(1, 40, 2))  # live: kept
        watcher.note("m1", 2)
        assert not background._tasks  # no gap watch: seq 1 is still known to have run
        await background.cancel_all()

    asyncio.run(run())
    state.close()


def test_a_sampler_made_after_a_restart_is_never_taken_for_an_older_one(tmp_path: Path) -> None:
    """Which samplers predate this process (a sampler not loaded then gets the "the server
    restarted" 404) is told by the time a row was written. Before: by rowid, which SQLite reuses
    once the newest rows are pruned, so a sampler made after the restart could count as older.
    A store from before the column (rows without a time) counts its samplers as older."""
    import sqlite3
    import time

    from tinker_sr.server.state import RESULT_TTL_S, ServerState

    db = tmp_path / "server.sqlite"
    old = sqlite3.connect(db)  # the schema of a store written before created_at
    old.execute("CREATE TABLE samplers (sampler_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, "
                "model_path TEXT)")  # fmt: skip
    old.execute("INSERT INTO samplers VALUES ('legacy', 'gone', NULL)")
    old.commit()
    old.close()
    state = ServerState(db)
    state.add_session("done", "o")
    for i in range(2):
        state.add_sampler(f"done-{i}", "done", None)
    state.finish_session("done", "success")
    state.close()

    state = ServerState(db)  # the restart
    state.prune(now=time.time() + RESULT_TTL_S + 1)  # the newest rows go
    state.add_session("live", "o")
    state.add_sampler("new", "live", None)
    assert not state.sampler_predates_start("new")
    assert state.sampler_predates_start("legacy")
    state.close()
