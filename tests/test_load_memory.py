"""A model that does not fit in the free memory is refused before anything is allocated, with
the sizes and the fix, instead of the OOM killer ending the process (a server with every
session in it). Embedded with the free memory given; served inside a real memory-limited
cgroup, from the official SDK, where this test may make one."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import tinker_sr  # noqa: E402
from tests._cgroups import limit_memory, move, real_v1_group_pair  # noqa: E402
from tests._server import running_server  # noqa: E402
from tests._train import cross_entropy_steps  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine import hf  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3")


def _need(model_dir: Path) -> int:
    """The bytes of the model's parameters as loaded (a tied embedding once)."""
    params = {id(p): p for p in hf.load_model_dir(model_dir).parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params)


def test_a_model_that_does_not_fit_is_refused_before_loading(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need = _need(model_dir)
    stored = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert 0 < need <= stored  # the tensors (the files add their headers)
    free = {"bytes": need + hf.LOAD_HEADROOM - 1}
    monkeypatch.setattr(hf, "available_memory", lambda: free["bytes"])
    monkeypatch.delenv(hf.MEMORY_CHECK_ENV, raising=False)
    backend = LocalBackend(tmp_path / "store")
    service = tinker_sr.ServiceClient(backend=backend)
    try:
        with pytest.raises(tinker_sr.RequestFailedError) as info:
            service.create_lora_training_client(base_model=str(model_dir), rank=4).result()
        message = str(info.value)
        for part in ("base_model", str(model_dir), "MiB", "smaller model", hf.MEMORY_CHECK_ENV):
            assert part in message
        assert backend.models.stats()["bases"] == 0  # nothing was allocated
        free["bytes"] = need + hf.LOAD_HEADROOM  # exactly enough
        training = service.create_lora_training_client(base_model=str(model_dir), rank=4)
        assert training.result().get_tokenizer() is not None
        assert backend.models.stats()["bases"] == 1
    finally:
        service.close().result()
        backend.close()


def test_a_training_client_that_does_not_fit_is_refused_and_the_others_keep_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each training client adds its adapters, their gradients and Adam's moments; one caller
    could make them until the process was killed out of memory (a server: all its users'
    unsaved weights lost). The one that would not fit is refused, naming rank and sizes."""
    from tinker_sr.engine import admission

    monkeypatch.delenv(hf.MEMORY_CHECK_ENV, raising=False)
    free: dict[str, int | None] = {"bytes": None}
    monkeypatch.setattr(admission, "free_memory", lambda _device: free["bytes"])
    backend = LocalBackend(tmp_path / "store")
    service = tinker_sr.ServiceClient(backend=backend)
    try:
        first = service.create_lora_training_client(base_model="tinker-sr/tiny", rank=64).result()
        adapters = sum(
            p.numel() * 4 for _, p in backend.models.trainer(first.model_id).optim.params
        )
        need = 3 * adapters
        free["bytes"] = need + admission.trainer_headroom(need) - 1  # one byte short
        with pytest.raises(tinker_sr.RequestFailedError) as info:
            service.create_lora_training_client(base_model="tinker-sr/tiny", rank=64).result()
        message = str(info.value)
        for part in ("rank-64 LoRA of 'tinker-sr/tiny'", "MiB", "lower rank", hf.MEMORY_CHECK_ENV):
            assert part in message, message
        assert cross_entropy_steps(first, tinker_sr.types, [1, 2, 3, 4], 1, 0.01)  # untouched
        free["bytes"] += 1  # exactly enough
        service.create_lora_training_client(base_model="tinker-sr/tiny", rank=64).result()
        # Memory the tuned allocator keeps (a dropped trainer's) is handed back and measured
        # again before a refusal: before, a sweep in a container was refused at its 2nd trial.
        free["bytes"] = need  # short, until the allocator returns what it kept
        monkeypatch.setattr(
            admission, "return_freed_memory", lambda: free.update(bytes=2 * need + (64 << 20))
        )
        service.create_lora_training_client(base_model="tinker-sr/tiny", rank=64).result()
        free["bytes"] = 0
        monkeypatch.setenv(hf.MEMORY_CHECK_ENV, "0")  # the same switch as the load check
        service.create_lora_training_client(base_model="tinker-sr/tiny", rank=64).result()
    finally:
        service.close().result()
        backend.close()


def test_the_check_can_be_skipped(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf, "available_memory", lambda: 0)
    monkeypatch.setenv(hf.MEMORY_CHECK_ENV, "0")
    model = hf.load_model_dir(model_dir)
    assert sum(p.numel() for p in model.parameters()) > 0
    monkeypatch.setenv(hf.MEMORY_CHECK_ENV, "off")
    with pytest.raises(ValueError, match="TINKER_SR_LOAD_MEMORY_CHECK must be 0 .* got 'off'"):
        hf.load_model_dir(model_dir)
    monkeypatch.setattr(hf, "available_memory", lambda: None)  # unknown: no check
    monkeypatch.delenv(hf.MEMORY_CHECK_ENV)
    hf.load_model_dir(model_dir)


def test_a_server_in_a_container_refuses_what_would_not_fit_and_stays_up(
    model_dir: Path, tmp_path: Path
) -> None:
    """`tinker-sr serve` moved into a real 384 MiB memory cgroup: the official SDK asking for
    a model directory hears why (its weights plus the headroom exceed the room left), the
    server stays up, and a built-in model still trains there."""
    tinker = pytest.importorskip("tinker")
    pairs = real_v1_group_pair()
    memory, _cpu = next(pairs)
    try:
        limit_memory(memory, 384 << 20)
        flags = ["--model-dir", str(model_dir)]
        with running_server(tmp_path / "store", extra_args=flags) as srv:
            assert srv.proc is not None
            assert "usable CPUs, free memory: " in srv.log()  # its start-up line
            move(srv.proc.pid, memory)  # what it allocates from here on counts in the group
            service = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-test")
            with pytest.raises(tinker.RequestFailedError, match="MiB of memory free"):
                service.create_lora_training_client(base_model=str(model_dir), rank=4).result()
            training = service.create_lora_training_client(
                base_model="tinker-sr/tiny", rank=4, seed=0
            )
            losses = cross_entropy_steps(
                training.result(), tinker.types, list(b"fits in a container"), steps=2, lr=1e-2
            )
            assert losses[-1] < losses[0], losses
            service.close("success").result()
            assert srv.proc.poll() is None
            move(srv.proc.pid, memory.parent)
    finally:
        next(pairs, None)  # removes the groups
