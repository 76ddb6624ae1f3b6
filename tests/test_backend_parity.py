"""Local and remote backends give bit-identical results for identical seeds."""

from __future__ import annotations

from typing import Any

import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.provenance import build_datum

pytest.importorskip("tests._server")

PROMPT = list(b"parity: ")


def script(service: tinker.ServiceClient) -> dict[str, Any]:
    tc = service.create_lora_training_client("tinker-sr/tiny", rank=4, seed=11).result()
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    res = sc.sample(
        types.ModelInput.from_ints(PROMPT),
        4,
        types.SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=3, stop=[]),
    ).result()
    rewards = [sum(t < 128 for t in s.tokens) / 6 for s in res.sequences]
    mean = sum(rewards) / len(rewards)
    data = [build_datum(PROMPT, s, r - mean) for s, r in zip(res.sequences, rewards, strict=True)]
    fb = tc.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.01})
    op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    fb_out, op_out = fb.result(), op.result()
    after = tc.forward(data, "stable_reinforce").result()
    sc2 = tc.save_weights_and_get_sampling_client().result()
    lps = sc2.compute_logprobs(
        types.ModelInput.from_ints(PROMPT + res.sequences[0].tokens)
    ).result()
    return {
        "tokens": [s.tokens for s in res.sequences],
        "logprobs": [s.logprobs for s in res.sequences],
        "fb_metrics": fb_out.metrics,
        "fb_logprobs": [o["logprobs"].tolist() for o in fb_out.loss_fn_outputs],
        "optim_metrics": op_out.metrics,
        "after_logprobs": [o["logprobs"].tolist() for o in after.loss_fn_outputs],
        "compute_logprobs": lps,
    }


def test_local_and_remote_are_bit_identical(tmp_path: Any, remote_server: Any) -> None:
    backend = LocalBackend(tmp_path / "store")
    local = tinker.ServiceClient(backend=backend)
    remote = tinker.ServiceClient(base_url=remote_server.base_url, api_key="tml-parity")
    try:
        a, b = script(local), script(remote)
    finally:
        local.close().result()
        remote.close().result()
        backend.close()
    assert a == b
