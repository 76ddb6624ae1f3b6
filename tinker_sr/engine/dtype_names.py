"""The dtype names the engine takes (``model_dtype=``, ``$TINKER_SR_MODEL_DTYPE``), checked
without torch: ``tinker-sr serve`` and ``demo`` refuse a bad setting before torch loads."""

from __future__ import annotations

import os

__all__ = ["DTYPE_NAMES", "MODEL_DTYPE_ENV", "dtype_name", "env_model_dtype_name"]

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
