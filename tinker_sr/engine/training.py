"""Training steps on a registered `Trainer`: forward/backward (datum checks, provenance,
loss), the optimizer step, the adapter history that stale samplers read, and the
training-state tensors that checkpoints hold.

Every check runs before anything is mutated: weights, gradients, optimizer state and recorded
sequences stay as they were when a request is refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np
import torch

from tinker_sr import types, validation
from tinker_sr.engine import losses as engine_losses
from tinker_sr.engine import usage
from tinker_sr.engine.checkpoints import CHECKPOINT_FORMAT, count_nonfinite, read_record
from tinker_sr.engine.cpu import allocator_fitted_to, available_memory, return_freed_memory
from tinker_sr.engine.guards import check_finite_outputs, checked_backward
from tinker_sr.engine.lora import LoraSpec, load_lora_state_dict, lora_state_dict
from tinker_sr.engine.model import Transformer, activation_bytes
from tinker_sr.engine.optim import Adam, AdamHParams
from tinker_sr.engine.registry import Trainer, snapshot
from tinker_sr.engine.store import Store
from tinker_sr.engine.store_files import record_done_work
from tinker_sr.limits import DEFAULT_LIMITS, Limits
from tinker_sr.provenance.validate import DatumSpans, ProvenanceView, validate_provenance
from tinker_sr.tokenization.byte import foreign_ids_hint
from tinker_sr.types.tensor_data import check_int64
from tinker_sr.user_errors import EngineUserError, official_sdk_hint


# ---- forward / backward ------------------------------------------------------------------
def forward_backward(
    t: Trainer,
    store: Store,
    data: Sequence[types.Datum],
    loss_fn: str,
    loss_fn_config: Mapping[str, float | str] | None,
    forward_only: bool,
    limits: Limits = DEFAULT_LIMITS,
) -> types.ForwardBackwardOutput:
    if not data:
        raise EngineUserError("data is empty; pass at least one Datum")
    _check_datum_types(data)
    limits.check_train_tokens(sum(d.model_input.length for d in data))
    if loss_fn == "custom":
        raise EngineUserError(
            "loss_fn 'custom' (server-side custom losses from create_custom_loss) is not "
            "supported by this engine; use forward_backward_custom(data, fn) instead"
        )
    now = time.time()
    cfg = t.model.config
    batch = [_datum_arrays(i, d, cfg.vocab_size, cfg.max_seq_len) for i, d in enumerate(data)]
    views = _validate_provenance(store, t.session_id, data, batch, loss_fn, now)
    loss_data = [_loss_datum(arr, view) for arr, view in zip(batch, views, strict=True)]
    config = engine_losses.validate_request(
        loss_fn, loss_data, loss_fn_config, vocab_size=cfg.vocab_size
    )

    lengths = [len(a.tokens) for a in batch]
    groups = length_groups(lengths)
    kept = sum(len(g) * max(lengths[i] for i in g) for g in groups)  # padded tokens
    device = t.model.device
    # Short of memory, the allocator hands what the step frees back at once (`cpu`).
    room = available_memory() if device.type == "cpu" else None
    if not forward_only:
        room = _check_step_fits(t.model, kept, room)
    with allocator_fitted_to(room), torch.set_grad_enabled(not forward_only):
        # Mixed precision (bf16 matmuls, float32 master weights, adapters and loss) when the
        # trainer was created with it; see `device.train_autocast_dtype`. No cache of casts
        # (autocast keeps trainable leaves' only): it would cast a shared expert factor
        # (`lora.LoraSpec.moe_shared_outer`) once for all its experts and sum their gradients
        # in bf16 in that cast's backward; a cast per use sums them in float32.
        low = t.model.autocast_dtype
        with torch.autocast(
            device.type, dtype=low or torch.bfloat16, enabled=low is not None, cache_enabled=False
        ):
            per_datum = _hidden_rows(t.model, batch, groups, kept)
            result = engine_losses.compute_loss(
                loss_fn, per_datum, loss_data, config, unembed=t.model.lm_head
            )
        check_finite_outputs("forward_backward" if not forward_only else "forward", result.outputs)
        if not forward_only:  # refused (gradients untouched) if it would not be finite
            checked_backward(
                result, t.optim, loss_fn, per_datum, loss_data, config, unembed=t.model.lm_head
            )
    touched = set().union(*(v.sequence_ids for v in views if v is not None))

    def record() -> None:
        store.touch_sequences(touched, now)
        store.touch_run(t.model_id)
        store.add_usage(t.session_id, t.base_model, {usage.TRAINING: sum(lengths)})

    record_done_work("forward_backward's usage and sequence times", record)
    outputs = [
        {k: types.TensorData.from_torch(v.detach().float()) for k, v in out.items()}
        for out in result.outputs
    ]
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=dict(result.metrics)
    )


# A group's padding may add this share of its real tokens (see `length_groups`).
PAD_SLACK = 1.25
_TOKEN_IDS_FIX = "token ids are whole numbers: send target_tokens as int64"


def length_groups(lengths: Sequence[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """A call's datum indices in groups that each run as one right-padded batch: longest first, a
    datum joining the group before it while the group, padded to its longest, holds at most
    ``slack`` times its real tokens. Each group lists its datums in call order. Padding every
    datum to the call's longest made one 2,048-token datum beside seven of 64-1,024 cost ~4.3x
    the same datums one per call (`benchmarks/mixed_lengths.py`); equal lengths stay one batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties in order
    groups: list[list[int]] = []
    longest = real = 0  # the last group's longest datum and its real tokens
    for i in order:
        if groups and (len(groups[-1]) + 1) * longest <= slack * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            longest = real = lengths[i]
    return [sorted(g) for g in groups]


