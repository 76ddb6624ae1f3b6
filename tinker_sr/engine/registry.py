"""The models the engine holds in memory: name aliases, the frozen base models, and the live
trainers (LoRA adapters + optimizer) and samplers, each keyed by its id.

Memory model (docs/architecture.md, "Memory"):

* one frozen base per (model, dtype), shared by every trainer and sampler of it: a trainer is
  `share_frozen(base)` plus its own LoRA adapters and optimizer state, never a copy of the base;
  a base is dropped when nothing uses it any more;
* a sampler holds only its LoRA adapters. Adapters live in memory up to
  ``adapter_budget_bytes`` (least recently used first out), beyond that in a spill file
  that is read back on use;
* sampling runs on merged weights (W + s·BA, the fastest decode) kept in an LRU cache of at
  most ``merged_budget_bytes``; a sampler whose merged weights would not fit samples through
  its adapters on the shared base instead;
* everything of a session goes when it closes or expires (`release_session`).

Threads: the training worker and the sampling scheduler share one registry, so every public
method runs under one reentrant lock. What a sampler decodes with is an immutable snapshot
(merged copies, or its own adapter copy on the frozen base; never a trainer's live tensors),
and a decode holds its model object, so a release or eviction meanwhile only drops the
registry's reference: the memory goes when the decode finishes.

Every entry goes in through a ``register_*`` method and out through a ``release_*`` method.
The registry is in-memory only; persistence (runs, checkpoints, recorded sequences) lives in
`Store` and `CheckpointStore`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

import torch
from safetensors.torch import load_file, save_file

from tinker_sr.engine import env_settings, gemm
from tinker_sr.engine.admission import trainer_optimizer
from tinker_sr.engine.cpu import return_freed_memory
from tinker_sr.engine.device import free_memory, train_autocast_dtype
from tinker_sr.engine.dir_stamps import LoadedDirs, Stamp, dir_stamp
from tinker_sr.engine.env_settings import checkpointing_setting
from tinker_sr.engine.hf import context_length, load_model_dir
from tinker_sr.engine.lora import (
    LoraLinear,
    LoraSpec,
    apply_lora,
    clone_for_sampling,
    load_lora_state_dict,
    lora_state_dict,
    reclaim_weights,
    share_frozen,
)
from tinker_sr.engine.model import BUILTIN_CONFIGS, Transformer, build_model
from tinker_sr.engine.optim import Adam
from tinker_sr.engine.set_aside import SetAside, Source, unknown_sampler
from tinker_sr.engine.spill import SpillDir, sweep_once
from tinker_sr.hf_files import cached_hub_model, not_found_hint, resolve_model_dir, tinker_variant
from tinker_sr.tokenization.hf import ByteModelTokenizer, ModelTokenizer
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError, ModelUnavailableError

log = logging.getLogger("tinker_sr.engine")
P = ParamSpec("P")
R = TypeVar("R")


def _locked(
    method: Callable[Concatenate[ModelRegistry, P], R],
) -> Callable[Concatenate[ModelRegistry, P], R]:
    """Run ``method`` under the registry's lock: the training worker and the sampling
    scheduler use one registry from two threads (reentrant: locked methods call each other)."""

    @functools.wraps(method)
    def wrapper(self: ModelRegistry, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _seq_of(sampler_id: str) -> int:
    """The ``sampling_session_seq_id`` in ``<session>:sample:<seq>``."""
    return int(sampler_id.rsplit(":", 1)[1])


def snapshot(model: Transformer) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s LoRA adapters."""
    return {k: v.detach().clone() for k, v in lora_state_dict(model).items()}


@dataclass
class Trainer:
    model_id: str
    session_id: str
    base_model: str  # the name the user asked for
    resolved: str  # built-in name or local directory
    lora: LoraSpec
    model: Transformer
    optim: Adam
    steps: int = 0
    # Adapter snapshots after each optimizer step, newest last (for stale samplers).
    history: deque[dict[str, torch.Tensor]] = field(default_factory=deque)


