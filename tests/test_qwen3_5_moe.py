"""Qwen3.5-MoE directories (Qwen3.5-35B-A3B, -397B-A17B: the cookbook's large defaults) as the
Hub ships them: Qwen3.5's hybrid layers with a routed mixture of experts and a shared expert
(scaled by a sigmoid gate) in every layer. Checked against transformers (logits, per-expert
and fused-expert checkpoints, the config), LoRA on every routed and the shared expert (never
the routers or the shared gate), sampling against teacher forcing. Batched decode in
tests/engine/test_batching.py, the merged export in tests/test_export.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import tinker_sr  # noqa: E402
from tests._train import learns_and_samples_as_the_learner  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.engine.hf_config import config_from_hf  # noqa: E402
from tinker_sr.engine.lora import LoraLinear  # noqa: E402
from tinker_sr.engine.model import SparseMoe  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402

PROMPT = "User: what is 12 plus 30?\n\nAssistant:"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("q35moe") / "tiny", "qwen3_5_moe")


def _logits(model: Any, n: int = 70) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 400, (2, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        out = model(ids)
    return ids, out if isinstance(out, torch.Tensor) else out.logits


def _fuse_experts(root: Path, out: Path) -> None:
    """The checkpoint with each layer's experts as 3-D tensors (gate_up_proj [E, 2F, D],
    down_proj [E, D, F]: transformers 5's in-memory layout, which some checkpoints keep)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(root, out)
    tensors = load_file(root / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        stem, sep, rest = key.partition(".mlp.experts.")
        if not sep:
            fused[key] = t
            continue
        e, name = int(rest.split(".")[0]), rest.split(".")[1]
        if name != "gate_proj":
            continue
        if e == 0:
            n = sum(1 for k in tensors if k.startswith(f"{stem}.mlp.experts.") and "gate" in k)
            pre = f"{stem}.mlp.experts."
            gate_up = [torch.cat([tensors[f"{pre}{i}.gate_proj.weight"],
                                  tensors[f"{pre}{i}.up_proj.weight"]]) for i in range(n)]  # fmt: skip
            fused[f"{pre}gate_up_proj"] = torch.stack(gate_up)
            fused[f"{pre}down_proj"] = torch.stack(
                [tensors[f"{pre}{i}.down_proj.weight"] for i in range(n)]
            )
    save_file(fused, out / "model.safetensors", metadata={"format": "pt"})


def test_logits_equal_transformers_with_either_expert_layout(moe_dir: Path, tmp_path: Path) -> None:
    ours = load_model_dir(moe_dir)
    mlp = ours.model.layers[0].mlp
    assert isinstance(mlp, SparseMoe) and hasattr(mlp, "shared_expert")
    assert ours.config.moe_layers == (0, 1, 2, 3) and ours.config.hybrid
    theirs = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    _, want = _logits(theirs)
    torch.testing.assert_close(_logits(ours)[1], want, rtol=0, atol=1e-5)
    _fuse_experts(moe_dir, tmp_path / "fused")
    torch.testing.assert_close(
        _logits(load_model_dir(tmp_path / "fused"))[1], want, rtol=0, atol=1e-5
    )


def test_config_read_as_transformers_reads_it(moe_dir: Path) -> None:
    import json

    from transformers import Qwen3_5MoeConfig

    hf = json.loads((moe_dir / "config.json").read_text())
    ours = config_from_hf(hf, "m")
    theirs = Qwen3_5MoeConfig(**{k: v for k, v in hf.items() if k != "architectures"}).text_config
    assert (ours.n_experts, ours.experts_per_token) == (
        theirs.num_experts,
        theirs.num_experts_per_tok,
    )
    assert (ours.moe_ffn_dim, ours.shared_expert_ffn_dim) == (
        theirs.moe_intermediate_size, theirs.shared_expert_intermediate_size)  # fmt: skip
    assert list(ours.layer_types) == theirs.layer_types and ours.norm_topk_prob


def test_lora_covers_routed_and_shared_experts_and_learns(tmp_path: Path, moe_dir: Path) -> None:
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(str(moe_dir), rank=4, seed=1).result()
    model = backend.models.trainer(training.model_id).model
    moe = model.model.layers[1].mlp
    owners = [*moe.experts, moe.shared_expert]
    assert all(isinstance(getattr(o, p), LoraLinear) for o in owners
               for p in ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
    assert type(moe.gate) is torch.nn.Linear and type(moe.shared_expert_gate) is torch.nn.Linear

    ids = training.get_tokenizer().encode(PROMPT + " 42")
    learns_and_samples_as_the_learner(training, types, ids)
    assert moe.shared_expert.down_proj.lora_B.weight.abs().sum() > 0  # every token reaches it
    client.close().result()
    backend.close()
