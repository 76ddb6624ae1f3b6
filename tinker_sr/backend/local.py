"""`LocalBackend`: the embedded engine behind the `Backend` protocol.

All torch work runs on one dedicated worker thread, so the caller's event loop never blocks
and execution order (hence every result) is deterministic. Training requests of one model
execute strictly in ``seq_id`` order, whatever order they arrive in. A request that fails
validation raises before anything is mutated: weights, optimizer state, gradients,
checkpoints and recorded sequences stay as they were.

Off-policy stress for studies (spec: issue 5): ``sampler_dtype="bfloat16"`` makes every
sampler compute in bfloat16 while the learner stays in float32, and
``sampler_staleness=k`` makes samplers snapshotted from a training model
(`save_weights_and_get_sampling_client`) use the weights it had ``k`` optimizer steps earlier,
as asynchronous RL does; named sampler checkpoints still hold the current weights. Both are real: the sampler actually
runs in that dtype / on those weights.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import secrets
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from tinker_sr import types
from tinker_sr.engine import checkpoints as ckpt_io
from tinker_sr.engine import losses as engine_losses
from tinker_sr.engine import sampler as engine_sampler
from tinker_sr.engine.errors import EngineNotFoundError, EngineUserError
from tinker_sr.engine.lora import (
    LoraSpec,
    apply_lora,
    clone_for_sampling,
    load_lora_state_dict,
    lora_state_dict,
    trainable_parameters,
)
from tinker_sr.engine.model import BUILTIN_CONFIGS, Transformer, build_model, load_pretrained
from tinker_sr.engine.optim import Adam, AdamHParams
from tinker_sr.engine.store import CheckpointRow, RunRow, Store
from tinker_sr.engine.tokenizer import ByteTokenizer
from tinker_sr.errors import RequestFailedError
from tinker_sr.provenance.validate import (
    RECORD_TTL_SECONDS,
    DatumSpans,
    ProvenanceView,
    SequenceRecord,
    validate_provenance,
)

T = TypeVar("T")

STABILITY_K = 8
_TTL_MIN, _TTL_MAX = 3600, 10 * 365 * 24 * 3600
_SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def default_store_dir() -> Path:
    """``$TINKER_SR_STORE`` or ``~/.cache/tinker_sr``."""
    env = os.environ.get("TINKER_SR_STORE")
    return Path(env) if env else Path.home() / ".cache" / "tinker_sr"


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


@dataclass
class _Trainer:
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
class _Sampler:
    sampler_id: str
    session_id: str
    base_model: str
    model: Transformer
    model_path: str | None


@dataclass
class _Order:
    next_seq: int = 1
    cond: asyncio.Condition | None = None
    # seq_ids given up by the client (a request refused before it reached us): skip them.
    released: set[int] = field(default_factory=set)

    def advance_past(self, seq_id: int) -> None:
        self.next_seq = max(self.next_seq, seq_id + 1)
        while self.next_seq in self.released:
            self.released.discard(self.next_seq)
            self.next_seq += 1


def _user(msg: str) -> RequestFailedError:
    return RequestFailedError(
        f"Request failed: {msg}",
        request_id=uuid.uuid4().hex,
        category=types.RequestErrorCategory.User,
    )


def _iso(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


class LocalBackend:
    """Runs the embedded PyTorch engine in-process. One instance can serve many sessions."""

    def __init__(
        self,
        store_dir: str | Path | None = None,
        *,
        model_aliases: Mapping[str, str] | None = None,
        sampler_dtype: str | torch.dtype | None = None,
        sampler_staleness: int = 0,
        persistent: bool = True,
        torch_threads: int | None = None,
    ) -> None:
        self.store_dir = Path(store_dir) if store_dir is not None else default_store_dir()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.store_dir / "engine.sqlite" if persistent else None)
        aliases = parse_aliases(os.environ.get("TINKER_SR_MODEL_ALIASES"))
        aliases.update(model_aliases or {})
        self.model_aliases = aliases
        self.sampler_dtype = _parse_dtype(sampler_dtype)
        if sampler_staleness < 0:
            raise ValueError(f"sampler_staleness must be >= 0, got {sampler_staleness}")
        self.sampler_staleness = sampler_staleness
        # Intra-op threads of the engine's torch work ($TINKER_SR_TORCH_THREADS; default: torch's
        # own). Small models on a busy machine run far faster on one thread than oversubscribed.
        env_threads = os.environ.get("TINKER_SR_TORCH_THREADS", "").strip()
        if torch_threads is None and env_threads:
            if not env_threads.isdigit() or int(env_threads) < 1:
                raise ValueError(
                    f"TINKER_SR_TORCH_THREADS must be a positive integer, got {env_threads!r}"
                )
            torch_threads = int(env_threads)
        self._torch_threads = torch_threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-sr-engine")
        self._trainers: dict[str, _Trainer] = {}
        self._samplers: dict[str, _Sampler] = {}
        self._orders: dict[str, _Order] = {}
        self._base_cache: dict[str, Transformer] = {}
        self._tokenizer = ByteTokenizer()
        self._closed = False
        self._last_purge = 0.0

    # ---- plumbing ---------------------------------------------------------------------
    async def _run(self, fn: Callable[[], T]) -> T:
        """Run engine work on the worker thread; map engine errors to Tinker errors."""
        if self._closed:
            raise RuntimeError("LocalBackend is closed")
        loop = asyncio.get_running_loop()

        def call() -> T:
            if self._torch_threads:
                torch.set_num_threads(self._torch_threads)
            return fn()

        try:
            return await loop.run_in_executor(self._executor, call)
        except EngineUserError as e:
            raise _user(str(e)) from e
        except RequestFailedError:
            raise
        except Exception as e:  # an engine bug: report it as a server-side failure
            raise RequestFailedError(
                f"Request failed: internal error: {type(e).__name__}: {e}",
                request_id=uuid.uuid4().hex,
                category=types.RequestErrorCategory.Server,
            ) from e

    async def _in_order(self, model_id: str, seq_id: int, fn: Callable[[], T]) -> T:
        """Execute ``fn`` when every earlier ``seq_id`` of ``model_id`` has finished."""
        order = self._orders.get(model_id)
        if order is None:
            raise _user(f"unknown model_id {model_id!r}; create a training client first")
        if order.cond is None:
            order.cond = asyncio.Condition()
        async with order.cond:
            if seq_id < order.next_seq:
                raise _user(
                    f"seq_id {seq_id} for model {model_id} was already executed (next is "
                    f"{order.next_seq}); every training request needs a fresh seq_id"
                )
            await order.cond.wait_for(lambda: order.next_seq == seq_id)
        try:
            return await self._run(fn)
        finally:
            async with order.cond:
                order.advance_past(seq_id)
                order.cond.notify_all()

    async def release_seq(self, model_id: str, seq_id: int) -> None:
        """Give up ``seq_id`` of ``model_id`` without running anything, so later requests do
        not wait for a request that will never arrive (e.g. one refused on the wire)."""
        order = self._orders.get(model_id)
        if order is None:
            return
        if order.cond is None:
            order.cond = asyncio.Condition()
        async with order.cond:
            if seq_id == order.next_seq:
                order.advance_past(seq_id)
                order.cond.notify_all()
            elif seq_id > order.next_seq:
                order.released.add(seq_id)

    def _trainer(self, model_id: str) -> _Trainer:
        t = self._trainers.get(model_id)
        if t is None:
            raise EngineNotFoundError(
                f"unknown model_id {model_id!r}; create a training client first"
            )
        return t

    def _sampler(self, sampler_id: str) -> _Sampler:
        s = self._samplers.get(sampler_id)
        if s is None:
            raise EngineNotFoundError(
                f"unknown sampling session {sampler_id!r}; create a sampling client first"
            )
        return s

    # ---- models -----------------------------------------------------------------------
    def available_models(self) -> list[str]:
        return sorted(BUILTIN_CONFIGS) + sorted(k for k in self.model_aliases if k != "*")

    def resolve_model(self, name: str) -> str:
        """Map a requested base model name to a built-in name or a local directory."""
        if name in BUILTIN_CONFIGS:
            return name
        target = self.model_aliases.get(name) or self.model_aliases.get("*") or name
        if target in BUILTIN_CONFIGS:
            return target
        if os.path.isdir(target) and os.path.exists(os.path.join(target, "config.json")):
            return os.path.abspath(target)
        raise EngineUserError(
            f"base_model {name!r} is not available. Available: {', '.join(self.available_models())}."
            " To use another name, alias it: TINKER_SR_MODEL_ALIASES='"
            f"{name}=tinker-sr/tiny' or to a local Hugging Face directory with config.json "
            "and *.safetensors (nothing is downloaded)."
        )

    def _base(self, resolved: str) -> Transformer:
        m = self._base_cache.get(resolved)
        if m is None:
            m = (
                build_model(resolved, seed=0)
                if resolved in BUILTIN_CONFIGS
                else load_pretrained(resolved)
            )
            m.requires_grad_(False)
            m.eval()
            self._base_cache[resolved] = m
        return m

    def _new_trainable(self, resolved: str, spec: LoraSpec) -> tuple[Transformer, Adam]:
        model = copy.deepcopy(self._base(resolved))
        apply_lora(model, spec)
        return model, Adam(trainable_parameters(model))

    def max_context(self, resolved: str) -> int:
        return int(self._base(resolved).config.max_seq_len)

    # ---- sessions ---------------------------------------------------------------------
    async def create_session(
        self,
        *,
        user_metadata: Mapping[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        tags: Sequence[str] = (),
    ) -> str:
        return self._add_session(
            user_metadata=user_metadata, project_id=project_id, display_name=display_name
        )

    def _add_session(
        self,
        *,
        user_metadata: Mapping[str, str] | None,
        project_id: str | None,
        display_name: str | None,
    ) -> str:
        session_id = f"sess-{uuid.uuid4().hex[:16]}"
        self.store.add_session(
            session_id,
            user_metadata=dict(user_metadata or {}),
            project_id=project_id,
            display_name=display_name,
        )
        return session_id

    async def close_session(self, session_id: str, status: str, detail: str | None = None) -> None:
        self.store.close_session(session_id, status)

    async def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        models = [
            types.SupportedModel(
                model_name=name,
                max_context_length=cfg.max_seq_len,
                trainable=True,
                sampleable=True,
            )
            for name, cfg in sorted(BUILTIN_CONFIGS.items())
        ]
        return types.GetServerCapabilitiesResponse(supported_models=models)

    # ---- training models --------------------------------------------------------------
    def _register_trainer(self, trainer: _Trainer, user_metadata: Mapping[str, str] | None) -> None:
        if self.sampler_staleness:
            trainer.history.append(_snapshot(trainer.model))  # the weights of step 0
        self._trainers[trainer.model_id] = trainer
        self._orders[trainer.model_id] = _Order()
        self.store.add_run(
            trainer.model_id,
            trainer.session_id,
            trainer.base_model,
            _lora_json(trainer.lora),
            dict(user_metadata) if user_metadata else None,
        )

    def _check_session(self, session_id: str) -> None:
        if not self.store.session_exists(session_id):
            raise EngineNotFoundError(f"unknown session_id {session_id!r}; create a session first")

    def _new_model_id(self, session_id: str, model_seq_id: int) -> str:
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self._trainers or self.store.get_run(model_id) is not None:
            raise EngineUserError(
                f"model_seq_id {model_seq_id} is already used in session {session_id}; "
                "use the next integer"
            )
        return model_id

    async def create_model(
        self,
        session_id: str,
        model_seq_id: int,
        *,
        base_model: str,
        lora_config: types.LoraConfig,
        optimizer_config: Any = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> str:
        def work() -> str:
            self._check_session(session_id)
            _check_optimizer_config(optimizer_config)
            model_id = self._new_model_id(session_id, model_seq_id)
            resolved = self.resolve_model(base_model)
            spec = _lora_spec(lora_config)
            model, optim = self._new_trainable(resolved, spec)
            self._register_trainer(
                _Trainer(model_id, session_id, base_model, resolved, spec, model, optim),
                user_metadata,
            )
            return model_id

        return await self._run(work)

    async def create_model_from_state(
        self,
        session_id: str,
        model_seq_id: int,
        *,
        path: str,
        with_optimizer: bool,
        base_model: str | None = None,
        optimizer_config: Any = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> str:
        def work() -> str:
            self._check_session(session_id)
            _check_optimizer_config(optimizer_config)
            model_id = self._new_model_id(session_id, model_seq_id)
            tensors, meta = self._load_checkpoint(path, expect="training")
            spec = LoraSpec(**json.loads(meta["lora"]))
            name = base_model or meta["base_model"]
            resolved = self.resolve_model(name)
            model, optim = self._new_trainable(resolved, spec)
            _restore(model, optim, tensors, with_optimizer)
            trainer = _Trainer(model_id, session_id, name, resolved, spec, model, optim)
            trainer.steps = int(meta.get("steps", 0)) if with_optimizer else 0
            self._register_trainer(trainer, user_metadata)
            return model_id

        return await self._run(work)

    async def get_info(self, model_id: str) -> types.GetInfoResponse:
        def work() -> types.GetInfoResponse:
            t = self._trainer(model_id)
            return types.GetInfoResponse(
                type="get_info",
                model_data=types.ModelData(
                    arch="transformer", model_name=t.base_model, tokenizer_id=None
                ),
                model_id=model_id,
                is_lora=True,
                lora_rank=t.lora.rank,
                model_name=t.base_model,
            )

        return await self._run(work)

    # ---- forward / backward -----------------------------------------------------------
    async def forward_backward(
        self,
        model_id: str,
        seq_id: int,
        data: Sequence[types.Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None = None,
        *,
        forward_only: bool = False,
    ) -> types.ForwardBackwardOutput:
        return await self._in_order(
            model_id,
            seq_id,
            lambda: self._forward_backward(model_id, data, loss_fn, loss_fn_config, forward_only),
        )

    def _forward_backward(
        self,
        model_id: str,
        data: Sequence[types.Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        forward_only: bool,
    ) -> types.ForwardBackwardOutput:
        t = self._trainer(model_id)
        if not data:
            raise EngineUserError("data is empty; pass at least one Datum")
        if loss_fn == "custom":
            raise EngineUserError(
                "loss_fn 'custom' (server-side custom losses from create_custom_loss) is not "
                "supported by this engine; use forward_backward_custom(data, fn) instead"
            )
        now = time.time()
        cfg = t.model.config
        batch = [_datum_arrays(i, d, cfg.vocab_size, cfg.max_seq_len) for i, d in enumerate(data)]
        views = self._validate_provenance(t.session_id, data, batch, loss_fn, now)
        loss_data = [_loss_datum(arr, view) for arr, view in zip(batch, views, strict=True)]
        config = engine_losses.validate_request(
            loss_fn, loss_data, loss_fn_config, vocab_size=cfg.vocab_size
        )

        lengths = [len(a.tokens) for a in batch]
        tokens = torch.zeros((len(batch), max(lengths)), dtype=torch.long)  # pad: masked below
        for i, a in enumerate(batch):
            tokens[i, : lengths[i]] = torch.from_numpy(a.tokens)
        with torch.set_grad_enabled(not forward_only):
            mask = torch.arange(tokens.shape[1])[None, :] < torch.tensor(lengths)[:, None]
            logits = t.model(tokens, attn_mask=mask)
            per_datum = [logits[i, : lengths[i]] for i in range(len(batch))]
            result = engine_losses.compute_loss(loss_fn, per_datum, loss_data, config)
            if not forward_only:
                result.loss.backward()
        touched = set().union(*(v.sequence_ids for v in views if v is not None))
        self.store.touch_sequences(touched, now)
        self.store.touch_run(model_id)
        outputs = [
            {k: types.TensorData.from_torch(v.detach().float()) for k, v in out.items()}
            for out in result.outputs
        ]
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=dict(result.metrics)
        )

    def _validate_provenance(
        self,
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
        return validate_provenance(
            spans, session_id=session_id, lookup=self.store, loss_fn=loss_fn, now=now
        )

    # ---- optimizer --------------------------------------------------------------------
    async def optim_step(
        self, model_id: str, seq_id: int, adam_params: types.AdamParams
    ) -> types.OptimStepResponse:
        def work() -> types.OptimStepResponse:
            t = self._trainer(model_id)
            hp = _adam_hparams(adam_params)
            metrics = t.optim.step(hp)
            t.steps += 1
            if self.sampler_staleness:
                t.history.append(_snapshot(t.model))
                while len(t.history) > self.sampler_staleness + 1:
                    t.history.popleft()
            self.store.touch_run(model_id)
            return types.OptimStepResponse(metrics={k: float(v) for k, v in metrics.items()})

        return await self._in_order(model_id, seq_id, work)

    # ---- checkpoints ------------------------------------------------------------------
    def _ckpt_file(self, run_id: str, segment: str, name: str) -> Path:
        safe_run = run_id.replace(":", "_")
        return self.store_dir / "checkpoints" / safe_run / segment / f"{name}.safetensors"

    def _write_checkpoint(
        self,
        t: _Trainer,
        segment: str,
        name: str,
        tensors: dict[str, torch.Tensor],
        *,
        ttl_seconds: int | None,
        overwrite: bool,
        user_metadata: Mapping[str, str] | None,
    ) -> str:
        _check_name(name)
        expires_at = _expiry(ttl_seconds)
        tinker_path = f"tinker://{t.model_id}/{segment}/{name}"
        if not overwrite and self.store.get_checkpoint(tinker_path) is not None:
            raise EngineUserError(
                f"checkpoint {tinker_path} already exists; pick another name or pass overwrite=True"
            )
        meta = {
            "base_model": t.base_model,
            "lora": json.dumps(_lora_json(t.lora)),
            "steps": str(t.steps),
            "format": "tinker_sr/1",
        }
        file_path = self._ckpt_file(t.model_id, segment, name)
        size = ckpt_io.save_tensors(file_path, tensors, meta)
        self.store.put_checkpoint(
            CheckpointRow(
                run_id=t.model_id,
                checkpoint_id=f"{segment}/{name}",
                checkpoint_type=_SEGMENTS[segment],
                tinker_path=tinker_path,
                file_path=str(file_path),
                created_at=time.time(),
                size_bytes=size,
                user_metadata=dict(user_metadata) if user_metadata else None,
                expires_at=expires_at,
            )
        )
        return tinker_path

    def _live_checkpoint(self, path: str) -> CheckpointRow:
        """The checkpoint at ``path``; not-found (the same message everywhere) if it does not
        exist or has expired."""
        _parse_path(path)
        row = self.store.get_checkpoint(path)
        if row is None:
            raise EngineNotFoundError(
                f"checkpoint {path} does not exist (or has expired); list checkpoints with "
                "RestClient.list_checkpoints(run_id)"
            )
        return row

    def _checkpoint_run(self, path: str) -> tuple[CheckpointRow, RunRow]:
        row = self._live_checkpoint(path)
        run = self.store.get_run(row.run_id)
        if run is None:
            raise EngineNotFoundError(f"checkpoint {path} has no training run record")
        return row, run

    def _load_checkpoint(
        self, path: str, *, expect: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        parsed = _parse_path(path)
        if expect == "training" and parsed.checkpoint_type != "training":
            raise EngineUserError(
                f"{path} is a {parsed.checkpoint_type} checkpoint; training state loads only from "
                "tinker://<run>/weights/<name> (written by save_state)"
            )
        return ckpt_io.load_tensors(self._live_checkpoint(path).file_path)

    async def save_state(
        self,
        model_id: str,
        seq_id: int,
        name: str,
        *,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: Mapping[str, str] | None = None,
    ) -> types.SaveWeightsResponse:
        def work() -> types.SaveWeightsResponse:
            t = self._trainer(model_id)
            tensors = {f"lora.{k}": v for k, v in lora_state_dict(t.model).items()}
            tensors.update({f"optim.{k}": v for k, v in t.optim.state_dict().items()})
            path = self._write_checkpoint(
                t,
                "weights",
                name,
                tensors,
                ttl_seconds=ttl_seconds,
                overwrite=overwrite,
                user_metadata=user_metadata,
            )
            return types.SaveWeightsResponse(path=path, type="save_weights")

        return await self._in_order(model_id, seq_id, work)

    async def save_weights_for_sampler(
        self,
        model_id: str,
        seq_id: int,
        *,
        name: str | None = None,
        sampling_session_seq_id: int | None = None,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> types.SaveWeightsForSamplerResponseInternal:
        def work() -> types.SaveWeightsForSamplerResponseInternal:
            t = self._trainer(model_id)
            if name is not None:
                # A named checkpoint is the current weights; only live samplers lag.
                tensors = {f"lora.{k}": v for k, v in _snapshot(t.model).items()}
                path = self._write_checkpoint(
                    t,
                    "sampler_weights",
                    name,
                    tensors,
                    ttl_seconds=ttl_seconds,
                    overwrite=False,
                    user_metadata=user_metadata,
                )
                return types.SaveWeightsForSamplerResponseInternal(
                    path=path, type="save_weights_for_sampler"
                )
            if sampling_session_seq_id is None:
                raise EngineUserError(
                    "save_weights_for_sampler needs either a name or a sampling_session_seq_id"
                )
            sampler_id = self._new_sampler_id(t.session_id, sampling_session_seq_id)
            model = self._sampling_copy(t.model, self._sampler_adapters(t))
            self._samplers[sampler_id] = _Sampler(
                sampler_id, t.session_id, t.base_model, model, None
            )
            return types.SaveWeightsForSamplerResponseInternal(
                sampling_session_id=sampler_id, type="save_weights_for_sampler"
            )

        return await self._in_order(model_id, seq_id, work)

    def _sampler_adapters(self, t: _Trainer) -> dict[str, torch.Tensor]:
        """Adapters a sampler created now gets: current, or ``sampler_staleness`` steps old."""
        if self.sampler_staleness and t.history:
            # history[-1] is the current weights; k steps back is history[-1-k] (or oldest).
            idx = max(0, len(t.history) - 1 - self.sampler_staleness)
            return t.history[idx]
        return _snapshot(t.model)

    def _sampling_copy(self, model: Transformer, adapters: dict[str, torch.Tensor]) -> Transformer:
        current = _snapshot(model)
        load_lora_state_dict(model, adapters)
        try:
            return clone_for_sampling(model, dtype=self.sampler_dtype)
        finally:
            load_lora_state_dict(model, current)

    async def load_state(
        self, model_id: str, seq_id: int, path: str, *, with_optimizer: bool
    ) -> types.LoadWeightsResponse:
        def work() -> types.LoadWeightsResponse:
            t = self._trainer(model_id)
            tensors, meta = self._load_checkpoint(path, expect="training")
            spec = LoraSpec(**json.loads(meta["lora"]))
            if _lora_json(spec) | {"seed": None} != _lora_json(t.lora) | {"seed": None}:
                raise EngineUserError(
                    f"checkpoint {path} has LoRA config {_lora_json(spec)} but this model has "
                    f"{_lora_json(t.lora)}; create a training client from the checkpoint instead"
                )
            _restore(t.model, t.optim, tensors, with_optimizer)
            for p in t.model.parameters():
                p.grad = None
            return types.LoadWeightsResponse(path=path, model_id=model_id, type="load_weights")

        return await self._in_order(model_id, seq_id, work)

    # ---- sampling ---------------------------------------------------------------------
    def _new_sampler_id(self, session_id: str, seq: int) -> str:
        sampler_id = f"{session_id}:sample:{seq}"
        if sampler_id in self._samplers:
            raise EngineUserError(
                f"sampling_session_seq_id {seq} is already used in session {session_id}"
            )
        return sampler_id

    async def create_sampling_session(
        self,
        session_id: str,
        sampling_session_seq_id: int,
        *,
        base_model: str | None = None,
        model_path: str | None = None,
    ) -> str:
        def work() -> str:
            self._check_session(session_id)
            if model_path is None and base_model is None:
                raise EngineUserError("Either model_path or base_model must be provided")
            sampler_id = self._new_sampler_id(session_id, sampling_session_seq_id)
            if model_path is not None:
                parsed = _parse_path(model_path)
                tensors, meta = self._load_checkpoint(model_path, expect=parsed.checkpoint_type)
                name = base_model or meta["base_model"]
                spec = LoraSpec(**json.loads(meta["lora"]))
                model, _ = self._new_trainable(self.resolve_model(name), spec)
                load_lora_state_dict(model, _strip(tensors, "lora."))
                sampling_model = clone_for_sampling(model, dtype=self.sampler_dtype)
            else:
                assert base_model is not None
                name = base_model
                sampling_model = clone_for_sampling(
                    self._base(self.resolve_model(name)), dtype=self.sampler_dtype
                )
            self._samplers[sampler_id] = _Sampler(
                sampler_id, session_id, name, sampling_model, model_path
            )
            return sampler_id

        return await self._run(work)

    async def get_sampler_base_model(self, sampler_id: str) -> str:
        return await self._run(lambda: self._sampler(sampler_id).base_model)

    async def sample(
        self,
        sampler_id: str,
        seq_id: int,
        *,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
        record_stability_info: bool = False,
        sequence_ids: Sequence[str] | None = None,
    ) -> types.SampleResponse:
        def work() -> types.SampleResponse:
            s = self._sampler(sampler_id)
            tokens = _prompt_tokens(prompt, s.model.config.vocab_size)
            if num_samples < 1:
                raise EngineUserError(f"num_samples must be >= 1, got {num_samples}")
            if sequence_ids is not None and len(sequence_ids) != num_samples:
                raise EngineUserError(
                    f"{len(sequence_ids)} sequence_ids given for num_samples={num_samples}"
                )
            sp = sampling_params
            max_ctx = s.model.config.max_seq_len
            max_tokens = sp.max_tokens if sp.max_tokens is not None else max_ctx - len(tokens)
            stop_ids, stop_strings = _stop_conditions(sp.stop, self._tokenizer.eos_token_id)
            seed = sp.seed if sp.seed is not None else secrets.randbits(63)
            vocab = s.model.config.vocab_size
            _check_k("topk_prompt_logprobs", topk_prompt_logprobs, vocab)
            _check_k("topk_sample_logprobs", topk_sample_logprobs, vocab)
            _check_k("prompt_alt_tokens_k", prompt_alt_tokens_k, vocab)
            if prompt_logprobs_last_n is not None and not (
                1 <= prompt_logprobs_last_n <= len(tokens) - 1
            ):
                raise EngineUserError(
                    f"prompt_logprobs_last_n must be in [1, len(prompt) - 1 = {len(tokens) - 1}]"
                    f", got {prompt_logprobs_last_n}"
                )
            targets = (
                _target_ids(target_prompt_logprobs, len(tokens), vocab)
                if target_prompt_logprobs is not None
                else None
            )
            # Prompt-side extras first: they only read the prompt, and a bad request must fail
            # before any sequence is generated or recorded.
            topk_prompt = None
            if topk_prompt_logprobs:
                ids_k, lps_k = engine_sampler.prompt_top_k_logprobs(
                    s.model, tokens, topk_prompt_logprobs
                )
                if prompt_logprobs_last_n is not None:
                    cut = len(tokens) - prompt_logprobs_last_n
                    ids_k[:cut], lps_k[:cut] = engine_sampler.TOPK_SENTINEL
                topk_prompt = types.TopkLogprobs(token_ids=ids_k, logprobs=lps_k)
            target_out = None
            if targets is not None:
                assert target_prompt_logprobs is not None
                dense = engine_sampler.target_logprobs(s.model, tokens, targets)
                target_out = _like_request(dense, target_prompt_logprobs)
            alt = None
            if prompt_alt_tokens_k:
                alt_ids, alt_lps = engine_sampler.prompt_alt_tokens(
                    s.model,
                    tokens,
                    prompt_alt_tokens_k,
                    temperature=float(sp.temperature),
                    seed=int(seed),
                )
                alt = types.PromptAltTokens(
                    tokens=types.TensorData.from_numpy(alt_ids.astype(np.int64)),
                    logprobs=types.TensorData.from_numpy(alt_lps.astype(np.float32)),
                )
            outs = engine_sampler.generate(
                s.model,
                tokens,
                num_samples=num_samples,
                max_tokens=max_tokens,
                temperature=float(sp.temperature),
                top_k=int(sp.top_k),
                top_p=float(sp.top_p),
                stop_token_ids=stop_ids,
                stop_strings=stop_strings,
                decode=self._tokenizer.decode,
                seed=int(seed),
                stability_k=STABILITY_K if record_stability_info else 0,
                top_k_logprobs=topk_sample_logprobs,
            )
            ids = (
                list(sequence_ids)
                if sequence_ids is not None
                else [
                    f"{sampler_id}:{seq_id}:{i}:{secrets.token_hex(4)}" for i in range(num_samples)
                ]
            )
            now = time.time()
            if now - self._last_purge > 3600:
                # Records live 24 h after their last use; drop the dead ones hourly.
                self.store.purge_expired_sequences(now - RECORD_TTL_SECONDS)
                self._last_purge = now
            prompt_arr = np.asarray(tokens, dtype=np.int32)
            self.store.put_sequences(
                [
                    SequenceRecord(
                        sequence_id=sid,
                        session_id=s.session_id,
                        prompt_tokens=prompt_arr,
                        sampled_tokens=np.asarray(o.tokens, dtype=np.int32),
                        sampler_logprobs=np.asarray(o.logprobs, dtype=np.float32),
                        draws=o.draws if record_stability_info else None,
                        created_at=now,
                        last_used_at=now,
                    )
                    for sid, o in zip(ids, outs, strict=True)
                ]
            )
            prompt_lp = None
            if include_prompt_logprobs:
                lps = engine_sampler.prompt_logprobs(s.model, tokens)
                arr = np.array([np.nan if v is None else v for v in lps], dtype=np.float32)
                if prompt_logprobs_last_n is not None:
                    arr[: len(tokens) - prompt_logprobs_last_n] = np.nan
                prompt_lp = arr
            seqs = [
                types.SampledSequence(
                    stop_reason=o.stop_reason,
                    sequence_id=sid,
                    tokens_np=np.asarray(o.tokens, dtype=np.int32),
                    logprobs_np=np.asarray(o.logprobs, dtype=np.float32),
                    topk_logprobs_np=(
                        types.TopkLogprobs(token_ids=o.topk_token_ids, logprobs=o.topk_logprobs)
                        if o.topk_token_ids is not None and o.topk_logprobs is not None
                        else None
                    ),
                )
                for sid, o in zip(ids, outs, strict=True)
            ]
            return types.SampleResponse(
                sequences=seqs,
                prompt_logprobs_np=prompt_lp,
                topk_prompt_logprobs_np=topk_prompt,
                target_prompt_logprobs=target_out,
                prompt_alt_tokens=alt,
            )

        return await self._run(work)

    # ---- REST -------------------------------------------------------------------------
    def _checkpoint_type(self, row: CheckpointRow) -> types.Checkpoint:
        return types.Checkpoint(
            checkpoint_id=row.checkpoint_id,
            checkpoint_type=row.checkpoint_type,  # type: ignore[arg-type]
            time=_iso(row.created_at),
            tinker_path=row.tinker_path,
            size_bytes=row.size_bytes,
            public=row.public,
            user_metadata=row.user_metadata,
            expires_at=None if row.expires_at is None else _iso(row.expires_at),
        )

    async def list_checkpoints(self, training_run_id: str) -> types.CheckpointsListResponse:
        def work() -> types.CheckpointsListResponse:
            if self.store.get_run(training_run_id) is None:
                raise EngineNotFoundError(f"unknown training run {training_run_id!r}")
            rows, _ = self.store.list_checkpoints(training_run_id)
            return types.CheckpointsListResponse(
                checkpoints=[self._checkpoint_type(r) for r in rows]
            )

        return await self._run(work)

    async def list_user_checkpoints(
        self, *, limit: int = 100, offset: int = 0
    ) -> types.CheckpointsListResponse:
        def work() -> types.CheckpointsListResponse:
            rows, _total = self.store.list_checkpoints(None, limit=limit, offset=offset)
            return types.CheckpointsListResponse(
                checkpoints=[self._checkpoint_type(r) for r in rows]
            )

        return await self._run(work)

    def _training_run(self, run_id: str) -> types.TrainingRun:
        run = self.store.get_run(run_id)
        if run is None:
            raise EngineNotFoundError(f"unknown training run {run_id!r}")
        rows, _ = self.store.list_checkpoints(run_id)
        last = {
            kind: max(
                (r for r in rows if r.checkpoint_type == kind),
                key=lambda r: r.created_at,
                default=None,
            )
            for kind in ("training", "sampler")
        }
        return types.TrainingRun(
            training_run_id=run.run_id,
            base_model=run.base_model,
            model_owner=run.session_id,
            is_lora=True,
            lora_rank=run.lora_rank,
            last_request_time=_iso(run.last_request_time),
            last_checkpoint=None
            if last["training"] is None
            else self._checkpoint_type(last["training"]),
            last_sampler_checkpoint=None
            if last["sampler"] is None
            else self._checkpoint_type(last["sampler"]),
            user_metadata=run.user_metadata,
        )

    async def get_training_run(self, training_run_id: str) -> types.TrainingRun:
        return await self._run(lambda: self._training_run(training_run_id))

    async def list_training_runs(
        self, *, limit: int = 20, offset: int = 0
    ) -> types.TrainingRunsResponse:
        def work() -> types.TrainingRunsResponse:
            runs, total = self.store.list_runs(limit=limit, offset=offset)
            return types.TrainingRunsResponse(
                training_runs=[self._training_run(r.run_id) for r in runs],
                cursor=types.Cursor(offset=offset, limit=limit, total_count=total),
            )

        return await self._run(work)

    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> None:
        def work() -> None:
            path = f"tinker://{training_run_id}/{checkpoint_id}"
            _parse_path(path)
            row = self.store.delete_checkpoint(path)
            if row is None:
                raise EngineNotFoundError(f"checkpoint {path} does not exist")
            Path(row.file_path).unlink(missing_ok=True)

        await self._run(work)

    async def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        def work() -> None:
            _parse_path(tinker_path)
            expires_at = _expiry(ttl_seconds)
            self._live_checkpoint(tinker_path)
            self.store.set_checkpoint_expiry(tinker_path, expires_at)

        await self._run(work)

    async def get_checkpoint(self, tinker_path: str) -> types.Checkpoint:
        def work() -> types.Checkpoint:
            return self._checkpoint_type(self._live_checkpoint(tinker_path))

        return await self._run(work)

    def checkpoint_info(self, tinker_path: str) -> dict[str, Any]:
        """Base model and LoRA config of a checkpoint (for ``weights_info``)."""
        _, run = self._checkpoint_run(tinker_path)
        return {"base_model": run.base_model, "is_lora": True, **run.lora_config}

    async def get_weights_info(self, tinker_path: str) -> types.WeightsInfoResponse:
        def work() -> types.WeightsInfoResponse:
            info = self.checkpoint_info(tinker_path)
            return types.WeightsInfoResponse(
                base_model=info["base_model"],
                is_lora=True,
                lora_rank=info.get("rank"),
                train_unembed=info.get("train_unembed"),
                train_mlp=info.get("train_mlp"),
                train_attn=info.get("train_attn"),
            )

        return await self._run(work)

    async def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        def work() -> None:
            self._live_checkpoint(tinker_path)
            self.store.set_checkpoint_public(tinker_path, public)

        await self._run(work)

    async def copy_weights(
        self,
        source_path: str,
        *,
        session_id: str | None = None,
        model_seq_id: int | None = None,
        destination_project_id: str | None = None,
        ttl_seconds: int | None = None,
        weights_access_token: str | None = None,
    ) -> str:
        """See `Backend.copy_weights`. The copy's file is a hard link to the source's where
        the file system allows (no bytes duplicated; deleting either leaves the other
        intact), else a byte copy."""

        def work() -> str:
            parsed = _parse_path(source_path)
            if weights_access_token is not None:
                raise EngineUserError(
                    "weights_access_token is not supported: tinker_sr has no cross-account "
                    "access; copy checkpoints your own key can read (omit the token)"
                )
            if (session_id is None) != (model_seq_id is None):
                raise EngineUserError(
                    "copy_weights: pass session_id and model_seq_id together (copy into that "
                    "run slot), or neither (copy into a new session)"
                )
            if model_seq_id is not None and model_seq_id < 0:
                raise EngineUserError(f"model_seq_id must be >= 0, got {model_seq_id}")
            expires_at = _expiry(ttl_seconds)
            row, source_run = self._checkpoint_run(source_path)
            if session_id is None:
                sid = self._add_session(
                    user_metadata=None, project_id=destination_project_id, display_name=None
                )
                run_id = self._new_model_id(sid, 0)
            else:
                self._check_session(session_id)
                assert model_seq_id is not None
                sid, run_id = session_id, self._new_model_id(session_id, model_seq_id)
            segment, name = parsed.checkpoint_id.split("/", 1)
            target = self._ckpt_file(run_id, segment, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
            try:
                os.link(row.file_path, tmp)
            except OSError:
                shutil.copyfile(row.file_path, tmp)
            os.replace(tmp, target)
            new_path = f"tinker://{run_id}/{parsed.checkpoint_id}"
            self.store.add_run(
                run_id, sid, source_run.base_model, source_run.lora_config, user_metadata=None
            )
            self.store.put_checkpoint(
                CheckpointRow(
                    run_id=run_id,
                    checkpoint_id=parsed.checkpoint_id,
                    checkpoint_type=row.checkpoint_type,
                    tinker_path=new_path,
                    file_path=str(target),
                    created_at=time.time(),
                    size_bytes=row.size_bytes,
                    user_metadata=row.user_metadata,
                    expires_at=expires_at,
                )
            )
            if session_id is None:
                self.store.close_session(sid, "success")  # it only holds the copy
            return new_path

        return await self._run(work)

    async def get_external_weights_urls(
        self, tinker_path: str
    ) -> types.ExternalWeightsUrlsResponse:
        raise NotImplementedError(
            f"get_external_weights_urls({tinker_path!r}): the tinker_sr engine produces no "
            "external (Hugging Face) weights, because save_weights_external is not supported; "
            "save with save_state or save_weights_for_sampler and load those paths instead"
        )

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self.store.close()


# ---- helpers -----------------------------------------------------------------------------


@dataclass
class _DatumArrays:
    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray]  # includes target_tokens


def _check_k(field_name: str, k: int, vocab: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 0 <= k <= vocab:
        raise EngineUserError(
            f"{field_name} must be an integer in [0, vocab size = {vocab}], got {k!r}"
        )


def _target_ids(td: types.TensorData, prompt_len: int, vocab: int) -> np.ndarray:
    """The request's target_prompt_logprobs as a dense int64 [len(prompt) - 1, K] array (-1 =
    nothing requested), validated."""
    if td.dtype != "int64":
        raise EngineUserError(
            f"target_prompt_logprobs must be an int64 tensor of token ids, got {td.dtype}"
        )
    try:
        ids = np.asarray(td.to_numpy(pad_value=-1), dtype=np.int64)
    except ValueError as e:
        raise EngineUserError(f"target_prompt_logprobs: {e}") from None
    if ids.ndim != 2 or ids.shape[0] != prompt_len - 1:
        raise EngineUserError(
            f"target_prompt_logprobs must have shape [len(prompt) - 1 = {prompt_len - 1}, K] "
            f"(row i is scored at prompt position i + 1), got {list(ids.shape)}"
        )
    bad = (ids < -1) | (ids >= vocab)
    if bad.any():
        r, c = (int(x[0]) for x in np.nonzero(bad))
        raise EngineUserError(
            f"target_prompt_logprobs: id {int(ids[r, c])} at [{r}, {c}] is outside the vocabulary "
            f"[0, {vocab}); use -1 for cells that request nothing"
        )
    if not (ids >= 0).any():
        raise EngineUserError(
            "target_prompt_logprobs holds no token id (every cell is -1); request at least one"
        )
    return ids


def _like_request(dense: np.ndarray, request: types.TensorData) -> types.TensorData:
    """float32 logprobs in the request's layout: dense stays dense, CSR keeps its pattern."""
    dense = np.asarray(dense, dtype=np.float32)
    if request.sparse_crow_indices is None:
        return types.TensorData(data=dense, dtype="float32", shape=list(dense.shape))
    crow = np.asarray(request.sparse_crow_indices, dtype=np.int64)
    col = np.asarray(request.sparse_col_indices, dtype=np.int64)
    rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    return types.TensorData(
        data=np.ascontiguousarray(dense[rows, col]),
        dtype="float32",
        shape=list(dense.shape),
        sparse_crow_indices=list(request.sparse_crow_indices),
        sparse_col_indices=list(request.sparse_col_indices or []),
    )


