"""Offline Tinker for tests and CI (see docs/testing.md).

- `mock_tinker`: the `tinker-sr serve` app in-process behind any httpx client (pytest fixture
  ``tinker_mock``); `ServerProcess` / `tinker_server_process`: a real server on a free port
  (fixtures ``tinker_server``, ``tinker_server_session``).
- Wire faults (`http_error`, `rate_limited`, `connection_reset`, `slow_response`,
  `request_timeout`, `future_stays_pending`, `session_expires`, `sequence_expired`) and the
  call `Trace`; backend-level faults for the embedded engine live in `tinker_sr.testing.faults`.
- The offline chat model every base model name maps to: `tinker_sr.testing.offline_model`.
"""

from typing import TYPE_CHECKING, Any

from tinker_sr.testing.mock import DEFAULT_API_KEY, DEFAULT_BASE_URL, MockTinker, mock_tinker
from tinker_sr.testing.wire import (
    FaultPlan,
    Trace,
    WireFault,
    connection_reset,
    future_stays_pending,
    http_error,
    rate_limited,
    read_trace,
    request_timeout,
    sequence_expired,
    session_expires,
    slow_response,
)

if TYPE_CHECKING:
    from tinker_sr.testing.server import ServerProcess, running_server, tinker_server_process

# Imported when first asked for, so that ``python -m tinker_sr.testing.server`` does not find
# the module imported by its package already (runpy's RuntimeWarning, an error under -W error).
_FROM_SERVER = frozenset({"ServerProcess", "running_server", "tinker_server_process"})


def __getattr__(name: str) -> Any:
    if name in _FROM_SERVER:
        from tinker_sr.testing import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_SERVER)


__all__ = [
    "DEFAULT_API_KEY",
    "DEFAULT_BASE_URL",
    "FaultPlan",
    "MockTinker",
    "ServerProcess",
    "Trace",
    "WireFault",
    "connection_reset",
    "future_stays_pending",
    "http_error",
    "mock_tinker",
    "rate_limited",
    "read_trace",
    "request_timeout",
    "running_server",
    "sequence_expired",
    "session_expires",
    "slow_response",
    "tinker_server_process",
]
