"""Qwen3.5's DeltaNet C passes (short convolution, gated norm) with half-precision operands: a
bfloat16 checkpoint's projections, or autocast's, read as float32 and computed in float32."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tinker_sr.engine import compiled, delta_native, hybrid

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_the_c_passes() -> None:
    if compiled.native_mode() == "off" or delta_native._deltanet_library() is None:
        pytest.skip("no C compiler here")


def _grads(fn: Callable[..., torch.Tensor | None], *leaves: torch.Tensor) -> list[torch.Tensor]:
    """fn's output (float32) and the gradients of a fixed weighting of it for ``leaves``."""
    leaves = tuple(t.detach().clone().requires_grad_() for t in leaves)
    out = fn(*leaves)
    assert out is not None, "the C pass refused its operands"
    assert out.dtype == torch.float32
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]  # type: ignore[misc]


def test_the_convolution_reads_bfloat16_as_float32_and_returns_its_gradient_in_bfloat16() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 48, generator=gen).to(BF16)
    w = torch.randn(48, 1, 4, generator=gen).to(BF16)
    want = _grads(lambda t: delta_native.short_conv_silu(t, w.float()), x.float())
    got = _grads(lambda t: delta_native.short_conv_silu(t, w), x)
    assert torch.equal(got[0], want[0])  # the same float32 arithmetic on the same values
    assert got[1].dtype == BF16 and torch.equal(got[1], want[1].to(BF16))
    with torch.autocast("cpu", dtype=BF16):  # autocast changes nothing in it
        under = _grads(lambda t: delta_native.short_conv_silu(t, w), x)
    assert torch.equal(under[0], want[0]) and torch.equal(under[1], got[1])
    init = torch.randn(3, 48, 3, generator=gen).to(BF16)  # a decode cache's window
    with torch.no_grad():
        resumed = delta_native.short_conv_silu(x, w, init)
        assert resumed is not None
        assert torch.equal(resumed, delta_native.short_conv_silu(x.float(), w, init.float()))


