"""A request too large for the memory left: a user error naming the fix, and its memory freed
at once (found by a hunt under a memory cap; before, the failure was an "internal error" of
category server, an HTTP 500 on the OpenAI routes, and the failed request's tensors stayed
alive in its traceback until the cyclic collector ran, failing the next requests too)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tinker_sr.backend.local_errors import out_of_memory

_SCRIPT = textwrap.dedent(
    """
    import resource
    import numpy as np
    import tinker_sr as tinker
    from tinker_sr import types

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    service = tinker.ServiceClient()
    tc = service.create_lora_training_client("tinker-sr/small", rank=8, seed=0).result()

    def datum(n, seed):
        t = [int(x) for x in np.random.default_rng(seed).integers(10, 250, n + 1)]
        return types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * n},
        )

    small = [datum(16, 0)]
    tc.forward_backward(small, "cross_entropy").result()
    before = status("VmRSS:")
    # 1 GiB of address space left: 64 x 1023 tokens need several
    resource.setrlimit(resource.RLIMIT_AS, (status("VmSize:") + (1 << 30),) * 2)
    try:
        tc.forward_backward([datum(1023, i) for i in range(64)], "cross_entropy").result()
        print("NO FAILURE")
    except tinker.RequestFailedError as e:
        print("CATEGORY", e.category.value)
        print("MESSAGE", e.message)
    tc.forward_backward(small, "cross_entropy").result()  # the next request runs
    print("GROWTH_MIB", (status("VmRSS:") - before) >> 20)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc")
def test_a_request_too_large_for_memory_is_a_user_error_and_frees_its_memory(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TINKER_SR_BACKEND", "TINKER_BASE_URL")}
    env["TINKER_SR_STORE"] = str(tmp_path / "store")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert out.get("CATEGORY") == "user", done.stdout
    assert "the engine ran out of memory running this request" in out["MESSAGE"]
    assert "fewer or shorter datums per forward_backward" in out["MESSAGE"]
    assert "internal error" not in out["MESSAGE"]
    # Before: ~970 MiB of the failed request's tensors stayed (held by its traceback's frames).
    assert int(out["GROWTH_MIB"]) < 200, done.stdout


@pytest.mark.parametrize(
    ("error", "asked"),
    [
        (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                      "can't allocate memory: you tried to allocate 4861344256 bytes."), "4.53 GiB"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79 GiB total)"),
         "2.00 GiB"),
        (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 3145728 "
                      "bytes."), "3.0 MiB"),
        (MemoryError("Unable to allocate 4.00 PiB for an array with shape (1, 2)"), "4.00 PiB"),
        (MemoryError(), None),
    ],
)  # fmt: skip
def test_out_of_memory_is_recognised_in_torchs_words(error: Exception, asked: str | None) -> None:
    text = out_of_memory(error)
    assert text is not None and "split a large request" in text and "retry once" in text
    assert (asked in text) if asked else "asked for" not in text
    assert out_of_memory(RuntimeError("shape mismatch")) is None
    assert out_of_memory(RuntimeError("a model out of memory budget")) is None


def test_a_step_that_cannot_fit_is_refused_before_it_allocates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where even activation checkpointing leaves a step bigger than the free memory, it is
    refused with the numbers and the fix before anything is allocated: on a machine without
    a memory cap the kernel's out-of-memory killer would end the server mid-step instead.
    A forward (nothing kept for backward) and a step that fits still run."""
    import tinker_sr as tinker
    from tinker_sr import types
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine import training

    monkeypatch.setattr(training, "available_memory", lambda: 128 << 20)  # 128 MiB free
    tokens = [1 + i % 250 for i in range(1000)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 999},
    )
    backend = LocalBackend(tmp_path / "store")
    service = tinker.ServiceClient(backend=backend)
    try:
        tc = service.create_lora_training_client("tinker-sr/small", rank=4, seed=0).result()
        # small keeps ~72 KB a token with checkpointing: 8 x 999 tokens need ~0.55 GiB
        with pytest.raises(tinker.RequestFailedError, match="need at least 0.5 GiB even with") as e:
            tc.forward_backward([datum] * 8, "cross_entropy").result()
        assert e.value.category == types.RequestErrorCategory.User
        assert "send fewer or shorter datums per call" in str(e.value)
        tc.forward([datum] * 2, "cross_entropy").result()  # as a step: ~140 MiB
        out = tc.forward_backward([datum], "cross_entropy").result()  # ~70 MiB: fits
        assert out.metrics["loss:sum"] > 0
        # Memory the allocator keeps from earlier steps reads as used until it is handed back:
        # a step that fits once it is is not refused (before: refused, and again on a retry).
        rooms = iter([64 << 20, 1 << 30])
        trims: list[bool] = []
        monkeypatch.setattr(training, "available_memory", lambda: next(rooms, 1 << 30))
        monkeypatch.setattr(training, "return_freed_memory", lambda: trims.append(True))
        tc.forward_backward([datum] * 2, "cross_entropy").result()
        assert trims == [True]
    finally:
        service.close().result()
        backend.close()
