"""Checks of a `forward_backward` request before any compute: the loss name, its config
(defaults filled in) and every datum's inputs, each failure an `EngineUserError` naming the
datum and key. Used by `engine.losses.compute_loss` and by `engine.training`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, get_args

import torch

from tinker_sr.types.training import LossFnType
from tinker_sr.user_errors import EngineUserError

if TYPE_CHECKING:
    from tinker_sr.engine.losses import LossDatum

# The built-in losses: every public LossFnType except "custom" (server-side custom losses).
LOSS_NAMES: tuple[str, ...] = tuple(n for n in get_args(LossFnType) if n != "custom")

# Config keys each loss accepts, with their defaults.
_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "stable_reinforce": {"kl_coeff": 0.01},
}

_RL_INPUTS = ("logprobs", "advantages")
_CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")
# loss_fn_inputs keys (besides target_tokens) each loss requires, and the optional ones it honours.
_REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "gspo": _RL_INPUTS,
    "stable_reinforce": _RL_INPUTS,
}
_OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    # Missing: every target weighs 1 (the official SDK's own `forward` example sends none).
    "cross_entropy": ("weights",),
    "ppo": _CLIP_INPUTS,
    "cispo": _CLIP_INPUTS,
    # Without it the ratio is taken over the datum's sampled positions (see the module doc).
    "gspo": (*_CLIP_INPUTS, "sequence_ratio_mask"),
}


def _accepted_inputs(loss_fn: str) -> tuple[str, ...]:
    return ("target_tokens", *_REQUIRED_INPUTS[loss_fn], *_OPTIONAL_INPUTS.get(loss_fn, ()))


def _normalise_config(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    defaults = _CONFIG_DEFAULTS[loss_fn]
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise EngineUserError(
            f"loss_fn_config must be a mapping of names to numbers, got {type(config).__name__}"
        )
    out = dict(defaults)
    for key, value in config.items():
        if key not in defaults:
            accepted = ", ".join(defaults) if defaults else "none"
            raise EngineUserError(
                f"loss_fn_config key {key!r} is not accepted by {loss_fn} "
                f"(accepted keys: {accepted}); remove it"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EngineUserError(
                f"loss_fn_config[{key!r}] must be a number, got {value!r} ({type(value).__name__})"
            )
        value = float(value)
        if not math.isfinite(value):
            raise EngineUserError(f"loss_fn_config[{key!r}] must be finite, got {value}")
        out[key] = value
    if out.get("kl_coeff", 0.0) < 0:
        raise EngineUserError(
            f"loss_fn_config['kl_coeff'] must be >= 0, got {out['kl_coeff']}; "
            "use 0 to switch the KL term off"
        )
    if out.get("beta", 0.0) < 0:
        raise EngineUserError(f"loss_fn_config['beta'] must be >= 0, got {out['beta']}")
    if "clip_low_threshold" in out and out["clip_low_threshold"] > out["clip_high_threshold"]:
        raise EngineUserError(
            f"loss_fn_config clip_low_threshold ({out['clip_low_threshold']}) is above "
            f"clip_high_threshold ({out['clip_high_threshold']}); both are ratio bounds, "
            "e.g. 0.8 and 1.2"
        )
    return out


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ("," if t.dim() == 1 else "") + ")"


def _first_true(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


def _validate_datum(i: int, loss_fn: str, d: LossDatum, vocab_size: int | None) -> None:
    tt = d.target_tokens
    _check_targets(i, loss_fn, tt, vocab_size)
    if loss_fn == "cross_entropy" and "weights" not in d.inputs:
        d.inputs["weights"] = torch.ones(tt.shape, dtype=torch.float32)
    _check_inputs(i, loss_fn, d, tt)
    _check_provenance_fields(i, d, tt.shape[0], vocab_size)
    if loss_fn == "stable_reinforce":
        _validate_stable_reinforce_datum(i, d)


def _check_targets(i: int, loss_fn: str, tt: torch.Tensor, vocab_size: int | None) -> None:
    if not isinstance(tt, torch.Tensor):
        raise EngineUserError(f"datum {i}: target_tokens must be a tensor")
    if tt.dtype.is_floating_point or tt.dtype.is_complex or tt.dtype == torch.bool:
        raise EngineUserError(f"datum {i}: target_tokens must hold integers, got {tt.dtype}")
    if tt.dim() == 2 and loss_fn != "cross_entropy":
        raise EngineUserError(
            f"datum {i}: target_tokens has shape {_shape(tt)} but {loss_fn} takes one target "
            "per position (shape (N,)); only cross_entropy takes (N, K) targets"
        )
    if tt.dim() not in (1, 2):
        raise EngineUserError(
            f"datum {i}: target_tokens must have shape (N,) or (N, K), got {_shape(tt)}"
        )
    if tt.numel() == 0:
        raise EngineUserError(f"datum {i}: target_tokens is empty; every datum needs a target")
    if bool((tt < 0).any()):
        t = _first_true(tt < 0)
        raise EngineUserError(
            f"datum {i}: target_tokens holds {int(tt.reshape(-1)[t])} at flat index {t}; "
            "token ids must be >= 0"
        )
    if vocab_size is not None and bool((tt >= vocab_size).any()):
        t = _first_true(tt >= vocab_size)
        raise EngineUserError(
            f"datum {i}: target_tokens holds token {int(tt.reshape(-1)[t])} at flat index {t} "
            f"but the vocabulary has {vocab_size} tokens"
        )


def _check_inputs(i: int, loss_fn: str, d: LossDatum, tt: torch.Tensor) -> None:
    n = tt.shape[0]
    required = _REQUIRED_INPUTS[loss_fn]
    accepted = _accepted_inputs(loss_fn)
    for key in required:
        if key not in d.inputs:
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs is missing {key!r}, which {loss_fn} requires "
                f"(required: {', '.join(('target_tokens', *required))})"
            )
    for key, value in d.inputs.items():
        if key not in accepted:
            users = [fn for fn in _REQUIRED_INPUTS if key in _accepted_inputs(fn)]
            other = f", or use a loss_fn that takes it ({', '.join(users)})" if users else ""
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs key {key!r} is not used by {loss_fn} "
                f"(accepted: {', '.join(accepted)}); remove it{other}"
            )
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs[{key!r}] must be a float32 tensor, got {kind}"
            )
        want = tt.shape if key == "weights" else (n,)
        if value.shape != want:
            target_desc = (
                f"target_tokens has shape {_shape(tt)}"
                if key == "weights" or tt.dim() == 1
                else f"target_tokens has {n} rows"
            )
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape {_shape(value)} but "
                f"{target_desc}; every input needs one value per target"
            )
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            t = _first_true(~finite)
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs[{key!r}] holds a non-finite value "
                f"({float(value.reshape(-1)[t])}) at flat index {t}"
            )
    if "clip_low_threshold" in d.inputs and "clip_high_threshold" in d.inputs:
        bad = d.inputs["clip_low_threshold"] > d.inputs["clip_high_threshold"]
        if bool(bad.any()):
            t = _first_true(bad)
            raise EngineUserError(
                f"datum {i}: clip_low_threshold is above clip_high_threshold at position {t}"
            )
    if "sequence_ratio_mask" in d.inputs and not bool((d.inputs["sequence_ratio_mask"] != 0).any()):
        raise EngineUserError(
            f"datum {i}: sequence_ratio_mask is all zero, so the GSPO sequence ratio is "
            "undefined; mark the sampled tokens with 1"
        )


def _check_provenance_fields(i: int, d: LossDatum, n: int, vocab_size: int | None) -> None:
    """The validator's ``sampled_mask`` and ``draws`` (a mismatch is a backend bug, but say
    where)."""
    if d.sampled_mask is not None:
        sm = d.sampled_mask
        if not isinstance(sm, torch.Tensor) or sm.dtype != torch.bool or sm.shape != (n,):
            raise EngineUserError(
                f"datum {i}: sampled_mask must be a bool tensor of shape ({n},)"
            )  # backend bug rather than user error, but say where
    if d.draws is not None:
        dr = d.draws
        if (
            not isinstance(dr, torch.Tensor)
            or dr.dtype.is_floating_point
            or dr.dim() != 2
            or dr.shape[0] != n
            or dr.shape[1] < 1
        ):
            raise EngineUserError(
                f"datum {i}: stability draws must be an integer tensor of shape ({n}, K)"
            )
        if vocab_size is not None and bool((dr >= vocab_size).any()):
            raise EngineUserError(
                f"datum {i}: recorded stability draws hold token ids >= the vocabulary size "
                f"{vocab_size}; the sequence was sampled from a different model"
            )


def _validate_stable_reinforce_datum(i: int, d: LossDatum) -> None:
    sm = d.sampled_mask
    if sm is None:
        raise EngineUserError(
            f"datum {i}: stable_reinforce needs provenance on every datum (model_input_spans "
            "and loss_fn_input_spans); build datums with tinker_sr.provenance.build_datum"
        )
    if not bool(sm.any()):
        raise EngineUserError(
            f"datum {i}: stable_reinforce needs at least one target position under a "
            "SampledProvenanceSpan in loss_fn_input_spans"
        )
    adv = d.inputs["advantages"]
    outside = (adv != 0) & ~sm
    if bool(outside.any()):
        t = _first_true(outside)
        raise EngineUserError(
            f"datum {i}: advantages[{t}] = {float(adv[t])} but position {t} is not under a "
            "SampledProvenanceSpan; stable_reinforce accepts non-zero advantages only on "
            "sampled tokens (set the prompt advantages to 0)"
        )
    needs_draws = (adv != 0) & sm
    if bool(needs_draws.any()):
        if d.draws is None:
            no_draws = needs_draws
        else:
            no_draws = needs_draws & ~(d.draws >= 0).any(dim=1)
        if bool(no_draws.any()):
            t = _first_true(no_draws)
            raise EngineUserError(
                f"datum {i}: position {t} has advantage {float(adv[t])} but no recorded "
                "stability draws; sample with a client created with record_stability_info=True"
            )


def validate_request(
    loss_fn: str,
    data: Sequence[LossDatum],
    config: Mapping[str, float | str] | None,
    *,
    vocab_size: int | None = None,
) -> dict[str, float]:
    """Check a request before any compute; return the config with defaults filled in.

    Raises EngineUserError naming the datum and key. ``vocab_size``, when known, also checks
    that target and draw token ids fit the model.
    """
    if loss_fn not in _CONFIG_DEFAULTS:
        raise EngineUserError(
            f"unknown loss_fn {loss_fn!r}; expected one of: {', '.join(LOSS_NAMES)}"
        )
    cfg = _normalise_config(loss_fn, config)
    if len(data) == 0:
        raise EngineUserError("no data: a request needs at least one datum")
    for i, d in enumerate(data):
        _validate_datum(i, loss_fn, d, vocab_size)
    return cfg
