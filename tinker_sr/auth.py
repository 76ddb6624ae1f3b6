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

For a remote server that is not on this machine, the key stored by the official CLI's
``tinker auth login`` (the default key of ``~/.tinker/credentials.json``, `stored_api_key`)
comes after ``$TINKER_API_KEY``, as in the SDK. ``$TINKER_CREDENTIAL_CMD`` is not run: where it
is set the stored key is skipped (the SDK prefers the command) and a key must be given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tinker_sr.errors import TinkerError

__all__ = [
    "get_tinker_token",
    "raise_if_tinker_not_accessible",
    "tinker_has_credentials",
]


def credentials_path() -> Path:
    """Where the official CLI's ``tinker auth login`` stores keys."""
    return Path("~/.tinker/credentials.json").expanduser()


def stored_api_key() -> str | None:
    """The default key stored by ``tinker auth login`` (``{"version": 1, "default": id,
    "keys": {id: {"key": ...}}}``); ``None`` without the file, without a default, or where
    ``$TINKER_CREDENTIAL_CMD`` is set. A file that cannot be read as one is a `TinkerError`
    naming it."""
    path = credentials_path()
    if os.environ.get("TINKER_CREDENTIAL_CMD") or not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
        default = stored.get("default")
        record = stored.get("keys", {}).get(default) if default is not None else None
        key = record.get("key") if record is not None else None
    except (OSError, ValueError, AttributeError) as e:
        raise TinkerError(
            f"{path}: not a readable Tinker credentials file ({type(e).__name__}: {e}); run "
            "`tinker auth login` again, delete it, or set TINKER_API_KEY"
        ) from e
    if key is not None and not isinstance(key, str):
        raise TinkerError(f"{path}: the default key is not a string; run `tinker auth login` again")
    return key


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
