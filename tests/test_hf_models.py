"""Hugging Face model directories end to end: loading (dtypes, shards, HF cache), the model's own
tokenizer and EOS ids, incremental string stops, and `get_tokenizer()` on every path."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import tinker_sr  # noqa: E402
from tests._train import cross_entropy_steps  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.clients.tokenizers import load_tokenizer  # noqa: E402
from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.engine.sampling import resolve_max_tokens  # noqa: E402
from tinker_sr.engine.stops import StopStrings  # noqa: E402
from tinker_sr.hf_files import resolve_model_dir, tinker_variant  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir, tiny_model_info  # noqa: E402
from tinker_sr.tokenization.byte import ByteTokenizer  # noqa: E402
from tinker_sr.tokenization.hf import FastTokenizer, ModelTokenizer  # noqa: E402

TEXT = "Hello world, 123 + 456 = 579.\n\nUser: what é ü 😀?"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import: set its constant too.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


# ---- loading ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "dtype", "sharded"),
    [("qwen3", "float32", False), ("llama", "bfloat16", True), ("qwen3", "float16", True)],
)
def test_loaded_weights_keep_dtype_and_match_transformers(
    tmp_path: Path, family: str, dtype: str, sharded: bool
) -> None:
    root = make_tiny_hf_model_dir(tmp_path / "m", family=family, dtype=dtype, sharded=sharded)  # type: ignore[arg-type]
    assert sharded == (root / "model.safetensors.index.json").is_file()
    ours = load_model_dir(root)
    theirs = AutoModelForCausalLM.from_pretrained(root)
    assert ours.dtype == theirs.dtype == getattr(torch, dtype)
    ids = torch.tensor([[1, 5, 100, 200, 300, 400, 650]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits.float(), rtol=0, atol=1e-5)
    assert load_model_dir(root, dtype=torch.float32).dtype == torch.float32


def test_hf_cache_name_resolves_offline(
    tmp_path: Path, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve_model_dir("tiny-org/tiny-qwen3") is None
    repo, rev = _into_hf_cache(tmp_path / "hf" / "hub", qwen_dir, "tiny-org/tiny-qwen3")
    assert resolve_model_dir("tiny-org/tiny-qwen3") == repo / "snapshots" / rev
    assert resolve_model_dir(f"tiny-org/tiny-qwen3@{rev}") == repo / "snapshots" / rev
    assert resolve_model_dir("tiny-org/tiny-qwen3@v2") is None

    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    sampler = client.create_sampling_client(base_model="tiny-org/tiny-qwen3").result()
    tok = sampler.get_tokenizer()
    assert tok.encode("hello", add_special_tokens=False) != list(b"hello")
    out = sampler.sample(
        types.ModelInput.from_ints(tok.encode("User: hi")), 1, types.SamplingParams(max_tokens=4)
    ).result()
    assert len(out.sequences[0].tokens) >= 1
    # The remote path (as the official SDK does) finds the cached tokenizer by name, too.
    assert load_tokenizer("tiny-org/tiny-qwen3", None).encode("hello") == tok.encode("hello")
    client.close().result()
    backend.close()


def _into_hf_cache(hub: Path, model_dir: Path, name: str) -> tuple[Path, str]:
    """Lay `model_dir` out in the HF cache at `hub` as Hub name `name`: (repo folder, rev)."""
    repo = hub / ("models--" + name.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return repo, rev


def test_a_tinker_variant_id_is_its_base_model_from_the_cache(
    tmp_path: Path, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tinker-cookbook's recipes name Tinker variant ids (``rl_numerics_check`` defaults to
    ``"Qwen/Qwen3.6-35B-A3B:peft:262144"``): the base model with its served context. Before:
    "base_model ... is not available" even with the base model in the HF cache."""
    assert tinker_variant("Qwen/Qwen3.6-35B-A3B:peft:262144") == ("Qwen/Qwen3.6-35B-A3B", 262144)
    assert tinker_variant("org/m:peft:0") == ("org/m:peft:0", None)
    assert tinker_variant("org/m") == ("org/m", None)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _into_hf_cache(tmp_path / "hub", qwen_dir, "tiny-org/tiny-qwen3")
    context = json.loads((qwen_dir / "config.json").read_text())["max_position_embeddings"]
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    name = f"tiny-org/tiny-qwen3:peft:{context}"
    trainer = client.create_lora_training_client(base_model=name, rank=2).result()
    assert trainer.get_info().model_data.model_name == name
    ids = trainer.get_tokenizer().encode("User: hi", add_special_tokens=False)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    out = trainer.forward_backward([datum], "cross_entropy").result()
    assert math.isfinite(out.metrics["loss:sum"])
    with pytest.raises(tinker_sr.RequestFailedError, match="asks for .* tokens of context"):
        client.create_lora_training_client(
            base_model=f"tiny-org/tiny-qwen3:peft:{2 * context}", rank=2
        ).result()
    client.close().result()
    backend.close()


