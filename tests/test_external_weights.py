"""`save_weights_external`: exports that the tools users already have read and merge.

The export is checked by what users do with it, with the real tools: tinker-cookbook 0.6.1's
``weights.download`` (which, for a training checkpoint, loads it into a new run and exports it
encrypted to a fresh age key), ``weights.build_hf_model`` and ``weights.build_lora_adapter``,
the official SDK 0.38's ``RestClient.get_external_weights_urls`` and its ``tinker checkpoint
download`` command, transformers and peft. The merged model must compute the trained model's
log-probabilities (the engine's, through the public API) on Hugging Face directories with a BPE
tokenizer: an untied Llama with an unembedding adapter and a tied Qwen3 without one. The case
the cookbook cannot merge exactly (tied embeddings + unembedding adapter) is shown to differ,
to warn, and to merge exactly with ``tinker-sr export --merge``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tinker_cookbook", reason="tinker-cookbook 0.6.1 is not installed")
pyrage = pytest.importorskip("pyrage")

import tinker_sr  # noqa: E402
from tests._server import ServerProcess, serving_model_dir  # noqa: E402
from tests._train import cross_entropy_steps  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402

TEXT = "The export of a trained adapter, merged by the tools users already have."
ADAPTER = "adapter_model.safetensors"
FILES = {"adapter_config.json", ADAPTER}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied embeddings: an unembedding adapter merges into lm_head exactly."""
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "llama", family="llama")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings (as Qwen3-0.6B and Llama-3.2-1B)."""
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "qwen3", family="qwen3")


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5 as the Hub ships it: Tinker names its linear attention's adapters in_proj_q,
    in_proj_k and in_proj_v; the cookbook fuses them into the checkpoint's in_proj_qkv."""
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "q35", family="qwen3_5")


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tinker_sr.ServiceClient]:
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    yield client
    client.close().result()
    backend.close()


def _trained(service: Any, model_dir: Path, *, train_unembed: bool = True) -> tuple[Any, list]:
    tc = service.create_lora_training_client(
        base_model=str(model_dir), rank=4, train_unembed=train_unembed
    ).result()
    ids = tc.get_tokenizer().encode(TEXT)
    cross_entropy_steps(tc, tinker_sr.types, ids, steps=3, lr=1e-2)
    return tc, ids


def _engine_logprobs(tc: Any, ids: list[int], types: Any = tinker_sr.types) -> torch.Tensor:
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    return torch.tensor(out[1:], dtype=torch.float32)


def _hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits.float()[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _load_hf(path: Path, *, vl: bool = False) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32)


def _fetch(urls: dict[str, str], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name, url in urls.items():
        urllib.request.urlretrieve(url, out / name)
    return out


def _adapter(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    config = json.loads((path / "adapter_config.json").read_text())
    return load_file(path / "adapter_model.safetensors"), config


# ---- the embedded engine ------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["llama-untied-unembed", "qwen3-tied-no-unembed", "qwen3_5-tied-no-unembed"]
)
def test_cookbook_merges_an_export_into_the_trained_model(
    case: str, service: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from tinker_cookbook import weights

    fixture = {"llama": "llama_dir", "qwen3": "qwen_dir", "qwen3_5": "q35_dir"}[case.split("-")[0]]
    model_dir: Path = request.getfixturevalue(fixture)
    unembed = case.startswith("llama")
    tc, ids = _trained(service, model_dir, train_unembed=unembed)
    path = tc.save_weights_external("final").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/final"
    urls = tinker_sr.RestClient(service.holder).get_external_weights_urls(path).result()
    assert set(urls.urls) == FILES and all(u.startswith("file://") for u in urls.urls.values())
    adapter = _fetch(urls.urls, tmp_path / "adapter")

    tensors, config = _adapter(adapter)
    assert (config["r"], config["lora_alpha"]) == (4, 32.0)
    assert config["base_model_name_or_path"] == str(model_dir)
    assert all(k.startswith("base_model.model.model.") for k in tensors), sorted(tensors)[:3]
    assert all(t.dtype == torch.float32 for t in tensors.values())
    head = {k for k in tensors if "unembed_tokens" in k}
    assert head == ({f"base_model.model.model.unembed_tokens.lora_{x}.weight" for x in "AB"} if unembed else set())  # fmt: skip
    assert not any("lm_head" in k for k in tensors)  # Tinker's name for it is unembed_tokens

    trained = _engine_logprobs(tc, ids)
    weights.build_hf_model(
        base_model=str(model_dir), adapter_path=str(adapter), output_path=str(tmp_path / "merged")
    )
    merged = _hf_logprobs(_load_hf(tmp_path / "merged"), ids)
    assert torch.allclose(merged, trained, atol=1e-4), (merged - trained).abs().max()
    base = _hf_logprobs(_load_hf(model_dir), ids)
    assert (base - trained).abs().max() > 0.1  # the adapter changes the model

    from peft import PeftModel

    if case.startswith("qwen3_5"):
        # The cookbook's PEFT directory for Qwen3.5 keeps Tinker's split in_proj_q/k/v
        # adapters (for vLLM); transformers has one fused in_proj_qkv, where PEFT finds no
        # module for them. `tinker-sr export` fuses them (tests/test_export.py).
        return
    weights.build_lora_adapter(
        base_model=str(model_dir), adapter_path=str(adapter), output_path=str(tmp_path / "peft")
    )
    peft_model = PeftModel.from_pretrained(_load_hf(model_dir), tmp_path / "peft")
    via_peft = _hf_logprobs(peft_model, ids)
    assert torch.allclose(via_peft, trained, atol=1e-4), (via_peft - trained).abs().max()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "qwen3_vl_moe", "gpt_oss"])
