"""What the official SDK's `RestClient` makes of an id or a path before a server answers, so
that both tinker_sr backends fail the same call with the same exception class.

The SDK formats an id into the URL path (``f"/api/v1/training_runs/{training_run_id}"``):
a value that is not a string names nothing there (the server answers 404), and a URL httpx
refuses (a control character such as NUL or TAB, or over 65536 characters) fails the future
with `httpx.InvalidURL` before anything is sent. A path that travels in a JSON body and is
not a string is a 400 naming the field, or, if JSON cannot carry it at all, the `TypeError`
/ `ValueError` of encoding it. An empty id, or one holding "/" (or a "." or ".." segment),
leaves a URL that names no endpoint (404). Before these checks the embedded engine handed
such values to SQLite ("internal error: ProgrammingError ...", a `RequestFailedError`).

Each function returns the exception to fail the future with, or ``None``.
"""

from __future__ import annotations

import json

import httpx

from tinker_sr.errors import refusal


def url(route: str, *, path_args: tuple[str, ...] = (), **args: object) -> Exception | None:
    """What becomes of the SDK's request to ``route`` (its URL path, ``args`` formatted into
    it): `invalid_url`, else `no_endpoint`."""
    return invalid_url(route, **args) or no_endpoint(route, path_args=path_args, **args)


def invalid_url(route: str, **args: object) -> Exception | None:
    """`httpx.InvalidURL`, naming ``args``, if httpx refuses ``route`` (before any body is
    encoded or anything sent)."""
    try:
        httpx.URL(route)
    except httpx.InvalidURL as e:
        return httpx.InvalidURL(f"{e} ({_named(args)}: no URL can carry it)")
    return None


def no_endpoint(route: str, *, path_args: tuple[str, ...] = (), **args: object) -> Exception | None:
    """`NotFoundError` if an argument leaves ``route`` naming no endpoint: one that is empty
    ("training_runs//checkpoints"), or holds a "." or ".." segment (httpx resolves it: the
    SDK calls another endpoint), or holds a "/" where an id is one segment (all but
    ``path_args``, such as a checkpoint id "weights/<name>")."""
    for name, value in args.items():
        text = str(value)
        parts = text.split("/")
        if text == "" or "." in parts or ".." in parts or (name not in path_args and "/" in text):
            return refusal(
                404,
                f"no such endpoint: {route!r:.100} ({name}={value!r:.60} is empty, '.' or "
                "'..', or holds '/': not one id)",
            )
    return None


def query_in_checkpoint_id(checkpoint_id: object) -> Exception | None:
    """`BadRequestError` for a DELETE on a checkpoint id whose "?" starts a query string in
    the SDK's URL (it is sent unquoted) while "<kind>/<name>" before it still names a
    checkpoint: a server refuses that (it turned an unpublish into a delete), and no
    checkpoint name holds a "?"."""
    head = str(checkpoint_id).split("#", 1)[0]
    if "?" not in head:
        return None
    route, query = head.split("?", 1)
    parts = route.split("/")
    if len(parts) != 2 or "" in parts:
        return None
    return refusal(
        400,
        f"checkpoint {route}: unexpected query string {query!r:.60}; a checkpoint name cannot "
        f"contain '?' or '#': check the tinker path (checkpoint_id={checkpoint_id!r:.60})",
    )


def not_an_id(what: str, **args: object) -> Exception | None:
    """`NotFoundError` for the first of ``args`` that is not a string: the SDK's request
    names the ``str()`` of it, which is no ``what`` (a training run, a sampler...)."""
    for name, value in args.items():
        if not isinstance(value, str):
            return refusal(
                404,
                f"unknown {what} {value!r:.60}: {name} must be a str, got {type(value).__name__}",
            )
    return None


def empty(**args: object) -> Exception | None:
    """`ValueError` for the first of ``args`` that is empty (or otherwise false), which the
    SDK refuses before building the URL."""
    for name, value in args.items():
        if not value:
            return ValueError(f"Expected a non-empty value for `{name}` but received {value!r:.60}")
    return None


def unencodable(where: str, name: str, value: object) -> Exception | None:
    """The error of encoding ``value`` in a JSON body, as the SDK meets it before sending
    (bytes, a set: `TypeError`; NaN or infinity: `ValueError`), naming the field."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        return type(e)(f"{where}: {name}={value!r:.60} cannot be sent as JSON: {e}")
    return None


def body_str(where: str, name: str, value: object) -> Exception | None:
    """A JSON body field that must be a string: the encoder's error for a value JSON cannot
    carry (`unencodable`), else a server's 400 naming the field for another non-string."""
    if isinstance(value, str):
        return None
    return unencodable(where, name, value) or refusal(
        400,
        f"{where}: field {name!r}: Input should be a valid string "
        f"(got {type(value).__name__} {value!r:.60})",
    )


def first(*problems: Exception | None) -> Exception | None:
    """The first of ``problems`` that is one (the order the SDK and a server meet them)."""
    return next((p for p in problems if p is not None), None)


def _named(args: dict[str, object]) -> str:
    return ", ".join(f"{name}={value!r:.60}" for name, value in args.items())