@pytest.mark.parametrize("y_dtype", [torch.float32, BF16])
def test_the_gated_norm_reads_bfloat16_as_float32_and_returns_its_gradients_in_theirs(
    y_dtype: torch.dtype,
) -> None:
    """y heads-major as the rule returns it (a transposed view), z and the gain in bfloat16."""
    gen = torch.Generator().manual_seed(1)
    y_heads = torch.randn(2, 4, 30, 64, generator=gen).to(y_dtype)  # [B, H, T, n]
    z = torch.randn(2, 30, 4, 64, generator=gen).to(BF16)
    w = (torch.rand(64, generator=gen) + 0.5).to(BF16)

    def norm(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor | None:
        return delta_native.gated_rms_norm(y.transpose(1, 2), z, w, 1e-6)

    want = _grads(lambda y, z: norm(y, z, w.float()), y_heads.float(), z.float())
    got = _grads(norm, y_heads, z)
    assert torch.equal(got[0], want[0])
    assert got[1].dtype == y_dtype and torch.equal(got[1], want[1].to(y_dtype))
    assert got[2].dtype == BF16 and torch.equal(got[2], want[2].to(BF16))


def _layer_run(
    layer: hybrid.GatedDeltaNet, x: torch.Tensor, autocast: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    xi = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = layer(xi, 0, None, 0)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * weights).sum().backward()
    assert xi.grad is not None
    return out.detach().float(), xi.grad.float()


def _float32_only(fn: Callable[..., torch.Tensor | None]) -> Callable[..., torch.Tensor | None]:
    """The pass as it was: torch's ops for any operand not float32, or under autocast."""

    def refusing(*args: torch.Tensor | None) -> torch.Tensor | None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(t.dtype != torch.float32 for t in tensors) or torch.is_autocast_enabled("cpu"):
            return None
        return fn(*args)

    return refusing


@pytest.mark.parametrize("way", ["bfloat16 checkpoint", "autocast"])
def test_a_half_precision_deltanet_layer_takes_the_c_passes_nearer_float32(
    way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeltaNet layer of bfloat16 weights (as a bf16 checkpoint loads), or of float32 weights
    under bfloat16 autocast (``TINKER_SR_TRAIN_DTYPE=bf16``), frozen as LoRA training keeps the
    base: both C passes run, and its output and input gradient are nearer the float32 layer's
    (the same bfloat16-rounded weights) than with torch's half-precision ops in their place."""
    from tests.engine._hybrid import tiny_hybrid_model

    layer = tiny_hybrid_model().model.layers[0].linear_attn.requires_grad_(False)
    assert isinstance(layer, hybrid.GatedDeltaNet)
    rounded = copy.deepcopy(layer).to(BF16).float()  # the float32 reference
    tested = copy.deepcopy(rounded).to(BF16) if way == "bfloat16 checkpoint" else rounded
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 70, layer.in_proj_q.in_features, generator=gen).to(BF16)
    want = _layer_run(rounded, x.float(), autocast=False)
    x_in = x if way == "bfloat16 checkpoint" else x.float()
    ran: list[bool] = []
    conv, norm = delta_native.short_conv_silu, delta_native.gated_rms_norm

    def recording(fn: Callable[..., torch.Tensor | None]) -> Callable[..., torch.Tensor | None]:
        def call(*args: torch.Tensor | None) -> torch.Tensor | None:
            out = fn(*args)
            ran.append(out is not None)
            return out

        return call

    monkeypatch.setattr(hybrid, "short_conv_silu", recording(conv))
    monkeypatch.setattr(hybrid, "gated_rms_norm", recording(norm))
    got = _layer_run(tested, x_in, autocast=way == "autocast")
    assert ran == [True, True]
    monkeypatch.setattr(hybrid, "short_conv_silu", _float32_only(conv))
    monkeypatch.setattr(hybrid, "gated_rms_norm", _float32_only(norm))
    before = _layer_run(tested, x_in, autocast=way == "autocast")

    def error(pair: tuple[torch.Tensor, torch.Tensor], i: int) -> float:
        return float((pair[i] - want[i]).norm() / want[i].norm())

    for i in (0, 1):  # the output, the input's gradient
        assert error(got, i) < 2e-2
        assert error(got, i) < error(before, i)


def _sampled_against_forward(model_dir: Path, store: Path) -> float:
    """The largest difference between a sampled token's log-prob and the training forward's
    for the same sequence (4 samples of 40 tokens from the public client)."""
    import tinker_sr as tinker
    from tinker_sr.backend.local import LocalBackend

    types = tinker.types
    # In bfloat16 also on a CPU without bf16 products (there it would load in float32).
    service = tinker.ServiceClient(backend=LocalBackend(store, model_dtype="bfloat16"))
    trainer = service.create_lora_training_client(base_model=str(model_dir), rank=8, seed=0)
    training = trainer.result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = list(range(100, 140))
    params = types.SamplingParams(max_tokens=40, seed=3, temperature=1.0)
    sequences = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints((prompt + seq.tokens)[:-1]),
            loss_fn_inputs={
                "target_tokens": (prompt + seq.tokens)[1:],
                "weights": [1.0] * (len(prompt) + len(seq.tokens) - 1),
            },
        )
        for seq in sequences
    ]
    outputs = training.forward(data, "cross_entropy").result().loss_fn_outputs
    start = len(prompt) - 1  # the first sampled token's position
    service.close()
    return max(
        float((out["logprobs"].to_torch()[start:] - torch.tensor(seq.logprobs)).abs().max())
        for out, seq in zip(outputs, sequences, strict=True)
    )


def test_a_bf16_qwen3_5_checkpoints_samples_carry_its_forwards_log_probs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling (prefill, then decode steps) and training's forward of a bfloat16 Qwen3.5
    directory compute the short convolution in float32 alike, so a sampled token's log-prob
    is the forward's within bfloat16's products' noise: well under the gap with the decode
    step's convolution left in bfloat16 (measured in the same run: the products' rounding
    differs between CPUs). Here ~1e-3 against ~3e-3 (and 2e-3 before the C passes took bf16)."""
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    model_dir = make_tiny_hf_model_dir(tmp_path / "model", "qwen3_5", dtype="bfloat16")
    gap = _sampled_against_forward(model_dir, tmp_path / "now")
    monkeypatch.setattr(hybrid, "deltanet_runs", lambda device: False)  # decode's conv in bf16
    in_bf16 = _sampled_against_forward(model_dir, tmp_path / "decode in bf16")
    assert gap < 0.6 * in_bf16 and gap < 5e-3, (gap, in_bf16)
