"""OpenAI's gpt-oss (openai/gpt-oss-20b, -120b: in Tinker's lineup) as transformers saves it:
attention sinks, a sliding window in every other layer (computed, not capped), biased q/k/v/o,
2 of 8 experts with biases and the clamped SwiGLU behind a biased router, YaRN RoPE, the
harmony chat tokens. Checked against transformers (logits past the window, the config), LoRA
on every expert (never the router or the sinks), sampling against teacher forcing past the
window. Batched decode in tests/engine/test_batching.py, the merged export in
tests/test_export.py, the builder and the cookbook's gpt-oss renderer in
tests/test_hf_model_dir_gpt_oss.py, the cookbook's RL recipe on it (as "openai/gpt-oss-20b")
in tests/integration/test_cookbook.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig  # noqa: E402

import tinker_sr  # noqa: E402
from tests._train import learns_and_samples_as_the_learner  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine.gpt_oss import ClampedMLP  # noqa: E402
from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.engine.hf_config import config_from_hf  # noqa: E402
from tinker_sr.engine.lora import LoraLinear  # noqa: E402
from tinker_sr.engine.model import SparseMoe  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.user_errors import EngineUserError  # noqa: E402

# openai/gpt-oss-20b's config.json, as the Hub has it (sizes shrunk; its MXFP4
# quantization_config left out: refused below).
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 256, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 131072, "num_attention_heads": 8, "num_experts_per_tok": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 32,
    "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 1024,
}  # fmt: skip


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory.mktemp("gpt_oss") / "tiny", "gpt_oss")


def _logits(model: Any, n: int = 70) -> torch.Tensor:
    ids = torch.randint(0, 600, (2, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def test_logits_equal_transformers_past_the_window(oss_dir: Path) -> None:
    ours = load_model_dir(oss_dir)
    assert ours.config.sliding_window == 16 and ours.config.max_seq_len == 131072  # no cap
    mlp = ours.model.layers[0].mlp
    assert isinstance(mlp, SparseMoe) and isinstance(mlp.experts[0], ClampedMLP)
    theirs = AutoModelForCausalLM.from_pretrained(oss_dir, dtype=torch.float32).eval()
    want = _logits(theirs)
    torch.testing.assert_close(_logits(ours), want, rtol=0, atol=1e-5)
    # Each part matters: without the sinks, the window or the router's bias it is another model.
    for part in ("sinks", "window", "router bias"):
        other = load_model_dir(oss_dir)
        with torch.no_grad():
            for layer in other.model.layers:
                if part == "sinks":
                    layer.self_attn.sinks.zero_()
                elif part == "window":
                    layer.self_attn.window = 0
                else:
                    layer.mlp.gate.bias.zero_()
        assert (_logits(other) - want).abs().max() > 1e-3, part


def test_bf16_logits_close_to_transformers(oss_dir: Path) -> None:
    ours = load_model_dir(oss_dir, dtype=torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(oss_dir, dtype=torch.bfloat16).eval()
    diff = (_logits(ours, 40).float() - _logits(theirs, 40).float()).abs().max()
    assert diff < 0.1, diff  # bf16 rounding (transformers multiplies the norm gain in fp32)


def test_the_hubs_config_read_as_transformers_reads_it() -> None:
    ours = config_from_hf(GPT_OSS_20B, "gpt-oss-20b")
    # transformers writes rope_theta into the rope dict it is given: a copy each time
    theirs = GptOssConfig(
        **{k: v for k, v in copy.deepcopy(GPT_OSS_20B).items() if k != "architectures"}
    )
    assert (ours.n_experts, ours.experts_per_token, ours.moe_ffn_dim) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size)  # fmt: skip
    assert ours.moe_layers == (0, 1, 2, 3) and list(ours.layer_types) == theirs.layer_types
    assert ours.sliding_window == theirs.sliding_window == 128
    assert ours.attention_bias and ours.attention_out_bias and not ours.qk_norm
    assert ours.max_seq_len == 131072 and ours.rope_theta == 150000
    assert dict(ours.rope_scaling or ())["rope_type"] == "yarn"
    assert (ours.swiglu_alpha, ours.swiglu_limit) == (theirs.swiglu_alpha, theirs.swiglu_limit)
    # transformers' defaults for what a config.json may leave out
    left_out = ("attention_bias", "layer_types", "sliding_window", "rope_scaling", "rope_theta",
                "num_experts_per_tok", "rms_norm_eps")  # fmt: skip
    bare = {k: v for k, v in GPT_OSS_20B.items() if k not in left_out}
    ours, theirs = config_from_hf(bare, "bare"), GptOssConfig(**copy.deepcopy(bare))
    assert ours.attention_bias and list(ours.layer_types) == theirs.layer_types
    # 4 and 1e-5 for gpt-oss (8 and 1e-6 for the other architectures)
    assert (ours.experts_per_token, ours.norm_eps) == (
        theirs.num_experts_per_tok, theirs.rms_norm_eps)  # fmt: skip
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 150000
    assert ours.sliding_window == 128 and dict(ours.rope_scaling or ()) == {
        k: v for k, v in theirs.rope_parameters.items() if k != "rope_theta"}  # fmt: skip


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config \\(mxfp4\\)"),
        ({"layer_types": ["linear_attention"] * 4}, "layer_types=.*'sliding_attention'"),
        ({"layer_types": ["full_attention"]}, "layer_types=.*each of the 4 layers"),
        ({"sliding_window": 0}, "sliding_window=0"),
        # transformers refuses it too (its sliding mask needs the window)
        ({"sliding_window": None}, "sliding_window is null but layer_types has sliding"),
        ({"swiglu_limit": -1}, "swiglu_limit=-1"),
        # transformers refuses null too (was: silently the default 7.0)
        ({"swiglu_limit": None}, "swiglu_limit is null; give a positive number"),
        ({"swiglu_alpha": None}, "swiglu_alpha is null.*default \\(1.702\\)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 32, "beta_fast": "x"}}, "beta_fast"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 32, "truncate": 1}}, "truncate=1"),
        # found by tests/fuzz/test_fuzz_hf_config.py: was a ZeroDivisionError
        ({"rope_theta": 1}, "rope_theta=1 must be above 1"),
    ],
)
def test_what_the_engine_cannot_compute_is_refused_by_name(
    over: dict[str, Any], field: str
) -> None:
    with pytest.raises(EngineUserError, match=field):
        config_from_hf(GPT_OSS_20B | over, "m")


def test_lora_on_every_expert_learns_and_samples_as_the_learner(
    tmp_path: Path, oss_dir: Path
) -> None:
    """The prompt (rendered with the model's harmony template) plus samples run past the
    16-token window, so decode's windowed attention is checked against teacher forcing."""
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(str(oss_dir), rank=4, seed=1).result()
    model = backend.models.trainer(training.model_id).model
    moe = model.model.layers[1].mlp
    assert all(isinstance(getattr(e, p), LoraLinear) for e in moe.experts
               for p in ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
    assert (
        type(moe.gate) is torch.nn.Linear
        and not model.model.layers[0].self_attn.sinks.requires_grad
    )
    tok = AutoTokenizer.from_pretrained(oss_dir)
    chat = [{"role": "user", "content": "what is 12 plus 30? think step by step first"}]
    ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert len(ids) > 16
    learns_and_samples_as_the_learner(training, types, ids + tok.encode("<|message|>42"))
    client.close().result()
    backend.close()


def test_a_config_written_back_is_the_same_model_in_transformers(
    tmp_path: Path, oss_dir: Path
) -> None:
    """`save_pretrained` (`config_to_hf`) of a gpt-oss whose RoPE is plain (no YaRN) and whose
    layers all attend fully: the RoPE type is written (left out, both readers would take
    gpt-oss's YaRN default) and so is a window (transformers builds its sliding mask even
    where no layer uses it, and fails on a null one)."""
    from tinker_sr.engine.model import save_pretrained

    src = tmp_path / "src"
    src.mkdir()
    for f in oss_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (src / "config.json").write_text(json.dumps(config))
    want = _logits(load_model_dir(src))
    save_pretrained(load_model_dir(src), tmp_path / "out")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(theirs), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(load_model_dir(tmp_path / "out")), want, rtol=0, atol=0)
