"""LoRA adapters: y = W x + (alpha / rank) · B A x, with W frozen, A random, B zero at init.

A wrapped layer keeps its base parameters under the original names (`...q_proj.weight`), so
base checkpoints still load by name; the adapter adds `...q_proj.lora_A.weight` [rank, in] and
`...q_proj.lora_B.weight` [out, rank] (PEFT's layout).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinker_sr.engine.fused import fits, frozen_linear, merged_weight
from tinker_sr.engine.model import Transformer, _stable_seed, rope_inv_freq
from tinker_sr.engine.skeleton import on_meta, without_init
from tinker_sr.user_errors import EngineUserError, check_same_names

# F.linear's signature: (x, weight, bias) -> x @ weight.T + bias.
LinearFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Qwen3.5's linear-attention projections with an adapter under train_attn: q, k, v (split
# from the checkpoint's in_proj_qkv, as Tinker's adapters are), the gate's z, and out_proj;
# not the per-head scalars' projections (in_proj_a, in_proj_b: one output per head).
LINEAR_ATTN = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "out_proj")


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int | None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: float = 32.0
    # Tinker's "shared-outer" scheme for a mixture of experts' adapters: the factor on the
    # model's hidden side is one per layer and projection, shared by the routed experts
    # (gate's and up's A [r, D], down's B [D, r]); the other factor is each expert's own.
    # Checkpoints written before it (no such field) have every expert's own pair: False.
    moe_shared_outer: bool = False


class LoraLinear(nn.Linear):
    """An nn.Linear (same weight/bias Parameters as the layer it replaces) plus an adapter."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.scaling = alpha / rank
        device = base.weight.device  # the adapter lives with its base (CPU or GPU)
        with without_init():  # both are written below, A from ``generator``
            self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device)
            self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device)
        with torch.no_grad():
            # PEFT's default: kaiming_uniform(a=sqrt(5)) on A, i.e. U(-1/sqrt(in), 1/sqrt(in)),
            # drawn from a CPU generator on every device (copy_ moves it).
            bound = 1.0 / math.sqrt(self.in_features)
            a = torch.rand(rank, self.in_features, generator=generator, dtype=torch.float32)
            self.lora_A.weight.copy_(a * (2 * bound) - bound)
            self.lora_B.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_with(x, frozen_linear)

    def forward_with(self, x: Tensor, linear: LinearFn) -> Tensor:
        """The layer's output with every product (base and adapter) computed by ``linear``
        (``F.linear``'s signature): decode passes its packed-weight GEMM. The adapter is
        float32 whatever the base dtype (bf16/fp16 checkpoints): its small updates would
        round away in 16 bits, and fp16 gradients overflow."""
        a, b = self.lora_A.weight, self.lora_B.weight
        if linear is frozen_linear and x.dtype != a.dtype and _tracks(x, a, b):
            delta = _WideAdapter.apply(x, a, b, self.scaling)
        else:
            delta = linear(linear(x.to(a.dtype), a, None), b, None) * self.scaling
        return linear(x, self.weight, self.bias) + delta.to(x.dtype)

    def merged_weight(self, reuse: Tensor | None = None) -> Tensor:
        """W + s B A in W's dtype (`fused.merged_weight`: what training's merged groups use),
        written into ``reuse`` where it fits."""
        a, b = self.lora_A.weight, self.lora_B.weight
        return merged_weight([self.weight], [a], [b], self.scaling, reuse=reuse)


def _tracks(x: Tensor, a: Tensor, b: Tensor) -> bool:
    """A graph is recorded through the adapter, outside autocast (which casts on its own)."""
    tracked = x.requires_grad or a.requires_grad or b.requires_grad
    return torch.is_grad_enabled() and tracked and not torch.is_autocast_enabled(x.device.type)