def test_cookbook_merges_a_mixture_of_experts_export(
    family: Any, service: Any, tmp_path: Path
) -> None:
    """Tinker stores an expert layer's adapters stacked, ``mlp.experts.w1`` (gate), ``.w3`` (up),
    ``.w2`` (down), ``[experts, r, in]`` and ``[experts, out, r]``, the shared hidden-side
    factors with one row, ``[1, r, D]`` / ``[1, D, r]``: the cookbook refuses anything
    else ("Expert LoRA weights must be 3D"). Before: one 2-D pair per expert, which neither
    ``build_hf_model`` nor ``build_lora_adapter`` took."""
    from safetensors.torch import load_file, save_file
    from tinker_cookbook import weights

    model_dir = make_tiny_hf_model_dir(tmp_path / family, family=family)
    text = json.loads((model_dir / "config.json").read_text())
    text = text.get("text_config", text)
    experts = text.get("num_experts", text.get("num_local_experts"))
    tc, ids = _trained(service, model_dir, train_unembed=False)
    path = tc.save_weights_external("final").result().path
    urls = tinker_sr.RestClient(service.holder).get_external_weights_urls(path).result()
    adapter = _fetch(urls.urls, tmp_path / "adapter")
    tensors, config = _adapter(adapter)
    assert not any(".experts.0." in k for k in tensors)
    stacked = sorted(k for k in tensors if ".mlp.experts." in k)
    assert stacked and {k.split(".experts.")[1] for k in stacked} == {
        f"{w}.lora_{x}.weight" for w in ("w1", "w2", "w3") for x in "AB"
    }
    for k in stacked:
        shape = tensors[k].shape
        # Tinker's shared-outer scheme: the hidden-side factor (w1's and w3's A, w2's B) is
        # one for all experts, [1, r, D] / [1, D, r]; the cookbook broadcasts it.
        shared = k.endswith(("w1.lora_A.weight", "w3.lora_A.weight", "w2.lora_B.weight"))
        assert len(shape) == 3 and shape[0] == (1 if shared else experts), (k, shape)
        assert shape[1 if ".lora_A." in k else 2] == config["r"], (k, shape)

    trained = _engine_logprobs(tc, ids)
    vl = family == "qwen3_vl_moe"  # transformers builds Qwen3-VL as the vision-language model
    weights.build_hf_model(
        base_model=str(model_dir), adapter_path=str(adapter), output_path=str(tmp_path / "merged")
    )
    merged = _hf_logprobs(_load_hf(tmp_path / "merged", vl=vl), ids)
    assert torch.allclose(merged, trained, atol=1e-4), (merged - trained).abs().max()
    # The experts' adapters were merged, not skipped: without them the model is another one.
    without = tmp_path / "without_experts"
    without.mkdir()
    shutil.copy(adapter / "adapter_config.json", without)
    save_file({k: v for k, v in tensors.items() if k not in stacked}, without / ADAPTER)
    weights.build_hf_model(
        base_model=str(model_dir), adapter_path=str(without), output_path=str(tmp_path / "m2")
    )
    assert (_hf_logprobs(_load_hf(tmp_path / "m2", vl=vl), ids) - trained).abs().max() > 1e-3

    # build_lora_adapter (for vLLM) expands them to each expert's module, values unchanged.
    weights.build_lora_adapter(
        base_model=str(model_dir), adapter_path=str(adapter), output_path=str(tmp_path / "peft")
    )
    peft = load_file(tmp_path / "peft" / ADAPTER)
    proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    for k in stacked:
        layer, rest = k.removeprefix("base_model.model.").split(".experts.")
        w, ab = rest.split(".", 1)
        for e in range(experts):
            name = f"{layer}.experts.{e}.{proj[w]}.{ab}"
            match = [v for n, v in peft.items() if n.endswith(name.removeprefix("model."))]
            assert len(match) == 1, (name, sorted(peft)[:4])
            assert torch.equal(match[0], tensors[k][e if len(tensors[k]) > 1 else 0]), name


