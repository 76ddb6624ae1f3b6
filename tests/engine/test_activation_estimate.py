"""`model.activation_bytes`, the estimate the automatic activation checkpointing decides on
(`model.checkpoint_pays`), against what a LoRA training step's forward really keeps for
backward: every tensor autograd saves (saved-tensor hooks), weights left out, counted once per
storage. An estimate under the real size lets a long datum run out of memory instead of
checkpointing; Qwen3.5's linear attention was 1.3x over its estimate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import tinker_sr  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine import compiled, training  # noqa: E402
from tinker_sr.engine import model as model_mod  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402


def _model_dir(path: Path, family: str) -> Path:
    """The tiny helper's tokenizer beside random weights of widths where per-token terms of a
    few floats (a LoRA rank's, a norm's scale) are as small beside the rest as in real models:
    hidden 256, 4 layers (Qwen3.5: three linear-attention layers, 2 key / 4 value heads of 64,
    then one gated-attention layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_tiny_hf_model_dir(path, family, pad_vocab_to_multiple=1024)  # type: ignore[arg-type]
    hf = json.loads((path / "config.json").read_text())
    sizes: dict[str, Any] = dict(
        vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        **{k: hf.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )  # fmt: skip
    if family == "qwen3_5":
        sizes.update(
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, architectures=["Qwen3_5ForCausalLM"],
        )  # fmt: skip
        config = AutoConfig.for_model("qwen3_5_text", **sizes)
    else:
        config = AutoConfig.for_model("qwen3", **sizes)
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _saved_and_estimated(
    tmp: Path, family: str, lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, int]:
    model_dir = _model_dir(tmp / family, family)
    counted: dict[str, int] = {}
    hidden_rows = training._hidden_rows

    def counting(model: Any, batch: Any, groups: Any, kept: int) -> Any:
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}
        alive = []  # no storage freed (and its address reused) while counting

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            alive.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = hidden_rows(model, batch, groups, kept)
        counted["saved"] = sum(saved.values())
        counted["estimate"] = model_mod.activation_bytes(model.config, kept)
        return out

    monkeypatch.setattr(training, "_hidden_rows", counting)
    service = tinker_sr.ServiceClient(backend=LocalBackend(tmp / f"store-{family}"))
    client = service.create_lora_training_client(base_model=str(model_dir), rank=8, seed=0)
    gen = torch.Generator().manual_seed(0)
    data = []
    for n in lengths:
        row = torch.randint(10, 200, (n + 1,), generator=gen).tolist()
        inputs = {"target_tokens": row[1:], "weights": [1.0] * n}
        data.append(
            types.Datum(model_input=types.ModelInput.from_ints(row[:-1]), loss_fn_inputs=inputs)
        )
    client.result().forward_backward(data, "cross_entropy").result()
    return counted["saved"], counted["estimate"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_activation_estimate_covers_what_a_step_saves(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved, estimate = _saved_and_estimated(tmp_path, family, [320, 320], monkeypatch)
    # The estimate leaves out per-token terms of a few floats (norm scales, LoRA rank products:
    # ~1 % here, less at real widths); Qwen3.5's linear attention was 1.27x over it. torch's
    # kernels ($TINKER_SR_NATIVE=0: its attention and norms) save ~8 % more than the C ones.
    limit = 1.05 if compiled.native_mode() != "off" else 1.15
    assert saved <= limit * estimate, (saved, estimate)
    assert estimate <= 1.5 * saved, (saved, estimate)
