"""SentencePiece-style tokenizers (Llama 2, Mistral: "▁" for spaces, <0xNN> byte-fallback pieces,
EOS id 2): the bytes each token contributes, which incremental stop strings match on, agree with
the `tokenizers` library's decoding, and a string stop ends a Mistral directory's sample."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

import tinker_sr  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.hf import token_bytes_table  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama 2 / Mistral
TEXTS = [
    "Hello world, 123 + 456 = 579.",
    "  two leading spaces and a tab\there",
    "User: what é ü 😀 Ω?\n\nAssistant: ok",
    "日本語のテキスト and ŝôme áccents",
]


def sentencepiece_tokenizer_json(n_merges: int = 300) -> dict[str, Any]:
    """A Llama-2-layout tokenizer.json: BPE over "▁"-joined words with byte fallback, the 256
    <0xNN> pieces at ids 3-258, the learned pieces after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    words = "the a and of to is what how many plus equals user assistant hello world".split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(9)) for i in range(300)]
    trainer = trainers.BpeTrainer(vocab_size=n_merges, min_frequency=2, show_progress=False)
    tok.train_from_iterator([*corpus, *TEXTS[:1]], trainer=trainer)
    spec = json.loads(tok.to_str())
    learned = [p for p, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + learned
    spec["model"].update(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<unk>",
                         byte_fallback=True, fuse_unk=True)  # fmt: skip
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(SPECIALS)
    ]  # fmt: skip
    spec["decoder"] = json.loads(
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        ).__getstate__()
    )  # fmt: skip
    return spec


def sentencepiece_tokenizer() -> tuple[Any, list[bytes]]:
    """`sentencepiece_tokenizer_json` as a transformers tokenizer (BOS <s>, EOS </s>), and
    the bytes each of its tokens adds to a text (`token_bytes_table`)."""
    from transformers import PreTrainedTokenizerFast

    spec = sentencepiece_tokenizer_json()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
    )
    return tok, token_bytes_table(spec, len(tok))


def test_token_bytes_agree_with_the_library_decoding() -> None:
    from tokenizers import Tokenizer

    spec = sentencepiece_tokenizer_json()
    tok = Tokenizer.from_str(json.dumps(spec))
    table = token_bytes_table(spec, tok.get_vocab_size() + 5)  # padded rows decode to nothing
    assert table[2] == b"" and table[3] == b"\x00" and table[-1] == b""
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert any(3 <= i < 259 for i in ids) or text.isascii()  # byte pieces were used
        joined = b"".join(table[i] for i in ids)
        # The decoder strips the one space Metaspace prepends; the bytes keep it.
        assert joined == b" " + tok.decode(ids).encode()


def _mistral_dir(root: Path) -> Path:
    """A tiny Mistral-layout model directory with `sentencepiece_tokenizer_json`'s tokenizer."""
    make_tiny_hf_model_dir(root, family="mistral")
    (root / "special_tokens_map.json").unlink()  # the fixture's Llama 3 names
    (root / "tokenizer.json").write_text(json.dumps(sentencepiece_tokenizer_json()))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
    }))  # fmt: skip
    for name in ("config.json", "generation_config.json"):
        config = json.loads((root / name).read_text())
        config.update(bos_token_id=1, eos_token_id=2, pad_token_id=None)
        (root / name).write_text(json.dumps(config))
    return root


def test_string_stop_ends_a_sample_on_a_sentencepiece_model(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    root = _mistral_dir(tmp_path / "mistral")
    spec = json.loads((root / "tokenizer.json").read_text())
    tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.get_vocab_size() <= json.loads((root / "config.json").read_text())["vocab_size"]

    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    sampler = client.create_sampling_client(base_model=str(root)).result()
    prompt = types.ModelInput.from_ints(tok.encode("hello world").ids)

    def clean(ids: list[int]) -> bool:  # no half characters, no EOS
        return 2 not in ids and "\ufffd" not in tok.decode(ids)

    # A stop: the text two sampled pieces make, in a row whose text is clean up to there.
    for seed in range(10):
        params = types.SamplingParams(max_tokens=40, stop=[], seed=seed)
        free = sampler.sample(prompt, 4, params).result().sequences
        found = [
            (r, tok.decode(f.tokens[a : a + 2]).strip())
            for a in range(3, 30)
            for r, f in enumerate(free)
            if clean(f.tokens[: a + 2])
            and len(tok.decode(f.tokens[a : a + 2]).strip()) >= 2
            and "\ufffd" not in tok.decode(f.tokens[a : a + 2])  # not half a character
        ]
        if found:
            break
    else:
        pytest.fail("no clean two-piece text in 10 seeds")
    row, text = found[0]
    params = types.SamplingParams(max_tokens=40, stop=[text], seed=seed)
    s, f = sampler.sample(prompt, 4, params).result().sequences[row], free[row]
    assert s.tokens == f.tokens[: len(s.tokens)] and s.stop_reason == "stop"
    assert text in tok.decode(s.tokens) and text not in tok.decode(s.tokens[:-1])
    assert sampler.get_tokenizer().eos_token_id == 2
    client.close().result()
    backend.close()


@pytest.mark.parametrize("declared", [None, 1], ids=["no-eos-declared", "eos-1-declared"])
def test_an_eos_that_is_a_vocabulary_piece_stops_sampling(
    tmp_path: Path, declared: int | None
) -> None:
    """The tokenizer's eos_token "</s>" only as a piece of the model's vocabulary (not an added
    token): transformers' eos_token_id is 2, so sampling stops there too. Before: not found,
    so a model declaring no EOS was refused ("the tokenizer's eos_token name none") and one
    declaring another never stopped at "</s>"."""
    from transformers import AutoTokenizer

    from tinker_sr.tokenization.hf import ModelTokenizer

    root = make_tiny_hf_model_dir(tmp_path / "m", family="mistral")
    spec = sentencepiece_tokenizer_json()
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "</s>"]
    (root / "special_tokens_map.json").unlink()
    (root / "tokenizer.json").write_text(json.dumps(spec))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>",
    }))  # fmt: skip
    for name in ("config.json", "generation_config.json"):
        config = json.loads((root / name).read_text())
        config.update(bos_token_id=1, eos_token_id=declared, pad_token_id=None)
        (root / name).write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(root).eos_token_id == 2
    assert ModelTokenizer(root).eos_token_ids == ((2,) if declared is None else (1, 2))


