from __future__ import annotations

from typing import Any

import pytest
import torch

from tinker_sr.engine.fused import frozen_linear
from tinker_sr.engine.lora import (
    LoraLinear,
    LoraSpec,
    apply_lora,
    clone_for_sampling,
    load_lora_state_dict,
    lora_state_dict,
    trainable_parameters,
)
from tinker_sr.engine.model import ModelConfig, Transformer, build_model
from tinker_sr.engine.sampler import generate
from tinker_sr.user_errors import EngineUserError

TINY = "tinker-sr/tiny"
QWEN_TINY = ModelConfig(
    name="test/qwen3-tiny", vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
    ffn_dim=128, max_seq_len=256, qk_norm=True, tie_embeddings=False,
)  # fmt: skip
TOKENS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


def lora_model(spec: LoraSpec, name: str | ModelConfig = TINY) -> Transformer:
    model = build_model(name, seed=1)
    apply_lora(model, spec)
    return model


def randomise_b(model: Transformer, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainable_parameters(model):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_zero_init_adapter_equals_base_model() -> None:
    base = build_model(TINY, seed=1)
    model = lora_model(LoraSpec(rank=4, seed=0))
    with torch.no_grad():
        assert torch.equal(model(TOKENS), base(TOKENS))
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora" not in n)


@pytest.mark.parametrize(
    ("flags", "wrapped"),
    [
        (
            dict(),
            {
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "lm_head",
            },
        ),
        (dict(train_mlp=False, train_unembed=False), {"q_proj", "k_proj", "v_proj", "o_proj"}),
        (dict(train_attn=False, train_unembed=False), {"gate_proj", "up_proj", "down_proj"}),
        (dict(train_attn=False, train_mlp=False), {"lm_head"}),
    ],
)
def test_train_flags_select_layers(flags: dict, wrapped: set[str]) -> None:
    model = lora_model(LoraSpec(rank=2, seed=0, **flags))
    got = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert got == wrapped
    names = [n for n, _ in trainable_parameters(model)]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    n_layers = 2 * (4 * flags.get("train_attn", True) + 3 * flags.get("train_mlp", True))
    assert len(names) == 2 * (n_layers + flags.get("train_unembed", True))


def test_base_names_are_unchanged_and_adapter_names_are_stable() -> None:
    model = lora_model(LoraSpec(rank=2, seed=0))
    sd = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in sd
    adapters = lora_state_dict(model)
    assert adapters["model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (2, 64)
    assert adapters["model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 2)
    assert adapters["lm_head.lora_B.weight"].shape == (259, 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_seeded_init_is_deterministic() -> None:
    a = lora_state_dict(lora_model(LoraSpec(rank=4, seed=7)))
    b = lora_state_dict(lora_model(LoraSpec(rank=4, seed=7)))
    c = lora_state_dict(lora_model(LoraSpec(rank=4, seed=8)))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    unseeded = lora_state_dict(lora_model(LoraSpec(rank=4, seed=None)))
    assert unseeded.keys() == a.keys()


def test_state_dict_round_trip_and_strictness() -> None:
    src = lora_model(LoraSpec(rank=4, seed=1))
    randomise_b(src)
    dst = lora_model(LoraSpec(rank=4, seed=2))
    load_lora_state_dict(dst, lora_state_dict(src))
    with torch.no_grad():
        assert torch.equal(src(TOKENS), dst(TOKENS))
    sd = lora_state_dict(src)
    with pytest.raises(EngineUserError, match="1 missing"):
        load_lora_state_dict(
            dst, {k: v for k, v in sd.items() if "lm_head" not in k or "lora_A" in k}
        )
    with pytest.raises(EngineUserError, match="shape"):
        load_lora_state_dict(dst, lora_state_dict(lora_model(LoraSpec(rank=3, seed=1))))
    with pytest.raises(EngineUserError, match="unexpected"):
        load_lora_state_dict(dst, sd | {"model.extra.lora_A.weight": torch.zeros(1)})


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (LoraSpec(rank=0, seed=0), "rank"),
        (
            LoraSpec(rank=2, seed=0, train_attn=False, train_mlp=False, train_unembed=False),
            "at least one",
        ),
    ],
)
def test_bad_specs_are_user_errors(spec: LoraSpec, match: str) -> None:
    with pytest.raises(EngineUserError, match=match):
        apply_lora(build_model(TINY), spec)


@pytest.mark.parametrize("name", [TINY, QWEN_TINY])
def test_clone_for_sampling_matches_and_is_independent(name: str | ModelConfig) -> None:
    model = lora_model(LoraSpec(rank=4, seed=0), name)
    randomise_b(model)
    with torch.no_grad():
        want = model(TOKENS)
    clone = clone_for_sampling(model)
    assert not any(isinstance(m, LoraLinear) for m in clone.modules())
    assert not any(p.requires_grad for p in clone.parameters())
    with torch.no_grad():
        torch.testing.assert_close(clone(TOKENS), want, atol=1e-5, rtol=0)
        # frozen base weights are shared, not copied
        assert clone.model.norm.weight.data_ptr() == model.model.norm.weight.data_ptr()
        # an optimizer step on the training model must not reach the clone
        for _, p in trainable_parameters(model):
            p.add_(0.1)
        torch.testing.assert_close(clone(TOKENS), want, atol=1e-5, rtol=0)
        assert not torch.allclose(model(TOKENS), want, atol=1e-3)
    # the adapted lm_head was untied from the embedding in the clone
    assert clone.lm_head.weight is not clone.model.embed_tokens.weight


def test_bfloat16_clone_samples_and_differs_slightly() -> None:
    model = lora_model(LoraSpec(rank=4, seed=0))
    randomise_b(model)
    f32, bf16 = clone_for_sampling(model), clone_for_sampling(model, dtype=torch.bfloat16)
    assert bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        diff = (bf16(TOKENS) - f32(TOKENS)).abs().max().item()
    assert 0 < diff < 0.05
    prompt = [256, 72, 105]
    a = generate(f32, prompt, num_samples=2, max_tokens=8, seed=0, stability_k=4)
    b = generate(bf16, prompt, num_samples=2, max_tokens=8, seed=0, stability_k=4)
    assert all(len(o.tokens) == 8 for o in a + b)
    assert [o.logprobs for o in a] != [o.logprobs for o in b]


def test_unadapted_clone_keeps_tied_embeddings() -> None:
    model = lora_model(LoraSpec(rank=2, seed=0, train_unembed=False))
    clone = clone_for_sampling(model)
    assert clone.lm_head.weight is clone.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_base_keeps_no_float32_copy_of_the_input(dtype: torch.dtype) -> None:
    """A bf16/fp16 base with float32 adapters: backward keeps the layer's input in its own
    dtype (one tensor for q, k and v alike), not a float32 copy per adapter; the gradients
    are those of the plain float32 adapter products to float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(64, 48, bias=False).to(dtype).requires_grad_(False)
    layer = LoraLinear(base, rank=4, alpha=8.0, generator=gen)
    with torch.no_grad():
        layer.lora_B.weight.normal_(0.0, 0.5, generator=gen)
    x = torch.randn(3, 5, 64, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(3, 5, 48, generator=gen).to(dtype)
    grads = []
    for plain in (False, True):
        saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

        def pack(t: torch.Tensor, out: list[Any] = saved) -> torch.Tensor:
            out.append((t.dtype, tuple(t.shape)))
            return t

        x.grad = layer.lora_A.weight.grad = layer.lora_B.weight.grad = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # Any other product function takes the plain form (as decode passes its own).
            y = layer.forward_with(x, frozen_linear if not plain else _plain)
        y.backward(g)
        wide = [(d, s) for d, s in saved if d == torch.float32 and s[-1] == 64 and s[0] > 4]
        assert (len(wide) > 0) == plain, saved  # float32 copies of x only in the plain form
        grads.append([x.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad])
    for ours, ref in zip(*grads, strict=True):
        assert ours is not None and ref is not None and ours.dtype == ref.dtype
        torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-5, atol=1e-6)
        # The scaling (alpha / rank = 2) applied on the rank-4 side: exact for a power of two.
        assert torch.equal(ours, ref)


def _plain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return frozen_linear(x, w, b)