def test_tied_unembedding_warns_and_tinker_sr_export_merges_it_exactly(
    service: Any, qwen_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tinker_cookbook import weights

    from tinker_sr.engine.export import export_checkpoint

    tc, ids = _trained(service, qwen_dir, train_unembed=True)
    with caplog.at_level(logging.WARNING, logger="tinker_sr.engine"):
        path = tc.save_weights_external("final").result().path
    assert any("ties its input and output embeddings" in r.getMessage() for r in caplog.records)
    urls = tinker_sr.RestClient(service.holder).get_external_weights_urls(path).result()
    adapter = _fetch(urls.urls, tmp_path / "adapter")
    trained = _engine_logprobs(tc, ids)

    # What the warning says: the cookbook folds the update into the shared embedding ...
    weights.build_hf_model(
        base_model=str(qwen_dir), adapter_path=str(adapter), output_path=str(tmp_path / "cb")
    )
    assert (_hf_logprobs(_load_hf(tmp_path / "cb"), ids) - trained).abs().max() > 1e-2
    # ... and `tinker-sr export --merge` of the same weights unties the head: exact.
    sampler_path = tc.save_weights_for_sampler("same").result().path
    store = Path(service.holder.backend.store_dir)
    export_checkpoint(sampler_path, tmp_path / "sr", merge=True, store_dir=store)
    exact = _hf_logprobs(_load_hf(tmp_path / "sr"), ids)
    assert torch.allclose(exact, trained, atol=1e-4), (exact - trained).abs().max()


def test_encrypted_export_decrypts_to_the_clear_one(
    service: Any, llama_dir: Path, tmp_path: Path
) -> None:
    tc, _ = _trained(service, llama_dir)
    keys = [pyrage.x25519.Identity.generate() for _ in range(2)]
    rest = tinker_sr.RestClient(service.holder)
    clear = rest.get_external_weights_urls(tc.save_weights_external("clear").result().path)
    sealed_path = (
        tc.save_weights_external(
            "sealed", age_encryption_recipients=[str(k.to_public()) for k in keys]
        )
        .result()
        .path
    )
    sealed = rest.get_external_weights_urls(sealed_path).result()
    assert set(sealed.urls) == {f + ".age" for f in FILES}  # no file in the clear
    plain = _fetch(clear.result().urls, tmp_path / "clear")
    for key in keys:  # every recipient can read every file
        for name, url in sealed.urls.items():
            with urllib.request.urlopen(url) as f:
                data = pyrage.decrypt(f.read(), [key])
            assert data == (plain / name.removesuffix(".age")).read_bytes(), name
    with pytest.raises(pyrage.DecryptError):
        with urllib.request.urlopen(sealed.urls["adapter_config.json.age"]) as f:
            pyrage.decrypt(f.read(), [pyrage.x25519.Identity.generate()])


BAD_EXPORTS = [
    ({"age_encryption_recipients": ["age1nope"]}, r"age_encryption_recipients\[0\]: 'age1nope'"),
    ({"age_encryption_recipients": []}, "non-empty list"),
    ({"age_encryption_recipients": ["x"] * 11}, "at most 10 recipients"),
    ({"ttl_seconds": 10}, "ttl_seconds must be between 3600"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_EXPORTS)
def test_bad_export_requests_name_the_field(
    service: Any, kwargs: dict[str, Any], message: str
) -> None:
    tc = service.create_lora_training_client("tinker-sr/tiny", rank=2).result()
    with pytest.raises((tinker_sr.RequestFailedError, ValueError), match=message):
        tc.save_weights_external("x", **kwargs).result()
    assert (
        tinker_sr.RestClient(service.holder).list_checkpoints(tc.model_id).result().checkpoints
        == []
    )
    tc.save_weights_external("x").result()  # the refused request held nothing up


def test_exports_are_files_for_other_tools_only(service: Any, tmp_path: Path) -> None:
    tc = service.create_lora_training_client("tinker-sr/tiny", rank=2).result()
    rest = tinker_sr.RestClient(service.holder)
    path = tc.save_weights_external("hf", ttl_seconds=7200).result().path
    [listed] = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert (listed.checkpoint_type, listed.checkpoint_id) == ("external", "external_weights/hf")
    assert listed.size_bytes > 0 and listed.expires_at is not None
    with pytest.raises(tinker_sr.RequestFailedError, match="already exists"):
        tc.save_weights_external("hf").result()
    with pytest.raises(tinker_sr.RequestFailedError, match="checkpoint name"):
        tc.save_weights_external("../hf").result()
    refusal = "external weights export"
    with pytest.raises(tinker_sr.BadRequestError, match=refusal):  # as a server answers
        service.create_sampling_client(model_path=path).result().sample(
            tinker_sr.types.ModelInput.from_ints([1, 2]), 1, tinker_sr.types.SamplingParams()
        ).result()
    with pytest.raises(tinker_sr.RequestFailedError, match="is an external weights export"):
        service.create_training_client_from_state(path).result()
    with pytest.raises(tinker_sr.BadRequestError, match="external weights export"):
        rest.copy_weights(path).result()
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].expires_at is None
    files = [Path(urllib.request.url2pathname(u[7:])) for u in rest.get_external_weights_urls(path).result().urls.values()]  # fmt: skip
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert not any(f.exists() for f in files) and not files[0].parent.exists()
    with pytest.raises(tinker_sr.NotFoundError, match="does not exist"):
        rest.get_external_weights_urls(path).result()
    tc.save_weights_external("hf").result()  # the name is free again


def test_encryption_without_pyrage_says_what_to_install(
    service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tc = service.create_lora_training_client("tinker-sr/tiny", rank=2).result()
    monkeypatch.setitem(sys.modules, "pyrage", None)  # import pyrage -> ImportError
    key = "age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p"
    with pytest.raises(tinker_sr.RequestFailedError, match="pip install pyrage"):
        tc.save_weights_external("x", age_encryption_recipients=[key]).result()


_ALIASED_SCRIPT = """
import sys, tinker
from tinker_cookbook import weights
assert tinker.__name__ == "tinker_sr", tinker.__name__
tc = tinker.ServiceClient().create_lora_training_client(base_model=sys.argv[1], rank=4).result()
export = tc.save_weights_external("export").result().path
state = tc.save_state("state").result().path
weights.download(tinker_path=export, output_dir=sys.argv[2] + "/export")
weights.download(tinker_path=state, output_dir=sys.argv[2] + "/state")
"""


def test_cookbook_download_runs_unchanged_under_tinker_sr_run(
    llama_dir: Path, tmp_path: Path
) -> None:
    """``tinker-sr run``: the cookbook's ``import tinker`` is tinker_sr, its clients share the
    script's store, the URLs are ``file://`` and the encrypted path decrypts."""
    script = tmp_path / "export.py"
    script.write_text(_ALIASED_SCRIPT)
    env = {**os.environ, "TINKER_SR_STORE": str(tmp_path / "store")}
    env.pop("TINKER_BASE_URL", None)
    cmd = [sys.executable, "-m", "tinker_sr", "run", str(script), str(llama_dir), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    export, _ = _adapter(tmp_path / "export")
    state, _ = _adapter(tmp_path / "state")
    assert export.keys() == state.keys() and all(torch.equal(export[k], state[k]) for k in state)


def test_cookbook_download_under_mock_tinker(tmp_path: Path) -> None:
    """In the offline mock (no socket), the official SDK gets file:// URLs it can read."""
    tinker = pytest.importorskip("tinker")
    from tinker_cookbook import weights

    from tinker_sr.testing import mock_tinker

    with mock_tinker(store=tmp_path / "store"):
        service = tinker.ServiceClient()
        tc = service.create_lora_training_client("Qwen/Qwen3-8B", rank=2).result()
        state = tc.save_state("state").result().path
        out = Path(weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter")))
        service.holder.close()
    tensors, config = _adapter(out)
    assert config["r"] == 2 and tensors and all(k.startswith("base_model.model.") for k in tensors)


def test_refused_exports_free_their_seq_id(tmp_path: Path) -> None:
    """A refused export (or a name the wire cannot carry), from either client, holds no later
    request: with the server's wait for a missing seq_id at 10 minutes, a leaked one would
    hang this test."""
    tinker = pytest.importorskip("tinker")
    from tinker_sr.testing import mock_tinker

    with mock_tinker(store=tmp_path / "store", seq_gap_grace_s=600.0):
        sdk = tinker.ServiceClient()
        tc = sdk.create_lora_training_client("Qwen/Qwen3-8B", rank=2).result()
        with pytest.raises(tinker.BadRequestError, match=r"age_encryption_recipients\[0\]"):
            tc.save_weights_external("x", age_encryption_recipients=["age1nope"]).result()
        tc.save_weights_external("x").result()  # refused at the server's door: seq freed
        sdk.holder.close()

        ours = tinker_sr.ServiceClient()  # tinker_sr's remote client, to the same mock
        tc2 = ours.create_lora_training_client("Qwen/Qwen3-8B", rank=2).result()
        for bad, message in (([1], r"\[0\]: expected a string"), ("age1x", "non-empty list")):
            with pytest.raises(ValueError, match=message):
                tc2.save_weights_external("y", age_encryption_recipients=bad)  # type: ignore[arg-type]
        for save in (tc2.save_state, tc2.save_weights_for_sampler, tc2.save_weights_external):
            with pytest.raises(ValueError, match="checkpoint name"):
                save("\ud800")  # a lone surrogate: no UTF-8 to put on the wire
        tc2.save_weights_external("y").result()  # refused before numbering: nothing to free
        ours.close().result()


# ---- a server, the official SDK, the cookbook and the SDK's CLI ------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Iterator[ServerProcess]:
    with serving_model_dir(tmp_path_factory, llama_dir) as srv:
        yield srv


@pytest.fixture
def sdk(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    tinker = pytest.importorskip("tinker")
    monkeypatch.setenv("TINKER_API_KEY", server.api_key)
    monkeypatch.setenv("TINKER_BASE_URL", server.base_url)
    service = tinker.ServiceClient()
    yield tinker, service
    service.holder.close()


def test_official_sdk_cookbook_and_cli_download_from_tinker_sr_serve(
    sdk: Any, server: ServerProcess, llama_dir: Path, tmp_path: Path
) -> None:
    from tinker_cookbook import weights

    tinker, service = sdk
    tc = service.create_lora_training_client(base_model=str(llama_dir), rank=4).result()
    ids = tc.get_tokenizer().encode(TEXT)
    cross_entropy_steps(tc, tinker.types, ids, steps=3, lr=1e-2)
    export = tc.save_weights_external("final").result().path
    state = tc.save_state("state").result().path
    rest = tinker.RestClient()
    urls = rest.get_external_weights_urls(export).result()
    assert set(urls.urls) == FILES
    assert all(u.startswith(server.base_url + "/api/v1/") for u in urls.urls.values())
    direct = _fetch(urls.urls, tmp_path / "direct")  # plain GETs, no API key

    # The cookbook: an export as it is, and a training checkpoint (exported to a fresh age key,
    # downloaded, decrypted, the temporary export deleted).
    via_export = Path(weights.download(tinker_path=export, output_dir=str(tmp_path / "cb1")))
    via_state = Path(weights.download(tinker_path=state, output_dir=str(tmp_path / "cb2")))
    # The official SDK's command line, on the training checkpoint.
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": server.api_key}
    cli = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "--output"]
    proc = subprocess.run([*cli, str(tmp_path / "cli")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [via_cli] = (tmp_path / "cli").iterdir()

    reference, config = _adapter(direct)
    for got in (via_export, via_state, via_cli):
        assert {p.name for p in got.iterdir()} == FILES, got
        tensors, got_config = _adapter(got)
        assert got_config["r"] == config["r"] and got_config["lora_alpha"] == config["lora_alpha"]
        assert tensors.keys() == reference.keys()
        assert all(torch.equal(tensors[k], reference[k]) for k in reference)
    # Only the two checkpoints of the run remain: the temporary exports were deleted.
    kinds = sorted(c.checkpoint_id for c in rest.list_user_checkpoints().result().checkpoints)
    assert [k for k in kinds if k.startswith("external_weights/")] == ["external_weights/final"]

    weights.build_hf_model(
        base_model=str(llama_dir), adapter_path=str(via_state), output_path=str(tmp_path / "m")
    )
    merged = _hf_logprobs(_load_hf(tmp_path / "m"), ids)
    trained = _engine_logprobs(tc, ids, tinker.types)
    assert torch.allclose(merged, trained, atol=1e-4), (merged - trained).abs().max()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url) as f:
            f.read()
            return int(f.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_signed_urls_grant_one_file_until_deleted(
    sdk: Any, server: ServerProcess, llama_dir: Path
) -> None:
    tinker, service = sdk
    tc = service.create_lora_training_client(base_model=str(llama_dir), rank=2).result()
    path = tc.save_weights_external("signed").result().path
    rest = tinker.RestClient()
    urls = rest.get_external_weights_urls(path).result().urls
    good = urls["adapter_config.json"]
    assert _status(good) == 200
    flipped = good[:-1] + ("0" if good[-1] != "0" else "1")
    other = urls["adapter_model.safetensors"].split("?")[0] + "?" + good.split("?")[1]
    for bad in (flipped, good.split("?")[0], other, good.replace("signed", "x", 1)):
        assert _status(bad) == 403, bad
    assert _status(good.split("&sig=")[0] + "&sig=%C3%A9") == 403  # not hex: refused, no 500
    with pytest.raises(tinker.BadRequestError, match="not published"):
        rest.publish_checkpoint_from_tinker_path(path).result()
    # Another user can neither sign URLs for it nor delete it.
    theirs = tinker.RestClient(api_key="tml-someone-else")
    with pytest.raises(tinker.NotFoundError):
        theirs.get_external_weights_urls(path).result()
    # tinker_sr's own remote client reads the same URLs.
    mine = tinker_sr.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    try:
        assert tinker_sr.RestClient(mine.holder).get_external_weights_urls(path).result().urls.keys() == urls.keys()  # fmt: skip
    finally:
        mine.close().result()
    # Deleted, then saved again under the same name: the old URL reads neither.
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert _status(good) == 403
    tc.save_weights_external("signed").result()
    assert _status(good) == 403
    assert _status(rest.get_external_weights_urls(path).result().urls["adapter_config.json"]) == 200


def test_url_signatures_expire_and_survive_a_restart(tmp_path: Path) -> None:
    from tinker_sr.server.downloads import KEY_FILE, UrlSigner, load_key
    from tinker_sr.server.http import HTTPError

    signer = UrlSigner(load_key(tmp_path))
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
    urls, expires = signer.sign("http://h", "run:train:0", "na me", "v1", ["f.json"], now=1000.0)
    assert expires.timestamp() == 1000 + 3600
    query = dict(kv.split("=") for kv in urls["f.json"].split("?")[1].split("&"))
    assert urls["f.json"].startswith(
        "http://h/api/v1/external_weights_files/run%3Atrain%3A0/na%20me/"
    )
    again = UrlSigner(load_key(tmp_path))  # a restarted server reads the same key
    args = ("run:train:0", "na me", "v1", "f.json", query["expires"])
    again.check(*args, query["sig"], now=4599.0)
    with pytest.raises(HTTPError, match="expired at"):
        again.check(*args, query["sig"], now=4600.0)
    for sig in ("", "é" * 64, query["sig"].upper(), query["sig"] + "0"):
        with pytest.raises(HTTPError, match="not signed"):
            again.check(*args, sig, now=0.0)
    with pytest.raises(HTTPError, match="not signed"):
        again.check(*args[:4], "9" * 40, query["sig"], now=0.0)
    with pytest.raises(HTTPError, match="saved again"):  # another version of the checkpoint
        again.check("run:train:0", "na me", "v2", *args[3:], query["sig"], now=0.0)
    with pytest.raises(HTTPError, match="does not match"):  # another server's key
        UrlSigner(load_key(None)).check(*args, query["sig"], now=0.0)


def test_export_of_a_variant_names_its_base(service: Any, qwen_dir: Path) -> None:
    """Trained on a Tinker variant id ("<dir>:peft:<context>"), the export's
    adapter_config.json named the variant id, which no loader resolves; it names the base."""
    tc = service.create_lora_training_client(f"{qwen_dir}:peft:512", rank=2).result()
    path = tc.save_weights_external("v").result().path
    urls = tinker_sr.RestClient(service.holder).get_external_weights_urls(path).result().urls
    with urllib.request.urlopen(urls["adapter_config.json"]) as f:
        config = json.loads(f.read())
    assert config["base_model_name_or_path"] == str(qwen_dir.resolve())
