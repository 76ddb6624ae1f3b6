"""The tinker_sr server: the Tinker wire protocol in front of a `Backend`.

`create_app(backend)` gives the ASGI app; `serve(...)` runs it with uvicorn over a
`LocalBackend` (what ``tinker-sr serve`` and ``python -m tinker_sr.server`` do).
"""

from .app import DEFAULT_LONG_POLL_S, DEFAULT_MAX_BODY_BYTES, create_app
from .run import serve

__all__ = ["create_app", "serve", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_LONG_POLL_S"]
