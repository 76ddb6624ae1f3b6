"""Build RL training datums with provenance, in the canonical layouts tinker-cookbook builds
(docs/stable_reinforce.md).

Works with ``tinker_sr.types`` and with the official ``tinker.types``: pass ``types=`` (either
module) or let the builder pick the package of the prompt / sequence objects you hand it
(``tinker_sr.types`` when they are plain lists).

Single turn (prompt P tokens, sampled S tokens, N = P + S - 1 positions)::

    model_input   = prompt + sampled[:-1]
    target_tokens = [0] * (P - 1) + sampled        # prompt region padded with 0, as the cookbook
    logprobs      = [0] * (P - 1) + sampler logprobs
    advantages    = [0] * (P - 1) + advantage(s)
    model_input spans: Prompt(sid, 0, P), Sampled(sid, 0, S - 1)
    loss spans:        Prompt(sid, 1, P - 1), Sampled(sid, 0, S)

Multi turn (the sequence grows by appending): turn k adds its new observation tokens and its
action; its sampling request had the whole sequence so far as prompt. Over the full sequence the
runs are Prompt(sid_k, offset=<tokens before the observation>, length=<observation tokens>) and
Sampled(sid_k, 0, <action tokens>) per turn (each only if non-empty); the model_input list drops
the last position, the loss list the first. Targets are the real next tokens everywhere
(``full[1:]``), as the cookbook's trajectory builder does; logprobs and advantages are 0 outside
the actions.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["build_datum", "build_trajectory_datum"]


def _resolve_types(types: ModuleType | None, *objs: object) -> ModuleType:
    if types is not None:
        return types
    for obj in objs:
        module = type(obj).__module__
        if module == "tinker" or module.startswith("tinker."):
            return importlib.import_module("tinker.types")
    return importlib.import_module("tinker_sr.types")


def _sequence_parts(sequence: Any, where: str) -> tuple[list[int], np.ndarray, str]:
    try:
        tokens = [int(t) for t in sequence.tokens]
        logprobs = sequence.logprobs
        sequence_id = sequence.sequence_id
    except AttributeError as exc:
        raise TypeError(
            f"{where}: expected a SampledSequence (tokens, logprobs, sequence_id), "
            f"got {type(sequence).__name__}"
        ) from exc
    if not sequence_id:
        raise ValueError(f"{where}: the sequence has no sequence_id; sample it again")
    if logprobs is None or len(logprobs) != len(tokens):
        raise ValueError(f"{where}: the sequence needs one sampler logprob per sampled token")
    return tokens, np.asarray(logprobs, dtype=np.float32), sequence_id


def _advantages(advantage: float | Sequence[float], n: int, where: str) -> np.ndarray:
    if isinstance(advantage, int | float | np.floating | np.integer):
        return np.full(n, float(advantage), dtype=np.float32)
    values = np.asarray(advantage, dtype=np.float32)
    if values.shape != (n,):
        raise ValueError(
            f"{where}: got {values.size} advantages for {n} sampled tokens; pass one float per "
            "sequence or one per sampled token"
        )
    return values


def _tokens_of(observation: Any, where: str) -> list[int]:
    if hasattr(observation, "to_ints"):
        try:
            return [int(t) for t in observation.to_ints()]
        except ValueError as exc:
            raise ValueError(
                f"{where}: only text chunks are supported in multi-turn datums ({exc})"
            ) from exc
    return [int(t) for t in observation]


def _datum(
    types: ModuleType,
    model_input: Any,
    targets: np.ndarray,
    logprobs: np.ndarray,
    advantages: np.ndarray,
    runs: list[tuple[str, str, int, int]],
) -> Any:
    """Assemble the datum; ``runs`` are (kind, sequence_id, offset, length) over the full
    sequence (N + 1 positions)."""

    def spans(drop_first: bool) -> list[Any]:
        out = []
        trimmed = list(runs)
        if drop_first:
            kind, sid, offset, length = trimmed[0]
            trimmed[0] = (kind, sid, offset + 1, length - 1)
        else:
            kind, sid, offset, length = trimmed[-1]
            trimmed[-1] = (kind, sid, offset, length - 1)
        for kind, sid, offset, length in trimmed:
            if length > 0:
                cls = (
                    types.SampledProvenanceSpan if kind == "sampled" else types.PromptProvenanceSpan
                )
                out.append(cls(sequence_id=sid, offset=offset, length=length))
        return out

    datum = types.Datum(
        model_input=model_input,
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(targets.astype(np.int64)),
            "logprobs": types.TensorData.from_numpy(logprobs.astype(np.float32)),
            "advantages": types.TensorData.from_numpy(advantages.astype(np.float32)),
        },
    )
    return datum.with_provenance(model_input=spans(False), loss_fn_inputs=spans(True))


def build_datum(
    prompt: Any,
    sequence: Any,
    advantages: float | Sequence[float],
    *,
    types: ModuleType | None = None,
) -> Any:
    """The canonical single-turn StableReinforce datum for one sampled sequence.

    ``prompt`` is the ModelInput (or token list) that was sampled from, ``sequence`` the
    SampledSequence, ``advantages`` one float for the sequence or one per sampled token.
    A ModelInput prompt keeps its chunks (images included): targets in the prompt region are
    0 padding, so prompt token ids are never needed.
    """
    types = _resolve_types(types, prompt, sequence)
    tokens, logprobs, sid = _sequence_parts(sequence, "build_datum")
    if hasattr(prompt, "chunks"):
        p = int(prompt.length)
        model_input = prompt
        if len(tokens) > 1:
            model_input = model_input.append(types.EncodedTextChunk(tokens=tokens[:-1]))
    else:
        prompt_tokens = [int(t) for t in prompt]
        p = len(prompt_tokens)
        model_input = types.ModelInput.from_ints(prompt_tokens + tokens[:-1])
    s = len(tokens)
    if p < 1 or s < 1:
        raise ValueError(
            f"build_datum: need at least one prompt token and one sampled token, got {p} and {s}"
        )
    pad = p - 1
    return _datum(
        types,
        model_input,
        targets=np.concatenate([np.zeros(pad, np.int64), np.asarray(tokens, np.int64)]),
        logprobs=np.concatenate([np.zeros(pad, np.float32), logprobs]),
        advantages=np.concatenate(
            [np.zeros(pad, np.float32), _advantages(advantages, s, "build_datum")]
        ),
        runs=[("prompt", sid, 0, p), ("sampled", sid, 0, s)],
    )


def build_trajectory_datum(
    turns: Sequence[tuple[Any, Any, float | Sequence[float]]],
    *,
    types: ModuleType | None = None,
) -> Any:
    """One datum for a multi-turn trajectory whose sequence grows by appending.

    ``turns`` is a list of ``(observation, sequence, advantage)``: the *new* observation
    tokens of the turn (a token list or a text ModelInput; may be empty after the first
    turn), the SampledSequence returned for the request whose prompt was the whole sequence
    so far, and one float for that action or one per action token.
    """
    if not turns:
        raise ValueError("build_trajectory_datum: need at least one turn")
    types = _resolve_types(types, *(o for turn in turns for o in turn[:2]))
    full: list[int] = []
    logprobs: list[np.ndarray] = []
    advantages: list[np.ndarray] = []
    runs: list[tuple[str, str, int, int]] = []
    for k, (observation, sequence, advantage) in enumerate(turns):
        where = f"build_trajectory_datum: turn {k}"
        obs = _tokens_of(observation, where)
        tokens, lps, sid = _sequence_parts(sequence, where)
        if k == 0 and not obs:
            raise ValueError(f"{where}: the first observation (the prompt sampled from) is empty")
        if k > 0 and obs[: len(full)] == full:  # the whole prompt of turn k (a cookbook `ob`)
            raise ValueError(
                f"{where}: the observation repeats the {len(full)} tokens of the trajectory so "
                "far; pass only the tokens added since the previous turn's action (here "
                f"observation[{len(full)}:])"
            )
        if obs:
            runs.append(("prompt", sid, len(full), len(obs)))
        if tokens:
            runs.append(("sampled", sid, 0, len(tokens)))
        full += obs + tokens
        logprobs += [np.zeros(len(obs), np.float32), lps]
        advantages += [np.zeros(len(obs), np.float32), _advantages(advantage, len(tokens), where)]
    if len(full) < 2 or not any(kind == "sampled" for kind, *_ in runs):
        raise ValueError(
            "build_trajectory_datum: the trajectory needs at least two tokens and one sampled token"
        )
    return _datum(
        types,
        types.ModelInput.from_ints(full[:-1]),
        targets=np.asarray(full[1:], np.int64),
        logprobs=np.concatenate(logprobs)[1:],
        advantages=np.concatenate(advantages)[1:],
        runs=runs,
    )
