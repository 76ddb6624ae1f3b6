"""Model directories whose files are there but are not what a reader can take: a weight or JSON
file that is a named pipe (reading it blocked the process, holding the GIL: a server froze for
every user), a JSON file of gigabytes (read whole: MemoryError or the OOM killer), the same
tensor in two shards (blamed on config.json), config.json fields transformers refuses (blamed
on the tokenizer files), and directories `tinker-sr serve` started with although every request
for them would be refused. Each is refused naming the file and field."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.hf_files import read_json  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.hf import ModelTokenizer, load_hf_tokenizer  # noqa: E402
from tinker_sr.user_errors import EngineUserError  # noqa: E402

NOT_REGULAR = "not a regular file but a named pipe, a device or a socket"
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("files") / "base")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("shards") / "base", sharded=True)


def _copy(src: Path, dst: Path, change: Callable[[Path], object] = lambda d: None) -> Path:
    shutil.copytree(src, dst)
    change(dst)
    return dst


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _edit(path: Path, **fields: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _serve_refuses(root: Path, tmp_path: Path) -> str:
    """`tinker-sr serve --model-dir root` refusing to start in one line: its stderr (a
    timeout, not a hang, where it starts or blocks)."""
    done = subprocess.run(
        [sys.executable, "-m", "tinker_sr", "serve", "--port", "0", "--store",
         str(tmp_path / "store"), "--model-dir", str(root)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


# Each in a child process with a timeout: a regression blocks in open(), holding the GIL.
_FIFO_CASES = """
import json, sys
from pathlib import Path
from tinker_sr.engine.hf import load_model_dir
from tinker_sr.hf_files import read_json
from tinker_sr.tokenization.hf import ModelTokenizer, load_hf_tokenizer
cases = {"load": load_model_dir, "read_json": lambda d: read_json(d / "config.json"),
         "model_tokenizer": ModelTokenizer, "get_tokenizer": load_hf_tokenizer}
try:
    cases[sys.argv[1]](Path(sys.argv[2]))
    print("loaded")
except Exception as e:
    print(type(e).__name__, e)
"""


@needs_fifo
@pytest.mark.parametrize(
    ("where", "case", "fifo"),
    [("single", "load", "model.safetensors"), ("shard", "load", ""),
     ("glob", "load", "b.safetensors"), ("stray", "load", "stray.safetensors"),
     ("single", "read_json", "config.json"),
     ("single", "model_tokenizer", "tokenizer.json"),
     ("single", "model_tokenizer", "generation_config.json"),
     ("single", "get_tokenizer", "tokenizer.json"), ("single", "get_tokenizer", "vocab.json")],
)  # fmt: skip
def test_a_named_pipe_in_a_model_directory_is_refused_not_waited_on(
    base: Path, sharded: Path, tmp_path: Path, where: str, case: str, fifo: str
) -> None:
    """Before: safe_open or transformers opened the pipe and waited for a writer forever
    (`weight_files` skipped a piped model.safetensors, then globbed it back in)."""
    root = _copy(sharded if where in ("shard", "stray") else base, tmp_path / "m")
    shards = sorted(root.glob("model-*.safetensors"))
    if where == "shard":  # one the index names
        fifo = shards[1].name
    if where == "glob":  # no model.safetensors, no index: every *.safetensors is read
        (root / "model.safetensors").rename(root / "a.safetensors")
    if where == "stray":  # an index that leaves a shard out: the files it does not name are
        index = json.loads((root / "model.safetensors.index.json").read_text())  # probed
        weight_map = {k: v for k, v in index["weight_map"].items() if v != shards[-1].name}
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _fifo(root / fifo)
    done = subprocess.run(
        [sys.executable, "-c", _FIFO_CASES, case, str(root)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if where == "stray":  # the pipe is named among the files not read, and never opened
        assert "checkpoint lacks" in done.stdout and fifo in done.stdout, done.stdout + done.stderr
        return
    assert done.stdout.startswith("EngineUserError"), done.stdout + done.stderr
    assert f"{root / fifo}: {NOT_REGULAR}" in done.stdout


@needs_fifo
def test_serve_refuses_a_piped_weight_file_at_start(base: Path, tmp_path: Path) -> None:
    """Before: `tinker-sr serve --model-dir` hung at startup, printing nothing."""
    root = _copy(base, tmp_path / "m", lambda d: _fifo(d / "model.safetensors"))
    assert f"{root}/model.safetensors: {NOT_REGULAR}" in _serve_refuses(root, tmp_path)


def _huge(path: Path, size: int = 257 * 2**20) -> None:
    """A sparse file of ``size`` bytes (no disk used) that starts as JSON."""
    with open(path, "wb") as f:
        f.write(b'{"model_type": "qwen3", "pad": "')
        f.truncate(size)


def test_a_json_file_over_the_cap_is_refused_unread(base: Path, tmp_path: Path) -> None:
    """Before: read whole (5 GiB: a bare MemoryError, or the OOM killer ending a server)."""
    from tinker_sr import hf_files

    assert hf_files.MAX_JSON_BYTES == 256 * 2**20  # as docs/models.md says
    root = _copy(base, tmp_path / "m", lambda d: _huge(d / "config.json", 5 * 2**30))
    with pytest.raises(EngineUserError, match="over the 256 MiB a model directory's JSON") as e:
        read_json(root / "config.json")
    assert str(e.value).startswith(f"{root}/config.json: 5368709120 bytes")
    with pytest.raises(EngineUserError, match=f"{root}/config.json: 5368709120 bytes"):
        load_model_dir(root)


def test_a_huge_tokenizer_file_is_refused_before_transformers_reads_it(
    base: Path, tmp_path: Path
) -> None:
    root = _copy(base, tmp_path / "m", lambda d: _huge(d / "tokenizer.json"))
    for load in (ModelTokenizer, load_hf_tokenizer):
        with pytest.raises(EngineUserError, match="over the 256 MiB") as e:
            load(root)
        assert str(e.value).startswith(f"{root}/tokenizer.json: {257 * 2**20} bytes")


def test_a_tensor_stored_in_two_shards_is_named_as_stored_twice(
    sharded: Path, tmp_path: Path
) -> None:
    """Before: "checkpoint holds 1 tensors that ... has no place for ... check config.json"."""

    def twice(d: Path) -> None:
        a, b = sorted(d.glob("model-*.safetensors"))[:2]
        wa, wb = load_file(a), load_file(b)
        name = next(iter(wa))
        save_file({**wb, name: wa[name].clone()}, b, metadata={"format": "pt"})

    root = _copy(sharded, tmp_path / "m", twice)
    with pytest.raises(EngineUserError, match="is stored twice") as e:
        load_model_dir(root)
    a, b = sorted(p.name for p in root.glob("model-*.safetensors"))[:2]
    assert f"is stored twice, in {a} and {b}" in str(e.value)
    assert "has no place for" not in str(e.value)


def test_a_shard_in_a_subfolder_is_named_with_it(sharded: Path, tmp_path: Path) -> None:
    def nest(d: Path) -> None:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))

    root = _copy(sharded, tmp_path / "m", nest)
    with pytest.raises(EngineUserError, match="'sub/model-00001-of-0000"):
        load_model_dir(root)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"layer_types": ["full_attention", "wat"]}, "layer_types=['full_attention', 'wat']"),
     ({"layer_types": ["full_attention"]}, "layer_types=['full_attention'] must list"),
     ({"layer_types": "full_attention"}, "layer_types='full_attention' must list"),
     ({"dtype": "bogus"}, "dtype='bogus' is not a torch dtype"),
     ({"dtype": None, "torch_dtype": "bf16"}, "torch_dtype='bf16' is not a torch dtype")],
    ids=["unknown-kind", "too-few", "not-a-list", "dtype", "torch_dtype"],
)  # fmt: skip
def test_config_fields_transformers_refuses_are_named_not_blamed_on_the_tokenizer(
    base: Path, tmp_path: Path, fields: dict[str, object], named: str
) -> None:
    """Before: the engine trained and sampled, then get_tokenizer() failed telling the user to
    copy the tokenizer files from the model's release."""
    root = _copy(base, tmp_path / "m", lambda d: _edit(d / "config.json", **fields))
    with pytest.raises(EngineUserError, match="fix config.json") as e:
        load_model_dir(root)
    assert f"config.json {named}" in str(e.value)
    assert "dtype" in named or "each of the 2 layers (num_hidden_layers)" in str(e.value)
    with pytest.raises(EngineUserError, match="does not load its config.json either") as e:
        load_hf_tokenizer(root)
    assert "fix config.json" in str(e.value) and "copy them from" not in str(e.value)


