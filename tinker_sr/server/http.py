"""HTTP framing of the Tinker wire protocol: API-key auth, request bodies (size limit, zstd),
JSON replies, and the mapping of backend errors to HTTP statuses.

Nothing here knows about sessions, models or futures.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from tinker_sr.backend.base import WorkNotStarted
from tinker_sr.engine.store_files import OUT_OF_SPACE, is_out_of_space
from tinker_sr.errors import APIStatusError, RequestFailedError
from tinker_sr.types import RequestErrorCategory
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError, clip_message
from tinker_sr.wire import BodyTooLargeError, WireError, compression
from tinker_sr.wire import messages as m

log = logging.getLogger("tinker_sr.server")

PROTOBUF = "application/x-protobuf"

T = TypeVar("T")
Handler = Callable[[Request, str], Awaitable[Response]]


class HTTPError(Exception):
    """Answer the request with ``status`` and ``{"detail": detail}`` (``param``: the request
    field at fault, for APIs whose errors name one)."""

    def __init__(
        self,
        status: int,
        detail: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers
        self.param = param


def error(
    status: int, detail: str, headers: dict[str, str] | None = None, param: str | None = None
) -> JSONResponse:
    """The Tinker API's error body, ``{"detail": ...}`` (it names no field: ``param`` unused)."""
    return JSONResponse({"detail": clip_message(detail)}, status_code=status, headers=headers)


ErrorReply = Callable[..., Response]


def json_reply(obj: Any, status: int = 200) -> Response:
    return Response(m.dumps(obj), status_code=status, media_type="application/json")


def strip_prefix(message: str) -> str:
    # The SDK prefixes "Request failed: " itself when it raises RequestFailedError.
    return message.removeprefix("Request failed: ")


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def owner_of(request: Request, api_keys: list[bytes], *, bearer: bool = False) -> str:
    """The caller's identity: a hash of its X-API-Key (checked against ``api_keys`` if any);
    with ``bearer``, ``Authorization: Bearer <key>`` (as OpenAI clients send it) too; both
    naming different keys is refused."""
    key = request.headers.get("x-api-key")
    if bearer:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if key and token and key != token:
            raise HTTPError(
                401, "X-API-Key and Authorization: Bearer name different keys; send one"
            )
        key = key or token
        if not key:
            raise HTTPError(
                401,
                "missing API key: send X-API-Key or 'Authorization: Bearer tml-...' (your "
                "client's api_key='tml-...')",
            )
    if not key:
        raise HTTPError(
            401, "missing X-API-Key header; pass api_key='tml-...' or set TINKER_API_KEY"
        )
    if api_keys:
        # Compare against every key so timing does not reveal which one nearly matched.
        matches = [hmac.compare_digest(key.encode(), k) for k in api_keys]
        if not any(matches):
            raise HTTPError(
                401,
                "X-API-Key is not accepted by this server (it is not one of the keys "
                "given to the server with --api-key, --api-keys or $TINKER_SR_API_KEYS)",
            )
    elif not key.startswith("tml-"):
        raise HTTPError(401, "X-API-Key must start with 'tml-' (e.g. TINKER_API_KEY=tml-local)")
    return hashlib.sha256(key.encode()).hexdigest()[:32]


BODY_STALL_ENV = "TINKER_SR_BODY_STALL_S"


