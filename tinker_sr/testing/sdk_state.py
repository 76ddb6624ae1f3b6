"""Process-wide state of the official SDK that would leak from one test's Tinker to the next.

``tinker.RestClient()`` (0.38) shares one connection holder per *argument* pair
``(base_url, api_key)`` for the life of the process. Built from ``$TINKER_BASE_URL`` (both
arguments ``None``), it is keyed ``(None, None)`` whatever the variable says: a test that
points the variable at a new mock or server is handed the connections of the URL that was set
when the first such client was made, and its requests go there (a stopped server: retried for
minutes; a live one: another test's data). tinker-cookbook's ``weights.download`` builds
exactly such a client. `fresh_sdk_rest_clients` hides the cached holders for a block and drops
those made inside it, so every fixture of `tinker_sr.testing` starts and ends clean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _cache() -> tuple[dict[Any, Any], Any] | None:
    try:
        from tinker.lib.internal_client_holder import sessionless_holder_cache
    except ImportError:  # the official SDK is not installed, or no longer has the cache
        return None
    holders = getattr(sessionless_holder_cache, "_holders", None)
    lock = getattr(sessionless_holder_cache, "_lock", None)
    if not isinstance(holders, dict) or lock is None:
        return None
    return holders, lock


@contextlib.contextmanager
def fresh_sdk_rest_clients() -> Iterator[None]:
    """Within the block ``tinker.RestClient()`` makes new connections to the URL set now; on
    leaving, those are closed and the ones cached before are back."""
    cache = _cache()
    if cache is None:
        yield
        return
    holders, lock = cache
    with lock:
        before = dict(holders)
        holders.clear()
    try:
        yield
    finally:
        with lock:
            made = list(holders.values())
            holders.clear()
            holders.update(before)
        for holder in made:
            with contextlib.suppress(Exception):
                holder.close()