@pytest.mark.parametrize(
    ("value"),
    [["full_attention", "full_attention"], ["sliding_attention", "full_attention"], None],
)
def test_config_fields_real_models_ship_still_load(
    base: Path, tmp_path: Path, value: object
) -> None:
    def change(d: Path) -> None:
        _edit(d / "config.json", layer_types=value, dtype="float32", torch_dtype="auto")

    load_model_dir(_copy(base, tmp_path / "m", change))


_REFUSED_BY_REQUESTS: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "config-eos-outside": ("config.json", lambda d: _edit(d, eos_token_id=10**6), "outside"),
    "generation-not-json": ("generation_config.json", lambda f: f.write_text("{"), "JSON"),
    "generation-eos-outside": ("generation_config.json", lambda f: _edit(f, eos_token_id=[10**6]),
                               "outside"),
    "tokenizer-config-not-json": ("tokenizer_config.json", lambda f: f.write_text("{x"), "JSON"),
    "tokenizer-a-list": ("tokenizer.json", lambda f: f.write_text("[]"), "a JSON object"),
    "added-token-negative": ("tokenizer.json", lambda f: f.write_text(json.dumps({
        **json.loads(f.read_text()), "added_tokens": [{"id": -1, "content": "<x>"}]})),
        "added tokens"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_REFUSED_BY_REQUESTS))
def test_serve_checks_at_start_what_each_request_would_refuse(
    base: Path, tmp_path: Path, case: str
) -> None:
    """docs/models.md: serve refuses to start where a request would be refused later. Before:
    it started, and every request for the directory failed. Checked before torch loads."""
    from tinker_sr.cli import build_parser, model_aliases_from_args

    fname, damage, said = _REFUSED_BY_REQUESTS[case]
    root = _copy(base, tmp_path / "m", lambda d: damage(d / fname))
    args = build_parser().parse_args(["serve", "--model-dir", str(root)])
    with pytest.raises(SystemExit, match=said) as e:
        model_aliases_from_args(args, deep=False)
    assert str(e.value).startswith(f"tinker-sr serve: --model-dir {root}")


def test_serve_refuses_a_directory_requests_refuse_before_loading_torch(
    base: Path, tmp_path: Path
) -> None:
    root = _copy(base, tmp_path / "m", lambda d: _edit(d / "config.json", eos_token_id=10**6))
    err = _serve_refuses(root, tmp_path)
    assert f"--model-dir {root}: EOS token ids [1000000]" in err
    code = (
        "import sys\nfrom tinker_sr.cli import build_parser, model_aliases_from_args\n"
        f"args = build_parser().parse_args(['serve', '--model-dir', {str(root)!r}])\n"
        "try:\n    model_aliases_from_args(args, deep=False)\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
