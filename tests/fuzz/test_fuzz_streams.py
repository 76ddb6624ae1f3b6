"""Property: a streamed answer of the OpenAI- and Anthropic-compatible routes, sent while it is
sampled (`server.live_stream`), joins to the very answer the same request gets unstreamed,
whatever its prompt, stop strings (pieces of the answer itself, texts of the vocabulary's odd
characters, partial UTF-8), ``n``, length, sampling parameters and special-token handling;
and the request is refused the same way streamed or not. Against a real server on a tiny
BPE model directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._server import ServerProcess, serving_model_dir
from tests.fuzz.conftest import FUZZ, scaled
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

pytest.importorskip("transformers")

KEY = {"Authorization": "Bearer tml-fuzz-streams"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    model_dir = make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny")
    with serving_model_dir(tmp_path_factory, model_dir) as srv:
        yield srv, str(model_dir)


def _events(body: str) -> list[dict[str, Any]]:
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def _streamed_oai(events: list[dict[str, Any]], chat: bool) -> tuple[dict[int, str], dict[int, str]]:  # fmt: skip
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for e in events:
        assert "error" not in e, e
        for c in e["choices"]:
            piece = (c["delta"].get("content") if chat else c["text"]) or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons


stops = st.lists(
    st.one_of(
        st.sampled_from(["a", "e", " ", "\n", "th", "\ufffd", "é", "<|im_end|>", "zzz"]),
        st.text(min_size=1, max_size=3),
    ),
    max_size=3,
)
requests = st.fixed_dictionaries(
    {
        "max_tokens": st.integers(1, 48),
        "n": st.integers(1, 3),
        "seed": st.integers(0, 2**31 - 1),
        "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5]),
        "top_p": st.sampled_from([1.0, 0.9, 0.5]),
        "stop": stops,
        "skip_special_tokens": st.booleans(),
    }
)


@settings(FUZZ, max_examples=scaled(40))
@given(
    body=requests,
    chat=st.booleans(),
    prompt=st.text(max_size=20),
    from_answer=st.integers(0, 8),
)
def test_a_streamed_answer_joins_to_the_unstreamed_one(
    served: tuple[ServerProcess, str],
    body: dict[str, Any],
    chat: bool,
    prompt: str,
    from_answer: int,
) -> None:
    srv, model = served
    route = "chat/completions" if chat else "completions"
    ask = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt or " "}
    url = f"{srv.base_url}/oai/api/v1/{route}"
    whole = httpx.post(url, json={"model": model, **ask, **body}, headers=KEY, timeout=60)
    if whole.status_code == 200 and from_answer:  # a stop string taken from the answer itself
        text = whole.json()["choices"][0]["message" if chat else "text"]
        text = text["content"] if chat else text
        if len(text) > from_answer:
            body = {**body, "stop": [*body["stop"], text[from_answer - 1 : from_answer + 1]]}
            whole = httpx.post(url, json={"model": model, **ask, **body}, headers=KEY, timeout=60)
    streamed = httpx.post(
        url, json={"model": model, **ask, **body, "stream": True}, headers=KEY, timeout=60
    )
    assert streamed.status_code == whole.status_code, (streamed.text[:500], whole.text[:500])
    if whole.status_code != 200:
        assert streamed.json() == whole.json()
        return
    want = {
        c["index"]: (c["message"]["content"] if chat else c["text"])
        for c in whole.json()["choices"]
    }
    texts, reasons = _streamed_oai(_events(streamed.text), chat)
    assert {i: t for i, t in texts.items() if t} == {i: t for i, t in want.items() if t}
    assert reasons == {c["index"]: c["finish_reason"] for c in whole.json()["choices"]}


@settings(FUZZ, max_examples=scaled(25))
@given(
    max_tokens=st.integers(1, 48),
    stop_sequences=st.lists(st.text(min_size=1, max_size=3), max_size=2),
    prompt=st.text(min_size=1, max_size=20),
)
def test_a_streamed_message_joins_to_the_unstreamed_one(
    served: tuple[ServerProcess, str], max_tokens: int, stop_sequences: list[str], prompt: str
) -> None:
    srv, model = served
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    if stop_sequences:
        body["stop_sequences"] = stop_sequences
    url = f"{srv.base_url}/anthropic/api/v1/messages"
    whole = httpx.post(url, json=body, headers=KEY, timeout=60)
    streamed = httpx.post(url, json={**body, "stream": True}, headers=KEY, timeout=60)
    assert streamed.status_code == whole.status_code, (streamed.text[:500], whole.text[:500])
    if whole.status_code != 200:
        return
    events = _events(streamed.text)
    assert not [e for e in events if e["type"] == "error"], events
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    message = whole.json()
    assert text == message["content"][0]["text"]
    last = next(e for e in events if e["type"] == "message_delta")
    assert last["delta"]["stop_reason"] == message["stop_reason"]
    assert last["usage"]["output_tokens"] == message["usage"]["output_tokens"]
