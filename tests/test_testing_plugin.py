"""The pytest plugin's offline fixtures, as a user's test suite would use them."""

from __future__ import annotations

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
    faulty.add(Fault("sample", error=request_failed("sampler overloaded"), times=1))
    sc = service.create_sampling_client(base_model="tinker-sr/tiny").result()
    prompt = types.ModelInput.from_ints([5, 6])
    params = types.SamplingParams(max_tokens=2, seed=0)
    with pytest.raises(tinker.RequestFailedError, match="sampler overloaded") as ei:
        sc.sample(prompt, 1, params).result()
    assert ei.value.category == types.RequestErrorCategory.Server
    assert len(sc.sample(prompt, 1, params).result().sequences) == 1  # fired once only
    assert faulty.calls["sample"] == 2


def test_injected_delay_trips_result_timeout(tinker_sr_faulty_service: Any) -> None:
    service, faulty = tinker_sr_faulty_service
    faulty.add(Fault("create_sampling_session", delay_s=2.0))
    fut = service.create_sampling_client(base_model="tinker-sr/tiny")
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.1)
    assert fut.result(timeout=60).get_base_model() == "tinker-sr/tiny"
