"""`TrainingClient`: forward/backward, optimizer steps, checkpoints, samplers of one model."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from tinker_sr import types, validation
from tinker_sr.clients import chunks, sr_lowering
from tinker_sr.clients.holder import (
    ClientSession,
    blocking_result,
    check_not_exited,
    deprecated_call,
    log,
    not_picklable,
    release_dropped_model,
    shallow_copy,
    warn_deprecated,
)
from tinker_sr.errors import refused_as_400
from tinker_sr.futures import APIFuture, AwaitableConcurrentFuture, run_to_the_end
from tinker_sr.user_errors import official_sdk_hint

if TYPE_CHECKING:
    import torch

    from tinker_sr.clients.creation import BackcompatSamplingClientFuture
    from tinker_sr.clients.custom_loss import LossHandle
    from tinker_sr.clients.sampling import SamplingClient
    from tinker_sr.lib.retry_handler import RetryConfig

T = TypeVar("T")
CustomLossFnV1 = Callable[
    [list[types.Datum], list["torch.Tensor"]], tuple["torch.Tensor", dict[str, float]]
]

LOAD_STATE_DEPRECATED = (  # the SDK's words, which a `pytest.warns(match=...)` may name
    "DEPRECATED: TrainingClient.load_state*() is deprecated and will NOT be supported in "
    "future tinker SDK versions. Migrate now: create a new training client from the "
    "checkpoint with ServiceClient.create_training_client_from_state() or "
    "ServiceClient.create_training_client_from_state_with_optimizer()."
)
_POISONED = (
    "A previous request failed; this TrainingClient is poisoned and cannot accept further requests."
)


def _poisoned_error(cause: BaseException) -> RuntimeError:
    """The poisoned client's error, chained to the failure that poisoned it (as the SDK)."""
    err = RuntimeError(_POISONED)
    err.__cause__ = cause
    return err


class _Turn:
    """A call's place in its model's order: the next call takes numbers once it releases it."""

    def __init__(self, client: TrainingClient, issued: concurrent.futures.Future[None]) -> None:
        self._client = client
        self._issued = issued

    def take(self, n: int) -> list[int]:
        with self._client._lock:
            return [next(self._client._seq) for _ in range(n)]

    def release(self) -> None:
        if not self._issued.done():
            self._issued.set_result(None)


