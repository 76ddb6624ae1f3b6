"""`AdminClient`: the official SDK's client for organization-admin REST endpoints (billing
usage, checkpoint storage usage, audit log).

Usage is counted by the engine (`tinker_sr.engine.usage`): `get_billing_usage` and
`get_current_checkpoint_storage_usage` answer from it, embedded or from ``tinker-sr serve``.
tinker_sr has no organizations or audit log: `get_audit_log` raises `NotImplementedError`.
"""

from __future__ import annotations

from collections.abc import Coroutine
from datetime import date, datetime
from typing import Any, Literal, NoReturn, TypeVar

from tinker_sr import types
from tinker_sr.clients.holder import ClientSession, deprecated_call, make_backend
from tinker_sr.futures import APIFuture, AwaitableConcurrentFuture

T = TypeVar("T")

AuditEventType = Literal["all", "checkpoints", "projects", "teams", "organizations"]


def _unsupported(method: str) -> NoReturn:
    raise NotImplementedError(
        f"AdminClient.{method}() is not available: tinker_sr keeps no audit log (it has no "
        "organizations). Use RestClient for training runs and checkpoints."
    )


class AdminClient:
    """Constructed like the SDK's ``AdminClient`` (and like `RestClient`). Every method
    returns an `APIFuture` (await it, or call ``.result()``), as the SDK's do."""

    def __init__(
        self,
        _holder: ClientSession | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        if _holder is not None and (base_url is not None or api_key is not None):
            raise ValueError(
                "AdminClient takes either a holder or base_url/api_key, not both: a holder "
                "already carries its own base URL and credentials"
            )
        self._holder = _holder
        self._base_url = base_url
        self._api_key = api_key

    @property
    def holder(self) -> ClientSession:
        """The connection holder, built on first access (no method here needs one, so
        constructing an AdminClient opens no store and no connection)."""
        if self._holder is None:
            backend, url = make_backend(
                backend=None, base_url=self._base_url, api_key=self._api_key
            )
            self._holder = ClientSession(
                backend, base_url=url, api_key=self._api_key, owns_backend=url is not None
            )
        return self._holder

    def __repr__(self) -> str:
        where = self._holder.base_url if self._holder is not None else self._base_url
        return f"AdminClient({where or 'default backend'})"

    def get_telemetry(self) -> Any:
        """tinker_sr sends no telemetry: always ``None``."""
        return None

    def get_audit_log(
        self, event_type: AuditEventType = "all", day: date | None = None
    ) -> APIFuture[types.AuditLogResponse]:
        _unsupported("get_audit_log")

    async def get_audit_log_async(
        self, event_type: AuditEventType = "all", day: date | None = None
    ) -> types.AuditLogResponse:
        _unsupported("get_audit_log_async")

    def _f(self, coro: Coroutine[Any, Any, T]) -> APIFuture[T]:
        return AwaitableConcurrentFuture(self.holder.run(coro))

    def get_billing_usage(
        self, starting_on: datetime | str, ending_before: datetime | str
    ) -> APIFuture[types.BillingUsageResponse]:
        """Hourly usage buckets in ``[starting_on, ending_before)``: tokens trained, prompt
        tokens prefilled (``cached``: served by the prompt cache), tokens sampled, and
        checkpoints saved, per session and base model (`tinker_sr.engine.usage`). Both ends
        on a UTC hour (RFC 3339 strings or datetimes; a time without a zone is UTC), the
        start not in the future, at most 14 days apart. Embedded: every session of the
        store; from a server: the caller's. Costs are estimated only with a rate card
        (``$TINKER_SR_RATE_CARD``, ``tinker-sr serve --rate-card``); otherwise null."""
        request = types.GetBillingUsageRequest.model_validate(
            {"starting_on": starting_on, "ending_before": ending_before}
        )  # bad arguments fail here, as in the official SDK
        return self._f(
            self.holder.backend.get_billing_usage(request.starting_on, request.ending_before)
        )

    @deprecated_call(
        "AdminClient.get_billing_usage_async() is deprecated; await get_billing_usage()"
    )
    async def get_billing_usage_async(
        self, starting_on: datetime | str, ending_before: datetime | str
    ) -> types.BillingUsageResponse:
        return await self.get_billing_usage(starting_on, ending_before)

    def get_current_checkpoint_storage_usage(
        self, project_id: str | None = None
    ) -> APIFuture[types.CurrentCheckpointStorageUsageResponse]:
        """The checkpoints stored now (not expired): count and bytes, per project (only
        ``project_id``'s when given); a monthly cost only with a rate card's
        ``storage_gb_month``."""
        request = types.GetCurrentCheckpointStorageUsageRequest(project_id=project_id)
        return self._f(self.holder.backend.get_current_checkpoint_storage_usage(request.project_id))

    @deprecated_call(
        "AdminClient.get_current_checkpoint_storage_usage_async() is deprecated; await "
        "get_current_checkpoint_storage_usage()"
    )
    async def get_current_checkpoint_storage_usage_async(
        self, project_id: str | None = None
    ) -> types.CurrentCheckpointStorageUsageResponse:
        return await self.get_current_checkpoint_storage_usage(project_id)
