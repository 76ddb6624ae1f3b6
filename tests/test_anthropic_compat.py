"""Anthropic-compatible inference on `tinker-sr serve` (``/anthropic/api``), driven by the
real `anthropic` client as a user points it at the server: a Message is the engine's own
greedy answer to the model's chat template (system prompt first; a last assistant message is a
prefill the answer continues), stop sequences are reported as Anthropic does, a stream's
deltas come while it is sampled and reassemble to the same Message, count_tokens counts the
rendered prompt, and what is not supported is refused with Anthropic's 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("transformers")
anthropic = pytest.importorskip("anthropic")
tinker = pytest.importorskip("tinker")

from tests._server import ServerProcess, official_sdk_sample, serving_model_dir  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.hf import load_hf_tokenizer  # noqa: E402

HI = [{"role": "user", "content": "Hi there"}]
GREEDY = {"temperature": 0}  # not a keyword of anthropic 2.x's create(); a field of the API


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    with serving_model_dir(tmp_path_factory, model_dir) as srv:
        yield srv


def client(server: ServerProcess, key: str = "tml-anthropic-user") -> Any:
    return anthropic.Anthropic(
        base_url=server.base_url + "/anthropic/api", api_key=key, max_retries=0
    )


def greedy_tokens(server: ServerProcess, model_dir: Path, ids: list[int], max_tokens: int) -> Any:
    """The official SDK's greedy sample of ``ids`` on the same server (the oracle)."""
    return official_sdk_sample(
        server, str(model_dir), ids, 1, "tml-anthropic-user", max_tokens=max_tokens, temperature=0
    ).sequences[0]


def test_a_message_is_the_engines_answer_to_the_chat_template(
    server: ServerProcess, model_dir: Path
) -> None:
    tok = load_hf_tokenizer(model_dir)
    convo = [{"role": "system", "content": "Be brief."}, *HI]
    ids = tok.apply_chat_template(convo, add_generation_prompt=True, return_dict=False)
    got = client(server).messages.create(
        model=str(model_dir), max_tokens=10, system="Be brief.", messages=HI, extra_body=GREEDY
    )
    seq = greedy_tokens(server, model_dir, ids, 10)
    assert got.type == "message" and got.role == "assistant" and got.model == str(model_dir)
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == tok.decode(seq.tokens, skip_special_tokens=True)
    assert got.usage.input_tokens == len(ids) and got.usage.output_tokens == len(seq.tokens)
    assert got.stop_reason == ("max_tokens" if seq.stop_reason == "length" else "end_turn")
    counted = client(server).messages.count_tokens(
        model=str(model_dir), system="Be brief.", messages=HI
    )
    assert counted.input_tokens == len(ids)


