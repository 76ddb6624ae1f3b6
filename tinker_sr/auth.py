"""Credential helpers with the official SDK's names (``tinker.auth``).

Which backend a default ``ServiceClient()`` would use decides the answers:

* **Embedded engine** (no ``$TINKER_BASE_URL``, or ``$TINKER_SR_BACKEND=local``): it needs
  no credential, so it is always accessible: `tinker_has_credentials` is ``True`` and
  `raise_if_tinker_not_accessible` returns at once. `get_tinker_token` still reports a
  configured ``$TINKER_API_KEY``.
* **Remote server** (``$TINKER_BASE_URL`` set): the SDK's rules. A credential is
  ``$TINKER_API_KEY`` (a ``tml-`` key or a JWT); `raise_if_tinker_not_accessible` makes a
  single, unretried ``get_server_capabilities`` request and raises the matching
  `TinkerError` subclass on failure.

tinker_sr reads no stored credentials (``~/.tinker/credentials.json``) and does not run
``$TINKER_CREDENTIAL_CMD``: its clients do not use them, so neither do these helpers.
"""

from __future__ import annotations

import os

from tinker_sr.errors import TinkerError

__all__ = [
    "get_tinker_token",
    "raise_if_tinker_not_accessible",
    "tinker_has_credentials",
]


def _uses_remote() -> bool:
    from tinker_sr.clients.holder import wants_remote

    return wants_remote(None, None)


def get_tinker_token() -> str | None:
    """The configured static API key (``$TINKER_API_KEY``), or ``None``. Local lookup only."""
    return os.environ.get("TINKER_API_KEY") or None


def tinker_has_credentials() -> bool:
    """Whether a default ``ServiceClient()`` has the credential it needs (local check, no
    request): always ``True`` on the embedded engine; on a remote server, whether
    ``$TINKER_API_KEY`` holds a well-formed key."""
    if not _uses_remote():
        return True
    from tinker_sr.clients.service import _check_api_key

    try:
        _check_api_key(None, remote=True)
    except TinkerError:
        return False
    return True


def raise_if_tinker_not_accessible() -> None:
    """Raise unless a default ``ServiceClient()`` can be used.

    The embedded engine is always accessible. For a remote server this makes one
    ``get_server_capabilities`` request, without retries, and raises `TinkerError` when no
    credential is configured, `AuthenticationError` when it is rejected,
    `APIConnectionError` when the server is unreachable (other failures as their
    `TinkerError` subclass).
    """
    if not _uses_remote():
        return
    from tinker_sr.backend.remote import RemoteBackend
    from tinker_sr.clients.holder import blocking_result, resolve_base_url, submit
    from tinker_sr.clients.service import _check_api_key

    try:
        key = _check_api_key(None, remote=True)
        backend = RemoteBackend(base_url=resolve_base_url(None), api_key=key, max_retries=0)
    except TinkerError:
        raise
    except Exception as e:  # fold e.g. OSError/ValueError into the documented contract
        raise TinkerError(str(e)) from e

    async def check() -> None:
        try:
            await backend.get_server_capabilities()
        finally:
            await backend.aclose()

    try:
        blocking_result(submit(check()))
    except TinkerError:
        raise
    except Exception as e:
        raise TinkerError(f"{type(e).__name__}: {e}") from e
