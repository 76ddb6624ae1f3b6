"""Export LoRA checkpoints for other tools: a PEFT adapter directory, or a merged HF model.

- `export_peft`: ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's LoRA layout
  (``base_model.model.<module>.lora_A.weight`` / ``lora_B``; ``lora_alpha`` / ``r`` is our
  scaling), loadable with ``peft.PeftModel.from_pretrained(base, dir)``, vLLM's LoRA support
  (which does not take an ``lm_head`` adapter: train with ``train_unembed=False`` for vLLM) or
  anything else that reads PEFT adapters.
- `export_merged`: a self-contained HF model directory (config.json, model.safetensors, the
  base's tokenizer and generation config) whose weights are W + (alpha / r) · B A, in the base
  model's dtype; ``transformers.AutoModelForCausalLM`` loads it with tinker_sr's logits.

The checkpoint is any tinker_sr LoRA checkpoint (``save_weights_for_sampler`` or
``save_state``): a safetensors file of ``lora.<module>.lora_{A,B}.weight`` tensors with the
base model and LoRA config in its metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tinker_sr.engine import gpt_oss
from tinker_sr.engine.checkpoints import read_record, save_tensors
from tinker_sr.engine.hf_config import config_to_hf
from tinker_sr.engine.hf_vl import vl_wrapper
from tinker_sr.engine.hybrid import fuse_qkv_adapters, to_hf
from tinker_sr.engine.lora import (
    LoraSpec,
    apply_lora,
    check_lora_state_dict,
    clone_for_sampling,
    load_lora_state_dict,
)
from tinker_sr.engine.model import ModelConfig, Transformer
from tinker_sr.engine.skeleton import on_meta
from tinker_sr.hf_files import adapter_base_model, peft_base_fields, read_json
from tinker_sr.tokenization.hf import TOKENIZER_FILE_NAMES
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError, ModelUnavailableError

PEFT_PREFIX = "base_model.model."
# Files of a base model directory that a merged export carries over unchanged.
_CARRIED = ("generation_config.json", *sorted(TOKENIZER_FILE_NAMES))


@dataclasses.dataclass(frozen=True)
class LoraCheckpoint:
    """The adapters of a checkpoint (names without the ``lora.`` prefix) and their config."""

    adapters: dict[str, torch.Tensor]
    spec: LoraSpec
    base_model: str

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], shown: str
    ) -> LoraCheckpoint:
        if "lora" not in meta or "base_model" not in meta:
            raise EngineUserError(
                "not a tinker_sr LoRA checkpoint: its metadata lacks 'lora' / 'base_model' "
                "(export takes files written by save_weights_for_sampler or save_state)"
            )
        adapters = {k.removeprefix("lora."): v for k, v in tensors.items() if k.startswith("lora.")}
        if not adapters:
            raise EngineUserError("the checkpoint holds no LoRA tensors (lora.*)")
        record = read_record(meta, tensors, shown)
        return cls(adapters, record.lora, record.base_model)


def export_peft(
    ckpt: LoraCheckpoint,
    out: str | os.PathLike[str],
    *,
    base_model_name_or_path: str,
    text_prefix: str = "model.",
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into `out`. The adapters
    of the decoder are named under ``text_prefix``: ``model.`` as in a causal LM, and
    ``model.language_model.`` for a vision-language base (Qwen3.5 as the Hub ships it,
    Qwen3-VL), whose text model sits there in the model its ``architectures`` names (what
    AutoModelForImageTextToText and vLLM build for it)."""
    experts = sorted({k.split(".mlp.experts.")[0] for k in ckpt.adapters if ".mlp.experts." in k})
    if experts:
        # transformers 5 holds a MoE layer's experts as fused 3-D parameters, where PEFT finds
        # no per-expert gate/up/down module: it would load the adapter without them, silently.
        raise EngineUserError(
            f"this checkpoint has adapters on mixture-of-experts experts ({experts[0]} and "
            f"{len(experts) - 1} more layers), which a PEFT adapter directory cannot carry to "
            "transformers 5 (it stores the experts fused and PEFT would drop those adapters "
            "without a word); export with --merge (a merged model directory, loadable by "
            "transformers and vLLM), or train with train_mlp=False for a PEFT adapter"
        )
    root = Path(out).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    adapters, rank_pattern, alpha_pattern = ckpt.adapters, {}, {}
    if any(".linear_attn.in_proj_q." in k for k in adapters):
        # Qwen3.5: transformers holds q, k, v as one in_proj_qkv; their three rank-r adapters
        # are exactly one of rank 3r there (`hybrid.fuse_qkv_adapters`), same scaling.
        adapters = fuse_qkv_adapters(adapters)
        rank_pattern = {"in_proj_qkv": 3 * ckpt.spec.rank}
        alpha_pattern = {"in_proj_qkv": 3 * ckpt.spec.alpha}
    tensors = {
        PEFT_PREFIX + (text_prefix + k.removeprefix("model.") if k.startswith("model.") else k):
        v.float()
        for k, v in adapters.items()
    }  # fmt: skip
    save_tensors(root / "adapter_model.safetensors", tensors, {"format": "pt"})
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        **peft_base_fields(base_model_name_or_path),
        "r": ckpt.spec.rank,
        "lora_alpha": ckpt.spec.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({k.split(".")[-3] for k in adapters}),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
    (root / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return root


def merged_model(base: Transformer, ckpt: LoraCheckpoint) -> Transformer:
    """A new model holding base + adapter in the base's dtype (merged in float32)."""
    adapted = clone_for_sampling(base, dtype=torch.float32)
    apply_lora(adapted, dataclasses.replace(ckpt.spec, seed=0))
    load_lora_state_dict(adapted, ckpt.adapters)
    return clone_for_sampling(adapted, dtype=base.dtype)


def export_merged(
    base: Transformer, ckpt: LoraCheckpoint, out: str | os.PathLike[str], *, base_dir: Path | None
) -> Path:
    """Write the merged model as an HF directory. With `base_dir` (an HF model directory) its
    config.json is kept (tie_word_embeddings and dtype updated) and its tokenizer and
    generation files are copied; for a built-in model the config is generated and the byte
    tokenizer written."""
    root = Path(out).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    model = merged_model(base, ckpt)
    tied = model.config.tie_embeddings
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    state = state_to_hf(model.config, state)  # Qwen3.5: its text model; gpt-oss: fused experts
    save_tensors(root / "model.safetensors", state, {"format": "pt"})
    dtype = str(model.dtype).removeprefix("torch.")
    if base_dir is not None:
        config = read_json(base_dir / "config.json")
        if vl_wrapper(config) is not None:  # the text model's: the vision tower is not written
            config = config_to_hf(model.config)
        for name in _CARRIED:
            if (base_dir / name).is_file():
                shutil.copyfile(base_dir / name, root / name)
    else:
        from tinker_sr.tokenization.byte import write_hf_tokenizer_dir

        config = config_to_hf(model.config)
        write_hf_tokenizer_dir(root, model_max_length=model.config.max_seq_len)
    config.update(tie_word_embeddings=tied, dtype=dtype)
    if "torch_dtype" in config:  # transformers 4.x's name for it
        config["torch_dtype"] = dtype
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return root


def state_to_hf(config: ModelConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The engine's state dict in the checkpoint layout of ``config``'s architecture."""
    if config.qwen3_5_layout:  # Qwen3.5's own names and norm offsets, fused q/k/v
        return to_hf(state)
    if config.gpt_oss:  # fused experts, the router's name
        return gpt_oss.to_hf(state)
    return state


def read_checkpoint(path: str, store_dir: Path) -> LoraCheckpoint:
    """A checkpoint by tinker path (looked up in the store at `store_dir`) or file path."""
    from tinker_sr.engine.checkpoint_store import CheckpointStore
    from tinker_sr.engine.checkpoints import load_tensors
    from tinker_sr.engine.store import Store

    if path.startswith("tinker://"):
        if not (store_dir / "engine.sqlite").is_file():
            raise EngineUserError(
                f"no tinker_sr store at {store_dir} (engine.sqlite); pass the store the "
                "checkpoint was written to (--store, $TINKER_SR_STORE) or the checkpoint file"
            )
        store = Store.for_reading(store_dir / "engine.sqlite")
        try:
            tensors, meta = CheckpointStore(store, store_dir, purge=False).load(path, expect="any")
        except EngineNotFoundError as e:
            raise EngineNotFoundError(
                f"{e}. Looked in the store at {store_dir}: pass the store it was saved to "
                "(--store DIR, $TINKER_SR_STORE)"
            ) from None
        finally:
            store.close()
    else:
        if Path(path).is_dir():
            raise EngineUserError(
                f"{path} is a directory; pass a checkpoint: its tinker:// path (with the store "
                "it was saved to: --store, $TINKER_SR_STORE) or its .safetensors file"
            )
        tensors, meta = load_tensors(path)
    return LoraCheckpoint.from_tensors(tensors, meta, path)


def _check_fits(resolved: str, base_dir: Path | None, ckpt: LoraCheckpoint) -> None:
    """Refuse an adapter that does not fit the base it will name (as a merge refuses it):
    the adapter's names and shapes against the base's LoRA layers, built on the meta device
    from its config alone (no weight is read)."""
    from tinker_sr.engine.hf import check_model_dir
    from tinker_sr.engine.model import BUILTIN_CONFIGS

    config = BUILTIN_CONFIGS[resolved] if base_dir is None else check_model_dir(base_dir)[3]
    with on_meta():
        skeleton = Transformer(config)
        apply_lora(skeleton, dataclasses.replace(ckpt.spec, seed=0))
    check_lora_state_dict(skeleton, ckpt.adapters)


def export_checkpoint(
    path: str,
    out: str | os.PathLike[str],
    *,
    merge: bool,
    store_dir: Path,
    base_model: str | None = None,
    aliases: Mapping[str, str] | None = None,
) -> Path:
    """`tinker-sr export`: checkpoint `path` → a PEFT adapter dir, or with `merge` a merged
    HF model dir. The base model is the checkpoint's (or `base_model`), resolved like the
    engine does (built-ins, directories, the HF cache, `aliases`).

    `out` must be new or an empty directory (never the base model's own, whose weights a merge
    would overwrite, nor one holding an older export's shards). The files are written into a
    hidden ``.export-*`` directory inside it and moved into place when complete: a failed
    export leaves `out` as it found it (one killed outright leaves that hidden directory)."""
    root = Path(out).expanduser()
    check_output_dir(root)
    # The directories this export creates (`out` and missing parents), deepest first.
    created = [d for d in (root, *root.parents) if not d.exists()]
    root.mkdir(parents=True, exist_ok=True)  # `out` itself, never replaced: a mount point works
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    try:
        _export(path, staging, merge=merge, store_dir=store_dir, base_model=base_model,
                aliases=aliases)  # fmt: skip
        check_output_dir(root, ignore=staging.name)  # nothing else appeared there meanwhile
        for entry in sorted(staging.iterdir()):
            os.replace(entry, root / entry.name)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        # No empty directory left behind (only empty ones: another export's staging stays).
        with contextlib.suppress(OSError):
            for d in created:
                d.rmdir()
        raise
    return root


STAGING_PREFIX = ".export-"


def check_output_dir(root: Path, ignore: str | None = None) -> None:
    """Refuse an export's output `root` that exists as a file or a non-empty directory."""
    if root.exists() and not root.is_dir():
        raise EngineUserError(f"output {root} exists and is not a directory; name a new directory")
    entries = sorted(p.name for p in root.iterdir() if p.name != ignore) if root.is_dir() else []
    if not entries:
        return
    if "config.json" in entries:
        what = (
            "a model's config.json (the base model's own directory? a merge there would "
            "overwrite its weights)"
        )
    elif any(e.startswith(STAGING_PREFIX) for e in entries):
        what = "the hidden directory of an export that was interrupted (or is running)"
    else:
        what = f"{len(entries)} entries, e.g. {entries[0]!r}"
    raise EngineUserError(
        f"output directory {root} is not empty: it holds {what}. Export into a new or empty "
        "directory (files of an older export beside the new ones would be read with them, "
        "e.g. its shards or adapter)"
    )


def _base_model_fix(name: str, given: str | None) -> str:
    """How to export against a base model `name` that is not available here (`given`: named by
    --base-model, else recorded in the checkpoint)."""
    if given is not None:
        return (
            "Pass --base-model the base model the checkpoint was trained on: its Hugging Face "
            "directory (config.json and *.safetensors), or its Hub name in the local cache."
        )
    return (
        f"The checkpoint records the name it was trained on, {name!r}: where that was an alias "
        "(TINKER_SR_MODEL_ALIASES, `tinker-sr serve --model-dir` / `--model-alias`), export "
        "against the model it named: `tinker-sr export CHECKPOINT OUT --base-model DIR`, DIR "
        "its Hugging Face directory (config.json and *.safetensors)."
    )


def _export(
    path: str,
    out: Path,
    *,
    merge: bool,
    store_dir: Path,
    base_model: str | None,
    aliases: Mapping[str, str] | None,
) -> Path:
    from tinker_sr.engine.registry import ModelRegistry

    ckpt = read_checkpoint(path, store_dir)
    registry = ModelRegistry(aliases or {})
    name = base_model or ckpt.base_model
    try:
        resolved = registry.resolve_model(name)
    except ModelUnavailableError as e:  # the registry's fix (an alias) is a request's, not ours
        raise ModelUnavailableError(e.stem, _base_model_fix(name, base_model)) from None
    base_dir = Path(resolved) if os.path.isdir(resolved) else None
    if not merge:
        _check_fits(resolved, base_dir, ckpt)
        kind = vl_wrapper(read_json(base_dir / "config.json")) if base_dir else None
        return export_peft(
            ckpt,
            out,
            base_model_name_or_path=adapter_base_model(name, resolved),
            text_prefix="model." if kind is None else "model.language_model.",
        )
    if base_dir is not None:  # the base as stored (not float32 on a CPU without bf16), so the
        from tinker_sr.engine.hf import checkpoint_dtype  # export is in the checkpoint's dtype

        registry.model_dtype = checkpoint_dtype(base_dir)
    return export_merged(registry.base(resolved), ckpt, out, base_dir=base_dir)