def test_unknown_model_error_names_where_it_looked(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    with pytest.raises(tinker_sr.RequestFailedError, match="Hugging Face cache"):
        client.create_lora_training_client(base_model="no-org/no-model", rank=2).result()
    client.close().result()
    backend.close()


# ---- tokenizer ----------------------------------------------------------------------------


def test_token_bytes_and_eos_come_from_the_model_dir(qwen_dir: Path) -> None:
    info = tiny_model_info(qwen_dir)
    mt = ModelTokenizer(qwen_dir)
    hf = AutoTokenizer.from_pretrained(qwen_dir)
    ids = hf.encode(TEXT, add_special_tokens=False)
    assert b"".join(mt.token_bytes[i] for i in ids).decode() == TEXT
    assert set(mt.eos_token_ids) == set(info.eos_token_ids) and min(mt.eos_token_ids) >= 259
    assert mt.token_bytes[info.special_ids["<|im_end|>"]] == b""


def test_fast_tokenizer_without_transformers_matches_autotokenizer(qwen_dir: Path) -> None:
    ours, theirs = FastTokenizer(qwen_dir), AutoTokenizer.from_pretrained(qwen_dir)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.decode(ours.encode(TEXT)) == TEXT
    assert (ours.eos_token_id, ours.pad_token_id, len(ours)) == (
        theirs.eos_token_id,
        theirs.pad_token_id,
        len(theirs),
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )


def test_fast_tokenizer_reads_a_transformers_4_era_directory(
    qwen_dir: Path, tmp_path: Path
) -> None:
    """Special tokens kept in special_tokens_map.json and a list of named chat templates (as
    transformers 4 saved them): the fallback tokenizer had no eos / bos (None) and crashed on
    the list with a TypeError."""
    root = tmp_path / "old"
    shutil.copytree(qwen_dir, root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    special = {k: cfg.pop(k) for k in ("eos_token", "pad_token") if cfg.get(k) is not None}
    del cfg["added_tokens_decoder"]  # what makes transformers read special_tokens_map.json
    assert "eos_token" in special
    (root / "special_tokens_map.json").write_text(json.dumps(special))
    template = "{{ eos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": template},
    ]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, theirs = FastTokenizer(root), AutoTokenizer.from_pretrained(root)
    assert (
        ours.eos_token_id
        == theirs.eos_token_id
        == tiny_model_info(qwen_dir).special_ids["<|im_end|>"]
    )
    assert ours.pad_token_id == theirs.pad_token_id
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == "<|im_end|>hi"
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )


def test_stop_strings_match_across_tokens_and_split_characters() -> None:
    # "é" is two bytes; a token may end halfway through it.
    table = [b"ab", b"\xc3", b"\xa9c", b"\n", b"User", b":", b""]
    m = StopStrings(["éc", "\n\nUser:"], table, rows=2)
    assert [m.push(0, t) for t in (0, 1, 2)] == [False, False, True]
    assert [m.push(1, t) for t in (3, 6, 3, 4, 5)] == [False, False, False, False, True]
    long = StopStrings(["er than year"], [b"x", b"er", b" than", b" year"], rows=1)
    assert [long.push(0, t) for t in (0, 1, 2, 3)] == [False, False, False, True]