# The two sampler budgets, overridable per process by environment (MiB). The merged cache
# defaults to room for MERGED_DEFAULT_COPIES merged models (a loop that makes a new sampler
# every step only samples the newest one or two), and to what the device's free memory allows:
# a merged copy is built only while at least MERGED_HEADROOM (or half the copy, if more) would
# stay free after it; otherwise the sampler decodes through its adapters (no copy, slower).
MERGED_BUDGET_ENV, MERGED_DEFAULT_COPIES = "TINKER_SR_MERGED_CACHE_MB", 2
MERGED_HEADROOM = 1 << 30
ADAPTER_BUDGET_ENV, ADAPTER_BUDGET_MB = "TINKER_SR_SAMPLER_ADAPTERS_MB", 32
# Base-model sampling clients hold no weights of their own (~1 KB each), but a loop making one
# a step kept them all: a session keeps its most recently used this many.
BASE_SAMPLERS_PER_SESSION = 4096
# Samplers that decode through their adapters (merged weights over budget): the most recent
# ones keep their built model (adapters only; the base is shared).
UNMERGED_KEPT = 4


def _budget_bytes(env: str, default_mb: int | None) -> int | None:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return None if default_mb is None else default_mb << 20
    if not raw.isdigit():
        raise ValueError(f"{env} must be a whole number of MiB (0 disables), got {raw!r}")
    return int(raw) << 20


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class Sampler:
    """A sampling session: a base model, optionally with LoRA adapters (held by the registry);
    ``model`` materialises the network it samples with (merged weights, or adapters on the base)."""

    sampler_id: str
    session_id: str
    base_model: str
    resolved: str
    lora: LoraSpec | None
    model_path: str | None
    registry: ModelRegistry | None = field(default=None, repr=False)
    source: Source | None = None  # as its checkpoint and base directory were (`set_aside`)

    @functools.cached_property
    def context(self) -> int:  # its model's context length, from config.json alone: read once
        return context_length(self.resolved)

    @property
    def model(self) -> Transformer:
        if self.registry is None:
            raise EngineNotFoundError(f"sampling session {self.sampler_id!r} was released")
        return self.registry.sampling_model(self)


