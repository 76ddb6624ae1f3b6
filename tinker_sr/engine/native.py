"""The engine's C kernels (``engine/csrc``), built with this machine's C compiler at first use.

`engine.compiled` uses them (``$TINKER_SR_NATIVE``). The source is compiled once per
machine with ``-O3 -march=native -fopenmp`` into a shared library kept in a cache directory
(``$TINKER_SR_KERNEL_CACHE``, default ``~/.cache/tinker_sr/kernels``), named by a hash of the
source and the headers beside it, the compiler's version, the flags and this CPU's model and
ISA flags (a library built for another CPU is never loaded: ``-march=native`` code may not run
there). Builds go to a temporary file renamed into place, so concurrent processes never load a
partial library. The OpenMP runtime is the one torch already loaded (the same
``libgomp.so.1``).

`load` returns None (and says why, through `failure`) where there is no compiler, the build
fails or the library does not load; callers then use torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from tinker_sr.engine.cpu import cpu_identity

__all__ = [
    "CACHE_ENV",
    "INDUCTOR_CACHE_ENV",
    "cache_dir",
    "failure",
    "isolate_inductor_cache",
    "library_path",
    "load",
]

CACHE_ENV = "TINKER_SR_KERNEL_CACHE"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # torch's own variable
SOURCE_DIR = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_failures: dict[tuple[str, tuple[str, ...]], str] = {}


def failure(name: str, defines: tuple[str, ...] = ()) -> str | None:
    """Why kernel library ``name`` (the build with ``defines``, see `load`) is unavailable in
    this process, or None."""
    return _failures.get((name, defines))


def cache_dir() -> Path:
    raw = os.environ.get(CACHE_ENV, "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "tinker_sr" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


@functools.cache
def load(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.c``, or None (see `failure`). ``defines``: macros
    defined for the build (``-D``), a variant cached (and its failure kept) apart; benchmarks
    and tests build baselines so (e.g. ``TSR_RULE_NARROW``, delta_rule.c's forward as before
    session 46)."""
    try:
        return _build_and_load(name, defines)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        _failures[name, defines] = f"{type(exc).__name__}: {exc}"[:500]
        return None


def library_path(name: str, cc: str, defines: tuple[str, ...] = ()) -> Path:
    """Where the library of ``csrc/<name>.c`` built by ``cc`` for this CPU is cached."""
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]  # shared by every source
    for part in (
        (SOURCE_DIR / f"{name}.c").read_bytes(),
        *headers,
        version.encode(),
        " ".join(FLAGS + tuple(f"-D{d}" for d in defines)).encode(),
        platform.machine().encode(),
        cpu_identity().encode(),
    ):
        key.update(part + b"\0")
    return cache_dir() / f"{name}-{key.hexdigest()[:20]}.so"


def _build_and_load(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler on PATH (cc, gcc or clang; or set $CC)")
    target = library_path(name, cc, defines)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            cmd = [
                cc,
                *FLAGS,
                *(f"-D{d}" for d in defines),
                "-I",
                str(SOURCE_DIR),
                "-o",
                tmp,
                str(SOURCE_DIR / f"{name}.c"),
                "-lm",
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:300]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def isolate_inductor_cache() -> Path | None:
    """Give torch's inductor a cache directory of this CPU's own (under `cache_dir`, named by
    the CPU model, its ISA flags, the vector ISA torch runs and torch's version), unless the
    user set ``$TORCHINDUCTOR_CACHE_DIR``; returns the directory set, or None.

    Inductor's cache key misses the vector ISA its code was generated for: code compiled
    under one (AVX-512) was loaded under another (``ATEN_CPU_CAPABILITY=avx2``, as on an
    AVX2-only CPU sharing the directory) and computed garbage (an RMSNorm off by 1e21, NaN
    logits, a corrupted heap). Call before the process's first ``torch.compile``."""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV, "").strip()
    ours = cache_dir().parent / "inductor"  # a child process inherits the one set here
    if chosen and os.path.abspath(chosen) != _inductor_default() and Path(chosen).parent != ours:
        # The user's (torch writes its default there at some imports), kept as it is.
        logging.getLogger("tinker_sr.engine").warning(
            "$%s=%s is set, so compiled loops are cached there as it is; torch's cache key "
            "misses the vector ISA, so share that directory only between CPUs of one ISA "
            "(a loop compiled for AVX-512 and run on an AVX2 CPU computes garbage), or unset "
            "it: tinker_sr then keeps a directory per CPU",
            INDUCTOR_CACHE_ENV,
            chosen,
        )
        return None
    import torch

    key = hashlib.sha256()
    for part in (
        platform.machine(),
        cpu_identity(),
        torch.backends.cpu.get_cpu_capability(),
        torch.__version__,
    ):
        key.update(part.encode() + b"\0")
    path = ours / key.hexdigest()[:20]
    os.environ[INDUCTOR_CACHE_ENV] = str(path)
    return path


def _inductor_default() -> str | None:
    """torch's default inductor cache directory (per user, in the temp dir), or None."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())
