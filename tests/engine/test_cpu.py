"""Threading defaults: passive OpenMP waits set before torch loads; threads sized to the CPUs
the process may use."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tinker_sr.engine import cpu


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_sets_passive_waits_before_torch_loads() -> None:
    code = "import os, sys, tinker_sr; print('torch' in sys.modules, os.environ['OMP_WAIT_POLICY'])"
    assert _run(code) == "False PASSIVE"


def test_a_users_wait_policy_wins() -> None:
    code = "import os, tinker_sr; print(os.environ['OMP_WAIT_POLICY'])"
    assert _run(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_available_cpus_follows_the_affinity_mask() -> None:
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    first = min(os.sched_getaffinity(0))
    code = (
        f"import os; os.sched_setaffinity(0, {{{first}}}); "
        "from tinker_sr.engine.cpu import available_cpus; print(available_cpus())"
    )
    assert _run(code) == "1"


def test_default_threads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.THREADS_ENV, "3")
    assert cpu.default_torch_threads() == 3
    monkeypatch.setenv(cpu.THREADS_ENV, "zero")
    with pytest.raises(ValueError, match="TINKER_SR_TORCH_THREADS must be a positive integer"):
        cpu.default_torch_threads()
    monkeypatch.delenv(cpu.THREADS_ENV)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # it lowers the default (the suite's)
    assert cpu.default_torch_threads() == cpu.available_cpus()


def test_machine_facts() -> None:
    flags = cpu.isa_flags()
    assert set(flags) <= set(cpu._REPORTED_FLAGS)
    assert cpu.has_fast_bf16() == any(f in flags for f in ("amx_bf16", "avx512_bf16"))
    line = cpu.describe_machine()
    assert line.startswith("CPU: ") and "usable CPUs: " in line


def test_available_memory_is_meminfo_capped_by_the_cgroup_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    room: dict[str, int | None] = {"bytes": None}
    monkeypatch.setattr(cpu.cgroups, "memory_room", lambda: room["bytes"])
    assert cpu.available_memory(meminfo) == 4000000 * 1024  # no cgroup limit
    room["bytes"] = 2 << 30
    assert cpu.available_memory(meminfo) == 2 << 30  # the cgroup leaves less
    room["bytes"] = 8 << 30
    assert cpu.available_memory(meminfo) == 4000000 * 1024  # the machine has less
    assert cpu.available_memory(tmp_path / "none") == 8 << 30
    room["bytes"] = None
    assert cpu.available_memory(tmp_path / "none") is None


_FAULTS_AFTER_REUSE = """
import resource, sys, threading
from tinker_sr.engine import cpu
tuned = cpu.tune_allocator() if sys.argv[1] == "tune" else False
import torch
faults = []
def steps():  # on a worker thread, as the engine's work runs
    for _ in range(6):  # a training step's pattern: allocate and touch, free, again
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(20 << 18) for _ in range(8)]  # 8 x 20 MiB
        del blocks
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
worker = threading.Thread(target=steps)
worker.start()
worker.join()
print(tuned, *faults)
"""


def _run_clean(code: str, *args: str, **env: str) -> str:
    """``code``'s stdout, run in a clean environment: only what finds Python and the package.
    Inheriting the suite's (its thread counts, kernel cache, ...) the tuned rounds below
    faulted like untuned ones in two full-suite CI runs on 2026-12-01 (never alone)."""
    keep = ("PATH", "HOME", "PYTHONPATH", "LANG", "TMPDIR")
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**{k: os.environ[k] for k in keep if k in os.environ}, **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _faults(mode: str, **env: str) -> tuple[str, list[int]]:
    tuned, *faults = _run_clean(_FAULTS_AFTER_REUSE, mode, **env).split()
    return tuned, [int(f) for f in faults]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_allocator_reuses_a_steps_memory_without_page_faults() -> None:
    """Tuned, the memory a round (step) freed is reused by the next ones without being
    faulted in (and zeroed by the kernel) again; glibc's defaults fault parts of it in
    again and again (measured here, rounds 4-6: ~75 % of the first round's faults in all;
    tuned: none)."""
    tuned, faults = _faults("tune")
    off, off_faults = _faults("tune", TINKER_SR_MALLOC_TUNING="0")
    assert (tuned, off) == ("True", "False")
    assert faults[0] > 30_000  # 160 MiB of 4 KiB pages, touched
    # Settled after a couple of rounds: none of the last three faults memory in again.
    assert sum(faults[3:]) <= 0.02 * faults[0], faults
    assert sum(faults[3:]) <= sum(off_faults[3:]), (faults, off_faults)


def test_local_backend_tunes_the_allocator() -> None:
    code = (
        "from tinker_sr.backend.local import LocalBackend; from tinker_sr.engine import cpu; "
        "LocalBackend(persistent=False).close(); print(cpu._allocator_tuned)"
    )
    assert _run(code) == ("True" if sys.platform.startswith("linux") else "False")


_LEAN_WHEN_SHORT = """
from tinker_sr.engine import cpu
assert cpu.tune_allocator()
import torch
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
def step():  # allocate and touch 8 x 20 MiB, then free it all
    blocks = [torch.ones(20 << 18) for _ in range(8)]
    del blocks
