"""Room for a new training client, checked when it is made.

A base model's weights are checked against free memory when they load (`hf`); each training
client then adds its LoRA adapters, and in its first steps their gradients and Adam's two
moments (three more copies). Unchecked, one caller could make trainers until the process was
killed out of memory mid-step, taking every session's unsaved weights with it (a server: all
its users'). Now the trainer that would not fit is refused, saying what it needs."""

from __future__ import annotations

import os

from torch import nn

from tinker_sr.engine.cpu import return_freed_memory
from tinker_sr.engine.device import free_memory
from tinker_sr.engine.hf import MEMORY_CHECK_ENV
from tinker_sr.engine.lora import trainable_parameters
from tinker_sr.engine.optim import Adam
from tinker_sr.user_errors import EngineUserError

# Free memory a new trainer must leave beyond its own state: as much again (its steps'
# activations and their gradients need room too), and at least this.
TRAINER_HEADROOM = 64 << 20


def trainer_headroom(need: int) -> int:
    return max(TRAINER_HEADROOM, need)


def trainer_optimizer(model: nn.Module, what: str) -> Adam:
    """The optimizer of a new trainer ``model`` (its adapters already allocated), once the
    device has room for their gradients and optimizer state, and `trainer_headroom` more.
    ``what`` names the trainer in the error (base model and rank)."""
    params = trainable_parameters(model)
    need = 3 * sum(p.numel() * p.element_size() for _, p in params)
    device = params[0][1].device if params else None
    if device is not None and os.environ.get(MEMORY_CHECK_ENV, "").strip() != "0":
        room = free_memory(device)
        if room is not None and need + trainer_headroom(need) > room and device.type == "cpu":
            return_freed_memory()  # what the allocator keeps (a dropped trainer's) counts too
            room = free_memory(device)
        if room is not None and need + trainer_headroom(need) > room:
            raise EngineUserError(
                f"create_model: {what} needs {need >> 20} MiB more for its adapters' gradients "
                f"and optimizer state, and {room >> 20} MiB of memory is free, short of that "
                f"plus {trainer_headroom(need) >> 20} MiB for its steps. Use a lower rank, or "
                "finish sessions (and drop training clients) no longer in use to free their "
                f"adapters; {MEMORY_CHECK_ENV}=0 skips this check"
            )
    return Adam(params)
