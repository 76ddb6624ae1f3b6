"""OpenAI-compatible inference on `tinker-sr serve` (``/oai/api/v1``), driven by the real
`openai` client as a user points it at the server: its answers are the engine's own samples
(the same tokens and log-probs as the official SDK's `SamplingClient` with the same seed),
chat prompts are the model's chat template, a trained checkpoint is served by its tinker://
path, a streamed answer comes while it is sampled and reassembles to the same answer, what it
samples is counted in the caller's usage, and what is not supported is refused with a 400
naming the field."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
tinker = pytest.importorskip("tinker")

from tests._server import (  # noqa: E402
    ServerProcess,
    official_sdk_sample,
    running_server,
    serving_model_dir,
)
from tests._train import cross_entropy_steps  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.hf import ModelTokenizer, load_hf_tokenizer  # noqa: E402

HI = [{"role": "user", "content": "Hi there"}]


# Qwen3's switch: with enable_thinking false the template writes an empty thought.
NO_THINKING = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] += NO_THINKING
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    with serving_model_dir(tmp_path_factory, model_dir) as srv:
        yield srv


def client(server: ServerProcess, key: str = "tml-oai-user") -> Any:
    return openai.OpenAI(base_url=server.base_url + "/oai/api/v1", api_key=key, max_retries=0)


def sdk(server: ServerProcess, key: str = "tml-oai-user") -> Any:
    return tinker.ServiceClient(base_url=server.base_url, api_key=key)


def sample_with_sdk(server: ServerProcess, model_dir: Path, ids: list[int], n: int, **params: Any) -> Any:  # fmt: skip
    """The official SDK's sample of ``ids`` (the oracle), under this file's key."""
    return official_sdk_sample(server, str(model_dir), ids, n, "tml-oai-user", **params)


def test_completions_are_the_engines_samples(server: ServerProcess, model_dir: Path) -> None:
    """Token ids in, the same tokens and log-probs out as the official SDK's sampler with the
    same seed; the text is their decoding; usage counts both sides."""
    from tinker_sr.server.handlers.oai import token_text
    from tinker_sr.tokenization.hf import ModelTokenizer

    tok, table = load_hf_tokenizer(model_dir), ModelTokenizer(model_dir).token_bytes
    prompt = tok.encode("The quick brown fox", add_special_tokens=True)
    got = client(server).completions.create(
        model=str(model_dir), prompt=prompt, max_tokens=12, n=3, seed=7, logprobs=0
    )
    want = sample_with_sdk(server, model_dir, prompt, 3, max_tokens=12, seed=7)
    assert len({c.text for c in got.choices}) == 3  # samples within one request differ
    for choice, seq in zip(got.choices, want.sequences, strict=True):
        # an incomplete last character (cut by max_tokens) is not said, as in vLLM
        assert choice.text == tok.decode(seq.tokens, skip_special_tokens=True).rstrip("\ufffd")
        assert choice.logprobs.tokens == [token_text(tok.decode([t]), table[t]) for t in seq.tokens]
        assert choice.logprobs.token_logprobs == pytest.approx(seq.logprobs, abs=0, rel=1e-6)
        assert choice.finish_reason == ("length" if seq.stop_reason == "length" else "stop")
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == sum(len(s.tokens) for s in want.sequences)


def test_chat_renders_the_models_own_template(server: ServerProcess, model_dir: Path) -> None:
    tok = load_hf_tokenizer(model_dir)
    ids = tok.apply_chat_template(HI, add_generation_prompt=True, return_dict=False)
    got = client(server).chat.completions.create(
        model=str(model_dir), messages=HI, max_tokens=10, seed=3, logprobs=True, top_logprobs=3
    )
    seq = sample_with_sdk(server, model_dir, ids, 1, max_tokens=10, seed=3).sequences[0]
    assert got.usage.prompt_tokens == len(ids)
    msg = got.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == tok.decode(seq.tokens, skip_special_tokens=True).rstrip("\ufffd")
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(seq.logprobs, rel=1e-6)
    assert all(len(c.top_logprobs) == 3 for c in content)
    # the drawn token is among the 3 most likely or scored below the third
    assert all(c.logprob <= c.top_logprobs[0].logprob + 1e-6 for c in content)
    # chat_template_kwargs reach the template (Qwen3's enable_thinking changes the prompt)
    plain = client(server).chat.completions.create(
        model=str(model_dir),
        messages=HI,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    off = tok.apply_chat_template(
        HI, add_generation_prompt=True, return_dict=False, enable_thinking=False
    )
    assert plain.usage.prompt_tokens == len(off) != len(ids)


def test_stop_strings_end_the_text_before_them(server: ServerProcess, model_dir: Path) -> None:
    oai = client(server)
    free = oai.completions.create(model=str(model_dir), prompt="Once", max_tokens=24, seed=11)
    text = free.choices[0].text
    stop = text[6:9]
    assert len(stop) == 3 and stop.strip(), text
    cut = oai.completions.create(
        model=str(model_dir), prompt="Once", max_tokens=24, seed=11, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_streaming_reassembles_to_the_same_answer(server: ServerProcess, model_dir: Path) -> None:
    oai = client(server)
    kw: dict[str, Any] = dict(model=str(model_dir), messages=HI, max_tokens=8, seed=5, n=2)
    whole = oai.chat.completions.create(**kw)
    parts: dict[int, str] = {0: "", 1: ""}
    reasons, usage = {}, None
    for chunk in oai.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert parts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens
    pieces = list(
        oai.completions.create(model=str(model_dir), prompt="a", max_tokens=4, seed=1, stream=True)
    )
    plain = oai.completions.create(model=str(model_dir), prompt="a", max_tokens=4, seed=1)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text


def _streamed(oai: Any, chat: bool, **kw: Any) -> tuple[dict[int, list[str]], dict[int, str]]:
    """Each choice's text pieces, in order, and its finish reason, from a streamed request."""
    pieces: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    create = oai.chat.completions.create if chat else oai.completions.create
    for chunk in create(**kw, stream=True):
        for c in chunk.choices:
            text = (c.delta.content if chat else c.text) or ""
            if text:
                pieces.setdefault(c.index, []).append(text)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return pieces, reasons


