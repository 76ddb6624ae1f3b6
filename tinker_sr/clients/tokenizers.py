"""`get_tokenizer()`: the model's own tokenizer on every backend, or an error saying what is
missing (never a stand-in).

- Embedded engine: the backend's tokenizer of the model (aliases resolved): the byte-level
  tokenizer for built-ins, the directory's tokenizer for a Hugging Face model.
- Remote service: like the official SDK, the service's ``tokenizer_id`` (training clients; a
  sampling client made from one inherits it; others ask a tinker_sr server for the sampler's),
  else a name derived from the base model. The byte-level directory a tinker_sr server names
  for its built-in models is the built-in tokenizer (no `tokenizers` package or access to the
  server's disk needed); other ids are loaded from a local directory or the Hugging Face cache
  when there, else through ``transformers.AutoTokenizer.from_pretrained`` as the SDK does
  (which may download).
"""

from __future__ import annotations

import functools
from typing import Any

from tinker_sr.hf_files import TOKENIZER_FILES, hub_cache_dir, resolve_model_dir


def tokenizer_for(backend: Any, model_name: str, tokenizer_id: str | None) -> Any:
    """The tokenizer of `model_name` as served by `backend` (see the module docstring)."""
    own = getattr(backend, "model_tokenizer", None)
    if own is not None:
        return own(model_name)
    return load_tokenizer(model_name, tokenizer_id)


def cached_repo(path: str) -> tuple[str, str] | None:
    """(``org/name``, revision) of a Hugging Face cache snapshot path
    (``.../models--org--name/snapshots/<rev>``), else None."""
    parts = path.replace("\\", "/").rstrip("/").split("/")
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    return parts[-3][len("models--") :].replace("--", "/"), parts[-1]


def sdk_tokenizer_id(model_name: str) -> str:
    """The id the official SDK derives from a base model name when the service names none."""
    name = model_name.split(":")[0]
    if name.startswith("meta-llama/Llama-3"):
        return "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"
    if name.count("/") == 2:
        org, model, _variant = name.split("/", 2)
        return f"{org}/{model}"
    return name


@functools.lru_cache(maxsize=32)
def load_tokenizer(model_name: str, tokenizer_id: str | None) -> Any:
    from tinker_sr.tokenization.byte import (
        BYTE_TOKENIZER_MODELS,
        ByteTokenizer,
        is_served_byte_tokenizer,
    )
    from tinker_sr.tokenization.hf import load_hf_tokenizer

    if tokenizer_id is None and model_name.split(":")[0] in BYTE_TOKENIZER_MODELS:
        return ByteTokenizer()
    if tokenizer_id is not None and is_served_byte_tokenizer(tokenizer_id):
        return ByteTokenizer()  # a tinker_sr server's built-in model (or an alias of one)
    # As the SDK: the model name is cut at a ':' (a variant id), a tokenizer id is not.
    ident = tokenizer_id or sdk_tokenizer_id(model_name)
    local = resolve_model_dir(ident, TOKENIZER_FILES)
    if local is None and (repo := cached_repo(ident)) is not None:
        # A snapshot in the server's Hugging Face cache (a server on another machine): the
        # same model here, at that revision or any, else from the Hub by its name.
        ident = repo[0]
        local = resolve_model_dir(f"{ident}@{repo[1]}", TOKENIZER_FILES) or resolve_model_dir(
            ident, TOKENIZER_FILES
        )
    if local is not None:
        return load_hf_tokenizer(local)
    where = (
        f"the tokenizer {ident!r} of model {model_name!r} is neither a local directory nor in "
        f"the Hugging Face cache ({hub_cache_dir()})"
    )
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise RuntimeError(
            f"get_tokenizer: {where}, and fetching it needs `transformers` (pip install "
            "transformers), or point HF_HOME at a cache that holds it"
        ) from e
    try:
        return AutoTokenizer.from_pretrained(ident, fast=True)
    except Exception as e:
        raise RuntimeError(
            f"get_tokenizer: {where}, and transformers could not load it: {e}"
        ) from e
