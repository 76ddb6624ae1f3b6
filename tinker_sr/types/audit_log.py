"""Audit-log response types (``tinker.types.AuditLogEntry`` / ``AuditLogResponse``).

tinker_sr keeps no audit log (`AdminClient.get_audit_log` says so); the types exist so code
that imports or builds them (the cookbook's ``scripts/save_audit_log.py``) runs unchanged.
"""

from __future__ import annotations

from datetime import datetime

from ._base import BaseModel

__all__ = ["AuditLogEntry", "AuditLogResponse"]


class AuditLogEntry(BaseModel):
    """One event of an organization's audit log."""

    timestamp: datetime
    event: str
    """``<resource>_<action>``, e.g. ``checkpoint_read``."""
    event_details: dict[str, object] = {}
    model_id: str | None = None
    """Deprecated in the SDK (read ``event_details``); set on checkpoint events only."""
    tinker_path: str | None = None
    """Deprecated in the SDK (read ``event_details``); set on checkpoint events only."""
    purpose: str | None = None
    """Deprecated in the SDK (read ``event_details``); set on checkpoint reads only."""


class AuditLogResponse(BaseModel):
    entries: list[AuditLogEntry]
    """Sorted by timestamp."""
