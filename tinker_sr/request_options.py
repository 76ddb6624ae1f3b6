"""Client-configuration types with the official SDK's names: `Timeout` (``httpx.Timeout``,
as in the SDK) and `RequestOptions` (per-request overrides, a ``TypedDict``).

tinker_sr's public methods take no per-request options, like the SDK's; these names exist
so code that imports or annotates with them keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from httpx import Timeout

__all__ = ["RequestOptions", "Timeout"]


class RequestOptions(TypedDict, total=False):
    """Per-request overrides (every key optional), as in ``tinker.RequestOptions``."""

    headers: Mapping[str, str]
    max_retries: int
    timeout: float | Timeout | None
    params: Mapping[str, object]
    extra_json: Mapping[str, object]
    idempotency_key: str
    follow_redirects: bool
