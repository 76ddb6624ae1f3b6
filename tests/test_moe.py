"""Qwen3-MoE directories (the architecture of Tinker's Qwen3-30B-A3B and -235B-A22B) as users
bring them: LoRA on every expert's projections (``train_mlp`` covers the experts, never the
router), gradients reaching exactly the experts the router chose, and the official SDK
training and sampling one through ``tinker-sr serve``. The logits against transformers, the
sampled log-probabilities and the merged export are checked with the other architectures
(tests/test_hf_architectures.py, tests/test_export.py); batched decode in
tests/engine/test_batching.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import tinker_sr  # noqa: E402
from tests._server import ServerProcess, serving_model_dir  # noqa: E402
from tests._train import (  # noqa: E402
    assert_sampled_logprobs_are_the_learners,
    cross_entropy_steps,
    official_sdk_trains_and_samples,
)
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine.lora import LoraLinear  # noqa: E402
from tinker_sr.engine.model import SparseMoe  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402

PROMPT = "User: what is 12 plus 30?\n\nAssistant:"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layer 0 dense (``mlp_only_layers``), layer 1 sparse: 2 of 8 experts per token."""
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", "qwen3_moe")


def test_every_expert_has_an_adapter_and_only_the_routed_ones_learn(
    tmp_path: Path, moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(str(moe_dir), rank=4, seed=1).result()
    model = backend.models.trainer(training.model_id).model
    moe = model.model.layers[1].mlp
    assert isinstance(moe, SparseMoe) and not isinstance(model.model.layers[0].mlp, SparseMoe)
    assert type(moe.gate) is torch.nn.Linear  # the router: frozen, no adapter
    experts = [getattr(e, p) for e in moe.experts for p in ("gate_proj", "up_proj", "down_proj")]
    assert len(experts) == 24 and all(isinstance(m, LoraLinear) for m in experts)
    # Tinker's shared-outer scheme: the hidden-side factor (gate's and up's A, down's B) is one
    # per layer, the other factor each expert's own; r (3 D + 3 E F) parameters per layer.
    first = moe.experts[0]
    for e in moe.experts:
        assert (
            e.gate_proj.lora_A is first.gate_proj.lora_A
            and e.up_proj.lora_A is first.up_proj.lora_A
        )
        assert e.down_proj.lora_B is first.down_proj.lora_B
    assert e.gate_proj.lora_B is not first.gate_proj.lora_B
    layer = [p for n, p in model.named_parameters() if p.requires_grad and ".layers.1.mlp." in n]
    d, f, r = model.config.dim, model.config.moe_ffn_dim, 4
    assert sum(p.numel() for p in layer) == r * (3 * d + 3 * 8 * f)

    ids = training.get_tokenizer().encode(PROMPT + " 42")
    # The experts the router picks for these tokens in the first step.
    seen: list[torch.Tensor] = []
    route = moe.route

    def recording(logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = route(logits, dtype)
        seen.append(chosen)
        return weights, chosen

    monkeypatch.setattr(moe, "route", recording)
    first = cross_entropy_steps(training, types, ids, steps=1, lr=1e-2)
    monkeypatch.setattr(moe, "route", route)
    routed = set(seen[0].flatten().tolist())
    assert 2 <= len(routed) < 8, routed  # a few tokens do not reach every expert
    learned = {i for i, e in enumerate(moe.experts) if e.gate_proj.lora_B.weight.abs().sum() > 0}
    assert learned == routed  # Adam moved exactly the routed experts' own B (all start at zero)

    losses = first + cross_entropy_steps(training, types, ids, steps=4, lr=1e-2)
    assert losses[-1] < 0.8 * losses[0], losses
    # Sampling on the trained weights: the sampled tokens' log-probabilities are the learner's.
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = types.ModelInput.from_ints(ids[:-2])
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    assert_sampled_logprobs_are_the_learners(sampler, types, prompt, 3, params)
    client.close().result()
    backend.close()


def test_checkpoints_with_every_experts_own_adapters_still_load(
    tmp_path: Path, moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint saved before the shared-outer scheme (each expert its own A and B; its
    LoRA config has no ``moe_shared_outer``, read as false) resumes with that structure, the
    same weights and optimizer state; loading it into a new run's shared structure is refused
    naming the difference, not a shape error."""
    from tinker_sr.engine import training as engine_training

    new_spec = engine_training.lora_spec
    monkeypatch.setattr(engine_training, "lora_spec", lambda cfg, experts=False: new_spec(cfg))
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    old = client.create_lora_training_client(str(moe_dir), rank=4, seed=1).result()
    ids = old.get_tokenizer().encode(PROMPT + " 42")
    cross_entropy_steps(old, types, ids, steps=2, lr=1e-2)
    path = old.save_state("old").result().path
    monkeypatch.undo()

    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    moe = backend.models.trainer(resumed.model_id).model.model.layers[1].mlp
    assert moe.experts[1].gate_proj.lora_A is not moe.experts[0].gate_proj.lora_A
    want = cross_entropy_steps(old, types, ids, steps=1, lr=1e-2)
    assert cross_entropy_steps(resumed, types, ids, steps=1, lr=1e-2) == want
    fresh = client.create_lora_training_client(str(moe_dir), rank=4, seed=1).result()
    with pytest.raises(Exception, match="moe_shared_outer"):
        fresh.load_state(path).result()
    client.close().result()
    backend.close()


def test_a_run_without_expert_adapters_loads_a_checkpoint_from_before_the_scheme(
    tmp_path: Path, moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``train_mlp=False`` no expert has an adapter, so the shared-outer scheme changes
    nothing: a checkpoint saved before it (no ``moe_shared_outer``: false) loads into a new
    run with the same LoRA config. Before: refused, the new run's config saying true."""
    from tinker_sr.engine import training as engine_training

    new_spec = engine_training.lora_spec
    monkeypatch.setattr(engine_training, "lora_spec", lambda cfg, experts=False: new_spec(cfg))
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    old = client.create_lora_training_client(str(moe_dir), rank=4, seed=1, train_mlp=False).result()
    ids = old.get_tokenizer().encode(PROMPT + " 42")
    cross_entropy_steps(old, types, ids, steps=2, lr=1e-2)
    path = old.save_state("old").result().path
    monkeypatch.undo()

    fresh = client.create_lora_training_client(
        str(moe_dir), rank=4, seed=2, train_mlp=False
    ).result()
    fresh.load_state(path).result()  # the same weights: the same loss
    want = cross_entropy_steps(old, types, ids, steps=1, lr=1e-2)
    assert cross_entropy_steps(fresh, types, ids, steps=1, lr=1e-2) == want
    client.close().result()
    backend.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, moe_dir: Path) -> Iterator[ServerProcess]:
    with serving_model_dir(tmp_path_factory, moe_dir) as srv:
        yield srv


def test_the_official_sdk_trains_and_samples_a_moe_dir(
    server: ServerProcess, moe_dir: Path
) -> None:
    tinker = pytest.importorskip("tinker")
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-test")
    names = {m.model_name for m in rest.get_server_capabilities().result().supported_models}
    assert str(moe_dir) in names
    official_sdk_trains_and_samples(tinker, server.base_url, str(moe_dir), PROMPT + " 42")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_shared_factors_gradient_is_the_sum_over_its_experts(tmp_path: Path, family: str) -> None:
    """The same adapter values held shared (one hidden-side factor per layer) and held per
    expert (each expert a copy): the shared factor's gradient is the sum of the copies'
    (through the training kernels: SwiGLU experts, gpt-oss's clamped ones), the others equal."""
    from tinker_sr.engine.hf import load_model_dir
    from tinker_sr.engine.lora import LoraSpec, apply_lora

    root = make_tiny_hf_model_dir(tmp_path / family, family)
    models = {}
    for shared in (True, False):
        models[shared] = load_model_dir(root)
        apply_lora(models[shared], LoraSpec(rank=4, seed=1, moe_shared_outer=shared))
    _same_adapter_values(models)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    grads = {}
    for shared, model in models.items():
        model(ids).logsumexp(-1).sum().backward()
        grads[shared] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    _assert_shared_grads_are_sums(grads[True], grads[False])


_OUTER = re.compile(
    r"(.*\.mlp\.experts\.)\d+\.(gate_proj\.lora_A|up_proj\.lora_A|down_proj\.lora_B)\.weight"
)


def shared_name(name: str) -> str:
    """A per-expert adapter's name in the shared-outer scheme (expert 0's for a shared factor)."""
    m = _OUTER.fullmatch(name)
    return name if m is None else f"{m[1]}0.{m[2]}.weight"


def _same_adapter_values(models: dict[bool, Any]) -> None:
    """Random adapter values (seeded) into the shared-outer model (``models[True]``) and the
    same into the per-expert one (``models[False]``): each expert's copy of a shared factor
    gets the shared value."""
    gen = torch.Generator().manual_seed(5)
    values = {n: torch.randn(p.shape, generator=gen) * 0.05
              for n, p in models[True].named_parameters() if p.requires_grad}  # fmt: skip
    with torch.no_grad():
        for model in models.values():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(values[shared_name(n)])


def _assert_shared_grads_are_sums(
    shared: dict[str, torch.Tensor | None], own: dict[str, torch.Tensor | None]
) -> None:
    """The shared-outer model's gradients (``shared``) against the per-expert model's
    (``own``) for the same adapter values: each shared factor's, the sum of its copies'."""
    summed: dict[str, torch.Tensor] = {}
    for n, g in own.items():
        if g is not None:
            summed[shared_name(n)] = summed.get(shared_name(n), 0) + g
    assert len(shared) < len(own)  # really shared
    for n, g in shared.items():
        if g is None:
            assert n not in summed
            continue
        torch.testing.assert_close(
            g, summed[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}"
        )


def test_bf16_training_sums_a_shared_factors_gradient_in_float32(
    tmp_path: Path, moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 mixed precision (``TINKER_SR_TRAIN_DTYPE``) a shared factor's gradient is
    still the float32 sum of what each expert sends it, as a per-expert copy's would be.
    Before: autocast cast the shared float32 factor to bf16 once per step and reused the cast
    for every expert (its cache of leaf casts), so the experts' gradients were summed in bf16
    in that one cast's backward: elements up to 6 % (5e-3
    absolute) off here, more with more experts."""
    from tinker_sr.engine import training as engine_training

    monkeypatch.setenv("TINKER_SR_TRAIN_DTYPE", "bf16-force")
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    clients = {True: client.create_lora_training_client(str(moe_dir), rank=4, seed=1).result()}
    new_spec = engine_training.lora_spec  # each expert its own pair, as an older run's
    monkeypatch.setattr(engine_training, "lora_spec", lambda cfg, experts=False: new_spec(cfg))
    clients[False] = client.create_lora_training_client(str(moe_dir), rank=4, seed=1).result()
    models = {k: backend.models.trainer(c.model_id).model for k, c in clients.items()}
    assert models[True].autocast_dtype == torch.bfloat16
    _same_adapter_values(models)
    ids = clients[True].get_tokenizer().encode(PROMPT + " 42")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    grads = {}
    for shared, model in models.items():
        clients[shared].forward_backward([datum], "cross_entropy").result()
        grads[shared] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    _assert_shared_grads_are_sums(grads[True], grads[False])
    client.close().result()
    backend.close()