class _WideAdapter(torch.autograd.Function):
    """``s (x A^T) B^T`` in float32 for activations ``x`` of a lower precision (a bf16/fp16
    base) and float32 adapters: the same float32 products as the plain form, but backward keeps
    x in its own dtype and widens it again there. The plain form kept a float32 copy of x per
    adapter (q, k and v each one of the same x): a bf16 Qwen3-0.6B-shaped step's forward held
    1076 MiB with those copies, 794 MiB without (docs/performance.md, "Memory limits").

    The scaling s goes on the rank-r side ([M, r] products) rather than a pass over the [M, N]
    output and its gradient: the same bits where s is a power of two (alpha / rank with the
    default alpha and a power-of-two rank), float32 rounding apart otherwise."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor, b: Tensor, s: float) -> Tensor:  # type: ignore[override]
        xa = F.linear(x.to(a.dtype), a)
        ctx.save_for_backward(x, a, b, xa)
        ctx.s = s
        return F.linear(xa * s, b)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, a, b, xa = ctx.saved_tensors
        gy = g.reshape(-1, g.shape[-1])
        dxa = gy.mm(b).mul_(ctx.s)  # s g B, [M, r]
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        db = gy.t().mm(xa.reshape(-1, xa.shape[-1]) * ctx.s) if need_b else None
        da = dxa.t().mm(x.reshape(-1, x.shape[-1]).to(a.dtype)) if need_a else None
        dx = dxa.mm(a).view(x.shape).to(x.dtype) if need_x else None
        return dx, da, db, None


def _targets(model: Transformer, spec: LoraSpec) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of every Linear the spec selects, in a fixed order."""
    out: list[tuple[nn.Module, str]] = []
    for i in range(model.config.n_layers):
        if spec.train_attn and model.config.is_linear(i):  # Qwen3.5: as Tinker names them
            mixer = model.get_submodule(f"model.layers.{i}.linear_attn")
            out += [(mixer, n) for n in LINEAR_ATTN]
        elif spec.train_attn:
            out += [(model.get_submodule(f"model.layers.{i}.self_attn"), n) for n in ATTN]
        if spec.train_mlp:  # a mixture of experts: each expert's projections (not the router)
            mlp = model.get_submodule(f"model.layers.{i}.mlp")
            experts = getattr(mlp, "experts", None)
            owners = [mlp] if experts is None else list(experts)
            if hasattr(mlp, "shared_expert"):  # Qwen3.5-MoE (its sigmoid gate: no adapter)
                owners.append(mlp.shared_expert)
            for owner in owners:
                out += [(owner, n) for n in MLP]
    if spec.train_unembed:
        out.append((model, "lm_head"))
    return out


def apply_lora(model: Transformer, spec: LoraSpec) -> None:
    """Freeze every base parameter and wrap the selected Linears with LoRA adapters, in place.

    A is drawn from a dedicated generator seeded by spec.seed (None: from OS entropy, so not
    reproducible), B is zero, so the wrapped model's outputs equal the base model's.
    """
    if not isinstance(spec.rank, int) or spec.rank < 1:
        raise EngineUserError(f"lora rank: expected an integer >= 1, got {spec.rank!r}")
    if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
        raise EngineUserError(
            "lora: train_attn, train_mlp and train_unembed are all False; enable at least one"
        )
    if not (math.isfinite(spec.alpha) and spec.alpha > 0):
        raise EngineUserError(f"lora alpha: expected a finite number > 0, got {spec.alpha}")
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise EngineUserError("lora: this model already has adapters")
    gen = torch.Generator()
    if spec.seed is None:
        gen.seed()
    else:
        gen.manual_seed(_stable_seed("tinker_sr.lora", spec.seed))
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, attr in _targets(model, spec):
        base = getattr(parent, attr)
        setattr(parent, attr, LoraLinear(base, spec.rank, spec.alpha, gen))
    if spec.moe_shared_outer and spec.train_mlp:
        _share_outer_factors(model)


def _share_outer_factors(model: Transformer) -> None:
    """Every routed expert of a layer uses its first expert's hidden-side factor (gate's and
    up's ``lora_A``, down's ``lora_B``): one module, so one Parameter, whose gradient sums
    over the experts (`LoraSpec.moe_shared_outer`). The shared expert of Qwen3.5-MoE is a
    plain MLP and keeps its own adapters."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        first = experts[0]
        for expert in list(experts)[1:]:
            for proj, factor in (
                ("gate_proj", "lora_A"),
                ("up_proj", "lora_A"),
                ("down_proj", "lora_B"),
            ):
                setattr(getattr(expert, proj), factor, getattr(getattr(first, proj), factor))


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters with requires_grad, in module-registration order (stable across processes)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Detached copies of the adapter tensors only, e.g.
    `model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if _is_adapter(n)}


def load_lora_state_dict(model: nn.Module, sd: dict[str, Tensor]) -> None:
    """Copy adapter values in; names and shapes must match this model's adapters exactly."""
    own = check_lora_state_dict(model, sd)
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(sd[n])


def check_lora_state_dict(model: nn.Module, sd: Mapping[str, Tensor]) -> dict[str, nn.Parameter]:
    """`model`'s adapter parameters by name, after checking that `sd` has exactly their names
    and shapes (`EngineUserError` naming the first that differs). `model` may be on the meta
    device: only shapes are read."""
    own = {n: p for n, p in model.named_parameters() if _is_adapter(n)}
    check_same_names(
        own,
        sd,
        mismatch="LoRA weights do not match this model",
        fix="load a checkpoint saved from a model with the same base model and LoRA config "
        "(rank, train_* flags)",
    )
    for n, p in own.items():
        if tuple(sd[n].shape) != tuple(p.shape):
            raise EngineUserError(
                f"LoRA weight {n}: checkpoint shape {tuple(sd[n].shape)} != model shape "
                f"{tuple(p.shape)}; the LoRA rank or base model differs"
            )
    return own