def test_unbounded_max_tokens_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_max_tokens(None, 10, 40960) == 4096
    assert resolve_max_tokens(None, 10, 100) == 90
    assert resolve_max_tokens(7, 10, 40960) == 7
    monkeypatch.setenv("TINKER_SR_DEFAULT_MAX_TOKENS", "16")
    assert resolve_max_tokens(None, 10, 40960) == 16


# ---- sampling on the BPE model ------------------------------------------------------------


def _sample(sampler: tinker_sr.SamplingClient, stop: object, seed: int, n: int = 16) -> list:
    params = types.SamplingParams(max_tokens=48, seed=seed, stop=stop)  # type: ignore[arg-type]
    prompt = types.ModelInput.from_ints([1, 2, 3])
    return list(sampler.sample(prompt, n, params).result().sequences)


def test_rows_stop_on_the_models_eos_not_the_byte_one(embedded_service, qwen_dir: Path) -> None:  # type: ignore[no-untyped-def]
    eos = set(tiny_model_info(qwen_dir).eos_token_ids)
    sampler = embedded_service.create_sampling_client(base_model=str(qwen_dir)).result()
    for seed in range(20):  # find a seed where some row samples an EOS id (no stops at all)
        free = _sample(sampler, [], seed)
        if any(eos & set(s.tokens) for s in free):
            break
    else:
        pytest.fail("no EOS id sampled in 20 seeds")
    stopped = _sample(sampler, None, seed)
    for f, s in zip(free, stopped, strict=True):
        first = next((i for i, t in enumerate(f.tokens) if t in eos), None)
        if first is None:
            assert s.tokens == f.tokens and s.stop_reason == "length"
        else:
            assert s.tokens == f.tokens[: first + 1] and s.stop_reason == "stop"


def test_string_stops_with_the_bpe_tokenizer(embedded_service, qwen_dir: Path) -> None:  # type: ignore[no-untyped-def]
    eos = set(tiny_model_info(qwen_dir).eos_token_ids)
    sampler = embedded_service.create_sampling_client(base_model=str(qwen_dir)).result()
    tok = sampler.get_tokenizer()
    free = _sample(sampler, [], seed=5, n=4)
    assert any(t >= 259 for s in free for t in s.tokens)  # ids the byte tokenizer lacks
    # A stop string (valid text) that row r completes at its token `end`, before any EOS.
    r, end, text = next(
        (i, a + 3, tok.decode(s.tokens[a : a + 3]))
        for a in range(5, 40)
        for i, s in enumerate(free)
        if not eos & set(s.tokens[: a + 3])
        and "\ufffd" not in tok.decode(s.tokens[a : a + 3])
        and tok.decode(s.tokens[a : a + 3]).strip()
    )
    stopped = _sample(sampler, [text, "\n\nUser:"], seed=5, n=4)
    for f, s in zip(free, stopped, strict=True):
        assert s.tokens == f.tokens[: len(s.tokens)]
        out = tok.decode(s.tokens, skip_special_tokens=True)
        shorter = tok.decode(s.tokens[:-1], skip_special_tokens=True)
        assert text not in shorter and "\n\nUser:" not in shorter
        if s.stop_reason == "length":
            assert len(s.tokens) == 48 and text not in out
        else:  # the stop ends with the last token: a stop string or one of the model's EOS
            assert text in out or "\n\nUser:" in out or s.tokens[-1] in eos
    assert stopped[r].stop_reason == "stop" and len(stopped[r].tokens) <= end
    assert text in tok.decode(stopped[r].tokens)


