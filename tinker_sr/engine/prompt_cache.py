"""Prefill once per prompt: the keys, values and last logits of recently prefilled prompts.

RL asks for the same prompt many times at once: tinker-cookbook's rollouts send one
``sample(num_samples=1)`` per member of a group (4 to 16 of them), all with the prompt of the
group's problem, and `engine.scheduler` used to prefill each of them. This cache keeps, per
sampling model and exact prompt, what a prefill produces (every layer's keys and values for the
prompt's positions, and the float32 logits after its last token), and a request whose prompt is
in it copies them into its own KV cache instead of running the model. What it copies are the
very tensors the first prefill computed, so a hit gives bit-identical tokens, logprobs and
draws to a miss, whatever ran before: results still depend only on the request.

Multi-turn rollouts (a conversation, a tool loop, a game) ask for prompts that extend earlier
ones: each turn's prompt is the last one plus the reply and the next observation. So a prompt is
prefilled in chunks of ``BLOCK`` (256) tokens at fixed positions, and each full block's keys and
values are kept under its tokens and the block before it; a prompt that extends a cached one
copies its leading blocks and computes only the rest. This stays bit-identical because block
``j`` is always computed the same way (the same ``BLOCK`` rows at the same positions over the
same earlier keys and values), whether the head was cached or not; so results still depend
only on the request, not on what the cache holds. The last chunk (1 to ``BLOCK`` tokens, with
the logits after the prompt) is kept as the prompt's tail: a whole prompt found is all of its
blocks and its tail. Qwen3.5's linear-attention layers carry a convolution window and a
recurrent state through the prompt instead of keys and values; the blocks are computed the same
way (each resumes from the state the block before it left), and the states are kept where a
longer prompt resumes: after a prefill's last full block, and after its tail. They are large
(per linear layer, value heads x key width x value width float32 numbers: 2 MiB for 32 heads of
128 x 128), so raise the budget for multi-turn rollouts on such models.

Prompts of at most ``BLOCK`` tokens are one chunk, as before. Chunking costs longer prompts
where nothing is cached: `benchmarks/multi_turn.py` measured 1.26x the time of one pass for a
700-token prompt and 1.21x for 2,000 tokens (the ~42M-parameter benchmark model, 2 threads),
against rollouts 2.6x faster.

Entries belong to one session (the ``scope`` of `lookup` and `put`): another session's request
for the same prompt computes it itself, so nothing of what one client (on a server, one API
key) sent shows to another, not in ``prompt_cache_hit_tokens``, which usage bills
(`engine.usage`), nor in timing. Entries belong to one model object; sampling models are immutable (merged copies or the frozen
base, never a trainer's live tensors: `engine.registry`), and an entry dies with its model. The
least recently used entries go when the total passes the budget: ``$TINKER_SR_PROMPT_CACHE_MB``
(default 256; 0 turns the cache off). An entry (a block or a tail) that would take more than a
quarter of the budget is not kept.
Requests report the prompt tokens they did not compute as ``prompt_cache_hit_tokens``.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

BUDGET_ENV, DEFAULT_BUDGET_MB = "TINKER_SR_PROMPT_CACHE_MB", 256
BLOCK = 256
"""Prefill chunk: a prompt is prefilled BLOCK tokens at a time at fixed positions, and its full
blocks are what a longer prompt can reuse (module docstring)."""
ROOT = 0  # the parent of a prompt's first block

__all__ = ["BLOCK", "BUDGET_ENV", "ROOT", "CachedPrompt", "PromptCache", "budget_from_env"]


def budget_from_env() -> int:
    """Bytes the cache may hold: ``$TINKER_SR_PROMPT_CACHE_MB`` MiB (0: off)."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_BUDGET_MB << 20
    try:
        mb = int(raw)
    except ValueError:
        raise ValueError(
            f"${BUDGET_ENV} must be a whole number of MiB (0: off), got {raw!r}"
        ) from None
    if mb < 0:
        raise ValueError(f"${BUDGET_ENV} must be >= 0 (0: off), got {mb}")
    return mb << 20


def _key(
    kind: str, model: torch.nn.Module, parent: int, tokens: Sequence[int], scope: str
) -> tuple[Any, ...]:
    """A block's or a tail's entry: its tokens after block `parent`, on `model`, for `scope`
    (whose prompts may share it: a session's, never another's)."""
    return (kind, id(model), scope, parent, tuple(tokens))


def _bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class CachedPrompt:
    """What a prefill left for some positions of a prompt (a whole prompt, a block or a tail):
    their keys and values [1, H, n, D] per layer; the float32 logits [1, V] after the prompt's
    last token (None for a block); ``nbytes``, what they take; for a hybrid model (Qwen3.5) each
    linear-attention layer's convolution window and recurrent state after the prompt
    (``states``, one row each); ``uid``, the entry's id (the parent of the next block)."""

    model: weakref.ref[torch.nn.Module]
    k: list[Tensor]
    v: list[Tensor]
    logits: Tensor | None
    nbytes: int
    states: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    uid: int = 0