def _hidden_rows(
    model: Transformer, batch: list[_DatumArrays], groups: list[list[int]], kept: int
) -> list[torch.Tensor]:
    """Each datum's final hidden states [n, D] (not logits: the loss unembeds them in chunks,
    no [B, T, V]), its length group run as one right-padded batch."""
    rows: list[torch.Tensor | None] = [None] * len(batch)
    for group in groups:
        lengths = [len(batch[i].tokens) for i in group]
        tokens = torch.zeros((len(group), max(lengths)), dtype=torch.long)  # pad: masked
        for j, i in enumerate(group):
            tokens[j, : lengths[j]] = torch.from_numpy(batch[i].tokens)
        mask = torch.arange(tokens.shape[1])[None, :] < torch.tensor(lengths)[:, None]
        hidden = model.hidden_states(tokens, attn_mask=mask, kept_tokens=kept)
        # Rows through unbind, not hidden[j, :n]: each such slice's backward would zero-fill
        # and add a whole [B, T, D] gradient (B of them per step).
        for i, r, n in zip(group, hidden.unbind(0), lengths, strict=True):
            rows[i] = r if n == r.shape[0] else r[:n]
    missing = [i for i, r in enumerate(rows) if r is None]
    if missing:  # `length_groups` partitions the call: a datum left out is a bug, not input
        raise AssertionError(f"datums {missing} are in no length group")
    return cast(list[torch.Tensor], rows)