def _prompt_tokens(prompt: types.ModelInput, vocab: int) -> list[int]:
    for i, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise EngineUserError(
                f"prompt chunk {i} is a {type(chunk).__name__}; the tinker_sr engine only "
                "accepts EncodedTextChunk (text models)"
            )
    tokens = prompt.to_ints()
    if not tokens:
        raise EngineUserError("prompt is empty; pass at least one token")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise EngineUserError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); "
            f"{len(bad)} token(s) out of range"
        )
    return tokens


def _datum_arrays(i: int, d: types.Datum, vocab: int, max_len: int) -> _DatumArrays:
    for j, chunk in enumerate(d.model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise EngineUserError(
                f"datum {i}: model_input chunk {j} is a {type(chunk).__name__}; the tinker_sr "
                "engine only accepts EncodedTextChunk"
            )
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
        )
    inputs: dict[str, np.ndarray] = {}
    for key, td in d.loss_fn_inputs.items():
        arr = td.to_numpy()
        if arr.ndim == 0 or arr.shape[0] != n:
            rows = "a scalar" if arr.ndim == 0 else f"{arr.shape[0]} rows"
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs[{key!r}] has {rows} but model_input has {n} tokens; "
                "every loss input needs one row per input position"
            )
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


def _stop_conditions(
    stop: str | Sequence[str] | Sequence[int] | None, eos: int
) -> tuple[list[int], list[str]]:
    if stop is None:
        return [eos], []
    if isinstance(stop, str):
        return [eos], [stop]
    items = list(stop)
    if not items:
        return [], []  # [] = no stop condition at all, not even EOS
    if all(isinstance(s, str) for s in items):
        return [eos], [str(s) for s in items]
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        return [eos, *(int(s) for s in items if isinstance(s, int))], []
    raise EngineUserError(
        "sampling_params.stop must be a string, a list of strings or a list of ints"
    )


