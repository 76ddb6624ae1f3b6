"""Property: a streamed answer of the OpenAI- and Anthropic-compatible routes, sent while it is
sampled (`server.live_stream`), joins to the very answer the same request gets unstreamed,
whatever its prompt, stop strings (pieces of the answer itself, texts of the vocabulary's odd
characters, partial UTF-8), ``n``, length, sampling parameters, log-probs (joined across the
chunks: entries, alternatives, text offsets) and special-token handling; and the request is
refused the same way streamed or not. Against a real server on a tiny
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


def _streamed_oai(events: list[dict[str, Any]], chat: bool) -> tuple[dict[int, str], dict[int, str], dict[int, Any]]:  # fmt: skip
    """Each choice's joined text, finish reason and joined log-probs."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    scores: dict[int, Any] = {}
    for e in events:
        assert "error" not in e, e
        for c in e["choices"]:
            piece = (c["delta"].get("content") if chat else c["text"]) or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
            if c["logprobs"] is not None:
                scores[c["index"]] = _joined(scores.get(c["index"]), c["logprobs"], chat)
    return texts, reasons, scores


def _joined(before: Any, more: Any, chat: bool) -> Any:
    """Two pieces' log-probs as one."""
    if before is None:
        return more
    if chat:
        return {**before, "content": before["content"] + more["content"]}
    return {k: before[k] + more[k] for k in before}


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
    more_prompts=st.lists(st.text(min_size=1, max_size=12), max_size=2),
    echo=st.booleans(),
    from_answer=st.integers(0, 8),
    logprobs=st.one_of(st.none(), st.integers(0, 4)),
)
def test_a_streamed_answer_joins_to_the_unstreamed_one(
    served: tuple[ServerProcess, str],
    body: dict[str, Any],
    chat: bool,
    prompt: str,
    more_prompts: list[str],
    echo: bool,
    from_answer: int,
    logprobs: int | None,
) -> None:
    """(``more_prompts``: `/completions` with several prompts, each sampled on its own;
    ``echo``: `/completions` answers after their prompts' texts.)"""
    srv, model = served
    if logprobs is not None:
        body = {**body, **({"logprobs": True, "top_logprobs": logprobs} if chat else {"logprobs": logprobs})}  # fmt: skip
    route = "chat/completions" if chat else "completions"
    ask: dict[str, Any] = {
        "prompt": [prompt or " ", *more_prompts] if more_prompts else prompt or " "
    }
    if chat:
        ask = {"messages": [{"role": "user", "content": prompt}]}
    elif echo:
        ask["echo"] = True
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
    texts, reasons, scores = _streamed_oai(_events(streamed.text), chat)
    assert {i: t for i, t in texts.items() if t} == {i: t for i, t in want.items() if t}
    assert reasons == {c["index"]: c["finish_reason"] for c in whole.json()["choices"]}
    if logprobs is not None:
        assert scores == {c["index"]: c["logprobs"] for c in whole.json()["choices"]}


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


