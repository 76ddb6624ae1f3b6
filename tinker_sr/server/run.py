"""`serve`: run the server over a `LocalBackend` with uvicorn (blocking)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tinker_sr.engine.cpu import available_cpus, describe_free_memory
from tinker_sr.engine.usage import RateCard
from tinker_sr.exit_with_parent import exit_with_parent
from tinker_sr.limits import DEFAULT_LIMITS, Limits

from .connections import (
    open_file_limit,
    protocol_class,
    quiet_accept_failures,
    raise_open_file_limit,
    request_start_s,
)
from .defaults import (
    DEFAULT_LOGPROBS_MODE,
    DEFAULT_LONG_POLL_S,
    DEFAULT_SAMPLE_ABANDON_S,
    DEFAULT_SESSION_TIMEOUT_S,
)
from .features import ServerFeatures
from .preflight import (
    UnusableAddressError,
    UnusableApiKeyError,
    api_keys_from_env,
    check_address,
    loopback_only,
    open_server_warning,
    preflight,
)

__all__ = [
    "serve",
    "api_keys_from_env",
    "run_uvicorn",
    "check_address",
    "loopback_only",
    "open_server_warning",
    "UnusableAddressError",
    "UnusableApiKeyError",
]


def _announce(
    host: str,
    port: int,
    store_dir: Path,
    keys: Sequence[str] | None,
    features: ServerFeatures | None,
) -> None:
    """The start-up line on stderr: where it listens, whom it accepts, what it runs on."""
    auth = f"{len(keys)} configured API key(s)" if keys else "any API key starting with 'tml-'"
    if features is not None and features.reduced:
        auth += f"; {features.describe()}"
    print(
        f"tinker_sr server: http://{host}:{port} (store {store_dir}, accepting {auth}; "
        f"{available_cpus()} usable CPUs, {describe_free_memory()}, open-file limit "
        f"{open_file_limit()}); OpenAI-compatible API: "
        f"http://{host}:{port}/oai/api/v1, Anthropic-compatible: http://{host}:{port}/anthropic/api",
        file=sys.stderr,
        flush=True,
    )
    if (warning := open_server_warning(host, keys)) is not None:
        print(warning, file=sys.stderr, flush=True)


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    store: str | os.PathLike[str] | None = None,
    api_keys: Sequence[str] | str | None = None,
    max_body_bytes: int = DEFAULT_LIMITS.max_body_bytes,
    log_level: str = "info",
    *,
    long_poll_s: float = DEFAULT_LONG_POLL_S,
    features: ServerFeatures | None = None,
    limits: Limits | None = None,
    model_aliases: Mapping[str, str] | None = None,
    device: str | None = None,
    rate_card: RateCard | None = None,
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE,
    session_timeout_s: float | None = DEFAULT_SESSION_TIMEOUT_S,
    sample_abandon_s: float | None = DEFAULT_SAMPLE_ABANDON_S,
    checked: tuple[list[str] | None, Path] | None = None,
) -> None:
    """Serve a `LocalBackend` on ``host:port`` until interrupted.

    ``store``: directory for sessions, checkpoints, recorded sequences and the server's
    futures (default ``$TINKER_SR_STORE`` or ``~/.cache/tinker_sr``). ``api_keys``: accept
    only these keys (a list or a comma-separated string; default ``$TINKER_SR_API_KEYS``),
    else any key starting with ``tml-``. Binds 127.0.0.1 unless told otherwise.
    ``features``: play an engine without StableReinforce support (`ServerFeatures`). ``limits``:
    the engine's size limits (`tinker_sr.limits.Limits`); its ``max_body_bytes`` wins over the
    ``max_body_bytes`` argument, which is kept for callers that set only that.
    ``model_aliases``: base_model name -> built-in model or local directory; requests may
    name only these (and built-ins), never a directory of their own. ``device``: ``cpu``,
    ``cuda`` or ``auto`` (default ``$TINKER_SR_DEVICE``, else ``cpu``). ``rate_card``: prices
    of the usage it reports (`tinker_sr.engine.usage`; default ``$TINKER_SR_RATE_CARD``).
    ``logprobs_mode``: the OpenAI-compatible routes' log-probs (`create_app`; default
    ``raw_logprobs``, as vLLM's). ``session_timeout_s``, ``sample_abandon_s``: see `create_app`.
    ``checked``: what `preflight` returned for these host, port, keys and store, where the
    caller ran it already (``tinker-sr serve`` does, before its other checks): not run again.
    """
    # before torch and the server load: a refused start is one line at once
    keys, store_dir = checked or preflight(host, port, api_keys, store)
    from tinker_sr.backend.local import LocalBackend

    from .app import create_app

    raise_open_file_limit()
    if limits is None:
        limits = Limits(max_body_bytes=max_body_bytes)
    backend = LocalBackend(
        store_dir=store_dir,
        limits=limits,
        model_aliases=model_aliases,
        request_model_paths=False,
        device=device,
        rate_card=rate_card,
    )
    try:  # StoreInUseError: another live server holds store_dir
        app = create_app(
            backend,
            api_keys=keys,
            max_body_bytes=limits.max_body_bytes,
            store_dir=store_dir,
            long_poll_s=long_poll_s,
            close_backend=True,
            features=features,
            logprobs_mode=logprobs_mode,
            session_timeout_s=session_timeout_s,
            sample_abandon_s=sample_abandon_s,
        )
    except BaseException:
        backend.close()
        raise
    _announce(host, port, store_dir, keys, features)
    _log_to_stderr(log_level)
    run_uvicorn(
        app,
        lambda: app.state.tinker_server,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level in ("debug", "trace"),
    )


def _log_to_stderr(level: str) -> None:
    """The server's own lines (slow requests, recovered futures) on stderr at ``level``, in
    uvicorn's format; before, only warnings reached stderr (Python's last-resort handler)."""
    from uvicorn.logging import DefaultFormatter

    logger = logging.getLogger("tinker_sr")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=False))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())


def run_uvicorn(app: Any, tinker_server: Callable[[], Any], **options: Any) -> None:
    """``uvicorn.run(app, **options)`` (5 s of graceful shutdown), except that on SIGTERM or
    SIGINT ``tinker_server()`` begins to stop first (`TinkerServer.begin_stop`): its long
    polls answer at once (uvicorn waits for open requests before it stops, and a long poll
    would hold it for its whole wait, up to 25 s; cut at 5 s, with a traceback per request,
    for nothing), and no queued work starts while uvicorn waits. Connections that send no
    request are closed, and failing accepts logged quietly (`tinker_sr.server.connections`)."""
    import uvicorn

    class Server(uvicorn.Server):  # type: ignore[misc]
        async def startup(self, sockets: Any = None) -> None:
            quiet_accept_failures(asyncio.get_running_loop())
            await super().startup(sockets)

        async def shutdown(self, sockets: Any = None) -> None:
            await tinker_server().begin_stop()
            await super().shutdown(sockets)

    exit_with_parent()  # a test fixture's server: not beyond its test run
    # asyncio's loop even where uvloop is installed (uvicorn's "auto" takes it): the loop
    # this server is tested on, and the one whose failing accepts `quiet_accept_failures`
    # reports (uvloop reset new connections without a word while out of files).
    defaults = {
        "timeout_graceful_shutdown": 5,
        "http": protocol_class(request_start_s()),
        "loop": "asyncio",
    }
    Server(uvicorn.Config(app, **{**defaults, **options})).run()
