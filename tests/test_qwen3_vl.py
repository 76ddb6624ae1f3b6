"""Qwen3-VL directories (Tinker serves Qwen3-VL-30B-A3B-Instruct and -235B-A22B-Instruct) as
the Hub ships them: a vision-language checkpoint (``Qwen3VLForConditionalGeneration``,
``Qwen3VLMoeForConditionalGeneration``) around a Qwen3 or Qwen3-MoE text model, which the
engine loads for text (its multimodal RoPE is plain RoPE on text; the vision tower is left
out). Checked against transformers' vision-language model on text: logits, with the experts
as transformers holds them and as the Hub's checkpoints store them (transposed); the config;
LoRA learning and sampling; the official SDK through `tinker-sr serve`. The exports are in
tests/test_export.py. Before: "architecture 'Qwen3VLForConditionalGeneration' is not
supported"."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

import tinker_sr  # noqa: E402
from tests._server import ServerProcess, serving_model_dir  # noqa: E402
from tests._train import (  # noqa: E402
    learns_and_samples_as_the_learner,
    official_sdk_trains_and_samples,
)
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.engine.hf_config import config_from_hf  # noqa: E402
from tinker_sr.engine.lora import LoraLinear  # noqa: E402
from tinker_sr.engine.model import SparseMoe  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.user_errors import EngineUserError  # noqa: E402

PROMPT = "User: what is 12 plus 30?\n\nAssistant:"
FAMILIES = ["qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def vl_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("vl") / request.param, request.param)


def _logits(model: Any, n: int = 40) -> torch.Tensor:
    ids = torch.randint(0, 400, (2, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _hub_layout(root: Path, out: Path) -> Path:
    """The checkpoint with each layer's fused experts transposed, as the Hub's Qwen3-VL-MoE
    checkpoints store them (gate_up_proj [E, D, 2F], down_proj [E, F, D])."""
    shutil.copytree(root, out)
    tensors = load_file(root / "model.safetensors")
    tensors = {k: t.transpose(1, 2).contiguous() if ".mlp.experts." in k else t
               for k, t in tensors.items()}  # fmt: skip
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_text_logits_equal_transformers_vision_language_model(vl_dir: Path, tmp_path: Path) -> None:
    ours = load_model_dir(vl_dir)
    theirs = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    want = _logits(theirs)
    torch.testing.assert_close(_logits(ours), want, rtol=0, atol=1e-5)
    if "moe" not in vl_dir.name:
        assert ours.config.tie_embeddings and not ours.config.n_experts
        return
    assert isinstance(ours.model.layers[0].mlp, SparseMoe) and ours.config.norm_topk_prob
    stored = load_file(vl_dir / "model.safetensors")
    gate_up = next(t for k, t in stored.items() if k.endswith("experts.gate_up_proj"))
    assert gate_up.shape == (8, 48, 64)  # transformers' layout, as its save_pretrained writes
    hub = _hub_layout(vl_dir, tmp_path / "hub")
    torch.testing.assert_close(_logits(load_model_dir(hub)), want, rtol=0, atol=1e-5)
    theirs_hub = AutoModelForImageTextToText.from_pretrained(hub, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(theirs_hub), want, rtol=0, atol=1e-5)


def test_config_read_as_transformers_reads_it(vl_dir: Path) -> None:
    from transformers import AutoConfig

    hf = json.loads((vl_dir / "config.json").read_text())
    ours = config_from_hf(hf, "m")
    theirs = AutoConfig.from_pretrained(vl_dir).text_config
    assert (ours.dim, ours.n_layers, ours.n_heads, ours.n_kv_heads, ours.head_dim) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
        theirs.num_key_value_heads, theirs.head_dim)  # fmt: skip
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.qk_norm
    assert ours.max_seq_len == theirs.max_position_embeddings
    # The wrapper's tie_word_embeddings decides, as transformers ties by it.
    assert ours.tie_embeddings == hf["tie_word_embeddings"]
    # RoPE keys beyond what the engine computes are refused by name.
    bad = json.loads(json.dumps(hf))
    bad["text_config"]["rope_parameters"]["partial_rotary_factor"] = 0.5
    with pytest.raises(EngineUserError, match="partial_rotary_factor"):
        config_from_hf(bad, "m")


def test_lora_learns_and_samples_what_the_learner_computes(tmp_path: Path, vl_dir: Path) -> None:
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(str(vl_dir), rank=4, seed=1).result()
    model = backend.models.trainer(training.model_id).model
    assert isinstance(model.model.layers[1].self_attn.q_proj, LoraLinear)
    learns_and_samples_as_the_learner(
        training, types, training.get_tokenizer().encode(PROMPT + " 42")
    )
    client.close().result()
    backend.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, vl_dir: Path) -> Iterator[ServerProcess]:
    with serving_model_dir(tmp_path_factory, vl_dir) as srv:
        yield srv


def test_the_official_sdk_trains_and_samples_a_qwen3_vl_dir(
    server: ServerProcess, vl_dir: Path
) -> None:
    tinker = pytest.importorskip("tinker")
    official_sdk_trains_and_samples(tinker, server.base_url, str(vl_dir), PROMPT + " 42")
