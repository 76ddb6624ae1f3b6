"""gpt-oss on the chat routes: a harmony answer (``<|channel|>analysis<|message|>...<|end|>
<|start|>assistant<|channel|>final<|message|>...<|return|>``) comes back as vLLM serves it, the
final channel's text as ``content`` and the analysis channel's as ``reasoning_content``, not as
"analysis...assistantfinal..." (its header words glued to its texts, as before). The split is
checked on harmony completions written with the tiny gpt-oss directory's own tokenizer, and end
to end through the real `openai` and `anthropic` clients against the server, whose answers are
held to the official SDK's samples of the same prompt and seed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("tinker")

from tests._server import ServerProcess, official_sdk_sample, serving_model_dir  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.server.handlers.oai import _choices  # noqa: E402
from tinker_sr.server.harmony import split_channels  # noqa: E402
from tinker_sr.server.oai_format import OaiRequest  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.hf import load_hf_tokenizer  # noqa: E402

ASK = [{"role": "user", "content": "what is the sum of 40 plus 2"}]
THINK = "<|channel|>analysis<|message|>add 40 and 2<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>the answer is 42<|return|>"
KEY = "tml-harmony-user"


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-gpt-oss", "gpt_oss")


@pytest.fixture(scope="module")
def tok(oss_dir: Path) -> Any:
    return load_hf_tokenizer(oss_dir)


def _prompt(tok: Any, opened: str = "") -> list[int]:
    text = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False) + opened
    return list(tok.encode(text, add_special_tokens=False))


def _answer(tok: Any, completion: str, stop_reason: str = "stop", **req: Any) -> Any:
    """The chat answer `_choices` makes of ``completion`` (harmony text) after `_prompt`."""
    ids = tok.encode(completion, add_special_tokens=False)
    seq = types.SampledSequence(
        stop_reason=stop_reason, sequence_id="s", _tokens_list=ids, _logprobs_list=[-1.0] * len(ids)
    )
    request = OaiRequest(**{"chat": True, "model": "m", **req})
    (choice,) = _choices(tok, request, _prompt(tok), types.SampleResponse(sequences=[seq]), None)
    return choice


def test_a_harmony_answer_is_its_final_channel_with_the_analysis_as_reasoning(tok: Any) -> None:
    whole = _answer(tok, THINK + FINAL)
    assert (whole.reasoning, whole.text) == ("add 40 and 2", "the answer is 42")
    assert whole.finish_reason == "stop" and whole.completion_tokens == len(
        tok.encode(THINK + FINAL, add_special_tokens=False)
    )
    # Cut off by max_tokens inside its thinking: all reasoning, no answer yet.
    cut = _answer(tok, "<|channel|>analysis<|message|>add 40", stop_reason="length")
    assert (cut.reasoning, cut.text, cut.finish_reason) == ("add 40", "", "length")
    # No analysis (low effort, or a template that opens the final channel): no reasoning.
    direct = _answer(tok, "<|channel|>final<|message|>the answer is 42<|return|>")
    assert (direct.reasoning, direct.text) == (None, "the answer is 42")
    # A commentary preamble is content; a message to a recipient (a tool call) is not text.
    tool = _answer(tok, THINK + "<|start|>assistant<|channel|>commentary<|message|>adding"
                   "<|end|><|start|>assistant<|channel|>commentary to=functions.add "
                   "<|constrain|>json<|message|>{}<|call|>")  # fmt: skip
    assert (tool.reasoning, tool.text) == ("add 40 and 2", "adding")
    # A stop string ends the part it is in (and nothing after it was kept).
    stopped = _answer(tok, THINK + FINAL, stop=["is 42"])
    assert (stopped.reasoning, stopped.text, stopped.stop_string) == (
        "add 40 and 2",
        "the answer ",
        "is 42",
    )
    early = _answer(tok, THINK + FINAL, stop=[" and"])
    assert (early.reasoning, early.text) == ("add 40", "")


def test_raw_text_where_asked_for_or_where_the_answer_is_not_harmony(
    tok: Any, oss_dir: Path
) -> None:
    raw = _answer(tok, THINK + FINAL, skip_special_tokens=False)
    assert raw.reasoning is None and raw.text == THINK + FINAL
    completion = _answer(tok, THINK + FINAL, chat=False)  # /completions: the text as it came
    assert completion.reasoning is None
    assert completion.text == tok.decode(
        tok.encode(THINK + FINAL, add_special_tokens=False), skip_special_tokens=True
    )
    assert completion.text.startswith("analysisadd 40 and 2assistantfinal")  # what chat was
    plain = _answer(tok, "the answer is 42")  # a model that writes no harmony
    assert (plain.reasoning, plain.text) == (None, "the answer is 42")
    qwen = load_hf_tokenizer(make_tiny_hf_model_dir(oss_dir.parent / "tiny-qwen3"))
    assert split_channels(qwen, qwen.encode("hi"), qwen.encode("<|channel|>")) is None
    # A prompt that opened a message: its channel continues, structure or none.
    opened = _prompt(tok, "<|start|>assistant<|channel|>analysis<|message|>")
    ids = tok.encode("add 40 and 2", add_special_tokens=False)
    assert split_channels(tok, opened, ids) == ("add 40 and 2", "")
    assert split_channels(tok, opened, []) == ("", "")


@pytest.mark.parametrize(
    "completion",
    [
        THINK + FINAL,
        "<|channel|>final<|message|>the answer is 42<|return|>",
        THINK + "<|start|>assistant<|channel|>commentary<|message|>adding<|end|>" + FINAL,
        THINK + "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json"
        '<|message|>{"a": 40}<|call|>',
        "<|channel|>analysis<|message|>add<|end|><|start|>assistant<|channel|>analysis"
        "<|message|> 40 and 2<|end|>" + FINAL,
    ],
)
def test_the_split_is_tinker_cookbooks_parse_of_the_answer(tok: Any, completion: str) -> None:
    """tinker-cookbook's gpt-oss renderer (``parse_response``, what an RL script reads a
    sample with) is the oracle: its thinking parts are the reasoning, its text parts the
    content, and a tool call neither."""
    renderers = pytest.importorskip("tinker_cookbook.renderers")
    renderer = renderers.get_renderer("gpt_oss_no_sysprompt", tok)
    ids = tok.encode(completion, add_special_tokens=False)
    message, _ = renderer.parse_response(ids)
    parts = message["content"]
    thinking = "".join(p["thinking"] for p in parts if p["type"] == "thinking")
    text = "".join(p["text"] for p in parts if p["type"] == "text")
    got = split_channels(tok, _prompt(tok), ids)
    assert got == (thinking or None, text)


@pytest.fixture(scope="module")
def opening_dir(oss_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gpt-oss whose chat template opens the channel named by the ``channel`` keyword
    (``chat_template_kwargs``) in its generation prompt: its random answers then continue that
    message (a random model seldom writes harmony's headers itself)."""
    path = tmp_path_factory.mktemp("models") / "opening-gpt-oss"
    path.mkdir()
    for f in oss_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] += (
        "{%- if add_generation_prompt and channel is defined %}"
        "{{- '<|channel|>' + channel + '<|message|>' }}{%- endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, opening_dir: Path) -> Iterator[ServerProcess]:
    with serving_model_dir(tmp_path_factory, opening_dir) as srv:
        yield srv


def _said(text: str | None) -> str | None:
    return None if text is None else text.rstrip("\ufffd")


@pytest.mark.parametrize("channel", ["analysis", "final"])
def test_the_server_answers_gpt_oss_chats_split_as_its_samples_are(
    server: ServerProcess, opening_dir: Path, channel: str
) -> None:
    """Each of 8 answers (seeded) is the split of the official SDK's sample of the same prompt
    and seed (in the analysis channel: reasoning, no content; in the final one: content, no
    reasoning); streamed while sampled, the reasoning comes in its own deltas, which join to
    it as the content's do."""
    tok = load_hf_tokenizer(opening_dir)
    kwargs = {"channel": channel}
    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, return_dict=False, **kwargs)
    kw: dict[str, Any] = dict(max_tokens=24, seed=7, temperature=1.0)
    oracle = official_sdk_sample(server, str(opening_dir), prompt, 8, KEY, **kw).sequences
    split = [split_channels(tok, prompt, list(s.tokens)) for s in oracle]
    # cut by max_tokens: an incomplete last character is not said, as in vLLM
    want = [None if w is None else tuple(_said(t) for t in w) for w in split]
    thinking = channel == "analysis"
    assert all(w is not None and (w[0] is not None) == thinking for w in want)
    assert all(w is not None and w[1 - thinking] for w in want)  # each wrote some text
    oai = openai.OpenAI(base_url=server.base_url + "/oai/api/v1", api_key=KEY, max_retries=0)
    args: dict[str, Any] = dict(model=str(opening_dir), messages=ASK, n=8, **kw)
    args["extra_body"] = {"chat_template_kwargs": kwargs}
    got = oai.chat.completions.create(**args)
    answers = [
        ((c.message.model_extra or {}).get("reasoning_content"), c.message.content)
        for c in got.choices
    ]
    assert answers == want
    assert all(("reasoning_content" in (c.message.model_extra or {})) == thinking
               for c in got.choices)  # fmt: skip
    streamed: dict[int, list[tuple[str, str]]] = {i: [] for i in range(8)}
    for chunk in oai.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if "reasoning_content" in extra:
                streamed[c.index].append(("reasoning", extra["reasoning_content"]))
            if c.delta.content:
                streamed[c.index].append(("content", c.delta.content))
    for i, (reasoning, content) in enumerate(want):  # type: ignore[misc]
        for kind, text in (("reasoning", reasoning), ("content", content)):
            assert "".join(t for k, t in streamed[i] if k == kind) == (text or "")
    pieces = [len(s) for s in streamed.values()]
    assert sum(pieces) > 2 * len(pieces), pieces  # sent while sampled, not in one piece each


