"""The Tinker wire protocol (as the official SDK 0.38 speaks it) in front of any `Backend`, as
a Starlette app.

No training logic lives here: every handler (`server.handlers`) decodes its body with
`tinker_sr.wire`, checks ownership (`server.sessions`), calls the backend and encodes the
answer. Long operations become futures (`server.futures`): the submission answers
``{"request_id", ...}`` at once, the backend call runs in a background task, and
``retrieve_future`` long-polls for the encoded result (JSON, or protobuf for forward/backward
and sample results). HTTP framing (auth, bodies, zstd, error mapping) is `server.http`;
seq_ids that never reach the backend are released by `server.ordering`. This module holds
the routes, the lifespan and `create_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tinker_sr.backend.base import Backend, WorkNotStarted
from tinker_sr.limits import DEFAULT_LIMITS
from tinker_sr.wire import messages as m

from . import anthropic_format, downloads, http
from .defaults import (
    DEFAULT_LOGPROBS_MODE,
    DEFAULT_LONG_POLL_S,
    DEFAULT_SAMPLE_ABANDON_S,
    DEFAULT_SESSION_TIMEOUT_S,
    LOGPROBS_MODES,
)
from .features import ServerFeatures
from .futures import Background, Futures
from .handlers import anthropic, oai, rest, sampling, session, training
from .oai_format import error_reply
from .ordering import SeqWatcher
from .sessions import Sessions
from .state import ServerState
from .tokenizers import TokenizerIds
from .unseeded import UnseededSeeds

__all__ = [
    "create_app",
    "TinkerServer",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_LONG_POLL_S",
    "DEFAULT_MAX_PENDING_SAMPLES",
    "DEFAULT_SESSION_TIMEOUT_S",
]

log = logging.getLogger("tinker_sr.server")

DEFAULT_MAX_BODY_BYTES = DEFAULT_LIMITS.max_body_bytes  # tinker_sr/limits.py: one place
"""Well above the SDK's forward_backward chunk size (5 MB estimated per request)."""


_PRUNE_EVERY_S = 3600.0
_PAUSE_S = 5.0  # a quiet-session check this late means the server itself did not run
DEFAULT_MAX_PENDING_SAMPLES = 64
"""asample requests allowed to be pending or running at once; above it asample answers 429
(the SDK waits, throttles and resubmits the same seq_id, spec §8.3)."""
DEFAULT_SEQ_GAP_GRACE_S = 5.0
"""How long a model's later request waits for a missing earlier seq_id before the server
decides that request was refused or lost and skips its number."""

T = TypeVar("T")