def test_embedded_get_tokenizer_and_info(embedded_service, qwen_dir: Path) -> None:  # type: ignore[no-untyped-def]
    training = embedded_service.create_lora_training_client(
        base_model=str(qwen_dir), rank=2
    ).result()
    assert training.get_info().model_data.tokenizer_id == str(qwen_dir)
    tok = training.get_tokenizer()
    assert not isinstance(tok, ByteTokenizer)
    assert tok.encode("hello world", add_special_tokens=False) == AutoTokenizer.from_pretrained(
        qwen_dir
    ).encode("hello world", add_special_tokens=False)
    sampler = training.save_weights_and_get_sampling_client().result()
    assert sampler.get_tokenizer().eos_token_id == tok.eos_token_id
    # A built-in model still gets the byte tokenizer.
    builtin = embedded_service.create_sampling_client(base_model="tinker-sr/tiny").result()
    assert isinstance(builtin.get_tokenizer(), ByteTokenizer)


def test_aliased_name_gets_the_directory_tokenizer(tmp_path: Path, qwen_dir: Path) -> None:
    backend = LocalBackend(tmp_path / "store", model_aliases={"Qwen/Qwen3-0.6B": str(qwen_dir)})
    client = tinker_sr.ServiceClient(backend=backend)
    sampler = client.create_sampling_client(base_model="Qwen/Qwen3-0.6B").result()
    tok = sampler.get_tokenizer()
    assert tok.eos_token_id == tiny_model_info(qwen_dir).special_ids["<|im_end|>"]
    client.close().result()
    backend.close()


