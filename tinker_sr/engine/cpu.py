"""CPU facts (model, ISA flags, fast bf16) and threading defaults: threads sized to the cores
this process may really use, and no spinning.

Two things make a small-model engine collapse on a busy machine (a server beside its client,
a training script beside a browser, CI runners sharing cores):

* OpenMP worker threads that busy-wait between parallel regions. libgomp's default spins for
  a while before sleeping; with another runnable process on the core the spinning thread
  burns the time slice the real work needed (measured: a 4x32 sample went from 0.40 s to
  3.5 s with one competing process per core; with passive waits, 0.55 s).
  ``OMP_WAIT_POLICY=PASSIVE`` must be in the environment before the OpenMP runtime loads,
  i.e. before ``import torch``: ``import tinker_sr`` calls `prefer_passive_waits`, which sets
  it unless the user did; child processes (a spawned server) inherit it. A program that
  imports torch before tinker_sr keeps torch's default (set the variable yourself then).
* Memory that grows with every new product shape: oneDNN (torch's CPU GEMMs in bf16, the
  engine's float32 ones, batched attention products) compiles a kernel per shape and keeps it,
  ~1-3 MiB each (by shape), in two caches (oneDNN's and ideep's) of 1,024 entries each. A run
  whose sequence lengths vary fills them: bf16 ``user_trial.py --max-tokens 96`` grew 0.7 MiB a step
  for hundreds of steps. `bound_kernel_caches` (called by ``import tinker_sr``) caps both at
  `KERNEL_CACHE_ENTRIES` unless the user set them (read when oneDNN makes its first kernel;
  building a mixture-of-experts model raises them, `widen_kernel_caches`);
  float32 products also run at bucketed row counts (`gemm.bucket_rows`) so a run's working set
  of shapes fits.
* More threads than cores: the default counts the CPUs of the machine, not the ones this
  process may run on (CPU affinity, a cgroup quota of a container).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tinker_sr.engine import cgroups
from tinker_sr.threads import starting

__all__ = [
    "allocator_fitted_to",
    "available_cpus",
    "available_memory",
    "bound_kernel_caches",
    "cpu_identity",
    "cpu_model",
    "default_torch_threads",
    "describe_free_memory",
    "describe_machine",
    "engine_executor",
    "fit_allocator_to_memory",
    "has_fast_bf16",
    "has_fast_half",
    "isa_flags",
    "onednn_isa_cap",
    "prefer_passive_waits",
    "return_freed_memory",
    "threads_within_task_limit",
    "tune_allocator",
    "warm_thread_team",
    "why_slow_half",
    "widen_kernel_caches",
]

THREADS_ENV = "TINKER_SR_TORCH_THREADS"


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroups.cpu_quota()
    return max(1, min(cpus, quota) if quota else cpus)


def _mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The machine's MemAvailable in bytes, None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes this process could still allocate: MemAvailable, capped by the room left under
    any cgroup memory limit over it (`cgroups.memory_room`, v1 or v2); None where neither can
    be read."""
    return _least(_mem_available(meminfo), cgroups.memory_room())


def _least(machine: int | None, limited: int | None) -> int | None:
    found = [x for x in (machine, limited) if x is not None]
    return max(0, min(found)) if found else None


