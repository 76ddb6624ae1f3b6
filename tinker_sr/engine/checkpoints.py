"""safetensors files written atomically: a reader sees the old file or the new one, never half."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as _serialize

from tinker_sr.user_errors import EngineNotFoundError, EngineUserError

log = logging.getLogger("tinker_sr")

if TYPE_CHECKING:
    from tinker_sr.engine.lora import LoraSpec


def save_tensors(
    path: str | os.PathLike[str],
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `tensors` (+ string metadata) to `path`; returns the file size in bytes.

    Temp file in the same directory, fsync, os.replace, then fsync of the directory, so a
    crash leaves either the previous file or the complete new one and no temp file behind
    on success. Tensors sharing storage (tied weights) are copied, as safetensors requires.
    """
    metadata = dict(metadata or {})
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise EngineUserError(
                f"checkpoint metadata {k!r}: keys and values must be str, got {type(v).__name__}"
            )
    seen: set[int] = set()
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        # safetensors refuses tensors that share memory; copy aliases and partial views.
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        plain[name] = t
    blob = _serialize(plain, metadata=metadata)

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        # mkstemp makes it 0600 whatever the umask: an exported adapter or checkpoint that
        # another user (a teammate, a vLLM service) should read could not be.
        if hasattr(os, "fchmod"):
            os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return len(blob)


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the process's umask (read from
    /proc/self/status where it can be, so no other thread sees the umask change)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # the strictest while it is probed: no file made meanwhile widens
    os.umask(mask)
    return 0o666 & ~mask


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in directory `path` durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_tensors(
    path: str | os.PathLike[str], name: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file → (tensors, metadata). Missing file → EngineNotFoundError; a file
    that does not read, or a tensor holding NaN or infinity (which no saved state holds: such
    weights are refused by every save), → EngineUserError naming the checkpoint as
    ``name`` (e.g. its tinker:// path; the file's path is never shown then)."""
    from safetensors import SafetensorError

    p = Path(path)
    shown = name or str(p)
    if not p.is_file():
        raise EngineNotFoundError(f"checkpoint file not found: {shown}")
    damaged = f"checkpoint {shown} is damaged on disk and cannot be loaded"
    fix = "load another checkpoint (RestClient.list_checkpoints lists a run's)"
    try:
        with safe_open(str(p), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(str(p))
    except (SafetensorError, OSError) as e:
        raise EngineUserError(f"{damaged}: its file does not read ({e}); {fix}") from e
    for key, tensor in tensors.items():
        if bad := count_nonfinite(tensor):
            raise EngineUserError(
                f"{damaged}: tensor {key} holds {bad} NaN or infinite values; {fix}"
            )
    return tensors, metadata


def count_nonfinite(tensor: torch.Tensor) -> int:
    """How many NaN / infinite elements a tensor holds (0 for integer tensors). A sum is the
    cheap test (one pass; `benchmarks/load_checks.py` measures it); only a non-finite sum,
    which a finite float16 tensor can also reach, is counted element-wise."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())):
        return 0
    return int((~torch.isfinite(tensor)).sum())


@dataclass(frozen=True)
class CheckpointRecord:
    """What a tinker_sr checkpoint's metadata records of the model it was saved from."""

    lora: LoraSpec
    base_model: str
    steps: int

    def base_for(self, requested: str | None, resolve: Callable[[str], str], shown: str) -> str:
        """The base model a client of this checkpoint (``shown``) runs: its own, or
        ``requested`` where that names the same model (a variant of its name, such as a longer
        context, or any model where its own no longer resolves: a moved directory); another
        model is refused, where its adapters would run on the wrong weights (silently where the
        shapes agree)."""
        if requested is None or requested == self.base_model:
            if self.base_model.startswith((".", "~")):
                _warn_relative(self.base_model, shown)
            return self.base_model
        wanted = resolve(requested)
        try:
            recorded = resolve(self.base_model)
        except EngineUserError:  # moved or gone since: the adapters' shapes are checked on load
            return requested
        if wanted != recorded:
            raise EngineUserError(
                f"base_model {requested!r} is not the model checkpoint {shown} was trained on "
                f"({self.base_model!r}); pass base_model={self.base_model!r}, or leave it out"
            )
        return requested


def _warn_relative(base_model: str, shown: str) -> None:
    """tinker_sr before commit 493d695 recorded a relative base model path as typed
    ("./model"): it resolves from the current directory, which need not be the one it was
    saved from, and a model of the same shapes there loads silently (hunt)."""
    log.warning(
        "checkpoint %s names its base model by the relative path %r (as an older tinker_sr "
        "recorded it), resolved from the current directory %s: if that is not the directory it "
        "was saved from, pass base_model=<the model's absolute path>",
        shown, base_model, os.getcwd(),
    )  # fmt: skip


CHECKPOINT_FORMAT = "tinker_sr/1"
"""What `training.checkpoint_meta` writes as ``format``; a later layout gets a higher number."""


def check_format(written: str | None, shown: str) -> None:
    """Refuse a checkpoint of a later layout than this version reads, saying so (before, its
    fields were read as this version's, and one it did not know was called damage)."""
    prefix, _, number = (written or "").partition("/")
    if prefix == "tinker_sr" and number.isdigit() and int(number) > int(CHECKPOINT_FORMAT[10:]):
        raise EngineUserError(
            f"checkpoint {shown} was written by a newer tinker_sr (format {written}; this "
            f"version reads {CHECKPOINT_FORMAT}): upgrade tinker_sr (pip install -U tinker-sr) "
            "to load it"
        )


def read_record(
    meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor], shown: str
) -> CheckpointRecord:
    """The metadata `checkpoint_meta` wrote (base model, LoRA config, steps), checked against
    the adapters it sits beside: a damaged or hand-edited file is EngineUserError naming the
    checkpoint as ``shown`` and the field, not a KeyError or TypeError from deep in a load."""
    from tinker_sr.engine.lora import LoraSpec

    def damaged(field: str) -> EngineUserError:
        return EngineUserError(
            f"checkpoint {shown} is damaged: its metadata's {field} "
            f"({str(meta.get(field))[:200]!r}) does not read; load another checkpoint "
            "(RestClient.list_checkpoints lists a run's)"
        )

    check_format(meta.get("format"), shown)
    try:
        spec = LoraSpec(**json.loads(meta["lora"]))
    except (KeyError, TypeError, ValueError) as e:
        raise damaged("lora") from e
    flags = (spec.train_attn, spec.train_mlp, spec.train_unembed, spec.moe_shared_outer)
    ranks = {t.shape[0] for k, t in tensors.items() if k.endswith("lora_A.weight") and t.ndim}
    if not (
        type(spec.rank) is int
        and ranks == {spec.rank}
        and (spec.seed is None or type(spec.seed) is int)
        and all(type(flag) is bool for flag in flags)
        and type(spec.alpha) in (int, float)
        and math.isfinite(spec.alpha)
        and spec.alpha > 0
    ):
        raise damaged("lora")
    base_model = meta.get("base_model")
    if not isinstance(base_model, str) or not base_model:
        raise damaged("base_model")
    steps = meta.get("steps", "0")
    if not (isinstance(steps, str) and steps.isdecimal() and steps.isascii()):
        raise damaged("steps")
    return CheckpointRecord(spec, base_model, int(steps))