def clone_for_sampling(
    model: Transformer,
    *,
    dtype: torch.dtype = torch.float32,
    reuse: Mapping[str, Tensor] | None = None,
) -> Transformer:
    """An independent, adapter-free inference copy holding the current weights in `dtype`.

    LoRA layers are merged (W + scaling · B A) into fresh tensors. Frozen base tensors are
    shared with `model` when `dtype` matches (they never change); trainable ones are copied,
    so later optimizer steps on `model` cannot reach the clone. A tied embedding whose
    lm_head has an adapter is untied in the clone (the adapter only acts on the output).

    ``reuse`` maps parameter names to tensors nothing else reads any more (an evicted copy's
    own weights, `registry`): a merged or converted weight is written into its name's tensor
    where that fits (`fused.fits`) instead of new memory, sparing the first touch of every
    page of a new allocation (a Qwen3-0.6B-shaped bf16 copy: ~1.2 GB, ~300K page faults).
    """
    reuse = reuse or {}
    config = model.config
    lm_head_adapted = isinstance(model.lm_head, LoraLinear)
    if config.tie_embeddings and lm_head_adapted:
        config = dataclasses.replace(config, tie_embeddings=False)
    with on_meta():  # every parameter is assigned below; nothing to allocate now
        clone = Transformer(config)
    clone.inv_freq = rope_inv_freq(config)
    src: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, LoraLinear):
                key = f"{name}.weight"
                src[key] = mod.merged_weight(reuse.get(key) if mod.weight.dtype == dtype else None)
        for name, p in model.named_parameters(remove_duplicate=False):
            if not _is_adapter(name):
                src.setdefault(name, p if not p.requires_grad else p.detach().clone())
        for name in [n for n, _ in clone.named_parameters()]:  # a tied lm_head is re-tied below
            t = src[name].detach()
            if t.dtype != dtype:
                into = reuse.get(name)
                t = into.copy_(t) if fits(into, tuple(t.shape), dtype, t.device) else t.to(dtype)
            # Parameter(t) aliases t's storage: frozen base weights are shared, not copied.
            _set_param(clone, name, nn.Parameter(t, requires_grad=False))
        if config.tie_embeddings:
            clone.lm_head.weight = clone.model.embed_tokens.weight
    clone.eval()
    return clone


def reclaim_weights(
    copies: list[Transformer], like: Mapping[str, Tensor], dtype: torch.dtype
) -> dict[str, Tensor]:
    """The weights of sampling copies just dropped (``copies``, their only holder, is emptied)
    that nothing else uses and that fit the parameter of their name in ``like`` in ``dtype``:
    an alias of each, by name, for `clone_for_sampling`'s ``reuse``. A weight shared with a
    base, or still read by anyone (a decode holds its copy, so every weight of it; a view or
    alias of one), is left alone: its Python object, its tensor and its storage must each have
    no other user. Whatever is not returned is freed here as usual."""
    named = [(n, p) for m in copies for n, p in m.named_parameters()]
    copies.clear()
    out: dict[str, Tensor] = {}
    while named:
        name, p = named.pop()
        target = like.get(name)
        if (
            name not in out
            and target is not None
            and fits(p, tuple(target.shape), dtype, target.device)
            and _sole_user(p)
        ):
            out[name] = p.detach()
        del p
    return out


def _sole_user(p: Tensor) -> bool:
    """Nothing but the caller's one reference uses ``p`` (its Python object, its TensorImpl and
    its storage); False where torch cannot say."""
    try:
        storage_users = torch._C._storage_Use_Count(p.untyped_storage()._cdata) - 1
        tensor_users = p._use_count()  # type: ignore[attr-defined]
        return sys.getrefcount(p) == 3 and tensor_users == 1 and storage_users == 1
    except (AttributeError, RuntimeError):
        return False


def share_frozen(model: Transformer) -> Transformer:
    """A new module tree over the very same parameter tensors as ``model`` (no copy).

    For a frozen base: every trainer and sampler of one base model wraps its own LoRA
    adapters around one shared set of base weights instead of a deep copy each.
    """
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("share_frozen: the model must be frozen (requires_grad False)")
    with on_meta():
        view = Transformer(model.config)
    view.inv_freq = model.inv_freq
    for name, p in model.named_parameters():
        _set_param(view, name, p)
    if model.config.tie_embeddings:
        view.lm_head.weight = view.model.embed_tokens.weight
    return view.train(model.training)


def _set_param(root: nn.Module, dotted: str, value: nn.Parameter) -> None:
    parent, _, attr = dotted.rpartition(".")
    setattr(root.get_submodule(parent), attr, value)
