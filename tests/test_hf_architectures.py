"""The Hugging Face architectures users bring beyond Llama and Qwen3 (Qwen2 with its q/k/v biases,
Mistral with its sliding window, Llama with attention biases, Qwen3-MoE), each checked against
transformers on the same directory; and the config fields or tensors the engine cannot compute,
refused by name instead of silently computing another model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

import tinker_sr  # noqa: E402
from tests._train import cross_entropy_steps  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.engine.hf_config import config_from_hf, config_to_hf  # noqa: E402
from tinker_sr.engine.model import BUILTIN_CONFIGS, build_model, save_pretrained  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.user_errors import EngineUserError  # noqa: E402

IDS = [1, 5, 100, 200, 300, 400, 450, 33, 7]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("arch")
    families = ("qwen2", "mistral", "qwen3_moe")
    out = {f: make_tiny_hf_model_dir(root / f, family=f) for f in families}  # type: ignore[arg-type]
    # Llama with attention_bias=true: biases on q, k, v *and* o (one the engine once dropped).
    llama = root / "llama-bias"
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.05)
    model.save_pretrained(llama)
    out["llama-bias"] = llama
    # Linear RoPE scaling (Llama 2 long-context finetunes), no biases.
    linear = root / "llama-linear"
    config.attention_bias = False
    config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        AutoModelForCausalLM.from_config(config).save_pretrained(linear)
    out["llama-linear"] = linear
    # YaRN whose original context is also at the top level (Phi-3's place), where it wins.
    yarn = root / "llama-yarn-top"
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        AutoModelForCausalLM.from_config(config).save_pretrained(yarn)
    hf = json.loads((yarn / "config.json").read_text())
    hf["original_max_position_embeddings"] = 64
    (yarn / "config.json").write_text(json.dumps(hf))
    out["llama-yarn-top"] = yarn
    # hidden_size not a multiple of the heads: Qwen2's head_dim is the floor, 66 // 4 = 16.
    floor = root / "qwen2-floor-head"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        AutoModelForCausalLM.from_config(
            Qwen2Config(
                vocab_size=512,
                hidden_size=66,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                architectures=["Qwen2ForCausalLM"],
            )  # fmt: skip
        ).save_pretrained(floor)
    out["qwen2-floor-head"] = floor
    return out


def _hf_logits(root: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(root)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float()


@pytest.mark.parametrize(
    "family",
    [
        "qwen2",
        "mistral",
        "llama-bias",
        "llama-linear",
        "llama-yarn-top",
        "qwen3_moe",
        "qwen2-floor-head",
    ],
)
def test_logits_match_transformers(dirs: dict[str, Path], family: str) -> None:
    ours = load_model_dir(dirs[family])
    with torch.no_grad():
        mine = ours(torch.tensor([IDS]))
    torch.testing.assert_close(mine, _hf_logits(dirs[family], IDS), rtol=0, atol=1e-5)
    if family in ("qwen2", "llama-bias", "qwen2-floor-head"):
        assert all(
            getattr(ours.model.layers[0].self_attn, f"{p}_proj").bias is not None
            for p in ("q", "k", "v")
        )
    o_bias = ours.model.layers[0].self_attn.o_proj.bias
    assert (o_bias is not None) == (family == "llama-bias")


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama-bias", "qwen3_moe"])
def test_sample_and_train_through_the_api(
    tmp_path: Path, dirs: dict[str, Path], family: str
) -> None:
    """Sampled tokens' logprobs equal transformers' on the same sequence (KV-cached decode with
    the biases), and a LoRA on every projection learns."""
    root = dirs[family]
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    training = client.create_lora_training_client(base_model=str(root), rank=4, seed=1).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = IDS[:5]
    params = types.SamplingParams(max_tokens=10, stop=[], seed=4)
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    for s in seqs:
        full = prompt + list(s.tokens)
        ref = torch.log_softmax(_hf_logits(root, full)[0], dim=-1)
        expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(s.tokens)]
        assert s.logprobs is not None
        assert max(abs(a - b) for a, b in zip(s.logprobs, expected, strict=True)) < 1e-4

    losses = cross_entropy_steps(training, types, IDS, steps=4, lr=2e-2)
    assert losses[-1] < 0.9 * losses[0]
    client.close().result()
    backend.close()


def test_sliding_window_caps_the_context(tmp_path: Path, dirs: dict[str, Path]) -> None:
    """Mistral's 4,096-token window: within it the model is exact (above), beyond it a request
    fails with the context error instead of attending past the window."""
    assert load_model_dir(dirs["mistral"]).config.max_seq_len == 4096
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    sampler = client.create_sampling_client(base_model=str(dirs["mistral"])).result()
    prompt = types.ModelInput.from_ints([5] * 4090)
    with pytest.raises(
        tinker_sr.BadRequestError, match="4090 prompt tokens \\+ 10 max_tokens > 4096"
    ):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10)).result()
    client.close().result()
    backend.close()


_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}


def _qwen3(**over: Any) -> dict[str, Any]:
    hf: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "max_position_embeddings": 40960,
    }  # fmt: skip
    return {**hf, **over}


def test_qwen_sliding_window_applies_only_when_switched_on_for_some_layer() -> None:
    window = {"use_sliding_window": True, "sliding_window": 1024}
    assert config_from_hf(_qwen3(), "m").max_seq_len == 40960
    assert config_from_hf(_qwen3(sliding_window=1024), "m").max_seq_len == 40960  # off
    assert config_from_hf(_qwen3(**window, max_window_layers=2), "m").max_seq_len == 1024
    assert config_from_hf(_qwen3(**window, max_window_layers=4), "m").max_seq_len == 40960
    full = ["full_attention"] * 4
    assert config_from_hf(_qwen3(**window, layer_types=full), "m").max_seq_len == 40960
    mixed = ["full_attention", "sliding_attention"] * 2
    assert config_from_hf(_qwen3(**window, layer_types=mixed), "m").max_seq_len == 1024
    mistral = _qwen3(architectures=["MistralForCausalLM"])
    assert config_from_hf(mistral, "m").max_seq_len == 4096  # transformers' default window
    assert config_from_hf({**mistral, "sliding_window": None}, "m").max_seq_len == 40960


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config \\(fp8\\)"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"architectures": ["LlamaForCausalLM"], "mlp_bias": True}, "mlp_bias"),
        ({"architectures": ["Gemma2ForCausalLM"]}, "architecture 'Gemma2ForCausalLM'"),
        ({"architectures": [{}]}, "architectures=\\[{}\\] must be a list of class names"),
        ({"model_type": "mistral"}, "model_type 'mistral' .* contradicts architectures"),
        ({"model_type": []}, "model_type \\[\\] is not supported"),
        # transformers' AutoConfig refuses it too; read as Llama before, whatever it was.
        ({"model_type": None, "architectures": None}, "neither model_type nor architectures"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}}, "\\['full_attention'\\]"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope'"),
        # found by the gpt-oss config fuzzer: was a TypeError (an unhashable rope type)
        ({"rope_scaling": {"rope_type": []}}, "rope type \\[\\] is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "x": 1}}, "\\['x'\\]"),
        ({"head_dim": 15}, "head_dim 15 must be even"),
        (_MOE | {"num_experts": 4, "num_local_experts": 8}, "num_experts and num_local_experts"),
        (_MOE | {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
        (_MOE | {"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be a positive integer"),
        (_MOE | {"mlp_only_layers": "0"}, "mlp_only_layers='0' must be a list"),
        (_MOE | {"norm_topk_prob": 1}, "norm_topk_prob=1 must be true or false"),
        (_MOE | {"moe_intermediate_size": -1}, "moe_intermediate_size=-1"),
        (_MOE | {"num_local_experts": 2**20, "num_experts": None}, "above the 1024 experts"),
        # Built on the meta device before any weight is read: ~1 ms and 55 KB per layer.
        ({"num_hidden_layers": 20000}, "num_hidden_layers=20000 is above the 1024 decoder"),
        (_MOE | {"num_hidden_layers": 512, "num_experts": 512}, "512 MoE layers of 512 experts"),
    ],
)
def test_fields_the_engine_cannot_compute_are_refused(over: dict[str, Any], field: str) -> None:
    with pytest.raises(EngineUserError, match=field):
        config_from_hf(_qwen3(**over), "m")


def test_a_tensor_without_a_place_is_refused(tmp_path: Path, dirs: dict[str, Path]) -> None:
    """A Llama checkpoint with attention biases whose config.json lost attention_bias: before,
    the biases were skipped and the model loaded as another one."""
    src = dirs["llama-bias"]
    root = _copy_dir(src, tmp_path / "lost-bias", attention_bias=False)
    with pytest.raises(EngineUserError, match=r"8 tensors .* no place for.*bias"):
        load_model_dir(root)
    # Old exports' rotary buffers carry nothing and still load.
    old = _copy_dir(src, tmp_path / "old-export")
    tensors = load_file(old / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, old / "model.safetensors")
    assert load_model_dir(old).config.attention_out_bias


def test_save_pretrained_names_the_architecture_transformers_computes(tmp_path: Path) -> None:
    """q/k/v-only biases are written as Qwen2 (a Llama config would add an o_proj bias);
    mixture-of-experts layers as Qwen3-MoE."""
    import dataclasses

    config = dataclasses.replace(BUILTIN_CONFIGS["tinker-sr/tiny"], attention_bias=True)
    model = build_model(config, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    save_pretrained(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"
    ]
    ids = [i % config.vocab_size for i in IDS]
    with torch.no_grad():
        mine = model(torch.tensor([ids]))
    torch.testing.assert_close(mine, _hf_logits(tmp_path / "m", ids), rtol=0, atol=1e-5)
    qk = dataclasses.replace(config, qk_norm=True)
    with pytest.raises(EngineUserError, match="no Hugging Face architecture"):
        config_to_hf(qk)
    # Mixture-of-experts layers (here the second of two) are written as Qwen3-MoE.
    moe = dataclasses.replace(
        BUILTIN_CONFIGS["tinker-sr/tiny"], n_experts=4, experts_per_token=2, moe_ffn_dim=32,
        moe_layers=(1,), qk_norm=True,
    )  # fmt: skip
    save_pretrained(build_model(moe, seed=2), tmp_path / "moe")
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["architectures"] == [
        "Qwen3MoeForCausalLM"
    ]
    with torch.no_grad():
        mine = load_model_dir(tmp_path / "moe")(torch.tensor([ids]))
    torch.testing.assert_close(mine, _hf_logits(tmp_path / "moe", ids), rtol=0, atol=1e-5)
    with pytest.raises(EngineUserError, match="mixture-of-experts layers need q/k norms"):
        config_to_hf(dataclasses.replace(moe, qk_norm=False))


def _copy_dir(src: Path, dst: Path, **config_over: Any) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_over}))
    return dst


def test_broken_directories_fail_with_the_file_or_field(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    src = dirs["qwen2"]
    cut = _copy_dir(src, tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineUserError, match="model.safetensors: not a readable safetensors"):
        load_model_dir(cut)
    # A typo'd size fails on the headers' shapes, before allocating 1e6 x 1e6 floats.
    huge = _copy_dir(src, tmp_path / "huge", intermediate_size=1_000_000, hidden_size=1_000_000)
    with pytest.raises(EngineUserError, match=r"has shape .* config.json implies"):
        load_model_dir(huge)
    with pytest.raises(EngineUserError, match="tie_word_embeddings='false' must be true or false"):
        load_model_dir(_copy_dir(src, tmp_path / "s", tie_word_embeddings="false"))
    with pytest.raises(EngineUserError, match="lacks 'num_hidden_layers'"):
        load_model_dir(_copy_dir(src, tmp_path / "n", num_hidden_layers=None))


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("tokenizer.json", lambda old: {}, r"tokenizer.json: cannot be read as a tokenizer"),
        (
            "tokenizer.json",
            lambda old: {**old, "added_tokens": [{"content": "x"}]},
            r"added tokens .* malformed",
        ),
        ("generation_config.json", lambda old: {"eos_token_id": "abc"}, r"generation_config.json"),
        ("generation_config.json", lambda old: {"eos_token_id": [10**9]}, r"outside the model's"),
    ],
)
def test_broken_tokenizer_files_fail_with_the_file(
    tmp_path: Path, dirs: dict[str, Path], file: str, edit: Any, message: str
) -> None:
    """Sampling with a string stop reads the EOS ids and the token bytes from these files."""
    root = _copy_dir(dirs["qwen2"], tmp_path / "m")
    (root / file).write_text(json.dumps(edit(json.loads((root / file).read_text()))))
    backend = LocalBackend(tmp_path / "store")
    client = tinker_sr.ServiceClient(backend=backend)
    try:
        with pytest.raises(tinker_sr.RequestFailedError, match=message):
            sampler = client.create_sampling_client(base_model=str(root)).result()
            params = types.SamplingParams(max_tokens=4, stop=["\n"])
            sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result()
    finally:
        client.close().result()
        backend.close()


def test_capabilities_list_the_served_directories_with_their_context(
    tmp_path: Path, dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`get_server_capabilities` names every model a request may use, aliased directories
    included, with each one's context (Mistral's capped at its window); a directory whose
    config would be refused is left out, not listed as servable."""
    broken = _copy_dir(dirs["qwen2"], tmp_path / "broken", hidden_act="gelu")
    aliases = f"my-qwen2={dirs['qwen2']},my-mistral={dirs['mistral']},broken={broken}"
    monkeypatch.setenv("TINKER_SR_MODEL_ALIASES", aliases)
    monkeypatch.setenv("TINKER_SR_STORE", str(tmp_path / "store"))
    caps = tinker_sr.RestClient().get_server_capabilities().result()
    contexts = {m.model_name: m.max_context_length for m in caps.supported_models}
    assert contexts["my-qwen2"] == 32768 and contexts["my-mistral"] == 4096
    assert "broken" not in contexts
    assert {n: c.max_seq_len for n, c in BUILTIN_CONFIGS.items()}.items() <= contexts.items()


