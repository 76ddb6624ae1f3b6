"""Top-k logprobs as two dense ``(length, k)`` matrices."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TopkLogprobs", "topk_to_lists", "MASK_LOGPROB"]

MASK_LOGPROB = -99999.0
"""Logprob of an empty cell; empty cells hold ``(0, MASK_LOGPROB)``."""


@dataclass(frozen=True, slots=True)
class TopkLogprobs:
    token_ids: np.ndarray
    """int32 token ids, shape ``(length, k)``."""

    logprobs: np.ndarray
    """float32 logprobs, shape ``(length, k)``."""


def topk_to_lists(topk: TopkLogprobs) -> list[list[tuple[int, float]] | None]:
    """Per position: the ``(token_id, logprob)`` pairs without trailing sentinels, or ``None``
    when the whole row is sentinel (nothing was computed there)."""
    ids = np.asarray(topk.token_ids)
    lps = np.asarray(topk.logprobs)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        return []
    filled = ~((ids == 0) & (lps == MASK_LOGPROB))
    # Number of leading cells to keep per row = index of the last non-sentinel + 1.
    keep = np.where(filled.any(axis=1), ids.shape[1] - np.argmax(filled[:, ::-1], axis=1), 0)
    id_rows, lp_rows = ids.tolist(), lps.tolist()
    out: list[list[tuple[int, float]] | None] = []
    for i, n in enumerate(keep.tolist()):
        # A row whose first cell is a sentinel means "not computed", as in the official SDK.
        if n == 0 or not filled[i, 0]:
            out.append(None)
        else:
            out.append(list(zip(id_rows[i][:n], lp_rows[i][:n], strict=True)))
    return out
