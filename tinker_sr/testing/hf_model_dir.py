"""Tiny random Hugging Face model directories for tests: a real `transformers` checkpoint with a
real (non-byte) BPE tokenizer, made offline in about a second.

`make_tiny_hf_model_dir(path)` writes what `AutoModelForCausalLM.from_pretrained(path)` and
`AutoTokenizer.from_pretrained(path)` load offline:

- config.json + safetensors weights (one file, or several with ``sharded=True``) of a randomly
  initialised Qwen3ForCausalLM, Qwen2ForCausalLM (q/k/v biases), LlamaForCausalLM or
  MistralForCausalLM (a 4,096-token sliding window), saved in the requested dtype; biases are
  drawn like the weights (transformers would zero them, hiding a bias that is not applied);
- tokenizer.json: a byte-level BPE trained by the `tokenizers` library on a small built-in
  English/number corpus, so ids are *not* bytes (``"hello"`` is not ``[104, 101, ...]``); the
  special tokens come after the trained vocabulary, so every special id (EOS included) is
  >= 259 and is not any byte id;
- tokenizer_config.json with a Qwen-style chat template (``<|im_start|>`` / ``<|im_end|>``);
- generation_config.json with several EOS ids.

Same arguments (``seed`` included) ⇒ byte-identical files. Needs `torch`, `transformers` >=
`MIN_TRANSFORMERS` (its config format, Qwen3.5's classes) and `tokenizers` (dev dependencies).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# "llama3": the Llama architecture with Llama 3's chat tokens (<|start_header_id|>,
# <|end_header_id|>, <|eot_id|>: the cookbook's llama3 renderer); "llama" uses Qwen's.
# "qwen3_5": Qwen3.5 as the Hub ships it (Qwen3_5ForConditionalGeneration: a tiny vision tower
# beside the hybrid text model, weights under model.language_model.).
# "qwen3_5_moe": likewise Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration: 2 of 8 routed experts
# and a shared expert in every layer).
# "gpt_oss": OpenAI's gpt-oss (GptOssForCausalLM: attention sinks, a 16-token window in every
# other layer, 2 of 8 experts with biases, YaRN) with the harmony chat tokens.
Family = Literal[
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen2",
    "llama",
    "llama3",
    "mistral",
    "gpt_oss",
]
DTypeName = Literal["float32", "bfloat16", "float16"]

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK, END_THINK = "<think>", "</think>"
LLAMA_BOS, LLAMA_EOS = "<|begin_of_text|>", "<|end_of_text|>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
# gpt-oss's harmony format (o200k_harmony's special tokens that tinker-cookbook's renderer uses).
HARMONY = ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
           "<|call|>")  # fmt: skip
RETURN, CALL = "<|return|>", "<|call|>"

# Qwen's template without tools/thinking: role header, content, <|im_end|>, newline.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's layout: BOS, then per message a role header, a blank line, content, <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# harmony as tinker-cookbook's "gpt_oss_no_sysprompt" renderer writes it, so that the template
# and the renderer give the same ids: no model-identity system preamble (the Hub's template
# always writes one, with today's date), a system message becomes the developer's
# "# Instructions", an assistant turn is one final-channel message ended by <|end|>, or by
# <|return|> when it is the conversation's last (training; no generation prompt); no
# analysis channel, tools or tool results.
HARMONY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] }}"
    "{{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}"
    "{%- elif message['role'] == 'system' %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + message['content']"
    " + '\\n\\n<|end|>' }}"
    "{%- else %}{{- '<|start|>' + message['role'] + '<|message|>' + message['content']"
    " + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

_WORDS = (
    "the a an and or of to in on for with is are was were be this that it he she they we you "
    "user assistant system question answer number sum total add plus minus times equals what "
    "how many apples oranges books cats dogs people day days year years hello world please "
    "think step first then next finally result so therefore because count each more less than"
).split()


@dataclass(frozen=True)
class TinyModelInfo:
    """Ids a test needs without loading the tokenizer."""

    path: Path
    vocab_size: int  # model rows (>= tokenizer length when padded)
    tokenizer_size: int
    eos_token_ids: tuple[int, ...]  # generation_config's, first = config.json's
    pad_token_id: int
    bos_token_id: int | None  # prepended by the tokenizer (llama family only)
    special_ids: dict[str, int]


def _corpus(seed: int) -> list[str]:
    """A few hundred deterministic lines of English words, numbers, arithmetic and chat text."""
    import random

    rng = random.Random(f"tinker_sr.hf_model_dir.corpus.{seed}")
    lines: list[str] = []
    for i in range(400):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"{words.capitalize()}. {a} + {b} = {a + b}.")
        if i % 4 == 0:
            lines.append(f"User: what is {a} plus {b}?\n\nAssistant: {a + b}\n\n")
    return lines


def _qwen(family: Family) -> bool:
    """Qwen's tokenizer layout (no BOS, <|endoftext|>)."""
    return family.startswith("qwen")