def test_a_last_assistant_message_is_a_prefill(server: ServerProcess, model_dir: Path) -> None:
    tok = load_hf_tokenizer(model_dir)
    ids = tok.apply_chat_template(HI, add_generation_prompt=True, return_dict=False)
    ids += tok.encode("The answer is", add_special_tokens=False)
    convo = [*HI, {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]
    got = client(server).messages.create(
        model=str(model_dir), max_tokens=6, messages=convo, extra_body=GREEDY
    )
    seq = greedy_tokens(server, model_dir, ids, 6)
    assert got.usage.input_tokens == len(ids)
    assert got.content[0].text == tok.decode(seq.tokens, skip_special_tokens=True)


def test_stop_sequences_and_streaming(server: ServerProcess, model_dir: Path) -> None:
    ant = client(server)
    kw: dict[str, Any] = dict(model=str(model_dir), messages=HI, extra_body=GREEDY)
    free = ant.messages.create(max_tokens=24, **kw).content[0].text
    stop = free[5:8]  # (the tiny model's greedy answer may be newlines: a stop all the same)
    assert len(stop) == 3, free
    cut = ant.messages.create(max_tokens=24, stop_sequences=[stop, "never-there"], **kw)
    assert cut.content[0].text == free[: free.find(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    with ant.messages.stream(max_tokens=24, stop_sequences=[stop], **kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == cut.content[0].text == final.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.usage.output_tokens == cut.usage.output_tokens


def test_a_streamed_message_comes_as_it_is_sampled(server: ServerProcess, model_dir: Path) -> None:
    """The text deltas are sent while the engine decodes (before: one delta after the whole
    sample) and join to the unstreamed Message's text; the final Message (stop reason,
    usage) is the unstreamed one's."""
    ant = client(server)
    kw: dict[str, Any] = dict(model=str(model_dir), messages=HI, max_tokens=40)
    whole = ant.messages.create(**kw, extra_body=GREEDY)
    with ant.messages.stream(**kw, extra_body=GREEDY) as stream:
        pieces = [t for t in stream.text_stream if t]
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text == final.content[0].text
    assert len(pieces) > 3, pieces
    assert (final.stop_reason, final.usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.output_tokens,
    )
    assert final.usage.input_tokens == whole.usage.input_tokens


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools: tool use"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking: only"),
        ({"temperature": 1.5}, "temperature must be between 0 and 1"),
        ({"top_k": 0}, "top_k must be a positive integer"),
        ({"stop_sequences": "x"}, "stop_sequences must be a list"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences: at most 16 stop strings, got 17"),
        ({"stop_sequences": ["x" * 600_000]}, "stop_sequences[0] is 600,000 characters"),
        ({"max_tokens": 0}, "max_tokens: a positive integer is required"),
        ({"max_tokens": 100_000}, "context"),
        ({"metadata": "me"}, "metadata has the wrong type"),
        ({"n": 2}, "n: Extra inputs are not permitted"),
        ({"messages": []}, "messages: a non-empty list"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role must be"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]: only text blocks",
        ),
        ({"system": [{"type": "text", "text": 5}]}, "system[0].text must be a string"),
        ({"model": "no/such-model"}, "is not available on this server"),
        # checked, not ignored: fields in blocks, cache_control's shape, tools' and metadata's
        ({"system": [{"type": "text", "text": "x", "bogus": 1}]}, "system[0].bogus: Extra"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x", "cache_control": "yes"}],
                    }
                ]
            },
            "messages[0].content[0].cache_control must be",
        ),  # fmt: skip
        ({"cache_control": {"type": "ephemeral", "ttl": "1d"}}, "cache_control.ttl must be"),
        ({"tools": {}}, "tools must be a list"),
        ({"tool_choice": {}}, "tool_choice: tool use"),
        ({"metadata": {"user": "me"}}, "metadata.user: Extra"),
        ({"metadata": {"user_id": 5}}, "metadata.user_id must be a string"),
        ({"service_tier": "fastest"}, "service_tier must be"),
    ],
)
def test_what_it_does_not_do_is_refused_as_anthropic_does(
    server: ServerProcess, model_dir: Path, extra: dict[str, Any], message: str
) -> None:
    body = {"model": str(model_dir), "max_tokens": 4, "messages": HI, **extra}
    resp = httpx.post(
        server.base_url + "/anthropic/api/v1/messages",
        json=body,
        headers={"x-api-key": "tml-anthropic-user", "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    got = resp.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert message in got["error"]["message"], got


def test_keys_and_routes_are_answered_as_anthropic_does(
    server: ServerProcess, model_dir: Path
) -> None:
    with pytest.raises(anthropic.AuthenticationError, match="must start with 'tml-'"):
        client(server, "sk-ant-not-tinker").messages.create(
            model=str(model_dir), max_tokens=2, messages=HI
        )
    with pytest.raises(anthropic.BadRequestError, match="no chat template .* use /completions"):
        client(server).messages.create(model="tinker-sr/tiny", max_tokens=2, messages=HI)
    resp = httpx.get(server.base_url + "/anthropic/api/v1/models", timeout=30,
                     headers={"x-api-key": "tml-anthropic-user"})  # fmt: skip
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    resp = httpx.post(server.base_url + "/anthropic/api/v1/messages", content=b"{",
                      headers={"x-api-key": "tml-anthropic-user"}, timeout=30)  # fmt: skip
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/anthropic/api/v1/messages", "/oai/api/v1/chat/completions"])
def test_a_field_name_that_is_not_unicode_is_a_400(server: ServerProcess, route: str) -> None:
    """A top-level field named with a lone surrogate escape was missed by the Unicode check
    (its place is "", falsy) and then named in the 400, which could not be written: a 500."""
    resp = httpx.post(
        server.base_url + route,
        content=b'{"\\ud800": 1, "model": "m", "max_tokens": 2, "messages": []}',
        headers={"x-api-key": "tml-anthropic-user", "content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    assert "not valid Unicode" in resp.json()["error"]["message"]


def test_prompt_caching_is_accepted_and_changes_nothing(
    server: ServerProcess, model_dir: Path
) -> None:
    """``cache_control`` (as Claude clients send it: on the request, system and message blocks)
    changes no answer, only what a prompt costs: accepted (it was refused on the request) and
    the answer and counts are those without it."""
    ant, cache = client(server), {"type": "ephemeral"}
    system = [{"type": "text", "text": "Be brief."}]
    plain: dict[str, Any] = dict(model=str(model_dir), system=system, messages=HI)
    cached: dict[str, Any] = dict(
        model=str(model_dir),
        system=[{**system[0], "cache_control": cache}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hi there", "cache_control": {**cache, "ttl": "1h"}}]}],
    )  # fmt: skip
    want = ant.messages.create(max_tokens=6, **plain, extra_body=GREEDY)
    got = ant.messages.create(max_tokens=6, **cached, extra_body={**GREEDY, "cache_control": cache})
    assert got.content == want.content and got.usage == want.usage
    counted = ant.messages.count_tokens(**cached, extra_body={"cache_control": cache})
    assert counted.input_tokens == want.usage.input_tokens
    assert ant.messages.count_tokens(**plain).input_tokens == want.usage.input_tokens


def test_consecutive_messages_of_a_role_are_one_turn(
    server: ServerProcess, model_dir: Path
) -> None:
    """As Anthropic combines consecutive user or assistant messages into one turn (they were
    separate turns of the chat template: two assistant messages ended the first one's turn and
    the prefill began another), their text joined as one message's text blocks are."""
    ant = client(server)
    split = [
        {"role": "user", "content": "Hi "},
        {"role": "user", "content": [{"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "The answer"},
        {"role": "assistant", "content": " is"},
    ]
    whole = [*HI, {"role": "assistant", "content": "The answer is"}]
    kw: dict[str, Any] = dict(model=str(model_dir), max_tokens=6, extra_body=GREEDY)
    got, want = ant.messages.create(messages=split, **kw), ant.messages.create(messages=whole, **kw)
    assert got.content == want.content and got.usage == want.usage
    counted = ant.messages.count_tokens(model=str(model_dir), messages=split).input_tokens
    assert counted == want.usage.input_tokens