def _expiry(ttl_seconds: int | None) -> float | None:
    """Expiry time for ``ttl_seconds`` (3600 s to 10 years; ``None`` = never expires)."""
    if ttl_seconds is None:
        return None
    if not (_TTL_MIN <= ttl_seconds <= _TTL_MAX):
        raise EngineUserError(
            f"ttl_seconds must be between {_TTL_MIN} (1 hour) and {_TTL_MAX} (10 years), or "
            f"None for no expiry; got {ttl_seconds}"
        )
    return time.time() + ttl_seconds


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or len(name) > 200:
        raise EngineUserError(
            f"checkpoint name {name!r} is invalid: use 1-200 characters without '/'"
        )


def _parse_path(path: str) -> types.ParsedCheckpointTinkerPath:
    try:
        return types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError as e:
        raise EngineUserError(
            f"{e}; expected tinker://<run_id>/<weights|sampler_weights>/<name>"
        ) from e


def _lora_spec(cfg: types.LoraConfig) -> LoraSpec:
    if cfg.rank < 1:
        raise EngineUserError(f"lora_config.rank must be >= 1, got {cfg.rank}")
    if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
        raise EngineUserError(
            "lora_config: at least one of train_attn/train_mlp/train_unembed must be true"
        )
    return LoraSpec(
        rank=cfg.rank,
        seed=cfg.seed,
        train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp,
        train_unembed=cfg.train_unembed,
    )


