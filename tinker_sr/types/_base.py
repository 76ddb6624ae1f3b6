"""The two pydantic bases every model type derives from (same split as the official SDK)."""

from __future__ import annotations

import pydantic
from pydantic import ConfigDict

__all__ = ["StrictBase", "BaseModel"]


class StrictBase(pydantic.BaseModel):
    """Request-side types: an unknown field is a user mistake, so reject it early."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    def __str__(self) -> str:
        return repr(self)


class BaseModel(pydantic.BaseModel):
    """Response-side types: ignore unknown fields so a newer server does not break us."""

    model_config = ConfigDict(frozen=True, extra="ignore", protected_namespaces=())

    def __str__(self) -> str:
        return repr(self)