def _check_step_fits(model: Transformer, tokens: int, room: int | None) -> int | None:
    """Refuse, before allocating, a training step of ``tokens`` (padded) tokens that cannot fit
    in ``room`` bytes even with activation checkpointing; returns the room (re-read after the
    allocator handed back what earlier steps freed, where that was needed to decide). The
    estimate (each layer's input kept, one layer's activations at a time, twice for
    backward) is a floor: real steps measured 1.6-4x it, so this stops only steps that
    surely cannot fit (the kernel's out-of-memory killer would end the process, and every
    request it had acknowledged, mid-step), not every one that will not."""
    if room is None:
        return None
    cfg = model.config
    need = 4 * tokens * cfg.dim * cfg.n_layers + 2 * activation_bytes(cfg, tokens) // cfg.n_layers
    if need > room:  # memory the allocator keeps from earlier steps counts as used: hand it back
        return_freed_memory()
        room = available_memory()
    if room is not None and need > room:
        raise EngineUserError(
            f"forward_backward: {tokens} tokens (padded to each length group's longest) need "
            f"at least {need / 2**30:.1f} GiB even with activation checkpointing, and "
            f"{room / 2**30:.1f} GiB is free; send fewer or shorter datums per call (gradients "
            "add up over several forward_backward calls before one optim_step), or free memory"
        )
    return room


def _check_datum_types(data: Sequence[types.Datum]) -> None:
    if not isinstance(data, Sequence) or isinstance(data, str | bytes):
        raise EngineUserError(f"data must be a list of Datum, got {type(data).__name__}")
    for i, d in enumerate(data):
        if not isinstance(d, types.Datum):
            raise EngineUserError(
                f"data[{i}] must be a Datum, got {type(d).__name__}; build it with "
                f"types.Datum(model_input=..., loss_fn_inputs=...){official_sdk_hint(d)}"
            )
        # Before anything measures the datum: an image's length may be unknown (no
        # ``expected_tokens``), so asking for it would fail as an engine error.
        for j, chunk in enumerate(d.model_input.chunks):
            if not isinstance(chunk, types.EncodedTextChunk):
                raise EngineUserError(
                    f"datum {i}: model_input chunk {j} is of type {type(chunk).__name__}; the "
                    "tinker_sr engine only accepts EncodedTextChunk"
                )


@dataclass
class _DatumArrays:
    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray]  # includes target_tokens


def _validate_provenance(
    store: Store,
    session_id: str,
    data: Sequence[types.Datum],
    batch: list[_DatumArrays],
    loss_fn: str,
    now: float,
) -> list[ProvenanceView | None]:
    spans = [
        DatumSpans(
            input_tokens=a.tokens,
            target_tokens=a.inputs.get("target_tokens"),
            advantages=a.inputs.get("advantages"),
            model_input_spans=d.model_input_spans,
            loss_fn_input_spans=d.loss_fn_input_spans,
        )
        for d, a in zip(data, batch, strict=True)
    ]
    return validate_provenance(spans, session_id=session_id, lookup=store, loss_fn=loss_fn, now=now)


def _datum_tokens(i: int, d: types.Datum, vocab: int, max_len: int) -> np.ndarray:
    """Its tokens, checked (its chunks are text: `_check_datum_types` ran first)."""
    tokens = np.asarray(d.model_input.to_ints(), dtype=np.int64)
    n = len(tokens)
    if n == 0:
        raise EngineUserError(f"datum {i}: model_input is empty")
    if n > max_len:
        raise EngineUserError(
            f"datum {i}: model_input has {n} tokens but the model's context is {max_len}; "
            f"truncate by {n - max_len}"
        )
    if tokens.min() < 0 or tokens.max() >= vocab:
        bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
        raise EngineUserError(
            f"datum {i}: model_input token id {bad} is outside the vocabulary [0, {vocab})"
            + foreign_ids_hint(vocab)
        )
    return tokens


def _datum_arrays(i: int, d: types.Datum, vocab: int, max_len: int) -> _DatumArrays:
    tokens = _datum_tokens(i, d, vocab, max_len)
    n = len(tokens)
    inputs: dict[str, np.ndarray] = {}
    for key, td in d.loss_fn_inputs.items():
        arr = _loss_input_array(i, key, td, n, vocab)
        if not np.all(np.isfinite(arr)):
            raise EngineUserError(f"datum {i}: loss_fn_inputs[{key!r}] contains NaN or inf")
        inputs[key] = arr
    tt = inputs.get("target_tokens")
    if tt is None:
        raise EngineUserError(
            f"datum {i}: loss_fn_inputs has no 'target_tokens'; every built-in loss needs the "
            "next token for each input position"
        )
    if tt.min() < 0 or tt.max() >= vocab:
        raise EngineUserError(
            f"datum {i}: target_tokens contain ids outside the vocabulary [0, {vocab})"
        )
    return _DatumArrays(tokens=tokens, inputs=inputs)