@pytest.fixture(scope="module")
def bpe(served: tuple[ServerProcess, str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served[1])


@settings(FUZZ, max_examples=scaled(200))
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_a_stream_sends_only_what_the_answer_keeps(
    bpe: Any, data: st.DataObject, skip_special_tokens: bool
) -> None:
    """Token by token, whatever the tokens (special ones, pieces of UTF-8 characters) and stop
    strings (texts of the tokens themselves, special tokens', U+FFFD), a stream's pieces are a
    prefix of the answer it ends with (`_choices`, as the unstreamed answer is written): its
    text, and the entries of the tokens it keeps (up to the one completing a stop string,
    which the engine runs past on a special token's text)."""
    specials = sorted(bpe.all_special_ids)
    partial = [t for t in range(len(bpe)) if bpe.decode([t]) == "\ufffd"]  # a character's bytes
    ids = st.one_of(
        st.integers(0, len(bpe) - 1), st.sampled_from(specials), st.sampled_from(partial)
    )
    tokens = data.draw(st.lists(ids, min_size=1, max_size=24), label="tokens")
    pieces = [str(bpe.decode([t], skip_special_tokens=False)) for t in tokens]
    stop = data.draw(
        st.lists(
            st.one_of(
                st.sampled_from(pieces).map(lambda p: p[:2] or "x"),
                st.sampled_from([*bpe.all_special_tokens, "\ufffd", " "]),
            ),
            max_size=2,
        ),
        label="stop",
    )
    _check_stream_prefix(bpe, tokens, stop, skip_special_tokens)


@pytest.fixture(scope="module")
def sentencepiece() -> Any:
    """A Llama 2 / Mistral-style tokenizer: "▁" for spaces, "<0xNN>" byte-fallback pieces."""
    from tests.test_sentencepiece_tokenizer import sentencepiece_tokenizer

    tok, table = sentencepiece_tokenizer()
    assert tok.convert_ids_to_tokens(3) == "<0x00>"
    return tok, table


@settings(FUZZ, max_examples=scaled(200))
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_a_byte_fallback_stream_sends_only_what_the_answer_keeps(
    sentencepiece: Any, data: st.DataObject, skip_special_tokens: bool
) -> None:
    """As above, for a byte-fallback vocabulary, whose decoder turns a run of byte pieces that
    is not valid UTF-8 into one U+FFFD a byte, valid characters before it included: a stream
    sent "A" for <0x41>, then <0xE4> made the text "\ufffd\ufffd", and nothing more of the
    answer was sent (its pieces no longer a prefix of it). A model's padded rows and the
    special tokens the text leaves out join runs too."""
    tok, table = sentencepiece
    ids = st.one_of(
        st.integers(3, 258),  # byte pieces: "<0x00>".."<0xFF>"
        st.sampled_from([0x41 + 3, 0xC3 + 3, 0xA9 + 3, 0xE4 + 3, 0xB8 + 3]),  # "A", é, 中's
        st.integers(0, len(tok) + 3),  # and a model's padded rows, which no token is
    )
    tokens = data.draw(st.lists(ids, min_size=1, max_size=24), label="tokens")
    stop = data.draw(st.lists(st.sampled_from(["\ufffd", "A", "é", " "]), max_size=2))
    _check_stream_prefix(tok, tokens, stop, skip_special_tokens, table=table)


def test_a_byte_fallback_stream_holds_back_only_an_open_run(sentencepiece: Any) -> None:
    """A run of byte pieces is held back while the last token may continue it, no longer: the
    "▁" piece between two Korean words (each a "▁" and byte pieces) closes a run, though
    alone it decodes to nothing (taken for a special token, it held the whole answer back)."""
    from tinker_sr.server.live_stream import settled_text
    from tinker_sr.server.oai_format import OaiRequest

    tok, _ = sentencepiece
    ids = tok.encode("한국어 텍스트 입니다 the", add_special_tokens=False)
    assert tok.decode(ids[-1:]) == "the" and len(ids) > 20
    req = OaiRequest(chat=False, model="m", stop=[], skip_special_tokens=True)
    text, stopped, read = settled_text(tok, req, ids)
    assert (text, stopped, read) == (" 한국어 텍스트 입니다", False, len(ids) - 1)
    emoji = tok.encode(" 😀", add_special_tokens=False)  # "▁" and four byte pieces
    text, _, read = settled_text(tok, req, ids[:-1] + emoji[:3])  # 😀 is still open
    assert (text, read) == (" 한국어 텍스트 입니다 ", len(ids))
    text, _, read = settled_text(tok, req, ids[:-1] + emoji + ids[-1:])  # closed by "the"
    assert (text, read) == (" 한국어 텍스트 입니다 😀", len(ids) + len(emoji) - 1)


@pytest.mark.parametrize(
    ("pieces", "stop", "skip"),
    [
        (["\xa1", "\xa1", "!"], ["\ufffd"], True),  # stray bytes: the answer keeps one token
        (["\xe0", "\xa1", "\xa1", "\xa1"], ["\ufffd"], True),  # a character, then a stray byte
        (["!", "\xc2", "\xa1", "\xa1"], ["\ufffd"], False),  # a shorter prefix holds the stop
        (["H", "<|im_end|>", "x", "y"], ["<|im_end|>"], False),  # the engine ran past it
        # a character's first bytes are U+FFFD until the next complete it into a stop string
        (["x", "a", "\xe0", "\xa1", "\xa1", "Z"], ["\ufffd", "a\u0861"], True),
    ],
)
def test_a_stream_sends_only_what_the_answer_keeps_at_the_edges(
    bpe: Any, pieces: list[str], stop: list[str], skip: bool
) -> None:
    """The cases the property above found, and one it has not (tokens by their byte-level
    symbols: a one-byte piece is that byte's own token)."""
    tokens = [bpe.convert_tokens_to_ids(p if len(p) > 1 else _byte_symbol(p)) for p in pieces]
    _check_stream_prefix(bpe, tokens, stop, skip)


def _byte_symbol(char: str) -> str:
    """The byte-level BPE symbol of a one-byte token (GPT-2's printable bytes stand for
    themselves)."""
    b = ord(char)
    assert 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255, b
    return chr(b)


def _check_stream_prefix(
    tok: Any,
    tokens: list[int],
    stop: list[str],
    skip: bool,
    prompt: list[int] | None = None,
    table: list[bytes] | None = None,
) -> None:
    """Stream ``tokens`` one at a time through `_piece`; what it sent is a prefix of the whole
    answer `_choices` writes: text, log-prob entries and (a chat ``prompt`` gpt-oss's channels
    split the answer to) reasoning."""
    from tinker_sr import types
    from tinker_sr.server.handlers.oai import _choices, _token_entries
    from tinker_sr.server.live_stream import Reader, _piece
    from tinker_sr.server.oai_format import OaiRequest, Sent

    chat = prompt is not None
    req = OaiRequest(chat=chat, model="m", stop=stop, logprobs=0, skip_special_tokens=skip)
    lps = [-float(i) for i in range(len(tokens))]
    scored = _token_entries(tok, tokens, lps, None, table, skip)
    sent = [Sent()]
    reader = Reader(tok, 1, 1, channels=prompt if chat and skip else None)
    for n in range(1, len(tokens) + 1):
        _piece(reader, req, 0, [tokens[:n]], [scored[:n]], sent)
    seq = types.SampledSequence(
        stop_reason="length", sequence_id="s", _tokens_list=tokens, _logprobs_list=lps
    )
    response = types.SampleResponse(sequences=[seq])
    (whole,) = _choices(tok, req, prompt or [1], response, table)
    assert whole.text.startswith(sent[0].text), (whole.text, sent[0].text)
    assert whole.tokens is not None and sent[0].tokens == whole.tokens[: len(sent[0].tokens)]
    assert (whole.reasoning or "").startswith(sent[0].reasoning), (whole, sent[0])


@pytest.fixture(scope="module")
def oss(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tinker_sr.tokenization.hf import load_hf_tokenizer

    return load_hf_tokenizer(
        make_tiny_hf_model_dir(tmp_path_factory.mktemp("oss") / "oss", "gpt_oss")
    )


HARMONY = [
    "<|channel|>analysis<|message|>",
    "<|end|>",
    "<|start|>assistant<|channel|>final<|message|>",
    "<|start|>assistant<|channel|>commentary<|message|>",
    "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>",
    "<|return|>",
    "<|call|>",
    "the answer is 42",
    " é\u0861🙂",
]


@settings(FUZZ, max_examples=scaled(150))
@given(data=st.data(), skip_special_tokens=st.booleans(), opened=st.booleans())
def test_a_gpt_oss_stream_sends_only_what_the_answer_keeps(
    oss: Any, data: st.DataObject, skip_special_tokens: bool, opened: bool
) -> None:
    """gpt-oss's chat answers, streamed while sampled: whatever harmony messages, stray
    structural tokens, text and stop strings the tokens hold, the reasoning and content sent
    are prefixes of the whole answer's (and so are the log-prob entries)."""
    parts = data.draw(st.lists(st.sampled_from(HARMONY), min_size=1, max_size=6), label="parts")
    cut = data.draw(st.integers(0, 64), label="cut")  # cut off anywhere
    more = data.draw(st.lists(st.integers(0, len(oss) - 1), max_size=4), label="more")
    stop = data.draw(
        st.lists(st.sampled_from(["42", "answer", "final", "\ufffd", "<|end|>", " é"]), max_size=2),
        label="stop",
    )
    _check_oss_stream(oss, parts, cut, more, stop, skip_special_tokens, opened)


@pytest.mark.parametrize(
    ("parts", "cut", "more", "stop"),
    [
        # a stop string in text outside any message: the answer ends there, before its final
        ([HARMONY[0], HARMONY[1], HARMONY[7], HARMONY[2], HARMONY[7]], 64, [], ["42"]),
        # a final message's header, then stray bytes: the whole answer's text is cut at U+FFFD
        ([HARMONY[2]], 7, [94, 0], ["\ufffd"]),
    ],
)
def test_a_gpt_oss_stream_sends_only_what_the_answer_keeps_at_the_edges(
    oss: Any, parts: list[str], cut: int, more: list[int], stop: list[str]
) -> None:
    """The cases the property above found."""
    _check_oss_stream(oss, parts, cut, more, stop, True, False)


def _check_oss_stream(
    oss: Any, parts: list[str], cut: int, more: list[int], stop: list[str], skip: bool, opened: bool
) -> None:
    """`_check_stream_prefix` for the tokens of harmony ``parts`` cut to ``cut`` tokens, then
    ``more``, answering a chat prompt (that opens an analysis message, where ``opened``)."""
    ask = [{"role": "user", "content": "what is 40 plus 2"}]
    text = oss.apply_chat_template(ask, add_generation_prompt=True, tokenize=False)
    prompt = list(oss.encode(text + ("<|channel|>analysis<|message|>" if opened else ""),
                             add_special_tokens=False))  # fmt: skip
    tokens = [t for p in parts for t in oss.encode(p, add_special_tokens=False)][:cut] + more
    if tokens:
        _check_stream_prefix(oss, tokens, stop, skip, prompt)


@settings(FUZZ, max_examples=scaled(400))
@given(
    text=st.text(alphabet="ab€\ufffd", max_size=40),
    stop=st.text(alphabet="ab€", min_size=1, max_size=12),
)
def test_a_stream_holds_back_the_longest_end_that_may_begin_a_stop(text: str, stop: str) -> None:
    """`_held_back` (which tries only where the stop string's first character is) against the
    definition it replaced, every prefix of the stop string tried."""
    from tinker_sr.server.live_stream import _held_back

    want = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    assert _held_back(text, stop) == want
