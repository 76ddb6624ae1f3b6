"""Fuzz a Hugging Face config.json: whatever a user's (or a broken download's) config holds, the
engine either builds the model it describes or refuses with `EngineUserError`; never a
`KeyError`, `TypeError`, `ZeroDivisionError` or an allocation the size of a typo."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ
from tinker_sr.engine.hf_config import ARCHITECTURES, MODEL_TYPES, config_from_hf
from tinker_sr.engine.model import Transformer, rope_inv_freq
from tinker_sr.user_errors import EngineUserError

BASE: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "sliding_window": 1024,
    "use_sliding_window": False,
    "max_window_layers": 1,
}
KEYS = [
    *BASE,
    "attention_bias",
    "rope_scaling",
    "rope_parameters",
    "hidden_act",
    "mlp_bias",
    "quantization_config",
    "layer_types",
    "model_type",
    "partial_rotary_factor",
]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

EDGES: list[Any] = [None, True, False, 0, -1, 1, 3, 2**62, 10**30, 0.5, 1e-300, math.inf,
                    -math.inf, math.nan, "", "2", "silu", [], [1], {}, {"rope_type": "yarn"},
                    {"rope_theta": "x"}, {"rope_theta": 0}, [{}], "qwen3", "mistral",
                    ["MistralForCausalLM"], {"rope_type": "default", "mrope": 1}]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 100),
    st.sampled_from(EDGES),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.sampled_from(["silu", "gelu", "llama3", "yarn", "sliding_attention"]),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.sampled_from([LLAMA3, {**LLAMA3, "factor": "x"}, {"rope_type": "dynamic"}, {}]),
    st.sampled_from([["LlamaForCausalLM"], ["MistralForCausalLM"], ["Qwen3ForCausalLM"], []]),
    st.dictionaries(
        st.sampled_from(["rope_type", "type", "factor", "rope_theta", "quant_method"]), scalars
    ),
)


def _check(hf: dict[str, Any]) -> None:
    try:
        config = config_from_hf(hf, "fuzz")
        inv_freq = rope_inv_freq(config)
    except EngineUserError as e:
        assert "fuzz" in str(e)
        return
    if hf.get("model_type") is not None:  # what transformers' AutoModel builds
        arch = MODEL_TYPES[hf["model_type"]]
        assert (hf.get("architectures") or [arch])[0] == arch  # a contradiction is refused
    else:
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    assert config.qk_norm == ARCHITECTURES[arch].qk_norm
    for n in (config.vocab_size, config.dim, config.n_layers, config.n_heads, config.n_kv_heads):
        assert isinstance(n, int) and not isinstance(n, bool) and n > 0
    assert config.max_seq_len > 0 and 0 < config.norm_eps < math.inf
    assert 0 < config.rope_theta < math.inf
    assert bool(torch.isfinite(inv_freq).all())
    for i in (config.bos_token_id, config.eos_token_id, config.pad_token_id):
        assert i is None or (isinstance(i, int) and i >= 0)
    flags = ["tie_word_embeddings", "attention_bias", "use_sliding_window"]
    for flag in flags + (["mlp_bias"] if ARCHITECTURES[arch].mlp_bias else []):
        assert hf.get(flag) is None or type(hf.get(flag)) is bool  # "false", 0 are not flags
    assert config.tie_embeddings == bool(hf.get("tie_word_embeddings"))
    with torch.device("meta"):  # shapes only: a typo'd size must not allocate here
        Transformer(config)


def test_every_field_at_every_edge_value() -> None:
    """Exhaustive over one field at a time: each key set to each edge value, or dropped."""
    for key in [*KEYS, "model_type", "bos_token_id", "eos_token_id", "pad_token_id"]:
        for value in EDGES:
            _check({**BASE, key: value})
        _check({k: v for k, v in BASE.items() if k != key})


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=4), st.sets(st.sampled_from(KEYS)))
def test_any_config_builds_or_is_refused_by_name(over: dict[str, Any], dropped: set[str]) -> None:
    """Several fields at once, from a wider range of values."""
    _check({k: v for k, v in {**BASE, **over}.items() if k not in dropped})


# Qwen3.5 as the Hub ships it: the text model's config inside a vision-language wrapper.
Q35_TEXT: dict[str, Any] = {
    **{k: BASE[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                            "num_attention_heads", "num_key_value_heads", "head_dim")},
    "num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}  # fmt: skip
Q35_KEYS = [*Q35_TEXT, "layer_types", "full_attention_interval", "attn_output_gate",
            "partial_rotary_factor", "model_type", "tie_word_embeddings"]  # fmt: skip
Q35_EDGES = [*EDGES, ["linear_attention"] * 4, ["full_attention", "linear_attention"],
             {"rope_theta": 1e7, "partial_rotary_factor": 0.0625}, "qwen3_5_text"]  # fmt: skip


def _check_qwen3_5(text: dict[str, Any], top: dict[str, Any]) -> None:
    hf = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": text, **top}  # fmt: skip
    try:
        config = config_from_hf(hf, "fuzz")
    except EngineUserError as e:
        assert "fuzz" in str(e)
        return
    assert len(config.layer_types) == config.n_layers
    assert set(config.layer_types) <= {"full_attention", "linear_attention"}
    rotary = config.rotary_dim
    assert rotary is not None and 2 <= rotary <= config.head_dim and rotary % 2 == 0
    assert config.linear_v_heads % config.linear_k_heads == 0 and config.linear_conv >= 1
    with torch.device("meta"):
        Transformer(config)


def test_qwen3_5_every_text_field_at_every_edge_value() -> None:
    for key in Q35_KEYS:
        for value in Q35_EDGES:
            _check_qwen3_5({**Q35_TEXT, key: value}, {})
        _check_qwen3_5({k: v for k, v in Q35_TEXT.items() if k != key}, {})
    for value in Q35_EDGES:
        _check_qwen3_5(Q35_TEXT, {"text_config": value})
        _check_qwen3_5(Q35_TEXT, {"model_type": value})


@FUZZ
@given(st.dictionaries(st.sampled_from(Q35_KEYS), st.one_of(values, st.sampled_from(Q35_EDGES)),
                       max_size=4))  # fmt: skip
def test_any_qwen3_5_config_builds_or_is_refused_by_name(over: dict[str, Any]) -> None:
    _check_qwen3_5({**Q35_TEXT, **over}, {})


Q35_MOE_TOP = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]}
Q35_MOE_KEYS = ["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "num_local_experts"]  # fmt: skip


def test_qwen3_5_moe_expert_fields_at_every_edge_value() -> None:
    moe = {**Q35_TEXT, "num_experts": 8, "num_experts_per_tok": 2}
    for key in Q35_MOE_KEYS:
        for value in Q35_EDGES:
            _check_qwen3_5({**moe, key: value}, Q35_MOE_TOP)
        _check_qwen3_5({k: v for k, v in moe.items() if k != key}, Q35_MOE_TOP)


VL_TEXT: dict[str, Any] = {
    **{k: BASE[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                            "num_attention_heads", "num_key_value_heads", "head_dim")},
    "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                        "mrope_interleaved": True},
}  # fmt: skip
VL_TOPS = [{"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"]},
           {"model_type": "qwen3_vl_moe",
            "architectures": ["Qwen3VLMoeForConditionalGeneration"]}]  # fmt: skip


def test_qwen3_vl_every_field_at_every_edge_value() -> None:
    """Qwen3-VL's text config (inside the vision-language wrapper) and the wrapper's own
    fields: the model builds, or is refused naming the checkpoint."""
    for top in VL_TOPS:
        text = VL_TEXT if "moe" in top["model_type"] else {
            k: v for k, v in VL_TEXT.items() if "expert" not in k}  # fmt: skip
        cases = [({**text, key: value}, {}) for key in [*text, "model_type", "mlp_only_layers",
                 "decoder_sparse_step", "norm_topk_prob"] for value in EDGES]  # fmt: skip
        cases += [(text, {key: value}) for key in ("tie_word_embeddings", "text_config",
                  "model_type", "architectures", "quantization_config") for value in EDGES]  # fmt: skip
        for body, over in cases:
            try:
                config = config_from_hf({**top, "text_config": body, **over}, "fuzz")
            except EngineUserError as e:
                assert "fuzz" in str(e)
                continue
            with torch.device("meta"):
                Transformer(config)


# gpt-oss as openai/gpt-oss-20b's config.json has it (sizes shrunk).
GPT_OSS: dict[str, Any] = {
    **{k: BASE[k] for k in ("vocab_size", "hidden_size", "num_attention_heads",
                            "num_key_value_heads", "head_dim")},
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 2,
    "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128,
    "attention_bias": True, "swiglu_limit": 7.0, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
}  # fmt: skip
GPT_OSS_KEYS = [*GPT_OSS, "swiglu_alpha", "experts_per_token", "rope_parameters"]
YARN_EDGES: list[Any] = [
    {"rope_type": "yarn", "factor": f, "beta_fast": b, "truncate": t, "mscale": m}
    for f, b, t, m in ((0.5, 32, True, None), (32, 0, False, 1.0), (32, -1, "no", 0.7),
                       (math.inf, 1e-9, None, math.nan), (None, 32, True, "x"))
]  # fmt: skip


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(GPT_OSS_KEYS),
        st.one_of(values, st.sampled_from(YARN_EDGES),
                  st.lists(st.sampled_from(["sliding_attention", "full_attention", 1]))),
        max_size=4,
    ),
    st.sets(st.sampled_from(GPT_OSS_KEYS)),
)  # fmt: skip
def test_any_gpt_oss_config_builds_or_is_refused_by_name(
    over: dict[str, Any], dropped: set[str]
) -> None:
    _check({k: v for k, v in {**GPT_OSS, **over}.items() if k not in dropped})


def test_gpt_oss_every_field_at_every_edge_value() -> None:
    for key in GPT_OSS_KEYS:
        for value in [*EDGES, *YARN_EDGES]:
            _check({**GPT_OSS, key: value})
        _check({k: v for k, v in GPT_OSS.items() if k != key})
