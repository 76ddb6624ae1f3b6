"""Which device the engine runs on: ``cpu`` (the default and the CI path), ``cuda`` or ``auto``.

Set by ``LocalBackend(device=...)``, ``tinker-sr serve --device`` or ``$TINKER_SR_DEVICE``
(in that order of precedence). On CUDA the model weights, LoRA adapters, optimizer state and
KV caches live on the GPU; random draws still come from CPU generators (the same seeds give
the same uniforms as on a CPU) and are moved to the device after drawing; results are moved
back to the CPU where they leave the engine.

Run on an NVIDIA H200 (fp32 within ~2e-6 of the CPU; figures in docs/performance.md, "GPU").
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from tinker_sr.engine.cpu import available_memory, has_fast_bf16, why_slow_half

DEVICE_ENV = "TINKER_SR_DEVICE"
CHOICES = ("cpu", "cuda", "auto")


def resolve_device(
    value: str | torch.device | None = None, *, what: str = "device"
) -> torch.device:
    """``value`` (or ``$TINKER_SR_DEVICE``, else ``cpu``) as a torch.device.

    ``auto`` is CUDA when torch can use a GPU, else the CPU. ``cuda`` (or ``cuda:N``) without a
    usable GPU is a ValueError naming the setting and the fix, never a silent CPU fallback.
    """
    source = what
    if value is None:
        value, source = os.environ.get(DEVICE_ENV, "").strip() or "cpu", DEVICE_ENV
    raw = str(value).strip().lower()
    if raw == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(raw)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{source}={value!r} is not a device; use one of {', '.join(CHOICES)}")
    if device.type == "cuda":
        _check_cuda(device, source, str(value))
    return device


def _check_cuda(device: torch.device, source: str, value: str) -> None:
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (
            "" if torch.version.cuda else ", a build without CUDA"
        )
        raise ValueError(
            f"{source}={value!r} but CUDA is not available ({build}). Install a CUDA build of "
            f"torch on a machine with an NVIDIA GPU, or set {source} to 'cpu' (or 'auto': the "
            "GPU when there is one, else the CPU)"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"{source}={value!r} but this machine has {torch.cuda.device_count()} CUDA "
            f"device(s); use cuda:0 .. cuda:{torch.cuda.device_count() - 1}"
        )


def fast_bf16(device: torch.device) -> bool:
    """bf16 matmuls run in hardware on ``device`` (CPU: AMX / AVX512-BF16; CUDA: sm80+)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return has_fast_bf16()


def free_memory(device: torch.device) -> int | None:
    """Bytes still allocatable on ``device``: for CUDA the GPU's free memory plus what torch's
    caching allocator holds unused, else the host's (`cpu.available_memory`: MemAvailable,
    capped by a cgroup limit); None where unknown."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + int(cached)
    return available_memory()


TRAIN_DTYPE_ENV = "TINKER_SR_TRAIN_DTYPE"


def train_autocast_dtype(device: torch.device | None = None) -> torch.dtype | None:
    """``$TINKER_SR_TRAIN_DTYPE``: ``float32`` (default) trains in fp32; ``bf16`` trains with
    bf16 matmuls under autocast (fp32 master weights, adapters, optimizer and loss) where the
    device has fast bf16 (CPU: AMX / AVX512-BF16, `has_fast_bf16`; CUDA: sm80+), else stays
    fp32 (bf16 would be emulated, i.e. slower; logged once); ``bf16-force`` uses bf16
    regardless."""
    raw = os.environ.get(TRAIN_DTYPE_ENV, "").strip().lower()
    if raw in ("", "float32", "fp32"):
        return None
    if raw in ("bf16", "bfloat16"):
        if fast_bf16(device or torch.device("cpu")):
            return torch.bfloat16
        _note_bf16_declined(str(device or "cpu"))
        return None
    if raw == "bf16-force":
        return torch.bfloat16
    raise ValueError(f"{TRAIN_DTYPE_ENV} must be float32, bf16 or bf16-force, got {raw!r}")


@functools.cache
def _note_bf16_declined(device: str) -> None:
    """Say once per device that ``bf16`` training was asked for and float32 runs instead."""
    what = why_slow_half(torch.bfloat16) if device == "cpu" else f"{device} has no bf16"
    logging.getLogger("tinker_sr.engine").warning(
        "%s=bf16 but %s (bf16 products would be emulated, slower than float32): training in "
        "float32; %s=bf16-force uses bf16 regardless",
        TRAIN_DTYPE_ENV, what, TRAIN_DTYPE_ENV,
    )  # fmt: skip
