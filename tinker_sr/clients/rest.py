"""`RestClient`: look up, copy and manage training runs and checkpoints; needs no session."""

from __future__ import annotations

import os
import warnings
from collections.abc import Coroutine
from datetime import date, datetime
from typing import Any, Literal, TypeVar

from tinker_sr import types
from tinker_sr.clients import rest_args
from tinker_sr.clients.admin import AdminClient, AuditEventType
from tinker_sr.clients.holder import (
    ClientSession,
    deprecated_call,
    make_backend,
    not_picklable,
    shallow_copy,
    warn_deprecated,
)
from tinker_sr.errors import refusal
from tinker_sr.futures import APIFuture, AwaitableConcurrentFuture

T = TypeVar("T")
AccessScope = Literal["owned", "accessible"]


class RestClient:
    """Every method returns an `APIFuture` (await it, or call ``.result()``); the deprecated
    ``*_async`` twins are coroutines resolving to the value."""

    def __reduce__(self) -> Any:
        raise not_picklable("RestClient")

    def __copy__(self) -> RestClient:
        return shallow_copy(self)

    def __init__(
        self,
        _holder: ClientSession | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        if _holder is None:
            backend, url = make_backend(backend=None, base_url=base_url, api_key=api_key)
            _holder = ClientSession(
                backend, base_url=url, api_key=api_key, owns_backend=url is not None
            )
        self.holder = _holder

    def _f(self, coro: Coroutine[Any, Any, T]) -> APIFuture[T]:
        return AwaitableConcurrentFuture(self.holder.run(coro))

    def _checked(self, coro: Coroutine[Any, Any, T], *problems: Exception | None) -> APIFuture[T]:
        """``coro``, unless one of ``problems`` (`rest_args`) is one: then the first of them
        fails the future, as the SDK's request fails."""
        problem = rest_args.first(*problems)
        if problem is None:
            return self._f(coro)
        coro.close()
        return self._f(_fail(problem))

    def _scoped(
        self,
        coro: Coroutine[Any, Any, T],
        access_scope: object,
        project_id: object = None,
        *,
        url: Exception | None = None,
        unknown: Exception | None = None,
    ) -> APIFuture[T]:
        """``coro``, unless the SDK or a server would refuse the query: a URL httpx refuses
        (``url``), an unknown ``access_scope`` or a ``project_id`` filter (`BadRequestError`),
        an id that names nothing (``unknown``), in the order a request meets them."""
        problem = None
        if access_scope not in ("owned", "accessible"):
            problem = f"access_scope must be 'owned' or 'accessible', got {access_scope!r:.60}"
        elif project_id is not None:
            problem = "filtering training runs by project_id is not supported"
        scope = None if problem is None else refusal(400, problem)
        return self._checked(coro, url, scope, unknown)

    @property
    def _b(self) -> Any:
        return self.holder.backend

    def get_telemetry(self) -> None:
        """Always ``None``: tinker_sr collects and sends no telemetry (out of scope)."""
        return None

    # ---- server, runs ------------------------------------------------------------------------
    def get_server_capabilities(self) -> APIFuture[types.GetServerCapabilitiesResponse]:
        return self._f(self._b.get_server_capabilities())

    def get_training_run(
        self, training_run_id: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[types.TrainingRun]:
        return self._scoped(
            self._b.get_training_run(training_run_id),
            access_scope,
            url=rest_args.url(
                f"/api/v1/training_runs/{training_run_id}", training_run_id=training_run_id
            ),
            unknown=rest_args.not_an_id("training run", training_run_id=training_run_id),
        )

    def get_sampler(self, sampler_id: str) -> APIFuture[types.GetSamplerResponse]:
        """A sampling session's base model and, if it was created from a checkpoint, that
        checkpoint's path (``SamplingClient.sampler_id`` names it)."""
        return self._checked(
            self._b.get_sampler(sampler_id),
            rest_args.url(f"/api/v1/samplers/{sampler_id}", sampler_id=sampler_id),
            rest_args.not_an_id("sampler", sampler_id=sampler_id),
        )

    def get_training_run_by_tinker_path(
        self, tinker_path: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[types.TrainingRun]:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self.get_training_run(parsed.training_run_id, access_scope)

    def list_training_runs(
        self,
        limit: int = 20,
        offset: int = 0,
        access_scope: AccessScope = "owned",
        project_id: str | None = None,
    ) -> APIFuture[types.TrainingRunsResponse]:
        listing = self._b.list_training_runs(limit=limit, offset=offset)
        return self._scoped(listing, access_scope, project_id)

    # ---- sessions ------------------------------------------------------------------------------
    def list_sessions(
        self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned"
    ) -> APIFuture[types.ListSessionsResponse]:
        """This caller's session ids, newest first, ``limit`` from ``offset``."""
        return self._scoped(self._b.list_sessions(limit=limit, offset=offset), access_scope)

    def get_session(
        self, session_id: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[types.GetSessionResponse]:
        """A session's training run ids, sampler ids, ``user_metadata`` and ``display_name``
        (ids as `list_sessions` gives them)."""
        return self._scoped(
            self._b.get_session(session_id),
            access_scope,
            url=rest_args.url(f"/api/v1/sessions/{session_id}", session_id=session_id),
            unknown=rest_args.not_an_id("session", session_id=session_id),
        )

    def search_sessions(
        self, request: types.SessionSearchRequest
    ) -> APIFuture[types.SessionSearchResponse]:
        """One page of the organization's sessions, newest first (a hosted-service endpoint,
        experimental in the SDK; the embedded engine and `tinker-sr serve` refuse it: 400)."""
        from tinker_sr import ExperimentalWarning

        warnings.warn(
            "RestClient.search_sessions is experimental: it may change or be removed in any "
            "release without a deprecation period.",
            ExperimentalWarning,
            stacklevel=2,
        )
        return self._f(self._b.search_sessions(request))

    def assign_session_project(self, session_id: str, project_id: str) -> APIFuture[None]:
        """Move a session into a project (a hosted-service endpoint; refused here: 400)."""
        return self._checked(
            self._b.assign_session_project(session_id, project_id),
            rest_args.url(f"/api/v1/sessions/{session_id}/project", session_id=session_id),
        )

    def export_session_trace(self, session_id: str) -> APIFuture[str]:
        """A signed URL of the session's trace file (a hosted-service endpoint; refused here:
        400)."""
        route = f"/api/v1/sessions/{session_id}/trace_export"
        return self._checked(
            self._b.export_session_trace(session_id),
            rest_args.url(route, session_id=session_id),
        )

    def whoami(self) -> APIFuture[types.WhoamiResponse]:
        """The caller's identity, which the SDK reads from a JWT of the hosted service's auth;
        fails as the SDK does with a plain API key (no server issues JWTs to this client)."""

        async def fail() -> types.WhoamiResponse:
            raise RuntimeError(
                "whoami requires JWT auth, but the server has it disabled and the credential "
                "is a plain API key."
            )

        return self._f(fail())

    # ---- checkpoints ---------------------------------------------------------------------------
    def list_checkpoints(self, training_run_id: str) -> APIFuture[types.CheckpointsListResponse]:
        return self._checked(
            self._b.list_checkpoints(training_run_id),
            rest_args.empty(training_run_id=training_run_id),
            rest_args.url(
                f"/api/v1/training_runs/{training_run_id}/checkpoints",
                training_run_id=training_run_id,
            ),
            rest_args.not_an_id("training run", training_run_id=training_run_id),
        )

    def list_user_checkpoints(
        self, limit: int = 100, offset: int = 0
    ) -> APIFuture[types.CheckpointsListResponse]:
        return self._f(self._b.list_user_checkpoints(limit=limit, offset=offset))

    def get_weights_info_by_tinker_path(
        self, tinker_path: str
    ) -> APIFuture[types.WeightsInfoResponse]:
        """Base model and LoRA configuration (rank, trained layers) of a checkpoint of either
        kind: what is needed to load it. A malformed path fails the future
        (`BadRequestError`), as the SDK sends any path to the service."""
        return self._checked(
            self._b.get_weights_info(tinker_path),
            rest_args.body_str("weights_info", "tinker_path", tinker_path),
        )

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        route = f"/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}"
        return self._checked(
            self._b.delete_checkpoint(training_run_id, checkpoint_id),
            rest_args.url(
                route,
                path_args=("checkpoint_id",),
                training_run_id=training_run_id,
                checkpoint_id=checkpoint_id,
            ),
            rest_args.query_in_checkpoint_id(checkpoint_id),
            rest_args.not_an_id("training run", training_run_id=training_run_id),
            rest_args.not_an_id("checkpoint", checkpoint_id=checkpoint_id),
        )

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self.delete_checkpoint(parsed.training_run_id, parsed.checkpoint_id)

    def set_checkpoint_ttl_from_tinker_path(
        self, tinker_path: str, ttl_seconds: int | None
    ) -> APIFuture[None]:
        """Expire the checkpoint ``ttl_seconds`` from now (3600 to 10 years), or never
        (``None``)."""
        body = rest_args.unencodable("checkpoint ttl", "ttl_seconds", ttl_seconds)
        url = _checkpoint_url(tinker_path, "/ttl", body=body)
        return self._checked(self._b.set_checkpoint_ttl(tinker_path, ttl_seconds), url)

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Mark one of your checkpoints public (``Checkpoint.public`` becomes ``True``). On a
        server, other API keys may then load, sample from, copy and inspect it (not list,
        delete or change it). Publishing a public checkpoint is a no-op (the hosted service
        answers 409 instead)."""
        url = _checkpoint_url(tinker_path, "/publish")
        return self._checked(self._b.set_checkpoint_public(tinker_path, True), url)

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Make a published checkpoint private again (a no-op if it is private)."""
        url = _checkpoint_url(tinker_path, "/publish")
        checkpoint_id = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).checkpoint_id
        query = rest_args.query_in_checkpoint_id(f"{checkpoint_id}/publish")  # a DELETE too
        return self._checked(self._b.set_checkpoint_public(tinker_path, False), url, query)

    def copy_weights(
        self,
        path: str,
        destination_project_id: str | None = None,
        *,
        ttl_seconds: int | None = None,
        weights_access_token: str | None = None,
    ) -> APIFuture[str]:
        """Copy a checkpoint of either kind; the future resolves to the copy's tinker path.

        The copy goes into run 0 of a new session of project ``destination_project_id``
        (default ``$TINKER_PROJECT_ID``; unlike the official SDK, neither is required, since
        tinker_sr has no project permissions), owned by this API key:
        ``tinker://<new session>:train:0/<segment>/<name>``. It keeps the source's kind and
        name, loads exactly like it, is private, and survives deleting the source; the new
        run cannot be trained on. ``ttl_seconds``: 3600 (1 hour) to 10 years, or ``None``
        for no expiry (the source's expiry is not inherited). ``weights_access_token`` is
        not supported (the call fails). To copy into your own session, use
        ``ServiceClient.copy_weights``. A malformed path fails the future (`BadRequestError`),
        as the SDK sends any path to the service.
        """
        if destination_project_id is None:
            destination_project_id = os.environ.get("TINKER_PROJECT_ID") or None
        # Built at once, as the SDK builds its request: an argument of the wrong type raises
        # pydantic's ValidationError here, not a failed future.
        request = types.CopyWeightsRequest(
            source_path=path, destination_project_id=destination_project_id, ttl_seconds=ttl_seconds
        )
        return self._f(
            self._b.copy_weights(
                request.source_path,
                destination_project_id=request.destination_project_id,
                ttl_seconds=request.ttl_seconds,
                weights_access_token=weights_access_token,
            )
        )

    def get_external_weights_urls(
        self, tinker_path: str
    ) -> APIFuture[types.ExternalWeightsUrlsResponse]:
        """Signed download URLs of an ``external_weights`` checkpoint.

        Not supported by tinker_sr: its engine produces no external weights
        (``TrainingClient.save_weights_external`` is unsupported), so on the embedded engine
        and on a tinker_sr server the future fails (`NotImplementedError` here, a 400
        ``BadRequestError`` from a server). A path that is not ``external_weights`` raises
        `ValueError` at once, as in the official SDK.
        """
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        if parsed.checkpoint_type != "external":
            raise ValueError(
                "get_external_weights_urls only accepts external weights checkpoints "
                f"(tinker://<training_run_id>/external_weights/<name>), got {tinker_path!r}"
            )
        return self._checked(
            self._b.get_external_weights_urls(tinker_path),
            rest_args.empty(
                training_run_id=parsed.training_run_id, checkpoint_id=parsed.checkpoint_id
            ),
            _checkpoint_url(tinker_path, "/external_weights_urls"),
        )

    def get_checkpoint_by_tinker_path(self, tinker_path: str) -> APIFuture[types.Checkpoint]:
        """(tinker_sr addition) One checkpoint's metadata."""
        types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self._f(self._b.get_checkpoint(tinker_path))

    # ---- deprecated coroutine twins ----------------------------------------------------------
    @deprecated_call("get_sampler_async is deprecated; await get_sampler()")
    async def get_sampler_async(self, sampler_id: str) -> types.GetSamplerResponse:
        return await self.get_sampler(sampler_id)

    @deprecated_call("list_sessions_async is deprecated; await list_sessions()")
    async def list_sessions_async(
        self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned"
    ) -> types.ListSessionsResponse:
        return await self.list_sessions(limit, offset, access_scope)

    @deprecated_call("get_session_async is deprecated; await get_session()")
    async def get_session_async(
        self, session_id: str, access_scope: AccessScope = "owned"
    ) -> types.GetSessionResponse:
        return await self.get_session(session_id, access_scope)

    @deprecated_call("assign_session_project_async is deprecated; await assign_session_project()")
    async def assign_session_project_async(self, session_id: str, project_id: str) -> None:
        return await self.assign_session_project(session_id, project_id)

    @deprecated_call("export_session_trace_async is deprecated; await export_session_trace()")
    async def export_session_trace_async(self, session_id: str) -> str:
        return await self.export_session_trace(session_id)

    @deprecated_call("get_training_run_async is deprecated; await get_training_run()")
    async def get_training_run_async(
        self, training_run_id: str, access_scope: AccessScope = "owned"
    ) -> types.TrainingRun:
        return await self.get_training_run(training_run_id, access_scope)

    @deprecated_call("get_training_run_by_tinker_path_async is deprecated")
    async def get_training_run_by_tinker_path_async(
        self, tinker_path: str, access_scope: AccessScope = "owned"
    ) -> types.TrainingRun:
        return await self.get_training_run_by_tinker_path(tinker_path, access_scope)

    @deprecated_call("list_training_runs_async is deprecated; await list_training_runs()")
    async def list_training_runs_async(
        self,
        limit: int = 20,
        offset: int = 0,
        access_scope: AccessScope = "owned",
        project_id: str | None = None,
    ) -> types.TrainingRunsResponse:
        return await self.list_training_runs(limit, offset, access_scope, project_id)

    @deprecated_call("list_checkpoints_async is deprecated; await list_checkpoints()")
    async def list_checkpoints_async(self, training_run_id: str) -> types.CheckpointsListResponse:
        return await self.list_checkpoints(training_run_id)

    @deprecated_call("list_user_checkpoints_async is deprecated; await list_user_checkpoints()")
    async def list_user_checkpoints_async(
        self, limit: int = 100, offset: int = 0
    ) -> types.CheckpointsListResponse:
        return await self.list_user_checkpoints(limit, offset)

    @deprecated_call("delete_checkpoint_async is deprecated; await delete_checkpoint()")
    async def delete_checkpoint_async(self, training_run_id: str, checkpoint_id: str) -> None:
        await self.delete_checkpoint(training_run_id, checkpoint_id)

    @deprecated_call("delete_checkpoint_from_tinker_path_async is deprecated")
    async def delete_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        await self.delete_checkpoint_from_tinker_path(tinker_path)

    @deprecated_call("set_checkpoint_ttl_from_tinker_path_async is deprecated")
    async def set_checkpoint_ttl_from_tinker_path_async(
        self, tinker_path: str, ttl_seconds: int | None
    ) -> None:
        await self.set_checkpoint_ttl_from_tinker_path(tinker_path, ttl_seconds)

    @deprecated_call("publish_checkpoint_from_tinker_path_async is deprecated")
    async def publish_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        await self.publish_checkpoint_from_tinker_path(tinker_path)

    @deprecated_call("unpublish_checkpoint_from_tinker_path_async is deprecated")
    async def unpublish_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        await self.unpublish_checkpoint_from_tinker_path(tinker_path)

    @deprecated_call("copy_weights_async is deprecated; await copy_weights()")
    async def copy_weights_async(
        self,
        path: str,
        destination_project_id: str | None = None,
        *,
        ttl_seconds: int | None = None,
        weights_access_token: str | None = None,
    ) -> str:
        return await self.copy_weights(
            path,
            destination_project_id,
            ttl_seconds=ttl_seconds,
            weights_access_token=weights_access_token,
        )

    @deprecated_call(
        "get_external_weights_urls_async is deprecated; await get_external_weights_urls()"
    )
    async def get_external_weights_urls_async(
        self, tinker_path: str
    ) -> types.ExternalWeightsUrlsResponse:
        return await self.get_external_weights_urls(tinker_path)

    # ---- admin endpoints (deprecated here in the SDK, moved to AdminClient) ------------------
    def _admin(self) -> AdminClient:
        return AdminClient(self.holder)

    def get_audit_log(
        self, event_type: AuditEventType = "all", day: date | None = None
    ) -> APIFuture[types.AuditLogResponse]:
        """Deprecated: `AdminClient.get_audit_log` (which raises: tinker_sr keeps no audit log)."""
        warn_deprecated("RestClient.get_audit_log() is deprecated; use AdminClient.get_audit_log()")
        return self._admin().get_audit_log(event_type, day)

    @deprecated_call("RestClient.get_audit_log_async() is deprecated; use AdminClient")
    async def get_audit_log_async(
        self, event_type: AuditEventType = "all", day: date | None = None
    ) -> types.AuditLogResponse:
        return await self._admin().get_audit_log_async(event_type, day)

    def get_billing_usage(self, starting_on: datetime | str, ending_before: datetime | str) -> Any:
        """Deprecated: `AdminClient.get_billing_usage`."""
        warn_deprecated("RestClient.get_billing_usage() is deprecated; use AdminClient")
        return self._admin().get_billing_usage(starting_on, ending_before)

    @deprecated_call("RestClient.get_billing_usage_async() is deprecated; use AdminClient")
    async def get_billing_usage_async(
        self, starting_on: datetime | str, ending_before: datetime | str
    ) -> Any:
        return await self._admin().get_billing_usage_async(starting_on, ending_before)

    def get_current_checkpoint_storage_usage(self, project_id: str | None = None) -> Any:
        """Deprecated: `AdminClient.get_current_checkpoint_storage_usage`."""
        warn_deprecated("RestClient.get_current_checkpoint_storage_usage() is deprecated")
        return self._admin().get_current_checkpoint_storage_usage(project_id)

    @deprecated_call("RestClient.get_current_checkpoint_storage_usage_async() is deprecated")
    async def get_current_checkpoint_storage_usage_async(
        self, project_id: str | None = None
    ) -> Any:
        return await self._admin().get_current_checkpoint_storage_usage_async(project_id)


async def _fail(problem: Exception) -> Any:
    raise problem


def _checkpoint_url(
    tinker_path: str, suffix: str, *, body: Exception | None = None
) -> Exception | None:
    """Parse ``tinker_path`` (a malformed one raises `ValueError` at once, as in the SDK);
    then what becomes of the SDK's request on that checkpoint (`rest_args.url`), its body's
    encoding problem (``body``) met after the URL's own and before a server's 404."""
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    run, checkpoint = parsed.training_run_id, parsed.checkpoint_id
    route = f"/api/v1/training_runs/{run}/checkpoints/{checkpoint}{suffix}"
    return rest_args.first(
        rest_args.invalid_url(route, tinker_path=tinker_path),
        body,
        rest_args.no_endpoint(
            route, path_args=("checkpoint_id",), training_run_id=run, checkpoint_id=checkpoint
        ),
    )