def test_a_relative_model_path_names_the_same_model_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``base_model="./model"`` is recorded as its absolute directory: a checkpoint loaded after
    a ``chdir`` (another project with its own ``./model``) used to load onto that other model."""
    for project, seed in (("a", 0), ("b", 1)):
        make_tiny_hf_model_dir(tmp_path / project / "model", seed=seed)
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    monkeypatch.chdir(tmp_path / "a")
    training = client.create_lora_training_client(base_model="./model", rank=2, seed=0).result()
    here = str((tmp_path / "a" / "model").resolve())
    assert training.get_info().model_data.model_name == here
    path = training.save_weights_for_sampler("relative").result().path
    prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("hello world"))
    want = training.create_sampling_client(path).result().compute_logprobs(prompt).result()
    monkeypatch.chdir(tmp_path / "b")
    sampler = client.create_sampling_client(model_path=path).result()
    assert sampler.compute_logprobs(prompt).result() == want
    assert sampler.get_base_model() == here
    state = training.save_state("relative").result().path
    resumed = client.create_training_client_from_state(state).result()
    assert resumed.get_info().model_data.model_name == here
    client.close().result()
    backend.close()
    # A name a server resolves by its aliases is kept as given, even where it is also the
    # same directory under the server's working directory (`tinker-sr serve --model-dir model`
    # run from b: its name had become b's absolute path, which the server does not serve).
    for paths in (False, True):
        served = LocalBackend(
            tmp_path / f"served{paths}",
            model_aliases={"model": str(tmp_path / "b" / "model")},
            request_model_paths=paths,
        )
        client = tinker_sr.ServiceClient(backend=served)
        aliased = client.create_lora_training_client(base_model="model", rank=2).result()
        assert aliased.get_info().model_data.model_name == "model"
        client.close().result()
        served.close()


def test_remote_get_tokenizer_raises_instead_of_guessing() -> None:
    with pytest.raises(RuntimeError, match="neither a local directory nor in the Hugging Face"):
        load_tokenizer("some-org/not-cached-model", None)
    assert isinstance(load_tokenizer("tinker-sr/tiny", None), ByteTokenizer)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lora_trains_on_a_16_bit_checkpoint(tmp_path: Path, dtype: str) -> None:
    root = make_tiny_hf_model_dir(tmp_path / "m", dtype=dtype)  # type: ignore[arg-type]
    # Named, so it stays in 16 bits also on a CPU without hardware for them (else float32).
    backend = LocalBackend(tmp_path / "store", model_dtype=dtype)
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(base_model=str(root), rank=4, seed=1).result()
    ids = training.get_tokenizer().encode("User: what is 1 plus 2?\n\nAssistant: 3")
    losses = cross_entropy_steps(training, types, ids, steps=4, lr=1e-2)
    assert losses[3] < 0.9 * losses[0]
    model = backend.models.trainer(training.model_id).model
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert params["model.embed_tokens.weight"].dtype == getattr(torch, dtype)
    sampler = training.save_weights_and_get_sampling_client().result()
    assert backend.models.sampler(sampler.sampler_id).model.dtype == getattr(torch, dtype)
    client.close().result()
    backend.close()


def test_without_transformers_get_tokenizer_uses_the_tokenizers_library(
    qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinker_sr.tokenization.hf import load_hf_tokenizer

    expected = AutoTokenizer.from_pretrained(qwen_dir).encode(TEXT)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    tok = load_hf_tokenizer(qwen_dir)
    assert isinstance(tok, FastTokenizer)
    assert tok.encode(TEXT) == expected


def test_max_tokens_none_generates_up_to_the_cap(
    embedded_service, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TINKER_SR_DEFAULT_MAX_TOKENS", "8")
    sampler = embedded_service.create_sampling_client(base_model=str(qwen_dir)).result()
    allocated: list[int] = []
    model_cls = type(sampler.holder.backend.models.base(str(qwen_dir)))
    new_cache = model_cls.new_cache

    def spy(self, batch_size: int, max_len: int):  # type: ignore[no-untyped-def]
        allocated.append(max_len)
        return new_cache(self, batch_size, max_len)

    monkeypatch.setattr(model_cls, "new_cache", spy)
    params = types.SamplingParams(max_tokens=None, stop=[], seed=0)
    out = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params).result()
    assert [len(s.tokens) for s in out.sequences] == [8, 8]
    assert allocated == [3 + 8]  # prompt + max_tokens, not the 40,960-token context


def test_padded_llama_vocab_eos_list_and_missing_tokenizer_json(tmp_path: Path) -> None:
    root = make_tiny_hf_model_dir(tmp_path / "l", family="llama", pad_vocab_to_multiple=64)
    info = tiny_model_info(root)
    mt = ModelTokenizer(root)
    assert mt.eos_token_ids == info.eos_token_ids and len(mt.eos_token_ids) == 2
    assert len(mt.token_bytes) == info.vocab_size > info.tokenizer_size
    assert mt.token_bytes[info.vocab_size - 1] == b""  # a padding row decodes to nothing
    (root / "tokenizer.json").unlink()
    bare = ModelTokenizer(root)  # EOS ids still come from config.json
    assert bare.eos_token_ids == info.eos_token_ids
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer.json"):
        _ = bare.token_bytes


def test_a_tokenizer_eos_past_the_vocabulary_is_dropped_beside_declared_ones(
    tmp_path: Path,
) -> None:
    """The tokenizer's eos_token is an added token past config.json's vocab_size (its row was
    never added to the embedding) while config.json declares EOS ids inside it, which is all
    transformers' generate reads. Before: every client of the directory was refused."""
    root = make_tiny_hf_model_dir(tmp_path / "q")
    info = tiny_model_info(root)
    spec = json.loads((root / "tokenizer.json").read_text())
    spec["added_tokens"].append({
        "id": info.vocab_size, "content": "<|eos_past_the_rows|>", "single_word": False,
        "lstrip": False, "rstrip": False, "normalized": False, "special": True,
    })  # fmt: skip
    (root / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(
        json.dumps({**config, "eos_token": "<|eos_past_the_rows|>"})
    )
    with pytest.warns(
        UserWarning, match=rf"eos_token '<\|eos_past_the_rows\|>' is id {info.vocab_size}"
    ):
        mt = ModelTokenizer(root)
    assert mt.eos_token_ids == tuple(i for i in info.eos_token_ids if i < info.vocab_size)
    for name in ("config.json", "generation_config.json"):  # nothing declared: refused
        declared = json.loads((root / name).read_text())
        (root / name).write_text(json.dumps({**declared, "eos_token_id": None}))
    with pytest.raises(ValueError, match="declare no eos_token_id; set eos_token_id in config"):
        ModelTokenizer(root)


def test_an_older_tokenizers_special_tokens_map_names_its_eos(tmp_path: Path) -> None:
    """A tokenizer_config.json without ``added_tokens_decoder`` (written before transformers
    4.34) whose special_tokens_map.json names another EOS: transformers takes the map's, and
    so does sampling now (before: it stopped only on tokenizer_config.json's, and a directory
    whose EOS only the map named was refused)."""
    root = make_tiny_hf_model_dir(tmp_path / "q")
    info = tiny_model_info(root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    config["eos_token"] = "<|endoftext|>"
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    smap = json.loads((root / "special_tokens_map.json").read_text())
    (root / "special_tokens_map.json").write_text(json.dumps({**smap, "eos_token": "<|im_end|>"}))
    for name in ("config.json", "generation_config.json"):  # only the tokenizer names an EOS
        declared = json.loads((root / name).read_text())
        (root / name).write_text(json.dumps({**declared, "eos_token_id": None}))
    im_end = AutoTokenizer.from_pretrained(root).eos_token_id
    assert im_end == info.special_ids["<|im_end|>"]
    assert ModelTokenizer(root).eos_token_ids == (im_end,)
    assert FastTokenizer(root).eos_token_id == im_end


def test_a_model_without_an_eos_trains_and_samples_only_with_its_own_stops(
    tmp_path: Path,
) -> None:
    """No EOS id anywhere (config.json, generation_config.json, the tokenizer): the model
    trains, scores prompts and samples with ``stop=[]``; a sample that would rely on an EOS is
    refused, naming the fix (before: every client of the directory was refused)."""
    root = make_tiny_hf_model_dir(tmp_path / "q")
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        declared = json.loads((root / name).read_text())
        (root / name).write_text(json.dumps({**declared, "eos_token_id": None, "eos_token": None}))
    (root / "special_tokens_map.json").unlink()
    backend = LocalBackend(tmp_path / "store")
    service = tinker_sr.ServiceClient(backend=backend)
    try:
        training = service.create_lora_training_client(base_model=str(root), rank=2).result()
        assert len(cross_entropy_steps(training, types, [5, 6, 7, 8], steps=1, lr=1e-3)) == 1
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 6, 7])
        assert len(sampler.compute_logprobs(prompt).result()) == 3
        params = types.SamplingParams(max_tokens=4, stop=[], seed=0)
        assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 4
        own = types.SamplingParams(max_tokens=4, stop=[5], seed=0)  # stops of its own: taken
        assert 1 <= len(sampler.sample(prompt, 1, own).result().sequences[0].tokens) <= 4
        with pytest.raises(
            tinker_sr.RequestFailedError, match="declares no EOS token id.*stop=\\[\\]"
        ):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=0)).result()
    finally:
        service.close().result()
        backend.close()


