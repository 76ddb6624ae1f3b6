"""Where a LoRA sampler's weights live, seen through the public API: merged copies (an LRU of
two), or adapters on the shared base when merged copies would not fit their budget. A sampler
must sample the same whichever it gets, however many newer samplers came after it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend

# Large enough that decode multiplies by oneDNN-packed weights (`gemm.packed_linear`).
MODEL = "tinker-sr/small"
PARAMS = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11, stop=[])


def _three_samplers(service: Any) -> tuple[list[Any], types.ModelInput]:
    """Three sampling clients of one trainer, one per optimizer step (distinct weights)."""
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    prompt = types.ModelInput.from_ints(list(b"older samplers: "))
    tokens = prompt.to_ints()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    samplers = []
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
        samplers.append(trainer.save_weights_and_get_sampling_client().result())
    return samplers, prompt


def _tokens(sampler: Any, prompt: types.ModelInput) -> list[list[int]]:
    res = sampler.sample(prompt, num_samples=3, sampling_params=PARAMS).result()
    return [s.tokens for s in res.sequences]


def test_an_older_sampler_samples_after_newer_ones_displaced_its_merged_weights(
    service: Any,
) -> None:
    """An async loop samples from a sampler a few steps old. Its merged copy was evicted (two
    are kept), so the sampling thread rebuilds it, in inference mode: built there as inference
    tensors, its weights had no version for the packed-weight cache and every such request
    failed with "Inference tensors do not track version counter"."""
    samplers, prompt = _three_samplers(service)
    first = [_tokens(s, prompt) for s in samplers]  # each sampled while its copy is newest
    assert first[0] != first[2]  # the steps changed the weights
    again = [_tokens(s, prompt) for s in samplers]  # oldest first: each one rebuilt
    assert again == first


def test_adapters_on_the_base_are_built_once_per_sampler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no room for a merged copy (``$TINKER_SR_MERGED_CACHE_MB=0``) samplers decode
    through their adapters on the shared base: the same tokens as merged weights, and one model
    per sampler (not one per request), so a sampler's concurrent requests share it."""
    results: dict[str, list[list[list[int]]]] = {}
    for budget in ("", "0"):
        monkeypatch.setenv("TINKER_SR_MERGED_CACHE_MB", budget)
        backend = LocalBackend(tmp_path / f"store{budget}")
        service = tinker.ServiceClient(backend=backend)
        try:
            samplers, prompt = _three_samplers(service)
            results[budget] = [_tokens(s, prompt) for s in samplers + samplers]
            stats = backend.models.stats()
            if budget == "0":
                assert stats["merged"] == 0 and stats["unmerged"] == 3
                models = backend.models._unmerged
                ids = [s.sampler_id for s in samplers]
                model = models[ids[0]][0]
                assert backend.models.sampler(ids[0]).model is model  # built once, then kept
                assert stats["unmerged_bytes"] > 0
            else:
                assert stats["merged"] == 2 and stats["unmerged"] == 0
        finally:
            service.close().result()
            backend.close()
    assert results["0"] == results[""]
    assert results[""][:3] == results[""][3:]


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The engine's records only (not, say, an unrelated client's warning from another thread,
    such as the official SDK's heartbeat of a session whose server is gone)."""
    return [r for r in caplog.records if r.name.startswith("tinker_sr")]


