"""Run a command under a memory limit, as in a container (``docker run -m``), and report whether
it finished or the kernel's OOM killer ended it, and the group's peak memory.

    python benchmarks/memory_limit.py --limit-mib 4096 -- \\
        python benchmarks/user_trial.py --model-dir DIR --steps 4

It makes a fresh cgroup under this process's own one (a v1 memory group, or v2 where the group
may have children), with that limit and no swap, runs the command in it, and removes it after.
That needs root, or a delegated group; elsewhere it says so and exits 2. Where it cannot, wrap
the command in ``systemd-run --scope -p MemoryMax=4G`` or ``docker run -m 4g`` instead: the
engine reads the limit the same way (`tinker_sr.engine.cgroups`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from tinker_sr.engine import cgroups  # noqa: E402
from tinker_sr.engine.cpu import describe_machine  # noqa: E402

MIB = 1 << 20


def make_group(limit: int) -> Path:
    """A new memory-limited cgroup under this process's own (v1 or v2), without swap; removed
    again if it cannot be limited."""
    own = cgroups.group_dirs("memory")
    if not own:
        raise OSError("no cgroup memory hierarchy is mounted under /sys/fs/cgroup")
    v2 = not (cgroups.ROOT / "memory").is_dir()  # group_dirs found the v2 tree, not v1's
    group = own[0] / f"tinker-sr-limit-{os.getpid()}"
    group.mkdir()
    try:
        if v2 and not (group / "memory.max").exists():
            raise OSError(f"the memory controller is not delegated to {own[0]} (cgroup v2)")
        (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        swap = group / ("memory.swap.max" if v2 else "memory.memsw.limit_in_bytes")
        if swap.exists():
            swap.write_text("0" if v2 else str(limit))
    except OSError:
        cgroups.remove_group(group)
        raise
    return group


def group_report(group: Path) -> tuple[int, int]:
    """(peak bytes, OOM kills) of ``group`` (v1 or v2 files)."""
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            peak = int((group / name).read_text().split()[0])
            break
        except (OSError, ValueError, IndexError):
            peak = 0
    kills = cgroups.stat_field(group / "memory.oom_control", "oom_kill")
    kills += cgroups.stat_field(group / "memory.events", "oom_kill")
    return peak, kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, required=True, help="the memory limit, MiB")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    print(describe_machine(), flush=True)
    try:
        group = make_group(args.limit_mib * MIB)
    except OSError as e:
        print(
            f"cannot make a memory-limited cgroup here ({e}); run as root on a host with a "
            "writable cgroup hierarchy, or use systemd-run --scope -p MemoryMax=... / "
            "docker run -m ... instead",
            file=sys.stderr,
        )
        sys.exit(2)
    procs = str(group / "cgroup.procs")
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, preexec_fn=lambda: Path(procs).write_text(str(os.getpid())), check=False
        )
        peak, kills = group_report(group)
    finally:
        if not cgroups.remove_group(group):
            print(f"could not remove {group} (a process of the command still in it?)")
    killed = " (killed by the OOM killer)" if kills else ""
    print(
        f"limit {args.limit_mib} MiB: exit {done.returncode}{killed} after "
        f"{time.perf_counter() - start:.0f} s; the group's peak {peak / MIB:.0f} MiB"
    )
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