class PromptCache:
    """Prefill results, LRU within a byte budget (module docstring): a prompt's full
    `BLOCK`-token blocks and its tail, each block keyed by its tokens and the entry of the block
    before it, so a prompt that extends a cached one finds its head (`lookup`, `put`)."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget = budget_from_env() if budget_bytes is None else budget_bytes
        self._entries: OrderedDict[tuple[Any, ...], CachedPrompt] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._uids = itertools.count(1)  # a block entry's id; ROOT (0) is before any block
        self.hits = self.misses = 0  # whole prompts found / not found
        self.block_hits = 0  # blocks found for prompts not found whole

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _find(self, model: torch.nn.Module, key: tuple[Any, ...]) -> CachedPrompt | None:
        """The live entry under `key` (most recently used now), or None; under the lock."""
        entry = self._entries.get(key)
        if entry is not None and entry.model() is not model:  # an old model's id, reused
            self._drop(key)
            entry = None
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def lookup(
        self,
        model: torch.nn.Module,
        prompt: Sequence[int],
        *,
        hybrid: bool = False,
        scope: str = "",
    ) -> tuple[list[CachedPrompt], CachedPrompt | None]:
        """The cached leading full blocks of `prompt` (those before its last `BLOCK`-token
        chunk, up to the first not cached), and, where all of them are, its tail (the rest of
        the prompt) if cached too: a whole hit. For a `hybrid` model without a whole hit the
        blocks end at the last one that kept the linear-attention states after it (a prefill
        resumes from there)."""
        found: list[CachedPrompt] = []
        if self.budget <= 0:
            return found, None
        n, parent = (len(prompt) - 1) // BLOCK, ROOT
        with self._lock:
            for j in range(n):
                block = prompt[j * BLOCK : (j + 1) * BLOCK]
                entry = self._find(model, _key("block", model, parent, block, scope))
                if entry is None:
                    break
                found.append(entry)
                parent = entry.uid
            tail = None
            if len(found) == n:
                tail = self._find(model, _key("tail", model, parent, prompt[n * BLOCK :], scope))
            if tail is None:
                while hybrid and found and not found[-1].states:
                    found.pop()
                self.block_hits += len(found)
                self.misses += 1
            else:
                self.hits += 1
        return found, tail

    def put(
        self,
        model: torch.nn.Module,
        parent: int,
        tokens: Sequence[int],
        k: list[Tensor],
        v: list[Tensor],
        logits: Tensor | None = None,
        states: dict[int, tuple[Tensor, Tensor]] | None = None,
        scope: str = "",
    ) -> int | None:
        """Keep copies of what a prefill computed for `tokens` after block `parent`: a full
        block's keys and values, or with `logits` (those after the prompt's last token) its
        tail's; and a hybrid model's linear-attention states after them, where given (after a
        prefill's last full block and its tail). Returns the entry's id, the parent of the next
        block, or None where it was not kept (nothing after it can be found)."""
        key = _key("tail" if logits is not None else "block", model, parent, tokens, scope)
        if self.budget <= 0:
            return None
        states = states or {}
        held = (*k, *v, *(() if logits is None else (logits,)))
        size = _bytes((*held, *(t for pair in states.values() for t in pair)))
        if size > self.budget // 4:
            return None
        with self._lock:
            # Computed again (a hybrid prefill resumes before it): the same tensors, bit for
            # bit. Keep the entry, or replace it to add states, under its id, so the blocks
            # after it stay reachable.
            old = self._find(model, key)
            if old is not None and (old.states or not states):
                return old.uid
            uid = next(self._uids) if old is None else old.uid
        entry = CachedPrompt(
            weakref.ref(model),
            [t.clone() for t in k],
            [t.clone() for t in v],
            None if logits is None else logits.clone(),
            size,
            {layer: (c.clone(), r.clone()) for layer, (c, r) in states.items()},
            uid,
        )
        with self._lock:
            if key in self._entries:
                self._drop(key)
            for dead in [k_ for k_, e in self._entries.items() if e.model() is None]:
                self._drop(dead)
            while self._entries and self._bytes + size > self.budget:
                self._drop(next(iter(self._entries)))
            self._entries[key] = entry
            self._bytes += size
        return entry.uid

    def drop_scope(self, scope: str) -> int:
        """Forget every entry of ``scope`` (a session that has finished: nothing can hit them
        again), and those of models that are gone; returns the bytes freed."""
        with self._lock:
            before = self._bytes
            for key in [k for k, e in self._entries.items() if k[2] == scope or e.model() is None]:
                self._drop(key)
            return before - self._bytes

    def _drop(self, key: tuple[Any, ...]) -> None:
        self._bytes -= self._entries.pop(key).nbytes
