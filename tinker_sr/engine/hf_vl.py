"""Vision-language wrappers whose text model the engine runs: Qwen3.5 (dense, MoE) as the Hub
ships it, and Qwen3-VL (dense, MoE). Their config.json nests the text model's config under
``text_config``, and their checkpoints its weights under ``model.language_model.``; the vision
tower's (and multi-token-prediction) weights are not used.
"""

from __future__ import annotations

from typing import Any

from tinker_sr.user_errors import EngineUserError

# model_type -> (the wrapper's architecture, the text model's architecture and model_type).
VL_WRAPPERS = {
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen3_5_moe": (
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
    ),
    # Qwen3-VL: a Qwen3 (dense or MoE) text model whose multimodal RoPE is plain RoPE on text.
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3ForCausalLM", "qwen3_vl_text"),
    "qwen3_vl_moe": (
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3MoeForCausalLM",
        "qwen3_vl_moe_text",
    ),
}
QWEN3_VL = ("qwen3_vl", "qwen3_vl_moe")
QWEN3_VL_TEXT = ("qwen3_vl_text", "qwen3_vl_moe_text")
# Qwen3-VL's text configs' defaults where they differ from Qwen3's and Qwen3-MoE's (those of
# transformers 5's Qwen3VLTextConfig and Qwen3VLMoeTextConfig; the expert count is `_moe`'s).
_VL_TEXT: dict[str, Any] = {"rope_theta": 500000.0, "max_position_embeddings": 128000}
VL_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_vl_text": _VL_TEXT,
    "qwen3_vl_moe_text": {
        **_VL_TEXT,
        "num_key_value_heads": 16,
        "intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
    },
}


def vl_wrapper(hf: dict[str, Any]) -> str | None:
    """The `VL_WRAPPERS` kind a config.json names (by model_type, else architectures[0]):
    a vision-language checkpoint whose text model lives under ``model.language_model.``."""
    model_type = hf.get("model_type")
    if isinstance(model_type, str) and model_type in VL_WRAPPERS:
        return model_type
    first = _first_architecture(hf)
    return next((kind for kind, (wrapper, _, _) in VL_WRAPPERS.items() if wrapper == first), None)


def _first_architecture(hf: dict[str, Any]) -> str | None:
    archs = hf.get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def text_config(hf: dict[str, Any], name: str) -> dict[str, Any]:
    """A vision-language wrapper's (Qwen3.5's, Qwen3-VL's) text model config, as transformers
    builds the text model from the wrapper; other configs as they are."""
    kind = vl_wrapper(hf)
    if kind is None:
        return _with_defaults(hf)
    model_type, archs = hf.get("model_type"), hf.get("architectures") or []
    if model_type is not None and model_type != kind:  # found by architectures[0]
        raise EngineUserError(
            f"{name}: config.json model_type {model_type!r} contradicts architectures "
            f"{archs!r}; make them agree"
        )
    first = _first_architecture(hf)
    wrapper, arch, text_type = VL_WRAPPERS[kind]
    if first is not None and first != wrapper:
        raise EngineUserError(
            f"{name}: config.json model_type {kind!r} (built as {wrapper}) contradicts "
            f"architectures {archs!r}; make them agree"
        )
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise EngineUserError(
            f"{name}: config.json model_type {kind!r} needs a text_config object "
            f"(the text model's config), got {text!r}"
        )
    out = dict(text)
    if "quantization_config" in hf:  # the wrapper's: it quantizes the text model too
        out.setdefault("quantization_config", hf["quantization_config"])
    out.setdefault("model_type", text_type)
    out["architectures"] = [arch]
    # Qwen3-VL's wrapper decides (transformers ties by the top-level flag; the text config's
    # own may disagree); Qwen3.5's text config, where it says.
    if "tie_word_embeddings" in hf and ("tie_word_embeddings" not in text or kind in QWEN3_VL):
        out["tie_word_embeddings"] = hf["tie_word_embeddings"]
    for key in ("dtype", "torch_dtype"):
        if key in hf and key not in out:
            out[key] = hf[key]
    return _with_defaults(out)


def _with_defaults(text: dict[str, Any]) -> dict[str, Any]:
    """``text`` with its model type's `VL_TEXT_DEFAULTS` for the fields it leaves out."""
    model_type = text.get("model_type")
    defaults = VL_TEXT_DEFAULTS.get(model_type) if isinstance(model_type, str) else None
    return {**defaults, **text} if defaults else text
