"""Exception hierarchy: constructors, attributes, default messages, pickling, status mapping."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import httpx
import pytest

import tinker_sr.errors as E
from tinker_sr.types import RequestErrorCategory

try:
    import tinker as official
except ImportError:  # pragma: no cover
    official = None  # type: ignore[assignment]

needs_sdk = pytest.mark.skipif(official is None, reason="official tinker SDK not installed")

REQUEST = httpx.Request("POST", "http://tinker.test/api/v1/forward")


def _response(status: int) -> httpx.Response:
    return httpx.Response(status, request=REQUEST, json={"detail": "nope"})


STATUS_CLASSES = {
    400: E.BadRequestError,
    401: E.AuthenticationError,
    402: E.BillingError,
    403: E.PermissionDeniedError,
    404: E.NotFoundError,
    409: E.ConflictError,
    422: E.UnprocessableEntityError,
    429: E.RateLimitError,
    500: E.InternalServerError,
    503: E.InternalServerError,
    599: E.InternalServerError,
    405: E.APIStatusError,
    408: E.APIStatusError,
    410: E.APIStatusError,
    418: E.APIStatusError,
}


@pytest.mark.parametrize(("status", "cls"), list(STATUS_CLASSES.items()))
def test_make_status_error_picks_class_by_status(status: int, cls: type) -> None:
    err = E.make_status_error("boom", _response(status), {"detail": "nope"})
    assert type(err) is cls
    assert err.status_code == status
    assert err.message == "boom" and str(err) == "boom"
    assert err.body == {"detail": "nope"}
    assert err.request is REQUEST
    assert err.response.status_code == status


def test_hierarchy() -> None:
    assert issubclass(E.APIError, E.TinkerError)
    assert issubclass(E.APIStatusError, E.APIError)
    assert issubclass(E.APITimeoutError, E.APIConnectionError)
    assert issubclass(E.APIConnectionError, E.APIError)
    assert issubclass(E.APIResponseValidationError, E.APIError)
    assert issubclass(E.RequestFailedError, E.TinkerError)
    assert not issubclass(E.RequestFailedError, E.APIError)
    for cls in set(STATUS_CLASSES.values()):
        assert issubclass(cls, E.APIStatusError)


def test_default_messages() -> None:
    assert E.APIConnectionError(REQUEST).message == "Connection error."
    assert E.APIConnectionError(REQUEST, "stuck").message == "stuck"
    timeout = E.APITimeoutError(REQUEST)
    assert timeout.message == "Request timed out." and timeout.body is None
    invalid = E.APIResponseValidationError(_response(200), body={"x": 1})
    assert invalid.message == "Data returned by API invalid for expected schema."
    assert invalid.status_code == 200
    assert E.APIResponseValidationError(_response(200), None, "custom").message == "custom"


def test_request_failed_error_attributes() -> None:
    err = E.RequestFailedError("Request failed: bad", "req-1", RequestErrorCategory.User)
    assert (err.message, err.request_id, err.category) == (
        "Request failed: bad",
        "req-1",
        RequestErrorCategory.User,
    )
    assert str(err) == "Request failed: bad"


def _all_errors() -> list[Exception]:
    return [
        E.TinkerError("plain"),
        E.APIError("api", REQUEST, body={"a": 1}),
        E.make_status_error("rate", _response(429), {"a": 1}),
        E.make_status_error("odd", _response(418), None),
        E.InternalServerError("ise", _response(502), "raw"),
        E.APIConnectionError(REQUEST, "down"),
        E.APITimeoutError(REQUEST),
        E.APIResponseValidationError(_response(200), {"b": 2}, "schema"),
        E.RequestFailedError("failed", "req-9", RequestErrorCategory.Server),
    ]


@pytest.mark.parametrize("err", _all_errors(), ids=lambda e: type(e).__name__)
def test_every_error_pickles_round_trip(err: Exception) -> None:
    restored = pickle.loads(pickle.dumps(err))
    assert type(restored) is type(err)
    assert str(restored) == str(err)
    for attr in ("message", "body", "status_code", "request_id", "category"):
        if hasattr(err, attr):
            assert getattr(restored, attr) == getattr(err, attr), attr


@needs_sdk
def test_names_and_constructor_signatures_match_sdk() -> None:
    import inspect

    names = [
        "TinkerError",
        "APIError",
        "APIStatusError",
        "APITimeoutError",
        "APIConnectionError",
        "APIResponseValidationError",
        "RequestFailedError",
        "BadRequestError",
        "AuthenticationError",
        "BillingError",
        "PermissionDeniedError",
        "NotFoundError",
        "ConflictError",
        "UnprocessableEntityError",
        "RateLimitError",
        "InternalServerError",
    ]
    for name in names:
        ours, theirs = getattr(E, name), getattr(official, name)
        assert [b.__name__ for b in ours.__mro__] == [b.__name__ for b in theirs.__mro__], name

        def params(cls: Any) -> list[tuple[str, Any, Any]]:
            sig = inspect.signature(cls.__init__)
            return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

        assert params(ours) == params(theirs), name
        assert getattr(ours, "status_code", None) == getattr(theirs, "status_code", None), name


@needs_sdk
@pytest.mark.parametrize("status", sorted(STATUS_CLASSES))
def test_status_mapping_matches_sdk_client(status: int) -> None:
    from tinker._client import AsyncTinker

    client = AsyncTinker(api_key="tml-test", base_url="http://tinker.test")
    theirs = client._make_status_error("m", body=None, response=_response(status))
    assert type(E.make_status_error("m", _response(status), None)).__name__ == type(theirs).__name__


def test_an_engine_failure_a_server_reports_as_internal_is_logged_with_its_trace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a request that failed inside the engine reached its client as "internal error:
    ..." and left nothing in the server's log to find where. A user's mistake is not logged."""
    import asyncio
    import logging

    from tinker_sr.backend.local_errors import mapped
    from tinker_sr.server.futures import Background, Futures
    from tinker_sr.server.state import FAILED, ServerState
    from tinker_sr.user_errors import EngineUserError

    futures = Futures(ServerState(None), Background(), long_poll_s=1.0, max_pending_samples=8)

    def failing(error: Exception) -> Any:
        async def engine() -> Any:
            raise error

        async def work(promise: Any) -> Any:
            return await mapped(engine(), tmp_path)

        return work

    with caplog.at_level(logging.ERROR, logger="tinker_sr"):
        bug = asyncio.run(futures._outcome("r1", failing(ZeroDivisionError("oops")), {}))
        mistake = asyncio.run(futures._outcome("r2", failing(EngineUserError("bad lr")), {}))
    assert (
        bug is not None and bug[0] == FAILED and bug[3] == "internal error: ZeroDivisionError: oops"
    )
    assert mistake is not None and mistake[3] == "bad lr"
    logged = [r for r in caplog.records if "failed inside the engine" in r.getMessage()]
    assert len(logged) == 1 and "request r1" in logged[0].getMessage()
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is ZeroDivisionError
