"""Exception hierarchy, mirroring the official SDK's (names, constructors, attributes, pickling).

TinkerError
├── APIError(message, request, *, body)
│   ├── APIStatusError(message, response, body)  -> one subclass per status (make_status_error)
│   ├── APIConnectionError(request, message="Connection error.")
│   │   └── APITimeoutError(request)
│   └── APIResponseValidationError(response, body, message=None)
└── RequestFailedError(message, request_id, category)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from tinker_sr.user_errors import EngineUserError

if TYPE_CHECKING:
    from .types import RequestErrorCategory

__all__ = [
    "TinkerError",
    "APIError",
    "APIStatusError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "BadRequestError",
    "AuthenticationError",
    "BillingError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "UnprocessableEntityError",
    "RateLimitError",
    "InternalServerError",
    "RequestFailedError",
    "make_status_error",
    "refusal",
]


class TinkerError(Exception):
    """Base of every error this package raises on purpose."""


class APIError(TinkerError):
    """An HTTP exchange with the server went wrong."""

    message: str
    request: httpx.Request
    body: object | None
    """Decoded JSON body of the response if it had one, else the raw body, else ``None``."""

    def __init__(self, message: str, request: httpx.Request, *, body: object | None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request
        self.body = body

    # Exceptions cross process boundaries (multiprocess sampling), so every class must
    # unpickle through its own constructor signature.
    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_api_error, (self.__class__, self.message, self.request, self.body))


def _rebuild_api_error(
    cls: type[APIError], message: str, request: httpx.Request, body: object | None
) -> APIError:
    return cls(message, request, body=body)


class APIStatusError(APIError):
    """The server answered with a 4xx or 5xx status."""

    response: httpx.Response
    status_code: int

    def __init__(self, message: str, response: httpx.Response, body: object | None) -> None:
        super().__init__(message, response.request, body=body)
        self.response = response
        self.status_code = response.status_code

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.message, self.response, self.body), None)


class APIConnectionError(APIError):
    """The request never got an HTTP answer (network failure, or stuck requests)."""

    def __init__(self, request: httpx.Request, message: str = "Connection error.") -> None:
        super().__init__(message, request, body=None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.request, self.message), None)


class APITimeoutError(APIConnectionError):
    def __init__(self, request: httpx.Request) -> None:
        super().__init__(request=request, message="Request timed out.")

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.request,), None)


class APIResponseValidationError(APIError):
    """The server's answer did not match the expected schema."""

    response: httpx.Response
    status_code: int

    def __init__(
        self, response: httpx.Response, body: object | None, message: str | None = None
    ) -> None:
        super().__init__(
            message or "Data returned by API invalid for expected schema.",
            response.request,
            body=body,
        )
        self.response = response
        self.status_code = response.status_code

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.response, self.body, self.message), None)


class BadRequestError(APIStatusError):
    """HTTP 400."""

    status_code: int = 400


class AuthenticationError(APIStatusError):
    """HTTP 401: missing or invalid credentials."""

    status_code: int = 401


class BillingError(APIStatusError):
    """HTTP 402: billing is not set up or is paused."""

    status_code: int = 402


class PermissionDeniedError(APIStatusError):
    """HTTP 403."""

    status_code: int = 403


class NotFoundError(APIStatusError):
    """HTTP 404."""

    status_code: int = 404


class ConflictError(APIStatusError):
    """HTTP 409."""

    status_code: int = 409


class UnprocessableEntityError(APIStatusError):
    """HTTP 422."""

    status_code: int = 422


class RateLimitError(APIStatusError):
    """HTTP 429."""

    status_code: int = 429


class InternalServerError(APIStatusError):
    """HTTP 5xx."""


class RequestFailedError(TinkerError):
    """The server accepted a request and later reported it failed."""

    def __init__(self, message: str, request_id: str, category: RequestErrorCategory) -> None:
        super().__init__(message)
        self.message: str = message
        self.request_id: str = request_id
        self.category: RequestErrorCategory = category

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.message, self.request_id, self.category), None)


_STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    402: BillingError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def make_status_error(
    message: str, response: httpx.Response, body: object | None = None
) -> APIStatusError:
    """The APIStatusError subclass for ``response.status_code`` (plain APIStatusError for
    statuses without a dedicated class)."""
    status = response.status_code
    if status >= 500:
        return InternalServerError(message, response, body)
    return _STATUS_ERRORS.get(status, APIStatusError)(message, response, body)


def refusal(status: int, detail: str, url: str = "http://embedded.local/") -> APIStatusError:
    """The error a Tinker server's HTTP refusal (``status``, body ``{"detail": detail}``)
    raises in the SDK, built without a server: what the embedded engine raises for a request a
    server would refuse before accepting it (an unknown id, a malformed path), so code catching
    `NotFoundError` / `BadRequestError` works the same on both backends."""
    body = {"detail": detail}
    response = httpx.Response(status, json=body, request=httpx.Request("POST", url))
    return make_status_error(f"Error code: {status} - {detail}", response, body)


def refused_as_400(check: Callable[..., None], *args: Any) -> None:
    """``check(*args)``, a request check made before sending: its `EngineUserError` becomes the
    `BadRequestError` the official SDK raises for a server's 400 on that request."""
    try:
        check(*args)
    except EngineUserError as e:
        raise refusal(400, str(e)) from None
