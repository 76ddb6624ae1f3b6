"""A Hugging Face model directory served by `tinker-sr serve`: the tinker_sr client and the
unmodified official SDK both get the model's own tokenizer and sample with its EOS and string
stops; the official SDK trains a Qwen2 directory and hears a refused one's field by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402

import tinker_sr  # noqa: E402
from tests._server import ServerProcess, running_server  # noqa: E402
from tests._train import cross_entropy_steps  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir, tiny_model_info  # noqa: E402
from tinker_sr.tokenization.byte import ByteTokenizer  # noqa: E402

tinker = pytest.importorskip("tinker")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """An HF hub cache holding the model as ``tiny-org/tiny-qwen3`` (refs/main → snapshot)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo, rev = cache / "models--tiny-org--tiny-qwen3", "a" * 40
    shutil.copytree(model_dir, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return cache


@pytest.fixture(scope="module")
def qwen2_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Qwen2 directory and a copy (which a test turns into a refused one after the server
    started: a `--model-dir` the engine would refuse stops `tinker-sr serve` at start)."""
    root = tmp_path_factory.mktemp("qwen2")
    good = make_tiny_hf_model_dir(root / "tiny-qwen2", family="qwen2")
    bad = root / "tiny-qwen2-awq"
    shutil.copytree(good, bad)
    return good, bad


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    hub_cache: Path,
    model_dir: Path,
    qwen2_dirs: tuple[Path, Path],
) -> Iterator[ServerProcess]:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    # A server loads only the model directories its operator names (issue 10, item 12);
    # Hub names in its cache need no flag.
    flags = ["--model-dir", str(model_dir)]
    for d in qwen2_dirs:
        flags += ["--model-dir", str(d)]
    with running_server(tmp_path_factory.mktemp("store"), env=env, extra_args=flags) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, hub_cache: Path) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    # huggingface_hub reads these once, at import; transformers reads its constants per call.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub_cache))
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)


def _ready(client_or_future: object) -> object:
    """The client of a client future (both SDKs return futures from some creators)."""
    result = getattr(client_or_future, "result", None)
    return result() if callable(result) else client_or_future


def _check_round(sdk: object, service: object, model_dir: Path) -> None:
    """Training + sampling clients on the model dir: tokenizers and a string-stop sample."""
    types = sdk.types  # type: ignore[attr-defined]
    info = tiny_model_info(model_dir)
    reference = AutoTokenizer.from_pretrained(model_dir)
    training = _ready(service.create_lora_training_client(base_model=str(model_dir), rank=2))  # type: ignore[attr-defined]
    assert training.get_info().model_data.tokenizer_id == str(model_dir)
    for client in (
        training,
        training.save_weights_and_get_sampling_client(),
        service.create_sampling_client(base_model=str(model_dir)),  # type: ignore[attr-defined]
    ):
        tok = _ready(client).get_tokenizer()
        assert not isinstance(tok, ByteTokenizer)
        assert tok.encode("hello world") == reference.encode("hello world")
        assert tok.eos_token_id == info.special_ids["<|im_end|>"]
    sampler = _ready(training.save_weights_and_get_sampling_client())
    prompt = types.ModelInput.from_ints(reference.encode("User: what is 1 plus 2?\n\nAssistant:"))
    params = types.SamplingParams(max_tokens=24, seed=3, stop=["\n\nUser:", "1"])
    seqs = sampler.sample(prompt, 8, params).result().sequences
    eos = set(info.eos_token_ids)
    for s in seqs:
        text = reference.decode(s.tokens, skip_special_tokens=True)
        before = reference.decode(s.tokens[:-1], skip_special_tokens=True)
        assert "1" not in before and "\n\nUser:" not in before
        if s.stop_reason == "stop":
            assert s.tokens[-1] in eos or "1" in text or "\n\nUser:" in text
        else:
            assert len(s.tokens) == 24 and "1" not in text and "\n\nUser:" not in text
    assert any(t >= 259 for s in seqs for t in s.tokens)
    assert any(s.stop_reason == "stop" and s.tokens[-1] not in eos for s in seqs)


def test_tinker_sr_client_against_server(server: ServerProcess, model_dir: Path) -> None:
    service = tinker_sr.ServiceClient(base_url=server.base_url, api_key="tml-test")
    _check_round(tinker_sr, service, model_dir)
    service.close().result()


def test_official_sdk_against_server(server: ServerProcess, model_dir: Path) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    _check_round(tinker, service, model_dir)
    service.close("success").result()


@pytest.mark.parametrize("sdk_name", ["tinker_sr", "tinker"])
def test_hub_cache_name_served_and_tokenized_offline(
    server: ServerProcess, model_dir: Path, sdk_name: str
) -> None:
    sdk = tinker_sr if sdk_name == "tinker_sr" else tinker
    service = sdk.ServiceClient(base_url=server.base_url, api_key="tml-test")
    expected = AutoTokenizer.from_pretrained(model_dir).encode("hello world")
    training = _ready(service.create_lora_training_client(base_model="tiny-org/tiny-qwen3", rank=2))
    assert training.get_info().model_data.tokenizer_id.endswith("snapshots/" + "a" * 40)  # type: ignore[attr-defined]
    sampler = _ready(service.create_sampling_client(base_model="tiny-org/tiny-qwen3"))
    for client in (training, sampler):
        assert client.get_tokenizer().encode("hello world") == expected  # type: ignore[attr-defined]
    types = sdk.types
    out = sampler.sample(  # type: ignore[attr-defined]
        types.ModelInput.from_ints(expected), 2, types.SamplingParams(max_tokens=6, stop=["\n"])
    ).result()
    assert len(out.sequences) == 2
    # A Tinker variant id (as tinker-cookbook's recipes name models) is its base model.
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    variant = f"tiny-org/tiny-qwen3:peft:{context}"
    training = _ready(service.create_lora_training_client(base_model=variant, rank=2))
    assert training.get_tokenizer().encode("hello world") == expected  # type: ignore[attr-defined]
    sampler = _ready(training.save_weights_and_get_sampling_client())  # type: ignore[attr-defined]
    out = sampler.sample(
        types.ModelInput.from_ints(expected), 1, types.SamplingParams(max_tokens=3)
    )  # type: ignore[attr-defined]
    assert len(out.result().sequences) == 1
    (service.close() if sdk_name == "tinker_sr" else service.close("success")).result()


def test_official_sdk_trains_a_qwen2_dir_and_hears_a_refusal_by_field(
    server: ServerProcess, qwen2_dirs: tuple[Path, Path]
) -> None:
    good, bad = qwen2_dirs
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(config))  # replaced under the running server
    types = tinker.types
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-test")
    caps = rest.get_server_capabilities().result()
    contexts = {m.model_name: m.max_context_length for m in caps.supported_models}
    assert contexts[good.name] == contexts[str(good)] == 32768 and bad.name not in contexts
    training = service.create_lora_training_client(base_model=str(good), rank=4, seed=0).result()
    ids = training.get_tokenizer().encode("User: what is 1 plus 2?\n\nAssistant: 3")
    losses = cross_entropy_steps(training, types, ids, steps=3, lr=1e-2)
    assert losses[-1] < losses[0], losses
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, seed=1)
    prompt = types.ModelInput.from_ints(ids[:5])
    assert len(sampler.sample(prompt, 2, params).result().sequences) == 2
    with pytest.raises(tinker.BadRequestError, match="quantization_config \\(awq\\)"):
        refused = service.create_sampling_client(base_model=str(bad)).result()
        refused.sample(prompt, 1, params).result()
    service.close("success").result()


def test_a_builtin_models_tokenizer_needs_no_tokenizers_package(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The server names a built-in model's byte-level tokenizer as a directory on its own disk
    (for the official SDK, which loads it with transformers). The tinker_sr client loaded that
    directory with `tokenizers`, which is not a run-time dependency: on a plain install
    `get_tokenizer()` failed (so did `tinker-sr demo --base-url`), and against a server on
    another machine it failed anyway. It is now the built-in tokenizer, with neither package."""
    import sys

    from tinker_sr.clients.tokenizers import load_tokenizer

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "transformers", None)
    load_tokenizer.cache_clear()
    try:
        service = tinker_sr.ServiceClient(base_url=server.base_url, api_key="tml-test")
        training = _ready(service.create_lora_training_client(base_model="tinker-sr/tiny", rank=2))
        assert training.get_info().model_data.tokenizer_id.endswith("/tokenizers/byte-level")
        assert training.get_tokenizer().encode("hi there") == ByteTokenizer().encode("hi there")
        # A server on another machine (its directory is not here), serving an alias of one.
        elsewhere = load_tokenizer("Qwen/Qwen3-8B", "/srv/other/store/tokenizers/byte-level")
        assert isinstance(elsewhere, ByteTokenizer)
        # A user's own tokenizer saved under such a name here is theirs (no server mark).
        from tinker_sr.tokenization.byte import is_served_byte_tokenizer

        theirs = tmp_path / "tokenizers" / "byte-level"
        theirs.mkdir(parents=True)
        (theirs / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
        assert not is_served_byte_tokenizer(str(theirs))
        service.close().result()
    finally:
        load_tokenizer.cache_clear()


def test_a_store_from_an_older_server_still_names_its_tokenizer(tmp_path: Path) -> None:
    """A store's byte-level tokenizer directory written by a server before the mark existed
    (review of the change that added it: the check ran before the rewrite, so every built-in
    model's get_info failed with a 500 on such a store, the default one included)."""
    import asyncio

    from tinker_sr import types
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.server.tokenizers import TokenizerIds
    from tinker_sr.tokenization.byte import MARKER, write_hf_tokenizer_dir

    old = write_hf_tokenizer_dir(tmp_path / "store" / "tokenizers" / "byte-level")
    config = json.loads((old / "tokenizer_config.json").read_text())
    del config[MARKER]
    (old / "tokenizer_config.json").write_text(json.dumps(config))

    async def tokenizer_id() -> str | None:
        backend = LocalBackend(tmp_path / "store")
        try:
            session = await backend.create_session()
            model = await backend.create_model(
                session, 0, base_model="tinker-sr/tiny", lora_config=types.LoraConfig(rank=2)
            )
            info = await backend.get_info(model)
            return TokenizerIds(backend, tmp_path / "store").tokenizer_id(info)
        finally:
            await backend.aclose()

    assert asyncio.run(tokenizer_id()) == str(old.resolve())
    assert json.loads((old / "tokenizer_config.json").read_text())[MARKER] == "byte-level"


def test_a_sampling_clients_tokenizer_is_the_served_models(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, hub_cache: Path
) -> None:
    """tinker_sr's remote sampling client chose its tokenizer by the model's name alone. For an
    alias whose name is in the client's Hugging Face cache it loaded that cached tokenizer, not
    the served model's (wrong text and rewards, silently); for a directory served under its
    folder name, or one whose path holds a ':', it found none. It now asks the server."""
    root = tmp_path_factory.mktemp("served")
    colon = root / "run:7"
    shutil.copytree(model_dir, colon)
    flags = ["--model-alias", "tiny-org/tiny-qwen3=tinker-sr/tiny"]
    flags += ["--model-dir", str(model_dir), "--model-dir", str(colon)]
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    with running_server(root / "store", env=env, extra_args=flags) as srv:
        service = tinker_sr.ServiceClient(base_url=srv.base_url, api_key="tml-test")
        expected = AutoTokenizer.from_pretrained(model_dir).encode("hello world")
        aliased = service.create_sampling_client(base_model="tiny-org/tiny-qwen3")
        assert aliased.get_tokenizer().encode("hi") == ByteTokenizer().encode("hi")
        for name in ("tiny-qwen3", str(colon)):  # a folder name; a path with a ':'
            sampler = service.create_sampling_client(base_model=name)
            assert sampler.get_tokenizer().encode("hello world") == expected, name
        training = service.create_lora_training_client(base_model=str(colon), rank=2)
        assert training.get_tokenizer().encode("hello world") == expected
        service.close().result()


def test_a_hub_models_tokenizer_from_a_server_on_another_machine(
    model_dir: Path, hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer id of a Hub-name model is a snapshot in the server's cache, a path that a
    client on another machine does not have: its training clients (and, once they asked the
    server, its sampling clients) failed. The same model in the client's own cache serves.
    (The server's cache is moved away once its model is loaded: it is not on this machine.)"""
    theirs, mine = tmp_path / "server-hub", tmp_path / "client-hub"
    shutil.copytree(hub_cache, theirs)
    shutil.copytree(hub_cache, mine)
    monkeypatch.setenv("HF_HUB_CACHE", str(mine))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(mine))
    from tinker_sr.clients.tokenizers import load_tokenizer

    load_tokenizer.cache_clear()
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(theirs)}
    try:
        with running_server(tmp_path / "store", env=env) as srv:
            service = tinker_sr.ServiceClient(base_url=srv.base_url, api_key="tml-test")
            expected = AutoTokenizer.from_pretrained(model_dir).encode("hello world")
            training = service.create_lora_training_client(base_model="tiny-org/tiny-qwen3", rank=2)
            sampler = service.create_sampling_client(base_model="tiny-org/tiny-qwen3")
            assert training.get_info().model_data.tokenizer_id.startswith(str(theirs))
            theirs.rename(tmp_path / "elsewhere")
            assert training.get_tokenizer().encode("hello world") == expected
            assert sampler.get_tokenizer().encode("hello world") == expected
            service.close().result()
    finally:
        load_tokenizer.cache_clear()


def test_asking_the_server_for_a_tokenizer_never_hangs_or_repeats(server: ServerProcess) -> None:
    """Review of the lookup: a bare `.result()` on the SDK's own loop thread hung the process,
    a server without the field was asked on every call, and an unreachable one turned
    get_tokenizer() into an error after a minute of retries. Now: once, and by the model's
    name (as the official SDK) where the server cannot say."""
    from tinker_sr.clients.holder import submit

    service = tinker_sr.ServiceClient(base_url=server.base_url, api_key="tml-test")
    backend = service.holder.backend
    asked: list[str] = []

    async def without_field(sampler_id: str) -> None:
        asked.append(sampler_id)

    async def unreachable(sampler_id: str) -> None:
        raise ConnectionError("server down")

    for lookup in (without_field, unreachable):
        sampler = service.create_sampling_client(base_model="tinker-sr/tiny")
        backend.sampler_tokenizer_id = lookup  # type: ignore[attr-defined]
        for _ in range(3):
            assert isinstance(sampler.get_tokenizer(), ByteTokenizer)
    assert len(asked) == 1

    async def on_the_sdk_loop() -> object:
        sampler = await service.create_sampling_client_async(base_model="tinker-sr/tiny")
        return sampler.get_tokenizer()

    del backend.sampler_tokenizer_id  # the real lookup, from the SDK's own loop thread
    assert isinstance(submit(on_the_sdk_loop()).result(timeout=60), ByteTokenizer)
    service.close().result()
