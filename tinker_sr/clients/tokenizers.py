"""Tokenizers for `get_tokenizer()`, without any download.

Built-in models (and aliases to them) use the engine's byte-level tokenizer. A tokenizer id
that is a local directory loads with `transformers` (or `tokenizers`) if installed.
"""

from __future__ import annotations

import functools
import os
from typing import Any


@functools.lru_cache(maxsize=32)
def load_tokenizer(model_name: str, tokenizer_id: str | None) -> Any:
    from tinker_sr.engine.tokenizer import ByteTokenizer

    for ident in (tokenizer_id, model_name):
        if ident and os.path.isdir(ident):
            if os.path.exists(os.path.join(ident, "tokenizer.json")) or os.path.exists(
                os.path.join(ident, "tokenizer_config.json")
            ):
                try:
                    from transformers import AutoTokenizer
                except ImportError as e:
                    raise ImportError(
                        f"loading the tokenizer in {ident} needs `transformers`; pip install it"
                    ) from e
                return AutoTokenizer.from_pretrained(ident)
    # Built-in models, and every name the embedded engine serves through an alias to one,
    # share the byte-level tokenizer.
    return ByteTokenizer()
