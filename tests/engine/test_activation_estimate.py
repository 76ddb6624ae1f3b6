"""`model.activation_bytes`, the estimate the automatic activation checkpointing decides on
(`model.checkpoint_pays`), against what a LoRA training step's forward really keeps for
backward: every tensor autograd saves (saved-tensor hooks), weights left out, counted once per
storage. An estimate under the real size lets a long datum run out of memory instead of
checkpointing; Qwen3.5's linear attention was 1.3x over its estimate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import tinker_sr  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine import compiled  # noqa: E402
from tinker_sr.testing.hf_model_dir import save_random_model  # noqa: E402
from tinker_sr.testing.saved_activations import counting_saved_activations  # noqa: E402


def _model_dir(path: Path, family: str) -> Path:
    """The tiny helper's tokenizer beside random weights of widths where per-token terms of a
    few floats (a LoRA rank's, a norm's scale) are as small beside the rest as in real models:
    hidden 256, 4 layers (Qwen3.5: three linear-attention layers, 2 key / 4 value heads of 64,
    then one gated-attention layer)."""
    from transformers import AutoConfig

    def config_of(**special_ids: Any) -> Any:
        sizes: dict[str, Any] = dict(
            vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        )  # fmt: skip
        if family != "qwen3_5":
            return AutoConfig.for_model("qwen3", **sizes, **special_ids)
        return AutoConfig.for_model(
            "qwen3_5_text", **sizes, **special_ids, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            architectures=["Qwen3_5ForCausalLM"],
        )  # fmt: skip

    return save_random_model(path, family, 1024, config_of)  # type: ignore[arg-type]


def _saved_and_estimated(tmp: Path, family: str, lengths: list[int]) -> tuple[int, int]:
    model_dir = _model_dir(tmp / family, family)
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
    with counting_saved_activations() as counted:
        client.result().forward_backward(data, "cross_entropy").result()
    return counted["saved"], counted["estimate"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_activation_estimate_covers_what_a_step_saves(family: str, tmp_path: Path) -> None:
    saved, estimate = _saved_and_estimated(tmp_path, family, [320, 320])
    # The estimate leaves out per-token terms of a few floats (norm scales, LoRA rank products:
    # ~1 % here, less at real widths); Qwen3.5's linear attention was 1.27x over it. torch's
    # kernels ($TINKER_SR_NATIVE=0: its attention and norms) save ~8 % more than the C ones.
    limit = 1.05 if compiled.native_mode() != "off" else 1.15
    assert saved <= limit * estimate, (saved, estimate)
    assert estimate <= 1.5 * saved, (saved, estimate)
