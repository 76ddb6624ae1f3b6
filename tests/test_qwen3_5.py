"""Qwen3.5 directories (the cookbook's default models, e.g. Qwen/Qwen3.5-4B) as users bring
them: the Hub's vision-language checkpoint (``Qwen3_5ForConditionalGeneration``, weights under
``model.language_model.``, a vision tower beside) of a hybrid decoder, gated DeltaNet linear
attention in three layers of four and gated attention with partial RoPE in the fourth.

Checked against transformers on the same directory (logits, a padded batch, bf16, both
checkpoint layouts), the chunked recurrence against the plain one (values and gradients),
LoRA on the linear attention's projections as Tinker names them, sampling (prefill, then one
recurrent step per token; rows stopping at different times) against teacher forcing, the
official SDK through ``tinker-sr serve``, and the configs refused by name. The exports are in
tests/test_export.py, batched decode in tests/engine/test_batching.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import tinker_sr  # noqa: E402
from tests._server import ServerProcess, serving_model_dir  # noqa: E402
from tests._train import (  # noqa: E402
    assert_sampled_logprobs_are_the_learners,
    cross_entropy_steps,
    official_sdk_trains_and_samples,
)
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine import compiled, device  # noqa: E402
from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.engine.hf_config import config_from_hf  # noqa: E402
from tinker_sr.engine.hybrid import gated_delta_rule, gated_delta_step  # noqa: E402
from tinker_sr.engine.lora import LoraLinear  # noqa: E402
from tinker_sr.engine.model import save_pretrained  # noqa: E402
from tinker_sr.engine.sampler import generate, score_tokens  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.user_errors import EngineUserError  # noqa: E402

PROMPT = "User: what is 12 plus 30?\n\nAssistant:"


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("q35") / "tiny-qwen3.5", "qwen3_5")


def _tokens(n: int, rows: int = 2, seed: int = 0, vocab: int = 500) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, n), generator=torch.Generator().manual_seed(seed))


def test_the_hub_layout_loads_and_computes_transformers_logits(q35_dir: Path) -> None:
    hf = json.loads((q35_dir / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in hf
    ours = load_model_dir(q35_dir)
    theirs = AutoModelForCausalLM.from_pretrained(q35_dir, dtype=torch.float32).eval()
    assert ours.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert ours.config.rotary_dim == 4  # a quarter of the 16-wide heads
    # Lengths within one chunk of the recurrence, on its edge and across three.
    for n in (7, 64, 150):
        ids = _tokens(n, vocab=ours.config.vocab_size)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)
    # A right-padded batch: each row's real positions as alone.
    ids = _tokens(40, vocab=ours.config.vocab_size)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 25:] = False
    with torch.no_grad():
        batched = ours(ids, attn_mask=mask)
        alone = ours(ids[1:, :25])
    torch.testing.assert_close(batched[1, :25], alone[0], rtol=0, atol=1e-5)


def test_a_text_only_checkpoint_and_our_own_save_load_alike(q35_dir: Path, tmp_path: Path) -> None:
    """transformers' Qwen3_5ForCausalLM saved on its own (``model.layers.``, no vision tower),
    and the engine's save_pretrained (q/k/v fused back, norm gains as offsets from 1) loaded
    by transformers: the same logits."""
    theirs = AutoModelForCausalLM.from_pretrained(q35_dir, dtype=torch.float32).eval()
    theirs.save_pretrained(tmp_path / "text")
    ids = _tokens(30, vocab=theirs.config.vocab_size)
    with torch.no_grad():
        want = theirs(ids).logits
        torch.testing.assert_close(load_model_dir(tmp_path / "text")(ids), want, rtol=0, atol=1e-5)
        save_pretrained(load_model_dir(q35_dir), tmp_path / "ours")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
        torch.testing.assert_close(back.eval()(ids).logits, want, rtol=0, atol=1e-5)


def test_a_qwen3_5_without_linear_layers_still_reads_its_norm_offsets(tmp_path: Path) -> None:
    """``layer_types`` all full attention: no recurrent state, but still Qwen3.5's layout."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["full_attention"] * 2, architectures=["Qwen3_5ForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    theirs.save_pretrained(tmp_path / "full")
    ours = load_model_dir(tmp_path / "full")
    assert not ours.config.hybrid and ours.config.qwen3_5_layout
    ids = _tokens(20, vocab=300)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)
        save_pretrained(ours, tmp_path / "ours")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
        torch.testing.assert_close(back.eval()(ids).logits, theirs(ids).logits, rtol=0, atol=1e-5)


