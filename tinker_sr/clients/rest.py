"""`RestClient`: look up training runs and checkpoints; needs no session."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from tinker_sr import types
from tinker_sr.clients.holder import ClientHolder, make_backend, warn_deprecated
from tinker_sr.futures import APIFuture, AwaitableConcurrentFuture

T = TypeVar("T")
AccessScope = Literal["owned", "accessible"]


class RestClient:
    """Every method returns an `APIFuture`."""

    def __init__(
        self,
        _holder: ClientHolder | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        if _holder is None:
            backend, url = make_backend(backend=None, base_url=base_url, api_key=api_key)
            _holder = ClientHolder(
                backend, base_url=url, api_key=api_key, owns_backend=url is not None
            )
        self.holder = _holder

    def _f(self, coro: Coroutine[Any, Any, T]) -> APIFuture[T]:
        return AwaitableConcurrentFuture(self.holder.run(coro))

    @property
    def _b(self) -> Any:
        return self.holder.backend

    def get_server_capabilities(self) -> APIFuture[types.GetServerCapabilitiesResponse]:
        return self._f(self._b.get_server_capabilities())

    def get_training_run(
        self, training_run_id: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[types.TrainingRun]:
        return self._f(self._b.get_training_run(training_run_id))

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
        return self._f(self._b.list_training_runs(limit=limit, offset=offset))

    def list_checkpoints(self, training_run_id: str) -> APIFuture[types.CheckpointsListResponse]:
        return self._f(self._b.list_checkpoints(training_run_id))

    def list_user_checkpoints(
        self, limit: int = 100, offset: int = 0
    ) -> APIFuture[types.CheckpointsListResponse]:
        return self._f(self._b.list_user_checkpoints(limit=limit, offset=offset))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        return self._f(self._b.delete_checkpoint(training_run_id, checkpoint_id))

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self.delete_checkpoint(parsed.training_run_id, parsed.checkpoint_id)

    def set_checkpoint_ttl_from_tinker_path(
        self, tinker_path: str, ttl_seconds: int | None
    ) -> APIFuture[None]:
        types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self._f(self._b.set_checkpoint_ttl(tinker_path, ttl_seconds))

    def get_checkpoint_by_tinker_path(self, tinker_path: str) -> APIFuture[types.Checkpoint]:
        """(tinker_sr addition) One checkpoint's metadata."""
        types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self._f(self._b.get_checkpoint(tinker_path))

    # ---- deprecated coroutine twins ----------------------------------------------------------
    async def list_checkpoints_async(self, training_run_id: str) -> types.CheckpointsListResponse:
        warn_deprecated("list_checkpoints_async is deprecated; await list_checkpoints()")
        return await self.list_checkpoints(training_run_id)

    async def get_training_run_by_tinker_path_async(
        self, tinker_path: str, access_scope: AccessScope = "owned"
    ) -> types.TrainingRun:
        warn_deprecated("get_training_run_by_tinker_path_async is deprecated")
        return await self.get_training_run_by_tinker_path(tinker_path, access_scope)

    async def delete_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        warn_deprecated("delete_checkpoint_from_tinker_path_async is deprecated")
        await self.delete_checkpoint_from_tinker_path(tinker_path)