def _bos(family: Family) -> bool:
    """Llama's tokenizer layout (BOS prepended): not Qwen's, not gpt-oss's."""
    return not _qwen(family) and family != "gpt_oss"


def _specials(family: Family) -> list[str]:
    """The special tokens, in id order after the learned vocabulary."""
    if family.startswith("qwen3_5"):  # its renderer reads </think> as one token, as Qwen's
        return [ENDOFTEXT, IM_START, IM_END, THINK, END_THINK]
    if _qwen(family):
        return [ENDOFTEXT, IM_START, IM_END]
    if family == "llama3":
        return [LLAMA_BOS, LLAMA_EOS, START_HEADER, END_HEADER, EOT]
    if family == "gpt_oss":
        return [ENDOFTEXT, *HARMONY]
    return [LLAMA_BOS, LLAMA_EOS, IM_START, IM_END]


def _train_tokenizer(family: Family, seed: int, n_merges: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + n_merges,
        initial_alphabet=alphabet,
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    # Specials after training: their ids follow the learned vocabulary (all >= 259).
    tok.add_special_tokens(_specials(family))
    if _bos(family):  # Llama prepends <|begin_of_text|> when special tokens are on
        bos_id = tok.token_to_id(LLAMA_BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{LLAMA_BOS} $A",
            pair=f"{LLAMA_BOS} $A $B",
            special_tokens=[(LLAMA_BOS, bos_id)],
        )
    return tok


def _qwen_config(family: Family, common: dict[str, Any], qwen: dict[str, Any], layers: int) -> Any:
    """The Qwen families' configs (`common` sizes, `qwen` specials and RoPE)."""
    from transformers import (
        Qwen2Config,
        Qwen3_5Config,
        Qwen3_5MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if family.startswith("qwen3_5"):
        # Like Qwen3.5-4B (three gated-DeltaNet layers, then one full attention layer; a
        # quarter of each head rotated; tied embeddings) with a 1-layer vision tower.
        text = dict(common, **qwen, max_position_embeddings=262144)
        text |= dict(
            num_hidden_layers=max(layers, 4),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
        text["rope_parameters"] = dict(
            rope_type="default",
            rope_theta=10_000_000.0,
            partial_rotary_factor=0.25,
            mrope_section=[1, 1, 0],
            mrope_interleaved=True,
        )
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=common["hidden_size"])  # fmt: skip
        if family == "qwen3_5_moe":  # like Qwen3.5-35B-A3B (8 of 256 experts) at 2 of 8
            del text["intermediate_size"]
            text |= dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48)  # fmt: skip
            return Qwen3_5MoeConfig(
                text_config=text,
                vision_config=vision,
                tie_word_embeddings=True,
                architectures=["Qwen3_5MoeForConditionalGeneration"],
            )
        return Qwen3_5Config(
            text_config=text,
            vision_config=vision,
            tie_word_embeddings=True,
            architectures=["Qwen3_5ForConditionalGeneration"],
        )
    if family.startswith("qwen3_vl"):
        return _qwen3_vl_config(family, common, qwen)
    if family == "qwen3":
        # Like Qwen3-0.6B: a 40,960-token context, EOS = <|im_end|>.
        return Qwen3Config(
            **common, **qwen, max_position_embeddings=40960, architectures=["Qwen3ForCausalLM"]
        )
    if family == "qwen3_moe":
        # Like Qwen3-30B-A3B (8 of 128 experts, norm_topk_prob) at 2 of 8 experts; the first
        # layer dense (mlp_only_layers) so that both kinds of layer are there.
        return Qwen3MoeConfig(
            **common,
            **qwen,
            max_position_embeddings=40960,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            architectures=["Qwen3MoeForCausalLM"],
        )
    # Qwen2, like Qwen2.5-0.5B-Instruct: q/k/v biases, the window switched off.
    common.pop("head_dim")  # Qwen2 derives it: hidden_size // num_attention_heads
    return Qwen2Config(
        **common,
        **qwen,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=layers,
        architectures=["Qwen2ForCausalLM"],
    )


def _qwen3_vl_config(family: Family, common: dict[str, Any], qwen: dict[str, Any]) -> Any:
    """Qwen3-VL as the Hub ships it: a Qwen3 text model (multimodal RoPE, interleaved) beside a
    1-layer vision tower; the MoE like Qwen3-VL-30B-A3B (8 of 128 experts) at 2 of 8, with an
    expert width (24) that tells the fused experts' two layouts apart."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text = dict(common, **qwen, max_position_embeddings=262144)
    text["rope_parameters"] = dict(
        rope_type="default", rope_theta=5_000_000.0, mrope_section=[4, 2, 2],
        mrope_interleaved=True,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=common["hidden_size"], deepstack_visual_indexes=[0])  # fmt: skip
    tied = text.pop("tie_word_embeddings")
    if family == "qwen3_vl":
        arch = "Qwen3VLForConditionalGeneration"
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied,
                             architectures=[arch])  # fmt: skip
    text |= dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
    arch = "Qwen3VLMoeForConditionalGeneration"
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            architectures=[arch])  # fmt: skip


def _hf_config(family: Family, vocab: int, ids: dict[str, int], layers: int) -> Any:
    from transformers import LlamaConfig, MistralConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
    )
    qwen: dict[str, Any] = dict(  # Qwen's specials, tied embeddings, RoPE theta 1e6
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=ids.get(ENDOFTEXT),
        eos_token_id=ids.get(IM_END),
        pad_token_id=ids.get(ENDOFTEXT),
    )
    if _qwen(family):
        return _qwen_config(family, common, qwen, layers)
    if family == "gpt_oss":
        return _gpt_oss_config(common, ids)
    if family == "mistral":
        # Like Mistral-7B-v0.1: a 4,096-token sliding window in a 32,768-token context.
        return MistralConfig(
            **common,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            sliding_window=4096,
            tie_word_embeddings=False,
            bos_token_id=ids[LLAMA_BOS],
            eos_token_id=ids[LLAMA_EOS],
            pad_token_id=ids[LLAMA_EOS],
            architectures=["MistralForCausalLM"],
        )
    # Like Llama-3.2-Instruct: llama3 RoPE scaling, a list of EOS ids in config.json.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return LlamaConfig(
        **common,
        max_position_embeddings=131072,
        rope_parameters=rope,
        tie_word_embeddings=False,
        bos_token_id=ids[LLAMA_BOS],
        eos_token_id=[ids[LLAMA_EOS], ids[EOT if family == "llama3" else IM_END]],
        pad_token_id=ids[LLAMA_EOS],
        architectures=["LlamaForCausalLM"],
    )


def _gpt_oss_config(common: dict[str, Any], ids: dict[str, int]) -> Any:
    """Like gpt-oss-20b (4 of 32 experts of width 2,880, a 128-token window in every other
    layer, YaRN from 4,096 to 131,072 tokens, EOS <|return|>) at 2 of 8 experts of width 32
    and a 16-token window, so that short prompts already reach past it."""
    from transformers import GptOssConfig

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip
    layers = max(common["num_hidden_layers"], 4)  # windowed and full layers, twice over
    return GptOssConfig(
        **dict(common, num_hidden_layers=layers, intermediate_size=32, rms_norm_eps=1e-5),
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=131072,
        rope_parameters=rope,
        tie_word_embeddings=False,
        eos_token_id=ids[RETURN],
        pad_token_id=ids[ENDOFTEXT],
        architectures=["GptOssForCausalLM"],
    )


def _save_tokenizer(out: Path, tok: Any, family: Family) -> None:
    """tokenizer.json plus a hand-written tokenizer_config.json in the long-standing layout
    (chat template inline, PreTrainedTokenizerFast) that transformers 4.x and 5.x both load."""
    tok.save(str(out / "tokenizer.json"))
    specials = _specials(family)
    llama3, harmony = family == "llama3", family == "gpt_oss"
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
        for t in specials
    }  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": LLAMA_BOS if _bos(family) else None,
        "eos_token": EOT if llama3 else RETURN if harmony else IM_END,
        "pad_token": LLAMA_EOS if _bos(family) else ENDOFTEXT,
        "additional_special_tokens": [START_HEADER, END_HEADER, EOT]
        if llama3
        else list(HARMONY)
        if harmony
        else [IM_START, IM_END],
        "chat_template": LLAMA3_CHAT_TEMPLATE
        if llama3
        else HARMONY_CHAT_TEMPLATE
        if harmony
        else CHAT_TEMPLATE,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    smap = {k: config[k] for k in ("bos_token", "eos_token", "pad_token") if config[k]}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


# transformers 5.2: the `rope_parameters` config format, `from_config(dtype=)`, Qwen3.5's classes.
MIN_TRANSFORMERS = (5, 2)


def _check_transformers() -> None:
    """ImportError naming the installed and the needed version (before: an ImportError of one
    of Qwen3.5's classes, whatever family was asked for)."""
    from tinker_sr.hf_files import installed_version, version_below

    if version_below("transformers", MIN_TRANSFORMERS) is not False:  # None: not installed
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(
            f"tinker_sr.testing.hf_model_dir needs transformers >= {need} (installed: "
            f"{installed_version('transformers') or 'none'}): pip install -U "
            f"'transformers>={need}' (or tinker_sr's dev extra)"
        )


def make_tiny_hf_model_dir(
    path: str | os.PathLike[str],
    family: Family = "qwen3",
    dtype: DTypeName = "float32",
    sharded: bool = False,
    seed: int = 0,
    *,
    n_layers: int = 2,
    n_merges: int = 400,
    pad_vocab_to_multiple: int = 1,
    attention_bias: bool = False,
) -> Path:
    """Write a tiny random HF causal LM + BPE tokenizer into `path` (created) and return it.

    ``sharded=True`` splits the weights over several safetensors files with an index (as
    `save_pretrained(max_shard_size=...)` does for big checkpoints). ``pad_vocab_to_multiple``
    pads the model's embedding rows past the tokenizer's length (Qwen pads to 151,936 rows);
    the default 1 keeps them equal. ``attention_bias=True`` (Llama, Qwen3) sets config.json's
    ``attention_bias``: biases on q, k, v and o. See `tiny_model_info` for the ids.
    """
    _check_transformers()
    import torch
    from transformers import GenerationConfig

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(family, seed, n_merges)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-n_tok // pad_vocab_to_multiple) * pad_vocab_to_multiple
    names = (ENDOFTEXT, IM_START, IM_END, LLAMA_BOS, LLAMA_EOS, EOT, RETURN, CALL)
    ids = {t: tok.token_to_id(t) for t in names}
    ids = {k: v for k, v in ids.items() if v is not None}
    config = _hf_config(family, vocab, ids, n_layers)
    if attention_bias:
        if family not in ("llama", "llama3", "qwen3", "qwen3_moe"):
            raise ValueError(f"attention_bias: {family} has fixed attention biases")
        config.attention_bias = True
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = _random_model(config, family)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(out, max_shard_size="100KB" if sharded else "50GB")
    config = getattr(config, "text_config", config)  # Qwen3.5, Qwen3-VL: its text model's ids
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    # gpt-oss's generation_config: <|return|>, <|endoftext|>, <|call|>
    extras = [ids[LLAMA_EOS]] if _bos(family) else [ids[ENDOFTEXT]]
    extras += [ids[CALL]] if family == "gpt_oss" else []
    gen_eos = eos + [e for e in extras if e not in eos]
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=gen_eos,
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=0.7,
    ).save_pretrained(out)
    _save_tokenizer(out, tok, family)
    return out


def save_random_model(
    path: str | os.PathLike[str],
    family: Family,
    vocab: int,
    config_of: Any,
    dtype: DTypeName = "float32",
) -> Path:
    """A directory of wider weights than `make_tiny_hf_model_dir`'s (benchmarks, and tests
    that need realistic widths): its tokenizer files (``family``'s, the vocabulary padded to
    ``vocab``) beside random weights (seed 0, drawn in float32 and saved in ``dtype``, as
    `make_tiny_hf_model_dir` does) of ``config_of(**special_ids)``, a transformers config given
    the tokenizer's bos/eos/pad ids."""
    import torch
    from transformers import AutoModelForCausalLM

    out = make_tiny_hf_model_dir(path, family, pad_vocab_to_multiple=vocab)
    hf = json.loads((out / "config.json").read_text())
    config = config_of(**{k: hf.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    return out


def _random_model(config: Any, family: Family) -> Any:
    """transformers' initialisation, then biases drawn like the weights (transformers would zero
    them, hiding a bias that is not applied); Qwen3.5's zero-centred norm gains drawn too (at
    zero they would hide a gain read without its offset)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForConditionalGeneration,
    )

    if family == "qwen3_5":
        model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=torch.float32)
    elif family == "qwen3_5_moe":
        model = Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=torch.float32)
    elif family.startswith("qwen3_vl"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if family == "gpt_oss" and name.endswith(("self_attn.sinks", "mlp.router.bias")):
                p.normal_(0.0, 1.0 if "sinks" in name else 0.5)  # O(1): both matter
            elif name.endswith(".bias") or name.endswith("_bias"):  # gpt-oss: experts' biases
                p.normal_(0.0, 0.02)
            elif family == "gpt_oss" and name.endswith("router.weight"):
                p.normal_(0.0, 0.5)  # routing that differs by token
            elif not family.startswith(("qwen3_5", "qwen3_vl")) or "visual" in name:
                continue
            elif name.endswith("norm.weight") and family.startswith("qwen3_5"):
                p.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.1)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)  # routing that differs by token, a gate that matters
    return model


def tiny_model_info(path: str | os.PathLike[str]) -> TinyModelInfo:
    """Read back the ids of a directory made by `make_tiny_hf_model_dir` (plain JSON reads)."""
    root = Path(path)
    cfg = json.loads((root / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # Qwen3.5: its text model's
    gen = json.loads((root / "generation_config.json").read_text())
    tok = json.loads((root / "tokenizer.json").read_text())
    specials = {t["content"]: int(t["id"]) for t in tok["added_tokens"]}
    eos = gen["eos_token_id"]
    return TinyModelInfo(
        path=root,
        vocab_size=int(cfg["vocab_size"]),
        tokenizer_size=len(tok["model"]["vocab"])
        + len([s for s in specials.values() if s >= len(tok["model"]["vocab"])]),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
        pad_token_id=int(cfg["pad_token_id"]),
        bos_token_id=specials.get(LLAMA_BOS),
        special_ids=specials,
    )
