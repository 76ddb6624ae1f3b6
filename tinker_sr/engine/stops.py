"""Incremental stop-string matching over sampled token ids.

Each row keeps only the last ``max(len(stop)) - 1`` bytes of its output; a new token appends
its bytes (a table lookup) and the stops are searched in that short buffer. Nothing is
re-decoded, so the cost per token is independent of how long the row already is.

Matching is on UTF-8 bytes, which equals matching on text: UTF-8 is self-synchronising, so a
stop string's encoding occurs in the byte stream exactly where the string occurs in the
decoded text, also when a character is split across tokens. Special tokens contribute no
bytes (they are skipped, as detokenisers for stop strings do); EOS is matched by id instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinker_sr.user_errors import EngineUserError


class StopStrings:
    """Per-row matcher for `stops` given `token_bytes[id]` = the bytes token `id` decodes to."""

    def __init__(self, stops: Sequence[str], token_bytes: Sequence[bytes], rows: int) -> None:
        if any(not s for s in stops):
            raise EngineUserError("stop: stop strings must be non-empty")
        self._patterns = [s.encode("utf-8") for s in stops]
        self._keep = max((len(p) for p in self._patterns), default=1) - 1
        self._table = token_bytes
        self._tails = [b""] * rows

    def push(self, row: int, token: int) -> bool:
        """Append `token` to `row`; True when a stop string now ends within the row's output."""
        piece = self._table[token] if 0 <= token < len(self._table) else b""
        buf = self._tails[row] + piece
        hit = any(p in buf for p in self._patterns)
        self._tails[row] = buf[-self._keep :] if self._keep else b""
        return hit