def env_seconds(name: str, default: float, *, zero: bool) -> float:
    """Seconds from ``$name`` (0 allowed where ``zero``), else ``default``: a value that is not
    a number of seconds is logged once, naming the variable, and the default used."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0 or (value == 0 and not zero):  # not a number, negative or a bad 0
        if (name, raw) not in _WARNED:
            _WARNED.add((name, raw))
            need = "a number of seconds" + ("" if zero else " above 0")
            log.warning("$%s=%r must be %s; using %g s", name, raw, need, default)
        return default
    return value


_WARNED: set[tuple[str, str]] = set()


def body_stall_s() -> float:
    """How long a request body may go without a byte before the server answers 408:
    ``$TINKER_SR_BODY_STALL_S``, default 60 s."""
    return env_seconds(BODY_STALL_ENV, 60.0, zero=False)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (before and after zstd decompression)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(
            f"request body of {declared} bytes exceeds this server's limit of {limit} bytes "
            "(--max-body-bytes); send smaller requests"
        )
    parts, size = [], 0
    chunks, stall = request.stream().__aiter__(), body_stall_s()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(chunks), stall)
        except StopAsyncIteration:
            break
        except TimeoutError:  # a client that stops mid-body would hold its connection forever
            raise HTTPError(
                408,
                f"the request body stalled: no bytes for {stall:g} s after {size} of "
                f"{declared or 'an unknown number of'} bytes; send the whole body at once "
                f"(${BODY_STALL_ENV} sets the wait)",
            ) from None
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(
                f"request body exceeds this server's limit of {limit} bytes "
                "(--max-body-bytes); send smaller requests"
            )
        parts.append(chunk)
    body = b"".join(parts)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "zstd":
        # Off the event loop: up to max_body_bytes of decompression (and its frame walk).
        return await asyncio.to_thread(compression.zstd_decompress, body, limit)
    if encoding not in ("", "identity"):
        raise HTTPError(
            415, f"Content-Encoding {encoding!r} is not supported; send identity or zstd"
        )
    return body


def _is_not_found(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, EngineNotFoundError):
            return True
        seen = seen.__cause__
    return False


def plain_error(e: Exception) -> tuple[int, str]:
    """Status and detail for a backend failure on a plain (non-future) call (or an
    `HTTPError`'s own, where one ends a reply that has begun)."""
    if isinstance(e, HTTPError):
        return e.status, e.detail
    if isinstance(e, EngineUserError):  # a request refused by `tinker_sr.validation`
        return (404 if isinstance(e, EngineNotFoundError) else 400), str(e)
    if isinstance(e, RequestFailedError):
        if e.category == RequestErrorCategory.User:
            return (404 if _is_not_found(e) else 400), strip_prefix(e.message)
        return 500, strip_prefix(e.message)
    if isinstance(e, APIStatusError):  # a refusal (`errors.refusal`), or a remote backend's
        detail = e.body.get("detail") if isinstance(e.body, dict) else None
        return e.status_code, detail if isinstance(detail, str) else e.message
    if isinstance(e, WorkNotStarted):  # a graceful stop began (`TinkerServer.begin_stop`)
        return 503, "the server is stopping; retry shortly (the restarted server answers)"
    if isinstance(e, NotImplementedError):
        # 400, not 501: the SDK retries every 5xx for minutes before giving up.
        return 400, f"not supported by this server: {e}"
    if is_out_of_space(e):
        return 507, OUT_OF_SPACE
    return 500, f"internal server error: {type(e).__name__}: {e}"


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client hangs up first: then ``work`` is cancelled (a
    sample stops, as a closed stream's does) and `ClientDisconnect` raised. For a request
    whose body has been read and whose answer takes long: nothing else hears the client go
    before the answer is sent."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientDisconnect()
    return task.result()


def endpoint(
    fn: Handler, owner: Callable[[Request], str] | None, *, reply: ErrorReply = error
) -> Callable[[Request], Awaitable[Response]]:
    """An ASGI handler: authenticate with ``owner`` (``None``: no auth), run ``fn``, and
    turn every error into its HTTP answer, written by ``reply(status, detail, headers,
    param)`` (default: the Tinker API's `error`)."""

    async def handler(request: Request) -> Response:
        try:
            return await fn(request, owner(request) if owner is not None else "")
        except HTTPError as e:
            return reply(e.status, e.detail, e.headers, e.param)
        except BodyTooLargeError as e:
            return reply(413, str(e))
        except WireError as e:
            return reply(400, str(e))
        except ClientDisconnect:  # gone mid-upload, or before its answer: nobody to tell
            log.info("%s %s: the client went away", request.method, request.url.path)
            return Response(status_code=499)
        except Exception as e:  # a backend failure on a plain (non-future) call
            status, detail = plain_error(e)
            if status >= 500 and not isinstance(e, WorkNotStarted):
                log.exception("%s %s failed", request.method, request.url.path)
            return reply(status, detail)

    return handler
