"""`AdminClient`: the official SDK's client for organization-admin REST endpoints (billing
usage, checkpoint storage usage, audit log).

tinker_sr has no organizations, billing or audit log, so the class exists for import and
construction compatibility only: every method raises `NotImplementedError` naming itself.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, Literal, NoReturn

from tinker_sr import types
from tinker_sr.clients.holder import ClientSession, make_backend
from tinker_sr.futures import APIFuture

AuditEventType = Literal["all", "checkpoints", "projects", "teams", "organizations"]


def _unsupported(method: str) -> NoReturn:
    raise NotImplementedError(
        f"AdminClient.{method}() is not available: admin, billing and audit-log endpoints are "
        "not part of tinker_sr (it has no organizations or billing). Use RestClient for "
        "training runs and checkpoints."
    )


class AdminClient:
    """Constructed like the SDK's ``AdminClient`` (and like `RestClient`); every method
    raises `NotImplementedError` because tinker_sr offers no admin endpoints."""

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

    def get_billing_usage(self, starting_on: datetime | str, ending_before: datetime | str) -> Any:
        _unsupported("get_billing_usage")

    async def get_billing_usage_async(
        self, starting_on: datetime | str, ending_before: datetime | str
    ) -> Any:
        _unsupported("get_billing_usage_async")

    def get_current_checkpoint_storage_usage(self, project_id: str | None = None) -> Any:
        _unsupported("get_current_checkpoint_storage_usage")

    async def get_current_checkpoint_storage_usage_async(
        self, project_id: str | None = None
    ) -> Any:
        _unsupported("get_current_checkpoint_storage_usage_async")