def test_a_large_checkpoint_shows_its_loading(
    dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """From PROGRESS_MIN_BYTES on (512 MiB; 0 here): a byte progress bar on a terminal and a
    log line with the size and time."""
    import io
    import logging

    import tinker_sr.engine.hf as hf

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(hf, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr("sys.stderr", term)
    with caplog.at_level(logging.INFO, logger="tinker_sr.engine"):
        load_model_dir(dirs["qwen2"])
    assert "loading qwen2" in term.getvalue() and "100%" in term.getvalue()
    assert any("loaded" in r.getMessage() and "tensors" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(hf, "PROGRESS_MIN_BYTES", 2**40)  # small checkpoints: silent
    term.seek(0), term.truncate()
    load_model_dir(dirs["qwen2"])
    assert term.getvalue() == ""


_LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
_SIZES = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4}  # fmt: skip
_WIDE = {"hidden_size": 1024, "num_attention_heads": 32}  # room for Qwen's 32 KV-head default
# Fields of real checkpoints' config.json (sizes shrunk), then the corner cases of how
# transformers reads them: absent fields, rope_theta in two places, rope_scaling beside
# rope_parameters, a llama3 scaling without its original context.
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B-Instruct": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "max_window_layers": 2,
        "rope_theta": 1e6, "sliding_window": 32768, "use_sliding_window": False,
        "tie_word_embeddings": True, "rope_scaling": None, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "torch_dtype": "bfloat16"},
    "DeepSeek-R1-Distill-Qwen-1.5B": {"model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 2,
        "max_position_embeddings": 131072, "max_window_layers": 2, "rope_theta": 1e4,
        "sliding_window": 4096, "use_sliding_window": False, "tie_word_embeddings": False},
    "Llama-3.2-1B-Instruct": {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 131072,
        "rope_theta": 5e5, "rope_scaling": _LLAMA3, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
        "eos_token_id": [128001, 128008, 128009]},
    "Mistral-7B-v0.1": {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1e4,
        "sliding_window": 4096},
    "Mistral-7B-Instruct-v0.3": {"model_type": "mistral",
        "architectures": ["MistralForCausalLM"], "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1e6, "sliding_window": None},
    "TinyLlama-1.1B": {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_key_value_heads": 2, "max_position_embeddings": 2048, "pad_token_id": -1 + 0,
        "rope_scaling": None},
    "Qwen3-0.6B": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 40960,
        "rope_theta": 1e6, "sliding_window": None, "use_sliding_window": False,
        "max_window_layers": 4, "tie_word_embeddings": True, "attention_bias": False},
    "theta in both places": {"model_type": "llama", "rope_theta": 1e4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    "theta null beside parameters": {"model_type": "qwen3", "rope_theta": None, **_WIDE,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "scaling beside parameters": {"model_type": "llama", "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": _LLAMA3},
    "llama3 without original context": {"model_type": "llama", "max_position_embeddings": 8192,
        "rope_scaling": {k: v for k, v in _LLAMA3.items()
                         if k != "original_max_position_embeddings"}},
    "qwen3 defaults": {"model_type": "qwen3", **_WIDE},
    "mistral defaults": {"model_type": "mistral", "num_attention_heads": 8},
    "qwen2 window on": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 256,
        "max_window_layers": 2, **_WIDE},
    "swish": {"model_type": "llama", "hidden_act": "swish"},
    "Qwen3-30B-A3B": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 40960,
        "rope_theta": 1e6, "sliding_window": None, "use_sliding_window": False,
        "max_window_layers": 4, "tie_word_embeddings": False, "attention_bias": False,
        "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "output_router_logits": False, "router_aux_loss_coef": 0.001},
    "qwen3_moe as transformers 5 writes it": {"model_type": "qwen3_moe", "head_dim": 16,
        "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 2, "mlp_only_layers": [3]},
    "qwen3_moe defaults": {"model_type": "qwen3_moe", "num_key_value_heads": 2},
    "qwen3_moe window on": {"model_type": "qwen3_moe", "num_key_value_heads": 2,
        "use_sliding_window": True, "sliding_window": 256, "max_window_layers": 28},
    # head_dim by floor division (transformers' Llama refuses it; Mistral, Qwen2 do not). It
    # was refused with "set explicit_head_dim", a name config.json does not have.
    "hidden not a multiple of heads": {"model_type": "mistral", "hidden_size": 66,
        "num_key_value_heads": 2},
    "linear scaling": {"model_type": "llama", "rope_theta": 1e4,
        "rope_scaling": {"type": "linear", "factor": 4.0}},
    # Qwen3's model cards enable YaRN this way for 131k tokens.
    "Qwen3 with YaRN": {"model_type": "qwen3", **_WIDE, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32768}},
    # Phi-3's place for the original context: top-level, over the rope dict's (it was ignored).
    "yarn, original context top-level": {"model_type": "llama", "max_position_embeddings": 1024,
        "original_max_position_embeddings": 64, "rope_scaling": {"rope_type": "yarn",
        "factor": 4.0, "original_max_position_embeddings": 256}},
    "yarn, original context top-level only": {"model_type": "qwen3", **_WIDE,
        "max_position_embeddings": 1024, "original_max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "llama3, original context top-level": {"model_type": "llama", "rope_scaling": _LLAMA3,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 2048},
    # transformers 5 writes a partial_rotary_factor of 1 into rope_parameters (was refused).
    "partial rotary 1 in parameters": {"model_type": "llama", "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}},
    # Qwen3-VL's text configs have defaults of their own (Qwen3's were taken).
    "qwen3_vl_text defaults": {"model_type": "qwen3_vl_text", **_WIDE},
    "qwen3_vl_moe_text defaults": {"model_type": "qwen3_vl_moe_text", "hidden_size": 256,
        "num_attention_heads": 16},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REAL_CONFIGS))
def test_configs_read_as_transformers_reads_them(case: str) -> None:
    """Differential: the engine's reading of a config.json against transformers' own config
    class on the same dict (head width, KV heads, RoPE theta and scaling, context, window,
    tying, biases)."""
    from transformers import CONFIG_MAPPING

    hf = {**_SIZES, **REAL_CONFIGS[case]}
    ours = config_from_hf(hf, case)
    theirs = CONFIG_MAPPING[hf["model_type"]].from_dict(dict(hf))
    # Again, as the model's rotary embedding does: then a top-level original context (Phi-3's
    # place for it) replaces the rope dict's.
    theirs.standardize_rope_params()
    rope = theirs.rope_parameters
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours.head_dim == head_dim
    assert ours.n_kv_heads == theirs.num_key_value_heads
    assert ours.rope_theta == rope["rope_theta"]
    scaling = dict(ours.rope_scaling or ())
    assert scaling.get("rope_type", "default") == rope["rope_type"]
    for key in ("factor", "original_max_position_embeddings"):
        assert scaling.get(key) == rope.get(key)
    window = getattr(theirs, "sliding_window", None)
    if "sliding_attention" not in (getattr(theirs, "layer_types", None) or ["sliding_attention"]):
        window = None
    expected = theirs.max_position_embeddings
    assert ours.max_seq_len == (expected if window is None else min(expected, window))
    if "vl" not in hf["model_type"]:  # Qwen3-VL's wrapper config decides (`text_config`)
        assert ours.tie_embeddings == theirs.tie_word_embeddings
    assert ours.attention_bias == (hf["model_type"] == "qwen2" or bool(hf.get("attention_bias")))
    if "moe" in hf["model_type"]:  # which layers are sparse, as transformers decides
        sparse = tuple(
            i for i in range(theirs.num_hidden_layers)
            if i not in theirs.mlp_only_layers and (i + 1) % theirs.decoder_sparse_step == 0
        )  # fmt: skip
        assert ours.moe_layers == sparse and ours.n_experts == theirs.num_experts
        assert ours.experts_per_token == theirs.num_experts_per_tok
        assert ours.moe_ffn_dim == theirs.moe_intermediate_size
        # Qwen3-VL-MoE's router always renormalises (its config has no flag).
        assert ours.norm_topk_prob == getattr(theirs, "norm_topk_prob", True)


def test_a_tied_head_stored_anyway_loads_as_transformers_loads_it(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    """Qwen2 ties its head. A checkpoint that also stores lm_head.weight: equal to the
    embedding, it stays tied; different, both load untied (transformers 5 does the same, with
    a warning) and the logits match transformers'."""
    root = _copy_dir(dirs["qwen2"], tmp_path / "m")
    tensors = load_file(root / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, root / "model.safetensors")
    assert load_model_dir(root).config.tie_embeddings
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, root / "model.safetensors")
    ours = load_model_dir(root)
    assert not ours.config.tie_embeddings
    assert torch.equal(ours.lm_head.weight, tensors["lm_head.weight"])
    with torch.no_grad():
        mine = ours(torch.tensor([IDS]))
    torch.testing.assert_close(mine, _hf_logits(root, IDS), rtol=0, atol=1e-5)