@pytest.mark.parametrize("chat", [True, False])
def test_a_streamed_answer_comes_as_it_is_sampled(
    server: ServerProcess, model_dir: Path, chat: bool
) -> None:
    """The text is sent while the engine decodes, in many pieces (before: one piece after the
    whole sample), and they join to the very answer of the same request unstreamed, with a
    stop string cut where the whole answer cuts it (a piece never runs past a stop string
    that later tokens complete)."""
    oai = client(server)
    ask: dict[str, Any] = {"messages": HI} if chat else {"prompt": "The quick brown fox"}
    kw: dict[str, Any] = dict(model=str(model_dir), max_tokens=40, seed=11, n=2, **ask)

    def whole(**more: Any) -> list[Any]:
        if chat:
            return oai.chat.completions.create(**kw, **more).choices
        return oai.completions.create(**kw, **more).choices

    def text(c: Any) -> str:
        return str(c.message.content if chat else c.text)

    plain = whole()
    pieces, reasons = _streamed(oai, chat, **kw)
    assert {i: "".join(p) for i, p in pieces.items()} == {c.index: text(c) for c in plain}
    assert reasons == {c.index: c.finish_reason for c in plain}
    assert all(len(p) > 3 for p in pieces.values()), pieces  # sent as it was sampled
    answer = text(plain[0])
    stop = answer[len(answer) // 2 : len(answer) // 2 + 3]
    cut = whole(stop=[stop])
    pieces, reasons = _streamed(oai, chat, **kw, stop=[stop])
    assert {i: "".join(p) for i, p in pieces.items()} == {c.index: text(c) for c in cut if text(c)}
    assert reasons == {c.index: c.finish_reason for c in cut} and reasons[0] == "stop"
    assert stop not in "".join(pieces[0])


def _streamed_logprobs(oai: Any, chat: bool, **kw: Any) -> dict[int, list[Any]]:
    """Each choice's log-probs, as the chunks of a streamed request carry them, in order."""
    got: dict[int, list[Any]] = {}
    create = oai.chat.completions.create if chat else oai.completions.create
    for chunk in create(**kw, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                got.setdefault(c.index, []).append(c.logprobs)
    return got


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_log_probs_come_as_they_are_sampled(
    server: ServerProcess, model_dir: Path, chat: bool
) -> None:
    """With log-probs asked for, a stream still comes while the engine decodes (before: whole,
    in one chunk per choice), and each choice's chunks' log-probs join to the unstreamed
    answer's: entries, alternatives and (`/completions`) text offsets; also where a stop
    string cuts the answer."""
    oai = client(server)
    ask: dict[str, Any] = (
        {"messages": HI, "logprobs": True, "top_logprobs": 3}
        if chat
        else {"prompt": "The quick brown fox", "logprobs": 2}
    )
    kw: dict[str, Any] = dict(model=str(model_dir), max_tokens=40, seed=11, n=2, **ask)
    create = oai.chat.completions.create if chat else oai.completions.create

    def joined(parts: list[Any]) -> Any:
        if chat:
            return [e.model_dump() for p in parts for e in p.content]
        return {k: [v for p in parts for v in getattr(p, k)]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}  # fmt: skip

    for more in ({}, {"stop": None}):
        plain = create(**kw, **more).choices
        if "stop" in more:  # a stop string from the middle of the first answer
            text = str(plain[0].message.content if chat else plain[0].text)
            more = {"stop": [text[len(text) // 2 : len(text) // 2 + 3]]}
            plain = create(**kw, **more).choices
            assert plain[0].finish_reason == "stop"
        streamed = _streamed_logprobs(oai, chat, **kw, **more)
        assert {i: joined(parts) for i, parts in streamed.items()} == {
            c.index: joined([c.logprobs]) for c in plain
        }
        pieces, _ = _streamed(oai, chat, **kw, **more)
        assert {i: "".join(p) for i, p in pieces.items()} == {
            c.index: (c.message.content if chat else c.text) for c in plain if c.index in pieces
        }
    scored = [
        [p for p in parts if (p.content if chat else p.tokens)] for parts in streamed.values()
    ]
    assert all(len(parts) > 3 for parts in scored), scored  # sent as it was sampled


def test_several_prompts_stream_while_sampled(server: ServerProcess, model_dir: Path) -> None:
    """`/completions` with a list of prompts streams each prompt's choices as they are sampled
    (before: the whole answer, one piece per choice), indexed as unstreamed (prompt i's j-th
    sample is choice i * n + j), joined to the very texts and log-probs."""
    oai = client(server)
    kw: dict[str, Any] = dict(
        model=str(model_dir), prompt=["The quick brown fox", "a b", "x"], n=2, max_tokens=40,
        seed=5, logprobs=1,
    )  # fmt: skip
    plain = oai.completions.create(**kw).choices
    pieces, reasons = _streamed(oai, False, **kw)
    assert {i: "".join(p) for i, p in pieces.items()} == {c.index: c.text for c in plain if c.text}
    assert reasons == {c.index: c.finish_reason for c in plain} and len(reasons) == 6
    streamed = _streamed_logprobs(oai, False, **kw)
    assert {i: [t for p in parts for t in p.tokens] for i, parts in streamed.items()} == {
        c.index: c.logprobs.tokens for c in plain
    }
    assert sum(len(p) > 3 for p in pieces.values()) >= 3, pieces  # sent as they were sampled


def test_a_bad_later_prompt_is_refused_before_a_stream_begins(
    server: ServerProcess, model_dir: Path
) -> None:
    """Several prompts, the second with a token id outside the vocabulary: streamed as
    unstreamed, a 400 naming ``prompt`` (before: the first prompt's sample had begun, so the
    stream began with a 200 and ended in a 500 error event), and the first prompt's sample is
    stopped, not run to its end for nobody."""
    key = "tml-oai-bad-later-prompt"
    oai = client(server, key)
    kw: dict[str, Any] = dict(model=str(model_dir), max_tokens=200, seed=3)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(**kw, prompt=[[5, 17, 230], [5, 10**8]], stream=stream)
        assert err.value.body["param"] == "prompt" and "prompt token id" in err.value.message
    # the first prompt's samples stopped with their requests (before: each ran on to its end,
    # no later than the same prompt sent alone after them)
    alone = oai.completions.create(**kw, prompt=[5, 17, 230]).usage.completion_tokens
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    report = tinker.AdminClient(base_url=server.base_url, api_key=key)
    usage = report.get_billing_usage(now, now + timedelta(hours=1)).result()
    sampled = sum(
        e.event_info.token_count for e in usage.data if e.event_info.type == "sampling_sample"
    )
    assert alone > 20 and sampled < 2 * alone, (sampled, alone)


def test_an_echoed_answer_streams_its_prompt_first(server: ServerProcess, model_dir: Path) -> None:
    """With ``echo``, a stream's first piece of each choice begins with its prompt's text,
    then the answer comes as it is sampled (before: whole); joined, the text and log-probs (the
    prompt's come at the end, once the engine has scored it) are the unstreamed answer's."""
    oai = client(server)
    prompt = "The quick brown fox"
    kw: dict[str, Any] = dict(
        model=str(model_dir), prompt=prompt, n=2, max_tokens=40, seed=9, echo=True, logprobs=1
    )
    plain = oai.completions.create(**kw).choices
    pieces, reasons = _streamed(oai, False, **kw)
    assert {i: "".join(p) for i, p in pieces.items()} == {c.index: c.text for c in plain}
    assert all(p[0].startswith(prompt) and len(p) > 3 for p in pieces.values()), pieces
    streamed = _streamed_logprobs(oai, False, **kw)
    assert {i: [t for p in parts for t in p.token_logprobs] for i, parts in streamed.items()} == {
        c.index: c.logprobs.token_logprobs for c in plain
    }


def test_a_stream_left_early_stops_its_sample(server: ServerProcess, model_dir: Path) -> None:
    """A client that closes a stream after its first pieces: the server stops decoding it, so
    only what it finished counts in the caller's usage. The same request sent whole right
    after decodes the same tokens beside it, so had the first gone on it would have finished
    (and been counted) no later than the second."""
    key = "tml-oai-leaver"
    oai = client(server, key)
    kw: dict[str, Any] = dict(model=str(model_dir), prompt="a b", max_tokens=200, seed=3)
    stream = oai.completions.create(**kw, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    whole = oai.completions.create(**kw)
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    report = tinker.AdminClient(base_url=server.base_url, api_key=key)
    usage = report.get_billing_usage(now, now + timedelta(hours=1)).result()
    sampled = sum(
        e.event_info.token_count for e in usage.data if e.event_info.type == "sampling_sample"
    )
    assert whole.usage.completion_tokens > 10 and sampled == whole.usage.completion_tokens


def test_greedy_is_repeatable_without_a_seed(server: ServerProcess, model_dir: Path) -> None:
    oai = client(server)
    runs = [
        oai.completions.create(model=str(model_dir), prompt="x y", max_tokens=8, temperature=0)
        for _ in range(2)
    ]
    assert runs[0].choices[0].text == runs[1].choices[0].text


def test_echo_scores_a_prompt_and_a_trained_checkpoint_is_served_by_its_path(
    server: ServerProcess, model_dir: Path
) -> None:
    """lm-eval-harness's log-likelihood request (echo, max_tokens 0, logprobs) scores the
    prompt; after training on a text, its checkpoint (by tinker:// path, alone or after its
    base model) scores that text higher than the base model does."""
    tok = load_hf_tokenizer(model_dir)
    text = "the cat sat on the mat and the cat sat"
    ids = tok.encode(text, add_special_tokens=True)

    def score(model: str) -> float:
        r = client(server).completions.create(
            model=model, prompt=text, max_tokens=0, echo=True, logprobs=1
        )
        lps = r.choices[0].logprobs.token_logprobs
        assert r.choices[0].text == text and lps[0] is None and len(lps) == len(ids)
        return float(sum(lps[1:]))

    service = sdk(server)
    try:
        training = service.create_lora_training_client(base_model=str(model_dir), rank=8)
        cross_entropy_steps(training, tinker, ids, steps=4, lr=5e-3)
        path = training.save_weights_for_sampler("oai").result().path
        base_scored = sum(
            x
            for x in service.create_sampling_client(base_model=str(model_dir))
            .compute_logprobs(tinker.ModelInput.from_ints(ids))
            .result()[1:]
        )
    finally:
        service.holder.close()
    base = score(str(model_dir))
    assert base == pytest.approx(base_scored, rel=1e-5)
    trained = score(path)
    assert trained > base + 1.0
    assert score(f"{model_dir};{path}") == trained
    with pytest.raises(openai.BadRequestError, match="was trained on") as e:
        client(server).completions.create(model=f"tinker-sr/tiny;{path}", prompt="a")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):  # another key cannot read it
        client(server, "tml-someone-else").completions.create(model=path, prompt="a")


def test_what_it_samples_is_in_the_callers_usage(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> None:
    store = tmp_path_factory.mktemp("oai-usage") / "store"
    with running_server(store, extra_args=["--model-dir", str(model_dir)]) as srv:
        oai = client(srv, "tml-usage-oai")
        a = oai.completions.create(model=str(model_dir), prompt=["ab", "cd e"], max_tokens=5, n=2)
        b = oai.chat.completions.create(model=str(model_dir), messages=HI, max_tokens=3)
        now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        report = tinker.AdminClient(base_url=srv.base_url, api_key="tml-usage-oai")
        usage = report.get_billing_usage(now, now + timedelta(hours=1)).result()
    totals: dict[str, int] = {}
    for e in usage.data:
        kind = e.event_info.type + ("_cached" if getattr(e.event_info, "cached", False) else "")
        totals[kind] = totals.get(kind, 0) + e.event_info.token_count
    sampled = a.usage.completion_tokens + b.usage.completion_tokens
    assert totals.get("sampling_sample") == sampled, totals
    prompts = a.usage.prompt_tokens + b.usage.prompt_tokens
    assert totals.get("sampling_prefill", 0) + totals.get("sampling_prefill_cached", 0) == prompts


def test_models_lists_the_servers_base_models(server: ServerProcess, model_dir: Path) -> None:
    ids = [m.id for m in client(server).models.list()]
    assert str(model_dir) in ids and "tinker-sr/tiny" in ids


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty", "penalties are not implemented"),
        ({"frequency_penalty": 1}, "frequency_penalty", "penalties are not implemented"),
        ({"logit_bias": {"5": 10}}, "logit_bias", "logit_bias is not implemented"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
        ({"tool_choice": "auto"}, "tool_choice", "tool calling is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "only {'type': 'text'}"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "chat_template_kwargs"),
        ({"n": 0}, "n", "n must be between 1 and"),
        ({"temperature": "hot"}, "temperature", "temperature must be a number"),
        ({"top_p": 0}, "top_p", "top_p must be above 0"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
        ({"stop": [""]}, "stop", "non-empty string"),
        ({"stop": ["x", "y" * 1025]}, "stop", "stop[1] is 1,025 characters long"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "differ"),
        ({"max_tokens": 100_000}, "max_tokens", "context"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
        ({"guided_json": {}}, "guided_json", "unrecognized request argument"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "only text content",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be system"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"model": "no/such-model"}, "model", "is not available on this server"),
        ({"chat_template_kwargs": {"tokenize": False}}, "tokenize", "set by the server"),
    ],
)
def test_chat_refuses_what_it_does_not_do_naming_the_field(
    server: ServerProcess, model_dir: Path, extra: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": str(model_dir), "messages": HI, "max_tokens": 2, **extra}
    with pytest.raises(openai.APIStatusError) as e:
        client(server).chat.completions.create(
            **{"model": body.pop("model"), "messages": body.pop("messages")}, extra_body=body
        )
    assert e.value.status_code in (400, 404)
    assert e.value.body["param"] == param and message in e.value.body["message"], e.value.body


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"prompt": []}, "prompt", "prompt must be a string"),
        ({"prompt": [[1, 2], "x", 3]}, "prompt", "prompt must be a string"),
        ({"prompt": ["x", [1, 2]]}, "prompt", "prompt must be a string"),
        ({"max_tokens": 0}, "max_tokens", "needs echo: true"),
        ({"best_of": 3}, "best_of", "only 1 is supported"),
        ({"suffix": "end"}, "suffix", "fill-in-the-middle"),
        ({"logprobs": 21}, "logprobs", "between 0 and 20"),
        ({"echo": "yes"}, "echo", "true or false"),
    ],
)
def test_completions_refuse_what_they_do_not_do_naming_the_field(
    server: ServerProcess, model_dir: Path, extra: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": str(model_dir), "prompt": "hello", "max_tokens": 2, **extra}
    resp = httpx.post(
        server.base_url + "/oai/api/v1/completions",
        json=body,
        headers={"Authorization": "Bearer tml-oai-user"},
        timeout=60,
    )
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == param and message in err["message"], err


def test_a_prompt_that_fills_the_context_is_refused_in_openai_terms(
    server: ServerProcess, model_dir: Path
) -> None:
    """One new token after a prompt as long as the context: refused naming the prompt, without
    the advice on the Tinker SDK's compute_logprobs that the Tinker routes give."""
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    resp = httpx.post(
        server.base_url + "/oai/api/v1/completions",
        json={"model": str(model_dir), "prompt": [5] * context, "max_tokens": 1},
        headers={"Authorization": "Bearer tml-oai-user"},
        timeout=60,
    )
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "prompt", err
    assert "context window" in err["message"] and f"> {context}" in err["message"], err
    assert "compute_logprobs" not in err["message"], err


def test_keys_bodies_and_routes_are_answered_as_openai_does(
    server: ServerProcess, model_dir: Path
) -> None:
    with pytest.raises(openai.AuthenticationError, match="must start with 'tml-'"):
        client(server, "sk-not-tinker").models.list()
    url = server.base_url + "/oai/api/v1"
    auth = {"Authorization": "Bearer tml-oai-user"}
    resp = httpx.post(url + "/completions", content=b"{not json", headers=auth, timeout=30)
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    resp = httpx.post(url + "/embeddings", json={}, headers=auth, timeout=30)
    assert resp.status_code == 404 and "/chat/completions" in resp.json()["error"]["message"]
    # the built-in models have no chat template: said, with the way out
    # (not "pass chat_template=...", which these routes refuse)
    with pytest.raises(openai.BadRequestError, match="no chat template .* use /completions"):
        client(server).chat.completions.create(model="tinker-sr/tiny", messages=HI)
    # the Tinker API's own routes keep their error format
    resp = httpx.get(server.base_url + "/api/v1/nope", headers={"X-API-Key": "tml-a"}, timeout=30)
    assert "detail" in resp.json()
    assert json.loads(httpx.get(url + "/models", headers=auth, timeout=30).text)["object"] == "list"


_SURROGATE = b'"\\ud800"'  # JSON can spell it; no tokenizer can encode it


@pytest.mark.parametrize(
    ("route", "body", "param", "message"),
    [
        ("chat", {"messages": [{"role": "user", "content": None}]}, "messages", "cannot render"),
        ("chat", {"messages": [{"role": "user"}]}, "messages", "cannot render"),
        ("chat", {"chat_template_kwargs": {"documents": 5}}, "chat_template_kwargs", "render"),
        (
            "chat",
            {"chat_template_kwargs": {"continue_final_message": True}},
            "chat_template_kwargs",
            "cannot render",
        ),  # fmt: skip
        ("chat", {"chat_template_kwargs": {"messages": []}}, "messages", "set by the server"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "SURROGATE"}]},
            "messages[0].content",
            "not valid Unicode",
        ),  # fmt: skip
        ("completions", {"prompt": "SURROGATE"}, "prompt", "not valid Unicode"),
        ("completions", {"stop": ["SURROGATE"]}, "stop[0]", "not valid Unicode"),
        ("completions", {"user": 5}, "user", "must be a string"),
        ("completions", {"metadata": "x"}, "metadata", "an object of strings"),
        ("chat", {"store": "yes"}, "store", "true or false"),
        ("chat", {"parallel_tool_calls": []}, "parallel_tool_calls", "true or false"),
        ("completions", {"best_of": True}, "best_of", "only 1"),
        ("completions", {"prompt": "NESTED"}, None, "nested too deeply"),
    ],
)
def test_what_would_break_the_template_or_the_tokenizer_is_a_400_naming_it(
    server: ServerProcess,
    model_dir: Path,
    route: str,
    body: dict[str, Any],
    param: str | None,
    message: str,
) -> None:
    """Messages the chat template cannot render, template arguments that break it, strings
    with lone surrogates, wrong types of the ignored fields and bodies nested too deeply to
    read: each a 400 in OpenAI's shape naming the field (were 500s, or accepted)."""
    base: dict[str, Any] = {"model": str(model_dir), "max_tokens": 2}
    base |= {"messages": HI} if route == "chat" else {"prompt": "hello"}
    raw = json.dumps({**base, **body}).encode()
    raw = raw.replace(b'"SURROGATE"', _SURROGATE).replace(b'"NESTED"', b"[" * 5000 + b"]" * 5000)
    resp = httpx.post(
        f"{server.base_url}/oai/api/v1/{'chat/completions' if route == 'chat' else 'completions'}",
        content=raw,
        headers={"Authorization": "Bearer tml-oai-user", "Content-Type": "application/json"},
        timeout=60,
    )
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == param, err
    assert message in err["message"] and err["type"] == "invalid_request_error", err


def test_a_kept_sampler_is_served_only_while_its_checkpoint_is_readable(
    server: ServerProcess, model_dir: Path
) -> None:
    """A sampler kept for a tinker:// path serves it only while the key may still read the
    checkpoint: once unpublished another key gets 404, once deleted its owner too (both were
    still served from the kept sampler)."""
    service = sdk(server, "tml-oai-owner")
    try:
        training = service.create_lora_training_client(base_model=str(model_dir), rank=4)
        path = training.save_weights_for_sampler("kept").result().path
        rest = tinker.RestClient(base_url=server.base_url, api_key="tml-oai-owner")
        rest.publish_checkpoint_from_tinker_path(path).result()
        owner, other = client(server, "tml-oai-owner"), client(server, "tml-oai-other")
        for oai in (owner, other):
            assert oai.completions.create(model=path, prompt="a", max_tokens=2).choices
        rest.unpublish_checkpoint_from_tinker_path(path).result()
        with pytest.raises(openai.NotFoundError):
            other.completions.create(model=path, prompt="a", max_tokens=2)
        assert owner.completions.create(model=path, prompt="a", max_tokens=2).choices
        rest.delete_checkpoint_from_tinker_path(path).result()
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            owner.completions.create(model=path, prompt="a", max_tokens=2)
    finally:
        service.holder.close()


def test_chat_logprob_bytes_are_each_tokens_own(server: ServerProcess, model_dir: Path) -> None:
    """``bytes`` is the token's own bytes (a token may be part of a UTF-8 character, whose
    decoded text is U+FFFD), so joining them rebuilds the text; was the bytes of U+FFFD."""
    from tinker_sr.tokenization.hf import ModelTokenizer

    messages = [{"role": "user", "content": "日本語 🙂🎉 naïve"}]
    tok = load_hf_tokenizer(model_dir)
    table = ModelTokenizer(model_dir).token_bytes
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    got = client(server).chat.completions.create(
        model=str(model_dir), messages=messages, max_tokens=40, seed=5, logprobs=True
    )
    seq = sample_with_sdk(server, model_dir, ids, 1, max_tokens=40, seed=5).sequences[0]
    want = [table[t] or tok.decode([t]).encode() for t in seq.tokens]
    assert [bytes(c.bytes) for c in got.choices[0].logprobs.content] == want
    assert any(tok.decode([t]) == "\ufffd" for t in seq.tokens)  # some token is a part


def _in_process(tmp_path: Path, **options: Any) -> Any:
    from starlette.testclient import TestClient

    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.limits import Limits
    from tinker_sr.server.app import create_app

    backend = LocalBackend(tmp_path, limits=Limits(**options.pop("limits", {})))
    app = create_app(backend, store_dir=tmp_path, close_backend=True, **options)
    return backend, TestClient(app, headers={"Authorization": "Bearer tml-in-process"})


def test_a_request_keeps_its_keys_session_alive(tmp_path: Path) -> None:
    """A request that waits longer than the session timeout is not cut off by its session's
    expiry (it was: 404 "unknown sampling session"), as an SDK's heartbeats keep theirs."""
    import asyncio

    backend, http = _in_process(tmp_path, session_timeout_s=0.5)
    sample = backend.sample

    async def slow_sample(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(1.5)  # e.g. queued behind others
        return await sample(*args, **kwargs)

    backend.sample = slow_sample
    body = {"model": "tinker-sr/tiny", "prompt": "hi", "max_tokens": 2}
    with http:
        for _ in range(2):
            resp = http.post("/oai/api/v1/completions", json=body)
            assert resp.status_code == 200, resp.json()


def test_the_prompts_of_one_request_share_its_token_limit(tmp_path: Path) -> None:
    """--max-sample-tokens bounds one request whatever number of prompts it lists (each
    prompt was checked alone, so a list of them could ask for any amount of work)."""
    _, http = _in_process(tmp_path, limits={"max_sample_tokens": 64})
    body: dict[str, Any] = {"model": "tinker-sr/tiny", "max_tokens": 6, "n": 4}
    with http:
        assert http.post("/oai/api/v1/completions", json={**body, "prompt": "ab"}).is_success
        resp = http.post("/oai/api/v1/completions", json={**body, "prompt": ["ab", "cd"]})
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "prompt", err
    assert "--max-sample-tokens" in err["message"], err


def test_above_the_pending_limit_a_request_is_asked_to_wait(tmp_path: Path) -> None:
    """OpenAI requests count among the server's pending sample requests (shared with
    asample): above ``max_pending_samples`` a 429 with Retry-After, which OpenAI clients wait
    out and retry; they were never throttled."""
    import asyncio
    import threading

    backend, http = _in_process(tmp_path, max_pending_samples=1)
    sample, release = backend.sample, threading.Event()

    async def held_sample(*args: Any, **kwargs: Any) -> Any:
        for _ in range(500):  # until released, at most ~5 s
            if release.is_set():
                break
            await asyncio.sleep(0.01)
        return await sample(*args, **kwargs)

    backend.sample = held_sample
    body = {"model": "tinker-sr/tiny", "prompt": "hi", "max_tokens": 2}
    with http:
        first: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: first.update(r=http.post("/oai/api/v1/completions", json=body))
        )
        worker.start()
        server = http.app.state.tinker_server
        while not server.futures.pending_samples:
            threading.Event().wait(0.01)
        second = http.post("/oai/api/v1/completions", json=body)
        release.set()
        worker.join(60)
        third = http.post("/oai/api/v1/completions", json=body)
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert "already pending" in second.json()["error"]["message"]
    assert first["r"].status_code == 200 and third.status_code == 200
    assert not server.futures.pending_samples


def test_partial_character_tokens_are_written_as_bytes(
    server: ServerProcess, model_dir: Path
) -> None:
    """A token that is part of a UTF-8 character decodes to U+FFFD; in log-probs it is
    written ``bytes:\\xNN`` as OpenAI does, so such alternatives keep distinct keys."""
    from tinker_sr.server.handlers.oai import token_text

    assert token_text("\ufffd", b"\xe6\x97") == "bytes:\\xe6\\x97"
    assert token_text("ab", b"ab") == "ab" and token_text("\ufffd", b"") == "\ufffd"
    got = client(server).completions.create(
        model=str(model_dir), prompt="日本語 🙂🎉", max_tokens=0, echo=True, logprobs=5
    )
    lp = got.choices[0].logprobs
    assert any(t.startswith("bytes:\\x") for t in lp.tokens), lp.tokens
    assert "\ufffd" not in "".join(lp.tokens)
    assert all(len(top) == 5 for top in lp.top_logprobs[1:])  # no two keys collapsed


def test_text_offsets_count_characters_of_the_text(server: ServerProcess, model_dir: Path) -> None:
    """``text_offset`` is each token's place in the answer's text, a token that is part of a
    character at that character's (before: the length of its ``bytes:\\xNN`` string was
    counted, 10 a byte, so offsets ran past the end of the text)."""
    oai = client(server)
    echo = oai.completions.create(
        model=str(model_dir), prompt="a☃b 日本語 🙂c", max_tokens=0, echo=True, logprobs=0
    )
    sampled = oai.completions.create(
        model=str(model_dir), prompt="日本", max_tokens=24, n=4, seed=3, logprobs=0
    )
    choices = [*echo.choices, *sampled.choices]
    assert any(t.startswith("bytes:") for c in choices for t in c.logprobs.tokens)
    for c in choices:
        tokens, offsets = c.logprobs.tokens, c.logprobs.text_offset
        assert offsets == sorted(offsets) and all(0 <= o <= len(c.text) for o in offsets)
        for t, o in zip(tokens, offsets, strict=True):
            if not t.startswith("bytes:") and "\ufffd" not in c.text[o : o + len(t)]:
                assert c.text[o : o + len(t)] == t, (c.text, tokens, offsets)
    text, offsets = echo.choices[0].text, echo.choices[0].logprobs.text_offset
    assert text == "a☃b 日本語 🙂c" and text[offsets[-1]] == "c", (text, offsets)
    # A special token the text leaves out adds nothing to it (its name's length was counted).
    tok = load_hf_tokenizer(model_dir)
    ids = [*tok.encode("ab"), tok.convert_tokens_to_ids("<|im_start|>"), *tok.encode("cd")]
    special = oai.completions.create(
        model=str(model_dir), prompt=ids, max_tokens=0, echo=True, logprobs=0
    ).choices[0]
    assert special.text == "abcd" and "<|im_start|>" in special.logprobs.tokens
    for t, o in zip(special.logprobs.tokens, special.logprobs.text_offset, strict=True):
        assert special.text[o : o + len(t)] == t or t == "<|im_start|>", special.logprobs


def test_the_field_at_fault_and_the_key_are_named(server: ServerProcess, model_dir: Path) -> None:
    url = server.base_url + "/oai/api/v1/completions"
    auth = {"Authorization": "Bearer tml-oai-user"}

    def error(body: dict[str, Any], headers: dict[str, str] = auth) -> tuple[int, Any]:
        resp = httpx.post(url, json={"model": str(model_dir), **body}, headers=headers, timeout=60)
        return resp.status_code, resp.json()["error"]

    status, err = error({"prompt": [5] * 50_000, "max_tokens": 1})  # the prompt alone
    assert status == 400 and err["param"] == "prompt", err
    status, err = error({"prompt": "hi", "max_tokens": 50_000})
    assert status == 400 and err["param"] == "max_tokens", err
    status, err = error({"prompt": [1, 10**6], "max_tokens": 1})
    assert status == 400 and err["param"] == "prompt" and "outside the vocabulary" in err["message"]
    status, err = error({"prompt": "hi"}, {})
    assert status == 401 and "Authorization: Bearer" in err["message"], err
    status, err = error({"prompt": "hi"}, {**auth, "X-API-Key": "tml-other"})
    assert status == 401 and "different keys" in err["message"], err


def test_greedy_log_probs_are_the_models_own(server: ServerProcess, model_dir: Path) -> None:
    """At temperature 0 the answer's log-probs and alternatives are the model's own (as vLLM
    reports them), not the greedy point mass's 0.0 with no alternatives: each token's equals
    the model's score of it after the prompt and the tokens before it, and is the best of
    its alternatives; the tokens are the Tinker sampler's greedy ones; streamed, the same."""
    oai = client(server)
    ids = [5, 17, 230, 31, 42, 7]
    kw: dict[str, Any] = dict(
        model=str(model_dir), prompt=ids, max_tokens=12, temperature=0, logprobs=5
    )
    got = oai.completions.create(**kw).choices[0]
    greedy = sample_with_sdk(server, model_dir, ids, 1, max_tokens=12, temperature=0.0)
    tokens = list(greedy.sequences[0].tokens)
    assert list(greedy.sequences[0].logprobs) == [0.0] * len(tokens)  # Tinker's: q's
    service = sdk(server)
    try:
        sampler = service.create_sampling_client(base_model=str(model_dir))
        want = sampler.compute_logprobs(tinker.ModelInput.from_ints(ids + tokens)).result()
    finally:
        service.holder.close()
    said = load_hf_tokenizer(model_dir).decode(tokens, skip_special_tokens=True)
    assert got.text == said.rstrip("\ufffd")  # an incomplete last character is not said
    lps = got.logprobs.token_logprobs
    assert len(lps) == len(tokens) and lps == pytest.approx(want[len(ids) :], abs=1e-4)
    assert all(len(t) == 5 and max(t.values()) == lp for t, lp in zip(got.logprobs.top_logprobs, lps, strict=True))  # fmt: skip
    assert all(lp < 0 for lp in lps)
    streamed = _streamed_logprobs(oai, False, **kw)
    assert [v for p in streamed[0] for v in p.token_logprobs] == lps


def test_lm_evaluation_harness_loglikelihood_requests(
    server: ServerProcess, model_dir: Path
) -> None:
    """lm-evaluation-harness's `local-completions` scores a continuation with this payload
    (a batch of token-id prompts, echo, max_tokens 1, logprobs 1, temperature 0) and reads
    ``sum(token_logprobs[ctxlen:-1])`` and whether each token was the top one: both must be
    the model's own (lm_eval 0.4.13 run by hand against serve: 60 of 60 equal)."""
    tok = load_hf_tokenizer(model_dir)
    pairs = [("Question: 2 plus 2?\nAnswer:", " 4"), ("The sky is", " blue today")]
    batch = [(tok.encode(c), tok.encode(c + x)) for c, x in pairs]
    payload = {"model": str(model_dir), "prompt": [whole for _, whole in batch],
               "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    out = httpx.post(
        server.base_url + "/oai/api/v1/completions",
        json=payload,
        headers={"Authorization": "Bearer tml-oai-user"},
        timeout=60,
    ).json()
    service = sdk(server)
    try:
        sampler = service.create_sampling_client(base_model=str(model_dir))
        choices = sorted(out["choices"], key=lambda c: c["index"])
        for (ctx, whole), choice in zip(batch, choices, strict=True):
            lps = choice["logprobs"]["token_logprobs"][len(ctx) : -1]
            tops = choice["logprobs"]["top_logprobs"][len(ctx) : -1]
            want = sampler.compute_logprobs(tinker.ModelInput.from_ints(whole)).result()
            assert lps == pytest.approx(want[len(ctx) :], rel=1e-6)
            assert len(lps) == len(whole) - len(ctx) and all(len(t) == 1 for t in tops)
            assert all(lp <= max(t.values()) + 1e-6 for lp, t in zip(lps, tops, strict=True))
    finally:
        service.holder.close()


def test_of_two_stop_strings_at_one_place_the_one_that_ends_first_is_named() -> None:
    """The engine stops at the first stop string to complete: at one starting place, the
    shorter (it was the first listed, which the engine had not stopped on)."""
    from tinker_sr.server.oai_format import cut_at_stop

    assert cut_at_stop("the answer is here", [" is", " i"]) == ("the answer", " i")
    assert cut_at_stop("ab cd ab", ["cd", "ab"]) == ("", "ab")
    assert cut_at_stop("abc", ["x"]) == ("abc", None)


def test_a_special_tokens_stop_string_ends_the_answer_at_that_token(model_dir: Path) -> None:
    """With ``skip_special_tokens: false`` a stop string can be a special token's text
    (gpt-oss's "<|end|>" or "<|call|>", ChatML's "<|im_end|>"), which the engine's stop
    matching never sees (special tokens add no bytes there): the answer still ends at the token
    that completes it, as vLLM's does: finish_reason "stop", and its log-probs and completion
    tokens end there too, not only its text."""
    from tinker_sr import types
    from tinker_sr.server.handlers.oai import _choices
    from tinker_sr.server.oai_format import OaiRequest

    tok = load_hf_tokenizer(model_dir)
    ids = tok.encode("Hello world<|im_end|> and more", add_special_tokens=False)
    end = ids.index(tok.convert_tokens_to_ids("<|im_end|>"))
    for reason in ("length", "stop"):  # ran to max_tokens, or on to EOS
        seq = types.SampledSequence(
            stop_reason=reason, sequence_id="s", _tokens_list=ids, _logprobs_list=[-1.0] * len(ids)
        )
        for skip, kept, stop in ((False, end + 1, "<|im_end|>"), (True, len(ids), None)):
            req = OaiRequest(
                chat=False, model="m", stop=["<|im_end|>"], logprobs=0, skip_special_tokens=skip
            )
            (choice,) = _choices(tok, req, [1], types.SampleResponse(sequences=[seq]), None)
            assert choice.text == tok.decode(ids[:kept], skip_special_tokens=True)
            assert (choice.completion_tokens, choice.stop_string) == (kept, stop)
            assert choice.tokens is not None and len(choice.tokens) == kept
            assert choice.finish_reason == ("stop" if stop else reason)


def test_an_answer_ended_by_eos_leaves_the_eos_text_out_as_vllm(
    server: ServerProcess, model_dir: Path
) -> None:
    """With ``skip_special_tokens: false`` an answer that ends on the model's EOS kept its text
    ("... 123 539<|endoftext|>") where vLLM leaves the token that ended the request out (and
    the same request with that text as a stop string did too); its log-prob and usage still
    count it (found by a hunt)."""
    tok = load_hf_tokenizer(model_dir)
    prompt = tok.encode("Hello world", add_special_tokens=True)
    kw: dict[str, Any] = dict(max_tokens=64, seed=5, temperature=1.0)
    want = sample_with_sdk(server, model_dir, prompt, 16, **kw).sequences
    got = client(server).completions.create(
        model=str(model_dir), prompt=prompt, n=16, logprobs=0, **kw,
        extra_body={"skip_special_tokens": False},
    ).choices  # fmt: skip
    eos = set(ModelTokenizer(model_dir).eos_token_ids)
    ended = [i for i, seq in enumerate(want) if seq.stop_reason == "stop"]
    assert ended and all(want[i].tokens[-1] in eos for i in ended)  # EOS-ended answers
    for choice, seq in zip(got, want, strict=True):
        said = seq.tokens[:-1] if seq.stop_reason == "stop" else seq.tokens
        assert choice.text == tok.decode(said, skip_special_tokens=False).rstrip("\ufffd")
        assert len(choice.logprobs.tokens) == len(seq.tokens)  # the EOS still counted


def _scored(server: ServerProcess, model_dir: Path, ids: list[int]) -> list[float]:
    """The model's own log-prob of each of ``ids`` after those before it (the SDK's
    ``compute_logprobs``: a forward over the whole sequence, no sampling involved)."""
    service = sdk(server)
    try:
        sampler = service.create_sampling_client(base_model=str(model_dir)).result()
        return list(sampler.compute_logprobs(tinker.ModelInput.from_ints(ids)).result())
    finally:
        service.holder.close()


def test_log_probs_above_temperature_0_are_the_models_own(
    server: ServerProcess, model_dir: Path
) -> None:
    """vLLM's default ``--logprobs-mode raw_logprobs``: at any temperature (here 0.7 with
    top_p 0.8, which q filters) a drawn token's log-prob and its alternatives are the model's
    own, not those of the distribution it was drawn from, which the Tinker sampler reports
    for the very same tokens; streamed, the same."""
    oai = client(server)
    ids = [5, 17, 230, 31, 42, 7]
    params: dict[str, Any] = dict(max_tokens=10, temperature=0.7, top_p=0.8, seed=11)
    kw: dict[str, Any] = dict(model=str(model_dir), prompt=ids, logprobs=5, **params)
    got = oai.completions.create(**kw).choices[0]
    q = sample_with_sdk(server, model_dir, ids, 1, **params).sequences[0]
    tokens = list(q.tokens)
    said = load_hf_tokenizer(model_dir).decode(tokens, skip_special_tokens=True)
    assert got.text == said.rstrip("\ufffd")  # an incomplete last character is not said
    lps = got.logprobs.token_logprobs
    assert lps == pytest.approx(_scored(server, model_dir, ids + tokens)[len(ids) :], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(lps, q.logprobs, strict=True)) > 1e-2  # not q's
    tops = got.logprobs.top_logprobs
    assert all(len(t) == 5 and max(t.values()) >= lp - 1e-6 for t, lp in zip(tops, lps, strict=True))  # fmt: skip
    assert all(sum(math.exp(v) for v in t.values()) < 1 for t in tops)  # p's, not top_p's q
    streamed = _streamed_logprobs(oai, False, **kw)
    assert [v for p in streamed[0] for v in p.token_logprobs] == lps


def test_processed_log_probs_are_the_sampling_distributions(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> None:
    """``tinker-sr serve --logprobs-mode processed_logprobs`` (vLLM's other mode): the
    log-probs are those of the distribution each token was drawn from, the Tinker sampler's
    own for the same tokens; at temperature 0 still the model's own."""
    store = tmp_path_factory.mktemp("processed") / "store"
    args = ["--model-dir", str(model_dir), "--logprobs-mode", "processed_logprobs"]
    with running_server(store, extra_args=args) as srv:
        ids = [5, 17, 230, 31, 42, 7]
        params: dict[str, Any] = dict(max_tokens=10, temperature=0.7, top_p=0.8, seed=11)
        got = client(srv).completions.create(model=str(model_dir), prompt=ids, logprobs=2, **params)
        q = sample_with_sdk(srv, model_dir, ids, 1, **params).sequences[0]
        lps = got.choices[0].logprobs.token_logprobs
        assert lps == pytest.approx(list(q.logprobs), abs=1e-6) and len(lps) == len(q.tokens)
        greedy = dict(max_tokens=6, temperature=0)
        got = client(srv).completions.create(model=str(model_dir), prompt=ids, logprobs=1, **greedy)
        tokens = list(sample_with_sdk(srv, model_dir, ids, 1, **greedy).sequences[0].tokens)
        want = _scored(srv, model_dir, ids + tokens)[len(ids) :]
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)


def test_an_unstreamed_answer_stops_sampling_when_its_client_leaves(server: ServerProcess) -> None:
    """A client that gives up on an unstreamed answer (openai-python's timeout, which then
    retries) stops its sample, as a closed stream does: the server's process then uses next to
    no CPU while 16 x 1000 tokens would keep its cores busy for many seconds (before: the
    sample ran to its end for nobody, and each retry added another)."""
    body = {"model": "tinker-sr/small", "prompt": [1, 2, 3], "n": 16, "stop": [], "seed": 1}
    url, auth = server.base_url + "/oai/api/v1/completions", {"Authorization": "Bearer tml-x"}
    assert httpx.post(url, json={**body, "max_tokens": 1}, headers=auth, timeout=120).is_success
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={**body, "max_tokens": 1000}, headers=auth, timeout=2)
    assert server.proc is not None
    stat = Path(f"/proc/{server.proc.pid}/stat")

    def cpu_seconds() -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(1)  # the sample stops at its next decode step
    before = cpu_seconds()
    time.sleep(4)
    assert cpu_seconds() - before < 1.5  # sampling on: ~2 cores x 4 s