def test_log_prob_token_strings_keep_their_spaces() -> None:
    """The OpenAI routes' token strings are the text each token adds to the answer: "▁world"
    is " world" (decoding it alone strips the space: the tokens joined lost every space between
    words, and "▁x" and "x" alternatives collapsed onto one key), a byte piece of a character
    is ``bytes:\\xNN``."""
    from tinker_sr.server.handlers.oai import _token_entries

    tok, table = sentencepiece_tokenizer()
    ids = tok.encode("hello world, what is ü", add_special_tokens=False)
    entries = _token_entries(tok, ids, [-1.0] * len(ids), None, table)
    words = "".join(e.text for e in entries if not e.text.startswith("bytes:"))
    assert words.startswith(" hello world, what is"), [e.text for e in entries]
    assert [e.text for e in entries][-2:] == ["bytes:\\xc3", "bytes:\\xbc"]  # ü: two byte pieces
    assert b"".join(e.raw for e in entries).decode() == " " + tok.decode(ids)


def test_an_answer_keeps_the_space_of_its_first_piece() -> None:
    """An answer's text is what it adds after its prompt, as vLLM writes it: " hello world"
    for "▁hello▁world" (decoded alone, "hello world": a completion joined to its prompt lost a
    space, a stop string " hello" that the engine matched on the tokens' bytes was not in the
    text, and the log-prob strings did not join to the text)."""
    from tinker_sr.tokenization.hf import decode_answer

    tok, table = sentencepiece_tokenizer()
    for text in ["hello world", "what é ü 😀", "</s> the a"]:
        ids = tok.encode(text, add_special_tokens=False)
        for skip in (True, False):
            answer = decode_answer(tok, ids, skip)
            kept = (table[i] or (b"" if skip else tok.decode([i]).encode()) for i in ids)
            assert answer.encode() == b"".join(kept), (text, skip, answer)
    assert decode_answer(tok, tok.encode("hello", add_special_tokens=False), True) == " hello"
    assert tok.decode(tok.encode("hello", add_special_tokens=False)) == "hello"
    assert decode_answer(tok, [], True) == "" and decode_answer(tok, [1], False) == "<s>"


def test_the_openai_routes_answer_a_sentencepiece_model_as_vllm_does(tmp_path: Path) -> None:
    """`tinker-sr serve` on a Mistral-layout directory: an answer keeps the space of its first
    piece, its log-prob strings join to its text and ``text_offset`` indexes it, and its
    streamed pieces join to it (before: the space was lost, the strings had none, and a
    stream could stop sending text after an invalid run of byte pieces)."""
    import httpx

    from tests._server import running_server

    root = _mistral_dir(tmp_path / "mistral")
    body = {"model": str(root), "prompt": "hello world", "max_tokens": 24, "n": 4}
    body |= {"seed": 7, "temperature": 1.5, "logprobs": 0}
    with running_server(tmp_path / "store", extra_args=["--model-dir", str(root)]) as srv:
        url, auth = srv.base_url + "/oai/api/v1/completions", {"Authorization": "Bearer tml-sp"}
        with httpx.Client(timeout=120) as http:
            whole = http.post(url, json=body, headers=auth).json()["choices"]
            events = http.post(url, json=body | {"stream": True}, headers=auth).text
            echo = {"prompt": "hello world the", "max_tokens": 0, "echo": True, "logprobs": 0}
            echoed = http.post(url, json=body | echo, headers=auth).json()["choices"][0]
            for seed in range(8):  # answers whose first piece is a word's ("▁the")
                more = http.post(url, json=body | {"seed": seed}, headers=auth).json()["choices"]
                spaced = [c for c in more if c["logprobs"]["tokens"][0].startswith(" ")]
                if spaced:
                    break
    streamed = {c["index"]: "" for c in whole}
    for line in events.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[len("data: ") :])["choices"]:
                streamed[c["index"]] += c["text"]
    assert streamed == {c["index"]: c["text"] for c in whole}
    assert spaced and all(c["text"].startswith(" ") for c in spaced), more
    # An echoed prompt's text leaves out the first space the decoder strips: its tokens'
    # offsets count from where the text begins.
    assert echoed["text"] == "hello world the"
    assert echoed["logprobs"]["tokens"] == [" hello", " world", " the"]
    assert echoed["logprobs"]["text_offset"] == [0, 5, 11]
    for c in spaced:  # up to its first byte piece (one byte: "bytes:\\xNN" or 1 character):
        # after an invalid run of them offsets drift (the decoder writes one U+FFFD a byte,
        # Python's decoding one per invalid sequence)
        tokens, offsets = c["logprobs"]["tokens"], c["logprobs"]["text_offset"]
        words = list(itertools.takewhile(lambda t: len(t) > 1 and "bytes:" not in t, tokens))
        assert c["text"].startswith("".join(words)), (c["text"], tokens)
        for t, o in zip(words, offsets, strict=False):
            assert c["text"][o : o + len(t)] == t, (c["text"], tokens, offsets)
