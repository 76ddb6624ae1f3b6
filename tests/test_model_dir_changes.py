"""A model directory saved again in place while the engine has it loaded (``save_pretrained``
rerun in a notebook, a served ``--model-dir`` updated): before, every new client computed the
weights as first loaded, without a word, for as long as any client of it was open."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir
from tinker_sr.tokenization.hf import load_hf_tokenizer

IDS = [3, 17, 42, 99, 7, 250, 31]
TEXT = "the quick brown fox jumps over the lazy dog, then sleeps"
REFUSED = (tinker.BadRequestError, tinker.RequestFailedError)  # as other refused creations


def _transformers_logprobs(path: Path) -> list[float]:
    """The oracle: transformers' own log-probs of IDS[1:] on the directory as it is now."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(IDS[1:])[:, None])[:, 0].tolist()


def _logprobs(sampler: Any) -> list[float]:
    got = sampler.compute_logprobs(types.ModelInput.from_ints(IDS)).result()
    return [float(x) for x in got[1:]]


def _once_released(create: Any) -> Any:
    """``create()``, once the dropped clients' sessions have ended (their last client gone)."""
    deadline = time.monotonic() + 30
    while True:
        gc.collect()
        try:
            return create()
        except REFUSED:
            assert time.monotonic() < deadline, "the old clients were not released"
            time.sleep(0.1)


def test_a_directory_saved_again_is_refused_while_open_then_loaded_anew(tmp_path: Path) -> None:
    path = make_tiny_hf_model_dir(tmp_path / "model", seed=0)
    backend = LocalBackend(tmp_path / "store")
    try:
        first = tinker.ServiceClient(backend=backend)
        old = first.create_sampling_client(base_model=str(path)).result()
        training = first.create_lora_training_client(str(path), rank=4).result()
        assert _logprobs(old) == pytest.approx(_transformers_logprobs(path), abs=1e-4)
        make_tiny_hf_model_dir(path, seed=1)  # the same directory, new weights
        second = tinker.ServiceClient(backend=backend)
        for create in (
            lambda: second.create_sampling_client(base_model=str(path)).result(),
            lambda: second.create_lora_training_client(str(path), rank=4).result(),
        ):
            with pytest.raises(REFUSED, match="changed on disk since it was loaded"):
                create()
        assert _logprobs(old) != pytest.approx(_transformers_logprobs(path), abs=1e-2)
        # a trainer's own samplers run the base it holds: not refused (review)
        mine = training.save_weights_and_get_sampling_client().result()
        assert _logprobs(mine) == _logprobs(old)
        del first, old, training, mine  # their session ends and frees the old weights
        new = _once_released(lambda: second.create_sampling_client(base_model=str(path)).result())
        assert _logprobs(new) == pytest.approx(_transformers_logprobs(path), abs=1e-4)
    finally:
        backend.close()


def test_a_directory_saved_again_after_its_clients_closed_loads_its_new_tokenizer(
    tmp_path: Path,
) -> None:
    path = make_tiny_hf_model_dir(tmp_path / "model", seed=0, n_merges=400)
    backend = LocalBackend(tmp_path / "store")
    try:
        first = tinker.ServiceClient(backend=backend)
        first.create_sampling_client(base_model=str(path)).result()
        old = backend.models.tokenizer(str(path)).hf.encode(TEXT)
        del first
        second = tinker.ServiceClient(backend=backend)
        deadline = time.monotonic() + 30
        while backend.models._resolved_in_use():  # the first session's sampler let go
            assert time.monotonic() < deadline
            gc.collect()
            time.sleep(0.1)
        make_tiny_hf_model_dir(path, seed=1, n_merges=100)  # new weights and vocabulary
        second.create_sampling_client(base_model=str(path)).result()
        now = backend.models.tokenizer(str(path)).hf.encode(TEXT)
        assert now == load_hf_tokenizer(path).encode(TEXT) != old
    finally:
        backend.close()