class ModelRegistry:
    """Aliases, base models, trainers and samplers of one engine."""

    def __init__(
        self,
        aliases: Mapping[str, str],
        *,
        sampler_dtype: torch.dtype | None = None,
        model_dtype: torch.dtype | None = None,
        merged_budget_bytes: int | None = None,
        adapter_budget_bytes: int | None = None,
        request_paths: bool = True,
        samplers_per_session: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``request_paths``: may a request's ``base_model`` name a local directory? Yes for
        the embedded engine (the caller owns the machine); a server says no, so a client can
        neither load nor probe the server's files: its directories come only from the
        operator's aliases (``tinker-sr serve --model-dir/--model-alias``), and a request
        may name only built-ins, aliases and Hub names cached on the server."""
        self._lock = threading.RLock()
        self.aliases = dict(aliases)
        self.request_paths = request_paths
        # None: samplers keep the base model's dtype; HF directories load in their
        # checkpoint's dtype unless model_dtype is set (built-ins are float32).
        self.sampler_dtype = sampler_dtype
        self.model_dtype = model_dtype
        # Where every model, adapter, optimizer state and KV cache lives (engine.device).
        self.device = device if device is not None else torch.device("cpu")
        # None: room for MERGED_DEFAULT_COPIES merged models of the size being added.
        self.merged_budget: int | None = merged_budget_bytes
        if merged_budget_bytes is None:
            self.merged_budget = _budget_bytes(MERGED_BUDGET_ENV, None)
        self.adapter_budget: int = adapter_budget_bytes or 0
        if adapter_budget_bytes is None:
            self.adapter_budget = _budget_bytes(ADAPTER_BUDGET_ENV, ADAPTER_BUDGET_MB) or 0
        per_session = samplers_per_session
        if per_session is None:
            per_session = env_settings.samplers_per_session()
        self.samplers_per_session = max(1, per_session)
        # (resolved, None) is the base as loaded; (resolved, dtype) a converted copy.
        self._bases: dict[tuple[str, torch.dtype | None], Transformer] = {}
        self._dirs = LoadedDirs()  # each loaded directory's files as they were read
        self._tokenizers: dict[str, ModelTokenizer | ByteModelTokenizer] = {}
        self._trainers: dict[str, Trainer] = {}
        self._samplers: OrderedDict[str, Sampler] = OrderedDict()  # least recently used first
        # LoRA samplers let go, which their checkpoints bring back
        self.set_aside = SetAside(self._lock)
        # Sampler adapters: in memory (LRU order, oldest first) or spilled to a file.
        self._adapters: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._spilled: dict[str, Path] = {}
        self._spill_dir: SpillDir | None = None
        sweep_once()  # a killed process's spilled adapters (`engine.spill`)
        self._spill_names = itertools.count()  # never reused (an id() of a freed dict is)
        # Merged sampling weights, LRU order, with their size in bytes.
        self._merged: OrderedDict[str, tuple[Transformer, int]] = OrderedDict()
        # Adapters-on-the-shared-base sampling models (merged would not fit), LRU order, with
        # their adapters' bytes: built once per sampler, not per request.
        self._unmerged: OrderedDict[str, tuple[Transformer, int]] = OrderedDict()
        # Sampling models built on adapters because free memory had no room for a merged copy
        # (a sampler rebuilt after leaving the kept ones counts again).
        self._low_memory_fallbacks = 0
        self._low_memory_noted = False

    # ---- base models ------------------------------------------------------------------
    def available_models(self) -> list[str]:
        return sorted(BUILTIN_CONFIGS) + sorted(k for k in self.aliases if k != "*")

    def context_lengths(self) -> dict[str, int]:
        """Every name `available_models` lists whose config reads, with its context length
        (from config.json alone: nothing is loaded). A name whose directory is gone or whose
        config the engine refuses is left out; a request for it says why."""
        out: dict[str, int] = {}
        for name in self.available_models():
            try:
                out[name] = context_length(self.resolve_model(name))
            except (EngineUserError, OSError):
                continue
        return out

    def resolve_model(self, name: str) -> str:
        """Map a requested base model name to a built-in name or a local directory (a path, or
        a Hub name found in the local Hugging Face cache; see `tinker_sr.hf_files`)."""
        if not isinstance(name, str) or not name:
            raise EngineUserError(
                f"base_model must be a non-empty string (a model name or a local model "
                f"directory), got {type(name).__name__} {name!r}"
            )
        if name in BUILTIN_CONFIGS:
            return name
        base, context = tinker_variant(name)  # "Qwen/Qwen3.6-35B-A3B:peft:262144"
        if context is not None and name not in self.aliases:
            resolved = self.resolve_model(base)
            if context > (have := context_length(resolved)):
                raise EngineUserError(
                    f"base_model {name!r} asks for {context} tokens of context and {base!r} "
                    f"has {have} (its config's context, or its sliding window); use "
                    f"'{base}:peft:{have}' or {base!r}"
                )
            return resolved
        alias = self.aliases.get(name) or self.aliases.get("*")
        target = alias or name
        if target in BUILTIN_CONFIGS:
            return target
        if alias is None and not self.request_paths:
            # Same answer whether or not such a directory exists: no file-system oracle.
            cached = cached_hub_model(target)
            if cached is not None:
                return str(cached)
            raise self._unavailable(
                f"{name!r} is not available on this server",
                "The server's operator adds models with `tinker-sr serve --model-dir DIR` or "
                "`--model-alias NAME=TARGET`.",
            )
        found = resolve_model_dir(target)
        if found is not None:
            return str(found)
        raise self._unavailable(
            f"{name!r} is not available",
            f"To use another name, alias it: TINKER_SR_MODEL_ALIASES='{name}=tinker-sr/tiny' "
            "or to a local Hugging Face directory with config.json and *.safetensors.",
            f" Looked for {target!r}: {not_found_hint(target)}.",
        )

    def _unavailable(self, what: str, fix: str, looked: str = "") -> ModelUnavailableError:
        available = ", ".join(self.available_models())
        return ModelUnavailableError(f"base_model {what}. Available: {available}.{looked}", fix)

    @_locked
    def tokenizer(self, name: str) -> ModelTokenizer | ByteModelTokenizer:
        """The tokenizer of base model ``name`` (resolved like `resolve_model`), loaded once."""
        resolved = self.resolve_model(name)
        tok = self._tokenizers.get(resolved)
        if tok is None:
            if resolved in BUILTIN_CONFIGS:
                tok = ByteModelTokenizer()
            else:
                tok = ModelTokenizer(Path(resolved))
            self._tokenizers[resolved] = tok
        return tok

    @_locked
    def base(self, resolved: str, dtype: torch.dtype | None = None) -> Transformer:
        """The frozen base model of ``resolved`` (in ``dtype`` when given and different from
        the loaded one), loaded once and shared."""
        if dtype is not None and dtype == self.base(resolved).dtype:
            dtype = None
        m = self._bases.get((resolved, dtype))
        if m is None:
            if dtype is not None:
                # New tensors (Module.to would convert the shared Parameters in place).
                m = clone_for_sampling(self.base(resolved), dtype=dtype)
            elif resolved in BUILTIN_CONFIGS:
                m = build_model(resolved, seed=0, dtype=self.model_dtype or torch.float32)
            else:
                self._dirs.loading(resolved)
                m = load_model_dir(resolved, dtype=self.model_dtype, cpu=self.device.type == "cpu")
            m.requires_grad_(False)
            m.eval()
            if m.device != self.device:  # loaded on the CPU, then moved once
                m = m.to(self.device)
            self._bases[(resolved, dtype)] = m
        return m

    def _adapted(
        self, resolved: str, spec: LoraSpec, dtype: torch.dtype | None = None
    ) -> Transformer:
        """The shared frozen base of ``resolved`` with fresh LoRA adapters of its own."""
        model = share_frozen(self.base(resolved, dtype))
        apply_lora(model, spec)
        return model

    @_locked
    def check_files(self, resolved: str) -> Stamp | None:
        """A new client asks for ``resolved``'s base: its directory as it loaded, or loaded
        again where no open client uses it; else refused (`dir_stamps`). Not for a trainer's
        own samplers, which run the base it holds. Returns the directory's files now."""
        now = dir_stamp(resolved)
        if self._dirs.changed(resolved, now, self._resolved_in_use()):
            self._drop_unused_bases(resolved)
        return now

    @_locked
    def new_trainable(self, resolved: str, spec: LoraSpec) -> tuple[Transformer, Adam]:
        """The shared base with new LoRA adapters, and an optimizer over the adapters.
        Activation checkpointing (`checkpointing_setting`) recomputes layer activations in
        backward: less memory for long sequences, about one more forward pass of compute."""
        self.check_files(resolved)
        model = self._adapted(resolved, spec)
        model.checkpoint_layers = checkpointing_setting()
        model.autocast_dtype = train_autocast_dtype(self.device)
        return model, trainer_optimizer(model, f"a rank-{spec.rank} LoRA of {resolved!r}")

    def _drop_unused_bases(self, changed: str | None = None) -> None:
        """Free the bases no client uses (and ``changed``'s tokenizer: its files changed)."""
        used = self._resolved_in_use()
        for key in [k for k in self._bases if k[0] not in used]:
            del self._bases[key]
        self._tokenizers.pop(changed or "", None)
        self._dirs.keep(used | set(self._tokenizers))  # a tokenizer is checked as its base

    def _resolved_in_use(self) -> set[str]:
        used = {t.resolved for t in self._trainers.values()}
        return used | {s.resolved for s in self._samplers.values()}

    # ---- trainers ---------------------------------------------------------------------
    @_locked
    def trainer(self, model_id: str) -> Trainer:
        t = self._trainers.get(model_id)
        if t is None:
            raise EngineNotFoundError(
                f"unknown model_id {model_id!r}; create a training client first"
            )
        return t

    @_locked
    def has_trainer(self, model_id: str) -> bool:
        return model_id in self._trainers

    @_locked
    def register_trainer(self, trainer: Trainer) -> None:
        self._trainers[trainer.model_id] = trainer

    @_locked
    def release_trainer(self, model_id: str) -> Trainer | None:
        """Forget ``model_id`` (its adapters and optimizer state); ``None`` if unknown."""
        t = self._trainers.pop(model_id, None)
        self._drop_unused_bases()
        return t

    @_locked
    def release_session(self, session_id: str) -> list[str]:
        """Drop every trainer and sampler of ``session_id``; returns the released ids."""
        trainers = [k for k, t in self._trainers.items() if t.session_id == session_id]
        samplers = [k for k, s in self._samplers.items() if s.session_id == session_id]
        for model_id in trainers:
            self._trainers.pop(model_id)
        for sampler_id in samplers:
            self._forget_sampler(sampler_id)
        self.set_aside.forget(session_id=session_id)
        self._drop_unused_bases()
        return_freed_memory()
        return trainers + samplers

    @_locked
    def close(self) -> None:
        """Drop everything, including spilled adapter files."""
        held: list[Trainer | Sampler] = [*self._trainers.values(), *self._samplers.values()]
        for session_id in {x.session_id for x in held}:
            self.release_session(session_id)
        if self._spill_dir is not None:
            self._spill_dir.close()
            self._spill_dir = None

    # ---- samplers ---------------------------------------------------------------------
    def sampler(self, sampler_id: str) -> Sampler:
        """``sampler_id``'s sampler, now the most recently used (samplers are kept in use
        order); one set aside is read back from its checkpoint first (`bring_back`)."""
        for _ in range(3):  # (brought back, it may be let go again before this use)
            with self._lock:
                if (s := self._samplers.get(sampler_id)) is not None:
                    self._samplers.move_to_end(sampler_id)  # one step: `live_sampler` sees it
                    return s
                if sampler_id not in self.set_aside:
                    break
            self.bring_back(sampler_id)
        raise unknown_sampler(sampler_id, self.samplers_per_session, BASE_SAMPLERS_PER_SESSION)

    def bring_back(self, sampler_id: str) -> None:
        """A set-aside sampler live again, its checkpoint read outside the lock (`set_aside`)."""
        self.set_aside.bring_back(self, sampler_id)

    def live_sampler(self, sampler_id: str) -> Sampler | None:
        """``sampler_id``'s sampler (or its record, set aside), or None, without waiting for
        engine work (dict reads)."""
        return self._samplers.get(sampler_id) or self.set_aside.get(sampler_id)

    @_locked
    def sampler_ids(self, session_id: str) -> list[str]:
        """The sampling sessions of `session_id` (live or set aside), in creation order."""
        found = [s.sampler_id for s in self._samplers.values() if s.session_id == session_id]
        return sorted([*found, *self.set_aside.ids(session_id)], key=_seq_of)

    @_locked
    def new_sampler_id(self, session_id: str, seq: int) -> str:
        sampler_id = f"{session_id}:sample:{seq}"
        if sampler_id in self._samplers or sampler_id in self.set_aside:
            raise EngineUserError(
                f"sampling_session_seq_id {seq} is already used in session {session_id}"
            )
        return sampler_id

    @_locked
    def register_sampler(
        self, sampler: Sampler, adapters: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Add ``sampler`` (with ``adapters`` when ``sampler.lora`` is set) and build its
        sampling weights now, so a mismatched checkpoint fails here, not at the first sample."""
        if (adapters is None) != (sampler.lora is None):
            raise ValueError("register_sampler: pass adapters exactly when sampler.lora is set")
        sampler.registry = self
        self._samplers[sampler.sampler_id] = sampler
        if adapters is not None:
            self._adapters[sampler.sampler_id] = {
                k: v.detach().clone() for k, v in adapters.items()
            }
        try:
            self.sampling_model(sampler)
        except Exception:
            self._forget_sampler(sampler.sampler_id)
            raise
        self._evict_least_used(sampler.session_id)
        self._spill_adapters_over_budget()

    def _evict_least_used(self, session_id: str) -> None:
        """Release the session's least recently used samplers beyond its quotas (LoRA ones
        beyond `samplers_per_session`, base-model ones beyond `BASE_SAMPLERS_PER_SESSION`)."""
        mine = [
            (k, s.lora is not None) for k, s in self._samplers.items() if s.session_id == session_id
        ]
        for lora, quota in ((True, self.samplers_per_session), (False, BASE_SAMPLERS_PER_SESSION)):
            ids = [k for k, is_lora in mine if is_lora == lora]
            for sampler_id in ids[: max(0, len(ids) - quota)]:
                self.set_aside.keep(self._samplers[sampler_id])  # before it leaves: never
                self._forget_sampler(sampler_id)  # unknown to `live_sampler` in between

    @_locked
    def release_sampler(self, sampler_id: str) -> Sampler | None:
        """Forget ``sampler_id`` (its adapters and merged weights); ``None`` if unknown."""
        s = self._forget_sampler(sampler_id)
        self.set_aside.forget(sampler_id)
        self._drop_unused_bases()
        return s

    def _forget_sampler(self, sampler_id: str) -> Sampler | None:
        s = self._samplers.pop(sampler_id, None)
        if s is not None:
            s.registry = None
        self._adapters.pop(sampler_id, None)
        self._merged.pop(sampler_id, None)
        self._unmerged.pop(sampler_id, None)
        spill = self._spilled.pop(sampler_id, None)
        if spill is not None:
            spill.unlink(missing_ok=True)
        return s

    # ---- sampling weights -------------------------------------------------------------
    @_locked
    def sampling_model(self, s: Sampler) -> Transformer:
        """The network ``s`` samples with: the shared base, its merged weights (cached, LRU
        under ``merged_budget``), or its adapters on the shared base when merged weights would
        not fit the budget (the last `UNMERGED_KEPT` such kept)."""
        for cache in (self._merged, self._unmerged):
            hit = cache.get(s.sampler_id)
            if hit is not None:
                cache.move_to_end(s.sampler_id)
                return hit[0]
        # What is built here outlives this call, so never as inference tensors (the scheduler
        # asks for an evicted sampler's model inside inference mode): those have no version
        # counter, which `gemm.packed_weight` needs to know its packed copy is current.
        with torch.inference_mode(False):
            if s.lora is None:
                return self.base(s.resolved, self.sampler_dtype)  # None: as loaded
            return self._build_sampling_model(s, s.lora)

    def _build_sampling_model(self, s: Sampler, spec: LoraSpec) -> Transformer:
        # Merge on the base as loaded (as the trainer would), then cast; only the fallback
        # runs on a base already in the sampler dtype.
        adapted = self._adapted(s.resolved, spec)
        load_lora_state_dict(adapted, self._sampler_adapters(s.sampler_id))
        adapted.requires_grad_(False)
        dtype = self.sampler_dtype or adapted.dtype
        size = _merged_bytes(adapted, dtype)
        budget = self._merged_budget_for(size)
        reuse = self._trim_merged(budget - size if size <= budget else budget, adapted, dtype)
        room = size - _nbytes(reuse or {})  # an evicted copy's own weights are written again
        if reuse is not None and size <= budget and not self._room_after_eviction(room):
            budget = 0  # an evicted copy still decodes somewhere: its memory is not back yet
        if size > budget:
            del reuse  # not written into: freed, and handed back to the OS
            return_freed_memory()
            if dtype != adapted.dtype:
                adapted = self._adapted(s.resolved, spec, dtype)
                load_lora_state_dict(adapted, self._sampler_adapters(s.sampler_id))
                adapted.requires_grad_(False)
            self._unmerged[s.sampler_id] = (adapted, _nbytes(lora_state_dict(adapted)))
            while len(self._unmerged) > UNMERGED_KEPT:
                self._unmerged.popitem(last=False)
            return adapted
        merged = clone_for_sampling(adapted, dtype=dtype, reuse=reuse)
        self._merged[s.sampler_id] = (merged, size)
        return merged

    def _merged_held(self) -> int:
        """Bytes of the merged copies held."""
        return sum(b for _, b in self._merged.values())

    def _trim_merged(
        self, keep_bytes: int, like: Transformer, dtype: torch.dtype
    ) -> dict[str, torch.Tensor] | None:
        """Evict the least recently used merged copies until at most ``keep_bytes`` remain.
        None if none went, else those copies' own weights that nothing else uses and that a
        copy of ``like`` in ``dtype`` can be written into (`reclaim_weights`), by name."""
        if self._merged_held() <= keep_bytes:
            return None
        evicted = []
        while self._merged and self._merged_held() > keep_bytes:
            evicted.append(self._merged.popitem(last=False)[1][0])
        reuse = reclaim_weights(evicted, dict(like.named_parameters(remove_duplicate=False)), dtype)
        return_freed_memory()
        return reuse

    def _room_after_eviction(self, size: int) -> bool:
        """After evicting for a copy of ``size`` bytes on the memory-derived budget: is the
        room really there? `_merged_budget_for` counted the evicted copies as freed, but one
        a decode still holds (or whose packed weights were never built) frees less."""
        if self.merged_budget is not None:
            return True
        room = free_memory(self.device)
        headroom = _merged_headroom(size)
        if room is None or room - headroom >= size:
            return True
        self._note_low_memory(size, room, headroom)
        return False

    def _merged_budget_for(self, size: int) -> int:
        """The merged cache's budget when adding a copy of ``size`` bytes: the configured one,
        else `MERGED_DEFAULT_COPIES` copies, fewer where the device's free memory (counting
        the copies held, which eviction frees) would keep less than the headroom after it."""
        if self.merged_budget is not None:
            return self.merged_budget
        budget = MERGED_DEFAULT_COPIES * size
        room = free_memory(self.device)
        if room is None:
            return budget
        held = self._merged_held()
        headroom = _merged_headroom(size)
        allowed = max(0, held + room - headroom)
        if allowed < size:
            self._note_low_memory(size, room, headroom)
        return min(budget, allowed)

    def _note_low_memory(self, size: int, room: int, headroom: int) -> None:
        """A sampler built on its adapters for want of memory: counted, and said once."""
        self._low_memory_fallbacks += 1
        if not self._low_memory_noted:
            self._low_memory_noted = True
            log.warning(
                "low memory: samplers decode through their LoRA adapters (slower) instead of "
                "merged weights. A merged copy takes %d MiB; with %d MiB free on %s it would "
                "leave less than %d MiB. Free memory, or set %s (MiB) to fix the budget.",
                size >> 20, room >> 20, self.device, headroom >> 20, MERGED_BUDGET_ENV,
            )  # fmt: skip

    def _sampler_adapters(self, sampler_id: str) -> dict[str, torch.Tensor]:
        adapters = self._adapters.get(sampler_id)
        if adapters is not None:
            self._adapters.move_to_end(sampler_id)
            return adapters
        path = self._spilled.pop(sampler_id)
        adapters = load_file(path)
        path.unlink(missing_ok=True)
        self._adapters[sampler_id] = adapters
        self._spill_adapters_over_budget(keep=sampler_id)
        return adapters

    def _new_spill_dir(self) -> SpillDir:
        """A temp dir removed when the registry is collected or the interpreter exits, so a
        process that never calls `close` (a script leaving its ServiceClient) leaves no files;
        a killed process's is removed by the next one's (`engine.spill`)."""
        spill = SpillDir()
        weakref.finalize(self, spill.close)
        return spill

    def _spill_adapters_over_budget(self, keep: str | None = None) -> None:
        """Write the least recently used sampler adapters to files until the rest fit."""
        total = sum(_nbytes(a) for a in self._adapters.values())
        for sampler_id in list(self._adapters):
            if total <= self.adapter_budget:
                break
            if sampler_id == keep:
                continue
            if self._spill_dir is None:  # before the pop: a failure here loses nothing
                self._spill_dir = self._new_spill_dir()
            adapters = self._adapters.pop(sampler_id)
            path = Path(self._spill_dir.path) / f"{next(self._spill_names)}.st"
            try:
                save_file({k: v.contiguous() for k, v in adapters.items()}, str(path))
            except Exception as e:  # full disk (OSError, SafetensorError): kept, over budget
                self._adapters[sampler_id] = adapters
                self._adapters.move_to_end(sampler_id, last=False)
                if not path.is_dir():
                    path.unlink(missing_ok=True)
                log.warning("sampler adapters not spilled to %s (%s); kept in memory", path, e)
                return
            self._spilled[sampler_id] = path
            total -= _nbytes(adapters)

    @_locked
    def stats(self) -> dict[str, int]:
        """Counts and bytes held, for benchmarks and tests."""
        return {
            "bases": len(self._bases),
            "trainers": len(self._trainers),
            "samplers": len(self._samplers),
            "adapters_in_memory": len(self._adapters),
            "adapters_in_memory_bytes": sum(_nbytes(a) for a in self._adapters.values()),
            "adapters_spilled": len(self._spilled),
            "merged": len(self._merged),
            "merged_bytes": self._merged_held(),
            "unmerged": len(self._unmerged),
            "unmerged_bytes": sum(b for _, b in self._unmerged.values()),
            "unmerged_low_memory": self._low_memory_fallbacks,
        }


def _merged_headroom(size: int) -> int:
    """Free memory a merged copy of ``size`` bytes must leave (`MERGED_HEADROOM`)."""
    return max(MERGED_HEADROOM, size // 2)


def _merged_bytes(adapted: Transformer, dtype: torch.dtype) -> int:
    """Bytes a merged copy allocates: one full weight per adapted layer, or (in another dtype
    than the base's) every parameter; twice that where decode keeps a oneDNN-packed copy of
    each weight beside it (`gemm.packed_linear`: float32 on a CPU with oneDNN)."""
    size = torch.empty((), dtype=dtype).element_size()
    if dtype == adapted.dtype:
        total = sum(m.weight.numel() * size for m in adapted.modules() if isinstance(m, LoraLinear))
    else:
        total = sum(p.numel() * size for p in {id(p): p for p in adapted.parameters()}.values())
    packs = dtype == torch.float32 and adapted.device.type == "cpu" and gemm.onednn_fp32()
    return 2 * total if packs else total
