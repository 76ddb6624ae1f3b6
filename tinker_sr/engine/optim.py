"""AdamW over a fixed list of named parameters, step-for-step equal to torch.optim.AdamW.

Our own loop rather than torch.optim so that hyperparameters can change on every step (Tinker
sends AdamParams with each optim_step) and the state dict is flat, named and exact: a
restored optimizer continues bit-identically.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from tinker_sr.user_errors import EngineUserError, check_same_names


@dataclass
class AdamHParams:
    """Tinker's AdamParams; defaults are Tinker's (note weight_decay 0, eps 1e-12)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # > 0: clip the global L2 norm of all gradients to this

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise EngineUserError(
                    f"adam_params.{f.name}: expected a finite number >= 0, got {v!r}"
                )
        for name in ("beta1", "beta2"):
            if getattr(self, name) >= 1:
                raise EngineUserError(
                    f"adam_params.{name}: expected a value in [0, 1), got {getattr(self, name)}"
                )


def _check_finite_weights(ps: list[Tensor], lr: float) -> None:
    """Say so at once when an update made weights NaN or infinite (a learning_rate so large
    that a step overflows, which `_check_in_range`'s scalars cannot foresee): before, the step
    answered normally, and its checkpoints were later refused as "damaged on disk"."""
    # A sum per tensor: NaN or inf anywhere makes it non-finite, finite weights do not (short
    # of ~1e38); the fastest such pass on a CPU (a largest-|value| pass made every step 25-55 %
    # slower, review; a 2-norm overflows from ~1e19 on, where the forward still answers).
    if not math.isfinite(float(torch.stack([p.sum() for p in ps]).sum())):
        raise EngineUserError(
            f"optim_step: this update made the weights NaN or infinite (learning_rate {lr:g} is "
            "far too large): the model has diverged, and every later call on it fails. Start "
            "again from a checkpoint saved before it (ServiceClient."
            "create_training_client_from_state) with a smaller learning_rate"
        )


def _check_in_range(hp: AdamHParams, steps: set[int], dtype: torch.dtype) -> None:
    """Refuse hyperparameters whose per-step scalars the parameters' dtype cannot hold (the
    update would fail half-way, or divide 0 by an eps rounded to 0 and write NaN)."""
    info = torch.finfo(dtype)
    if hp.eps < info.tiny:
        raise EngineUserError(
            f"AdamParams.eps: {hp.eps:g} is below {dtype}'s smallest normal number "
            f"({info.tiny:.3g}) of the optimizer state, where it is lost or rounds to 0, which "
            "makes an update 0/0 = NaN; use a larger eps (Tinker's default is 1e-12)"
        )
    lr = hp.learning_rate
    scalars = {
        "1 - learning_rate * weight_decay": 1 - lr * hp.weight_decay,
        "the bias-corrected step learning_rate / (1 - beta1**step)": max(
            lr / (1 - hp.beta1**t) for t in steps
        ),
    }
    for what, v in scalars.items():
        if not abs(v) <= info.max:
            raise EngineUserError(
                f"optim_step: AdamParams make {what} = {v:.3g}, beyond what the {dtype} "
                f"weights can hold ({info.max:.3g}); lower learning_rate (or weight_decay). "
                "Nothing was changed: the weights, optimizer state and gradients are as before"
            )