def test_without_a_budget_merged_copies_leave_memory_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No ``$TINKER_SR_MERGED_CACHE_MB``: two merged copies where memory allows, fewer where the
    free memory (copies held count as free) would keep less than the headroom after one more,
    and none, decoding through the adapters with one warning, where even one would not fit. A
    laptop with a checkpoint of several GB would otherwise build two copies of it and be
    killed by the OOM killer. The tokens are the same in every case."""
    from tinker_sr.engine import registry as registry_mod

    monkeypatch.delenv("TINKER_SR_MERGED_CACHE_MB", raising=False)
    # The machine's free memory: `pool` less the merged copies held (evicting one frees it),
    # unless `frees` is off (an evicted copy that a decode still holds frees nothing yet).
    memory = {"pool": 1 << 40, "frees": True}
    backend = LocalBackend(tmp_path / "store")
    models = backend.models

    def free(_device: object) -> int:
        held = models.stats()["merged_bytes"] if memory["frees"] else 0
        return max(0, memory["pool"] - held)

    monkeypatch.setattr(registry_mod, "free_memory", free)
    monkeypatch.setattr(registry_mod, "MERGED_HEADROOM", 0)  # the headroom is half a copy
    service = tinker.ServiceClient(backend=backend)
    try:
        samplers, prompt = _three_samplers(service)
        one = models.stats()["merged_bytes"] // 2  # ample memory: two copies held
        assert models.stats()["merged"] == 2 and models.stats()["unmerged_low_memory"] == 0
        want = [_tokens(s, prompt) for s in samplers]
        with caplog.at_level("WARNING", logger="tinker_sr.engine"):
            # Room for one copy and its headroom: both held copies go, the rebuilt one stays.
            memory["pool"] = one + one * 3 // 4
            assert _tokens(samplers[0], prompt) == want[0]
            assert models.stats()["merged"] == 1 and models.stats()["unmerged"] == 0
            assert not ours(caplog)
            # Evicting the held copy would make room, but a decode still holds it: after the
            # eviction the room is measured again (its weights cannot be written again, so
            # the new copy needs all of its size), and the sampler decodes on its adapters.
            held = next(iter(models._merged.values()))[0]  # as a running decode holds it
            memory.update(pool=one, frees=False)
            assert _tokens(samplers[1], prompt) == want[1]
            assert models.stats()["merged"] == 0 and models.stats()["unmerged"] == 1
            del held
            memory.update(pool=0, frees=True)  # no room at all
            assert _tokens(samplers[2], prompt) == want[2]
        stats = models.stats()
        assert stats["merged"] == 0 and stats["unmerged"] == 2
        assert stats["unmerged_low_memory"] == 2
        (warning,) = ours(caplog)  # once, naming the knob
        assert "low memory" in warning.getMessage()
        assert "TINKER_SR_MERGED_CACHE_MB" in warning.getMessage()
        # An explicit budget is obeyed whatever the free memory says.
        monkeypatch.setattr(models, "merged_budget", 2 * one)
        models._unmerged.clear()
        assert _tokens(samplers[1], prompt) == want[1]
        assert models.stats()["merged"] == 1
    finally:
        service.close().result()
        backend.close()


def test_spilled_sampler_adapters_come_back_as_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An RL loop makes a sampler per step and samples from recent ones. With no room for
    adapters in memory (``$TINKER_SR_SAMPLER_ADAPTERS_MB=0``) each older sampler's adapters go
    to a spill file and are read back on use. Spill files were named by the count of spilled
    samplers and the adapters' ``id()``: in the steady state (the oldest samplers released,
    freed dicts' addresses reused) two live samplers got one file, and an older sampler sampled
    with a newer one's weights (or found its file gone)."""
    from tinker_sr.engine import registry as registry_mod

    monkeypatch.setenv("TINKER_SR_SAMPLER_ADAPTERS_MB", "0")
    monkeypatch.setenv("TINKER_SR_SAMPLERS_PER_SESSION", "4")
    # CPython hands a freed object's address to the next one of its size, so ``id()``s of
    # adapters made one step apart often repeat; here always (what a name must not rely on).
    monkeypatch.setattr(registry_mod, "id", lambda _obj: 1, raising=False)
    backend = LocalBackend(tmp_path / "store")
    service = tinker.ServiceClient(backend=backend)
    try:
        trainer = service.create_lora_training_client("tinker-sr/tiny", rank=4, seed=0).result()
        tokens = list(b"spilled adapters")
        full = types.ModelInput.from_ints(tokens)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        live: list[tuple[Any, list[float | None]]] = []
        for _ in range(24):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
            sampler = trainer.save_weights_and_get_sampling_client().result()
            live = [*live[-2:], (sampler, sampler.compute_logprobs(full).result())]
            for older, when_new in live:  # each sampler as it was when it was made
                assert older.compute_logprobs(full).result() == when_new
        assert backend.models.stats()["adapters_spilled"] >= 2
    finally:
        service.close().result()
        backend.close()