def _lora_json(spec: LoraSpec) -> dict[str, Any]:
    return {
        "rank": spec.rank,
        "seed": spec.seed,
        "train_attn": spec.train_attn,
        "train_mlp": spec.train_mlp,
        "train_unembed": spec.train_unembed,
        "alpha": spec.alpha,
    }


def _check_optimizer_config(cfg: Any) -> None:
    kind = getattr(cfg, "type", "adamw") if cfg is not None else "adamw"
    if kind != "adamw":
        raise EngineUserError(
            f"optimizer {kind!r} is not supported by the tinker_sr engine; use AdamOptimizerConfig()"
        )


def _adam_hparams(p: Any) -> AdamHParams:
    if not isinstance(p, types.AdamParams):
        raise EngineUserError(
            f"this model uses AdamW; optim_step needs AdamParams, got {type(p).__name__}"
        )
    vals = {
        "learning_rate": p.learning_rate,
        "beta1": p.beta1,
        "beta2": p.beta2,
        "eps": p.eps,
        "weight_decay": p.weight_decay,
        "grad_clip_norm": p.grad_clip_norm,
    }
    for k, v in vals.items():
        if not np.isfinite(v):
            raise EngineUserError(f"AdamParams.{k} must be finite, got {v}")
    if p.learning_rate < 0:
        raise EngineUserError(f"AdamParams.learning_rate must be >= 0, got {p.learning_rate}")
    if not (0 <= p.beta1 < 1 and 0 <= p.beta2 < 1):
        raise EngineUserError("AdamParams.beta1 and beta2 must be in [0, 1)")
    if p.eps <= 0 or p.weight_decay < 0 or p.grad_clip_norm < 0:
        raise EngineUserError("AdamParams.eps must be > 0; weight_decay and grad_clip_norm >= 0")
    return AdamHParams(**vals)


def _snapshot(model: Transformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in lora_state_dict(model).items()}


def _strip(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _restore(
    model: Transformer, optim: Adam, tensors: Mapping[str, torch.Tensor], with_optimizer: bool
) -> None:
    load_lora_state_dict(model, _strip(tensors, "lora."))
    if with_optimizer:
        optim_state = _strip(tensors, "optim.")
        if not optim_state:
            raise EngineUserError(
                "checkpoint has no optimizer state; load it without the optimizer"
            )
        optim.load_state_dict(optim_state)


def _parse_dtype(d: str | torch.dtype | None) -> torch.dtype:
    if d is None:
        return torch.float32
    if isinstance(d, torch.dtype):
        return d
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if d not in table:
        raise ValueError(f"sampler_dtype must be one of {sorted(table)}, got {d!r}")
    return table[d]