class Adam:
    """Decoupled weight decay, bias correction, optional global grad-norm clipping.

    Per parameter with a gradient (as torch's single-tensor AdamW):
        p *= 1 - lr * wd
        m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g²
        p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    When no parameter has a gradient the step changes nothing. Otherwise a parameter without
    one (an expert no token was routed to) steps with a zero gradient, as the rows of a
    stacked expert tensor do in Tinker's layout: its moments decay, its momentum carries, it
    decays, and every step count stays the same.
    """

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]]) -> None:
        names = [n for n, _ in params]
        if len(set(names)) != len(names):
            raise ValueError("Adam: parameter names must be unique")
        self.params = list(params)
        self.steps = {n: 0 for n in names}
        self.exp_avg = {
            n: torch.zeros_like(p, memory_format=torch.preserve_format) for n, p in params
        }
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in params}

    def reset(self) -> None:
        """Forget every moment and step count, as a new optimizer (weights-only loads)."""
        for name, _ in self.params:
            self.exp_avg[name].zero_()
            self.exp_avg_sq[name].zero_()
            self.steps[name] = 0

    def zero_grad(self) -> None:
        for _, p in self.params:
            p.grad = None

    def grads(self) -> list[Tensor | None]:
        """A copy of the accumulated gradients, for `restore_grads` if a backward pass must be
        undone (it produced non-finite values)."""
        return [None if p.grad is None else p.grad.clone() for _, p in self.params]

    def restore_grads(self, grads: Sequence[Tensor | None]) -> None:
        for (_, p), g in zip(self.params, grads, strict=True):
            p.grad = g

    def grads_finite(self) -> bool:
        # Exactly what `step` accepts: a NaN or inf anywhere, or a norm past float's range,
        # makes the global norm non-finite (and one call per tensor is ~10x faster than a
        # largest-|value| pass, whose many small reductions each wake the other threads).
        return math.isfinite(self.grad_norm())

    def grad_norm(self) -> float:
        grads = [p.grad for _, p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))

    @torch.no_grad()
    def step(self, hp: AdamHParams, *, zero_grad: bool = True) -> dict[str, float]:
        """Apply one update from the accumulated gradients, then (by default) clear them.

        A non-finite gradient norm raises EngineUserError: the gradients are discarded (so the
        next forward_backward + optim_step work normally) and nothing else changes.
        """
        hp.validate()
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.zero_grad()
            raise EngineUserError(
                f"optim_step: the accumulated gradient is not finite (norm {norm}); it was "
                "discarded and the weights and optimizer state are unchanged. Check the loss "
                "inputs (advantages, logprobs, weights) of the forward_backward calls since the "
                "last step, then run them again"
            )
        clip = 1.0
        if hp.grad_clip_norm > 0:  # same arithmetic as torch.nn.utils.clip_grad_norm_
            clip = min(hp.grad_clip_norm / (norm + 1e-6), 1.0)
        lr, b1, b2 = hp.learning_rate, hp.beta1, hp.beta2
        live = self.params if any(p.grad is not None for _, p in self.params) else []
        if live:  # every scalar checked before any state changes: a refused step changes none
            _check_in_range(hp, {self.steps[n] + 1 for n, _ in live}, live[0][1].dtype)
            # The per-parameter arithmetic above, one call per op over all parameters (on the
            # CPU each runs the single-tensor op per parameter: the same bits, far fewer calls).
            ps: list[Tensor] = [p for _, p in live]
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in ps]
            if clip != 1.0:
                grads = list(torch._foreach_mul(grads, clip))
            ms = [self.exp_avg[n] for n, _ in live]
            vs = [self.exp_avg_sq[n] for n, _ in live]
            for n, _ in live:
                self.steps[n] += 1
            ts = [self.steps[n] for n, _ in live]
            if hp.weight_decay != 0:
                torch._foreach_mul_(ps, 1 - lr * hp.weight_decay)
            torch._foreach_lerp_(ms, grads, 1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
            same = len(set(ts)) == 1  # the usual case: one scalar (a list is wrapped per tensor)

            def per_step(f: Callable[[int], float]) -> float | list[float]:
                return f(ts[0]) if same else [f(t) for t in ts]

            denom = _sqrt_all(vs)
            torch._foreach_div_(denom, per_step(lambda t: (1 - b2**t) ** 0.5))
            torch._foreach_add_(denom, hp.eps)
            torch._foreach_addcdiv_(ps, ms, denom, per_step(lambda t: -(lr / (1 - b1**t))))
            _check_finite_weights(ps, lr)
        if zero_grad:
            self.zero_grad()
        return {"grad_norm:mean": norm, "learning_rate:mean": lr}

    def state_dict(self) -> dict[str, Tensor]:
        """Flat tensors: `{name}.exp_avg`, `{name}.exp_avg_sq`, `{name}.step` (int64 scalar)."""
        out: dict[str, Tensor] = {}
        for name, _ in self.params:
            out[f"{name}.exp_avg"] = self.exp_avg[name].clone()
            out[f"{name}.exp_avg_sq"] = self.exp_avg_sq[name].clone()
            out[f"{name}.step"] = torch.tensor(self.steps[name], dtype=torch.int64)
        return out

    def load_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Exact restore; names and shapes must match this optimizer's parameters."""
        want = self.state_dict()
        check_same_names(
            want,
            sd,
            mismatch="optimizer state does not match this model",
            fix="load state saved from a model with the same base model and LoRA config",
        )
        for k, v in sd.items():
            if tuple(v.shape) != tuple(want[k].shape):
                raise EngineUserError(
                    f"optimizer state {k}: shape {tuple(v.shape)} != expected {tuple(want[k].shape)}"
                )
        for name, _ in self.params:
            self.exp_avg[name].copy_(sd[f"{name}.exp_avg"])
            self.exp_avg_sq[name].copy_(sd[f"{name}.exp_avg_sq"])
            self.steps[name] = int(sd[f"{name}.step"])


def _sqrt_all(tensors: list[Tensor]) -> list[Tensor]:
    """``torch._foreach_sqrt(tensors)`` as one op over their concatenation (views of it
    returned). torch's float sqrt is correctly rounded (IEEE), so the bits are the same; but
    its vector-math kernel goes parallel from 4,096 elements, and one such region per small
    tensor of a LoRA adapter (each waking the other threads, ~40 us with passive waits) made
    this 5-7 ms of a ~10 ms step for ~100 tensors instead of ~0.5."""
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return list(torch._foreach_sqrt(tensors))
    flat = torch.cat([t.reshape(-1) for t in tensors]).sqrt_()
    parts = flat.split([t.numel() for t in tensors])
    return [part.view(t.shape) for part, t in zip(parts, tensors, strict=True)]
