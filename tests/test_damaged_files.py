"""Files as users really have them when something is wrong with them. Model directories: a
tensor stored as integers or FP8 codes, a NaN in a norm, a quantized release, a value beyond
the chosen dtype, a malformed shard index, a tokenizer without its files. Checkpoints: a file
cut short or holding a NaN. Each is refused when loading, naming the file or checkpoint, the
tensor or field and the fix, instead of training a silently different model, failing later
with advice about the loss inputs, or answering "internal error"."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import tinker_sr  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.engine.checkpoints import load_tensors  # noqa: E402
from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.hf import TOKENIZER_FILE_NAMES, load_hf_tokenizer  # noqa: E402
from tinker_sr.user_errors import EngineUserError  # noqa: E402

O_PROJ = "model.layers.0.self_attn.o_proj.weight"
NORM = "model.layers.1.post_attention_layernorm.weight"
Weights = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("hostile") / "base")


def _serve_refuses(root: Path, tmp_path: Path) -> str:
    """`tinker-sr serve --model-dir root` refusing to start in one line: its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "tinker_sr", "serve", "--port", "0", "--store",
         str(tmp_path / "store"), "--model-dir", str(root)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def _variant(base: Path, dst: Path, mutate: Callable[[Weights], None]) -> Path:
    """A copy of `base` whose weights went through `mutate` (re-saved as a valid file)."""
    shutil.copytree(base, dst)
    weights = load_file(base / "model.safetensors")
    mutate(weights)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "dtype",
    [torch.int32, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn],
    ids=lambda d: str(d).removeprefix("torch."),
)
def test_a_weight_stored_as_codes_is_refused_naming_it(
    base: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    """Before: an int32/int8/bool/FP8 tensor was cast to float and trained on (quantized codes
    or junk taken for weights, silently)."""

    def codes(w: Weights) -> None:
        w[O_PROJ] = (w[O_PROJ] * 100).to(dtype)

    root = _variant(base, tmp_path / "m", codes)
    with pytest.raises(EngineUserError, match=f"tensor {O_PROJ} is stored as") as err:
        load_model_dir(root)
    assert "model.safetensors" in str(err.value) and "unquantized" in str(err.value)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float16], ids=lambda d: str(d).removeprefix("torch.")
)
def test_other_float_storage_still_loads_cast(
    base: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    reference = load_model_dir(base).state_dict()[O_PROJ]

    def widen(w: Weights) -> None:
        w[O_PROJ] = w[O_PROJ].to(dtype)

    loaded = load_model_dir(_variant(base, tmp_path / "m", widen)).state_dict()[O_PROJ]
    assert loaded.dtype == torch.float32
    torch.testing.assert_close(loaded, reference.to(dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_is_refused_naming_the_tensor(
    base: Path, tmp_path: Path, value: float
) -> None:
    def corrupt(w: Weights) -> None:
        w[NORM] = w[NORM].clone()
        w[NORM][3] = value

    root = _variant(base, tmp_path / "m", corrupt)
    with pytest.raises(EngineUserError, match=f"tensor {NORM} holds 1 non-finite values"):
        load_model_dir(root)


def test_a_user_sees_the_corrupt_tensor_not_advice_about_the_loss(
    base: Path, tmp_path: Path
) -> None:
    """Before: the first forward_backward said 'the loss is nan ... scale that datum's loss
    inputs down', which is wrong advice for a corrupt checkpoint."""

    def corrupt(w: Weights) -> None:
        w["model.norm.weight"] = w["model.norm.weight"].clone()
        w["model.norm.weight"][0] = float("nan")

    root = _variant(base, tmp_path / "m", corrupt)
    service = tinker_sr.ServiceClient()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(tinker_sr.RequestFailedError) as err:
        client = service.create_lora_training_client(base_model=str(root), rank=4).result()
        client.forward_backward([datum], "cross_entropy").result()
    message = str(err.value)
    assert "model.norm.weight holds 1 non-finite values" in message
    assert "corrupt" in message and "loss inputs" not in message


def test_a_value_beyond_the_chosen_dtype_is_refused_as_an_overflow(
    base: Path, tmp_path: Path
) -> None:
    def large(w: Weights) -> None:
        w[O_PROJ] = w[O_PROJ].clone()
        w[O_PROJ][0, 0] = 1e5  # finite in float32, beyond float16's 65504

    root = _variant(base, tmp_path / "m", large)
    assert load_model_dir(root).state_dict()[O_PROJ][0, 0] == 1e5
    with pytest.raises(EngineUserError, match="overflow float16: load it in a wider dtype"):
        load_model_dir(root, dtype=torch.float16)


def test_a_float16_tensor_whose_sum_overflows_is_finite_and_loads(
    base: Path, tmp_path: Path
) -> None:
    """The cheap test is a sum; a finite float16 tensor can sum past 65504, and must load."""

    def big(w: Weights) -> None:
        w[O_PROJ] = torch.full_like(w[O_PROJ], 1000.0)

    root = _variant(base, tmp_path / "m", big)
    model = load_model_dir(root, dtype=torch.float16)
    weight = model.state_dict()[O_PROJ]
    assert not torch.isfinite(weight.sum()) and bool(torch.isfinite(weight).all())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_quantized_release_is_refused_by_its_config_field(tmp_path: Path, family: str) -> None:
    """Qwen3.5's field sits on the vision-language wrapper, beside text_config; before, reading
    the text model's config dropped it and the FP8 weights met the loader unannounced."""
    root = make_tiny_hf_model_dir(tmp_path / family, family=family, n_layers=1)
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineUserError, match=r"quantization_config \(fp8\) is not supported"):
        load_model_dir(root)


def test_a_tokenizer_without_its_files_names_what_the_directory_holds(
    base: Path, tmp_path: Path
) -> None:
    """Before: transformers' ValueError ('Couldn't instantiate the backend tokenizer ...'),
    naming neither the directory nor the files it lacks."""
    root = tmp_path / "m"
    shutil.copytree(base, root)
    (root / "tokenizer.json").unlink()
    with pytest.raises(EngineUserError) as err:
        load_hf_tokenizer(root)
    message = str(err.value)
    assert str(root) in message and "tokenizer_config.json" in message
    assert "needs tokenizer.json" in message
    service = tinker_sr.ServiceClient()
    client = service.create_lora_training_client(base_model=str(root), rank=4).result()
    with pytest.raises(EngineUserError, match="its tokenizer does not load"):
        client.get_tokenizer()


def test_a_tokenizer_json_this_tokenizers_cannot_read_says_to_upgrade(
    base: Path, tmp_path: Path
) -> None:
    """Found by a hunt: tokenizers 0.19 cannot read a tokenizer.json written by 0.20 or later
    (merges as pairs), and the error asked for a tokenizer.json that was there."""
    root = tmp_path / "m"
    shutil.copytree(base, root)
    spec = json.loads((root / "tokenizer.json").read_text())
    spec["model"]["type"] = "BPE2"  # a model kind this library does not know
    (root / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(EngineUserError) as err:
        load_hf_tokenizer(root)
    message = str(err.value)
    assert "pip install -U tokenizers transformers" in message and "needs tokenizer" not in message


def test_a_directory_without_any_tokenizer_file_is_refused_not_served_empty(
    base: Path, tmp_path: Path
) -> None:
    """config.json and the weights only, as training frameworks often save them. Before:
    transformers 5 built a Qwen2 tokenizer from nothing, whose whole vocabulary is its one
    special token: every text encoded to [], and get_tokenizer() handed that to the user."""
    root = tmp_path / "weights-only"
    shutil.copytree(base, root, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert not {p.name for p in root.iterdir()} & TOKENIZER_FILE_NAMES
    service = tinker_sr.ServiceClient()
    client = service.create_lora_training_client(base_model=str(root), rank=4).result()
    with pytest.raises(EngineUserError, match=r"Tokenizer files there: none.*needs tokenizer.json"):
        client.get_tokenizer()


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
def test_a_json_file_that_is_not_utf8_is_refused_naming_it(
    base: Path, tmp_path: Path, name: str
) -> None:
    """A Latin-1 byte in a model's JSON: an "internal error: UnicodeDecodeError" (a server-side
    failure, naming no file) for the user, a traceback from `tinker-sr serve --model-dir`."""
    root = tmp_path / "m"
    shutil.copytree(base, root)
    text = (root / name).read_bytes()
    (root / name).write_bytes(text.replace(b"{", b'{"note": "caf\xe9", ', 1))
    service = tinker_sr.ServiceClient()
    refused = (tinker_sr.RequestFailedError, tinker_sr.BadRequestError)
    with pytest.raises(refused, match=f"{name}: cannot read JSON .* must be UTF-8") as err:
        service.create_lora_training_client(base_model=str(root), rank=4).result()
    if isinstance(err.value, tinker_sr.RequestFailedError):
        assert err.value.category == types.RequestErrorCategory.User
    if name == "config.json":
        assert f"{root}/config.json: cannot read JSON" in _serve_refuses(root, tmp_path)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("sharded") / "base", sharded=True)


def _with_index(sharded: Path, dst: Path, index: object) -> Path:
    shutil.copytree(sharded, dst)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize(
    "weight_map",
    [["a"], {"w": 3}, {"w": "/etc/passwd"}, {"w": "../base/x.safetensors"}, "x.safetensors"],
    ids=["list", "number", "absolute", "parent", "string"],
)
def test_a_malformed_shard_index_is_refused_by_field(
    sharded: Path, tmp_path: Path, weight_map: object
) -> None:
    """Before: AttributeError / TypeError for a list or a number, and a shard named by an
    absolute or ../ path was read from outside the model directory."""
    root = _with_index(sharded, tmp_path / "m", {"weight_map": weight_map})
    with pytest.raises(EngineUserError, match="weight_map must map each tensor name"):
        load_model_dir(root)


def test_an_index_that_leaves_shards_out_says_which_are_not_read(
    sharded: Path, tmp_path: Path
) -> None:
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    kept = {k: v for k, v in index["weight_map"].items() if v == first}
    root = _with_index(sharded, tmp_path / "m", {"weight_map": kept})
    with pytest.raises(EngineUserError, match=r"checkpoint lacks .* more here are not read"):
        load_model_dir(root)


def _mixed(sharded: Path, dst: Path, single_from: Path) -> Path:
    """`sharded` (its index and shards) plus `single_from`'s model.safetensors beside them."""
    shutil.copytree(sharded, dst)
    shutil.copy(single_from / "model.safetensors", dst / "model.safetensors")
    return dst


def test_a_single_file_beside_an_index_loads_as_transformers_loads_it(
    base: Path, tmp_path: Path
) -> None:
    """Before: the index's shards were read where transformers reads model.safetensors, so the
    same folder computed another model in each (logprobs 2.6 nats apart)."""
    from transformers import AutoModelForCausalLM

    other = make_tiny_hf_model_dir(tmp_path / "other", sharded=True, seed=1)
    root = _mixed(other, tmp_path / "m", single_from=base)
    ours = load_model_dir(root).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(root).state_dict()
    assert torch.equal(ours[O_PROJ], theirs[O_PROJ])
    assert torch.equal(ours[O_PROJ], load_file(base / "model.safetensors")[O_PROJ])
    assert not torch.equal(ours[O_PROJ], load_model_dir(other).state_dict()[O_PROJ])


@pytest.mark.parametrize("stray", ["adapter_model.safetensors", "consolidated.safetensors"])
def test_other_safetensors_files_beside_model_safetensors_are_not_read(
    base: Path, tmp_path: Path, stray: str
) -> None:
    """Before: every *.safetensors file was read, and a PEFT adapter or a consolidated copy
    beside model.safetensors made the folder refused ("no place for" its tensors)."""
    root = _variant(base, tmp_path / "m", lambda w: None)
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, root / stray)
    loaded = load_model_dir(root).state_dict()
    assert torch.equal(loaded[O_PROJ], load_file(base / "model.safetensors")[O_PROJ])
    (root / "model.safetensors").rename(root / "weights.safetensors")
    with pytest.raises(EngineUserError, match=rf"in \['{stray}'\].*move other files"):
        load_model_dir(root)


def _linked_as_in_the_hf_cache(model_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """`model_dir`'s files copied into ``blobs/`` and linked from ``snapshots/abc/``, as the
    Hugging Face cache lays a model out: (blobs, snapshot)."""
    blobs, root = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    root.mkdir(parents=True)
    for f in model_dir.iterdir():
        shutil.copy(f, blobs / f.name)
        (root / f.name).symlink_to(blobs / f.name)
    return blobs, root


def test_shards_linked_from_outside_the_folder_load_as_in_the_hf_cache(
    sharded: Path, tmp_path: Path
) -> None:
    """The Hugging Face cache's snapshot folders hold links into ../../blobs: a shard name is
    checked as written, not resolved."""
    blobs, root = _linked_as_in_the_hf_cache(sharded, tmp_path)
    reference = load_model_dir(sharded).state_dict()
    loaded = load_model_dir(root).state_dict()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


def _damage(file: Path, how: str) -> None:
    raw = file.read_bytes()
    if how == "cut":
        file.write_bytes(raw[: len(raw) // 2])
        return
    tensors, metadata = load_tensors(file)
    key = next(k for k, t in sorted(tensors.items()) if t.is_floating_point())
    tensors = {k: t.clone() for k, t in tensors.items()}
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, file, metadata=metadata)


@pytest.mark.parametrize("how", ["cut", "nan"])
def test_a_damaged_checkpoint_is_refused_naming_its_tinker_path(
    service: tinker_sr.ServiceClient,
    backend_kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    how: str,
) -> None:
    """Before: a file cut short answered "internal error: SafetensorError: ..." and a NaN
    loaded, to fail the next step's loss. Embedded and through `tinker-sr serve`."""
    store = (
        tmp_path / "store"
        if backend_kind == "local"
        else request.getfixturevalue("remote_server").store
    )
    client = service.create_lora_training_client(base_model="tinker-sr/tiny", rank=4).result()
    name = f"damaged-{how}-{tmp_path.name}"
    path = client.save_state(name).result().path
    (file,) = store.glob(f"checkpoints/**/{name}.safetensors")
    _damage(file, how)
    what = "its file does not read" if how == "cut" else "NaN or infinite values"
    for message in _resume_errors(service, client, path):
        assert f"checkpoint {path} is damaged on disk" in message and what in message
        assert "internal error" not in message and str(store) not in message


def _resume_errors(service: tinker_sr.ServiceClient, client: Any, path: str) -> list[str]:
    """The errors of resuming from `path` the ways users do: a new client from the state
    (with and without its optimizer), and `load_state` into an existing one. Each must fail."""
    messages = []
    for load in (
        lambda: service.create_training_client_from_state(path).result(),
        lambda: service.create_training_client_from_state_with_optimizer(path).result(),
        lambda: client.load_state(path).result(),
    ):
        with pytest.raises(tinker_sr.RequestFailedError) as err:
            load()
        messages.append(str(err.value))
    return messages


def test_a_damaged_store_database_is_refused_with_the_way_out(tmp_path: Path) -> None:
    """Before: sqlite3.DatabaseError 'file is not a database' and a traceback, from the
    embedded engine, `tinker-sr serve` and `tinker-sr export` alike."""
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine.store import StoreDamagedError

    store = tmp_path / "store"
    store.mkdir()
    database = store / "engine.sqlite"
    database.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 8)
    with pytest.raises(StoreDamagedError, match="not a readable tinker_sr store") as err:
        LocalBackend(store)
    assert str(database) in str(err.value) and "move it aside" in str(err.value)
    for argv in (["serve", "--port", "0"], ["export", "tinker://r:train:0/weights/a", "out"]):
        done = subprocess.run(
            [sys.executable, "-m", "tinker_sr", *argv, "--store", str(store)],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert "not a readable tinker_sr store" in done.stderr
    database.rename(store / "engine.sqlite.damaged")  # the way out the message gives
    LocalBackend(store).close()


@pytest.mark.parametrize("damage", ["garbage", "cut in half"])
def test_a_damaged_server_database_is_refused_with_the_way_out(tmp_path: Path, damage: str) -> None:
    """The server's own database (futures, sessions): before, a 21-line traceback ending in
    'file is not a database' or 'database disk image is malformed'."""
    from tinker_sr.server.state import ServerState

    store = tmp_path / "store"
    ServerState(store / "server.sqlite").close()  # a real one, with its schema
    database = store / "server.sqlite"
    data = database.read_bytes()
    if damage == "garbage":
        database.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 8)
    else:
        database.write_bytes(data[: len(data) // 2])
    done = subprocess.run(
        [sys.executable, "-m", "tinker_sr", "serve", "--port", "0", "--store", str(store)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip()
    assert line.startswith(f"tinker-sr serve: {database}: not a readable tinker_sr store"), line
    assert "futures, sessions" in line and "checkpoints, kept in engine.sqlite, stay" in line
    database.rename(store / "server.sqlite.damaged")  # the way out the message gives
    ServerState(database).close()


def test_serve_refuses_at_start_a_model_dir_whose_tensors_it_would_refuse(
    base: Path, tmp_path: Path
) -> None:
    """The operator hears of a foreign tensor dtype at start, from the safetensors headers
    (no weight is read), not a user at the first request. Before: only config.json was
    checked at start."""

    def codes(w: Weights) -> None:
        w[O_PROJ] = w[O_PROJ].to(torch.int8)

    root = _variant(base, tmp_path / "m", codes)
    err = _serve_refuses(root, tmp_path)
    assert f"--model-dir {root}/model.safetensors: tensor {O_PROJ} is stored as I8" in err


@pytest.mark.parametrize(
    ("field", "value"),
    [("lora", None), ("lora", "{not json"), ("lora", '{"rank": 3, "seed": null}'),
     ("lora", '{"rank": 4, "seed": null, "colour": 1}'), ("steps", "x"), ("base_model", ""),
     ("lora", '{"rank": 4, "seed": null, "moe_shared_outer": "no"}')],
    ids=["lora-dropped", "lora-not-json", "rank-edited", "lora-unknown-key", "steps", "base",
         "moe-shared-outer-not-bool"],
)  # fmt: skip
def test_a_checkpoint_whose_metadata_is_damaged_is_refused_naming_the_field(
    embedded_service: tinker_sr.ServiceClient, tmp_path: Path, field: str, value: str | None
) -> None:
    """Before: KeyError / JSONDecodeError / TypeError / ValueError from deep in the load, all
    answered as "internal error" (found by tests/fuzz/test_fuzz_checkpoint_files.py)."""
    client = embedded_service.create_lora_training_client(
        base_model="tinker-sr/tiny", rank=4
    ).result()
    path = client.save_state("meta").result().path
    (file,) = (tmp_path / "store").glob("checkpoints/**/meta.safetensors")
    tensors, metadata = load_tensors(file)
    if value is None:
        del metadata[field]
    else:
        metadata[field] = value
    save_file(tensors, file, metadata=metadata)
    for message in _resume_errors(embedded_service, client, path):
        assert f"checkpoint {path} is damaged: its metadata's {field}" in message, message


def test_a_pruned_cache_blob_names_the_missing_shard_and_the_fix(
    sharded: Path, tmp_path: Path
) -> None:
    """An interrupted or pruned download leaves a snapshot's link to its blob dangling."""
    blobs, root = _linked_as_in_the_hf_cache(sharded, tmp_path)
    shard = sorted(blobs.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(EngineUserError, match=f"missing: \\['{shard.name}'\\]; copy or download"):
        load_model_dir(root)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4, 5)], ids=["0-d", "1-d", "4-d"])
def test_fused_experts_of_the_wrong_rank_are_refused_by_name(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """Before: TypeError ('iteration over a 0-d tensor') or RuntimeError from splitting them."""
    base = make_tiny_hf_model_dir(tmp_path / "vl", "qwen3_vl_moe", n_layers=1)
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"

    def reshape(w: Weights) -> None:
        w[key] = torch.zeros(shape)

    root = _variant(base, tmp_path / "m", reshape)
    with pytest.raises(EngineUserError, match=f"tensor {key} has shape .* must have 3"):
        load_model_dir(root)


def _same_logits_in_transformers(a: Path, b: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 9, 300, 17, 42, 260]])
    with torch.no_grad():
        one, two = (AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits for d in (a, b))
    assert torch.equal(one, two)


def test_tensor_names_save_pretrained_would_not_write_load_as_transformers_loads_them(
    tmp_path: Path,
) -> None:
    """Two layouts transformers loads by its own renaming: a bare model's state dict (no
    ``model.`` prefix) and a tied model whose embedding is stored only as ``lm_head.weight``.
    Both were refused ("lack the 'model.' prefix", "store them as model.embed_tokens");
    now each loads the very weights of the directory save_pretrained wrote, as
    transformers does (its logits on both identical)."""
    plain = make_tiny_hf_model_dir(tmp_path / "plain", "mistral")
    bare = tmp_path / "bare"
    shutil.copytree(plain, bare)
    stored = load_file(bare / "model.safetensors")
    assert "lm_head.weight" in stored  # untied: the output layer keeps its name
    save_file({k.removeprefix("model."): v for k, v in stored.items()}, bare / "model.safetensors")
    _same_logits_in_transformers(plain, bare)
    want = load_model_dir(plain).state_dict()
    got = load_model_dir(bare).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    tied = make_tiny_hf_model_dir(tmp_path / "tied")  # Qwen3's: tied
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"]
    stored = load_file(tied / "model.safetensors")
    head_only = tmp_path / "head_only"
    shutil.copytree(tied, head_only)
    stored["lm_head.weight"] = stored.pop("model.embed_tokens.weight")
    save_file(stored, head_only / "model.safetensors")
    _same_logits_in_transformers(tied, head_only)
    want = load_model_dir(tied).state_dict()
    got = load_model_dir(head_only).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_an_emptied_store_database_beside_checkpoints_is_refused(tmp_path: Path) -> None:
    """engine.sqlite cut to 0 bytes (a crash, a full disk, a bad copy) with checkpoint files
    beside it: before, it opened as a new, empty store listing none of them, without a word."""
    import tinker_sr
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine.store import StoreDamagedError

    store = tmp_path / "store"
    backend = LocalBackend(store)
    service = tinker_sr.ServiceClient(backend=backend)
    tc = service.create_lora_training_client("tinker-sr/tiny", rank=4).result()
    tc.save_state("s").result()
    service.close().result()
    backend.close()
    for extra in store.glob("engine.sqlite-*"):  # its WAL files, gone with it
        extra.unlink()
    (store / "engine.sqlite").write_bytes(b"")
    with pytest.raises(StoreDamagedError, match="the file is empty, and checkpoints/ is not"):
        LocalBackend(store)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "engine.sqlite").write_bytes(b"")  # empty, nothing beside it: a new store
    LocalBackend(fresh).close()


def test_a_store_folder_that_cannot_be_written_is_said_as_such(tmp_path: Path) -> None:
    """A checkpoints/ folder that cannot be written (read-only, permissions, a file in its
    place) failed every save as "internal error: NotADirectoryError: ..."; the error now
    says the store cannot be written, where, and the way out."""
    import asyncio

    from tinker_sr import errors, types
    from tinker_sr.backend.local import LocalBackend

    store = tmp_path / "store"
    store.mkdir()
    (store / "checkpoints").write_text("not a folder")

    async def save() -> str:
        backend = LocalBackend(store)
        try:
            session = await backend.create_session()
            model = await backend.create_model(
                session, 0, base_model="tinker-sr/tiny", lora_config=types.LoraConfig(rank=2)
            )
            with pytest.raises(errors.RequestFailedError) as e:
                await backend.save_state(model, 1, "st")
            return str(e.value)
        finally:
            await backend.aclose()

    text = asyncio.run(save())
    assert "the store cannot be written" in text and "<store>/checkpoints" in text, text
    assert "internal error" not in text and str(store) not in text


def test_missing_tensors_name_the_config_field_to_check(tmp_path: Path) -> None:
    """Found by a hunt: an untied config over a checkpoint without lm_head.weight, and a
    num_hidden_layers above the stored layers, said only "checkpoint lacks N tensors"."""
    untied = make_tiny_hf_model_dir(tmp_path / "untied", "llama", n_layers=2)
    weights = load_file(untied / "model.safetensors")
    weights.pop("lm_head.weight")
    save_file(weights, untied / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EngineUserError, match="set tie_word_embeddings to true"):
        load_model_dir(untied)
    deeper = make_tiny_hf_model_dir(tmp_path / "deeper", "llama", n_layers=2)
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(EngineUserError, match="stores layers 0-1 and config.json's num_hidden_"):
        load_model_dir(deeper)
    # Tensors missing because the index leaves a shard unread: that is the fix, not config.json.
    sharded = make_tiny_hf_model_dir(tmp_path / "sharded", "llama", n_layers=4, sharded=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    last = max(index["weight_map"].values())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != last}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineUserError, match="more here are not read") as err:
        load_model_dir(sharded)
    assert "tie_word_embeddings" not in str(err.value) and "num_hidden" not in str(err.value)


def test_an_unread_shard_of_a_mapped_layout_is_still_named(tmp_path: Path) -> None:
    """Qwen3.5 stores other names than the engine's: an unread shard holding the missing
    tensors is found through the same mapping as on load (review: it was not named)."""
    root = make_tiny_hf_model_dir(tmp_path / "q", "qwen3_5", sharded=True)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    last = max(index["weight_map"].values())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != last}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineUserError, match=rf"more here are not read \(\['{last}'\]\)"):
        load_model_dir(root)


def test_a_stray_file_beside_an_index_does_not_hide_the_config_hint(tmp_path: Path) -> None:
    """Before: any *.safetensors the index does not name (a LoRA adapter, a consolidated copy
    of other tensors) was blamed for the missing tensors, and the config hint was left out."""
    deeper = make_tiny_hf_model_dir(tmp_path / "deeper", "llama", n_layers=2, sharded=True)
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, deeper / "adapter.safetensors")
    with pytest.raises(EngineUserError, match="stores layers 0-1 and config.json's num_hidden_"):
        load_model_dir(deeper)
