"""The pytest plugin's offline fixtures, as a user's test suite would use them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.testing.faults import Fault, request_failed


def test_offline_service_aliases_any_model_name(tinker_sr_service: tinker.ServiceClient) -> None:
    tc = tinker_sr_service.create_lora_training_client("Qwen/Qwen3-8B", rank=4, seed=0).result()
    assert tc.get_info().model_data.model_name == "Qwen/Qwen3-8B"
    sc = tc.save_weights_and_get_sampling_client().result()
    r = sc.sample(
        types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=3, seed=0)
    ).result()
    assert len(r.sequences) == 2


def test_injected_faults_fire_then_clear(tinker_sr_faulty_service: Any) -> None:
    service, faulty = tinker_sr_faulty_service
    faulty.add_fault(Fault("sample", error=request_failed("sampler overloaded"), times=1))
    sc = service.create_sampling_client(base_model="tinker-sr/tiny").result()
    prompt = types.ModelInput.from_ints([5, 6])
    params = types.SamplingParams(max_tokens=2, seed=0)
    with pytest.raises(tinker.RequestFailedError, match="sampler overloaded") as ei:
        sc.sample(prompt, 1, params).result()
    assert ei.value.category == types.RequestErrorCategory.Server
    assert len(sc.sample(prompt, 1, params).result().sequences) == 1  # fired once only
    assert faulty.calls["sample"] == 2


@pytest.mark.parametrize("method", ["forward_backward", "optim_step"])
def test_an_injected_training_failure_does_not_hold_the_model(
    tinker_sr_faulty_service: Any, method: str
) -> None:
    """Before: the failed call's seq_id never reached the engine, which runs a model's calls
    in seq_id order, so every later call of the model waited forever."""
    service, faulty = tinker_sr_faulty_service
    tc = service.create_lora_training_client("tinker-sr/tiny", rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    faulty.add_fault(Fault(method, error=request_failed("injected")))
    with pytest.raises(tinker.RequestFailedError, match="injected"):
        tc.forward_backward([datum], "cross_entropy").result(timeout=60)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    out = tc.forward_backward([datum], "cross_entropy").result(timeout=60)
    assert out.metrics["loss:sum"] > 0


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: Fault("smaple"), "not a method of LocalBackend"),
        (lambda: Fault("sample", error="boom"), "Fault.error must be an exception"),
        (lambda: Fault("sample", times=0), "Fault.times must be an integer >= 1"),
        (lambda: Fault("sample", delay_s=-5), "Fault.delay_s must be a number"),
    ],
)
def test_a_fault_that_could_not_fire_as_meant_is_refused(
    tinker_sr_faulty_service: Any, make: Any, needle: str
) -> None:
    """Before: accepted; the test using it passed without the fault ever firing."""
    _, faulty = tinker_sr_faulty_service
    with pytest.raises((ValueError, TypeError), match=needle):
        faulty.add_fault(make())


def test_injected_delay_trips_result_timeout(tinker_sr_faulty_service: Any) -> None:
    service, faulty = tinker_sr_faulty_service
    faulty.add(Fault("create_sampling_session", delay_s=2.0))
    fut = service.create_sampling_client(base_model="tinker-sr/tiny")
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.1)
    assert fut.result(timeout=60).get_base_model() == "tinker-sr/tiny"


# ---- tinker_mock: offline model names and tokenizers --------------------------------------------

MODELS = ["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B"]


@pytest.mark.parametrize("client", ["tinker", "tinker_sr"])
def test_get_tokenizer_is_the_offline_chat_tokenizer_on_every_path(
    client: str, tinker_mock: Any
) -> None:
    import importlib

    from tinker_sr.testing.offline_model import TOKEN_IDS, VOCAB_SIZE

    module = importlib.import_module(client)
    service = module.ServiceClient()
    for model in MODELS:
        training = service.create_lora_training_client(model, rank=4, seed=0).result()
        sampler = service.create_sampling_client(base_model=model).result()
        from_training = training.save_weights_and_get_sampling_client().result()
        for tok in (
            training.get_tokenizer(),
            sampler.get_tokenizer(),
            from_training.get_tokenizer(),
        ):
            assert len(tok) == VOCAB_SIZE
            for special in ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|eot_id|>"):
                assert tok.encode(special, add_special_tokens=False) == [TOKEN_IDS[special]]
            assert tok.decode(tok.encode("héllo", add_special_tokens=False)) == "héllo"
    service.close("success").result()


def test_mock_sets_and_restores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from tinker_sr.testing import mock_tinker

    monkeypatch.setenv("TINKER_SR_BACKEND", "local")
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    with mock_tinker("http://my-tinker.invalid/prefix") as mock:
        assert os.environ["TINKER_BASE_URL"] == "http://my-tinker.invalid/prefix"
        assert os.environ["TINKER_API_KEY"] == mock.api_key
        assert "TINKER_SR_BACKEND" not in os.environ  # tinker_sr clients go over HTTP
        import httpx

        assert httpx.get("http://my-tinker.invalid/prefix/api/v1/healthz").json() == {
            "status": "ok"
        }
    assert os.environ["TINKER_SR_BACKEND"] == "local" and "TINKER_BASE_URL" not in os.environ


def test_mock_also_serves_the_hosted_service_url(tinker_mock: Any) -> None:
    import tinker as official

    from tinker_sr.testing.mock import PRODUCTION_BASE_URL

    # Code that names the hosted service explicitly still cannot leave the machine.
    service = official.ServiceClient(base_url=PRODUCTION_BASE_URL)
    sampler = service.create_sampling_client(base_model="Qwen/Qwen3-8B").result()
    assert sampler.get_base_model() == "Qwen/Qwen3-8B"
    assert tinker_mock.trace.calls("create_sampling_session")[-1]["status"] == 200
    service.close("success").result()


def test_docs_tinker_sr_example(tinker_mock: Any) -> None:
    # docs/testing.md, "A tinker_sr script under test", verbatim.
    from tinker_sr.testing import connection_reset

    tinker_mock.add_fault(connection_reset("asample"))
    service = tinker.ServiceClient()  # RemoteBackend -> the mock
    sampler = service.create_sampling_client(base_model="Qwen/Qwen3-8B").result()
    tok = sampler.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("<|im_start|>user\nhi<|im_end|>\n"))
    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, stop=["\n"])).result()
    assert len(out.sequences) == 2
    assert [c["status"] for c in tinker_mock.trace.calls("asample")] == [None, 200]
    service.close().result()


@pytest.mark.parametrize("renderer_name", ["qwen3", "llama3"])
def test_cookbook_renderers_work_offline(renderer_name: str, tinker_mock: Any) -> None:
    renderers = pytest.importorskip("tinker_cookbook.renderers")
    tokenizer_utils = pytest.importorskip("tinker_cookbook.tokenizer_utils")
    import tinker as official

    model = "Qwen/Qwen3-8B" if renderer_name == "qwen3" else "meta-llama/Llama-3.1-8B"
    tokenizer = tokenizer_utils.get_tokenizer(model)  # AutoTokenizer.from_pretrained(model)
    renderer = renderers.get_renderer(renderer_name, tokenizer)
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "What is 2+2?"}])
    service = official.ServiceClient()
    sampler = service.create_sampling_client(base_model=model).result()
    params = official.types.SamplingParams(
        max_tokens=16, seed=0, stop=renderer.get_stop_sequences()
    )
    out = sampler.sample(prompt, 4, params).result()
    for seq in out.sequences:
        message, _ = renderer.parse_response(seq.tokens)
        assert message["role"] == "assistant"
    service.close("success").result()


def test_loading_the_plugin_imports_no_tinker_sr(tmp_path: Path) -> None:
    """pytest loads every installed plugin in every project. The plugin lived in the tinker_sr
    package, so an unrelated project's tests ran with tinker_sr imported: its engine's
    environment set (OMP_WAIT_POLICY=PASSIVE, bounded oneDNN caches) and ~0.6 s more start-up.
    Now the plugin imports nothing of tinker_sr until a test uses one of its fixtures."""
    import os
    import subprocess
    import sys

    engine_env = ("OMP_WAIT_POLICY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    (tmp_path / "test_other_project.py").write_text(
        "import os, sys\n\n"
        "def test_untouched():\n"
        "    assert 'tinker_sr' not in sys.modules\n"
        f"    assert not any(k in os.environ for k in {engine_env!r})\n\n"
        "def test_the_plugin_is_loaded(tinker_sr_store):\n"
        "    assert tinker_sr_store.name\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in engine_env}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


def test_the_former_plugin_name_has_every_fixture() -> None:
    """``-p tinker_sr.testing.plugin`` (the plugin's name before it left the package) gives
    every fixture, the autouse one too (a star import alone drops a leading-underscore name)."""
    import tinker_sr_pytest_plugin as plugin
    from tinker_sr.testing import plugin as former

    defined = {n for n, v in vars(plugin).items() if "fixture" in type(v).__name__.lower()}
    assert defined == set(plugin.__all__)
    assert "_tinker_server_session_names" in defined
    for name in plugin.__all__:
        assert getattr(former, name) is getattr(plugin, name)


def test_the_former_plugin_name_brings_the_hooks_without_the_entry_point(tmp_path: Path) -> None:
    """With plugins not auto-loaded, ``-p tinker_sr.testing.plugin`` gave the fixtures (a star
    import) but not the plugin's hook that keeps the server fixtures' unclosed-socket warnings
    from failing tests under ``-W error``; it registers the plugin now, once either way."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_former.py").write_text(
        "import tinker_sr_pytest_plugin as plugin\n\n"
        "def test_hooks(pytestconfig, tinker_sr_store):\n"
        "    manager = pytestconfig.pluginmanager\n"
        "    assert manager.is_registered(plugin)\n"
        "    impls = manager.hook.pytest_runtest_protocol.get_hookimpls()\n"
        "    assert sum(i.plugin is plugin for i in impls) == 1\n"
    )
    for autoload in ("1", None):
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
        if autoload:
            env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = autoload
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-p", "tinker_sr.testing.plugin", str(tmp_path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "1 passed" in proc.stdout
