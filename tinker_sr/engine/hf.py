"""Hugging Face model directories as first-class models: load them in their own dtype.

Finding a directory (a local path, or a Hub name in the local Hugging Face cache; nothing is
ever downloaded) is `tinker_sr.hf_files`, torch-free and shared with the clients. A model
directory holds ``config.json`` and ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``).

Weights stay in the checkpoint's dtype (``config.json``'s ``dtype``/``torch_dtype``, else the
dtype of the stored tensors): a bf16 checkpoint costs 2 bytes per parameter in memory. The
compute dtype is the weights' dtype, with RMSNorm statistics, RoPE angles, softmax and the
returned logits in float32 (see `tinker_sr.engine.model`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tinker_sr.engine import gpt_oss, hybrid
from tinker_sr.engine.checkpoints import count_nonfinite
from tinker_sr.engine.cpu import available_memory, has_fast_half, why_slow_half
from tinker_sr.engine.env_settings import MODEL_DTYPE_ENV, dtype_name, env_model_dtype_name
from tinker_sr.engine.hf_config import config_from_hf
from tinker_sr.engine.hf_vl import vl_wrapper
from tinker_sr.engine.model import BUILTIN_CONFIGS, ModelConfig, Transformer, _empty_model
from tinker_sr.engine.skeleton import on_meta
from tinker_sr.hf_files import present, read_json
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROGRESS_MIN_BYTES = 512 * 2**20  # a progress bar and a log line from this checkpoint size
# A model is loaded only where its weights and LOAD_HEADROOM fit in the free memory (a load
# that cannot fit would end the process, a server with every session in it, by the OOM killer).
LOAD_HEADROOM = 512 * 2**20
MEMORY_CHECK_ENV = "TINKER_SR_LOAD_MEMORY_CHECK"
log = logging.getLogger("tinker_sr.engine")
# Tensors a checkpoint may hold that carry nothing the model computes: old exports' rotary
# frequency buffers (recomputed from config.json).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# How a weight may be stored (safetensors dtype names); each is cast to the model's dtype on
# load. Anything else (integers, bools, FP8/FP4 codes) holds a quantized or foreign tensor
# whose stored values are not the weights.
FLOAT_STORAGE = ("F64", "F32", "F16", "BF16")
EMBED = "model.embed_tokens.weight"


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint, chosen as transformers chooses them:
    ``model.safetensors`` where it exists (beside it, an index and its shards, or other
    ``*.safetensors`` files such as a PEFT adapter or a ``consolidated.safetensors``, are not
    read), else the shards the index names, else every ``*.safetensors`` file."""
    if present(single := root / SINGLE_FILE):
        return [single]
    index = root / INDEX_FILE
    if present(index):
        weight_map = read_json(index).get("weight_map") or {}
        names = list(weight_map.values()) if isinstance(weight_map, dict) else [weight_map]
        if not isinstance(weight_map, dict) or not all(map(_shard_name, names)):
            wrong = (
                weight_map
                if not isinstance(weight_map, dict)
                else next(n for n in names if not _shard_name(n))
            )
            raise EngineUserError(
                f"{index}: weight_map must map each tensor name to the name of a shard file "
                f"in {root}, got {wrong!r:.200}; re-save the model with transformers' "
                "save_pretrained()"
            )
        files = [root / f for f in sorted(set(names))]
        missing = [_shard(root, f) for f in files if not present(f)]
        if missing:
            raise EngineNotFoundError(
                f"{index} names shard files that are missing: {missing[:3]}; copy or download "
                "them again (an interrupted or pruned download leaves them out, or their links "
                "into the Hugging Face cache's blobs dangling)"
            )
        return files
    files = sorted(f for f in root.glob("*.safetensors") if present(f))
    if not files:
        raise EngineNotFoundError(
            f"{root}: no *.safetensors weight files (PyTorch .bin checkpoints are not supported; "
            "convert them with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def _shard_name(name: object) -> bool:
    """A weight map's file name: relative and inside the folder (not resolved: the HF cache's
    shards are links to blobs outside it)."""
    return isinstance(name, str) and not Path(name).is_absolute() and ".." not in Path(name).parts


def _shard(root: Path, f: Path) -> str:
    """A weight file's name as the index writes it (``sub/x.safetensors`` too)."""
    return str(f.relative_to(root)) if f.is_relative_to(root) else f.name


def _open(f: Path) -> Any:
    from safetensors import SafetensorError, safe_open

    present(f)  # a FIFO or a device is refused: safe_open would block on it, holding the GIL
    try:
        return safe_open(str(f), framework="pt")
    except (SafetensorError, OSError) as e:
        raise EngineUserError(
            f"{f}: not a readable safetensors file ({e}); the file is truncated or "
            "corrupt: copy or download it again, or re-save the model with transformers' "
            "save_pretrained()"
        ) from e


def _renames(files: list[Path], tied: bool) -> dict[str, str]:
    """Stored names the engine reads under another, as transformers loads them: a bare
    model's state dict (``layers.0...``, no tensor under ``model.``) gets the base model's
    prefix, ``model.``, on every name but the output layer's; a tied model (``tied``) that
    stores its embedding only as ``lm_head.weight`` (no embedding tensor) reads it as
    the embedding."""
    keys: list[str] = []
    for f in files:
        with _open(f) as handle:
            keys += list(handle.keys())
    out = {}
    if keys and not any(k.startswith("model.") for k in keys):
        out = {k: f"model.{k}" for k in keys if not k.startswith("lm_head.")}
    names = [out.get(k, k) for k in keys]
    if tied and "lm_head.weight" in names and not any(_is_embedding(n) for n in names):
        out["lm_head.weight"] = EMBED
    return out


def _is_embedding(name: str) -> bool:
    """The token embedding's name in any layout (``model.language_model.embed_tokens.weight``
    too), not a vision tower's ``patch_embed`` or ``pos_embed``."""
    return name.endswith("embed_tokens.weight")


def _tensors(files: list[Path], tied: bool = False) -> Iterator[tuple[Path, str, Any]]:
    """(file, name, lazy slice) for every stored tensor, one file open at a time, under the
    name transformers loads it by (`_renames`; ``tied``: config.json ties the embeddings)."""
    renames = _renames(files, tied)
    for f in files:
        with _open(f) as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield f, renames.get(key, key), handle.get_slice(key)


def checkpoint_dtype(root: Path, hf: dict[str, Any] | None = None) -> torch.dtype:
    """The dtype a checkpoint declares in config.json, else that of its first float tensor."""
    hf = hf if hf is not None else read_json(root / "config.json")
    declared = hf.get("dtype") or hf.get("torch_dtype")
    if isinstance(declared, str) and declared in DTYPES:
        return DTYPES[declared]
    table = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    for _, _, sl in _tensors(weight_files(root)):
        if sl.get_dtype() in table:
            return table[sl.get_dtype()]
    return torch.float32


def parse_dtype(value: str | torch.dtype | None, field: str = "dtype") -> torch.dtype | None:
    """'bf16' / 'bfloat16' / torch.bfloat16 → torch.bfloat16; None stays None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    return DTYPES[dtype_name(value, field)]


def env_model_dtype() -> torch.dtype | None:
    """``$TINKER_SR_MODEL_DTYPE``: the dtype models load in where none is given (None: each
    checkpoint's own)."""
    name = env_model_dtype_name()
    return None if name is None else DTYPES[name]


def _check_tensors(
    root: Path, files: list[Path], config: ModelConfig, wrapped: bool
) -> dict[str, int]:
    """The checkpoint's tensors (names and shapes from the safetensors headers) against the
    model `config` describes: each must have a place of its shape, and each place a tensor.
    Returns the tensors that will load, each with its number of elements."""
    with on_meta():
        shapes = {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    unused: list[str] = []
    unused_in: set[str] = set()  # the files that hold them
    placed: dict[str, int] = {}
    placed_from: dict[str, Path] = {}  # the file each placed tensor came from
    mapped = _mapped(config, wrapped)  # stored names are not the engine's
    for f, stored, sl in _tensors(files, config.tie_embeddings):
        if mapped and stored.startswith(hybrid.UNUSED_PREFIXES):
            continue  # a vision tower; Qwen3.5's multi-token-prediction head
        fused = _fused_ndim(stored) if mapped else None
        if fused is not None and len(sl.get_shape()) != fused:
            raise EngineUserError(
                f"{f}: tensor {stored} has shape {tuple(sl.get_shape())}; it holds several "
                f"tensors fused along new dimensions and must have {fused}: re-save the model "
                "with transformers' save_pretrained()"
            )
        for key, shape in _engine_shapes(stored, tuple(sl.get_shape()), config, wrapped):
            if key in placed_from:  # not an unplaced tensor: a second copy of a placed one
                raise EngineUserError(
                    f"{root}: tensor {stored} is stored twice, in "
                    f"{_shard(root, placed_from[key])} and {_shard(root, f)} (a botched merge "
                    "or re-shard); keep one copy: re-save the model with transformers' "
                    "save_pretrained()"
                )
            if key not in shapes:
                if not key.endswith(IGNORED_SUFFIXES):
                    unused.append(key)
                    unused_in.add(_shard(root, f))
                continue
            placed[key] = math.prod(shape)
            placed_from[key] = f
            if (stored_dtype := sl.get_dtype()) not in FLOAT_STORAGE:
                raise EngineUserError(
                    f"{f}: tensor {stored} is stored as {stored_dtype}, not as floating-point "
                    f"weights ({', '.join(FLOAT_STORAGE)}). Quantized checkpoints (FP8, GPTQ, "
                    "AWQ, bitsandbytes) are not supported: use the model's unquantized "
                    "(bfloat16) release, or load this one in transformers and save_pretrained() "
                    "it dequantized"
                )
            if (expected := shapes.pop(key)) != shape:
                raise EngineUserError(
                    f"{f}: tensor {stored} has shape {tuple(sl.get_shape())}, config.json "
                    f"implies {expected}"
                )
    if unused:
        raise _unplaced(root, files, config, unused, unused_in, shapes)
    if config.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    if shapes:
        raise _missing(root, files, config, shapes, placed, wrapped)
    return placed


def _unplaced(
    root: Path,
    files: list[Path],
    config: ModelConfig,
    unused: list[str],
    unused_in: set[str],
    shapes: dict[str, tuple[int, ...]],
) -> EngineUserError:
    """The error for stored tensors the model has no place for (``shapes``: its places still
    without a tensor)."""
    fix = (
        "check config.json (architectures, attention_bias, mlp_bias, num_hidden_layers) "
        "against the checkpoint"
    )
    if len(files) > 1 and not (root / INDEX_FILE).is_file():  # every file was read
        fix = (
            f"with neither {SINGLE_FILE} nor {INDEX_FILE} here every *.safetensors file is "
            f"read, so move other files (an adapter, a consolidated copy) out of it, or {fix}"
        )
    return EngineUserError(
        f"{root}: checkpoint holds {len(unused)} tensors that {config.name!r} as configured "
        f"has no place for, e.g. {sorted(unused)[:3]}, in {sorted(unused_in)[:3]}; ignoring "
        f"them would compute another model: {fix}"
    )


def _missing(
    root: Path,
    files: list[Path],
    config: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    placed: dict[str, int],
    wrapped: bool,
) -> EngineUserError:
    """The error for the model's places no stored tensor fills (``shapes``)."""
    unread = sorted(f.name for f in set(root.glob("*.safetensors")) - set(files))
    # Unread files explain the gap only if they hold what is missing (a stray adapter or a
    # consolidated copy of other names does not, and the config's hints below still apply).
    unread = unread if _hold_any(root, unread, set(shapes), config, wrapped) else []
    hints = []
    if unread:
        hints.append(
            f"{INDEX_FILE} names {len(files)} weight files, and {len(unread)} more here are "
            f"not read ({unread[:3]}): list every tensor in its weight_map"
        )
    if config.tie_embeddings and EMBED in shapes and "lm_head.weight" in placed:
        hints.append(
            f"config.json ties the embeddings (tie_word_embeddings) and the checkpoint stores "
            f"them as lm_head.weight only: store them as {EMBED} (save_pretrained does)"
        )
    if not unread and set(shapes) == {"lm_head.weight"} and EMBED in placed:
        hints.append(
            "config.json does not tie the embeddings (tie_word_embeddings false) and the "
            "checkpoint stores no lm_head.weight: set tie_word_embeddings to true if the model "
            "shares its embedding as its output layer (as Qwen3-0.6B does)"
        )
    stored = {int(k.split(".")[2]) for k in placed if k.startswith("model.layers.")}
    wanted = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.")}
    if not unread and stored and wanted and min(wanted) > max(stored):  # whole layers missing
        hints.append(
            f"the checkpoint stores layers 0-{max(stored)} and config.json's "
            f"num_hidden_layers asks for {config.n_layers}: check num_hidden_layers"
        )
    return EngineUserError(
        f"{root}: checkpoint lacks {len(shapes)} tensors, e.g. {sorted(shapes)[:3]}"
        + "".join(f"; {h}" for h in hints)
    )


def _hold_any(
    root: Path, names: list[str], wanted: set[str], config: ModelConfig, wrapped: bool
) -> bool:
    """Does any of the files ``names`` in ``root`` store a tensor that lands in ``wanted``
    (the engine's names, the stored ones mapped as on load)? One that cannot be read, or a
    name that does not map, may: it counts."""
    try:
        for _, stored, sl in _tensors([root / name for name in names], config.tie_embeddings):
            landing = _engine_shapes(stored, tuple(sl.get_shape()), config, wrapped)
            if any(k in wanted for k, _ in landing):
                return True
    except Exception:  # noqa: BLE001 - unreadable, or a tensor the mapping refuses
        return True
    return False


def _mapped(config: ModelConfig, wrapped: bool) -> bool:
    """Are the stored names (some) not the engine's (`_engine_parts` maps them)?"""
    return config.qwen3_5_layout or config.gpt_oss or wrapped


def _fused_ndim(key: str) -> int | None:
    """How many dimensions a fused tensor has: 3 for experts ([E, ., .]), 2 for Qwen3.5's
    in_proj_qkv and gpt-oss's expert biases; None for the rest (their shapes are checked
    against the model's)."""
    if key.endswith((hybrid.FUSED_EXPERTS, hybrid.FUSED_EXPERTS_DOWN)):
        return 3
    return 2 if key.endswith((hybrid.FUSED_QKV, *gpt_oss.FUSED_2D)) else None


def _engine_key(key: str, config: ModelConfig) -> str:
    """A stored tensor's engine name where it lands whole (`_mapped` checkpoints)."""
    return gpt_oss.engine_key(key) if config.gpt_oss else hybrid.engine_key(key)


def _engine_shapes(
    key: str, shape: tuple[int, ...], config: ModelConfig, wrapped: bool
) -> list[tuple[str, tuple[int, ...]]]:
    """Where a stored tensor lands: its name, or its parts' names and shapes."""
    if not _mapped(config, wrapped):
        return [(key, shape)]
    with torch.device("meta"):
        parts = _engine_parts(key, torch.empty(shape), config, wrapped)
    return [(k, tuple(t.shape)) for k, t in parts]


def _engine_parts(
    key: str, tensor: torch.Tensor, config: ModelConfig, wrapped: bool
) -> list[tuple[str, torch.Tensor]]:
    """A stored tensor as the engine's: Qwen3.5's layout (`hybrid.to_engine`); a Qwen3-VL
    text model's names without ``model.language_model.``, its fused experts split per expert
    (stored as transformers holds them, [E, 2F, D] and [E, D, F], or transposed as the Hub's
    checkpoints are, [E, D, 2F] and [E, F, D]; where both read, transformers' own, as it
    does); anything else as it is."""
    if config.qwen3_5_layout:
        return hybrid.to_engine(key, tensor, config)
    if config.gpt_oss:
        return gpt_oss.to_engine(key, tensor, config)
    if not wrapped:
        return [(key, tensor)]
    d, f = config.dim, config.moe_ffn_dim or 0
    if key.endswith(hybrid.FUSED_EXPERTS) and tensor.shape[1:] == (d, 2 * f) != (2 * f, d):
        tensor = tensor.transpose(1, 2)
    if key.endswith(hybrid.FUSED_EXPERTS_DOWN) and tensor.shape[1:] == (f, d) != (d, f):
        tensor = tensor.transpose(1, 2)
    if key.endswith((hybrid.FUSED_EXPERTS, hybrid.FUSED_EXPERTS_DOWN)):
        return hybrid.to_engine(key, tensor, config)
    return [(hybrid.engine_key(key), tensor)]


def load_model_dir(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    name: str | None = None,
    cpu: bool = False,
) -> Transformer:
    """Load a Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE HF directory into a Transformer.

    ``dtype=None`` keeps the checkpoint's dtype (with ``cpu``, for a model that computes on
    this CPU: float32 where the CPU has no fast matmuls in it, `cpu_dtype`); tensors stored
    in another dtype (e.g. float32 norms in a bf16 checkpoint) are cast to it. Tensors load
    one at a time, so peak memory is the model plus one tensor. Every tensor must land in the model (rotary ``inv_freq``
    buffers of old exports excepted): a tensor without a place, e.g. a bias config.json does not
    declare, is an error rather than a silently different model.
    """
    root, files, hf, config, placed, wrapped = check_model_dir(path, name)
    declared = hf.get("max_position_embeddings")
    if isinstance(declared, int) and config.max_seq_len < declared:
        log.info(
            "%s: sliding-window attention: context capped at its window, %d of %d tokens "
            "(within the window sliding-window and causal attention agree)",
            root, config.max_seq_len, declared,
        )  # fmt: skip
    if config.tie_embeddings and "lm_head.weight" in placed:
        config = _tie_or_untie(root, files, config)
        if config.tie_embeddings:
            del placed["lm_head.weight"]
    if dtype is None:
        dtype = checkpoint_dtype(root, hf)
        dtype = cpu_dtype(root, dtype, sum(placed.values())) if cpu else dtype
    total = sum(placed.values()) * torch.empty((), dtype=dtype).element_size()
    check_room(root, total)
    model = _empty_model(config, dtype)
    own = model.state_dict()
    start = time.perf_counter()
    wanted = set(placed)
    with _progress(root, total) as bar, torch.no_grad():
        mapped = _mapped(config, wrapped)  # stored names are not the engine's
        for f, stored, sl in _tensors(files, config.tie_embeddings):
            key = _engine_key(stored, config) if mapped else stored
            if key in wanted or (mapped and _fused_ndim(key) is not None):
                for name, tensor in _engine_parts(stored, sl[:], config, wrapped):
                    own[name].copy_(tensor)
                    _check_finite(f, stored, own[name], tensor)
                    bar.update(own[name].nbytes)
    if total >= PROGRESS_MIN_BYTES:
        log.info(
            "loaded %s: %d tensors, %.2f GiB in %.1f s",
            root, len(placed), total / 2**30, time.perf_counter() - start,
        )  # fmt: skip
    return model


def _check_finite(file: Path, stored: str, loaded: torch.Tensor, source: torch.Tensor) -> None:
    """Refuse a weight holding NaN or infinity, or values beyond the model dtype's range (a
    corrupt checkpoint, a diverged fine-tune, a float32 value over float16's 65504): it would
    make every loss NaN with no hint why."""
    if not (bad := count_nonfinite(loaded)):
        return
    where = (
        "its stored values overflow "
        f"{str(loaded.dtype).removeprefix('torch.')}: load it in a wider dtype"
        if not count_nonfinite(source)
        else "the checkpoint is corrupt (a diverged fine-tune or a bad conversion): use "
        "another copy of the model"
    )
    raise EngineUserError(
        f"{file}: tensor {stored} holds {bad} non-finite values (NaN or infinity) of "
        f"{loaded.numel()}; {where}"
    )


def check_model_dir(
    path: str | os.PathLike[str], name: str | None = None
) -> tuple[Path, list[Path], dict[str, Any], ModelConfig, dict[str, int], bool]:
    """Everything about a model directory that can be checked without reading its weights:
    config.json, the weight files (or shard index), and each stored tensor's name, shape and
    dtype (from the safetensors headers) against the model the config describes. Returns the
    directory, its weight files, config.json, the `ModelConfig`, the tensors that will load
    (each with its number of elements) and whether it is a vision-language checkpoint (its
    text model under ``model.language_model.``); `EngineUserError` names what is wrong."""
    root = Path(path)
    if not present(root / "config.json"):
        raise EngineNotFoundError(
            f"{root}: no config.json; expected a Hugging Face model directory "
            "(config.json + *.safetensors)"
        )
    files = weight_files(root)
    hf = read_json(root / "config.json")
    config = config_from_hf(hf, name=name or str(root))
    wrapped = vl_wrapper(hf) is not None
    return root, files, hf, config, _check_tensors(root, files, config, wrapped), wrapped


def context_length(model: str) -> int:
    """A built-in's or a model directory's context length, from its config alone."""
    if model in BUILTIN_CONFIGS:
        return BUILTIN_CONFIGS[model].max_seq_len
    return config_from_hf(read_json(Path(model) / "config.json"), model).max_seq_len


def cpu_dtype(root: Path, stored: torch.dtype, elements: int) -> torch.dtype:
    """The dtype a checkpoint stored in ``stored`` computes in on this CPU: float32 for a bf16
    or fp16 one whose matmuls the CPU has no hardware for (`cpu.has_fast_half`: AMX or
    AVX512-BF16 / -FP16), where they are emulated (a hunt: a bf16 training step 35-38x slower
    than float32 with oneDNN capped to AVX2, 3-5x on AVX-512 without BF16), unless twice the
    float32 weights would not fit in the free memory (so the choice depends on it: set
    ``$TINKER_SR_MODEL_DTYPE`` to fix it); else ``stored``. Logged either way."""
    if stored not in (torch.bfloat16, torch.float16) or has_fast_half(stored):
        return stored
    kind = str(stored).removeprefix("torch.")
    why = why_slow_half(stored)
    room = available_memory()
    # float32 weights, and as much again to spare (activations, KV caches and merged sampler
    # weights are twice the size too): a model that only just fits stays in its dtype.
    if room is not None and 2 * elements * 4 + LOAD_HEADROOM > room:
        log.warning(
            "%s: stored in %s, which this CPU computes without hardware support (%s), kept "
            "in %s: twice its float32 size does not fit in the %s free; expect slow steps",
            root, kind, why, kind, _size(room),
        )  # fmt: skip
        return stored
    log.warning(
        "%s: stored in %s, which this CPU computes without hardware support (%s): loading it "
        "in float32, twice the memory and several times faster here. %s=%s keeps %s",
        root, kind, why, MODEL_DTYPE_ENV, kind, kind,
    )  # fmt: skip
    return torch.float32


def check_room(root: Path, need: int) -> None:
    """Refuse, before allocating, a model of ``need`` bytes that would not fit in the free
    memory (`cpu.available_memory`: MemAvailable capped by any cgroup limit) with
    `LOAD_HEADROOM` to spare. ``$TINKER_SR_LOAD_MEMORY_CHECK=0`` skips the check (e.g. where
    swap is meant to take the rest)."""
    setting = os.environ.get(MEMORY_CHECK_ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{MEMORY_CHECK_ENV} must be 0 (skip) or 1 (check), got {setting!r}")
    if setting == "0":
        return
    room = available_memory()
    if room is None or need + LOAD_HEADROOM <= room:
        return
    raise EngineUserError(
        f"base_model {str(root)!r}: its weights take {_size(need)} and this machine has "
        f"{_size(room)} of memory free (MemAvailable, or the room left under a "
        f"cgroup/container limit), short of the weights plus {LOAD_HEADROOM >> 20} MiB. Use a "
        "smaller model or a lower-precision dtype (a bfloat16 checkpoint loads in bfloat16 "
        f"unless a dtype is set), free memory or raise the limit; {MEMORY_CHECK_ENV}=0 skips "
        "this check"
    )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _tie_or_untie(root: Path, files: list[Path], config: ModelConfig) -> ModelConfig:
    """A tied model whose checkpoint stores lm_head.weight too: tied when the two tensors are
    equal, else untied with both loaded (what transformers 5 does, with a warning)."""
    stored = {
        hybrid.engine_key(k): sl[:]
        for _, k, sl in _tensors(files, config.tie_embeddings)
        if hybrid.engine_key(k) in ("lm_head.weight", EMBED)
    }
    if torch.equal(stored["lm_head.weight"], stored[EMBED]):
        return config
    log.warning(
        "%s: config.json ties the embeddings but the checkpoint stores a different "
        "lm_head.weight: loading them untied, as transformers does (set "
        "tie_word_embeddings=false in config.json to say so)",
        root,
    )
    return dataclasses.replace(config, tie_embeddings=False)


def _progress(root: Path, total: int) -> Any:
    """A bytes progress bar on a terminal for checkpoints of PROGRESS_MIN_BYTES or more (a
    multi-GB model takes a while to read); otherwise nothing."""
    from tqdm import tqdm

    quiet = total < PROGRESS_MIN_BYTES or not sys.stderr.isatty()
    return tqdm(desc=f"loading {root.name}", total=total, unit="B", unit_scale=True, disable=quiet)
