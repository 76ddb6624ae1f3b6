"""External weights (`TrainingClient.save_weights_external`): a LoRA adapter in the layout
Tinker exports for other tools, so the tools users already have read tinker_sr checkpoints:
tinker-cookbook's ``weights.download`` / ``weights.build_hf_model`` /
``weights.build_lora_adapter`` and the official SDK's ``tinker checkpoint download``.

An export is a directory of two files:

- ``adapter_model.safetensors`` (float32): ``base_model.model.<module>.lora_A.weight`` and
  ``.lora_B.weight`` for every adapted module, e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; the unembedding's adapter
  under Tinker's name ``base_model.model.model.unembed_tokens`` (the cookbook maps it to
  ``lm_head``, or to ``embed_tokens`` when the base ties its embeddings). ``lora_B`` is stored
  unscaled: the update is ``(lora_alpha / r) · B A``. A mixture of experts' adapters are
  stacked per layer and projection, as Tinker stores them: ``...mlp.experts.w1`` (gate),
  ``.w3`` (up) and ``.w2`` (down), ``lora_A`` of shape ``[experts, r, in]`` and ``lora_B`` of
  ``[experts, out, r]``; the cookbook expands them to each expert's module.
- ``adapter_config.json``: ``r`` and ``lora_alpha`` (what the cookbook reads), the base model
  name and PEFT's other LoRA fields.

With age recipients (`tinker_sr.validation.age_recipients`) every file is encrypted to all of
them and stored as ``<file>.age``; nothing is written in the clear.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tinker_sr import validation
from tinker_sr.engine.checkpoint_store import CheckpointStore
from tinker_sr.engine.lora import LoraSpec
from tinker_sr.engine.registry import Trainer, snapshot
from tinker_sr.hf_files import peft_base_fields, tinker_variant

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
AGE_SUFFIX = ".age"
PREFIX = "base_model.model."
UNEMBED = "model.unembed_tokens"
"""Tinker's name for the unembedding (``lm_head``) in an external adapter."""


log = logging.getLogger("tinker_sr.engine")


def warn_if_tied_unembed(tied: bool, adapters: Mapping[str, torch.Tensor], path: str) -> None:
    """A tied base plus an unembedding adapter cannot be merged exactly by name: tinker-cookbook
    folds the unembedding's update into the shared embedding matrix (which changes the input
    embeddings too), so its merged model is not the trained one. Say so where it is made."""
    if tied and any(k.startswith("lm_head.") for k in adapters):
        log.warning(
            "%s: the base model ties its input and output embeddings and this adapter trains "
            "the unembedding (train_unembed=True). Tools that merge the export by name "
            "(tinker-cookbook's weights.build_hf_model / build_lora_adapter) fold that update "
            "into the shared embedding, changing the input embeddings as well, so the merged "
            "model differs from the trained one. For an exact merge use `tinker-sr export "
            "--merge` on the sampler or training checkpoint (it unties the output layer), or "
            "train with train_unembed=False.",
            path,
        )


# One expert's adapter, e.g. ``model.layers.1.mlp.experts.7.up_proj.lora_B.weight``.
_EXPERT_KEY = re.compile(r"(?P<layer>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<ab>lora_[AB])\.weight")  # fmt: skip
EXPERT_PROJ = {"gate": "w1", "down": "w2", "up": "w3"}
"""Tinker's names for an expert's projections in an external adapter."""


def external_name(key: str) -> str:
    """``model.layers.0.mlp.up_proj.lora_A.weight`` → its name in an external adapter."""
    if key.startswith("lm_head."):
        key = UNEMBED + key.removeprefix("lm_head")
    return PREFIX + key


def external_tensors(adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export's tensors (float32), experts' adapters stacked as Tinker stores them."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in sorted(adapters.items()):
        m = _EXPERT_KEY.fullmatch(k)
        if m is None:
            out[external_name(k)] = v.detach().to(torch.float32, copy=True).contiguous()
        else:
            name = f"{m['layer']}.{EXPERT_PROJ[m['proj']]}.{m['ab']}.weight"
            stacks.setdefault(external_name(name), {})[int(m["e"])] = v
    for name, by_expert in stacks.items():
        if sorted(by_expert) != list(range(len(by_expert))):  # the engine numbers them 0..E-1
            raise AssertionError(f"{name}: experts {sorted(by_expert)} are not 0..E-1")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))]).to(torch.float32)
    return dict(sorted(out.items()))


def adapter_config(spec: LoraSpec, adapters: Mapping[str, torch.Tensor], base_model: str) -> dict:
    modules = sorted({k.split(".")[-3] for k in adapters})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        **peft_base_fields(base_model),
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["unembed_tokens" if m == "lm_head" else m for m in modules],
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def write_external(
    out: Path,
    adapters: Mapping[str, torch.Tensor],
    spec: LoraSpec,
    base_model: str,
    recipients: Sequence[Any] = (),
) -> None:
    """Write the export's files into the (new) directory `out`; with `recipients` (parsed age
    recipients) each file is encrypted in memory, so no clear copy ever reaches the disk."""
    from safetensors.torch import save as serialize

    files = {
        ADAPTER_FILE: serialize(external_tensors(adapters), metadata={"format": "pt"}),
        CONFIG_FILE: (
            json.dumps(adapter_config(spec, adapters, base_model), indent=2) + "\n"
        ).encode(),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if recipients:
            import pyrage  # importable: validation.age_recipients parsed the recipients with it

            name, data = name + AGE_SUFFIX, pyrage.encrypt(data, list(recipients))
        with open(out / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def save_external(
    checkpoints: CheckpointStore,
    t: Trainer,
    name: str,
    ttl_seconds: int | None,
    age_encryption_recipients: Sequence[str] | None,
) -> str:
    """Export trainer `t`'s current adapters as ``tinker://<run>/external_weights/<name>``."""
    recipients = validation.age_recipients(age_encryption_recipients)
    adapters = snapshot(t.model)
    # The name the caller trained on, less a Tinker variant's suffix: a remote user knows it,
    # not the server's directory behind an alias (`tinker-sr export`, run where that
    # directory is, names the directory: `adapter_base_model`).
    base_model = tinker_variant(t.base_model)[0]
    path = checkpoints.write_dir(
        t.model_id,
        "external_weights",
        name,
        lambda out: write_external(out, adapters, t.lora, base_model, recipients),
        ttl_seconds=ttl_seconds,
        user_metadata=None,
    )
    warn_if_tied_unembed(t.model.config.tie_embeddings, adapters, path)
    return path