def _loss_input_array(i: int, key: str, td: types.TensorData, n: int, vocab: int) -> np.ndarray:
    """One loss input as an array of ``n`` rows (and, if 2-D, 1 to ``vocab`` columns), its
    shape checked before a sparse tensor is densified."""
    where = f"datum {i}: loss_fn_inputs[{key!r}]"
    shape = list(td.shape) if td.shape is not None else [td.dense_size]
    if not shape or shape[0] != n:
        rows = "a scalar" if not shape else f"{shape[0]} rows"
        raise EngineUserError(
            f"{where} has {rows} but model_input has {n} tokens; every loss input needs one "
            "row per input position"
        )
    if len(shape) > 2 or (len(shape) == 2 and not 1 <= shape[1] <= vocab):
        raise EngineUserError(
            f"{where} has shape {shape}; use [{n}] or [{n}, K] with 1 <= K <= {vocab} (the "
            "vocabulary size)"
        )
    try:
        arr = td.to_numpy()
    except ValueError as e:  # a malformed CSR tensor
        raise EngineUserError(f"{where}: {e}") from None
    if key == "target_tokens" and td.dtype != "int64":
        try:  # token ids: 2.9 is a mistake, not token 2; refuse rather than truncate
            check_int64(arr, integral=True, what=f"{where} ({td.dtype})", fix=_TOKEN_IDS_FIX)
        except ValueError as e:
            raise EngineUserError(str(e)) from None
    if list(arr.shape) != shape:
        raise EngineUserError(f"{where}: data holds shape {list(arr.shape)}, not {shape}")
    return arr


def _loss_datum(a: _DatumArrays, view: ProvenanceView | None) -> engine_losses.LossDatum:
    target = torch.from_numpy(np.asarray(a.inputs["target_tokens"], dtype=np.int64))
    rest = {
        k: torch.from_numpy(np.asarray(v, dtype=np.float32))
        for k, v in a.inputs.items()
        if k != "target_tokens"
    }
    return engine_losses.LossDatum(
        target_tokens=target,
        inputs=rest,
        draws=None if view is None or view.draws is None else torch.from_numpy(view.draws),
        sampled_mask=None if view is None else torch.from_numpy(view.sampled_mask),
    )


# ---- optimizer and staleness history -----------------------------------------------------
def optim_step(
    t: Trainer, store: Store, adam_params: types.AdamParams, *, staleness: int
) -> types.OptimStepResponse:
    hp = AdamHParams(**validation.adam_values(adam_params))
    metrics = t.optim.step(hp)
    t.steps += 1
    if staleness:
        t.history.append(snapshot(t.model))
        while len(t.history) > staleness + 1:
            t.history.popleft()
    record_done_work("optim_step's run time", lambda: store.touch_run(t.model_id))
    return types.OptimStepResponse(metrics={k: float(v) for k, v in metrics.items()})


def start_history(t: Trainer, staleness: int) -> None:
    """Record the step-0 weights when samplers may lag (``staleness > 0``)."""
    if staleness:
        t.history.append(snapshot(t.model))


def sampler_adapters(t: Trainer, staleness: int) -> dict[str, torch.Tensor]:
    """Adapters a sampler created now gets: current, or ``staleness`` steps old."""
    if staleness and t.history:
        # history[-1] is the current weights; k steps back is history[-1-k] (or oldest).
        idx = max(0, len(t.history) - 1 - staleness)
        return t.history[idx]
    return snapshot(t.model)


