"""`tinker-sr export`: a trained LoRA checkpoint → a PEFT adapter dir and a merged HF model dir
that `peft` / `transformers` load with tinker_sr's logits (1e-4 in float32)."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer  # noqa: E402

import tinker_sr  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.cli import main as cli  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402

TOKENS = [[3, 17, 101, 250, 40, 51, 200, 7, 9, 30]]  # valid for every model here


def _train_and_save(
    tmp_path: Path, base_model: str, **lora: Any
) -> tuple[LocalBackend, str, torch.Tensor]:
    """Train a LoRA a few steps (so B != 0), save sampler weights; return the store, the
    tinker path and the engine's logits on TOKENS."""
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(base_model, rank=4, seed=1, **lora).result()
    ids = TOKENS[0]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = training.save_weights_for_sampler(name="final").result().path
    model = backend.models.trainer(training.model_id).model
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS))
    client.close().result()
    return backend, path, logits


def _hf_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float()


@pytest.fixture(
    scope="module",
    params=[
        "qwen3",
        "qwen2",
        "llama-bias",
        "qwen3_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_vl",
        "qwen3_vl_moe",
        "gpt_oss",
    ],
)
def model_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """Qwen3; Qwen2 with its q/k/v biases and Llama with attention_bias (biases on q, k, v and
    o): LoRA on biased projections, both exports; Qwen3-MoE: adapters on every expert, merged
    (a PEFT directory cannot carry them to transformers 5: refused); Qwen3.5 as the Hub ships
    it (a vision-language checkpoint): the merged text model, and the q/k/v adapters of its
    linear attention fused into one on in_proj_qkv for PEFT, named under the vision-language
    model's ``model.language_model.`` (loaded as it and as the text-only class);
    Qwen3.5-MoE merged; Qwen3-VL (dense and MoE, vision-language checkpoints): the merged text
    model, and for PEFT the adapters under ``model.language_model.``; gpt-oss merged (its
    experts fused back, gate and up interleaved, the router and the sinks as transformers
    names them)."""
    root = tmp_path_factory.mktemp("m") / f"tiny-{request.param}"
    if request.param == "llama-bias":
        return make_tiny_hf_model_dir(root, family="llama", attention_bias=True)
    return make_tiny_hf_model_dir(root, family=request.param)


