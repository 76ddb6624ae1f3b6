"""One test's mock leaves nothing to the next (found by a hunt of the offline-mocking fixtures,
used as a user's CI would): its clients of the hosted service's URL, which the mock answers
for too, are closed with it; tokenizers cached by model name are dropped; and faults count
from when they are planned and refuse what is not a fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinker_sr.testing import mock_tinker
from tinker_sr.testing.faults import Fault, FaultyBackend, request_failed

tinker = pytest.importorskip("tinker")

TEXT = "<|im_start|>user\nhello world<|im_end|>\n"


def test_a_client_of_the_hosted_services_url_is_closed_with_the_mock() -> None:
    """Before, only clients of the mock's own URL were: one made with the production URL
    heartbeated on, into the next test's mock (its trace, its faults' counts) or, with no
    mock, the real network."""
    from tinker_sr.backend.transport import DEFAULT_BASE_URL

    with mock_tinker():
        service = tinker.ServiceClient(base_url=DEFAULT_BASE_URL)
        service.create_lora_training_client("Qwen/Qwen3-8B", rank=2, seed=0).result()
        holder = service._session_holder
        assert holder is not None and not holder._closed
    assert holder._closed


def test_a_mock_serving_a_directory_gives_its_tokenizer_after_another_mock(
    tmp_path: Path,
) -> None:
    """The official SDK's and the cookbook's tokenizer caches (by model name) outlived the
    mock: after a test whose mock answered "Qwen/Qwen3-8B" with the offline byte model, a
    test serving a real directory under that name encoded with the byte tokenizer."""
    from transformers import AutoTokenizer

    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    def encoded() -> tuple[list[int], list[int]]:
        from tinker_cookbook.tokenizer_utils import get_tokenizer

        sampler = tinker.ServiceClient().create_sampling_client(base_model="Qwen/Qwen3-8B")
        sdk = sampler.get_tokenizer().encode(TEXT, add_special_tokens=False)
        return sdk, get_tokenizer("Qwen/Qwen3-8B").encode(TEXT, add_special_tokens=False)

    with mock_tinker(store=tmp_path / "a"):
        byte_level, _ = encoded()
    hf = make_tiny_hf_model_dir(tmp_path / "hf")
    want = AutoTokenizer.from_pretrained(str(hf)).encode(TEXT, add_special_tokens=False)
    assert want != byte_level
    with mock_tinker(store=tmp_path / "b", model_aliases={"Qwen/Qwen3-8B": str(hf)}):
        assert encoded() == (want, want)


def test_a_fault_counts_the_calls_made_since_it_was_planned(tmp_path: Path) -> None:
    """``after=1`` lets the next call through and fails the one after, however many calls
    came before it was planned (before: it counted from the backend's creation and failed the
    next call), as a `WireFault`'s ``after`` does."""
    import tinker_sr
    from tinker_sr import types
    from tinker_sr.backend.local import LocalBackend

    faulty = FaultyBackend(LocalBackend(tmp_path / "store"))
    try:
        service = tinker_sr.ServiceClient(backend=faulty)
        sampler = service.create_sampling_client(base_model="tinker-sr/tiny")
        prompt, params = types.ModelInput.from_ints([1, 2, 3]), types.SamplingParams(max_tokens=2)
        for _ in range(3):
            sampler.sample(prompt, 1, params).result()
        fault = faulty.add_fault(Fault("sample", error=request_failed("boom"), after=1))
        sampler.sample(prompt, 1, params).result()
        with pytest.raises(tinker_sr.RequestFailedError, match="boom"):
            sampler.sample(prompt, 1, params).result()
        assert (fault.seen, fault.fired) == (2, 1)
        service.close().result()
    finally:
        faulty.inner.close()


def test_something_that_is_not_a_fault_is_refused_when_planned(tmp_path: Path) -> None:
    """Before, ``add_fault("asample")`` was taken, and every request then failed inside the
    mock: the official SDK's ServiceClient() hung with no message."""
    with mock_tinker(store=tmp_path / "s") as mock:
        for wrong in ("asample", None, 42):
            with pytest.raises(TypeError, match="add_fault takes a WireFault"):
                mock.add_fault(wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="add_fault takes a WireFault"):
        mock_tinker(faults=["asample"]).__enter__()  # type: ignore[list-item]
    with pytest.raises(TypeError, match="add_fault takes a Fault"):
        FaultyBackend(object(), ["sample"])  # type: ignore[list-item]


def test_a_permanent_fault_on_every_route_ends_with_the_mock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, the fault stayed planned while the mock closed the clients the test left open:
    each one's closing telemetry (on, as in a user's CI) was refused and retried for 10 s."""
    from tinker_sr.testing.wire import http_error

    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    with mock_tinker() as mock:
        service = tinker.ServiceClient()
        service.create_lora_training_client("Qwen/Qwen3-8B", rank=2, seed=0).result()
        fault = mock.add_fault(http_error("*", 500, times=None))
        before = len(mock.trace)
    closing = mock.trace.calls()[before:]
    assert fault.fired == 0
    assert [e["endpoint"] for e in closing][-1:] == ["telemetry"]  # the session's end
    assert all(e["status"] == 200 and e["fault"] is None for e in closing)


def test_a_permanent_fault_ends_with_a_per_test_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for `tinker_server_process` (the ``tinker_server`` fixture)."""
    from tinker_sr.testing.server import tinker_server_process
    from tinker_sr.testing.wire import http_error

    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    with tinker_server_process(tmp_path / "srv") as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key)
        service.create_lora_training_client("Qwen/Qwen3-8B", rank=2, seed=0).result()
        srv.add_fault(http_error("*", 500, times=None))
        before = len(srv.trace)
    closing = srv.trace.calls()[before:]
    assert [e["endpoint"] for e in closing][-1:] == ["telemetry"]
    assert all(e["status"] == 200 and e["fault"] is None for e in closing)