def test_a_checkpoint_samples_only_on_the_base_it_was_trained_on(tmp_path: Path) -> None:
    """``create_sampling_client(model_path=..., base_model=...)`` naming another model of the
    same shapes: refused, naming the checkpoint's own base (before: its adapters ran on the
    other model's weights without a word); naming its own base still works."""
    dirs = {n: make_tiny_hf_model_dir(tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 1))}
    aliases = {f"m/{n}": str(d) for n, d in dirs.items()}
    backend = LocalBackend(tmp_path / "store", model_aliases=aliases)
    service = tinker_sr.ServiceClient(backend=backend)
    try:
        training = service.create_lora_training_client(base_model="m/a", rank=2).result()
        path = training.save_weights_for_sampler("w").result().path
        prompt = types.ModelInput.from_ints([5, 6, 7, 8])
        own = service.create_sampling_client(model_path=path).result().compute_logprobs(prompt)
        named = service.create_sampling_client(model_path=path, base_model="m/a").result()
        assert named.compute_logprobs(prompt).result() == own.result()
        with pytest.raises(
            tinker_sr.BadRequestError, match="trained on \\('m/a'\\); pass base_model='m/a'"
        ):
            service.create_sampling_client(model_path=path, base_model="m/b").result()
        moved = dirs["a"].rename(tmp_path / "a-moved")  # its own no longer resolves: the new one
        again = service.create_sampling_client(model_path=path, base_model=str(moved)).result()
        assert again.compute_logprobs(prompt).result() == own.result()
    finally:
        service.close().result()
        backend.close()
