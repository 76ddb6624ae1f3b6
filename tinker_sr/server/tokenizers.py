"""Tokenizer ids for ``get_info`` (and a sampler's, for tinker_sr's client): the official SDK
loads the tokenizer named there with `transformers`, offline, so the server names a local
directory (never a Hub name it made up).
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from tinker_sr.backend.base import Backend
from tinker_sr.tokenization.hf import has_vocabulary
from tinker_sr.types import GetInfoResponse


class TokenizerIds:
    """Resolves the tokenizer id of a model; writes the byte-level tokenizer dir on demand."""

    def __init__(self, backend: Backend, store_dir: Path | None) -> None:
        self.backend = backend
        self.store_dir = store_dir
        self._lock = threading.Lock()
        self._byte_dir: str | None = None

    def tokenizer_id(self, info: GetInfoResponse) -> str | None:
        """A tokenizer id the official SDK can load offline: a local directory."""
        current = info.model_data.tokenizer_id
        if current:  # a directory, or a Hub name chosen by the backend: as it is
            return current
        return self.for_model(info.model_data.model_name or info.model_name)

    def for_model(self, name: str | None) -> str | None:
        """The tokenizer directory of base model ``name`` as served (aliases resolved): its
        own directory's, or for a built-in the byte-level one; None if it has none here."""
        resolve = getattr(self.backend, "resolve_model", None)
        if resolve is None or not name:
            return None
        try:
            resolved = resolve(name)
        except Exception:
            return None
        if os.path.isdir(resolved):
            # A ':' in it is fine: the SDK cuts the model name at one, not the tokenizer id.
            return resolved if has_vocabulary(resolved) else None
        return self._byte_tokenizer()  # a built-in model: byte-level tokenizer

    def _byte_tokenizer(self) -> str:
        with self._lock:
            if self._byte_dir is None:
                from tinker_sr.tokenization import byte

                root = self.store_dir / "tokenizers" if self.store_dir is not None else None
                if root is None:  # a server keeping its state in memory
                    root = Path(tempfile.mkdtemp(prefix=byte.SERVED_TEMP_PREFIX))
                path = root.resolve() / byte.SERVED_DIR_NAME
                # Written anew each start: one an older server wrote lacks the mark.
                byte.write_hf_tokenizer_dir(path)
                assert byte.is_served_byte_tokenizer(str(path)), path  # the clients know it
                self._byte_dir = str(path)
            return self._byte_dir