def default_torch_threads(requested: int | None = None) -> int:
    """Intra-op threads of the engine's torch work: ``requested`` (e.g. `LocalBackend`'s
    ``torch_threads``), else ``$TINKER_SR_TORCH_THREADS`` (a positive integer), else
    `available_cpus` (affinity and cgroup quota): oversubscribed threads make a busy machine
    far slower. A positive ``$OMP_NUM_THREADS`` lowers that default (a machine running many
    worker processes sets it to 1), as it does torch's own; it never raises it."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"torch_threads must be >= 1, got {requested}")
        return requested
    env = os.environ.get(THREADS_ENV, "").strip()
    if not env:
        omp = os.environ.get("OMP_NUM_THREADS", "").strip()
        cpus = available_cpus()
        return min(int(omp), cpus) if omp.isdigit() and int(omp) > 0 else cpus
    if not env.isdigit() or int(env) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {env!r}")
    return int(env)


# Tasks (threads) a pids limit must leave beside the engine's OpenMP teams: the clients' event
# loop, a server's connections and default executor, the engine's own Python threads.
TASK_RESERVE = 16
# Threads that run the engine's torch work, each the master of its own OpenMP team: the
# worker that trains and the sampling thread.
TEAM_MASTERS = 2
# Besides the teams, torch.set_num_threads(n) sizes torch's process-wide pthreadpool: n - 1
# threads more.
THREAD_POOLS = TEAM_MASTERS + 1


def threads_within_task_limit(threads: int) -> int:
    """``threads`` (intra-op threads of each engine thread), lowered where a cgroup's pids
    limit over this process leaves too little room for the engine's `TEAM_MASTERS` threads
    and `THREAD_POOLS` pools of ``threads - 1`` (their OpenMP teams, torch's pthreadpool)
    beside `TASK_RESERVE` others, with a warning. libgomp cannot fail a parallel region:
    when the OS refuses a team thread it ends the whole process ("Thread creation failed"),
    and the work under way with it. The count then depends on the tasks in use as the engine
    starts, and results on the count (docs/stability.md)."""
    pids = cgroups.pids_limit()
    if pids is None or threads <= 1:
        return threads
    used, limit = pids
    fits = max(1, (limit - used - TASK_RESERVE - TEAM_MASTERS) // THREAD_POOLS + 1)
    if fits >= threads:
        return threads
    logging.getLogger("tinker_sr.engine").warning(
        "this process's cgroup allows %d tasks (processes and threads), %d in use: room for "
        "%d torch thread(s) per engine thread, not %d; using %d (raise the limit, e.g. a "
        "container's --pids-limit, for more; results depend on the thread count)",
        limit, used, fits, threads, fits,
    )  # fmt: skip
    return fits


def warm_thread_team(threads: int) -> None:
    """Set the calling thread's torch threads to ``threads`` and start its OpenMP team now.
    libgomp starts a thread's team at its first parallel region and keeps it; started when
    the engine starts (within `threads_within_task_limit`), no later region of this thread
    needs a new one, so a pids limit reached later (other processes of the container) fails
    the engine's Python threads as errors (`tinker_sr.threads`), not the process. Other
    threads that run torch (the user's own) still start their teams when they first do."""
    import torch

    torch.set_num_threads(threads)
    if threads > 1:
        torch.ones(1 << 18).add_(1)  # elementwise work above torch's grain: a parallel region


def engine_executor(threads: int) -> ThreadPoolExecutor:
    """The engine's one worker thread, started now with its OpenMP team (`warm_thread_team`);
    `ThreadLimitError` where the OS refuses the thread."""
    executor = ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="tinker-sr-engine",
        initializer=warm_thread_team,
        initargs=(threads,),
    )
    with starting("the embedded engine's worker thread"):
        executor.submit(int).result()
    return executor


# oneDNN's and ideep's kernel cache capacities (entries each): a dense model's training step
# takes a few dozen float32 product shapes at bucketed row counts; a miss recompiles (~0.3-2
# ms). A mixture of experts runs each expert on its own rows, four products per bucketed
# row count (forward and backward, the backward's weights transposed: kernels of their own):
# 128 experts choosing 8 for 8 x 100-400 tokens took 256-512 kernels a step
# (``benchmarks/moe_kernel_cache.py``: 240 recompiles a step at 128 entries, 167 at 256, 15
# at 512 or 1,024), so building one raises the caps to `MOE_KERNEL_CACHE_ENTRIES`.
KERNEL_CACHE_ENTRIES = 128
MOE_KERNEL_CACHE_ENTRIES = 512
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
_capped: dict[str, str] = {}  # the capacities `bound_kernel_caches` set (the user set none)


def bound_kernel_caches() -> None:
    """Cap oneDNN's primitive cache and ideep's at `KERNEL_CACHE_ENTRIES` entries each, where
    the user set neither (``DNNL_PRIMITIVE_CACHE_CAPACITY`` is oneDNN's older name). Takes
    effect if no oneDNN kernel was made yet in this process (both are read then)."""
    oned, ideep = KERNEL_CACHE_ENV
    names = [ideep] if "DNNL_PRIMITIVE_CACHE_CAPACITY" in os.environ else [oned, ideep]
    for name in names:
        if name not in os.environ:
            os.environ[name] = _capped[name] = str(KERNEL_CACHE_ENTRIES)


def widen_kernel_caches(entries: int) -> None:
    """Raise the caps `bound_kernel_caches` set (never a user's) to at least ``entries``: a
    model whose steps take more kernel shapes is being built. Takes effect only if no oneDNN
    kernel was made yet in this process (the first model built decides, as a rule)."""
    for name, value in list(_capped.items()):
        if os.environ.get(name) == value and int(value) < entries:
            os.environ[name] = _capped[name] = str(entries)


def prefer_passive_waits() -> bool:
    """Ask OpenMP to sleep, not spin, when idle. Returns whether it can still take effect
    (False once torch, and with it the OpenMP runtime, is already loaded)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return "torch" not in sys.modules


# The ISA extensions that decide matmul speed here, in the order they are reported (x86's
# "flags", then aarch64's "Features" of /proc/cpuinfo).
_REPORTED_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_bf16", "amx_fp16", "amx_int8",
    "asimd", "sve", "sve2", "bf16", "i8mm",
)  # fmt: skip
# oneDNN's ISA caps (``$ONEDNN_MAX_CPU_ISA``) below which its bf16 / fp16 products are
# emulated: under a cap of AVX2 a hunt measured a bf16 step 30x slower than float32.
_ONEDNN_BELOW_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)
# Per 16-bit dtype: the ISA flags that run its products in hardware, the oneDNN caps below
# them, and how a message names that hardware.
_HALF_HARDWARE = {
    "bfloat16": (("amx_bf16", "avx512_bf16"), _ONEDNN_BELOW_BF16, "AMX or AVX512-BF16"),
    "float16": (
        ("amx_fp16", "avx512_fp16"),
        _ONEDNN_BELOW_BF16 | {"AVX512_CORE_BF16"},
        "AMX-FP16 or AVX512-FP16",
    ),
}


def _cpuinfo_field(name: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    import platform

    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def isa_flags() -> list[str]:
    """The reported ISA extensions (`_REPORTED_FLAGS`) this CPU has, from /proc/cpuinfo."""
    have = set((_cpuinfo_field("flags") or _cpuinfo_field("Features")).split())
    return [f for f in _REPORTED_FLAGS if f in have]


def cpu_identity() -> str:
    """What /proc/cpuinfo says the CPU is and can run (x86: model name and flags; aarch64: its
    implementer, part and features), for keys of code compiled for it."""
    fields = ("model name", "flags", "CPU implementer", "CPU part", "Features")
    return "\n".join(f"{name}: {_cpuinfo_field(name)}" for name in fields)


def onednn_isa_cap() -> str | None:
    """The ISA oneDNN is capped to (``$ONEDNN_MAX_CPU_ISA``, or its old name
    ``$DNNL_MAX_CPU_ISA``), upper-case; None when uncapped."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if value := os.environ.get(name, "").strip().upper():
            return value
    return None


def has_fast_bf16() -> bool:
    """True when bf16 matmuls run in hardware (AMX or AVX512-BF16, and oneDNN is not capped
    below them), i.e. where a bf16 compute dtype is a speed-up rather than an emulation."""
    return has_fast_half("bfloat16")


def has_fast_half(dtype: Any) -> bool:
    """Whether this CPU's matmuls in ``dtype`` (bfloat16 or float16, a torch dtype or its name)
    run in hardware (fp16: AMX-FP16 or AVX512-FP16); False for other dtypes."""
    hardware = _HALF_HARDWARE.get(str(dtype).removeprefix("torch."))
    if hardware is None:
        return False
    flags, below, _ = hardware
    have = isa_flags()
    return any(f in have for f in flags) and onednn_isa_cap() not in below


def why_slow_half(dtype: Any) -> str:
    """Why ``dtype``'s (bfloat16 or float16) products are emulated on this CPU, for a
    message: oneDNN's cap below them, else the ISA flags it lacks (`has_fast_half` is False)."""
    _, below, names = _HALF_HARDWARE[str(dtype).removeprefix("torch.")]
    if (cap := onednn_isa_cap()) in below:
        return f"oneDNN is capped to {cap}"
    return f"this CPU has no {names}"


def describe_machine() -> str:
    """One line for benchmark reports: CPU model, ISA flags, usable CPUs, free memory (both
    within any cgroup limits), torch version."""
    import torch

    return (
        f"CPU: {cpu_model()} | flags: {' '.join(isa_flags()) or '-'} | usable CPUs: "
        f"{available_cpus()} | {describe_free_memory()} | load avg: {os.getloadavg()[0]:.2f} | "
        f"torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}{_caps()}"
    )


def _caps() -> str:
    """The ISA caps set for oneDNN and MKL (what this run's products may use), if any."""
    caps = [("oneDNN", onednn_isa_cap()), ("MKL", os.environ.get("MKL_ENABLE_INSTRUCTIONS"))]
    return "".join(f", {lib} capped to {cap}" for lib, cap in caps if cap)


def describe_free_memory() -> str:
    """``free memory: 21.9 GiB`` (`available_memory`), ``... (cgroup limit)`` where a cgroup
    leaves less than the machine has; ``free memory: unknown`` where neither can be read."""
    limited = cgroups.memory_room()
    room = _least(_mem_available(), limited)
    if room is None:
        return "free memory: unknown"
    where = " (cgroup limit)" if limited is not None and limited <= room else ""
    return f"free memory: {room / 2**30:.1f} GiB{where}"


ALLOCATOR_ENV = "TINKER_SR_MALLOC_TUNING"
# glibc mallopt parameters (malloc.h) and the values the engine sets.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
# What `fit_allocator_to_memory` switches between the lean settings and back.
_TUNED_SETTINGS = (
    (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's maximum: blocks below it come from the heap
    (_M_TRIM_THRESHOLD, 1 << 30),  # keep up to 1 GiB of freed heap for the next step
    (_M_TOP_PAD, 64 << 20),  # grow the heap in 64 MiB steps
)
_ALLOCATOR_SETTINGS = (
    (_M_ARENA_MAX, 1),  # every thread allocates from the main (sbrk) heap: no 64 MiB arena cap
    *_TUNED_SETTINGS,
)
_allocator_tuned: bool | None = None
# Where memory is short, the memory a step freed and the allocator keeps is what gets the
# process OOM-killed (a cgroup counts it as used). Below LEAN_BELOW of free memory the tuned
# allocator hands big blocks back at once instead: each block over 1 MiB is its own mapping,
# unmapped when freed, and freed heap past 16 MiB is trimmed. Back to the tuned settings from
# twice that (no switching back and forth at the edge).
LEAN_BELOW = 2 << 30
_LEAN_SETTINGS = ((_M_MMAP_THRESHOLD, 1 << 20), (_M_TRIM_THRESHOLD, 16 << 20), (_M_TOP_PAD, 0))
_allocator_lean = False


def tune_allocator() -> bool:
    """Make glibc keep the memory of one training step for the next (returns whether it did).

    A training step allocates and frees ~1-2 GB of activations and gradients. With glibc's
    defaults every block over its mmap threshold is a fresh ``mmap`` whose pages the kernel
    faults in and zeroes on first touch, every step (measured on the 16 x 256 benchmark step:
    ~1.1 GB of page faults, ~0.5 s of system CPU time, ~5 % of the step), and a worker thread's
    arena cannot hold blocks over 64 MiB at all. One heap, blocks up to 32 MiB from it, and
    freed memory kept (up to 1 GiB at the top) remove those faults; peak RSS moves by ~3 %.
    The engine's explicit `return_freed_memory` after releasing sessions and weights still
    hands everything back. Set ``$TINKER_SR_MALLOC_TUNING=0`` to keep glibc's defaults; a
    no-op without glibc. Idempotent; call it before the engine's threads start.
    """
    global _allocator_tuned
    if _allocator_tuned is not None:
        return _allocator_tuned
    _allocator_tuned = False
    if os.environ.get(ALLOCATOR_ENV, "1").strip() in ("0", "false", "no", "off"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    _allocator_tuned = all(libc.mallopt(k, v) == 1 for k, v in _ALLOCATOR_SETTINGS)
    return _allocator_tuned


def fit_allocator_to_memory(room: int | None) -> bool:
    """Where `tune_allocator` tuned glibc: lean settings (`LEAN_BELOW`) while ``room``, the
    free memory in bytes, is short, the tuned ones again once it is not; returns whether the
    allocator is lean. The engine calls it before each training step on the CPU. Values
    computed do not depend on it; only page faults (time) and memory kept do."""
    global _allocator_lean
    if not _allocator_tuned or room is None:
        return _allocator_lean
    lean = room < (2 * LEAN_BELOW if _allocator_lean else LEAN_BELOW)
    libc = _glibc()
    if lean != _allocator_lean and libc is not None:
        for key, value in _LEAN_SETTINGS if lean else _TUNED_SETTINGS:
            libc.mallopt(key, value)
        if lean:
            libc.malloc_trim(0)  # what the tuned settings kept
        _allocator_lean = lean
    return lean


@contextlib.contextmanager
def allocator_fitted_to(room: int | None) -> Iterator[bool]:
    """`fit_allocator_to_memory` for one step of work; lean, the memory the step freed goes
    back to the OS after it (freed heap pages below the top stay resident otherwise, and a
    heap grown while the allocator was tuned has many)."""
    lean = fit_allocator_to_memory(room)
    try:
        yield lean
    finally:
        if lean:
            return_freed_memory()


@functools.cache
def _glibc() -> Any | None:
    """The C library when it is glibc (has ``mallopt`` and ``malloc_trim``), else None. Looked
    up once (``find_library`` may run ``ldconfig``), not at every `return_freed_memory`."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both exist only in glibc
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory() -> None:
    """Hand memory freed by Python/torch back to the OS (glibc keeps freed heap pages of
    every thread's arena otherwise, so a process that dropped a session's weights would
    still show them in its RSS). A no-op where glibc's ``malloc_trim`` is not available."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
