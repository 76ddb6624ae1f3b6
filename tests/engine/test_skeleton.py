"""Model skeletons and adapters are built without torch's default init (`engine.skeleton`):
no ``nn.init`` draw on the meta device (seconds for a mixture of experts' ~20,000 Linears) and
none from torch's global generator on a real one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tinker_sr.engine.lora import LoraSpec, apply_lora, clone_for_sampling, share_frozen
from tinker_sr.engine.model import BUILTIN_CONFIGS, Transformer, build_model
from tinker_sr.engine.skeleton import on_meta, without_init

from .test_lora import TINY


class _CountInits(TorchFunctionMode):
    """Counts the ``nn.init`` calls that reach it (a mode inside it may stop them first)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        self.calls += getattr(func, "__module__", "") == "torch.nn.init"
        return func(*args, **(kwargs or {}))


def test_a_meta_skeleton_and_its_adapters_draw_nothing() -> None:
    config = BUILTIN_CONFIGS[TINY]
    with _CountInits() as plain:  # torch.device("meta") alone: every Linear draws
        with torch.device("meta"):
            apply_lora(Transformer(config), LoraSpec(rank=2, seed=0))
    assert plain.calls > 2 * config.n_layers
    with _CountInits() as counted, on_meta():
        model = Transformer(config)
        apply_lora(model, LoraSpec(rank=2, seed=0))
    assert counted.calls == 0
    assert all(p.is_meta for p in model.parameters())


def test_models_and_their_copies_leave_the_global_generator_alone() -> None:
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    model = build_model(TINY, seed=1)
    apply_lora(model, LoraSpec(rank=4, seed=3))
    clone_for_sampling(model)
    base = build_model(TINY, seed=1).requires_grad_(False)
    apply_lora(share_frozen(base), LoraSpec(rank=4, seed=3))
    assert torch.equal(torch.rand(4), want)


def test_adapters_keep_their_seeded_draws() -> None:
    """Skipping nn.Linear's init changes nothing the adapter holds: A from its own generator,
    B zero; the same seed gives the same A."""
    a = build_model(TINY, seed=1)
    b = build_model(TINY, seed=1)
    torch.manual_seed(0)
    apply_lora(a, LoraSpec(rank=4, seed=3))
    torch.manual_seed(1)  # another global stream: no effect on the adapters
    apply_lora(b, LoraSpec(rank=4, seed=3))
    adapters = {k: v for k, v in a.state_dict().items() if "lora_" in k}
    assert adapters and all(torch.equal(v, b.state_dict()[k]) for k, v in adapters.items())
    assert all(not v.any() for k, v in adapters.items() if "lora_B" in k)
    bound = 1.0 / BUILTIN_CONFIGS[TINY].dim ** 0.5
    q = a.model.layers[0].self_attn.q_proj.lora_A.weight
    assert q.abs().max() <= bound and q.std() > bound / 4


def test_other_threads_initialise_as_usual() -> None:
    """Torch function modes are per thread: a module built elsewhere meanwhile is drawn."""
    built: list[nn.Linear] = []
    entered, done = threading.Event(), threading.Event()

    def elsewhere() -> None:
        entered.wait()
        torch.manual_seed(5)
        built.append(nn.Linear(8, 8))
        done.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with without_init():
        entered.set()
        assert done.wait(60)
    thread.join()
    torch.manual_seed(5)
    assert torch.equal(built[0].weight, nn.Linear(8, 8).weight)
