"""Hostile input found by the session-30 audit: each was a 500, a silent acceptance, an
engine ("server") error for the caller's mistake, or a traceback; each is now the caller's
error, naming the field and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

import tinker_sr as tinker
from tests.test_server import Wire
from tinker_sr import types
from tinker_sr.engine.store import Store, StoreUnwritableError
from tinker_sr.wire import tinker_public_pb2 as pb


@pytest.fixture(scope="module")
def wire(remote_server: Any) -> Wire:
    """Raw HTTP to the suite's server (tests/conftest.py), in sessions of its own."""
    return Wire(remote_server.base_url)


def _refused(resp: object, needle: str) -> None:
    assert resp.status_code == 400, resp.text  # type: ignore[attr-defined]
    assert needle in resp.json()["detail"], resp.text  # type: ignore[attr-defined]


def test_an_integer_literal_too_long_to_read_is_a_400(wire: Wire) -> None:
    """Before: 500 "Exceeds the limit (4300 digits) for integer string conversion"."""
    body = b'{"type": "create_session", "tags": [], "n": ' + b"9" * 5000 + b"}"
    _refused(wire.post("create_session", body), "too long to read")
    wire.session()  # still serving


def test_a_cut_off_zstd_body_is_a_400_not_an_empty_request(wire: Wire) -> None:
    """Before: a truncated frame decompressed to nothing and was served as ``{}`` (200, the
    tags and metadata sent silently dropped)."""
    full = zstandard.ZstdCompressor().compress(
        b'{"type": "create_session", "tags": [], "user_metadata": {"k": "' + b"t" * 4000 + b'"}}'
    )
    zstd = {"Content-Encoding": "zstd", "Content-Type": "application/json"}
    for body in (full[: len(full) // 2], full[:4] + b"junk"):
        _refused(wire.post("create_session", body, headers=zstd), "cut off")
    assert wire.post("create_session", full, headers=zstd).status_code == 200


def test_a_zstd_body_of_several_frames_is_read_whole_and_trailing_bytes_are_refused(
    wire: Wire,
) -> None:
    """RFC 8878: a zstd body is one or more frames (streaming compressors flush frames). Before:
    only the first frame was read and the rest dropped without a word, so a protobuf body cut at
    a frame boundary could parse as a valid request missing its tail; bytes after the last
    frame were ignored too."""
    head, tail = b'{"type": "create_session", "tags": [], "user_metadata": {"k": "', b'"}}'
    compress = zstandard.ZstdCompressor(write_checksum=True).compress
    skippable = (0x184D2A5A).to_bytes(4, "little") + (2).to_bytes(4, "little") + b"ok"
    frames = compress(head) + skippable + compress(b"t" * 5000) + compress(tail)
    zstd = {"Content-Encoding": "zstd", "Content-Type": "application/json"}
    assert wire.post("create_session", frames, headers=zstd).status_code == 200  # JSON whole
    _refused(wire.post("create_session", frames + b"junk", headers=zstd), "after its last")
    _refused(wire.post("create_session", frames[:-2], headers=zstd), "cut off")
    _refused(wire.post("create_session", b"", headers=zstd), "cut off")
    streamed = zstandard.ZstdCompressor().compressobj()
    flushed = streamed.compress(head) + streamed.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    flushed += streamed.compress(b"t" * 99 + tail) + streamed.flush()
    assert wire.post("create_session", flushed, headers=zstd).status_code == 200


def test_a_zero_size_tensor_with_unindexable_dimensions_is_a_400(wire: Wire) -> None:
    """Before: 500 "array is too big" (numpy cannot reshape to [0, 2**62])."""
    sid = wire.session()
    mid = wire.model(sid)
    msg = pb.ForwardBackwardRequest(model_id=mid, seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray([1, 2, 3, 4], np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype = pb.DTYPE_INT64
    t.shape.extend([0, 2**62])
    w = d.loss_fn_inputs["weights"]
    w.dtype = pb.DTYPE_FLOAT32
    w.dense = np.ones(4, np.float32).tobytes()
    resp = wire.post(
        "forward_backward",
        msg.SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    _refused(resp, "loss_fn_inputs['target_tokens']: shape [0, 4611686018427387904]")


def test_an_image_of_unknown_length_is_the_callers_error(
    embedded_service: tinker.ServiceClient,
) -> None:
    """Before: its length was asked before its type was checked, and the ValueError that
    raised came back as an engine error (category "server")."""
    tc = embedded_service.create_lora_training_client("tinker-sr/tiny", rank=4).result()
    image = types.ImageChunk(data=b"\x89PNG", format="png")
    datum = types.Datum(
        model_input=types.ModelInput(chunks=[image]),
        loss_fn_inputs={"target_tokens": [1], "weights": [1.0]},
    )
    with pytest.raises(
        tinker.RequestFailedError, match="is of type ImageChunk; .* only accepts"
    ) as ei:
        tc.forward_backward([datum], "cross_entropy").result()
    assert ei.value.category == types.RequestErrorCategory.User


def test_an_unwritable_store_is_one_clear_error(tmp_path: Path) -> None:
    """Before: a traceback ending in ``sqlite3.OperationalError: unable to open database
    file`` (or ``OSError`` from the server's lock file)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreUnwritableError, match="--store DIR"):
        Store(blocker / "engine.sqlite")
    (tmp_path / "dir-db" / "engine.sqlite").mkdir(parents=True)  # a directory in its place
    with pytest.raises(StoreUnwritableError, match="unable to open"):
        Store(tmp_path / "dir-db" / "engine.sqlite")
    proc = subprocess.run(
        [sys.executable, "-m", "tinker_sr", "serve", "--port", "0", "--store", str(blocker)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"store {blocker} cannot be written" in proc.stderr, proc.stderr


def test_compute_logprobs_on_a_full_context_says_what_to_use(
    embedded_service: tinker.ServiceClient,
) -> None:
    """Before: only "prompt + max_tokens (1) exceeds ...", a max_tokens the caller never set."""
    sampler = embedded_service.create_sampling_client(base_model="tinker-sr/tiny").result()
    full = types.ModelInput.from_ints([5] * 512)  # tinker-sr/tiny's whole context
    with pytest.raises(tinker.BadRequestError, match="scores at most 511 tokens") as ei:
        sampler.compute_logprobs(full).result()
    assert "TrainingClient.forward" in str(ei.value)
    assert len(sampler.compute_logprobs(types.ModelInput.from_ints([5] * 511)).result()) == 511


def test_a_full_disk_is_said_as_such(
    embedded_service: tinker.ServiceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: "internal error: OSError: [Errno 28] No space left on device" (a future) or a
    500 "internal server error: OperationalError: database or disk is full" that the official
    SDK retried for minutes without saying why."""
    import errno
    import sqlite3

    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine.store_files import OUT_OF_SPACE
    from tinker_sr.server.http import plain_error

    assert plain_error(sqlite3.OperationalError("database or disk is full")) == (507, OUT_OF_SPACE)
    tc = embedded_service.create_lora_training_client("tinker-sr/tiny", rank=4).result()

    def full(*_: object, **__: object) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalBackend, "_save", full)
    with pytest.raises(tinker.RequestFailedError, match="out of disk space") as ei:
        tc.save_state("x").result()
    assert ei.value.category == types.RequestErrorCategory.Server


def test_a_full_disk_while_creating_a_sampler_is_retried_not_blamed_on_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine made the sampler, then the server could not record it (disk full: 507, which
    the official SDK retries). Before: the retry found its sampling_session_seq_id "already
    used" (a 400, the caller's fault) and the engine kept a sampler nothing could reach. Now
    the engine's sampler is forgotten, so the retry creates it. A heartbeat on a full disk
    still keeps the session alive (it is kept in memory) instead of answering 507."""
    import os
    import sqlite3

    import httpx
    import tinker as sdk

    from tinker_sr.testing import mock_tinker

    def disk_full_once(real: Any) -> Any:
        calls = iter([True])

        def write(*args: Any) -> Any:
            if next(calls, False):
                raise sqlite3.OperationalError("database or disk is full")
            return real(*args)

        return write

    with mock_tinker(store=tmp_path / "store") as mock:
        state = mock.server().state
        monkeypatch.setattr(state, "add_sampler", disk_full_once(state.add_sampler))
        service = sdk.ServiceClient()
        sampler = service.create_sampling_client(base_model="tinker-sr/tiny").result()
        params = sdk.types.SamplingParams(max_tokens=2)
        assert sampler.sample(sdk.types.ModelInput.from_ints([1, 2]), 1, params).result()
        assert [c["status"] for c in mock.trace.calls("create_sampling_session")] == [507, 200]
        monkeypatch.setattr(state, "heartbeat", disk_full_once(state.heartbeat))
        heartbeat = {"session_id": service.holder.get_session_id(), "type": "session_heartbeat"}
        with httpx.Client(base_url=os.environ["TINKER_BASE_URL"]) as http:
            reply = http.post(
                "/api/v1/session_heartbeat",
                json=heartbeat,
                headers={"X-API-Key": os.environ["TINKER_API_KEY"]},
            )
        assert reply.status_code == 200, reply.text
        service.close("success").result()  # its heartbeats would outlive the mock server


def test_an_oversized_value_is_not_echoed_whole(wire: Wire) -> None:
    """Before: a 100 KB base_model came back whole inside its error."""
    sid = wire.session()
    body = {
        "session_id": sid,
        "model_seq_id": 5,
        "base_model": "m" * 100_000,
        "lora_config": {"rank": 4},
        "type": "create_model",
    }
    resp = wire.post("create_model", body)
    if resp.status_code == 200:  # accepted, then failed: the future's error
        text = wire.wait(resp.json()).json()["error"]
    else:
        text = resp.json()["detail"]
    assert "characters left out" in text and len(text) < 2100, text[:300]


def test_a_nan_the_official_sdk_sent_as_null_is_named(wire: Wire) -> None:
    """The official SDK sends ``AdamParams(learning_rate=nan)`` as ``null``; the 400 says so
    (before: only "Input should be a valid number (got None)")."""
    mid = wire.model(wire.session())
    body = {
        "model_id": mid,
        "seq_id": 1,
        "adam_params": {"learning_rate": None, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12},
        "type": "optim_step",
    }
    _refused(wire.post("optim_step", body), "adam_params.learning_rate': Input should be")
    assert "NaN or infinity" in wire.post("optim_step", body).json()["detail"]


def test_a_client_that_hangs_up_mid_upload_is_not_an_internal_error(remote_server: Any) -> None:
    """A body cut off by its client (a timeout or Ctrl-C during a large upload) is logged as
    the client going away, not as an internal error with a traceback (before: ``ERROR: POST
    /api/v1/forward_backward failed`` and starlette's ClientDisconnect traceback, as a 500);
    the server serves on."""
    import socket
    import time

    with socket.create_connection(("127.0.0.1", remote_server.port)) as conn:
        conn.sendall(
            b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: tml-hangup\r\n"
            b"Content-Type: application/x-protobuf\r\nContent-Length: 100000\r\n\r\n" + b"\0" * 10
        )
        time.sleep(0.5)
    wire = Wire(remote_server.base_url, "tml-hangup")
    for _ in range(50):  # the server has read the cut-off body once it answers the next call
        if wire.http.get("/api/v1/healthz").status_code == 200:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    log = remote_server.log_path.read_text()
    assert "ClientDisconnect" not in log, log[-2000:]


def _raw_post(base_url: str, head: bytes, pieces: list[bytes], gap_s: float = 0.0) -> bytes:
    """``POST /api/v1/create_session`` on a raw socket: the request line, ``head`` (the rest of
    the header block) and ``pieces`` of body ``gap_s`` apart; all that comes back until the
    server closes the connection."""
    import socket
    import time

    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: tml-a\r\n")
        conn.sendall(head)
        for piece in pieces:
            conn.sendall(piece)
            time.sleep(gap_s)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
    return got


def test_a_body_that_stalls_is_answered_408_and_its_connection_freed(tmp_path: Path) -> None:
    """A client that sends the headers and a byte of its body, then nothing, held its
    connection (and a file descriptor) open for good: enough of them and the server accepts
    nobody. Now the body's wait is bounded ($TINKER_SR_BODY_STALL_S), then a 408."""
    from tinker_sr.server.http import BODY_STALL_ENV
    from tinker_sr.testing.server import running_server

    with running_server(tmp_path / "store", env={BODY_STALL_ENV: "1"}) as srv:
        head = b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        got = _raw_post(srv.base_url, head, [b"{"])  # until the server closes the connection
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), got
        assert b"stalled: no bytes for 1 s after 1 of 1000 bytes" in body, got
        assert Wire(srv.base_url).session()  # still serving


def test_a_training_request_the_server_could_not_record_leaves_its_model_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the moment a forward_backward was recorded. Before, its number had
    already been counted as arrived, so it was never released, and every later call of that
    training client waited for it forever. Now it counts only once recorded (the request's
    future fails, saying why): the next call runs after the gap's grace period."""
    import sqlite3

    from tinker_sr.backend.remote import RemoteBackend
    from tinker_sr.testing import mock_tinker

    full = {"disk": False}
    with mock_tinker(store=tmp_path / "store", seq_gap_grace_s=0.3) as mock:
        state = mock.server().state
        real = state.add_future

        def add_future(*args: Any, **kwargs: Any) -> Any:
            if full["disk"]:
                raise sqlite3.OperationalError("database or disk is full")
            return real(*args, **kwargs)

        monkeypatch.setattr(state, "add_future", add_future)
        service = tinker.ServiceClient(backend=RemoteBackend(max_retries=0))
        try:
            tc = service.create_lora_training_client("tinker-sr/tiny", rank=4).result()
            datum = types.Datum(
                model_input=types.ModelInput.from_ints([1, 2, 3]),
                loss_fn_inputs={"target_tokens": [2, 3, 4]},
            )
            full["disk"] = True
            with pytest.raises(tinker.RequestFailedError, match="out of disk space"):
                tc.forward_backward([datum], "cross_entropy").result()
            full["disk"] = False  # space freed
            out = tc.forward_backward([datum], "cross_entropy").result(timeout=60)
            assert out.metrics["loss:sum"] > 0
            tc.optim_step(types.AdamParams(learning_rate=0.01)).result(timeout=60)
        finally:
            service.close().result()


def test_a_full_disk_fails_the_official_sdks_futures_at_once_and_keeps_finished_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The official SDK retries a 507 (any 5xx) for up to two hours: with the disk full, its
    calls hung without a word. Now a request the server cannot record is answered with a
    future that fails at once, saying why; and a result the server cannot write (the work is
    done) is kept in memory for its client instead of leaving its future pending for good."""
    import sqlite3

    import tinker as sdk

    from tinker_sr.testing import mock_tinker

    full = {"add": False, "complete": False}

    def failing(real: Any, which: str) -> Any:
        def write(*args: Any, **kwargs: Any) -> Any:
            if full[which]:
                raise sqlite3.OperationalError("database or disk is full")
            return real(*args, **kwargs)

        return write

    with mock_tinker(store=tmp_path / "store", seq_gap_grace_s=0.3) as mock:
        state = mock.server().state
        monkeypatch.setattr(state, "add_future", failing(state.add_future, "add"))
        monkeypatch.setattr(state, "complete_future", failing(state.complete_future, "complete"))
        service = sdk.ServiceClient()
        try:
            tc = service.create_lora_training_client("tinker-sr/tiny", rank=4).result()
            datum = sdk.types.Datum(
                model_input=sdk.types.ModelInput.from_ints([1, 2, 3]),
                loss_fn_inputs={"target_tokens": [2, 3, 4]},
            )
            full["add"] = True
            with pytest.raises(sdk.RequestFailedError, match="out of disk space"):
                tc.forward_backward([datum], "cross_entropy").result(timeout=60)
            full["add"], full["complete"] = False, True
            out = tc.forward_backward([datum], "cross_entropy").result(timeout=60)
            assert out.metrics["loss:sum"] > 0  # done, written nowhere, still answered
            full["complete"] = False  # space freed: the next calls run as usual
            tc.optim_step(sdk.types.AdamParams(learning_rate=0.01)).result(timeout=60)
        finally:
            service.holder.close()


def test_a_slow_but_steady_body_is_read_whole(tmp_path: Path) -> None:
    """The stall limit is between bytes, not on the whole upload: a body arriving in small
    pieces for longer than the limit is served."""
    from tinker_sr.server.http import BODY_STALL_ENV
    from tinker_sr.testing.server import running_server

    body = b'{"type": "create_session", "tags": [], "user_metadata": {"k": "' + b"v" * 40 + b'"}}'
    with running_server(tmp_path / "store", env={BODY_STALL_ENV: "1"}) as srv:
        head = (
            b"Connection: close\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        pieces = [body[i : i + 16] for i in range(0, len(body), 16)]
        got = _raw_post(srv.base_url, head, pieces, gap_s=0.4)  # ~3 s in all
        assert got.startswith(b"HTTP/1.1 200"), got


def test_outcomes_the_database_cannot_take_are_never_left_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A result kept in memory on a full disk is answered, written once the database takes
    writes again, and past the memory budget gives way to a failure saying so (before: pushed
    out by a burst of refused requests, its future read as pending for good and the SDK
    polled without end). A write failing for another reason fails the future, as before."""
    import sqlite3

    from tinker_sr.server import futures as futures_mod
    from tinker_sr.server.futures import Background, Futures
    from tinker_sr.server.state import COMPLETE, FAILED, ServerState

    state = ServerState(None)
    futures = Futures(state, Background(), long_poll_s=1.0, max_pending_samples=8)
    for i in range(4):
        state.add_future(
            f"r{i}", owner="o", session_id=None, kind="Forward", dedupe_key=f"k{i}",
            body_hash=None, promise={"request_id": f"r{i}"},
        )  # fmt: skip
    real_complete, trouble = state.complete_future, {"kind": "full"}

    def complete(*args: Any) -> None:
        if trouble["kind"] == "full":
            raise sqlite3.OperationalError("database or disk is full")
        if trouble["kind"] == "too big":
            raise sqlite3.DataError("string or blob too big")
        real_complete(*args)

    monkeypatch.setattr(state, "complete_future", complete)
    monkeypatch.setattr(futures_mod, "_KEPT_RESULT_BYTES", 15)
    futures._record("r0", (COMPLETE, "json", b'"0123456789"', None, None))
    assert futures.lookup("r0", "o").result == b'"0123456789"'  # answered from memory
    futures._record("r1", (COMPLETE, "json", b'"abcdefghij"', None, None))  # over the budget
    lost = futures.lookup("r0", "o")
    assert lost.status == FAILED and "no longer fits in memory" in (lost.error or "")
    trouble["kind"] = "too big"
    futures._record("r2", (COMPLETE, "json", b"{}", None, None))
    failed = state.get_future("r2")
    assert failed is not None and failed.status == FAILED and "DataError" in (failed.error or "")
    trouble["kind"] = "none"  # space is back: the kept result is written at the next write
    futures._record("r3", (COMPLETE, "json", b"{}", None, None))
    written = state.get_future("r1")
    assert written is not None and written.status == COMPLETE and not futures._kept
    state.close()


def test_results_kept_in_memory_are_written_at_a_graceful_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result done while the disk was full, with no write after it once space came back,
    stayed in memory only: a graceful stop lost it, and after the restart its client read it
    as failed (hunt, from the code). The stop writes it."""
    import sqlite3

    from starlette.testclient import TestClient

    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.server import create_app
    from tinker_sr.server.state import COMPLETE, ServerState

    app = create_app(LocalBackend(tmp_path / "store"), close_backend=True)
    with TestClient(app):
        server = app.state.tinker_server
        server.state.add_future(
            "r0", owner="o", session_id=None, kind="Forward", dedupe_key="k0",
            body_hash=None, promise={"request_id": "r0"},
        )  # fmt: skip
        real = server.state.complete_future

        def full(*args: Any) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(server.state, "complete_future", full)
        server.futures._record("r0", (COMPLETE, "json", b'"done"', None, None))
        assert server.futures._kept  # in memory only
        monkeypatch.setattr(server.state, "complete_future", real)  # space is back
    state = ServerState(tmp_path / "store" / "server.sqlite")
    try:
        row = state.get_future("r0")
        assert row is not None and row.status == COMPLETE and row.result == b'"done"', row
    finally:
        state.close()


def test_finished_results_kept_for_polls_are_capped_in_bytes_not_only_in_count() -> None:
    """Before: the 256 most recent results stayed in memory whatever their size (a sample
    with prompt log-probs or a large forward is megabytes: 256 of 8 MiB held 2 GiB). Now they
    are also capped at 64 MiB; older ones are read from SQLite when polled."""
    from tinker_sr.server.futures import Background, Futures
    from tinker_sr.server.state import COMPLETE, ServerState

    state = ServerState(None)
    futures = Futures(state, Background(), long_poll_s=1.0, max_pending_samples=8)
    big = b"x" * (8 << 20)
    for i in range(20):
        state.add_future(
            f"r{i}", owner="o", session_id=None, kind="Forward", dedupe_key=f"k{i}",
            body_hash=None, promise={"request_id": f"r{i}"},
        )  # fmt: skip
        futures._record(f"r{i}", (COMPLETE, "json", big, None, None))
        futures._settled(f"r{i}")
    held = sum(len(row.result or b"") for row in futures._recent.values())
    assert held <= 64 << 20 and "r19" in futures._recent and "r0" not in futures._recent
    assert all(futures.lookup(f"r{i}", "o").result == big for i in range(20))