# ---- training state in checkpoints -------------------------------------------------------
def checkpoint_meta(t: Trainer) -> dict[str, str]:
    return {
        "base_model": t.base_model,
        "lora": json.dumps(lora_json(t.lora)),
        "steps": str(t.steps),
        "format": CHECKPOINT_FORMAT,
    }


def state_tensors(t: Trainer) -> dict[str, torch.Tensor]:
    """Adapters and optimizer state, as `save_state` writes them."""
    tensors = {f"lora.{k}": v for k, v in lora_state_dict(t.model).items()}
    tensors.update({f"optim.{k}": v for k, v in t.optim.state_dict().items()})
    return _savable(tensors)


def sampler_tensors(t: Trainer) -> dict[str, torch.Tensor]:
    """The current adapters, as a named sampler checkpoint holds them."""
    return _savable({f"lora.{k}": v for k, v in snapshot(t.model).items()})


def _savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors``, refused if any holds NaN or infinity: a diverged model's checkpoint
    would load nowhere (refused as damaged), so it is not written."""
    for name, tensor in tensors.items():
        if bad := count_nonfinite(tensor):
            raise EngineUserError(
                f"save: the weights hold NaN or infinite values ({bad} in {name}): they have "
                "diverged, most likely in an optim_step with too large a learning_rate. Nothing "
                "was saved; start again from a checkpoint saved before that step "
                "(ServiceClient.create_training_client_from_state) with a smaller learning_rate"
            )
    return tensors


def load_state(
    t: Trainer,
    path: str,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, str],
    with_optimizer: bool,
) -> None:
    """Load a `save_state` checkpoint into ``t``; its LoRA config must match (seed aside)."""
    record = read_record(meta, tensors, path)
    spec = record.lora
    if lora_json(spec) | {"seed": None} != lora_json(t.lora) | {"seed": None}:
        raise EngineUserError(
            f"checkpoint {path} has LoRA config {lora_json(spec)} but this model has "
            f"{lora_json(t.lora)}; create a training client from the checkpoint instead"
        )
    restore(t.model, t.optim, tensors, with_optimizer)
    t.steps = record.steps if with_optimizer else 0  # as a client created from the state
    for p in t.model.parameters():
        p.grad = None


def strip(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def restore(
    model: Transformer, optim: Adam, tensors: Mapping[str, torch.Tensor], with_optimizer: bool
) -> None:
    """Load a checkpoint's adapter into ``model``; its optimizer state into ``optim`` if
    ``with_optimizer``, else the optimizer starts afresh (as the SDK's `load_state` says:
    "weights only, optimizer resets")."""
    optim_state = strip(tensors, "optim.")
    if with_optimizer and not optim_state:  # before anything changes
        raise EngineUserError("checkpoint has no optimizer state; load it without the optimizer")
    load_lora_state_dict(model, strip(tensors, "lora."))
    if with_optimizer:
        optim.load_state_dict(optim_state)
    else:
        optim.reset()


# ---- LoRA config ------------------------------------------------------------------------
def lora_spec(cfg: types.LoraConfig | None, *, experts: bool = False) -> LoraSpec:
    """A new run's LoRA spec; ``experts``: its base model has a mixture of experts, whose
    adapters then follow Tinker's shared-outer scheme (`LoraSpec.moe_shared_outer`). Without
    ``train_mlp`` no expert has an adapter: false, as in every checkpoint from before it."""
    cfg = validation.check_lora_config(cfg)
    return LoraSpec(
        rank=cfg.rank,
        seed=cfg.seed,
        train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp,
        train_unembed=cfg.train_unembed,
        moe_shared_outer=experts and cfg.train_mlp,
    )


def lora_json(spec: LoraSpec) -> dict[str, Any]:
    """Every LoraSpec field, in declaration order (checkpoint metadata and get_info)."""
    return asdict(spec)
