"""The models the engine holds in memory: name aliases, the frozen base-model cache, and the
live trainers (LoRA model + optimizer) and samplers, each keyed by its id.

Every entry goes in through a ``register_*`` method and out through the matching
``release_*`` method, so what a session, client or TTL owned can be dropped in one place (the
hook for eviction under a memory budget). The registry is in-memory only; persistence (runs,
checkpoints, recorded sequences) lives in `Store` and `CheckpointStore`.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinker_sr.engine.errors import EngineNotFoundError, EngineUserError
from tinker_sr.engine.hf import load_model_dir, not_found_hint, resolve_model_dir
from tinker_sr.engine.hf_tokenizer import ByteModelTokenizer, ModelTokenizer
from tinker_sr.engine.lora import (
    LoraSpec,
    apply_lora,
    clone_for_sampling,
    load_lora_state_dict,
    lora_state_dict,
    trainable_parameters,
)
from tinker_sr.engine.model import BUILTIN_CONFIGS, Transformer, build_model
from tinker_sr.engine.optim import Adam


def parse_aliases(spec: str | None) -> dict[str, str]:
    """``"Qwen/Qwen3-8B=tinker-sr/tiny,*=tinker-sr/tiny"`` → dict (``*`` aliases every name)."""
    out: dict[str, str] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"TINKER_SR_MODEL_ALIASES entry {part!r} must look like 'name=target'")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


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


@dataclass
class Sampler:
    sampler_id: str
    session_id: str
    base_model: str
    model: Transformer
    model_path: str | None


class ModelRegistry:
    """Aliases, base models, trainers and samplers of one engine."""

    def __init__(
        self,
        aliases: Mapping[str, str],
        *,
        sampler_dtype: torch.dtype | None = None,
        model_dtype: torch.dtype | None = None,
    ) -> None:
        self.aliases = dict(aliases)
        # None: samplers keep the base model's dtype; HF directories load in their
        # checkpoint's dtype unless model_dtype is set (built-ins are float32).
        self.sampler_dtype = sampler_dtype
        self.model_dtype = model_dtype
        self._bases: dict[str, Transformer] = {}
        self._tokenizers: dict[str, ModelTokenizer | ByteModelTokenizer] = {}
        self._trainers: dict[str, Trainer] = {}
        self._samplers: dict[str, Sampler] = {}

    # ---- base models ------------------------------------------------------------------
    def available_models(self) -> list[str]:
        return sorted(BUILTIN_CONFIGS) + sorted(k for k in self.aliases if k != "*")

    def resolve_model(self, name: str) -> str:
        """Map a requested base model name to a built-in name or a local directory (a path, or
        a Hub name found in the local Hugging Face cache; see `tinker_sr.engine.hf`)."""
        if name in BUILTIN_CONFIGS:
            return name
        target = self.aliases.get(name) or self.aliases.get("*") or name
        if target in BUILTIN_CONFIGS:
            return target
        found = resolve_model_dir(target)
        if found is not None:
            return str(found)
        raise EngineUserError(
            f"base_model {name!r} is not available. Available: {', '.join(self.available_models())}."
            f" Looked for {target!r}: {not_found_hint(target)}. To use another name, alias it: "
            f"TINKER_SR_MODEL_ALIASES='{name}=tinker-sr/tiny' or to a local Hugging Face "
            "directory with config.json and *.safetensors."
        )

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

    def base(self, resolved: str) -> Transformer:
        """The frozen base model of ``resolved``, loaded once and shared."""
        m = self._bases.get(resolved)
        if m is None:
            m = (
                build_model(resolved, seed=0, dtype=self.model_dtype or torch.float32)
                if resolved in BUILTIN_CONFIGS
                else load_model_dir(resolved, dtype=self.model_dtype)
            )
            m.requires_grad_(False)
            m.eval()
            self._bases[resolved] = m
        return m

    def new_trainable(self, resolved: str, spec: LoraSpec) -> tuple[Transformer, Adam]:
        """A fresh copy of the base with LoRA adapters, and an optimizer over them."""
        model = copy.deepcopy(self.base(resolved))
        apply_lora(model, spec)
        return model, Adam(trainable_parameters(model))

    # ---- trainers ---------------------------------------------------------------------
    def trainer(self, model_id: str) -> Trainer:
        t = self._trainers.get(model_id)
        if t is None:
            raise EngineNotFoundError(
                f"unknown model_id {model_id!r}; create a training client first"
            )
        return t

    def has_trainer(self, model_id: str) -> bool:
        return model_id in self._trainers

    def register_trainer(self, trainer: Trainer) -> None:
        self._trainers[trainer.model_id] = trainer

    def release_trainer(self, model_id: str) -> Trainer | None:
        """Forget ``model_id`` (its weights and optimizer state); ``None`` if unknown."""
        return self._trainers.pop(model_id, None)

    # ---- samplers ---------------------------------------------------------------------
    def sampler(self, sampler_id: str) -> Sampler:
        s = self._samplers.get(sampler_id)
        if s is None:
            raise EngineNotFoundError(
                f"unknown sampling session {sampler_id!r}; create a sampling client first"
            )
        return s

    def new_sampler_id(self, session_id: str, seq: int) -> str:
        sampler_id = f"{session_id}:sample:{seq}"
        if sampler_id in self._samplers:
            raise EngineUserError(
                f"sampling_session_seq_id {seq} is already used in session {session_id}"
            )
        return sampler_id

    def register_sampler(self, sampler: Sampler) -> None:
        self._samplers[sampler.sampler_id] = sampler

    def release_sampler(self, sampler_id: str) -> Sampler | None:
        """Forget ``sampler_id`` (its sampling weights); ``None`` if unknown."""
        return self._samplers.pop(sampler_id, None)

    # ---- sampling weights -------------------------------------------------------------
    def sampling_copy(self, model: Transformer, adapters: dict[str, torch.Tensor]) -> Transformer:
        """A sampling model of ``model`` with ``adapters`` in place of its current ones."""
        current = snapshot(model)
        load_lora_state_dict(model, adapters)
        try:
            return clone_for_sampling(model, dtype=self.sampler_dtype or model.dtype)
        finally:
            load_lora_state_dict(model, current)

    def sampling_base(self, name: str) -> Transformer:
        """A sampling model of the plain base model ``name``."""
        base = self.base(self.resolve_model(name))
        return clone_for_sampling(base, dtype=self.sampler_dtype or base.dtype)

    def sampling_adapted(
        self, name: str, spec: LoraSpec, adapters: Mapping[str, torch.Tensor]
    ) -> Transformer:
        """A sampling model of base ``name`` with LoRA ``adapters`` (from a checkpoint)."""
        model, _ = self.new_trainable(self.resolve_model(name), spec)
        load_lora_state_dict(model, dict(adapters))
        return clone_for_sampling(model, dtype=self.sampler_dtype or model.dtype)
