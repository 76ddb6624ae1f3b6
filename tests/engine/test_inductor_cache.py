"""torch's inductor cache is kept per CPU and vector ISA (`native.isolate_inductor_cache`): its
own key misses the ISA, and code generated for AVX-512 loaded under AVX2 computed garbage."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinker_sr.engine import native


def test_the_inductor_cache_is_named_by_the_vector_isa(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "kernels"))
    dirs = {}
    for isa in ("AVX512", "AVX2"):
        monkeypatch.delenv(native.INDUCTOR_CACHE_ENV, raising=False)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda isa=isa: isa)
        dirs[isa] = native.isolate_inductor_cache()
        assert os.environ[native.INDUCTOR_CACHE_ENV] == str(dirs[isa])
    assert dirs["AVX512"] != dirs["AVX2"]
    assert all(d is not None and d.parent == tmp_path / "inductor" for d in dirs.values())
    # torch's default, which torch itself writes to the variable at some imports: replaced
    monkeypatch.setenv(native.INDUCTOR_CACHE_ENV, str(native._inductor_default()))
    assert native.isolate_inductor_cache() == dirs["AVX2"]
    # what a child process inherits from its parent's call: tinker_sr's own, not the user's
    monkeypatch.setenv(native.INDUCTOR_CACHE_ENV, str(dirs["AVX512"]))
    with caplog.at_level(logging.WARNING, logger="tinker_sr.engine"):
        assert native.isolate_inductor_cache() == dirs["AVX2"]
    assert not caplog.records
    monkeypatch.setenv(native.INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))  # the user's choice
    with caplog.at_level(logging.WARNING, logger="tinker_sr.engine"):
        assert native.isolate_inductor_cache() is None
    assert os.environ[native.INDUCTOR_CACHE_ENV] == str(tmp_path / "mine")
    # kept, with the warning a hunt found missing (a shared one computed garbage on AVX2)
    assert f"$TORCHINDUCTOR_CACHE_DIR={tmp_path / 'mine'} is set" in caplog.text
    assert "share that directory only between CPUs of one ISA" in caplog.text


_SCRIPT = """
import torch
from tinker_sr.engine import compiled
compiled.MIN_ELEMENTS = 1
x = torch.randn(4, 96, 64, generator=torch.Generator().manual_seed(0))[..., :32]  # strided
w = torch.randn(32, generator=torch.Generator().manual_seed(1))
got = compiled.call("rms_norm", x, w, 1e-6)
assert got is not None, compiled.failure()
want = compiled._rms_norm(x, w, 1e-6)
err = max(float((g - v).abs().max()) for g, v in zip(got, want))
print(err)
assert err < 1e-4, err
"""


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or (shutil.which("g++") is None and shutil.which("clang++") is None),
    reason="x86 vector ISAs; torch.compile needs a C++ compiler",
)
def test_code_compiled_for_one_vector_isa_does_not_serve_another(tmp_path: Path) -> None:
    """Two processes sharing one cache: torch on the CPU's own ISA, then capped to AVX2 (what an
    AVX2-only CPU runs); each compiles its own RMSNorm loop and gets the eager values."""
    env = {k: v for k, v in os.environ.items() if k != native.INDUCTOR_CACHE_ENV}
    env |= {native.CACHE_ENV: str(tmp_path / "kernels"), "TMPDIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    for isa in (None, "avx2"):
        run_env = env | ({"ATEN_CPU_CAPABILITY": isa} if isa else {})
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            env=run_env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (isa, done.stdout[-2000:], done.stderr[-3000:])