def test_bf16_checkpoint_stays_bf16_and_close_to_transformers(tmp_path: Path) -> None:
    root = make_tiny_hf_model_dir(tmp_path / "bf16", "qwen3_5", dtype="bfloat16")
    ours = load_model_dir(root)
    theirs = AutoModelForCausalLM.from_pretrained(root, dtype=torch.bfloat16).eval()
    assert ours.dtype == torch.bfloat16
    ids = _tokens(100, vocab=ours.config.vocab_size)
    with torch.no_grad():
        diff = (ours(ids).log_softmax(-1) - theirs(ids).logits.float().log_softmax(-1)).abs()
    # bf16 rounding (the engine holds 1 + w for the norm gains; transformers adds 1 in fp32).
    assert diff.max() < 0.05, diff.max()


def _recurrence(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any) -> tuple[Any, Any]:
    outs = []
    for t in range(q.shape[1]):
        y, state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(y)
    return torch.stack(outs, 1), state


C_RULE = [pytest.param(True, id="c-rule"), pytest.param(False, id="chunked")]


@pytest.mark.parametrize("c_rule", C_RULE)
@pytest.mark.parametrize("length", [1, 63, 64, 130])
def test_both_forms_of_the_rule_are_the_recurrence_in_values_and_gradients(
    length: int, c_rule: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways the engine runs the rule on a CPU (the C kernels, position by position; the
    chunked form, with them off) follow the float64 recurrence, values and gradients."""
    if not c_rule:
        monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    gen = torch.Generator().manual_seed(length)
    B, H, Dk, Dv = 2, 3, 8, 6

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(draw(B, length, H, Dk), dim=-1) for _ in range(2))
    v = draw(B, length, H, Dv)
    g = -torch.nn.functional.softplus(draw(B, length, H))  # decays in (0, 1)
    beta = torch.sigmoid(draw(B, length, H))
    state = draw(B, H, Dk, Dv)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, state)]
    y1, s1 = gated_delta_rule(*inputs)
    y2, s2 = _recurrence(*inputs)
    torch.testing.assert_close(y1, y2, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s1, s2, rtol=1e-9, atol=1e-9)
    weights = draw(*y1.shape)
    g1 = torch.autograd.grad((y1 * weights).sum() + s1.sum(), inputs)
    g2 = torch.autograd.grad((y2 * weights).sum() + s2.sum(), inputs)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


class _Subnormals(TorchDispatchMode):
    """Counts float32 subnormal values in every op's outputs run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func).startswith("aten.empty") or str(func).startswith("aten.new_empty"):
            return out  # not written yet (the C solve's output is checked as its view)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                tiny = (t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)
                if int(tiny.sum()):
                    self.found[str(func)] = self.found.get(str(func), 0) + int(tiny.sum())
        return out


@pytest.mark.parametrize("c_rule", C_RULE)
@pytest.mark.parametrize("decay_scale", [0.5, 5.0, 40.0])
def test_fast_decays_make_no_subnormal_floats_and_keep_the_values(
    decay_scale: float, c_rule: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decays of a few units per token (a random Qwen3.5's, and fast heads of real ones) ran into
    float32's subnormal range inside the chunked form, whose arithmetic x86 does in slow
    microcode: the step cost 1.3x (`benchmarks/linear_attention.py --baseline floor`). Forward
    and backward now make none, and the values still follow the float64 recurrence. (The C
    rule flushes subnormals to zero inside its kernels.)"""
    if not c_rule:
        monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    gen = torch.Generator().manual_seed(1)
    B, T, H, D = 2, 200, 2, 16
    q, k = (
        torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1) for _ in "qk"
    )
    v = torch.randn(B, T, H, D, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * decay_scale
    beta = torch.rand(B, T, H, generator=gen)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    with _Subnormals() as mode:
        y, s = gated_delta_rule(*inputs)
        grads = torch.autograd.grad(y.square().sum() + s.sum(), inputs)
    assert mode.found == {}
    wide = [t.detach().double().requires_grad_() for t in inputs]
    y64, s64 = _recurrence(*wide, torch.zeros(B, H, D, D, dtype=torch.float64))
    torch.testing.assert_close(y.double(), y64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.double(), s64, rtol=1e-4, atol=1e-5)
    grads64 = torch.autograd.grad(y64.square().sum() + s64.sum(), wide)
    for a, b in zip(grads, grads64, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-4)


def test_lora_covers_the_linear_attention_as_tinker_names_it_and_learns(
    tmp_path: Path, q35_dir: Path
) -> None:
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(str(q35_dir), rank=4, seed=1).result()
    model = backend.models.trainer(training.model_id).model
    linear, full = model.model.layers[0].linear_attn, model.model.layers[3].self_attn
    adapted = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "out_proj")
    assert all(isinstance(getattr(linear, n), LoraLinear) for n in adapted)
    assert type(linear.in_proj_a) is torch.nn.Linear and type(linear.in_proj_b) is torch.nn.Linear
    assert not any(p.requires_grad for p in (linear.A_log, linear.dt_bias, linear.conv1d.weight))
    assert isinstance(full.q_proj, LoraLinear) and full.q_proj.weight.shape[0] == 2 * 4 * 16

    ids = training.get_tokenizer().encode(PROMPT + " 42")
    losses = cross_entropy_steps(training, types, ids, steps=5, lr=1e-2)
    assert losses[-1] < 0.8 * losses[0], losses
    assert linear.in_proj_k.lora_B.weight.abs().sum() > 0  # the gradient reached k
    # Sampled on the trained weights, a prompt longer than one chunk of the recurrence: the
    # sampled tokens' log-probabilities are the learner's.
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = types.ModelInput.from_ints((ids * 6)[:70])
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop=[])
    assert_sampled_logprobs_are_the_learners(sampler, types, prompt, 3, params)
    client.close().result()
    backend.close()


def test_rows_that_stop_early_leave_the_others_states_intact(q35_dir: Path) -> None:
    """Rows finish at different steps (stop ids), so later steps decode a subset of each
    request's rows: every row's log-probabilities still equal teacher forcing."""
    model = load_model_dir(q35_dir)
    prompt = list(range(300, 340))
    outs = generate(model, prompt, num_samples=6, max_tokens=30, seed=5, temperature=1.0,
                    stop_token_ids=list(range(0, model.config.vocab_size, 9)))  # fmt: skip
    lengths = sorted(len(o.tokens) for o in outs)
    assert lengths[0] < lengths[-1] and lengths[-1] > 3, lengths
    for o in outs:
        seq = prompt + o.tokens
        want = score_tokens(model, seq)[len(prompt) - 1 : len(seq) - 1]
        assert max(abs(float(a) - b) for a, b in zip(want, o.logprobs, strict=True)) < 1e-4


def _one_step(tmp: Path, q35_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(device.TRAIN_DTYPE_ENV, dtype)
    backend = LocalBackend(tmp / dtype)
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(str(q35_dir), rank=4, seed=1).result()
    ids = training.get_tokenizer().encode(PROMPT + " 42") * 3
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    trainer = backend.models.trainer(training.model_id)
    grads = torch.cat([p.grad.flatten() for _, p in trainer.optim.params if p.grad is not None])
    client.close().result()
    backend.close()
    return loss, grads


def test_bf16_mixed_precision_step_matches_fp32(
    tmp_path: Path, q35_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 products, the recurrence kept in float32: loss and gradients as in float32."""
    from tinker_sr.engine import hybrid

    ref_loss, ref = _one_step(tmp_path, q35_dir, "float32", monkeypatch)
    autocast_seen: list[bool] = []
    rule = hybrid.gated_delta_rule

    def spy(*args: Any) -> Any:
        autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return rule(*args)

    monkeypatch.setattr(hybrid, "gated_delta_rule", spy)
    loss, grad = _one_step(tmp_path, q35_dir, "bf16-force", monkeypatch)
    assert autocast_seen and not any(autocast_seen)  # its products not autocast to bf16
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert float(torch.nn.functional.cosine_similarity(grad, ref, dim=0)) > 0.99
    assert float((grad - ref).norm() / ref.norm()) < 0.1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, q35_dir: Path) -> Iterator[ServerProcess]:
    with serving_model_dir(tmp_path_factory, q35_dir) as srv:
        yield srv


def test_the_official_sdk_trains_and_samples_a_qwen3_5_dir(
    server: ServerProcess, q35_dir: Path
) -> None:
    tinker = pytest.importorskip("tinker")
    official_sdk_trains_and_samples(tinker, server.base_url, str(q35_dir), PROMPT + " 42")


def _qwen3_5(**text: Any) -> dict[str, Any]:
    """A Hub-style Qwen3.5 config.json (text model inside the vision-language wrapper)."""
    base: dict[str, Any] = {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
    }  # fmt: skip
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": {**base, **text},
    }


def test_configs_read_as_transformers_reads_them() -> None:
    from transformers import Qwen3_5Config

    for text in ({}, {"full_attention_interval": 2}, {"layer_types": ["full_attention"] * 8}):
        hf = _qwen3_5(**text)
        ours = config_from_hf(hf, "m")
        theirs = Qwen3_5Config(**{k: v for k, v in hf.items() if k != "architectures"})
        assert list(ours.layer_types) == theirs.text_config.layer_types
        assert ours.rope_theta == theirs.text_config.rope_parameters["rope_theta"]
        assert ours.tie_embeddings and ours.max_seq_len == 32768


@pytest.mark.parametrize(
    ("text", "top", "field"),
    [
        ({}, {"model_type": "qwen3_5_moe"}, "qwen3_5_moe.*contradicts architectures"),
        ({"attn_output_gate": False}, {}, "attn_output_gate=False"),
        ({"layer_types": ["full_attention"] * 3}, {}, "layer_types=.* each of the 8"),
        ({"layer_types": ["sliding_attention"] * 8}, {}, "layer_types="),
        ({"layer_types": ["full_attention"] * 7 + [{}]}, {}, "layer_types="),
        ({"linear_num_value_heads": 3}, {}, "linear_num_value_heads=3 must be a multiple"),
        ({"linear_key_head_dim": 0}, {}, "linear_key_head_dim=0"),
        ({"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.1}}, {},
         "partial_rotary_factor=0.1 rotates 1 of 16"),
        ({"rope_parameters": {"rope_theta": 1e7, "mrope_extra": 1}}, {}, "mrope_extra"),
        ({}, {"text_config": [1]}, "needs a text_config object"),
    ],
)  # fmt: skip
def test_fields_the_engine_cannot_compute_are_refused(
    text: dict[str, Any], top: dict[str, Any], field: str
) -> None:
    with pytest.raises(EngineUserError, match=field):
        config_from_hf({**_qwen3_5(**text), **top}, "m")


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    """Long sequences recompute each layer in backward (`Transformer.checkpoint_layers`): the
    linear-attention layers' gradients are bit-identical to keeping their activations."""
    from tests.engine._hybrid import tiny_hybrid_model

    model = tiny_hybrid_model()
    model.requires_grad_(True)
    ids = _tokens(90, vocab=model.config.vocab_size)
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        model.checkpoint_layers = recompute
        model(ids).logsumexp(-1).sum().backward()
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1])