def test_merged_and_peft_exports_reproduce_the_logits(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend, path, ours = _train_and_save(tmp_path, str(model_dir))
    store = str(backend.store_dir)
    backend.close()
    # A vision-language checkpoint (Qwen3.5 as the Hub ships it, Qwen3-VL) loads as what its
    # architectures name, as vLLM serves it (transformers has no causal-LM class for Qwen3-VL).
    vl = model_dir.name.startswith(("tiny-qwen3_vl", "tiny-qwen3_5"))
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    base = auto.from_pretrained(model_dir)
    assert (_hf_logits(base) - ours).abs().max() > 1e-3  # the adapter changed something

    merged_dir = tmp_path / "merged"
    assert cli(["export", path, str(merged_dir), "--merge", "--store", store]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert merged.dtype == torch.float32
    assert not merged.config.tie_word_embeddings  # the lm_head adapter unties it
    torch.testing.assert_close(_hf_logits(merged), ours, rtol=0, atol=1e-4)
    tok = AutoTokenizer.from_pretrained(merged_dir)
    assert tok.encode("hello world") == AutoTokenizer.from_pretrained(model_dir).encode(
        "hello world"
    )
    assert (merged_dir / "generation_config.json").is_file()

    peft = pytest.importorskip("peft")
    adapter_dir = tmp_path / "adapter"
    if "moe" in model_dir.name or "gpt_oss" in model_dir.name:  # PEFT would drop the experts'
        # adapters: refused, by name
        assert cli(["export", path, str(adapter_dir), "--store", store]) != 0
        assert re.search(r"mixture-of-experts.*--merge.*train_mlp", capsys.readouterr().err)
        assert not adapter_dir.exists()
        return
    assert cli(["export", path, str(adapter_dir), "--store", store]) == 0
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and "lm_head" in config["target_modules"]
    peft_model = peft.PeftModel.from_pretrained(base, adapter_dir)
    torch.testing.assert_close(_hf_logits(peft_model), ours, rtol=0, atol=1e-4)
    if "qwen3_5" in model_dir.name:  # its text-only class, with the key_mapping docs/models.md
        # gives: a Qwen3.5 adapter attaches under both (it attached under this one alone)
        text = AutoModelForCausalLM.from_pretrained(model_dir)
        text_only = {r"^model\.language_model\.": "model."}
        peft_text = peft.PeftModel.from_pretrained(text, adapter_dir, key_mapping=text_only)
        torch.testing.assert_close(_hf_logits(peft_text), ours, rtol=0, atol=1e-4)


def test_builtin_model_merged_export_loads_in_transformers(tmp_path: Path) -> None:
    backend, path, ours = _train_and_save(tmp_path, "tinker-sr/tiny", train_unembed=False)
    ckpt_file = str(backend.checkpoints.path_of(backend.checkpoints.live(path)))
    backend.close()
    out = tmp_path / "merged"
    assert cli(["export", ckpt_file, str(out), "--merge"]) == 0  # a checkpoint file works too
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.config.tie_word_embeddings  # no lm_head adapter: still tied
    torch.testing.assert_close(_hf_logits(merged), ours, rtol=0, atol=1e-4)
    assert AutoTokenizer.from_pretrained(out).encode("hi", add_special_tokens=False) == [104, 105]


def test_bf16_merged_export_keeps_the_dtype(tmp_path: Path) -> None:
    root = make_tiny_hf_model_dir(tmp_path / "l", family="llama", dtype="bfloat16", sharded=True)
    backend, path, ours = _train_and_save(tmp_path, str(root), train_attn=False)
    store = str(backend.store_dir)
    backend.close()
    out = tmp_path / "merged"
    assert cli(["export", path, str(out), "--merge", "--store", store]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # bf16 compute differs from the engine's (which adds the float32 adapter path to bf16
    # activations) at bf16 precision; the adapter's own effect is far larger.
    base = AutoModelForCausalLM.from_pretrained(root)
    drift = (_hf_logits(merged) - ours).abs().max()
    assert drift < 0.1 * (_hf_logits(base) - ours).abs().max() and drift < 0.2


def test_export_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = "tinker://nope/sampler_weights/x"
    assert cli(["export", missing, str(tmp_path / "o"), "--store", str(tmp_path)]) == 2
    assert "no tinker_sr store" in capsys.readouterr().err
    assert cli(["export", str(tmp_path / "none.safetensors"), str(tmp_path / "o")]) == 2
    assert "checkpoint file not found" in capsys.readouterr().err


def test_export_refuses_a_base_the_adapter_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PEFT export checks the adapter against the base it names, as a merge does: it wrote
    an adapter_config.json naming a base the adapter cannot load into, with exit status 0.
    A failed export leaves no directory behind; a checkpoint not in the store names the store
    that was searched."""
    backend, path, _ = _train_and_save(tmp_path, "tinker-sr/tiny")
    backend.close()
    store = str(tmp_path / "store")
    for merge in ([], ["--merge"]):
        out = tmp_path / f"out{len(merge)}"
        argv = ["export", path, str(out), "--store", store, "--base-model", "tinker-sr/small"]
        assert cli(argv + merge) == 2
        err = capsys.readouterr().err
        assert "LoRA weights do not match this model" in err and "same base model" in err, err
        assert not out.exists()
    assert cli(["export", path, str(tmp_path / "ok"), "--store", store]) == 0
    assert (tmp_path / "ok" / "adapter_config.json").is_file()
    other = tmp_path / "other"
    LocalBackend(other).close()  # an empty store
    assert cli(["export", path, str(tmp_path / "o2"), "--store", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"Looked in the store at {other}" in err and "--store DIR" in err, err


def test_export_never_writes_over_a_directory_or_leaves_half_an_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`export CKPT <base dir> --merge` overwrote the base model's weights with the merged ones
    (then crashed on copying its tokenizer onto itself); a non-empty directory kept an older
    export's files beside the new ones; a file or an unwritable path gave a raw traceback."""
    import hashlib

    base = make_tiny_hf_model_dir(tmp_path / "base")
    backend, path, _ = _train_and_save(tmp_path, str(base))
    store = str(backend.store_dir)
    backend.close()

    def digest() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in base.iterdir()}

    before = digest()
    for merge in (["--merge"], []):
        assert cli(["export", path, str(base), "--store", store, *merge]) == 2
        err = capsys.readouterr().err
        assert "is not empty" in err and "base model's own directory" in err, err
    assert digest() == before
    older = tmp_path / "older"
    older.mkdir()
    (older / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    assert cli(["export", path, str(older), "--store", store, "--merge"]) == 2
    assert "not empty" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert cli(["export", path, str(a_file), "--store", store]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert cli(["export", path, str(a_file / "sub"), "--store", store]) == 2
    err = capsys.readouterr().err
    assert "Not a directory" in err and str(a_file) in err and "Traceback" not in err, err
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory (mkdtemp's, a mount point's) is used as it is
    empty.chmod(0o2775)
    assert cli(["export", path, str(empty), "--store", store, "--merge"]) == 0
    assert (empty / "model.safetensors").is_file() and (empty / "tokenizer.json").is_file()
    assert stat.S_IMODE(empty.stat().st_mode) == 0o2775  # its mode kept (a staging dir's: 0700)
    assert not [p for p in empty.iterdir() if p.name.startswith(".")]  # no staging left
    fresh = tmp_path / "new" / "out"
    assert cli(["export", path, str(fresh), "--store", store]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o777 & ~umask
    linked = tmp_path / "linked"
    (tmp_path / "target").mkdir()
    linked.symlink_to(tmp_path / "target")
    assert cli(["export", path, str(linked), "--store", store]) == 0
    assert (tmp_path / "target" / "adapter_config.json").is_file()
    here = tmp_path / "here"
    here.mkdir()
    cwd = os.getcwd()
    os.chdir(here)
    try:
        assert cli(["export", path, ".", "--store", store]) == 0
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in here.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    (tmp_path / "killed" / ".export-abc").mkdir(parents=True)  # what a killed export leaves
    assert cli(["export", path, str(tmp_path / "killed"), "--store", store]) == 2
    assert "an export that was interrupted" in capsys.readouterr().err


def test_peft_export_of_a_variant_names_its_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint trained on a Tinker variant id ("<base>:peft:<context>") exported an
    adapter_config.json naming the variant id, which no loader resolves: AutoPeftModel failed
    on it. It names the base: a local directory resolved, a Hub name as a Hub name."""
    peft = pytest.importorskip("peft")
    base = make_tiny_hf_model_dir(tmp_path / "base")
    backend, path, ours = _train_and_save(tmp_path, f"{base}:peft:512")
    store = str(backend.store_dir)
    backend.close()
    adapter = tmp_path / "adapter"
    assert cli(["export", path, str(adapter), "--store", store]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(adapter)
    torch.testing.assert_close(_hf_logits(loaded), ours, rtol=0, atol=1e-4)

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo, sha = tmp_path / "hub" / "models--tiny-org--tiny", "c" * 40
    make_tiny_hf_model_dir(repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    hub_ckpt = tmp_path / "hub_run"
    backend, path, _ = _train_and_save(hub_ckpt, "tiny-org/tiny:peft:512")
    backend.close()
    out = tmp_path / "hub_adapter"
    assert cli(["export", path, str(out), "--store", str(hub_ckpt / "store")]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-org/tiny"


def test_peft_export_of_a_hub_revision_names_it_as_peft_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A base named with its revision ("org/model@<sha>", as the cache lookup takes it) was
    written whole as base_model_name_or_path, which huggingface_hub refuses as a repo id: the
    name and PEFT's ``revision`` now, which PEFT reads back."""
    peft = pytest.importorskip("peft")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, sha = tmp_path / "hub" / "models--tiny-org--tiny", "d" * 40
    make_tiny_hf_model_dir(repo / "snapshots" / sha)
    backend, path, _ = _train_and_save(tmp_path, f"tiny-org/tiny@{sha}")
    store = str(backend.store_dir)
    backend.close()
    out = tmp_path / "adapter"
    assert cli(["export", path, str(out), "--store", store]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("tiny-org/tiny", sha)
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(config["base_model_name_or_path"])  # raised for "org/model@<sha>"
    assert peft.PeftConfig.from_pretrained(out).revision == sha
    base = peft.PeftConfig.from_pretrained(out).base_model_name_or_path
    assert base == "tiny-org/tiny"


def test_export_of_an_aliased_base_says_to_pass_base_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint records its base by the name it was trained on: an alias (or a `serve
    --model-dir` name). Exported where that alias is not set, the error said to alias the name
    to tinker-sr/tiny, which the adapter does not fit; it says to pass --base-model DIR."""
    from tinker_sr.engine.export import export_checkpoint
    from tinker_sr.engine.registry import ModelRegistry
    from tinker_sr.user_errors import ModelUnavailableError

    base = make_tiny_hf_model_dir(tmp_path / "base")
    monkeypatch.setenv("TINKER_SR_MODEL_ALIASES", f"tiny-org/aliased={base}")
    backend, path, ours = _train_and_save(tmp_path, "tiny-org/aliased")
    store = backend.store_dir
    backend.close()
    monkeypatch.delenv("TINKER_SR_MODEL_ALIASES")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # no such Hub name cached
    out = tmp_path / "out"
    assert cli(["export", path, str(out), "--merge", "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert "'tiny-org/aliased' is not available" in err and "Looked for" in err, err
    assert "--base-model DIR" in err and "alias it" not in err, err
    with pytest.raises(ModelUnavailableError, match="--base-model DIR"):  # the type kept
        export_checkpoint(path, out, merge=False, store_dir=store)
    with pytest.raises(ModelUnavailableError, match="Pass --base-model") as e:
        export_checkpoint(path, out, merge=True, store_dir=store, base_model=str(tmp_path / "x"))
    assert "alias it" not in str(e.value)
    with pytest.raises(ModelUnavailableError, match="alias it: TINKER_SR_MODEL_ALIASES"):
        ModelRegistry({}).resolve_model("tiny-org/aliased")  # a request's fix is unchanged
    argv = ["export", path, str(out), "--merge", "--store", str(store), "--base-model", str(base)]
    assert cli(argv) == 0  # the fix it names works
    torch.testing.assert_close(
        _hf_logits(AutoModelForCausalLM.from_pretrained(out)), ours, rtol=0, atol=1e-4
    )
