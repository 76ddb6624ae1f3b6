"""The offline chat model: what every base model name means inside `mock_tinker` and
`tinker_server`.

A tiny random Qwen3-shaped model in Hugging Face layout (config.json, generation_config.json,
model.safetensors) with a byte-level tokenizer that also knows the chat special tokens of the
main families, so cookbook renderers for Qwen (``<|im_start|>`` / ``<|im_end|>``,
``<think>``) and Llama 3 (``<|begin_of_text|>``, header tokens, ``<|eot_id|>``) encode
prompts offline:

- ids 0..255 are the UTF-8 bytes (no merges), so any text round-trips;
- 256 ``<|begin_of_text|>`` (BOS), 257 ``<|im_end|>`` (EOS), 258 ``<|endoftext|>`` (pad),
  the same roles the built-in byte tokenizer gives those ids;
- 259.. the other chat tokens (`CHAT_TOKENS`), each one id.

Encoding adds no BOS (Qwen style); Llama renderers add ``<|begin_of_text|>`` themselves.
Built with torch and the JSON below only (no `transformers` or `tokenizers` needed to write
it); the same inputs give byte-identical files.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tinker_sr.tokenization.byte import _bytes_to_unicode

BOS, EOS, PAD = "<|begin_of_text|>", "<|im_end|>", "<|endoftext|>"
# (token, special): Qwen3 keeps <think>/<tool_call> as ordinary added tokens, so decoding
# with skip_special_tokens=True keeps them, as with the real tokenizer.
CHAT_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS, True),
    (EOS, True),
    (PAD, True),
    ("<|im_start|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|end_of_text|>", True),
    ("<|start_header_id|>", True),
    ("<|end_header_id|>", True),
    ("<|eot_id|>", True),
    ("<|eom_id|>", True),
    ("<|python_tag|>", True),
    ("<|finetune_right_pad_id|>", True),
)
TOKEN_IDS: dict[str, int] = {tok: 256 + i for i, (tok, _) in enumerate(CHAT_TOKENS)}
VOCAB_SIZE = 256 + len(CHAT_TOKENS)
# Sampling stops on any of these (the end-of-turn tokens of both families).
EOS_IDS = [TOKEN_IDS[t] for t in (EOS, "<|eot_id|>", PAD, "<|end_of_text|>")]
MODEL_DIR_NAME = "tinker-sr-offline-chat"
FORMAT_VERSION = "1"  # bump when the files change, so stale copies are rebuilt

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_build_lock = threading.Lock()


def _tokenizer_json() -> dict[str, Any]:
    chars = _bytes_to_unicode()
    added = [
        {"id": TOKEN_IDS[tok], "content": tok, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": special}
        for tok, special in CHAT_TOKENS
    ]  # fmt: skip
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {chars[b]: b for b in range(256)}, "merges": []},
    }  # fmt: skip


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(TOKEN_IDS[tok]): {"content": tok, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": special}
            for tok, special in CHAT_TOKENS
        },
    }  # fmt: skip


def write_offline_tokenizer(path: str | os.PathLike[str]) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json(), ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2))
    smap = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2))
    return out


def _write_model(out: Path) -> None:
    from tinker_sr.engine.model import ModelConfig, build_model, save_pretrained

    config = ModelConfig(
        name=MODEL_DIR_NAME,
        vocab_size=VOCAB_SIZE,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=256,
        max_seq_len=4096,  # room for cookbook chat prompts
        rope_theta=1_000_000.0,
        tie_embeddings=True,
        qk_norm=True,
        bos_token_id=TOKEN_IDS[BOS],
        eos_token_id=TOKEN_IDS[EOS],
        pad_token_id=TOKEN_IDS[PAD],
    )
    save_pretrained(build_model(config, seed=0), out)
    gen = {"bos_token_id": TOKEN_IDS[BOS], "eos_token_id": EOS_IDS, "pad_token_id": TOKEN_IDS[PAD]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def offline_model_dir(root: str | os.PathLike[str]) -> Path:
    """The offline chat model directory under ``root`` (written on first use; thread-safe)."""
    out = Path(root) / MODEL_DIR_NAME
    stamp = out / ".tinker-sr-offline-model"
    with _build_lock:
        if stamp.exists() and stamp.read_text() == FORMAT_VERSION:
            return out
        out.mkdir(parents=True, exist_ok=True)
        _write_model(out)
        write_offline_tokenizer(out)
        stamp.write_text(FORMAT_VERSION)
    return out


@contextmanager
def hub_names_resolve_to(
    model_dir: str | os.PathLike[str], aliases: Mapping[str, str] | None = None
) -> Iterator[None]:
    """While active, ``transformers.AutoTokenizer.from_pretrained(name)`` loads the tokenizer in
    ``model_dir`` for any ``name`` that is not a local directory (or the directory ``aliases``
    maps ``name`` to, when it maps it to one).

    The official SDK's ``SamplingClient.get_tokenizer()`` (and the cookbook's
    ``get_tokenizer(model_name)``) load hub ids such as ``"Qwen/Qwen3-8B"``; inside the mock
    every such name *is* the offline model, so its tokenizer is the right one, and nothing is
    downloaded. A no-op when `transformers` is not installed."""
    try:
        from transformers.models.auto.tokenization_auto import AutoTokenizer
    except ImportError:
        yield
        return
    original = AutoTokenizer.__dict__["from_pretrained"]
    load = original.__get__(None, AutoTokenizer)

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(name, str | os.PathLike) and not os.path.isdir(name):
            for hub_only in ("revision", "trust_remote_code", "token", "subfolder"):
                kwargs.pop(hub_only, None)
            target = (aliases or {}).get(str(name), "")
            name = target if os.path.isdir(target) else str(model_dir)
        return load(name, *args, **kwargs)

    AutoTokenizer.from_pretrained = classmethod(from_pretrained)  # type: ignore[assignment,method-assign]
    clear_tokenizer_caches()  # what another test (or its mock) loaded under these names
    try:
        yield
    finally:
        AutoTokenizer.from_pretrained = original  # type: ignore[method-assign]
        clear_tokenizer_caches()  # this mock's tokenizers, for the next test


# Tokenizers cached by model name, which outlive a mock: the official SDK's (get_tokenizer),
# tinker-cookbook's (get_tokenizer) and tinker_sr's clients'.
_TOKENIZER_CACHES = (
    ("tinker.lib.public_interfaces.sampling_client", "_load_tokenizer_from_model_info"),
    ("tinker_cookbook.tokenizer_utils", "_get_hf_tokenizer"),
    ("tinker_sr.clients.tokenizers", "load_tokenizer"),
)


def clear_tokenizer_caches() -> None:
    """Empty the tokenizer caches of the modules already imported (a test before loaded the
    offline model's under "Qwen/Qwen3-8B", or a mock's aliased directory's: found by a hunt,
    the next test then encoded with it)."""
    import sys

    for module, name in _TOKENIZER_CACHES:
        clear = getattr(getattr(sys.modules.get(module), name, None), "cache_clear", None)
        if callable(clear):
            clear()
