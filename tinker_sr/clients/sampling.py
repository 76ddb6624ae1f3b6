"""`SamplingClient`: sample completions and score prompts on one sampler."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import random
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

from tinker_sr import types, validation
from tinker_sr.clients import sr_lowering
from tinker_sr.clients.holder import (
    ClientSession,
    blocking_result,
    deprecated_call,
    make_backend,
)
from tinker_sr.futures import BackcompatConcurrentFuture
from tinker_sr.user_errors import official_sdk_hint

T = TypeVar("T")
_MAX_RETRIES = 8  # transient failures retried per call before the error is raised
_TOKENIZER_LOOKUP_S = 10.0  # how long get_tokenizer waits for the server's tokenizer id

if TYPE_CHECKING:
    from tinker_sr.lib.retry_handler import RetryConfig


class SamplingClient:
    """Samples from a fixed set of weights. Belongs to the session of the client that made it,
    so its ``sequence_id``s are usable for provenance by that session's training clients.

    With ``record_stability_info=True`` every sample is recorded for StableReinforce: the
    prompt, the sampled tokens, their logprobs and K=8 draws per sampled position.
    """

    def __init__(
        self,
        holder: ClientSession,
        sampler_id: str,
        *,
        base_model: str,
        record_stability_info: bool = False,
        retry_config: RetryConfig | None = None,
        seq_base: int = 0,
        tokenizer_id: str | None = None,
    ) -> None:
        self.holder = holder
        self.sampler_id = sampler_id
        self._base_model = base_model
        # The service's tokenizer id when known (a sampler made from a training client).
        self._tokenizer_id = tokenizer_id
        self._tokenizer_asked = False  # of the server, by `get_tokenizer`
        self.record_stability_info = bool(record_stability_info)
        self.retry_config = retry_config  # honoured by every sample call (_retrying)
        self._gate: asyncio.Semaphore | None = None
        self._seq = itertools.count(seq_base)
        self._lock = threading.Lock()

    @property
    def _sampling_session_id(self) -> str:
        """The SDK keeps the sampler's id under this private name, and tools built on the SDK
        read it (tinker-cookbook's ``capture`` tags every recorded sample with it)."""
        return self.sampler_id

    def __repr__(self) -> str:
        return (
            f"SamplingClient(sampler_id={self.sampler_id!r}, base_model={self._base_model!r}, "
            f"record_stability_info={self.record_stability_info})"
        )

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> BackcompatConcurrentFuture[types.SampleResponse]:
        """``num_samples`` independent completions of ``prompt``; every sequence carries its
        ``sequence_id``, tokens and sampled-token logprobs."""
        self.holder.check_open()
        _refuse_official_types(prompt, sampling_params)
        # Coerce and check as the official SDK does (it builds this request model first):
        # num_samples "2" -> 2, a dict of sampling params accepted, a list prompt refused.
        req = types.SampleRequest(
            num_samples=num_samples, prompt=prompt, sampling_params=sampling_params
        )
        num_samples, prompt, sampling_params = req.num_samples, req.prompt, req.sampling_params
        validation.check_text(sampling_params.stop, "sampling_params.stop")
        _check_prompt_extras(
            target_prompt_logprobs,
            prompt_alt_tokens_k,
            prompt_logprobs_last_n,
            include_prompt_logprobs,
        )
        seq_id = self._next_seq()
        backend = self.holder.backend
        # StableReinforce lowering keeps what it needs of these samples client-side.
        lowering = sr_lowering.session_of(self.holder)
        plan = lowering.plan_sample(
            self.record_stability_info, sampling_params, topk_sample_logprobs
        )
        holder = self.holder

        seq_ids = [seq_id]  # a retry (without the top-k the lowering added) takes a new one

        async def sample(topk: int) -> types.SampleResponse:
            seq = seq_ids.pop() if seq_ids else self._next_seq()
            return await self._retrying(  # transient failures retry the same seq
                lambda: backend.sample(
                    self.sampler_id,
                    seq,
                    prompt=prompt,
                    num_samples=num_samples,
                    sampling_params=sampling_params,
                    include_prompt_logprobs=include_prompt_logprobs,
                    topk_prompt_logprobs=topk_prompt_logprobs,
                    topk_sample_logprobs=topk,
                    target_prompt_logprobs=target_prompt_logprobs,
                    prompt_alt_tokens_k=prompt_alt_tokens_k,
                    prompt_logprobs_last_n=prompt_logprobs_last_n,
                    record_stability_info=self.record_stability_info,
                )
            )

        async def run() -> types.SampleResponse:
            problem = validation.non_finite(sampling_params, "sampling_params")
            if problem is not None:  # as the SDK fails to send it (JSON cannot carry it)
                raise ValueError(problem)
            response = await lowering.sample(plan, sample)
            if not plan.keep:
                return response
            session_id = await holder.session_id()
            return await lowering.record_sample(
                plan, session_id, prompt, sampling_params, response, self._raw_topk
            )

        return BackcompatConcurrentFuture(self.holder.run(run()))

    # What `compute_logprobs` calls, as the official SDK calls its private implementation: a
    # wrapper a user (or tinker-cookbook's capture and trace) puts on the public `sample`
    # sees only the caller's samples, not the one-token request behind each compute_logprobs.
    _sample_impl = sample

    def _next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    async def _raw_topk(self, tokens: list[int], k: int) -> types.TopkLogprobs | None:
        """The model's top-k next-token log-probs at every position of ``tokens`` (for
        client-side StableReinforce draws when the service returns no sample top-k)."""
        r = await self.holder.backend.sample(
            self.sampler_id,
            self._next_seq(),
            prompt=types.ModelInput.from_ints(tokens),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=1),
            topk_prompt_logprobs=k,
        )
        return r.topk_prompt_logprobs_np

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` under this client's `RetryConfig` (the default one when None, as in the
        official SDK): at most ``max_connections`` at once, transient errors retried with
        jittered exponential backoff, and a call with no answer for ``progress_timeout``
        seconds reported as stuck. Retries reuse the request's seq_id: the service answers a
        repeated (sampler, seq_id) with the same result, so nothing is sampled twice."""
        import httpx

        from tinker_sr.errors import APIConnectionError, APIStatusError
        from tinker_sr.lib.retry_handler import RetryConfig, is_retryable_status_code

        cfg = self.retry_config or RetryConfig()
        if self._gate is None and cfg.max_connections is not None:
            self._gate = asyncio.Semaphore(cfg.max_connections)
        attempt = 0
        while True:
            try:
                async with self._gate or contextlib.nullcontext():
                    if not cfg.enable_stuck_detection:
                        return await call()
                    try:
                        return await asyncio.wait_for(call(), cfg.progress_timeout)
                    except TimeoutError:
                        raise APIConnectionError(
                            httpx.Request("POST", "sample"),
                            f"No progress for {cfg.progress_timeout} s. Requests appear to be "
                            "stuck.",
                        ) from None
            except Exception as e:
                transient = isinstance(e, cfg.retryable_exceptions) or (
                    isinstance(e, APIStatusError) and is_retryable_status_code(e.status_code)
                )
                if not (cfg.enable_retry_logic and transient) or attempt >= _MAX_RETRIES:
                    raise
            delay = min(cfg.retry_delay_base * 2**attempt, cfg.retry_delay_max)
            await asyncio.sleep(delay * (1 + cfg.jitter_factor * random.random()))
            attempt += 1

    def compute_logprobs(
        self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None
    ) -> BackcompatConcurrentFuture[list[float | None]]:
        """Log-probability of each prompt token given the ones before it (entry 0 is None)."""
        _refuse_official_types(prompt)
        inner = self._sample_impl(
            prompt,
            1,
            types.SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
        )

        async def run() -> list[float | None]:
            r = await inner
            assert r.prompt_logprobs is not None
            return list(r.prompt_logprobs)

        return BackcompatConcurrentFuture(self.holder.run(run()))

    def get_base_model(self) -> str:
        return self._base_model

    def get_tokenizer(self) -> Any:
        """The model's own tokenizer (see `tinker_sr.clients.tokenizers`); raises if it cannot
        be found rather than returning another one."""
        from tinker_sr.clients.tokenizers import tokenizer_for

        lookup = getattr(self.holder.backend, "sampler_tokenizer_id", None)
        if self._tokenizer_id is None and lookup is not None and not self._tokenizer_asked:
            self._tokenizer_asked = True  # once: a server without the field answers None
            try:  # a tinker_sr server names the served model's (an alias's target's)
                found = self.holder.run(lookup(self.sampler_id))
                self._tokenizer_id = blocking_result(found, timeout=_TOKENIZER_LOOKUP_S)
            except Exception:  # unreachable, too slow, on the SDK's loop: by name, as the SDK
                pass
        return tokenizer_for(self.holder.backend, self._base_model, self._tokenizer_id)

    def get_telemetry(self) -> None:
        """Always ``None``: tinker_sr collects and sends no telemetry (out of scope)."""
        return None

    # ---- deprecated coroutine twins ---------------------------------------------------------
    @deprecated_call("sample_async is deprecated; await sample() instead")
    async def sample_async(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> types.SampleResponse:
        """Deprecated: ``await sample(...)``."""
        return await self.sample(
            prompt,
            num_samples,
            sampling_params,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_logprobs=target_prompt_logprobs,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
        )

    @deprecated_call("compute_logprobs_async is deprecated; await compute_logprobs() instead")
    async def compute_logprobs_async(
        self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None
    ) -> list[float | None]:
        """Deprecated: ``await compute_logprobs(...)``."""
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n=prompt_logprobs_last_n)

    @deprecated_call("get_base_model_async is deprecated; use get_base_model()")
    async def get_base_model_async(self) -> str:
        return self._base_model

    # ---- handles and pickling ----------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "sampler_id": self.sampler_id,
            "base_model": self._base_model,
            "tokenizer_id": self._tokenizer_id,
            "record_stability_info": self.record_stability_info,
            "base_url": self.holder.base_url,
            "holder_key": self.holder.key,
            "pid": os.getpid(),
            "session_id": self.holder._session_id,
        }

    def get_sampler_handle(self) -> str:
        """A URL-safe string (no credentials) that `from_sampler_handle` turns back into a
        client for the same sampler, in the same session."""
        return base64.urlsafe_b64encode(json.dumps(self._state()).encode()).decode()

    @staticmethod
    def from_sampler_handle(handle: str, *, api_key: str | None = None) -> SamplingClient:
        try:
            state = json.loads(base64.urlsafe_b64decode(handle))
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a sampler handle: {e}") from e
        return _rebuild(state, api_key)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # As the official SDK's pickle: with the key (a handle carries none), so a worker
        # process reaches the sampler as the same user; a server ties sessions to keys.
        return (_unpickle, ({**self._state(), "api_key": _pickled_key(self.holder)},))


class _ElsewhereSession:
    """The session of an embedded-engine `SamplingClient` unpickled in another process: it
    cannot reach that engine, so using the client raises. (Raising while unpickling killed a
    process pool's worker, and its parent saw only ``BrokenProcessPool``; raised when used, the
    error reaches ``future.result()``.) Pickling such a clone again, or its repr, still work."""

    base_url = None
    api_key = None
    key = -1  # in no process's registry
    _session_id = None
    closed = False

    def check_open(self) -> NoReturn:
        raise RuntimeError(
            "This SamplingClient runs on the embedded engine of the process that created it "
            "and cannot be used in another process. For multi-process sampling run a server "
            "(`tinker-sr serve`) and create clients with base_url=..."
        )

    @property
    def backend(self) -> NoReturn:
        self.check_open()

    def run(self, coro: Any) -> NoReturn:
        coro.close()
        self.check_open()


def _pickled_key(holder: Any) -> str | None:
    """The key a remote client's requests carry (resolved from the environment or a store
    when it was not passed), for its pickle; None on the embedded engine."""
    if not isinstance(holder, ClientSession) or not holder.base_url:
        return None
    return getattr(holder.backend, "_api_key", None) or holder.api_key


def _unpickle(state: dict[str, Any]) -> SamplingClient:
    return _rebuild(state, state.get("api_key"))


def _rebuild(state: dict[str, Any], api_key: str | None) -> SamplingClient:
    # A clone numbers its requests in its own range so they never collide with the original's.
    seq_base = random.randint(1, 10**9) * 1_000_000_000
    base_url = state.get("base_url")
    same_process = state.get("pid") == os.getpid()  # a key means nothing in another process
    found = ClientSession.lookup(int(state["holder_key"])) if same_process else None
    if found is not None and found.base_url == base_url and not found.closed:
        holder = found  # same process: keep using the creating client's connection
    elif base_url:
        # Another process: talk to the same server with this process's credentials.
        backend, url = make_backend(backend="remote", base_url=base_url, api_key=api_key)
        holder = ClientSession(backend, base_url=url, api_key=api_key, owns_backend=True)
        holder._session_id = state.get("session_id")
    elif found is not None:  # this process's embedded engine, its ServiceClient closed
        raise RuntimeError("ServiceClient is closed: its embedded SamplingClients end with it")
    else:
        holder = cast(ClientSession, _ElsewhereSession())
    return SamplingClient(
        holder,
        state["sampler_id"],
        base_model=state["base_model"],
        record_stability_info=state["record_stability_info"],
        seq_base=seq_base,
        tokenizer_id=state.get("tokenizer_id"),
    )


def _refuse_official_types(*args: object) -> None:
    """A prompt or sampling parameters of the official SDK's types: a TypeError that says so
    and names the fix (pydantic's own error says only that the input is not a ModelInput)."""
    for arg in args:
        if hint := official_sdk_hint(arg):
            raise TypeError(f"{type(arg).__name__} from another library{hint}")


def _check_prompt_extras(
    target_prompt_logprobs: types.TensorData | None,
    prompt_alt_tokens_k: int,
    prompt_logprobs_last_n: int | None,
    include_prompt_logprobs: bool,
) -> None:
    """`SamplingClient.sample`'s checks of its prompt-side options, as the official SDK's."""
    if target_prompt_logprobs is not None:
        if target_prompt_logprobs.dtype != "int64":
            raise ValueError("target_prompt_logprobs must have dtype int64")
        shape = target_prompt_logprobs.shape
        if shape is None or len(shape) != 2:
            raise ValueError("target_prompt_logprobs must be 2-D: [len(prompt) - 1, K]")
    if prompt_alt_tokens_k < 0:
        raise ValueError(f"prompt_alt_tokens_k must be >= 0, got {prompt_alt_tokens_k}")
    if prompt_logprobs_last_n is not None:
        if prompt_logprobs_last_n < 1:
            raise ValueError(f"prompt_logprobs_last_n must be >= 1, got {prompt_logprobs_last_n}")
        if not include_prompt_logprobs:
            raise ValueError("prompt_logprobs_last_n requires include_prompt_logprobs=True")