base = rss()
step()
kept = rss() - base  # tuned: the step's memory stays for the next one
assert not cpu.fit_allocator_to_memory(cpu.LEAN_BELOW + 1)
assert cpu.fit_allocator_to_memory(cpu.LEAN_BELOW - 1)  # short: what was kept goes back
trimmed = rss() - base
step()
lean_kept = rss() - base
assert cpu.fit_allocator_to_memory(2 * cpu.LEAN_BELOW - 1)  # no flapping at the edge
assert not cpu.fit_allocator_to_memory(2 * cpu.LEAN_BELOW)
step()
print(kept, trimmed, lean_kept, rss() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_short_of_memory_the_allocator_hands_freed_memory_back() -> None:
    """A cgroup counts the memory glibc keeps for the next step as used: in a 2560 MiB group a
    Qwen3-0.6B-shaped model's RL trial held ~700 MiB more between steps for it. Short of memory
    the tuned allocator goes lean (freed blocks go back at once), and tuned again when room
    returns."""
    out = _run_clean(_LEAN_WHEN_SHORT)
    kept, trimmed, lean_kept, tuned_again = (int(x) for x in out.split())
    assert kept >= 150, out  # 160 MiB kept by the tuned heap
    assert trimmed <= 20 and lean_kept <= 20, out
    assert tuned_again >= 150, out  # kept again once memory is ample


def test_each_training_step_fits_the_allocator_to_the_free_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import contextlib

    import tinker_sr as tinker
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine import training

    seen: list[int | None] = []

    @contextlib.contextmanager
    def record(room: int | None) -> Iterator[bool]:
        seen.append(room)
        yield False

    monkeypatch.setattr(training, "available_memory", lambda: 12345 << 20)
    monkeypatch.setattr(training, "allocator_fitted_to", record)
    backend = LocalBackend(tmp_path / "store")
    service = tinker.ServiceClient(backend=backend)
    try:
        trainer = service.create_lora_training_client(base_model="tinker-sr/tiny", rank=2)
        datum = tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
        trainer.result().forward_backward([datum], "cross_entropy").result()
        trainer.result().forward([datum], "cross_entropy").result()
    finally:
        service.close().result()
        backend.close()
    assert seen == [12345 << 20, 12345 << 20]


def test_free_memory_is_described_with_where_its_limit_comes_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu, "_mem_available", lambda: 3 << 30)
    monkeypatch.setattr(cpu.cgroups, "memory_room", lambda: 3 << 30)
    assert cpu.describe_free_memory() == "free memory: 3.0 GiB (cgroup limit)"
    assert "| free memory: 3.0 GiB (cgroup limit) |" in cpu.describe_machine()
    monkeypatch.setattr(cpu.cgroups, "memory_room", lambda: None)
    assert cpu.describe_free_memory() == "free memory: 3.0 GiB"
    monkeypatch.setattr(cpu, "_mem_available", lambda: None)
    assert cpu.describe_free_memory() == "free memory: unknown"


AMX_HOST = (
    "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    "flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"
)
AVX2_HOST = "model name\t: AMD EPYC 7R13 Processor\nflags\t\t: fpu sse2 avx2 fma\n"
# aarch64: no "model name" or "flags"; Graviton3 (SVE, BF16) and Graviton2 (neither)
GRAVITON3 = (
    "Features\t: fp asimd sve i8mm bf16 svebf16\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
)
GRAVITON2 = "Features\t: fp asimd asimddp ssbs\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n"


@pytest.fixture
def cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``cpuinfo(text)``: the machine's /proc/cpuinfo reads as ``text`` from now on."""
    real = cpu._cpuinfo_field
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)

    def fake(text: str) -> None:
        path = tmp_path / f"cpuinfo{abs(hash(text))}"
        path.write_text(text)
        monkeypatch.setattr(cpu, "_cpuinfo_field", lambda name, _=None: real(name, path))

    yield fake


def test_fast_half_precision_needs_the_flags_and_onednn_allowed_to_use_them(
    cpuinfo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: only /proc/cpuinfo decided, so a host with AMX whose oneDNN was capped to AVX2
    (the docs' AVX2 recipe) took bf16 for fast and trained 30x slower than float32."""
    import torch

    cpuinfo(AMX_HOST)
    assert cpu.has_fast_bf16() and cpu.has_fast_half(torch.float16)
    assert not cpu.has_fast_half(torch.float32)
    for cap, bf16, fp16 in (
        ("avx2", False, False),
        ("AVX512_CORE", False, False),
        ("AVX512_CORE_BF16", True, False),
        ("AVX512_CORE_AMX", True, True),
        ("ALL", True, True),
    ):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert (cpu.has_fast_bf16(), cpu.has_fast_half(torch.float16)) == (bf16, fp16), cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")  # its old name
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert not cpu.has_fast_bf16()
    assert "oneDNN capped to AVX2, MKL capped to AVX2" in cpu.describe_machine()
    cpuinfo(AVX2_HOST)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    assert not cpu.has_fast_bf16() and not cpu.has_fast_half(torch.float16)
    assert cpu.isa_flags() == ["avx2", "fma"]


def test_arm_cpus_report_their_features_and_are_told_apart(cpuinfo: Any) -> None:
    """Before: aarch64's /proc/cpuinfo has "Features", no "flags" or "model name", so every
    ARM CPU had no flags and the same identity: a library built with -march=native on a
    Graviton3 would load on a Graviton2 sharing the kernel cache."""
    from tinker_sr.engine import native

    cpuinfo(GRAVITON3)
    assert cpu.isa_flags() == ["asimd", "sve", "bf16", "i8mm"]
    assert not cpu.has_fast_bf16()  # not claimed for ARM
    g3 = cpu.cpu_identity()
    cc = native._compiler()
    g3_lib = native.library_path("rows", cc) if cc else None
    cpuinfo(GRAVITON2)
    assert cpu.isa_flags() == ["asimd"]
    assert cpu.cpu_identity() != g3 and "CPU part: 0xd0c" in cpu.cpu_identity()
    if cc:
        assert native.library_path("rows", cc) != g3_lib
