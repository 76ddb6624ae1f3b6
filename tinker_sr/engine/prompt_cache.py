"""Prefill once per prompt: the keys, values and last logits of recently prefilled prompts.

RL asks for the same prompt many times at once: tinker-cookbook's rollouts send one
``sample(num_samples=1)`` per member of a group (4 to 16 of them), all with the prompt of the
group's problem, and `engine.scheduler` used to prefill each of them. This cache keeps, per
sampling model and exact prompt, what a prefill produces (every layer's keys and values for the
prompt's positions, and the float32 logits after its last token), and a request whose prompt is
in it copies them into its own KV cache instead of running the model. What it copies are the
very tensors the first prefill computed, so a hit gives bit-identical tokens, logprobs and
draws to a miss, whatever ran before: results still depend only on the request.

Only whole prompts match (no prefix reuse: a prompt that extends a cached one is prefilled in
full, because computing its tail after a cached head rounds differently from one forward over
it, and whether the head is still cached depends on timing). Entries belong to one model
object; sampling models are immutable (merged copies or the frozen base, never a trainer's live
tensors: `engine.registry`), and an entry dies with its model. The least recently used entries
go when the total passes the budget: ``$TINKER_SR_PROMPT_CACHE_MB`` (default 256; 0 turns the
cache off). A prompt whose entry would take more than a quarter of the budget is not kept.
Requests report the prompt tokens they did not compute as ``prompt_cache_hit_tokens``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

BUDGET_ENV, DEFAULT_BUDGET_MB = "TINKER_SR_PROMPT_CACHE_MB", 256

__all__ = ["BUDGET_ENV", "CachedPrompt", "PromptCache", "budget_from_env"]


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


def _bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class CachedPrompt:
    """What a prefill of one prompt left: keys and values [1, H, P, D] per layer, and the
    float32 logits [1, V] after the last prompt token; ``nbytes``, what they take; for a
    hybrid model (Qwen3.5) each linear-attention layer's convolution window and recurrent
    state after the prompt (``states``, one row each)."""

    model: weakref.ref[torch.nn.Module]
    k: list[Tensor]
    v: list[Tensor]
    logits: Tensor
    nbytes: int
    states: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


class PromptCache:
    """Prefill results by (model, prompt), LRU within a byte budget (module docstring)."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget = budget_from_env() if budget_bytes is None else budget_bytes
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], CachedPrompt] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, model: torch.nn.Module, prompt: Sequence[int]) -> CachedPrompt | None:
        if self.budget <= 0:
            return None
        key = (id(model), tuple(prompt))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.model() is not model:  # an old model's id, reused
                self._drop(key)
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(
        self,
        model: torch.nn.Module,
        prompt: Sequence[int],
        k: list[Tensor],
        v: list[Tensor],
        logits: Tensor,
        states: dict[int, tuple[Tensor, Tensor]] | None = None,
    ) -> None:
        """Keep copies of a prefill's results (the tensors given are not held)."""
        if self.budget <= 0:
            return
        states = states or {}
        size = _bytes((*k, *v, logits, *(t for pair in states.values() for t in pair)))
        if size > self.budget // 4:
            return
        entry = CachedPrompt(
            weakref.ref(model),
            [t.clone() for t in k],
            [t.clone() for t in v],
            logits.clone(),
            size,
            {layer: (c.clone(), r.clone()) for layer, (c, r) in states.items()},
        )
        key = (id(model), tuple(prompt))
        with self._lock:
            if key in self._entries:
                self._drop(key)
            for dead in [k_ for k_, e in self._entries.items() if e.model() is None]:
                self._drop(dead)
            while self._entries and self._bytes + size > self.budget:
                self._drop(next(iter(self._entries)))
            self._entries[key] = entry
            self._bytes += size

    def _drop(self, key: tuple[int, tuple[int, ...]]) -> None:
        self._bytes -= self._entries.pop(key).nbytes
