"""The tinker_sr server: the Tinker wire protocol in front of a `Backend`.

`create_app(backend)` gives the ASGI app; `serve(...)` runs it with uvicorn over a
`LocalBackend` (what ``tinker-sr serve`` and ``python -m tinker_sr.server`` do).
"""

from __future__ import annotations

from typing import Any

from .defaults import DEFAULT_LONG_POLL_S

__all__ = ["create_app", "serve", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_LONG_POLL_S"]


def __getattr__(name: str) -> Any:
    """`create_app`, `serve` and the body limit, loaded on first use: importing a light
    submodule (`tinker_sr.server.defaults`, for ``tinker-sr``'s argument parser) must not
    load the whole server and torch."""
    if name in ("create_app", "DEFAULT_MAX_BODY_BYTES"):
        from . import app

        return getattr(app, name)
    if name == "serve":
        from .run import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