def test_the_anthropic_route_answers_with_the_content(
    server: ServerProcess, opening_dir: Path
) -> None:
    """Greedy: the text block is the content of the official SDK's greedy sample (its split,
    or its whole text where the random model wrote no harmony)."""
    tok = load_hf_tokenizer(opening_dir)
    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, return_dict=False)
    greedy = official_sdk_sample(server, str(opening_dir), prompt, 1, KEY, max_tokens=24,
                                 temperature=0.0).sequences[0]  # fmt: skip
    split = split_channels(tok, prompt, list(greedy.tokens))
    want = tok.decode(greedy.tokens, skip_special_tokens=True) if split is None else split[1]
    claude = anthropic.Anthropic(base_url=server.base_url + "/anthropic/api", api_key=KEY)
    msg = claude.messages.create(  # temperature: an API field, not a keyword of create()
        model=str(opening_dir), messages=ASK, max_tokens=24, extra_body={"temperature": 0}
    )
    assert msg.content[0].text == want
    with claude.messages.stream(
        model=str(opening_dir), messages=ASK, max_tokens=24, extra_body={"temperature": 0}
    ) as stream:
        assert "".join(stream.text_stream) == want  # the content only, as sampled


def test_the_anthropic_stream_sends_no_empty_delta_for_reasoning() -> None:
    """A gpt-oss answer's reasoning moves while its content does not: the Messages stream
    (which answers with the content only) sends nothing for it, not an empty text delta."""
    from tinker_sr.server.anthropic_format import MessageStream, parse_messages_request
    from tinker_sr.server.oai_format import Piece

    req = parse_messages_request({"model": "m", "max_tokens": 8, "messages": ASK})
    stream = MessageStream(req)
    assert stream.pieces([Piece(0, "", [], 0, "let me think")]) == ""
    assert '"text": "42"' in stream.pieces([Piece(0, "42", [], 0, "")])


def test_a_stop_string_across_channels_ends_the_answer_where_it_begins(tok: Any) -> None:
    """A stop string spanning the analysis and final messages ("2.assistantfinalthe": the
    text of the reasoning's end, the header's words, the answer's start) ends the answer
    where it begins: the reasoning before it, no content. Before, each channel was cut on its
    own and neither held the whole stop string: reasoning "add 40 and 2" kept its head and
    the content "the answer is 42" its tail (a hunt)."""
    stop = "2assistantfinalthe"
    whole = _answer(tok, THINK + FINAL, stop=[stop])
    assert (whole.reasoning, whole.text, whole.finish_reason) == ("add 40 and ", "", "stop")
    assert whole.stop_string == stop
    inside = _answer(tok, THINK + FINAL, stop=["answer is"])  # within one channel: as before
    assert (inside.reasoning, inside.text) == ("add 40 and 2", "the ")
    # characters of several tokens before it (a prefix of the text ends in U+FFFD there)
    wide = "<|channel|>analysis<|message|>easy é€ 4.<|end|>" + FINAL.replace("42", "4. done")
    after = _answer(tok, wide, stop=["4. do"])
    assert (after.reasoning, after.text) == ("easy é€ 4.", "the answer is ")
