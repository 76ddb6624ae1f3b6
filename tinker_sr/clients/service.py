"""`ServiceClient`: the entry point. Picks the backend and owns the session."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from tinker_sr import types, validation
from tinker_sr.backend.base import Backend
from tinker_sr.clients import sr_lowering
from tinker_sr.clients.creation import (
    BackcompatSamplingClientFuture,
    BackcompatTrainingClientFuture,
)
from tinker_sr.clients.holder import (
    ClientSession,
    blocking_result,
    default_api_key,
    deprecated_call,
    make_backend,
    not_picklable,
    server_url,
    shallow_copy,
    wants_remote,
    warn_deprecated,
)
from tinker_sr.clients.sampling import SamplingClient
from tinker_sr.clients.sr_lowering import LoweringMode, LoweringOptions
from tinker_sr.clients.training import TrainingClient
from tinker_sr.errors import TinkerError, refused_as_400
from tinker_sr.futures import APIFuture, AwaitableConcurrentFuture

if TYPE_CHECKING:
    from tinker_sr.clients.custom_loss import LossHandle, PerDatumLossFn
    from tinker_sr.clients.rest import RestClient
    from tinker_sr.lib.retry_handler import RetryConfig


def _check_api_key(api_key: str | None, remote: bool) -> str | None:
    """The official key rules apply to remote services; the embedded engine needs no key."""
    key = api_key or os.environ.get("TINKER_API_KEY") or None
    if not remote:
        return key
    if key is None:
        from tinker_sr.auth import stored_api_key

        key = stored_api_key()
    if key is None:
        raise TinkerError(
            "No API key: pass api_key=..., set TINKER_API_KEY or run `tinker auth login` (a "
            "tinker_sr server accepts any key starting with 'tml-' unless it was started with "
            "--api-key/--api-keys)"
        )
    if not (key.startswith("tml-") or key.startswith("eyJ")):
        raise TinkerError(
            "The API key must start with 'tml-' (a local tinker-sr serve accepts any such key "
            "unless it was started with --api-key)"
        )
    return key


class ServiceClient:
    """Creates training, sampling and REST clients that share one session.

    The backend is the embedded engine unless a base URL is given (``base_url=`` or
    ``$TINKER_BASE_URL``), in which case every call goes over the Tinker wire protocol to
    that server. ``backend=`` takes ``"local"``, ``"remote"`` or a `Backend` instance.
    Construction makes no request; the session starts on first use.

    API key: ``api_key=``, else ``$TINKER_API_KEY``; it must start with ``tml-``. A server
    on this machine (host ``localhost``, ``127.0.0.1`` or ``::1``) needs none: the key then
    defaults to ``"tml-local"``, which a tinker_sr server accepts unless it was started
    with ``--api-keys``. Unlike the official SDK, ``close()``'s ``status`` defaults to
    ``"success"``.

    ``stable_reinforce_lowering``: on a service without ``stable_reinforce``, the client
    lowers it to weighted ``cross_entropy`` (same gradient; docs/stable_reinforce.md).
    ``"auto"`` (default, or ``$TINKER_SR_LOWERING``) decides from the service's answers,
    ``"always"`` forces the lowering, ``"never"`` forbids it; a `LoweringOptions` also picks
    the target form and the top-k used for client-side draws.
    """

    def __reduce__(self) -> Any:
        raise not_picklable("ServiceClient")

    def __copy__(self) -> ServiceClient:
        return shallow_copy(self)

    def __init__(
        self,
        user_metadata: dict[str, str] | None = None,
        project_id: str | None = None,
        *,
        display_name: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        default_headers_overrides: Mapping[str, str] | None = None,
        backend: Backend | Literal["local", "remote"] | None = None,
        stable_reinforce_lowering: LoweringOptions | LoweringMode | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            warn_deprecated(
                f"ServiceClient ignores unknown arguments: {sorted(kwargs)}", stacklevel=2
            )
        for field, value in (
            ("user_metadata", user_metadata),
            ("project_id", project_id),
            ("display_name", display_name),
        ):
            validation.check_text(value, f"ServiceClient: {field}")
        remote = wants_remote(backend, base_url)
        if remote:  # a missing server is named before a missing key
            api_key = default_api_key(api_key, server_url(base_url))
        key = _check_api_key(api_key, remote=remote)
        be, url = make_backend(
            backend=backend,
            base_url=base_url,
            api_key=key,
            default_headers=default_headers_overrides,
            project_id=project_id,
        )
        self.holder = ClientSession(
            be,
            base_url=url,
            api_key=key,
            user_metadata=user_metadata,
            project_id=project_id,
            display_name=display_name,
            owns_backend=url is not None,
        )
        sr_lowering.configure(self.holder, stable_reinforce_lowering)
        self._close_future: APIFuture[None] | None = None

    @property
    def stable_reinforce_path(self) -> str | None:
        """How ``stable_reinforce`` ran in this session: ``"native"``, ``"lowered-2d"``,
        ``"lowered-1d"`` (see `LoweringOptions`), or None before its first use."""
        return sr_lowering.session_of(self.holder).path

    def __repr__(self) -> str:
        where = self.holder.base_url or "embedded engine"
        return f"ServiceClient({where})"

    # ---- context manager ----------------------------------------------------------------
    def __enter__(self) -> ServiceClient:
        if self.holder.closed:
            raise RuntimeError("ServiceClient is closed")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            status: Literal["success", "errored", "interrupted"] = "success"
        elif isinstance(exc, Exception):
            status = "errored"
        else:
            status = "interrupted"
        self.close(status).result()

    def close(
        self,
        status: Literal["success", "errored", "interrupted"] = "success",
        detail: str | None = None,
    ) -> APIFuture[None]:
        """Finish the session (first reason wins). Idempotent.

        ``status`` defaults to ``"success"`` (the official SDK requires it; every SDK call
        works the same here)."""
        if self._close_future is not None:
            return self._close_future
        self.holder.closed = True
        if not self.holder.has_session and not self.holder._owns_backend:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            done.set_result(None)
            self._close_future = AwaitableConcurrentFuture(done)
        else:
            self._close_future = AwaitableConcurrentFuture(
                self.holder.run(self.holder.close(status, detail))
            )
        return self._close_future

    # ---- training clients -------------------------------------------------------------------
    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: types.OptimizerConfig | None = None,
    ) -> BackcompatTrainingClientFuture:
        """A new LoRA on ``base_model``. ``seed`` makes the adapter init reproducible."""
        assert train_mlp or train_attn or train_unembed, (
            "At least one of train_mlp, train_attn, or train_unembed must be True"
        )
        self.holder.check_open()
        validation.check_text(user_metadata, "create_lora_training_client: user_metadata")
        lora = types.LoraConfig(
            rank=rank,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
        )
        optimizer = optimizer if optimizer is not None else types.AdamOptimizerConfig()
        backend = self.holder.backend
        return self._training_client(
            lambda sid, seq: backend.create_model(
                sid,
                seq,
                base_model=base_model,
                lora_config=lora,
                optimizer_config=optimizer,
                user_metadata=user_metadata,
            )
        )

    def _training_client(
        self, create_model: Callable[[str, int], Awaitable[str]]
    ) -> BackcompatTrainingClientFuture:
        """Reserve the next model slot now; on the SDK loop, start the session if needed,
        create the model with ``create_model(session_id, model_seq_id)`` and fetch its info."""
        holder = self.holder
        model_seq_id = holder.next_model_seq_id()

        async def create() -> TrainingClient:
            sid = await holder.session_id()
            model_id = await create_model(sid, model_seq_id)
            info = await holder.backend.get_info(model_id)
            return TrainingClient(holder, model_id, info)

        return BackcompatTrainingClientFuture(holder.run(create()))

    def _from_state(
        self,
        path: str,
        *,
        with_optimizer: bool,
        base_model: str | None,
        user_metadata: dict[str, str] | None,
        optimizer: types.OptimizerConfig | None,
        weights_access_token: str | None,
    ) -> BackcompatTrainingClientFuture:
        self.holder.check_open()
        refused_as_400(validation.check_no_access_token, weights_access_token, "load_weights")
        validation.check_text(user_metadata, "create_training_client_from_state: user_metadata")
        # Any path goes to the service, as the SDK sends it: a sampler or external-weights
        # path fails the future (RequestFailedError), a malformed one too (BadRequestError).
        backend = self.holder.backend

        def load(sid: str, seq: int) -> Awaitable[str]:
            # The SDK's request model fails the future on a path that is not a string.
            request = types.LoadWeightsRequest(path=path, optimizer=with_optimizer)
            return backend.create_model_from_state(
                sid,
                seq,
                path=request.path,
                with_optimizer=with_optimizer,
                base_model=base_model,
                optimizer_config=optimizer,
                user_metadata=user_metadata,
            )

        return self._training_client(load)

    def create_training_client_from_state(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: types.OptimizerConfig | None = None,
    ) -> BackcompatTrainingClientFuture:
        """A training client with the weights of a ``save_state`` checkpoint (fresh optimizer)."""
        return self._from_state(
            path,
            with_optimizer=False,
            base_model=base_model,
            user_metadata=user_metadata,
            optimizer=optimizer,
            weights_access_token=weights_access_token,
        )

    def create_training_client_from_state_with_optimizer(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> BackcompatTrainingClientFuture:
        """A training client with the weights *and* Adam state of a ``save_state`` checkpoint."""
        return self._from_state(
            path,
            with_optimizer=True,
            base_model=base_model,
            user_metadata=user_metadata,
            optimizer=None,
            weights_access_token=weights_access_token,
        )

    # ---- sampling clients -------------------------------------------------------------------
    def create_sampling_client(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: RetryConfig | None = None,
        record_stability_info: bool = False,
    ) -> BackcompatSamplingClientFuture:
        """A sampler on saved sampler weights (``model_path``) or on a base model."""
        if model_path is None and base_model is None:
            raise ValueError("Either model_path or base_model must be provided")
        self.holder.check_open()
        return create_sampling_client_future(
            self.holder,
            model_path=model_path,
            base_model=base_model,
            retry_config=retry_config,
            record_stability_info=record_stability_info,
        )

    # ---- custom losses (alpha) ------------------------------------------------------------
    def create_custom_loss(
        self, fn: PerDatumLossFn, input_ranks: Mapping[str, types.CustomLossInputRank]
    ) -> APIFuture[LossHandle]:
        """Trace ``fn`` into a `LossHandle` for ``TrainingClient.forward_backward_custom``
        (alpha in the official SDK too).

        ``fn(logprobs, *inputs)`` runs once per datum: ``logprobs`` (the datum's target
        logprobs) then one tensor per ``loss_fn_inputs`` key it names. It returns a scalar
        loss and a dict of scalar tensors keyed ``custom/<name>:sum`` or
        ``custom/<name>:mean``; losses are summed over datums. ``input_ranks`` gives each
        parameter's rank (0 scalar, 1 ``[T]``, 2 ``[T, K]``), ``logprobs`` included.

        The function is traced with ``torch.fx``: only torch, math and operator calls, no
        branching on tensor values, no ``torch.nn`` modules, no captured tensors, no
        ``.item()``/``.numpy()``/``.tolist()``. A violation raises ``ValueError`` here,
        before anything is sent. The handle belongs to this session (``loss_id`` is
        ``None``: tinker_sr runs custom losses client-side); creating the same traced loss
        twice in a session fails the future with ``ValueError``.

        ```python
        def neg_ll(logprobs, weights):
            loss = -(logprobs * weights).sum()
            return loss, {"custom/neg_ll:sum": loss}

        handle = service_client.create_custom_loss(
            neg_ll, input_ranks={"logprobs": 1, "weights": 1}
        ).result()
        training_client.forward_backward_custom(data, handle).result()
        ```
        """
        import dataclasses

        from tinker_sr.clients.custom_loss import register_loss, trace_loss

        self.holder.check_open()
        # Validate and trace now, so a bad loss fails at the call; bind the session later.
        traced = trace_loss(fn, input_ranks, session_id="")
        holder = self.holder

        async def create() -> LossHandle:
            bound = dataclasses.replace(traced, session_id=await holder.session_id())
            register_loss(holder, bound)
            return bound

        return AwaitableConcurrentFuture(holder.run(create()))

    # ---- checkpoints ------------------------------------------------------------------------
    def copy_weights(
        self,
        path: str,
        *,
        ttl_seconds: int | None = None,
        weights_access_token: str | None = None,
    ) -> APIFuture[str]:
        """Copy a checkpoint of either kind into a new training run of this client's session;
        the future resolves to the copy's tinker path.

        The copy is ``tinker://<session_id>:train:<n>/<segment>/<name>``: the same kind and
        name as ``path``, in training-run slot ``n`` of this session (numbered like the
        training clients it creates). It loads exactly like the source (a ``weights`` copy
        with `create_training_client_from_state`, either kind with
        `create_sampling_client`), is private, and survives deleting the source. The new
        run holds no trainable model. ``ttl_seconds``: 3600 (1 hour) to 10 years, or
        ``None`` for no expiry; the source's expiry is not inherited. A malformed path fails
        the future (`BadRequestError`), as in the official SDK.

        Differences from the official SDK, which copies into a new session of this client's
        project: the copy lands in this session, so no project id is needed; and
        ``weights_access_token`` is not supported (the call fails): copy your own
        checkpoints, or published ones on a server.

        ```python
        archived = service_client.copy_weights("tinker://run-id/weights/step-400").result()
        training_client = service_client.create_training_client_from_state(archived).result()
        ```
        """
        self.holder.check_open()
        # Built at once, as the SDK builds its request: an argument of the wrong type raises
        # here; a malformed path fails the future (`BadRequestError`), as the SDK's does.
        request = types.CopyWeightsRequest(source_path=path, ttl_seconds=ttl_seconds)
        holder = self.holder
        model_seq_id = holder.next_model_seq_id()

        async def copy() -> str:
            sid = await holder.session_id()
            return await holder.backend.copy_weights(
                request.source_path,
                session_id=sid,
                model_seq_id=model_seq_id,
                ttl_seconds=request.ttl_seconds,
                weights_access_token=weights_access_token,
            )

        return AwaitableConcurrentFuture(holder.run(copy()))

    # ---- misc -------------------------------------------------------------------------------
    def get_telemetry(self) -> None:
        """Always ``None``: tinker_sr collects and sends no telemetry (out of scope)."""
        return None

    def create_rest_client(self) -> RestClient:
        from tinker_sr.clients.rest import RestClient

        warn_deprecated("create_rest_client() is deprecated; construct RestClient() directly")
        return RestClient(self.holder)

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        warn_deprecated("get_server_capabilities() is deprecated; use RestClient")
        return blocking_result(self.holder.run(self.holder.backend.get_server_capabilities()))

    @deprecated_call("get_server_capabilities_async() is deprecated; use RestClient")
    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return await asyncio.wrap_future(
            self.holder.run(self.holder.backend.get_server_capabilities())
        )

    def get_console_url(self) -> str:
        sid = self.holder._session_id
        return f"tinker-sr://sessions/{sid}" if sid else "tinker-sr://sessions"

    # ---- deprecated coroutine twins (one await, resolve to the client) -----------------------
    @deprecated_call(
        "create_lora_training_client_async is deprecated; await create_lora_training_client()"
    )
    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: types.OptimizerConfig | None = None,
    ) -> TrainingClient:
        """Deprecated: ``await create_lora_training_client(...)``."""
        return await self.create_lora_training_client(
            base_model,
            rank=rank,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
            user_metadata=user_metadata,
            optimizer=optimizer,
        )

    @deprecated_call(
        "create_training_client_from_state_async is deprecated; await "
        "create_training_client_from_state()"
    )
    async def create_training_client_from_state_async(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: types.OptimizerConfig | None = None,
    ) -> TrainingClient:
        """Deprecated: ``await create_training_client_from_state(...)``."""
        return await self.create_training_client_from_state(
            path,
            base_model=base_model,
            user_metadata=user_metadata,
            weights_access_token=weights_access_token,
            optimizer=optimizer,
        )

    @deprecated_call(
        "create_training_client_from_state_with_optimizer_async is deprecated; await "
        "create_training_client_from_state_with_optimizer()"
    )
    async def create_training_client_from_state_with_optimizer_async(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> TrainingClient:
        """Deprecated: ``await create_training_client_from_state_with_optimizer(...)``."""
        return await self.create_training_client_from_state_with_optimizer(
            path,
            base_model=base_model,
            user_metadata=user_metadata,
            weights_access_token=weights_access_token,
        )

    @deprecated_call("create_sampling_client_async is deprecated; await create_sampling_client()")
    async def create_sampling_client_async(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: RetryConfig | None = None,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        """Deprecated: ``await create_sampling_client(...)``."""
        return await self.create_sampling_client(
            model_path=model_path,
            base_model=base_model,
            retry_config=retry_config,
            record_stability_info=record_stability_info,
        )


def create_sampling_client_future(
    holder: ClientSession,
    *,
    model_path: str | None,
    base_model: str | None,
    retry_config: RetryConfig | None,
    record_stability_info: bool,
) -> BackcompatSamplingClientFuture:
    if model_path and not model_path.startswith("tinker://"):  # "" goes on, as in the SDK
        raise ValueError(f"model_path must start with 'tinker://', got {model_path!r}")
    seq = holder.next_sampling_session_seq_id()

    async def create() -> SamplingClient:
        sid = await holder.session_id()
        sampler_id = await holder.backend.create_sampling_session(
            sid, seq, base_model=base_model, model_path=model_path
        )
        name = base_model or await holder.backend.get_sampler_base_model(sampler_id)
        return SamplingClient(
            holder,
            sampler_id,
            base_model=name,
            record_stability_info=record_stability_info,
            retry_config=retry_config,
        )

    return BackcompatSamplingClientFuture(holder.run(create()))
