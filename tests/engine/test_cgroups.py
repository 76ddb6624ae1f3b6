"""The limits a cgroup puts on the process (engine/cgroups.py): v1 and v2 layouts, a container's
partial mount, nested limits, and (where this test may make one) a real group."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._cgroups import real_v1_group_pair
from tinker_sr.engine import cgroups

GIB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(tmp_path: Path, text: str) -> Path:
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(text)
    return proc


def test_v2_nested_limits_the_tightest_applies(tmp_path: Path) -> None:
    """A systemd scope under a slice: the scope's limit and the slice's both apply; page cache
    the kernel can drop (inactive_file) counts as free."""
    root = tmp_path / "fs"
    _write(root / "cgroup.controllers", "cpu memory\n")
    scope = root / "user.slice" / "run-1.scope"
    _write(scope / "memory.max", f"{8 * GIB}\n")
    _write(scope / "memory.current", f"{3 * GIB}\n")
    _write(scope / "memory.stat", f"anon 100\ninactive_file {GIB}\nactive_file 5\n")
    _write(scope / "cpu.max", "max 100000\n")
    _write(root / "user.slice" / "memory.max", "max\n")
    _write(root / "user.slice" / "memory.current", f"{3 * GIB}\n")
    _write(root / "user.slice" / "cpu.max", "150000 100000\n")
    proc = _proc(tmp_path, "0::/user.slice/run-1.scope\n")
    assert cgroups.group_dirs("memory", proc, root) == [scope, scope.parent, root]
    assert cgroups.memory_room(proc, root) == 8 * GIB - (3 * GIB - GIB)
    assert cgroups.cpu_quota(proc, root) == 2  # 1.5 CPUs of the slice, rounded up
    _write(root / "user.slice" / "memory.max", f"{4 * GIB}\n")  # the slice is tighter
    assert cgroups.memory_room(proc, root) == GIB
    _write(scope / "cpu.max", "50000 100000\n")
    assert cgroups.cpu_quota(proc, root) == 1


def test_v1_container_sees_only_its_own_group(tmp_path: Path) -> None:
    """Docker on a v1 host: /proc/self/cgroup names /docker/<id>, but the container's mount
    shows that group as its root; "no limit" is LLONG_MAX rounded to a page."""
    root = tmp_path / "fs"
    memory, cpu = root / "memory", root / "cpu"
    _write(memory / "memory.limit_in_bytes", f"{2 * GIB}\n")
    _write(memory / "memory.usage_in_bytes", f"{GIB + 4096}\n")
    _write(memory / "memory.stat", "cache 10\ninactive_file 999\ntotal_inactive_file 4096\n")
    _write(cpu / "cpu.cfs_quota_us", "200000\n")
    _write(cpu / "cpu.cfs_period_us", "100000\n")
    proc = _proc(tmp_path, "4:memory:/docker/abc123\n1:cpu,cpuacct:/docker/abc123\n0::/\n")
    assert cgroups.group_dirs("memory", proc, root)[0] == memory
    assert cgroups.memory_room(proc, root) == GIB
    assert cgroups.cpu_quota(proc, root) == 2
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroups.memory_room(proc, root) is None
    assert cgroups.cpu_quota(proc, root) is None


def test_v1_whole_hierarchy_walks_up_from_the_own_group(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    parent = root / "memory" / "jobs"
    _write(parent / "memory.limit_in_bytes", f"{6 * GIB}\n")
    _write(parent / "memory.usage_in_bytes", f"{5 * GIB}\n")
    own = parent / "job-7"
    _write(own / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(own / "memory.usage_in_bytes", f"{GIB}\n")
    proc = _proc(tmp_path, "4:memory:/jobs/job-7\n")
    assert cgroups.group_dirs("memory", proc, root) == [own, parent, root / "memory"]
    assert cgroups.memory_room(proc, root) == GIB  # the parent's limit binds


@pytest.mark.parametrize("text", ["", "garbage\n", "0::/\n", "4:memory:/../../etc\n", "4:memory\n"])
def test_no_or_odd_cgroup_information_means_no_limit(tmp_path: Path, text: str) -> None:
    root = tmp_path / "fs"
    _write(root / "memory" / "memory.limit_in_bytes", "not a number\n")
    _write(root / "cpu" / "cpu.cfs_quota_us", "\n")
    proc = _proc(tmp_path, text)
    assert cgroups.memory_room(proc, root) is None
    assert cgroups.cpu_quota(proc, root) is None
    assert cgroups.memory_room(tmp_path / "absent", tmp_path / "absent") is None
    assert cgroups.cpu_quota(tmp_path / "absent", tmp_path / "absent") is None


@pytest.fixture
def real_v1_groups() -> Iterator[tuple[Path, Path]]:
    yield from real_v1_group_pair()


def test_a_real_v1_group_limits_threads_and_memory(
    real_v1_groups: tuple[Path, Path], tmp_path: Path
) -> None:
    """A process inside a real group of 3 GiB and half a CPU: the engine sizes its threads and
    its memory by the group, not by the machine."""
    memory, cpu_group = real_v1_groups
    try:
        (memory / "memory.limit_in_bytes").write_text(str(3 * GIB))
        (cpu_group / "cpu.cfs_quota_us").write_text("50000")
        (cpu_group / "cpu.cfs_period_us").write_text("100000")
    except OSError as e:
        pytest.skip(f"cannot set cgroup limits here: {e}")
    code = (
        "import os, sys\n"
        "for g in sys.argv[1:3]: open(os.path.join(g, 'cgroup.procs'), 'w').write(str(os.getpid()))\n"
        "from tinker_sr.engine import cpu\n"
        "from tinker_sr.backend.local import LocalBackend\n"
        "b = LocalBackend(sys.argv[-1], persistent=False)\n"
        "print(cpu.available_cpus(), cpu.available_memory(), b._torch_threads)\n"
        "print(cpu.describe_free_memory())\n"
        "b.close()\n"
    )
    # Neither thread setting of the suite's (OMP_NUM_THREADS=1 would lower the default too).
    unset = ("TINKER_SR_TORCH_THREADS", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run(
        [sys.executable, "-c", code, str(memory), str(cpu_group), str(tmp_path / "store")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    numbers, described = done.stdout.strip().splitlines()
    cpus, room, threads = (int(x) for x in numbers.split())
    assert described.endswith("GiB (cgroup limit)"), described
    assert cpus == 1 and threads == 1
    assert 0 < room <= 3 * GIB


def test_unreadable_cgroup_directories_mean_no_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A confined process (AppArmor, a sandbox) may not stat /sys/fs/cgroup: no limit, not a
    crash at start-up (Path.is_dir raises PermissionError on Python 3.11)."""
    root = tmp_path / "fs"
    _write(root / "memory" / "memory.limit_in_bytes", f"{GIB}\n")
    _write(root / "memory" / "memory.usage_in_bytes", "0\n")
    proc = _proc(tmp_path, "4:memory:/\n1:cpu:/\n")
    assert cgroups.memory_room(proc, root) == GIB
    real_stat = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(str(root)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    assert cgroups.memory_room(proc, root) is None
    assert cgroups.cpu_quota(proc, root) is None


def test_pids_limit_the_group_with_least_room(tmp_path: Path) -> None:
    """v2: a pod's pids.max under a slice with none ("max"); the one with less room left is
    reported as (in use, limit). v1: the pids hierarchy's own group."""
    root = tmp_path / "fs"
    _write(root / "cgroup.controllers", "pids\n")
    pod = root / "kubepods" / "pod1"
    _write(pod / "pids.max", "100\n")
    _write(pod / "pids.current", "40\n")
    _write(root / "kubepods" / "pids.max", "max\n")
    _write(root / "kubepods" / "pids.current", "900\n")
    proc = _proc(tmp_path, "0::/kubepods/pod1\n")
    assert cgroups.pids_limit(proc, root) == (40, 100)
    _write(root / "kubepods" / "pids.max", "950\n")  # 50 left there, 60 in the pod
    assert cgroups.pids_limit(proc, root) == (900, 950)
    v1 = tmp_path / "v1"
    _write(v1 / "pids" / "ci" / "pids.max", "64\n")
    _write(v1 / "pids" / "ci" / "pids.current", "12\n")
    assert cgroups.pids_limit(_proc(tmp_path, "8:pids:/ci\n"), v1) == (12, 64)
    assert cgroups.pids_limit(_proc(tmp_path, "0::/\n"), tmp_path / "none") is None
