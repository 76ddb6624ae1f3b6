"""Module trees whose every parameter is assigned after construction, built without torch's
default initialisation.

``nn.Linear`` and ``nn.Embedding`` initialise their weights as they are built (kaiming /
normal draws). Where the engine overwrites every parameter afterwards (a checkpoint's tensors,
a sampler's merged weights, a shared frozen base, a LoRA adapter's own seeded draws) those
draws are wasted twice over: on the meta device each is a decomposed ``uniform_`` of ~60 us
(a 128-expert mixture of experts has ~20,000 Linears: seconds per model skeleton), and on a
real device they draw from torch's *global* generator, moving the random stream of the
user's own script (``torch.manual_seed(0)`` then a LoRA training client gave other numbers
than the official SDK, which builds nothing locally).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# What nn's layers call from their reset_parameters(); each takes the tensor first.
_INITS: frozenset[Callable[..., Any]] = frozenset(
    {
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        nn.init.uniform_,
        nn.init.normal_,
        nn.init.trunc_normal_,
    }
)


class _SkipInit(TorchFunctionMode):
    """Returns the tensor of an ``nn.init`` call untouched. Torch function modes are
    per-thread: other threads' modules initialise as usual."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _INITS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextmanager
def without_init() -> Iterator[None]:
    """Build modules whose parameters the caller assigns next: ``nn.init`` draws are skipped
    (the weights hold whatever their memory held), and torch's global generator is left as
    it was."""
    with _SkipInit():
        yield


@contextmanager
def on_meta() -> Iterator[None]:
    """``torch.device("meta")`` without the init draws: a model's shapes, for parameters
    assigned next (`without_init`)."""
    with torch.device("meta"), _SkipInit():
        yield
