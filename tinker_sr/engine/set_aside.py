"""LoRA sampling clients made from a saved checkpoint, set aside when their session keeps too
many (`env_settings.SAMPLERS_PER_SESSION`) and loaded again from it on their next use.

A session keeps the adapters of its most recently used LoRA samplers only, or an RL loop that
makes a sampler every step would fill memory. Before, a client it had let go (a self-play
league's old opponent, made with ``create_sampling_client(model_path=...)``) failed on its
next use, where the hosted service's client keeps working. Such a client's weights are still
in its checkpoint, so only its name, base model and path are kept (a few hundred bytes), and
its next use reads them again: refused, naming why, if the checkpoint was deleted, expired or
written again since, or its base model's directory saved again (`dir_stamps`). Samplers with
no checkpoint of their own (``save_weights_and_get_sampling_client``) are not kept: their
weights are gone."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tinker_sr.engine.dir_stamps import Stamp, dir_stamp
from tinker_sr.engine.env_settings import SAMPLERS_PER_SESSION_ENV
from tinker_sr.engine.lora import LoraSpec
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError

if TYPE_CHECKING:  # they import the registry, which imports this module
    from tinker_sr.engine.checkpoint_store import CheckpointStore
    from tinker_sr.engine.registry import ModelRegistry, Sampler

__all__ = ["SetAside", "Source", "checkpoint_sampler", "unknown_sampler"]

FileStamp = tuple[int, int]  # a checkpoint file's size and modification time (ns)
# A checkpoint sampler's sources as it was made: its checkpoint file's `FileStamp`, and its
# base model directory's files (`dir_stamps`; None for a built-in).
Source = tuple[FileStamp, Stamp | None]

KEPT = 65_536  # set-aside samplers kept in all (oldest forgotten first): ~20 MB at most


def checkpoint_sampler(
    checkpoints: CheckpointStore,
    model_path: str,
    base_model: str | None,
    resolve: Callable[[str], str],
) -> tuple[str, LoraSpec | None, dict[str, torch.Tensor], FileStamp]:
    """What a sampler of checkpoint ``model_path`` runs: its base model's name, its LoRA spec
    and adapters; and the checkpoint file's `FileStamp` (its base's stamp: `Source`)."""
    from tinker_sr.engine import training
    from tinker_sr.engine.checkpoint_store import parse_path
    from tinker_sr.engine.checkpoints import read_record

    parsed = parse_path(model_path)
    tensors, meta = checkpoints.load(model_path, expect=parsed.checkpoint_type)
    record = read_record(meta, tensors, model_path)
    name = record.base_for(base_model, resolve, model_path)
    st = checkpoints.path_of(checkpoints.live(model_path)).stat()
    return name, record.lora, training.strip(tensors, "lora."), (st.st_size, st.st_mtime_ns)


def unknown_sampler(sampler_id: str, lora_kept: int, base_kept: int) -> EngineNotFoundError:
    """The error for a sampler id that is neither live nor set aside."""
    return EngineNotFoundError(
        f"unknown sampling session {sampler_id!r}; create a sampling client first (a session "
        f"keeps the weights of its {lora_kept} most recently used LoRA sampling clients, "
        f"${SAMPLERS_PER_SESSION_ENV} raises the number, and of its {base_kept} most recently "
        "used base-model ones)"
    )


class SetAside:
    """The set-aside samplers of one `ModelRegistry`; ``checkpoints`` (the engine's) reads
    them again (none: nothing is kept)."""

    def __init__(self, registry_lock: threading.RLock) -> None:
        self.checkpoints: CheckpointStore | None = None
        self._kept: OrderedDict[str, Sampler] = OrderedDict()
        self._lock = registry_lock  # held to change `_kept` and to make a sampler live
        self._reading: dict[str, threading.Event] = {}  # a bring-back under way, by id

    def bring_back(self, registry: ModelRegistry, sampler_id: str) -> None:
        """Load ``sampler_id`` again if it is set aside: its checkpoint read outside the
        registry's lock (other samplers decode meanwhile), once however many requests want
        it at the same time (the others wait for that read), then made live under it."""
        with self._lock:
            reading = self._reading.get(sampler_id)
            if reading is None:
                self._reading[sampler_id] = mine = threading.Event()
        if reading is not None:
            reading.wait()
            return
        try:
            found = self.read_back(registry, sampler_id)
            if found is not None:
                with self._lock:
                    self.install(registry, *found)
        finally:
            with self._lock:
                del self._reading[sampler_id]
            mine.set()

    def keep(self, s: Sampler) -> None:
        """``s`` leaves memory; kept where its checkpoint can bring it back."""
        if s.model_path and s.lora and s.source and self.checkpoints is not None:
            self._kept[s.sampler_id] = s
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)

    def forget(self, sampler_id: str | None = None, session_id: str | None = None) -> None:
        """Forget ``sampler_id``, or every sampler of ``session_id`` (released)."""
        for key in self.ids(session_id) if session_id is not None else ():
            del self._kept[key]
        self._kept.pop(sampler_id or "", None)

    def __contains__(self, sampler_id: str) -> bool:
        return sampler_id in self._kept

    def get(self, sampler_id: str) -> Sampler | None:
        """``sampler_id``'s record, where it is set aside (its context, its session)."""
        return self._kept.get(sampler_id)

    def ids(self, session_id: str) -> list[str]:
        return [k for k, s in self._kept.items() if s.session_id == session_id]

    def read_back(
        self, registry: ModelRegistry, sampler_id: str
    ) -> tuple[Sampler, dict[str, torch.Tensor]] | None:
        """``sampler_id`` as its checkpoint has it now, with its adapters, if it is set aside
        (None: it is not). Run outside the registry's lock: the read takes as long as the
        file, and decoding and training go on meanwhile. One that cannot come back stays set
        aside, and each use says why (`EngineNotFoundError`)."""
        s = self._kept.get(sampler_id)
        if s is None or self.checkpoints is None or s.model_path is None or s.source is None:
            return None  # (`keep` keeps only samplers with a checkpoint and a source)
        try:
            _, spec, adapters, stamp = checkpoint_sampler(
                self.checkpoints, s.model_path, s.base_model, registry.resolve_model
            )
            source = (stamp, dir_stamp(s.resolved))
            if source[0] != s.source[0]:
                raise EngineUserError(f"{s.model_path} was written again since")
            if source[1] != s.source[1]:
                raise EngineUserError(f"its base model's directory {s.resolved} changed since")
        except (EngineUserError, EngineNotFoundError, OSError) as e:
            raise EngineNotFoundError(
                f"sampling client {sampler_id!r} was let go (its session keeps its most recently "
                f"used LoRA sampling clients) and cannot be loaded again from its checkpoint: "
                f"{e}. Make a new one from a checkpoint that exists"
            ) from None
        again = type(s)(
            s.sampler_id, s.session_id, s.base_model, s.resolved, spec, s.model_path, source=source
        )
        return again, adapters

    def install(
        self, registry: ModelRegistry, again: Sampler, adapters: dict[str, torch.Tensor]
    ) -> None:
        """Make a sampler `read_back` gave live, under the registry's lock; nothing if it left
        the set-aside ones meanwhile (released, or brought back by another use)."""
        if again.sampler_id in self._kept:
            registry.register_sampler(again, adapters)  # live before it leaves the set-aside
            del self._kept[again.sampler_id]
