"""Real cgroups for tests that need a limit the kernel enforces: made under this process's own
v1 groups and removed after; the test is skipped where that is not allowed."""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tinker_sr.engine import cgroups


def real_v1_group_pair() -> Iterator[tuple[Path, Path]]:
    """A fresh memory group and cpu group under this process's own v1 groups, removed after;
    skipped where the host has no writable v1 hierarchy (not root, v2 only, read-only)."""
    groups = cgroups._membership(cgroups.PROC_CGROUP)
    made: list[Path] = []
    try:
        for name in ("memory", "cpu"):
            if name not in groups or not (cgroups.ROOT / name).is_dir():
                pytest.skip(f"no cgroup v1 {name} hierarchy here")
            group = cgroups.group_dirs(name)[0] / f"tinker-sr-test-{uuid.uuid4().hex[:8]}"
            try:
                group.mkdir()
            except OSError as e:
                pytest.skip(f"cannot make a cgroup here: {e}")
            made.append(group)
        yield made[0], made[1]
    finally:
        for group in made:
            if not cgroups.remove_group(group):
                warnings.warn(f"could not remove the test's cgroup {group}", stacklevel=1)


def limit_memory(group: Path, limit: int) -> None:
    """Set a v1 memory group's limit (no swap beyond it); skip the test where it may not."""
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        pytest.skip(f"cannot set a cgroup memory limit here: {e}")


def move(pid: int, group: Path) -> None:
    (group / "cgroup.procs").write_text(str(pid))


def real_pids_group() -> Iterator[Path]:
    """A fresh pids group under this process's own (v1 or v2), removed after; skipped where
    the host has no writable pids hierarchy."""
    dirs = cgroups.group_dirs("pids")
    if not dirs:
        pytest.skip("no cgroup pids hierarchy here")
    group = dirs[0] / f"tinker-sr-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a cgroup here: {e}")
    try:
        if not (group / "pids.max").exists():
            pytest.skip("the new group has no pids.max (controller not enabled for it)")
        yield group
    finally:
        if not cgroups.remove_group(group):
            warnings.warn(f"could not remove the test's cgroup {group}", stacklevel=1)
