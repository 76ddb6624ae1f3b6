"""What a Linux control group allows this process: its CPU quota, and the memory left under its
memory limit, on cgroup v2 (unified) and v1 hierarchies.

A container (Docker ``--cpus 2 -m 8g``, a Kubernetes pod), a systemd scope (``systemd-run -p
MemoryMax=8G``) or a CI runner limits a process below what the machine reports: ``os.cpu_count``
and MemAvailable count the whole host. Sized by those, the engine would run more threads than
its quota and build merged sampler copies until the kernel's OOM killer ended it.

Where the limits are: ``/proc/self/cgroup`` names the process's group in each hierarchy,
relative to the hierarchy's root. Under ``/sys/fs/cgroup`` the hierarchy is mounted whole (a
host, a VM), or only from the process's own group down (a container), so `group_dirs` takes the
deepest directory of that path that exists under the mount, then every ancestor up to the
mount: a limit on any of them applies. v2 keeps ``memory.max``/``cpu.max`` in one tree at
``/sys/fs/cgroup``; v1 keeps ``memory.limit_in_bytes`` under ``/sys/fs/cgroup/memory`` and
``cpu.cfs_quota_us`` under ``/sys/fs/cgroup/cpu``. Unreadable files count as no limit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# v1 reports "no limit" as LLONG_MAX rounded down to a page; anything this large is no limit.
_V1_UNLIMITED = 1 << 60


def _membership(proc_cgroup: Path) -> dict[str, str]:
    """Controller -> the process's group path in that hierarchy ("" for the v2 hierarchy)."""
    try:
        text = proc_cgroup.read_text()
    except OSError:
        return {}
    groups: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            groups[name] = path
    return groups


def _own_and_ancestors(mount: Path, path: str) -> list[Path]:
    """The deepest existing directory for ``path`` under ``mount`` (dropping leading parts the
    mount does not show), then its ancestors up to ``mount`` itself."""
    parts = [p for p in path.split("/") if p and p != "."]
    own = mount
    if ".." in parts:  # a group outside this cgroup namespace: only the mount is ours
        parts = []
    for start in range(len(parts) + 1):
        candidate = mount.joinpath(*parts[start:])
        if _isdir(candidate):
            own = candidate
            break
    dirs = [own]
    while dirs[-1] != mount and mount in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return dirs


def _isdir(path: Path) -> bool:
    return os.path.isdir(path)  # False on any OSError (Path.is_dir raises EACCES on 3.11)


def _isfile(path: Path) -> bool:
    return os.path.isfile(path)


def group_dirs(controller: str, proc_cgroup: Path = PROC_CGROUP, root: Path = ROOT) -> list[Path]:
    """The directories whose ``controller`` ("memory", "cpu") limits apply to this process,
    innermost first: its v1 group of that controller and its ancestors (under
    ``/sys/fs/cgroup/<controller>``), or its v2 group and its ancestors where
    ``/sys/fs/cgroup`` is a v2 mount. (A hybrid host's v2 tree at ``unified`` holds no
    controllers, so it is not read.)"""
    groups = _membership(proc_cgroup)
    dirs: list[Path] = []
    if _isdir(root / controller):
        dirs += _own_and_ancestors(root / controller, groups.get(controller, "/"))
    if _isfile(root / "cgroup.controllers"):  # a v2 mount, not v1's tmpfs of mounts
        dirs += _own_and_ancestors(root, groups.get("", "/"))
    return list(dict.fromkeys(dirs))


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stat_field(path: Path, *names: str) -> int:
    """The first of ``names`` found in a ``key value`` file (memory.stat, memory.events,
    memory.oom_control), else 0."""
    try:
        fields = dict(line.split(None, 1) for line in path.read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return 0
    for name in names:
        if name in fields and fields[name].strip().isdigit():
            return int(fields[name])
    return 0


def _memory_room(group: Path) -> int | None:
    """Bytes left under ``group``'s memory limit, None where it has none. Inactive page cache
    counts as free (the kernel reclaims it before it kills anything), as ``docker stats``
    and the kubelet count a group's working set."""
    if _isfile(group / "memory.max"):  # v2: "max" is none
        limit = _read_int(group / "memory.max")
        usage = _read_int(group / "memory.current")
        inactive = stat_field(group / "memory.stat", "inactive_file")
    else:  # v1
        limit = _read_int(group / "memory.limit_in_bytes")
        if limit is not None and limit >= _V1_UNLIMITED:
            limit = None
        usage = _read_int(group / "memory.usage_in_bytes")
        inactive = stat_field(group / "memory.stat", "total_inactive_file", "inactive_file")
    if limit is None or usage is None:
        return None
    return max(0, limit - max(0, usage - inactive))


def memory_room(proc_cgroup: Path = PROC_CGROUP, root: Path = ROOT) -> int | None:
    """The least room any memory limit over this process leaves (bytes), None without one."""
    rooms = [
        r for d in group_dirs("memory", proc_cgroup, root) if (r := _memory_room(d)) is not None
    ]
    return min(rooms) if rooms else None


def _cpu_quota(group: Path) -> int | None:
    """CPUs ``group``'s quota allows (rounded up, at least 1), None where it has none."""
    try:
        if _isfile(group / "cpu.max"):  # v2: "max 100000" or "150000 100000"
            quota, period = (group / "cpu.max").read_text().split()[:2]
            if quota == "max":
                return None
            q, p = int(quota), int(period)
        else:  # v1: a quota of -1 is none
            q = _read_int(group / "cpu.cfs_quota_us") or -1
            p = _read_int(group / "cpu.cfs_period_us") or 0
    except (OSError, ValueError):
        return None
    if q <= 0 or p <= 0:
        return None
    return max(1, math.ceil(q / p))


def cpu_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = ROOT) -> int | None:
    """The fewest CPUs any quota over this process allows, None without one."""
    quotas = [q for d in group_dirs("cpu", proc_cgroup, root) if (q := _cpu_quota(d)) is not None]
    return min(quotas) if quotas else None


def pids_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = ROOT) -> tuple[int, int] | None:
    """``(in use, limit)`` of the pids limit (tasks: processes and threads) over this process
    with the least room left, None without one."""
    found: list[tuple[int, int]] = []
    for group in group_dirs("pids", proc_cgroup, root):
        limit, current = _read_int(group / "pids.max"), _read_int(group / "pids.current")
        if limit is not None and current is not None:  # "max" (none) reads as None
            found.append((current, limit))
    return min(found, key=lambda used: used[1] - used[0]) if found else None


def remove_group(group: Path, wait_s: float = 5.0) -> bool:
    """Remove an emptied cgroup directory (benchmarks/memory_limit.py and the tests make them),
    retrying while the kernel lets go of its last process; whether it went."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            group.rmdir()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