class TinkerServer:
    """What the handlers share: the backend, the server state, futures, ordering, sessions
    and tokenizer ids; `create_app` wraps it in a Starlette app."""

    def __init__(
        self,
        backend: Backend,
        *,
        store_dir: Path | None,
        api_keys: Sequence[str] | None,
        max_body_bytes: int,
        long_poll_s: float,
        close_backend: bool,
        seq_gap_grace_s: float = DEFAULT_SEQ_GAP_GRACE_S,
        max_pending_samples: int = DEFAULT_MAX_PENDING_SAMPLES,
        session_timeout_s: float | None = DEFAULT_SESSION_TIMEOUT_S,
        sample_abandon_s: float | None = DEFAULT_SAMPLE_ABANDON_S,
        features: ServerFeatures | None = None,
        file_download_urls: bool = False,
        logprobs_mode: str = DEFAULT_LOGPROBS_MODE,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode {logprobs_mode!r}: one of {', '.join(LOGPROBS_MODES)} (vLLM's)"
            )
        self.logprobs_mode = logprobs_mode  # the OpenAI-compatible routes' log-probs
        self.backend = backend
        self.file_download_urls = file_download_urls
        self.features = features or ServerFeatures()
        self.store_dir = store_dir
        self.api_keys = [k.encode() for k in api_keys or () if k]
        self.max_body_bytes = max_body_bytes
        self.close_backend = close_backend
        self.state = ServerState(store_dir / "server.sqlite" if store_dir is not None else None)
        self.background = Background()
        self.futures = Futures(
            self.state,
            self.background,
            long_poll_s=long_poll_s,
            max_pending_samples=max_pending_samples,
        )
        self.seqs = SeqWatcher(self.state, backend, self.background, seq_gap_grace_s)
        self.sessions = Sessions(
            self.state, backend, session_timeout_s, self.futures, sample_abandon_s
        )
        self.tokenizers = TokenizerIds(backend, store_dir)
        self.signer = downloads.UrlSigner(downloads.load_key(store_dir))
        self.oai = oai.OaiSamplers(self)
        self.stopping = False  # a graceful stop began (`begin_stop`)
        self.unseeded: UnseededSeeds | None = None  # `create_app(seed_unseeded=)`
        self._answering: set[asyncio.Task[object]] = set()  # OpenAI / Anthropic answers
        self._stopped: set[asyncio.Task[object]] = set()  # those a graceful stop cancelled

    @property
    def _pending_samples(self) -> set[str]:
        """Request ids of asample work not yet done (tests watch it)."""
        return self.futures.pending_samples

    # ---- lifecycle -----------------------------------------------------------------------
    async def startup(self) -> None:
        orphans = self.state.fail_orphans()
        if orphans:
            log.warning("failed %d request(s) left pending by a previous server process", orphans)
        self.state.prune()
        self.background.spawn(self._prune_periodically())

    async def _prune_periodically(self) -> None:
        tick = _PRUNE_EVERY_S
        for quiet in (self.sessions.timeout_s, self.sessions.sample_abandon_s):
            if quiet is not None:
                tick = min(tick, max(quiet / 4, 0.01))
        last_prune = time.monotonic()
        while True:
            before = time.monotonic()
            await asyncio.sleep(tick)
            if (late := time.monotonic() - before - tick) > max(tick, _PAUSE_S):
                # This process was paused (SIGSTOP, a frozen container or VM): its clients'
                # heartbeats wait in its sockets, unread. Time it did not run does not count
                # as theirs to be quiet, and this round waits for them (before: a server
                # stopped for 40 s cancelled every live client's samples as it woke, hunt).
                # A suspended machine's monotonic clock stands still: nothing to discount.
                self.sessions.paused(late)
                continue
            try:
                self.sessions.stop_abandoned_samples()
                await self.sessions.expire_quiet()
            except Exception:
                log.exception("expiring quiet sessions failed")
            if time.monotonic() - last_prune >= _PRUNE_EVERY_S:
                last_prune = time.monotonic()
                try:
                    self.state.prune()
                except Exception:
                    log.exception("pruning old futures failed")

    async def begin_stop(self) -> bool:
        """The first step of a graceful stop (SIGTERM, Ctrl-C; called again, harmless): long
        polls answer now, OpenAI and Anthropic answers being sampled end as refused (503; an
        error event where a stream has begun: before, uvicorn cut them with a traceback each
        once its 5 s of grace ran out), and a backend of the server's own starts no more
        queued work (so none starts while uvicorn waits for open connections). Whether the
        backend can."""
        self.futures.stop_waiting()
        self.stopping = True
        for task in list(self._answering):
            self._stopped.add(task)
            task.cancel()
        stop_starting = getattr(self.backend, "stop_starting", None)
        if not self.close_backend or stop_starting is None:
            return False
        await stop_starting()
        return True

    async def shutdown(self) -> None:
        if await self.begin_stop():
            await self.futures.finish_running()
        await self.background.cancel_all()
        self.futures.flush_kept()
        if self.close_backend:
            await self.backend.aclose()
        self.state.close()

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Around an OpenAI or Anthropic answer's sampling: a graceful stop cancels it, and it
        ends as `WorkNotStarted` (a 503 saying the server is stopping). Cancelled otherwise
        (its client left, even during a stop), it ends cancelled: nothing reads its result."""
        if self.stopping:
            raise WorkNotStarted("the server is stopping")
        task = asyncio.current_task()
        assert task is not None
        self._answering.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._stopped:  # its client left: cancelled as before
                raise
            task.uncancel()
            raise WorkNotStarted("the server is stopping") from None
        finally:
            self._answering.discard(task)
            self._stopped.discard(task)

    # ---- request helpers -----------------------------------------------------------------
    def owner(self, request: Request) -> str:
        return http.owner_of(request, self.api_keys)

    def oai_owner(self, request: Request) -> str:
        """The caller of an OpenAI-compatible route: its key as OpenAI clients send it."""
        return http.owner_of(request, self.api_keys, bearer=True)

    async def body(self, request: Request) -> bytes:
        return await http.read_body(request, self.max_body_bytes)

    async def parse(self, request: Request, model: type[T], what: str) -> tuple[T, bytes]:
        body = await self.body(request)
        return m.parse(model, m.parse_json(body, what), what), body  # type: ignore[type-var]

    # ---- routes --------------------------------------------------------------------------
    def _endpoint(
        self,
        fn: Handler,
        *,
        auth: bool = True,
        owner: Callable[[Request], str] | None = None,
        reply: http.ErrorReply = http.error,
    ) -> Endpoint:
        """``fn`` as a route: the caller by ``owner`` (default: the Tinker API's X-API-Key;
        ``auth=False``: none), errors written by ``reply``."""

        async def bound(request: Request, owner: str) -> Response:
            return await fn(self, request, owner)

        return http.endpoint(bound, (owner or self.owner) if auth else None, reply=reply)

    def _oai_endpoint(self, fn: Handler, reply: http.ErrorReply = error_reply) -> Endpoint:
        return self._endpoint(fn, owner=self.oai_owner, reply=reply)

    def oai_routes(self) -> list[Route]:
        """OpenAI-compatible inference (`handlers.oai`), where Tinker serves it."""
        o, v = self._oai_endpoint, "/oai/api/v1"
        return [
            Route(v + "/completions", o(oai.completions), methods=["POST"]),
            Route(v + "/chat/completions", o(oai.chat_completions), methods=["POST"]),
            Route(v + "/models", o(oai.models), methods=["GET"]),
            Route(v + "/{rest:path}", o(oai.unsupported), methods=["GET", "POST", "PUT", "DELETE"]),
        ]

    def anthropic_routes(self) -> list[Route]:
        """Anthropic-compatible inference (`handlers.anthropic`), where Tinker serves it."""
        v = "/anthropic/api/v1"

        def a(fn: Handler) -> Endpoint:
            return self._oai_endpoint(fn, anthropic_format.error_reply)

        return [
            Route(v + "/messages", a(anthropic.messages), methods=["POST"]),
            Route(v + "/messages/count_tokens", a(anthropic.count_tokens), methods=["POST"]),
            Route(
                "/anthropic/{rest:path}",
                a(anthropic.unsupported),
                methods=["GET", "POST", "PUT", "DELETE"],
            ),  # fmt: skip
        ]

    def routes(self) -> list[Route]:
        e = self._endpoint
        v = "/api/v1"
        post = ["POST"]
        ckpt = v + "/training_runs/{run_id}/checkpoints/{kind}/{name}"
        any_method = ["GET", "POST", "PUT", "DELETE"]
        return [
            Route(v + "/healthz", e(rest.healthz, auth=False), methods=["GET"]),
            Route(v + "/client/config", e(session.client_config), methods=post),
            Route(v + "/client/dynamic_config", e(session.dynamic_config), methods=post),
            Route(v + "/create_session", e(session.create_session), methods=post),
            Route(v + "/session_heartbeat", e(session.heartbeat), methods=post),
            Route(v + "/sessions/{session_id}/finish", e(session.finish_session), methods=post),
            Route(v + "/sessions", e(session.list_sessions), methods=["GET"]),
            Route(v + "/sessions/{session_id}", e(session.get_session), methods=["GET"]),
            Route(v + "/telemetry", e(session.telemetry), methods=post),
            Route(v + "/create_model", e(training.create_model), methods=post),
            Route(v + "/get_info", e(training.get_info), methods=post),
            Route(v + "/forward_backward", e(training.forward_backward), methods=post),
            Route(v + "/optim_step", e(training.optim_step), methods=post),
            Route(v + "/save_weights", e(training.save_weights), methods=post),
            Route(
                v + "/save_weights_for_sampler",
                e(training.save_weights_for_sampler),
                methods=post,
            ),
            Route(v + "/save_weights_external", e(training.save_weights_external), methods=post),
            Route(v + "/load_weights", e(training.load_weights), methods=post),
            Route(
                v + "/create_sampling_session",
                e(sampling.create_sampling_session),
                methods=post,
            ),
            Route(v + "/samplers/{sampler_id}", e(sampling.get_sampler), methods=["GET"]),
            Route(v + "/asample", e(sampling.asample), methods=post),
            Route(v + "/retrieve_future", e(session.retrieve_future), methods=post),
            Route(v + "/cancel_future", e(session.cancel_future), methods=post),
            Route(v + "/get_server_capabilities", e(rest.capabilities), methods=["GET"]),
            Route(v + "/weights_info", e(rest.weights_info), methods=post),
            Route(v + "/copy_weights", e(rest.copy_weights), methods=post),
            Route(v + "/checkpoints", e(rest.list_user_checkpoints), methods=["GET"]),
            Route(v + "/training_runs", e(rest.list_training_runs), methods=["GET"]),
            Route(v + "/training_runs/{run_id}", e(rest.get_training_run), methods=["GET"]),
            Route(
                v + "/training_runs/{run_id}/checkpoints",
                e(rest.list_checkpoints),
                methods=["GET"],
            ),
            Route(ckpt, e(rest.delete_checkpoint), methods=["DELETE"]),
            Route(
                v + "/training_runs/{run_id}/checkpoints/{checkpoint_id}",
                e(rest.checkpoint_id_without_kind),
                methods=any_method,
            ),
            Route(ckpt + "/ttl", e(rest.set_checkpoint_ttl), methods=["PUT"]),
            Route(ckpt + "/publish", e(rest.publish), methods=["POST", "DELETE"]),
            Route(ckpt + "/external_weights_urls", e(rest.external_weights_urls), methods=["GET"]),
            Route(
                downloads.ROUTE + "/{run_id}/{name}/{file}",
                e(rest.external_weights_file, auth=False),
                methods=["GET"],
            ),
            Route(v + "/billing/usage/events", e(rest.billing_usage), methods=["GET"]),
            Route(
                v + "/billing/usage/checkpoints/current",
                e(rest.checkpoint_storage_usage),
                methods=["GET"],
            ),
            Route(v + "/{rest:path}", e(rest.unsupported), methods=any_method),
            *self.oai_routes(),
            *self.anthropic_routes(),
        ]


Handler = Callable[[TinkerServer, Request, str], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def _check_limits(
    max_pending_samples: int,
    max_body_bytes: int,
    session_timeout_s: float | None,
    sample_abandon_s: float | None,
) -> None:
    if max_pending_samples < 1:
        raise ValueError(f"max_pending_samples must be at least 1, got {max_pending_samples}")
    quiet_limits = {"session_timeout_s": session_timeout_s, "sample_abandon_s": sample_abandon_s}
    for name, quiet in quiet_limits.items():
        if quiet is not None and quiet <= 0:
            raise ValueError(f"{name} must be positive (or None), got {quiet}")
    if max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes must be at least 1024, got {max_body_bytes}")
    if sample_abandon_s is not None and sample_abandon_s < 30:
        log.warning(
            "sample_abandon_s=%g is under 3 of the SDK's 10 s heartbeat periods: live clients' "
            "sample requests will be cancelled as abandoned", sample_abandon_s,
        )  # fmt: skip


async def _http_error(request: Request, exc: Exception) -> Response:
    """A 404 or 405 in the format of the route family asked for."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    reply = (
        error_reply
        if path.startswith("/oai/")
        else anthropic_format.error_reply
        if path.startswith("/anthropic/")
        else http.error
    )
    return reply(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")


def create_app(
    backend: Backend,
    *,
    api_keys: Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    store_dir: str | os.PathLike[str] | None = None,
    long_poll_s: float = DEFAULT_LONG_POLL_S,
    close_backend: bool = False,
    seq_gap_grace_s: float = DEFAULT_SEQ_GAP_GRACE_S,
    max_pending_samples: int = DEFAULT_MAX_PENDING_SAMPLES,
    session_timeout_s: float | None = DEFAULT_SESSION_TIMEOUT_S,
    sample_abandon_s: float | None = DEFAULT_SAMPLE_ABANDON_S,
    features: ServerFeatures | None = None,
    file_download_urls: bool = False,
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE,
    seed_unseeded: int | None = None,
) -> Starlette:
    """The ASGI app serving ``backend`` over the Tinker wire protocol.

    ``api_keys``: accept only these X-API-Key values (else any key starting with ``tml-``).
    ``store_dir``: where ``server.sqlite`` and tokenizer files go; defaults to the backend's
    ``store_dir`` attribute, else state is kept in memory. ``close_backend``: call
    ``backend.aclose()`` at shutdown (when the app owns the backend). ``seq_gap_grace_s``:
    how long to wait for a missing training seq_id before skipping it.
    ``max_pending_samples``: asample requests of one API key pending or running at once
    before asample answers that key 429 with ``Retry-After: 1``. ``session_timeout_s``: finish
    (as "interrupted") a session quiet this long; ``None`` never expires sessions.
    ``sample_abandon_s``: cancel the sample requests of a session quiet this long (its client
    has gone); ``None`` never does. A finished or expired session's are cancelled at once.
    ``features``: switch StableReinforce support off to play another engine (`ServerFeatures`).
    ``file_download_urls``: answer ``get_external_weights_urls`` with ``file://`` URLs into the
    store instead of signed HTTP ones (for a server in the client's own process, `mock_tinker`,
    whose host no plain HTTP GET can reach). ``logprobs_mode``: one of `LOGPROBS_MODES`.
    ``seed_unseeded``: seed LoRA clients and samples the client left unseeded from this (a
    server for tests: `unseeded`); None draws them at random, as the hosted service does.
    """
    _check_limits(max_pending_samples, max_body_bytes, session_timeout_s, sample_abandon_s)
    if store_dir is None:
        store_dir = getattr(backend, "store_dir", None)
    server = TinkerServer(
        backend,
        store_dir=Path(store_dir) if store_dir is not None else None,
        api_keys=api_keys,
        max_body_bytes=max_body_bytes,
        long_poll_s=long_poll_s,
        close_backend=close_backend,
        seq_gap_grace_s=seq_gap_grace_s,
        max_pending_samples=max_pending_samples,
        session_timeout_s=session_timeout_s,
        sample_abandon_s=sample_abandon_s,
        features=features,
        file_download_urls=file_download_urls,
        logprobs_mode=logprobs_mode,
    )
    if seed_unseeded is not None:
        server.unseeded = UnseededSeeds(seed_unseeded)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.startup()
        try:
            yield
        finally:
            await server.shutdown()

    app = Starlette(
        routes=server.routes(),
        lifespan=lifespan,
        exception_handlers={404: _http_error, 405: _http_error},
    )
    app.state.tinker_server = server
    return app
