"""The embedded engine's REST queries: checkpoints, training runs and sessions (what
`RestClient` reads) and usage (what `AdminClient` reads), as a mixin of `LocalBackend`, which
supplies the store, the checkpoint store, the model registry and `_run` (work on the engine's
worker). `copy_weights` is here too: it writes a checkpoint, but as a REST call (no training
model, no ``seq_id``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tinker_sr import types, validation
from tinker_sr.backend.local_errors import mapped
from tinker_sr.engine import usage
from tinker_sr.engine.checkpoint_store import parse_path
from tinker_sr.errors import refusal
from tinker_sr.user_errors import SESSION_QUERIES_UNSUPPORTED, EngineNotFoundError

if TYPE_CHECKING:
    from tinker_sr.engine.checkpoint_store import CheckpointStore
    from tinker_sr.engine.registry import ModelRegistry
    from tinker_sr.engine.store import Store

T = TypeVar("T")


def _not_offered(path: str) -> Exception:
    return refusal(
        400,
        f"/api/v1/{path} is not supported by the embedded engine: {SESSION_QUERIES_UNSUPPORTED}",
    )


class LocalRestQueries:
    store: Store
    checkpoints: CheckpointStore
    models: ModelRegistry
    rate_card: usage.RateCard | None
    store_dir: Path
    _closed: bool

    async def _run(self, fn: Callable[[], T], *, plain: bool = False) -> T:  # LocalBackend's
        raise NotImplementedError

    def _add_session(
        self,
        *,
        user_metadata: Mapping[str, str] | None,
        project_id: str | None,
        display_name: str | None,
        tags: list[str] | None = None,
    ) -> str:  # LocalBackend's
        raise NotImplementedError

    def _new_model_id(self, session_id: str, model_seq_id: int) -> str:  # LocalBackend's
        raise NotImplementedError

    def _check_session(self, session_id: str) -> None:  # LocalBackend's
        raise NotImplementedError

    async def _query(self, fn: Callable[[], T]) -> T:
        """Run a query: a plain call (a server answers it directly, so a refusal is
        `NotFoundError` / `BadRequestError`, not a failed future)."""
        return await self._run(fn, plain=True)

    async def _read(self, fn: Callable[[], T]) -> T:
        """A read-only query, on a thread of its own (the store is thread-safe), as a plain
        call. On the engine's worker a listing waited for whatever training step ran, any
        session's: 15-20 s behind another key's large step on a shared server (a hunt)."""
        if self._closed:  # as `_run`: the store is closed
            raise RuntimeError("LocalBackend is closed")
        try:
            return await mapped(asyncio.to_thread(fn), self.store_dir, plain=True)
        except Exception:
            if self._closed:  # closed while it read (a closed database's error)
                raise RuntimeError("LocalBackend is closed") from None
            raise

    # ---- sessions -----------------------------------------------------------------------
    async def list_sessions(
        self, *, limit: int = 20, offset: int = 0
    ) -> types.ListSessionsResponse:
        """Session ids, newest first."""

        def work() -> list[str]:
            validation.check_paging(limit, offset, "list_sessions")
            return self.store.list_sessions(limit=limit, offset=offset)

        ids = await self._read(work)
        return types.ListSessionsResponse(sessions=ids)

    async def get_session(self, session_id: str) -> types.GetSessionResponse:
        """A session's training runs, its live sampling sessions and what it was created with."""

        def work() -> types.GetSessionResponse:
            info = self.store.session_info(session_id)
            if info is None:
                raise EngineNotFoundError(f"unknown session {session_id!r}")
            return types.GetSessionResponse(
                training_run_ids=info.run_ids,
                sampler_ids=self.models.sampler_ids(session_id),
                user_metadata=info.user_metadata,
                display_name=info.display_name,
            )

        return await self._read(work)

    # Hosted-service endpoints the embedded engine does not offer: refused as `tinker-sr serve`
    # refuses them (400), so code written against the hosted service fails the same way here.
    async def search_sessions(
        self, request: types.SessionSearchRequest
    ) -> types.SessionSearchResponse:
        raise _not_offered("sessions/search")

    async def assign_session_project(self, session_id: str, project_id: str) -> None:
        raise _not_offered(f"sessions/{session_id}/project")

    async def export_session_trace(self, session_id: str) -> str:
        raise _not_offered(f"sessions/{session_id}/trace_export")

    # ---- usage (engine.usage) -------------------------------------------------------------
    # Read on a thread of their own (`_read`), not the engine's worker: a look at usage does
    # not wait for a training step.
    async def get_billing_usage(
        self,
        starting_on: datetime | str,
        ending_before: datetime | str,
        *,
        sessions: Collection[str] | None = None,
    ) -> types.BillingUsageResponse:
        """Hourly usage in ``[starting_on, ending_before)`` (`engine.usage`), of ``sessions``
        only when given (a server's caller sees its own)."""

        def work() -> types.BillingUsageResponse:
            start, end = usage.check_window(starting_on, ending_before, time.time())
            rows = self.store.usage_rows(start, end)
            rows = [r for r in rows if usage.only(sessions, r.session_id)]
            attributes = self.store.session_attributes({r.session_id for r in rows})
            return usage.billing_response(rows, attributes, self.rate_card)

        return await self._read(work)

    async def get_current_checkpoint_storage_usage(
        self, project_id: str | None = None, *, sessions: Collection[str] | None = None
    ) -> types.CurrentCheckpointStorageUsageResponse:
        """The checkpoints stored now, per project (of ``sessions`` only when given)."""

        def work() -> types.CurrentCheckpointStorageUsageResponse:
            live = self.store.live_checkpoint_sizes(time.time())
            mine = [c for c in live if usage.only(sessions, c[0])]
            return usage.storage_response(mine, self.rate_card, project_id)

        return await self._read(work)

    # ---- checkpoints and training runs ----------------------------------------------------
    async def list_checkpoints(self, training_run_id: str) -> types.CheckpointsListResponse:
        return await self._read(lambda: self.checkpoints.list_run(training_run_id))

    async def list_user_checkpoints(
        self, *, limit: int = 100, offset: int = 0, runs: Collection[str] | None = None
    ) -> types.CheckpointsListResponse:
        def work() -> types.CheckpointsListResponse:
            validation.check_paging(limit, offset, "list_user_checkpoints")
            return self.checkpoints.list_all(limit=limit, offset=offset, runs=runs)

        return await self._read(work)

    async def get_training_run(self, training_run_id: str) -> types.TrainingRun:
        return await self._read(lambda: self.checkpoints.training_run(training_run_id))

    async def list_training_runs(
        self, *, limit: int = 20, offset: int = 0, runs: Collection[str] | None = None
    ) -> types.TrainingRunsResponse:
        def work() -> types.TrainingRunsResponse:
            validation.check_paging(limit, offset, "list_training_runs")
            return self.checkpoints.training_runs(limit=limit, offset=offset, runs=runs)

        return await self._read(work)

    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> None:
        await self._query(lambda: self.checkpoints.delete(training_run_id, checkpoint_id))

    async def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        await self._query(lambda: self.checkpoints.set_ttl(tinker_path, ttl_seconds))

    async def get_checkpoint(self, tinker_path: str) -> types.Checkpoint:
        return await self._read(
            lambda: self.checkpoints.checkpoint(self.checkpoints.live(tinker_path))
        )

    def checkpoint_info(self, tinker_path: str) -> dict[str, Any]:
        """Base model and LoRA config of a checkpoint (for ``weights_info``)."""
        return self.checkpoints.info(tinker_path)

    async def get_weights_info(self, tinker_path: str) -> types.WeightsInfoResponse:
        return await self._read(lambda: self.checkpoints.weights_info(tinker_path))

    async def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        await self._query(lambda: self.checkpoints.set_public(tinker_path, public))

    async def external_weights_files(self, tinker_path: str) -> tuple[str, dict[str, Path]]:
        """An export's version and files (the server signs URLs to them)."""
        return await self._query(lambda: self.checkpoints.files(tinker_path))

    async def get_external_weights_urls(
        self, tinker_path: str
    ) -> types.ExternalWeightsUrlsResponse:
        """``file://`` URLs: the embedded engine's files are on this machine. They do not
        expire; ``expires`` says an hour, as signed URLs of a server do."""
        _, files = await self.external_weights_files(tinker_path)
        return types.ExternalWeightsUrlsResponse(
            urls={name: f.resolve().as_uri() for name, f in files.items()},
            expires=datetime.now(UTC) + timedelta(seconds=validation.EXTERNAL_URL_TTL_S),
        )

    async def copy_weights(
        self,
        source_path: str,
        *,
        session_id: str | None = None,
        model_seq_id: int | None = None,
        destination_project_id: str | None = None,
        ttl_seconds: int | None = None,
        weights_access_token: str | None = None,
    ) -> str:
        """See `Backend.copy_weights` and `CheckpointStore.copy`."""

        def work() -> str:
            parse_path(source_path)
            validation.check_copy_weights(
                session_id=session_id,
                model_seq_id=model_seq_id,
                destination_project_id=destination_project_id,
                ttl_seconds=ttl_seconds,
                weights_access_token=weights_access_token,
            )
            expires_at = validation.expiry(ttl_seconds)
            self.checkpoints.copyable(source_path)
            row, source_run = self.checkpoints.with_run(source_path)
            if session_id is None:
                sid = self._add_session(
                    user_metadata=None, project_id=destination_project_id, display_name=None
                )
                run_id = self._new_model_id(sid, 0)
            else:
                self._check_session(session_id)
                assert model_seq_id is not None
                sid, run_id = session_id, self._new_model_id(session_id, model_seq_id)
            new_path = self.checkpoints.copy(
                row, source_run, session_id=sid, run_id=run_id, expires_at=expires_at
            )
            if session_id is None:
                self.store.close_session(sid, "success")  # it only holds the copy
            return new_path

        return await self._run(work, plain=True)
