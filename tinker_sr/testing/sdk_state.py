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
import functools
import weakref
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def clients_closed_after(
    *base_urls: str, before_closing: Callable[[], object] | None = None
) -> Iterator[None]:
    """On leaving the block, close the clients made in it that talk to ``base_urls`` (a mock's
    own, and the hosted service's it answers for too): the
    official SDK's (a ServiceClient's connection holder and its heartbeat) and tinker_sr's.
    ``before_closing`` runs first (a mock drops its faults: a permanent one on ``*`` made
    each client's closing retry its telemetry for 10 s).
    A client a test leaves open otherwise heartbeats every 10 s into whatever answers that URL
    next: the next test's mock (its trace and its faults' counters: a fault planned for that
    test fires on the other test's heartbeat) or another test's server on a reused port."""
    from tinker_sr.clients.holder import ClientSession, submit

    made: weakref.WeakSet[Any] = weakref.WeakSet()
    restore = _record_sdk_holders(made)
    before = set(ClientSession._registry.keys())
    urls = {u.rstrip("/") for u in base_urls}
    try:
        yield
    finally:
        restore()
        if before_closing is not None:
            with contextlib.suppress(Exception):  # a server the test stopped: nothing to drop
                before_closing()
        for holder in list(made):
            if str(getattr(holder, "_base_url", "")).rstrip("/") in urls:
                # Waited for: closing flushes the SDK's telemetry, which must reach this mock
                # or server, not the next one (or, a mock gone, the network).
                with contextlib.suppress(Exception):
                    holder.run_coroutine_threadsafe(holder.aclose()).result(timeout=10)
        for key, session in list(ClientSession._registry.items()):
            target = str(getattr(session.backend, "base_url", None) or "").rstrip("/")
            if key in before or session.closed or target not in urls:
                continue
            session.closed = True
            with contextlib.suppress(Exception):
                submit(session.close("interrupted", _LEFT_OPEN)).result(timeout=10)


_LEFT_OPEN = "left open by a test; closed as its mock or server stopped"


def _record_sdk_holders(made: weakref.WeakSet[Any]) -> Callable[[], None]:
    """Add every official SDK connection holder made from now on to ``made``; returns the
    function that stops it."""
    try:
        from tinker.lib.internal_client_holder import InternalClientHolder
    except ImportError:  # the official SDK is not installed
        return lambda: None
    original = InternalClientHolder.__init__

    @functools.wraps(original)
    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        made.add(self)
        original(self, *args, **kwargs)

    InternalClientHolder.__init__ = recording  # type: ignore[method-assign]

    def restore() -> None:
        InternalClientHolder.__init__ = original  # type: ignore[method-assign]

    return restore
