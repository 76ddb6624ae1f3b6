"""Connections a server must not let pile up, and the open-file limit they count against.

Each client connection holds one of the process's open files. A found case (resource-limits
hunt): with uvicorn's defaults, a connection that never sent a request (or never finished its
headers, a slow-loris) was held forever, so ~250 idle sockets took a server whose limit was
256 out of service for everyone; CPython's accept loop then logged 2048 tracebacks a tick
(50 MB of log in 10 s, a core spinning). Here: the soft limit is raised to the hard one at
start, a connection that has not sent a whole request's headers within `request_start_s` is
closed, and running out of files while accepting is one log line every 10 s, naming the limit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from typing import Any

log = logging.getLogger("tinker_sr.server")

REQUEST_START_ENV = "TINKER_SR_REQUEST_START_S"
DEFAULT_REQUEST_START_S = 15.0
_ACCEPT_FAILED = "socket.accept() out of system resource"
_MOST_FILES = 1 << 20  # never raised beyond (containers' hard limits reach ~1e9)
_QUIET_S = 10.0  # at most one line per this many seconds about failing accepts


def request_start_s() -> float:
    """How long a connection may take to send a request's headers: after it opens and
    after each response (``$TINKER_SR_REQUEST_START_S``, default 15 s)."""
    raw = os.environ.get(REQUEST_START_ENV, "").strip()
    if not raw:
        return DEFAULT_REQUEST_START_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"${REQUEST_START_ENV} must be a number of seconds > 0, got {raw!r}: unset it for "
            f"the default ({DEFAULT_REQUEST_START_S:g} s)"
        )
    return value


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (many shells and
    services start at 1024); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = _MOST_FILES if hard == resource.RLIM_INFINITY else min(hard, _MOST_FILES)
    for target in (ceiling, min(ceiling, 10240)):  # 10240: macOS's OPEN_MAX
        if soft == resource.RLIM_INFINITY or soft >= target:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
            break
        except (OSError, ValueError):  # a kernel that caps it lower (nr_open, OPEN_MAX)
            continue
    return int(soft)


def open_file_limit() -> int:
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def quiet_accept_failures(loop: asyncio.AbstractEventLoop) -> None:
    """Failing accepts (out of files) as one warning every 10 s, naming the limit; every
    other loop error as before."""
    last = [-_QUIET_S]

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - last[0] >= _QUIET_S:
            last[0] = now
            log.warning(
                "cannot accept connections: %s (this process's open-file limit is %d). "
                "Connections that send no request are closed after %g s; raise the limit "
                "(ulimit -n) before starting the server for more clients",
                context.get("exception"),
                open_file_limit(),
                request_start_s(),
            )

    loop.set_exception_handler(handler)


def protocol_class(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request's
    headers ``timeout_s`` after it opened or after its last response (uvicorn's own
    keep-alive timer starts only after a response, and any byte stops it)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):  # type: ignore[misc]
        _request_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._await_request()

        def _answering(self) -> bool:
            """A request's headers are in and its response is not complete (a long poll's
            included). Not the client's h11 state: an early answer (401, 404) leaves it
            sending a body that may never end."""
            return self.cycle is not None and not self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._answering():
                self._stop_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # (a pipelined request already read has made a new cycle: it is being answered)
            if not self._answering() and not self.transport.is_closing():
                self._await_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _await_request(self) -> None:
            self._stop_timer()
            self._request_timer = self.loop.call_later(timeout_s, self._no_request)

        def _stop_timer(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _no_request(self) -> None:
            self._request_timer = None
            if not self._answering() and not self.transport.is_closing():
                log.debug("closing a connection that sent no request in %g s", timeout_s)
                self.transport.close()

    return Protocol
