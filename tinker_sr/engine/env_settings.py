"""Settings the engine reads from the environment, parsed without torch, so ``tinker-sr
serve`` and ``demo`` refuse a bad one before torch loads (`server.preflight.check_settings`):
the dtype names it takes (``model_dtype=``, ``$TINKER_SR_MODEL_DTYPE``), activation
checkpointing and the LoRA samplers a session keeps."""

from __future__ import annotations

import os

__all__ = [
    "CHECKPOINTING_ENV",
    "DTYPE_NAMES",
    "MODEL_DTYPE_ENV",
    "SAMPLERS_PER_SESSION",
    "SAMPLERS_PER_SESSION_ENV",
    "checkpointing_setting",
    "dtype_name",
    "env_model_dtype_name",
    "samplers_per_session",
]

DTYPE_NAMES = ("bfloat16", "float16", "float32")
ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
MODEL_DTYPE_ENV = "TINKER_SR_MODEL_DTYPE"


def dtype_name(value: str, field: str = "dtype") -> str:
    """'bf16' / 'bfloat16' -> 'bfloat16'; a name the engine does not take is an
    `EngineUserError` (a ValueError) naming ``field`` and the names it takes."""
    from tinker_sr.user_errors import EngineUserError

    name = ALIASES.get(value, value)
    if name not in DTYPE_NAMES:
        raise EngineUserError(
            f"{field}: {value!r} is not a supported dtype; use one of {list(DTYPE_NAMES)}"
        )
    return name


def env_model_dtype_name() -> str | None:
    """``$TINKER_SR_MODEL_DTYPE``'s dtype name (None where unset or empty: each checkpoint's
    own)."""
    value = os.environ.get(MODEL_DTYPE_ENV) or None
    return None if value is None else dtype_name(value, f"${MODEL_DTYPE_ENV}")


CHECKPOINTING_ENV = "TINKER_SR_ACTIVATION_CHECKPOINTING"


def checkpointing_setting() -> bool | None:
    """``$TINKER_SR_ACTIVATION_CHECKPOINTING``: ``1`` always, ``0`` never, unset or ``auto``:
    when a step's activations would crowd the available memory (`model.checkpoint_pays`)."""
    raw = os.environ.get(CHECKPOINTING_ENV, "auto").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("0", "1"):
        return raw == "1"
    raise ValueError(f"{CHECKPOINTING_ENV} must be 0, 1 or auto, got {raw!r}")


# A session keeps the adapters of its most recently used LoRA samplers only: an RL loop that
# makes a sampler every step (and never says when it drops one) would otherwise fill memory,
# then the spill directory, without bound (`registry`; those from a checkpoint: `set_aside`).
SAMPLERS_PER_SESSION_ENV, SAMPLERS_PER_SESSION = "TINKER_SR_SAMPLERS_PER_SESSION", 64


def samplers_per_session() -> int:
    """``$TINKER_SR_SAMPLERS_PER_SESSION`` (default 64; at least 1)."""
    raw = os.environ.get(SAMPLERS_PER_SESSION_ENV, "").strip()
    if not raw:
        return SAMPLERS_PER_SESSION
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"{SAMPLERS_PER_SESSION_ENV} must be a whole number >= 1 (the LoRA sampling "
            f"clients a session keeps in memory), got {raw!r}; unset it for the default "
            f"({SAMPLERS_PER_SESSION})"
        )
    return int(raw)