class TrainingClient:
    """Trains one LoRA model. Every call returns at once with a future; calls execute in the
    order they were made (each reserves a sequence number synchronously), so
    ``fb = tc.forward_backward(...); op = tc.optim_step(...)`` then awaiting both is the
    recommended pipelining pattern."""

    def __reduce__(self) -> Any:
        raise not_picklable("TrainingClient")

    def __copy__(self) -> TrainingClient:
        return shallow_copy(self)

    def __init__(self, holder: ClientSession, model_id: str, info: types.GetInfoResponse) -> None:
        self.holder = holder
        self.model_id = model_id
        self._info = info
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._prev_issued: concurrent.futures.Future[None] | None = None  # the last call's
        self._poisoned: BaseException | None = None  # the failure that poisoned it (SDK: first)
        weakref.finalize(self, release_dropped_model, holder._ending, model_id).atexit = False

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r})"

    def _poison(self, failure: BaseException) -> None:
        """Later calls fail, chained to the first failure that poisoned it (as the SDK)."""
        if self._poisoned is None:
            self._poisoned = failure

    # ---- ordered submission --------------------------------------------------------------
    def _submit(
        self, n_seq: int, body: Callable[[list[int]], Awaitable[T]]
    ) -> concurrent.futures.Future[T]:
        """Run ``body`` with the next ``n_seq`` sequence numbers, after earlier calls issued."""

        async def fixed(turn: _Turn) -> T:
            return await body(turn.take(n_seq))

        return self._submit_turn(fixed, release_after_start=True)

    def _submit_turn(
        self, body: Callable[[_Turn], Awaitable[T]], *, release_after_start: bool = False
    ) -> concurrent.futures.Future[T]:
        """Run ``body`` in call order, taking its sequence numbers from the `_Turn` as it goes
        (as many as earlier answers say); the next call starts once it calls
        ``turn.release()`` (or right after it started: ``release_after_start``), or ends."""
        self.holder.check_open()
        check_not_exited()
        # As the SDK: a poisoned client's call returns a future that fails (it does not raise).
        if self._poisoned is not None:
            failed: concurrent.futures.Future[T] = concurrent.futures.Future()
            failed.set_exception(_poisoned_error(self._poisoned))
            return failed
        issued: concurrent.futures.Future[None] = concurrent.futures.Future()
        turn = _Turn(self, issued)

        async def run() -> T:
            try:
                if prev is not None:
                    await asyncio.wrap_future(prev)
                if self._poisoned is not None:
                    raise _poisoned_error(self._poisoned)
                task = asyncio.ensure_future(body(turn))
                task.add_done_callback(lambda _: turn.release())
                # Let the body issue its request before the next call may issue its own.
                await asyncio.sleep(0)
                if release_after_start:
                    turn.release()
            except BaseException:
                turn.release()
                raise
            return await task

        with self._lock:
            prev, self._prev_issued = self._prev_issued, issued
        try:  # once made, a call runs in its turn (as a request on a server) whatever its caller
            return self.holder.run(run_to_the_end(run()))
        except BaseException:  # Ctrl-C before it was queued: later calls must not wait for it
            turn.release()
            raise

    def _api(self, n_seq: int, body: Callable[[list[int]], Awaitable[T]]) -> APIFuture[T]:
        return AwaitableConcurrentFuture(self._submit(n_seq, body))

    # ---- training ---------------------------------------------------------------------
    def forward(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Loss and per-datum outputs without gradients."""
        return self._fb(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Loss, outputs, and gradients accumulated for the next `optim_step`."""
        return self._fb(data, loss_fn, loss_fn_config, forward_only=False)

    def _fb(
        self,
        data: list[types.Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        *,
        forward_only: bool,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        if not data:
            raise ValueError("No data provided")
        data = list(data)
        config = dict(loss_fn_config) if loss_fn_config is not None else None
        validation.check_forward_request(data, loss_fn, config)
        backend = self.holder.backend
        if loss_fn == "stable_reinforce":  # natively or lowered, as the service allows
            lowering = sr_lowering.session_of(self.holder)
            holder = self.holder

            async def stable_reinforce(turn: _Turn) -> types.ForwardBackwardOutput:
                session_id = await holder.session_id()
                return await lowering.forward_backward(
                    backend, self.model_id, session_id, turn, data, config,
                    forward_only=forward_only,
                )  # fmt: skip

            return AwaitableConcurrentFuture(self._submit_turn(stable_reinforce))

        async def plain(turn: _Turn) -> types.ForwardBackwardOutput:
            return await chunks.issue(
                backend, self.model_id, turn.take, data, loss_fn, config, forward_only=forward_only
            )

        return AwaitableConcurrentFuture(self._submit_turn(plain, release_after_start=True))

    def forward_backward_custom(
        self,
        data: list[types.Datum],
        loss_fn: CustomLossFnV1 | LossHandle,
        *,
        loss_type_input: Literal["logprobs"] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """A loss computed here in torch from the model's logprobs (as the official SDK does): a
        forward pass, your loss and its gradient w.r.t. the logprobs, then a cross-entropy
        backward pass weighted by minus that gradient. Costs about 1.5 forward_backwards.

        ``loss_fn`` is ``fn(data, logprobs_list) -> (loss, metrics)`` or a `LossHandle`
        from ``ServiceClient.create_custom_loss`` of this client's session; a handle is
        checked against ``data`` first (each input present, at its declared rank) and run
        per datum, losses summed."""
        from tinker_sr.clients.custom_loss import (
            LossHandle,
            ce_copy,
            check_loss_inputs,
            custom_backward_data,
        )

        if loss_type_input is not None:
            warnings.warn(
                "loss_type_input is deprecated; logprobs are the only input type",
                DeprecationWarning,
                stacklevel=2,
            )
            if loss_type_input != "logprobs":
                raise ValueError(f"loss_type_input must be 'logprobs', got {loss_type_input!r}")
        if isinstance(loss_fn, LossHandle) and loss_fn.loss_id is not None:
            self._check_handle_session(loss_fn)
            check_loss_inputs(loss_fn, data)
            # A server-side loss: one forward_backward (the engine says it has none).
            return self.forward_backward(data, "custom", {"loss_id": loss_fn.loss_id})
        compute = self._custom_compute(loss_fn, data)
        data = list(data)
        validation.check_token_ids(data)
        backend = self.holder.backend

        async def body(turn: _Turn) -> types.ForwardBackwardOutput:
            # Like the official SDK, a failed custom loss poisons the client. The backward's
            # number is taken only once the loss has succeeded, so a failure leaves no gap
            # for the backend to wait on (queued calls then see the poison and take none).
            try:
                fwd = await chunks.issue(
                    backend, self.model_id, turn.take, [ce_copy(d, None) for d in data],
                    "cross_entropy", None, forward_only=True,
                )  # fmt: skip
                loss, user_metrics, bwd_data = custom_backward_data(data, compute, fwd)
            except BaseException as e:
                self._poison(e)
                raise
            bwd = asyncio.ensure_future(
                chunks.issue(
                    backend, self.model_id, turn.take, bwd_data, "cross_entropy", None,
                    forward_only=False,
                )
            )  # fmt: skip
            await asyncio.sleep(0)  # issued: later calls may now issue theirs
            turn.release()
            try:
                out = await bwd
            except BaseException as e:  # as the SDK: any failure of the custom call poisons
                self._poison(e)
                raise
            surrogate = out.metrics.pop("loss:sum", 0.0)
            out.metrics.update(user_metrics)  # as you returned them, as the SDK (not floats)
            out.metrics["loss:sum"] = loss
            out.metrics["surrogate_loss:sum"] = surrogate
            return out

        return AwaitableConcurrentFuture(self._submit_turn(body))

    def _custom_compute(
        self, loss_fn: CustomLossFnV1 | LossHandle, data: list[types.Datum]
    ) -> CustomLossFnV1:
        """The client-side loss of `forward_backward_custom`, checked against ``data``."""
        from tinker_sr.clients.custom_loss import LossHandle, check_loss_inputs, run_loss_handle

        compute: CustomLossFnV1
        if isinstance(loss_fn, LossHandle):
            self._check_handle_session(loss_fn)
            check_loss_inputs(loss_fn, data)
            handle = loss_fn

            def run_handle(batch: list[types.Datum], logprobs: list[Any]) -> tuple[Any, Any]:
                return run_loss_handle(handle, batch, logprobs)

            compute = run_handle
        elif callable(loss_fn):
            compute = loss_fn
        else:
            raise TypeError(
                "loss_fn must be a callable (data, logprobs_list) -> (loss, metrics) or a "
                f"LossHandle from ServiceClient.create_custom_loss, got {type(loss_fn).__name__}"
            )
        if not data:
            raise ValueError("No data provided")
        for i, d in enumerate(data):
            if "target_tokens" not in d.loss_fn_inputs:
                raise ValueError(f"datum {i}: forward_backward_custom needs target_tokens")
        return compute

    def _check_handle_session(self, handle: LossHandle) -> None:
        """A `LossHandle` works only for clients of the session that created it."""
        sid = self.holder._session_id
        if sid is None:  # not reached for clients made by create_*; kept for safety
            sid = blocking_result(self.holder.run(self.holder.session_id()))
        if handle.session_id != sid:
            raise ValueError(
                f"LossHandle {handle.name!r} was created in session {handle.session_id}; it "
                f"can only be used by clients of that session (this client is in {sid}). "
                "Create the loss with this client's ServiceClient.create_custom_loss"
            )

    def optim_step(
        self,
        optim_params: types.OptimParams | None = None,
        *,
        adam_params: types.AdamParams | None = None,
    ) -> APIFuture[types.OptimStepResponse]:
        """Apply the accumulated gradients (and clear them)."""
        if optim_params is not None and adam_params is not None:
            raise ValueError("Pass either optim_params or adam_params, not both")
        params = optim_params if optim_params is not None else adam_params
        if not isinstance(params, (types.AdamParams, types.OptimParamsBase)):
            raise TypeError(
                f"optim_step needs AdamParams (or another OptimParams), got "
                f"{type(params).__name__}{official_sdk_hint(params)}"
            )
        backend = self.holder.backend
        return self._api(1, lambda s: backend.optim_step(self.model_id, s[0], params))  # type: ignore[arg-type]

    # ---- checkpoints ------------------------------------------------------------------
    def save_state(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[types.SaveWeightsResponse]:
        """Weights and optimizer state → ``tinker://<run>/weights/<name>``."""
        _check_name_encodes(name)
        validation.check_text(user_metadata, "save_state: user_metadata")  # the wire's: at once
        try:  # the SDK's future fails (its types refuse it); no sequence number is taken here
            validation.check_user_metadata(user_metadata, "save_state")
        except ValueError as e:
            failed: concurrent.futures.Future[types.SaveWeightsResponse] = (
                concurrent.futures.Future()
            )
            failed.set_exception(e)
            return AwaitableConcurrentFuture(failed)
        backend = self.holder.backend
        return self._api(
            1,
            lambda s: backend.save_state(
                self.model_id,
                s[0],
                name,
                ttl_seconds=ttl_seconds,
                overwrite=overwrite,
                user_metadata=user_metadata,
            ),
        )

    def save_weights_for_sampler(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        """Weights only → ``tinker://<run>/sampler_weights/<name>``."""
        _check_name_encodes(name)
        validation.check_text(user_metadata, "save_weights_for_sampler: user_metadata")
        backend = self.holder.backend

        async def body(s: list[int]) -> types.SaveWeightsForSamplerResponse:
            r = await backend.save_weights_for_sampler(
                self.model_id, s[0], name=name, ttl_seconds=ttl_seconds, user_metadata=user_metadata
            )
            assert r.path is not None
            return types.SaveWeightsForSamplerResponse(path=r.path)  # type None, as the SDK

        return self._api(1, body)

    def save_weights_external(
        self,
        name: str,
        ttl_seconds: int | None = None,
        age_encryption_recipients: list[str] | None = None,
    ) -> APIFuture[types.SaveWeightsExternalResponse]:
        """The current LoRA adapter, exported for other tools →
        ``tinker://<run>/external_weights/<name>``: ``adapter_model.safetensors`` +
        ``adapter_config.json`` in Tinker's layout, which tinker-cookbook's
        ``weights.download`` / ``weights.build_hf_model`` and ``tinker checkpoint download``
        read. ``ttl_seconds``: 3600 to 10 years (``None`` = never expires).
        ``age_encryption_recipients``: up to 10 age (``age1...``) or SSH public keys; every file
        is then encrypted to them and named ``<file>.age`` (needs the ``pyrage`` package).
        Download the files from `RestClient.get_external_weights_urls` (docs/models.md)."""
        _check_name_encodes(name)
        validation.check_age_recipients_shape(age_encryption_recipients)
        backend = self.holder.backend

        async def body(s: list[int]) -> types.SaveWeightsExternalResponse:
            return await backend.save_weights_external(
                self.model_id,
                s[0],
                name,
                ttl_seconds=ttl_seconds,
                age_encryption_recipients=age_encryption_recipients,
            )

        return self._api(1, body)

    def save_weights_and_get_sampling_client(
        self,
        name: str | None = None,
        retry_config: RetryConfig | None = None,
        record_stability_info: bool = False,
        kind: types.SamplingClientKind = "snapshot",
    ) -> BackcompatSamplingClientFuture:
        """Snapshot the current weights into a new sampler (no persistent path)."""
        from tinker_sr.clients.creation import BackcompatSamplingClientFuture
        from tinker_sr.clients.sampling import SamplingClient

        if name is not None:
            warnings.warn(
                "save_weights_and_get_sampling_client(name=...) is ignored: the snapshot is "
                "ephemeral; use save_weights_for_sampler(name) for a persistent path",
                DeprecationWarning,
                stacklevel=2,
            )
        if kind not in ("snapshot", "inflight"):
            raise ValueError(f"kind must be 'snapshot' or 'inflight', got {kind!r}")
        # Refused here with the server's own words (it refuses the SDK's request alike).
        refused_as_400(validation.check_sampler_kind, kind, "save_weights_and_get_sampling_client")
        backend = self.holder.backend
        sampling_seq = self.holder.next_sampling_session_seq_id()

        async def body(s: list[int]) -> SamplingClient:
            r = await backend.save_weights_for_sampler(
                self.model_id, s[0], sampling_session_seq_id=sampling_seq
            )
            assert r.sampling_session_id is not None
            return SamplingClient(
                self.holder,
                r.sampling_session_id,
                base_model=self._info.model_data.model_name or "",
                record_stability_info=record_stability_info,
                retry_config=retry_config,
                tokenizer_id=self._info.model_data.tokenizer_id,
            )

        return BackcompatSamplingClientFuture(self._submit(1, body))

    def create_sampling_client(
        self,
        model_path: str,
        retry_config: RetryConfig | None = None,
        record_stability_info: bool = False,
    ) -> BackcompatSamplingClientFuture:
        """A sampler on saved sampler weights, in this client's session."""
        from tinker_sr.clients.service import create_sampling_client_future

        return create_sampling_client_future(
            self.holder,
            model_path=model_path,
            base_model=None,
            retry_config=retry_config,
            record_stability_info=record_stability_info,
        )

    def load_state(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[types.LoadWeightsResponse]:
        """Deprecated: use ``ServiceClient.create_training_client_from_state``."""
        warn_deprecated(LOAD_STATE_DEPRECATED)
        return self._deprecated_load(path, False, weights_access_token)

    def load_state_with_optimizer(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[types.LoadWeightsResponse]:
        """Deprecated: use ``ServiceClient.create_training_client_from_state_with_optimizer``."""
        warn_deprecated(LOAD_STATE_DEPRECATED)
        return self._deprecated_load(path, True, weights_access_token)

    def _deprecated_load(
        self, path: str, with_optimizer: bool, weights_access_token: str | None
    ) -> APIFuture[types.LoadWeightsResponse]:
        log.error(LOAD_STATE_DEPRECATED)  # the SDK both logs it and warns (FutureWarning)
        return self._load(
            path, with_optimizer=with_optimizer, weights_access_token=weights_access_token
        )

    def _load(
        self, path: str, *, with_optimizer: bool, weights_access_token: str | None
    ) -> APIFuture[types.LoadWeightsResponse]:
        refused_as_400(validation.check_no_access_token, weights_access_token, "load_weights")
        # The path's form is the backend's to check: BadRequestError from the future, as the
        # SDK gets it from a server.
        backend = self.holder.backend
        return self._api(
            1,
            lambda s: backend.load_state(self.model_id, s[0], path, with_optimizer=with_optimizer),
        )

    # ---- info -------------------------------------------------------------------------
    def get_info(self) -> types.GetInfoResponse:
        """Model info, cached when the client was created (no request)."""
        return self._info

    @deprecated_call("get_info_async is deprecated; use get_info() (no request needed)")
    async def get_info_async(self) -> types.GetInfoResponse:
        """Deprecated: use `get_info`, which answers without a request."""
        return self._info

    def get_tokenizer(self) -> Any:
        """The model's own tokenizer (see `tinker_sr.clients.tokenizers`)."""
        from tinker_sr.clients.tokenizers import tokenizer_for

        name = self._info.model_data.model_name
        assert name is not None, "get_info() did not report model_data.model_name"
        return tokenizer_for(self.holder.backend, name, self._info.model_data.tokenizer_id)

    def get_console_url(self) -> str:
        return f"tinker-sr://training_runs/{self.model_id}"

    def get_telemetry(self) -> None:
        """Always ``None``: tinker_sr collects and sends no telemetry (out of scope)."""
        return None

    # ---- deprecated coroutine twins (await twice: they resolve to a future) ------------
    @deprecated_call("forward_async is deprecated; use forward() and await the future")
    async def forward_async(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Deprecated: use `forward` and await its future."""
        return self.forward(data, loss_fn, loss_fn_config)

    @deprecated_call(
        "forward_backward_async is deprecated; use forward_backward() and await the future"
    )
    async def forward_backward_async(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Deprecated: use `forward_backward` and await its future."""
        return self.forward_backward(data, loss_fn, loss_fn_config)

    @deprecated_call("forward_backward_custom_async is deprecated; use forward_backward_custom()")
    async def forward_backward_custom_async(
        self,
        data: list[types.Datum],
        loss_fn: CustomLossFnV1 | LossHandle,
        *,
        loss_type_input: Literal["logprobs"] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Deprecated: use `forward_backward_custom` and await its future."""
        return self.forward_backward_custom(data, loss_fn, loss_type_input=loss_type_input)

    @deprecated_call("optim_step_async is deprecated; use optim_step() and await the future")
    async def optim_step_async(
        self,
        optim_params: types.OptimParams | None = None,
        *,
        adam_params: types.AdamParams | None = None,
    ) -> APIFuture[types.OptimStepResponse]:
        """Deprecated: use `optim_step` and await its future."""
        return self.optim_step(optim_params, adam_params=adam_params)

    @deprecated_call("save_state_async is deprecated; use save_state()")
    async def save_state_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[types.SaveWeightsResponse]:
        """Deprecated: use `save_state` and await its future."""
        return self.save_state(
            name, ttl_seconds=ttl_seconds, overwrite=overwrite, user_metadata=user_metadata
        )

    @deprecated_call("save_weights_for_sampler_async is deprecated; use save_weights_for_sampler()")
    async def save_weights_for_sampler_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        """Deprecated: use `save_weights_for_sampler` and await its future."""
        return self.save_weights_for_sampler(
            name, ttl_seconds=ttl_seconds, user_metadata=user_metadata
        )

    @deprecated_call("save_weights_external_async is deprecated; use save_weights_external()")
    async def save_weights_external_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        age_encryption_recipients: list[str] | None = None,
    ) -> APIFuture[types.SaveWeightsExternalResponse]:
        """Deprecated: use `save_weights_external` and await its future."""
        return self.save_weights_external(
            name, ttl_seconds=ttl_seconds, age_encryption_recipients=age_encryption_recipients
        )

    @deprecated_call(LOAD_STATE_DEPRECATED)
    async def load_state_async(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[types.LoadWeightsResponse]:
        """Deprecated: use ``ServiceClient.create_training_client_from_state``."""
        return self._deprecated_load(path, False, weights_access_token)

    @deprecated_call(LOAD_STATE_DEPRECATED)
    async def load_state_with_optimizer_async(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[types.LoadWeightsResponse]:
        """Deprecated: use ``ServiceClient.create_training_client_from_state_with_optimizer``."""
        return self._deprecated_load(path, True, weights_access_token)

    @deprecated_call("create_sampling_client_async is deprecated; await create_sampling_client()")
    async def create_sampling_client_async(
        self,
        model_path: str,
        retry_config: RetryConfig | None = None,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        """Deprecated: ``await create_sampling_client(...)``."""
        return await self.create_sampling_client(
            model_path, retry_config=retry_config, record_stability_info=record_stability_info
        )

    @deprecated_call(
        "save_weights_and_get_sampling_client_async is deprecated; await "
        "save_weights_and_get_sampling_client()"
    )
    async def save_weights_and_get_sampling_client_async(
        self,
        name: str | None = None,
        retry_config: RetryConfig | None = None,
        record_stability_info: bool = False,
        kind: types.SamplingClientKind = "snapshot",
    ) -> SamplingClient:
        """Deprecated: ``await save_weights_and_get_sampling_client(...)``."""
        return await self.save_weights_and_get_sampling_client(
            name,
            retry_config=retry_config,
            record_stability_info=record_stability_info,
            kind=kind,
        )


def _check_name_encodes(name: str) -> None:
    """A name the wire cannot carry (not a str, or a lone surrogate that UTF-8 cannot encode)
    is refused before the request is numbered; a remote request that failed to encode would
    leave a gap in the model's seq_ids. Every other name rule is the backend's, as before."""
    try:
        name.encode("utf-8")
    except (UnicodeEncodeError, AttributeError):
        validation.check_checkpoint_name(name)
