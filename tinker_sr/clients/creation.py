"""Futures of clients that old scripts may also use directly as clients.

``tc = await service.create_lora_training_client(...)`` and ``.result()`` are the intended
use. For scripts written against older SDKs, calling client methods or reading public
attributes on the future itself still works: it blocks for the client and warns.
"""

from __future__ import annotations

import concurrent.futures
import inspect
from collections.abc import Generator
from typing import Any, Generic, TypeVar

from tinker_sr.clients.holder import blocking_result, warn_deprecated
from tinker_sr.clients.sampling import SamplingClient
from tinker_sr.clients.training import TrainingClient
from tinker_sr.futures import APIFuture, _await_concurrent

C = TypeVar("C")


class _ClientFuture(APIFuture[C], Generic[C]):
    _client_cls: type

    def __init__(self, future: concurrent.futures.Future[C]) -> None:
        self._cf = future

    # APIFuture
    def result(self, timeout: float | None = None) -> C:
        return blocking_result(self._cf, timeout)

    async def result_async(self, timeout: float | None = None) -> C:
        return await _await_concurrent(self._cf, timeout)

    def future(self) -> concurrent.futures.Future[C]:
        return self._cf

    def __await__(self) -> Generator[Any, None, C]:
        return self.result_async().__await__()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the future itself lacks (e.g. `model_id`).
        if name.startswith("_"):
            raise AttributeError(name)
        warn_deprecated(
            f"Reading .{name} on a client future is deprecated; await the future (or call "
            ".result()) to get the client first"
        )
        return getattr(self.result(), name)

    def __repr__(self) -> str:
        f = self._cf
        if f.cancelled():
            return f"<{type(self).__name__} cancelled>"
        if not f.done():
            return f"<{type(self).__name__} pending>"
        exc = f.exception()
        return f"<{type(self).__name__} failed: {exc!r}>" if exc else repr(f.result())


def _forwarder(name: str) -> Any:
    def method(self: _ClientFuture[Any], *args: Any, **kwargs: Any) -> Any:
        warn_deprecated(
            f"Calling .{name}() on a client future is deprecated; await the future (or call "
            ".result()) to get the client first"
        )
        return getattr(self.result(), name)(*args, **kwargs)

    method.__name__ = name
    return method


def _install_forwarders(cls: type, client_cls: type) -> None:
    skip = {"result", "result_async", "future", "coroutine"}
    for name, member in inspect.getmembers(client_cls):
        if name.startswith("_") or name in skip or not callable(member):
            continue
        setattr(cls, name, _forwarder(name))


class BackcompatTrainingClientFuture(_ClientFuture[TrainingClient], TrainingClient):  # type: ignore[misc]
    """Future of a `TrainingClient` (also usable as one, with a deprecation warning)."""


class BackcompatSamplingClientFuture(_ClientFuture[SamplingClient], SamplingClient):  # type: ignore[misc]
    """Future of a `SamplingClient` (also usable as one, with a deprecation warning)."""

    def __reduce__(self) -> Any:
        return self.result().__reduce__()


_install_forwarders(BackcompatTrainingClientFuture, TrainingClient)
_install_forwarders(BackcompatSamplingClientFuture, SamplingClient)
