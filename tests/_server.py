"""A real server subprocess for tests: see `tinker_sr.testing.server` (one implementation,
shared with the `tinker_server` pytest fixture)."""

from __future__ import annotations

from pathlib import Path

from tinker_sr.testing.server import ServerProcess, free_port, running_server

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "ServerProcess", "free_port", "running_server"]
