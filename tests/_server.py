"""A real server subprocess for tests: see `tinker_sr.testing.server` (one implementation,
shared with the `tinker_server` pytest fixture)."""

from __future__ import annotations

from tinker_sr.testing.server import ServerProcess, free_port, running_server

__all__ = ["ServerProcess", "free_port", "running_server"]
