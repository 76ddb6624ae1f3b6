"""Machinery shared by the clients: the SDK event-loop thread, backend choice, the session.

Every backend coroutine runs on one process-wide background event loop (like the official
SDK's). Public methods hand back futures over it, so the same client works from plain
scripts (``.result()``), from async code (``await``), and across threads.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread
import contextlib
import functools
import inspect
import itertools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from tinker_sr.backend.base import Backend
from tinker_sr.errors import TinkerError
from tinker_sr.threads import ThreadLimitError, start_thread

T = TypeVar("T")
P = ParamSpec("P")
log = logging.getLogger("tinker_sr")

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None


EXITED = (
    "tinker_sr's clients were stopped as the interpreter exits, and training calls still in "
    "flight were cancelled, so a model's later requests could wait for them forever: an "
    "atexit hook registered before `import tinker_sr` runs after that. Make training calls "
    "before the program ends (against a server, a hook registered after `import tinker_sr` "
    "runs before that; the embedded engine's thread pools are stopped before any atexit hook)"
)
_stopped_at_exit = False  # the exit hook wound the loop down (`check_not_exited`)


def check_not_exited() -> None:
    """Refuse a model's ordered (training) call once the exit hook has cancelled the calls in
    flight: its sequence numbers would wait on theirs. Other calls (sampling, ``close()``)
    start a new loop as before."""
    if _stopped_at_exit:
        raise RuntimeError(EXITED)


def sdk_loop() -> asyncio.AbstractEventLoop:
    """The background event loop all clients of this process share (started on first use)."""
    global _loop, _loop_thread
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            t = threading.Thread(target=run, name="tinker-sr-sdk-loop", daemon=True)
            try:
                start_thread(t, "the clients' event-loop thread")
            except ThreadLimitError:
                loop.close()
                raise
            ready.wait()
            _loop, _loop_thread = loop, t
        return _loop


EXIT_GRACE_S = 5.0  # how long the exit hook lets the SDK loop's cancelled tasks unwind


@atexit.register
def _stop_loop_at_exit() -> None:
    """Stop the SDK loop's thread before the interpreter finalizes: cancel its tasks, let them
    unwind, stop the loop, join the thread, close the loop. A daemon thread still running as
    Python finalizes is killed when it retakes the GIL, and torch releases the GIL inside
    every tensor's deallocation, so the kill could unwind through torch's C++ frames and
    abort the process (`terminate called without an active exception`, exit status 134).
    The loop did free tensors then: the clients of a function's locals are dropped as it
    returns, and ending their session (`_end_dropped`) let go of a whole engine there.
    Atexit hooks run after the engine's worker thread has finished its queued work."""
    global _stopped_at_exit
    loop, thread = _loop, _loop_thread
    if loop is None or thread is None or loop.is_closed() or not thread.is_alive():
        return
    _stopped_at_exit = True

    async def wind_down() -> None:
        deadline = loop.time() + 1.5 * EXIT_GRACE_S  # the caller waits 2 * EXIT_GRACE_S
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=EXIT_GRACE_S)
        # A server's connections of clients never closed: closed here, as collecting them
        # would (`_end_dropped`), or each socket is reported unclosed as Python finalizes
        # (a ResourceWarning: an error under -W error, noise under -X dev).
        endings = [s._ending for s in list(ClientSession._registry.values())]
        endings = [e for e in endings if e.owns_backend and not e.in_process and not e.done]
        for ending in endings:
            ending.done = True
        if endings:  # together, within what is left of this hook's time
            closing = asyncio.gather(*(e.backend.aclose() for e in endings), return_exceptions=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(closing, max(0.0, deadline - loop.time()))

    try:
        asyncio.run_coroutine_threadsafe(wind_down(), loop).result(2 * EXIT_GRACE_S)
        loop.call_soon_threadsafe(loop.stop)
    except (RuntimeError, concurrent.futures.TimeoutError):  # closed meanwhile; stuck
        return
    thread.join(EXIT_GRACE_S)
    if not thread.is_alive():
        loop.close()  # a finalizer run later finds it closed and schedules nothing


def on_sdk_loop_thread() -> bool:
    return _loop_thread is not None and threading.current_thread() is _loop_thread


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Run ``coro`` on the SDK loop; its result or error goes to the returned future."""
    try:
        loop = sdk_loop()
    except BaseException:
        coro.close()  # never run: no "coroutine was never awaited" at exit
        raise
    return asyncio.run_coroutine_threadsafe(_seen(coro), loop)


def _mark_seen(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _seen(coro: Coroutine[Any, Any, T]) -> T:
    """``coro``, its error marked as retrieved: the future `submit` returns carries it. When
    that future was cancelled first (the caller's loop ended: ``asyncio.run`` cancels what is
    left of a ``gather`` whose first error it raised), asyncio would otherwise log "Task
    exception was never retrieved" with a traceback for an error nobody waits for."""
    task = asyncio.current_task()
    if task is not None:
        task.add_done_callback(_mark_seen)
    try:
        return await coro
    except RuntimeError as e:
        exiting = getattr(concurrent.futures.thread, "_shutdown", False)  # set at exit only
        if not exiting or "cannot schedule new futures after" not in str(e):
            raise
        raise RuntimeError(POOLS_STOPPED) from e


POOLS_STOPPED = (
    "the interpreter is exiting: Python stopped its thread pools before running atexit hooks, "
    "and the embedded engine works on them. Make these calls before the program ends"
)


def blocking_result(fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """``fut.result()`` with the official SDK's guard against deadlocking the SDK loop."""
    if not fut.done():
        if on_sdk_loop_thread():
            raise RuntimeError(
                "Blocking on a tinker_sr future from the SDK's own event-loop thread would "
                "deadlock; await it instead (e.g. inside a done-callback, use the callback's "
                "argument)."
            )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            if not _in_notebook():  # a notebook's cells run on its loop: as the official SDK
                log.warning(
                    "Blocking call to .result() at %s while an asyncio event loop is running "
                    "in this thread; use `await` instead to keep the loop responsive.",
                    _caller(),
                )
    return fut.result(timeout)


def _in_notebook() -> bool:
    """Is this a Jupyter kernel (or qtconsole), whose cells run with an event loop running?
    There ``.result()`` is how a cell waits, and the official SDK does not warn about it."""
    import builtins

    shell = getattr(builtins, "get_ipython", None)
    return shell is not None and type(shell()).__name__ in ("ZMQInteractiveShell", "Shell")


def _caller() -> str:
    """``file:line (function)`` of the innermost frame outside tinker_sr: the user's call."""
    import sys

    package = str(Path(__file__).resolve().parents[1]) + os.sep
    frame = sys._getframe(1)
    while frame.f_back is not None and os.path.realpath(frame.f_code.co_filename).startswith(
        package
    ):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


# ---- backend choice -------------------------------------------------------------------------

_local_backends: dict[tuple[Any, ...], Backend] = {}
_local_lock = threading.Lock()


def resolve_base_url(base_url: str | None) -> str | None:
    """``base_url`` argument → ``$TINKER_BASE_URL``; empty counts as unset; trailing / stripped."""
    url = base_url or os.environ.get("TINKER_BASE_URL") or None
    return url.rstrip("/") if url else None


LOCAL_API_KEY = "tml-local"
"""The API key assumed for a server on this machine when none is configured."""


def default_api_key(api_key: str | None, base_url: str | None) -> str | None:
    """``api_key``, else ``$TINKER_API_KEY``, else ``"tml-local"`` when ``base_url`` (already
    resolved) points at this machine: a local tinker_sr server accepts any ``tml-`` key
    unless it was started with ``--api-keys``; else the key ``tinker auth login`` stored
    (`auth.stored_api_key`: never sent to a server on this machine). ``None`` when there is
    none of these."""
    key = api_key or os.environ.get("TINKER_API_KEY") or None
    if key is None and base_url:
        from tinker_sr.backend.transport import is_loopback_url  # a remote client's: loaded then

        if is_loopback_url(base_url):
            return LOCAL_API_KEY
    if key is None:
        from tinker_sr.auth import stored_api_key

        key = stored_api_key()
    return key


def local_backend(store_dir: str | Path | None = None, **options: Any) -> Backend:
    """The process-wide embedded backend for ``store_dir`` (created on first use), so every
    client of the process sees the same models, samplers and recorded sequences."""
    from tinker_sr.backend.local import LocalBackend, default_store_dir

    path = Path(store_dir) if store_dir is not None else default_store_dir()
    key = (str(path.resolve()), tuple(sorted(options.items())))
    with _local_lock:
        backend = _local_backends.get(key)
        if backend is None:
            backend = LocalBackend(path, **options)
            _local_backends[key] = backend
        return backend


def wants_remote(backend: Backend | str | None, base_url: str | None) -> bool:
    """Whether `make_backend` would pick the remote backend for these arguments."""
    if backend is not None and not isinstance(backend, str):
        return False
    choice = backend or os.environ.get("TINKER_SR_BACKEND") or None
    return choice == "remote" or (choice is None and resolve_base_url(base_url) is not None)


NO_SERVER = "backend='remote' needs a server: pass base_url=... or set TINKER_BASE_URL"


def server_url(base_url: str | None) -> str:
    """The server's URL for the remote backend (`resolve_base_url`); none is an error."""
    url = resolve_base_url(base_url)
    if url is None:
        raise TinkerError(NO_SERVER)
    return url


def make_backend(
    *,
    backend: Backend | str | None,
    base_url: str | None,
    api_key: str | None,
    default_headers: Mapping[str, str] | None = None,
    project_id: str | None = None,
) -> tuple[Backend, str | None]:
    """Pick the backend: an explicit one, else remote when a base URL is known, else local.

    ``$TINKER_SR_BACKEND=local`` forces the embedded engine even when ``$TINKER_BASE_URL`` is
    set (handy in CI). A server on this machine needs no configured key (`default_api_key`).
    """
    if backend is not None and not isinstance(backend, str):
        return backend, None
    choice = backend or os.environ.get("TINKER_SR_BACKEND") or None
    url = resolve_base_url(base_url)
    if choice not in (None, "local", "remote"):
        where = "backend" if backend else "$TINKER_SR_BACKEND"
        raise ValueError(f"{where} must be 'local', 'remote' or a Backend instance, got {choice!r}")
    if choice == "local" or (choice is None and url is None):
        return local_backend(), None
    if url is None:
        raise TinkerError(NO_SERVER)
    from tinker_sr.backend.remote import RemoteBackend

    remote = RemoteBackend(
        base_url=url,
        api_key=default_api_key(api_key, url),
        default_headers=dict(default_headers or {}),
        project_id=project_id,
    )
    return remote, url


DROPPED = "every client of this session was dropped without close()"


class _Ending:
    """What ends a session whose clients were all dropped (`_end_dropped`): held apart from
    the `ClientSession`, which its finalizer must not keep alive."""

    def __init__(self, backend: Backend, owns_backend: bool) -> None:
        self.backend = backend
        self.owns_backend = owns_backend
        # An engine in this process (`LocalBackend.in_process`): nothing else can reach its
        # session. A server's session may still be used by other processes (sampler handles).
        self.in_process = bool(getattr(backend, "in_process", False))
        self.session_future: concurrent.futures.Future[str] | None = None
        self.done = False  # closed, or ended once already


def _end_dropped(ending: _Ending) -> None:
    """The finalizer of a `ClientSession` (its ServiceClient and every training, sampling and
    REST client of it are gone, none closed). On an engine in this process: finish the session
    as "interrupted", releasing its trainers and samplers (kept until exit before). On a server:
    close the connection, which stops the heartbeats, so the server expires the session once
    nothing uses it (sampler handles in other processes may still), as when a client process
    dies; the session is not finished from here."""
    if ending.done:
        return
    ending.done = True
    ends_session = ending.in_process and ending.session_future is not None
    if not (ends_session or ending.owns_backend):
        return

    async def end() -> None:
        if ends_session:
            assert ending.session_future is not None
            sid = await asyncio.wrap_future(ending.session_future)
            await ending.backend.close_session(sid, "interrupted", DROPPED)  # type: ignore[arg-type]
        if ending.owns_backend:
            await ending.backend.aclose()

    _from_finalizer(end, "ending a dropped session")


def release_dropped_model(ending: _Ending, model_id: str) -> None:
    """The finalizer of a `TrainingClient` of an engine in this process: nothing else can
    reach its model, so its adapters and optimizer state are freed now, not at the session's
    end (a sweep making a training client per trial in one ServiceClient grew by one model's
    state per trial). Its calls have all finished: each holds the client until it is done."""
    if ending.done or not ending.in_process:  # a session ended frees all of its models
        return
    release = getattr(ending.backend, "release_model", None)
    if release is not None:
        _from_finalizer(lambda: release(model_id), f"freeing dropped model {model_id}")


def _from_finalizer(work: Callable[[], Coroutine[Any, Any, None]], what: str) -> None:
    """Run ``work()`` on the SDK loop, from a finalizer: it runs inside garbage collection,
    on any thread and at any allocation, maybe while that thread holds `_loop_lock`, so the
    running loop is taken as it is, never the lock."""

    def report(fut: concurrent.futures.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("%s failed: %r", what, fut.exception())

    loop = _loop
    if loop is None or loop.is_closed():  # no loop, nothing of it left to free
        return
    coro = work()
    try:
        asyncio.run_coroutine_threadsafe(coro, loop).add_done_callback(report)
    except RuntimeError:  # the loop closed meanwhile (interpreter shutdown)
        coro.close()


class ClientSession:
    """The client side of one session on a backend (created lazily on first need): its
    backend, key, metadata and id counters, shared by all clients of one ServiceClient.
    (Formerly `ClientSession`; `client.holder` keeps the SDK's attribute name.) When the
    last client holding it is collected without ``close()``, `_end_dropped` ends it."""

    _registry: weakref.WeakValueDictionary[int, ClientSession] = weakref.WeakValueDictionary()
    _ids = itertools.count(1)

    def __init__(
        self,
        backend: Backend,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        user_metadata: Mapping[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        owns_backend: bool = False,
    ) -> None:
        self.backend = backend
        self.base_url = base_url
        self.forked = False  # made before this process was forked from its maker (`_forked`)
        self.api_key = api_key
        self.user_metadata = dict(user_metadata or {})
        self.project_id = project_id
        self.display_name = display_name
        self._owns_backend = owns_backend
        self._session_id: str | None = None
        self._session_future: concurrent.futures.Future[str] | None = None
        self._lock = threading.Lock()
        self._model_seq = itertools.count(0)
        self._sampling_seq = itertools.count(0)
        self._ending = _Ending(backend, owns_backend)
        weakref.finalize(self, _end_dropped, self._ending).atexit = False
        self.key = next(self._ids)
        ClientSession._registry[self.key] = self

    @property
    def closed(self) -> bool:
        return self._ending.done

    @closed.setter
    def closed(self, value: bool) -> None:
        self._ending.done = value

    @classmethod
    def lookup(cls, key: int) -> ClientSession | None:
        return cls._registry.get(key)

    def check_open(self) -> None:
        if self.forked:
            raise RuntimeError(FORKED)
        if self.closed:
            raise RuntimeError("ServiceClient is closed")

    def next_model_seq_id(self) -> int:
        return next(self._model_seq)

    def next_sampling_session_seq_id(self) -> int:
        return next(self._sampling_seq)

    def run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the SDK loop, holding this session until it ends: a call made on a
        client dropped at once (``RestClient(...).list_training_runs().result()``) must not
        see its session ended (its connection closed) while it runs."""
        session = self

        async def held() -> T:
            assert session is not None  # a cell of this frame: the session lives as long
            return await coro

        try:
            return submit(held())
        except BaseException:
            coro.close()  # never run (no event-loop thread): no "never awaited" warning
            raise

    async def session_id(self) -> str:
        """Create the session on first need (one creation even under concurrent callers)."""
        if self._session_id is not None:
            return self._session_id
        with self._lock:
            if self._session_future is None:
                tags = [t for t in (os.environ.get("TINKER_TAGS") or "").split(",") if t]
                self._session_future = submit(
                    self.backend.create_session(
                        user_metadata=self.user_metadata,
                        project_id=self.project_id or os.environ.get("TINKER_PROJECT_ID") or None,
                        display_name=self.display_name,
                        tags=sorted(set(tags)),
                    )
                )
                self._ending.session_future = self._session_future
            fut = self._session_future
        self._session_id = await asyncio.wrap_future(fut)
        return self._session_id

    @property
    def has_session(self) -> bool:
        return self._session_future is not None

    async def close(self, status: str, detail: str | None) -> None:
        if self._session_future is not None:
            sid = await asyncio.wrap_future(self._session_future)
            await self.backend.close_session(sid, status, detail)  # type: ignore[arg-type]
        if self._owns_backend:
            await self.backend.aclose()


FORKED = (
    "This client was made before the process forked (os.fork, multiprocessing's default "
    "'fork' start method on Linux); its threads and connections stayed with the parent. "
    "Make clients in the child (a new ServiceClient works there), pass it a pickled "
    "SamplingClient, or use the 'spawn' start method"
)


def _forked() -> None:
    """In a forked child: the parent's threads (the SDK loop's, every engine's) are not here,
    and work handed to them would wait forever. Start afresh (the first use makes a loop and
    engines), and have clients made before the fork say so when used. Nothing of theirs is
    ended from here: their sessions are the parent's."""
    global _loop, _loop_thread, _loop_lock, _local_lock, _stopped_at_exit
    _loop, _loop_thread, _stopped_at_exit = None, None, False
    _loop_lock, _local_lock = threading.Lock(), threading.Lock()
    _local_backends.clear()
    for session in list(ClientSession._registry.values()):
        session.forked = True
        session._ending.done = True  # no finalizer of the child ends the parent's session


os.register_at_fork(after_in_child=_forked)


def shallow_copy(client: T) -> T:
    """``copy.copy`` of a client (its `__reduce__` refuses pickling): the same attributes, as
    the official SDK's clients copy."""
    new = object.__new__(type(client))
    new.__dict__.update(client.__dict__)
    return new


def not_picklable(kind: str) -> TypeError:
    """The error pickling a client that holds its session's connection raises (rather than
    "cannot pickle '_thread.RLock' object")."""
    return TypeError(
        f"a {kind} cannot be pickled: it holds its session's connection and threads. In a "
        "worker process make a ServiceClient of its own, or pass a SamplingClient of a server "
        "(picklable: it carries its key); or pass the paths and ids the worker needs"
    )


def warn_deprecated(msg: str, *, stacklevel: int = 3) -> None:
    warnings.warn(msg, FutureWarning, stacklevel=stacklevel)


def deprecated_call(msg: str) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """A deprecated coroutine method that warns when called, at the caller's line, as the
    SDK's ``@deprecated`` does (warned inside the coroutine, a task's warning named asyncio's
    own file). Its ``__wrapped__`` is the ``async def``, and asyncio sees a coroutine
    function."""

    def wrap(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        def warned(*args: P.args, **kwargs: P.kwargs) -> Awaitable[T]:
            warn_deprecated(msg)  # at the caller's line
            return fn(*args, **kwargs)

        if (mark := getattr(inspect, "markcoroutinefunction", None)) is not None:
            return mark(warned)  # type: ignore[no-any-return]  # Python 3.12+
        warned._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]
        return warned

    return wrap
