"""A graceful stop (SIGTERM) of `tinker-sr serve` with OpenAI and Anthropic answers being
sampled (found by a hunt): before, the server waited out uvicorn's 5 s of grace and then cut
every stream mid-body (``incomplete chunked read`` in the client, no error event, no end) and
logged a 40-line traceback per stream. Now each stream ends at once with an error event
saying the server is stopping, and an answer not streamed is a 503."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("transformers")

from tests._server import ServerProcess, serving_model_dir  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402

KEY = {"Authorization": "Bearer tml-stop", "x-api-key": "tml-stop"}
LONG = 20_000  # new tokens: far more than the stop leaves time for


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    model_dir = make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3")
    with serving_model_dir(tmp_path_factory, model_dir) as srv:
        yield srv, model_dir


def _read(
    url: str, body: dict[str, Any], began: threading.Event, out: dict[str, Any], key: str
) -> None:
    events: list[str] = []
    try:
        with httpx.stream("POST", url, json=body, headers=KEY, timeout=120) as resp:
            out[key + ":status"] = resp.status_code
            if not body.get("stream") or resp.status_code != 200:
                began.set()
                out[key] = resp.read().decode()
                return
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    began.set()
        out[key] = events
    except Exception as e:  # what the client saw, for the assertions
        out[key] = e
        began.set()


def test_a_graceful_stop_ends_answers_being_sampled_with_an_error(
    server: tuple[ServerProcess, Path],
) -> None:
    srv, model_dir = server
    model = str(model_dir)
    oai = srv.base_url + "/oai/api/v1"
    hi = [{"role": "user", "content": "Hi there"}]
    requests = {
        "completions": (oai + "/completions",
                        {"prompt": "hello", "max_tokens": LONG, "n": 2, "stream": True}),
        "chat": (oai + "/chat/completions",
                 {"messages": hi, "max_tokens": LONG, "stream": True}),
        "anthropic": (srv.base_url + "/anthropic/api/v1/messages",
                      {"messages": hi, "max_tokens": LONG, "stream": True}),
        "whole": (oai + "/completions", {"prompt": "hello", "max_tokens": LONG}),
    }  # fmt: skip
    out: dict[str, Any] = {}
    threads = []
    for key, (url, body) in requests.items():
        began = threading.Event()
        # Greedy: this random model's greedy answers never end (its EOS is not their argmax).
        body = {"model": model, "temperature": 0.0, **body}
        t = threading.Thread(target=_read, args=(url, body, began, out, key), daemon=True)
        t.start()
        threads.append((t, began))
    for (_, began), key in zip(threads, requests, strict=True):
        if key != "whole":  # its reply comes at the end: begun alongside the others
            assert began.wait(120), out
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(timeout=120)  # (uvicorn re-raises the signal once it has stopped)
    for t, _ in threads:
        t.join(60)
    for key in ("completions", "chat"):
        events = out[key]
        assert isinstance(events, list), (key, events)
        last = json.loads(events[-1])
        assert last["error"]["code"] == 503 and "stopping" in last["error"]["message"], last
    anthropic = out["anthropic"]
    assert isinstance(anthropic, list), anthropic
    last = json.loads(anthropic[-1])
    assert last["type"] == "error" and "stopping" in last["error"]["message"], last
    assert out["whole:status"] == 503 and "stopping" in out["whole"], out["whole"]
    assert "Exception in ASGI application" not in srv.log(), srv.log()
