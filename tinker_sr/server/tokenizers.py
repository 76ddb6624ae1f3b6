"""Tokenizer ids for ``get_info``: the official SDK loads the tokenizer named there with
`transformers`, offline, so the server names a local directory (never a Hub name it made up).
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from tinker_sr.backend.base import Backend
from tinker_sr.types import GetInfoResponse


class TokenizerIds:
    """Resolves the tokenizer id of a model; writes the byte-level tokenizer dir on demand."""

    def __init__(self, backend: Backend, store_dir: Path | None) -> None:
        self.backend = backend
        self.store_dir = store_dir
        self._lock = threading.Lock()
        self._byte_dir: str | None = None

    def tokenizer_id(self, info: GetInfoResponse) -> str | None:
        """A tokenizer id the official SDK can load offline: a local directory (no ':')."""
        current = info.model_data.tokenizer_id
        if current and os.path.isdir(current):
            return current
        if current:
            return current  # a Hub name chosen by the backend: leave it alone
        resolve = getattr(self.backend, "resolve_model", None)
        name = info.model_data.model_name or info.model_name
        if resolve is None or not name:
            return None
        try:
            resolved = resolve(name)
        except Exception:
            return None
        if os.path.isdir(resolved):
            has_tokenizer = any(
                (Path(resolved) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
            )
            return resolved if has_tokenizer and ":" not in resolved else None
        return self._byte_tokenizer()  # a built-in model: byte-level tokenizer

    def _byte_tokenizer(self) -> str:
        with self._lock:
            if self._byte_dir is None:
                from tinker_sr.tokenization import byte

                root = self.store_dir / "tokenizers" if self.store_dir is not None else None
                if root is None or ":" in str(root.resolve()):
                    # The SDK cuts tokenizer ids at the first ':'; use a path without one.
                    root = Path(tempfile.mkdtemp(prefix=byte.SERVED_TEMP_PREFIX))
                path = root.resolve() / byte.SERVED_DIR_NAME
                # Written anew each start: one an older server wrote lacks the mark.
                byte.write_hf_tokenizer_dir(path)
                assert byte.is_served_byte_tokenizer(str(path)), path  # the clients know it
                self._byte_dir = str(path)
            return self._byte_dir
