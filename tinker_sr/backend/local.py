"""`LocalBackend`: the embedded engine behind the `Backend` protocol.

This module is the workers, the ordering and the session lifecycle; the engine work lives in
`engine.registry` (models), `engine.training`, `engine.sampling`, `engine.checkpoint_store`.

Torch work runs on two threads, so the caller's event loop never blocks: the engine worker
(training, checkpoints, sessions; one request at a time, in arrival order) and the sampling
worker (`engine.scheduler`: in-flight samples decode in one batch), so an async RL loop's
sampling and training do not wait for each other. Results are deterministic: a sampler decodes
an immutable snapshot of its weights, the registry is locked, and a request's samples are
bit-identical whatever decodes beside them. A model's training requests execute strictly in
``seq_id`` order. A request that fails validation raises before anything (weights, optimizer
state, gradients, checkpoints, recorded sequences) is changed.

Off-policy stress for studies: ``sampler_dtype="bfloat16"`` samples in bfloat16 beside a
float32 learner; ``sampler_staleness=k`` gives samplers snapshotted from a training model its
weights of ``k`` optimizer steps earlier, as asynchronous RL does (named sampler checkpoints
hold the current weights). By default samplers keep the base model's dtype, and an HF directory
loads in its own (``model_dtype=`` or ``$TINKER_SR_MODEL_DTYPE``; docs/models.md).
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

from tinker_sr import types, validation
from tinker_sr.backend.base import WorkNotStarted
from tinker_sr.backend.local_errors import mapped, refused, user_error
from tinker_sr.backend.local_rest import LocalRestQueries
from tinker_sr.backend.ordering import SeqOrdering
from tinker_sr.backend.session_samples import SessionSamples
from tinker_sr.engine import training, usage
from tinker_sr.engine.checkpoint_store import CheckpointStore
from tinker_sr.engine.checkpoints import read_record
from tinker_sr.engine.cpu import (
    default_torch_threads,
    engine_executor,
    return_freed_memory,
    threads_within_task_limit,
    tune_allocator,
)
from tinker_sr.engine.device import resolve_device
from tinker_sr.engine.external_weights import save_external
from tinker_sr.engine.hf import env_model_dtype, parse_dtype
from tinker_sr.engine.registry import ModelRegistry, Sampler, Trainer
from tinker_sr.engine.sampler import LogprobsMode, NewTokens
from tinker_sr.engine.sampling import SampleRequest, SequenceRecorder, Started, request_overflow
from tinker_sr.engine.sampling import begin as begin_sample
from tinker_sr.engine.scheduler import DecodeScheduler
from tinker_sr.engine.set_aside import checkpoint_sampler
from tinker_sr.engine.store import Store, default_store_dir, make_store_dir
from tinker_sr.engine.store_files import record_done_work
from tinker_sr.engine.usage import RateCard
from tinker_sr.errors import APIStatusError, refusal
from tinker_sr.hf_files import is_model_dir
from tinker_sr.limits import DEFAULT_LIMITS, Limits
from tinker_sr.model_aliases import env_aliases, parse_aliases
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError

__all__ = ["LocalBackend", "default_store_dir", "parse_aliases"]

T = TypeVar("T")


class LocalBackend(LocalRestQueries):
    """Runs the embedded PyTorch engine in-process. One instance can serve many sessions."""

    # The engine implements loss_fn="stable_reinforce" and records its own stability draws,
    # so a client's StableReinforce lowering has nothing to probe or keep (sr_lowering).
    native_stable_reinforce = True
    in_process = True  # its sessions are reachable from this process only

    def __init__(
        self,
        store_dir: str | Path | None = None,
        *,
        model_aliases: Mapping[str, str] | None = None,
        sampler_dtype: str | torch.dtype | None = None,
        model_dtype: str | torch.dtype | None = None,
        sampler_staleness: int = 0,
        persistent: bool = True,
        torch_threads: int | None = None,
        limits: Limits | None = None,
        request_model_paths: bool = True,
        device: str | torch.device | None = None,
        rate_card: str | Path | RateCard | None = None,
    ) -> None:
        """``limits``: the size limits every request is held to (`tinker_sr.limits.Limits`;
        ``tinker-sr serve`` sets them from its flags). ``request_model_paths``: may
        ``base_model`` name a local directory (False on a server: only aliases may).
        ``device``: ``cpu`` (default), ``cuda`` or ``auto`` (`tinker_sr.engine.device`;
        default ``$TINKER_SR_DEVICE``); ``cuda`` without a usable GPU is a ValueError.
        ``rate_card``: prices for the usage `AdminClient.get_billing_usage` reports (a JSON
        file or a `RateCard`, `tinker_sr.engine.usage`; default ``$TINKER_SR_RATE_CARD``;
        none: usage is counted, not priced)."""
        engine_device = resolve_device(device, what="LocalBackend(device=...)")
        tune_allocator()  # before the engine's threads exist; $TINKER_SR_MALLOC_TUNING=0: off
        self.limits = limits if limits is not None else DEFAULT_LIMITS
        self.rate_card = RateCard.resolve(rate_card)
        store = Path(store_dir).expanduser() if store_dir is not None else default_store_dir()
        self.store_dir = store.absolute()  # a later chdir changes nothing
        make_store_dir(self.store_dir)
        self.store = Store(self.store_dir / "engine.sqlite" if persistent else None)
        aliases = env_aliases()
        aliases.update(model_aliases or {})
        self.models = ModelRegistry(
            aliases,
            sampler_dtype=parse_dtype(sampler_dtype, "sampler_dtype"),
            model_dtype=parse_dtype(model_dtype, "model_dtype") or env_model_dtype(),
            request_paths=request_model_paths,
            device=engine_device,
        )
        if sampler_staleness < 0:
            raise ValueError(f"sampler_staleness must be >= 0, got {sampler_staleness}")
        self.sampler_staleness = sampler_staleness
        self.checkpoints = CheckpointStore(self.store, self.store_dir)
        self.models.set_aside.checkpoints = self.checkpoints  # brings let-go samplers back
        self._recorder = SequenceRecorder(self.store)
        self._torch_threads = threads_within_task_limit(default_torch_threads(torch_threads))
        self._executor = engine_executor(self._torch_threads)
        try:
            self._scheduler = DecodeScheduler(self._torch_threads)
        except BaseException:  # its thread refused (ThreadLimitError): no worker left behind
            self._executor.shutdown(wait=False)
            raise
        self._session_samples = SessionSamples()
        weakref.finalize(self, self._scheduler.close, False)  # dropped unclosed: it still ends
        self._ordering = SeqOrdering(self.limits)
        self._closed = self._stopping = False

    @property
    def sampler_dtype(self) -> torch.dtype | None:
        """The dtype of sampling weights; None = the base model's own."""
        return self.models.sampler_dtype

    # ---- plumbing ---------------------------------------------------------------------
    async def _run(self, fn: Callable[[], T], *, plain: bool = False) -> T:
        """Run engine work on the worker thread; a refused request fails as a future does
        (`RequestFailedError`), or with ``plain`` (a direct call) as a server's HTTP refusal."""
        if self._closed:
            raise RuntimeError("LocalBackend is closed")
        loop = asyncio.get_running_loop()

        def call() -> T:
            if self._stopping:
                raise WorkNotStarted("the server is stopping")
            torch.set_num_threads(self._torch_threads)
            return fn()

        return await mapped(loop.run_in_executor(self._executor, call), self.store_dir, plain=plain)

    async def _on_sampler(self, future: Future[T]) -> T:
        """Await work of the sampling worker; map engine errors to Tinker errors."""
        return await mapped(asyncio.wrap_future(future), self.store_dir)

    async def stop_starting(self) -> None:
        """At a server's shutdown: work not yet started never starts (`WorkNotStarted`), so
        only the request running is waited for, and its result is recorded."""
        self._stopping = True
        await self._ordering.stop_starting()

    async def _in_order(self, model_id: str, seq_id: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker when every earlier ``seq_id`` of ``model_id`` has finished."""
        try:
            return await self._ordering.run(model_id, seq_id, lambda: self._run(fn))
        except EngineUserError as e:  # from the ordering; the work's errors are mapped by _run
            # A request arriving after its session closed (its model's order is gone).
            raise user_error(str(self._ended(model_id) or e)) from None

    async def release_seq(self, model_id: str, seq_id: int) -> None:
        """Give up ``seq_id`` of ``model_id`` (see `SeqOrdering.release`)."""
        await self._ordering.release(model_id, seq_id)

    async def _refuse_numbered(self, model_id: str, seq_id: int, problem: str | None) -> None:
        """Refuse a numbered request as a server does before accepting it (400, number freed)."""
        if problem is not None:
            await self.release_seq(model_id, seq_id)
            raise refusal(400, problem)

    async def _trainer_work(self, model_id: str, seq_id: int, fn: Callable[[Trainer], T]) -> T:
        """Run ``fn`` on ``model_id``'s trainer, in ``seq_id`` order."""
        return await self._in_order(model_id, seq_id, lambda: fn(self._trainer(model_id)))

    def _ended(self, model_id: str) -> EngineUserError | None:
        """The error of a request for a model whose session ended before the request ran."""
        if self.models.has_trainer(model_id) or not (end := self.store.run_session_end(model_id)):
            return None
        return EngineUserError(
            f"model {model_id} belongs to finished session {end[0]} (it ended, status "
            f"{end[1]!r}, before this request ran: close() was called, or it expired); load "
            "its checkpoint from a new ServiceClient"
        )

    def _trainer(self, model_id: str) -> Trainer:
        if (ended := self._ended(model_id)) is not None:
            raise ended  # a request still waiting its turn when the session closed
        return self.models.trainer(model_id)

    # ---- models -----------------------------------------------------------------------
    def available_models(self) -> list[str]:
        return self.models.available_models()

    def model_tokenizer(self, name: str) -> Any:
        """The Hugging Face-style tokenizer of base model ``name`` (aliases resolved): what
        ``get_tokenizer()`` returns on the embedded engine."""
        return self.models.tokenizer(name).hf

    def resolve_model(self, name: str) -> str:
        """Map a requested base model name to a built-in name or a local directory."""
        return self.models.resolve_model(name)

    # ---- sessions ---------------------------------------------------------------------
    async def create_session(
        self,
        *,
        user_metadata: Mapping[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        tags: Sequence[str] = (),
    ) -> str:
        try:
            tag_list = validation.check_session_fields(
                user_metadata, project_id, display_name, tags
            )
        except EngineUserError as e:
            raise refused(e) from None
        return self._add_session(
            user_metadata=user_metadata,
            project_id=project_id,
            display_name=display_name,
            tags=tag_list,
        )

    def _add_session(
        self,
        *,
        user_metadata: Mapping[str, str] | None,
        project_id: str | None,
        display_name: str | None,
        tags: list[str] | None = None,
    ) -> str:
        session_id = f"sess-{uuid.uuid4().hex[:16]}"
        self.store.add_session(
            session_id,
            user_metadata=dict(user_metadata or {}),
            project_id=project_id,
            display_name=display_name,
            tags=tags,
        )
        return session_id

    async def close_session(self, session_id: str, status: str, detail: str | None = None) -> None:
        self.store.close_session(session_id, status)

        def release() -> None:  # on the worker: work queued for its models finishes first
            self._scheduler.prompt_cache.drop_scope(session_id)  # no prompt of it comes again
            for model_id in self.models.release_session(session_id):
                self._ordering.remove(model_id)

        if not self._closed:
            await self._session_samples.wait(session_id)  # its samples made before: first
            await self._run(release)

    def _check_session(self, session_id: str) -> None:
        if not self.store.session_exists(session_id):
            raise EngineNotFoundError(f"unknown session_id {session_id!r}; create a session first")

    async def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        models = [
            types.SupportedModel(
                model_name=name, max_context_length=context, trainable=True, sampleable=True
            )
            for name, context in self.models.context_lengths().items()
        ]
        return types.GetServerCapabilitiesResponse(supported_models=models)

    # ---- training models --------------------------------------------------------------
    def has_trainer(self, model_id: str) -> bool:
        """Whether ``model_id``'s weights are loaded here (not after a server restart)."""
        return self.models.has_trainer(model_id)

    def _recorded(self, name: str, resolved: str) -> str:
        """The base model name a run, checkpoint or sampler records: a relative (or ``~``)
        directory path, resolved as a path, as that absolute directory, so the checkpoint names
        the same base model from any working directory (``"./model"`` named another after a
        ``chdir``); anything else as given: a Hub name, an absolute path, and every name a
        server resolves (by its aliases only, which know the name, not the directory)."""
        aliases, path = self.models.aliases, Path(name).expanduser()
        relative = not path.is_absolute() or name.startswith("~")
        if not relative or not self.models.request_paths or name in aliases or "*" in aliases:
            return name
        if is_model_dir(path) and str(path.resolve()) == resolved:
            return resolved
        return name

    def _new_model_id(self, session_id: str, model_seq_id: int) -> str:
        model_id = f"{session_id}:train:{model_seq_id}"
        if self.models.has_trainer(model_id) or self.store.get_run(model_id) is not None:
            raise EngineUserError(
                f"model_seq_id {model_seq_id} is already used in session {session_id}; "
                "use the next integer"
            )
        return model_id

    def _register_trainer(self, trainer: Trainer, user_metadata: Mapping[str, str] | None) -> None:
        validation.check_user_metadata(user_metadata, "create_model")
        training.start_history(trainer, self.sampler_staleness)
        self.models.register_trainer(trainer)
        self._ordering.add(trainer.model_id)
        self.store.add_run(
            trainer.model_id,
            trainer.session_id,
            trainer.base_model,
            training.lora_json(trainer.lora),
            dict(user_metadata) if user_metadata else None,
        )

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
            validation.check_model_seq_id(model_seq_id, "create_model")
            validation.check_optimizer_config(optimizer_config)
            model_id = self._new_model_id(session_id, model_seq_id)
            resolved = self.models.resolve_model(base_model)
            self.limits.check_lora_rank(lora_config.rank)
            experts = bool(self.models.base(resolved).config.moe_layers)  # loads it, as training
            spec = training.lora_spec(lora_config, experts=experts)
            model, optim = self.models.new_trainable(resolved, spec)
            name = self._recorded(base_model, resolved)
            self._register_trainer(
                Trainer(model_id, session_id, name, resolved, spec, model, optim),
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
            validation.check_model_seq_id(model_seq_id, "create_model")
            validation.check_optimizer_config(optimizer_config)
            model_id = self._new_model_id(session_id, model_seq_id)
            tensors, meta = self.checkpoints.load(path, expect="training")
            record = read_record(meta, tensors, path)
            spec, name = record.lora, record.base_for(base_model, self.models.resolve_model, path)
            resolved = self.models.resolve_model(name)
            name = self._recorded(name, resolved)
            model, optim = self.models.new_trainable(resolved, spec)
            training.restore(model, optim, tensors, with_optimizer)
            trainer = Trainer(model_id, session_id, name, resolved, spec, model, optim)
            trainer.steps = record.steps if with_optimizer else 0
            self._register_trainer(trainer, user_metadata)
            return model_id

        await self._readable(path)
        return await self._run(work)

    async def get_info(self, model_id: str) -> types.GetInfoResponse:
        def work() -> types.GetInfoResponse:
            t = self.models.trainer(model_id)
            tokenizer_id = self.models.tokenizer(t.base_model).tokenizer_id
            return types.GetInfoResponse(
                type="get_info",
                model_data=types.ModelData(
                    arch="transformer", model_name=t.base_model, tokenizer_id=tokenizer_id
                ),
                model_id=model_id,
                is_lora=True,
                lora_rank=t.lora.rank,
                model_name=t.base_model,
            )

        return await self._run(work, plain=True)

    # ---- training ---------------------------------------------------------------------
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
        await self._refuse_numbered(model_id, seq_id, None if loss_fn else validation.EMPTY_LOSS_FN)
        return await self._trainer_work(
            model_id,
            seq_id,
            lambda t: training.forward_backward(
                t, self.store, data, loss_fn, loss_fn_config, forward_only, self.limits
            ),
        )

    async def optim_step(
        self, model_id: str, seq_id: int, adam_params: types.AdamParams
    ) -> types.OptimStepResponse:
        problem = validation.unsupported_optimizer(adam_params)  # as the server: 400, freed
        await self._refuse_numbered(
            model_id,
            seq_id,
            problem or validation.non_finite(adam_params, "optim_step: adam_params"),
        )
        return await self._trainer_work(
            model_id,
            seq_id,
            lambda t: training.optim_step(
                t, self.store, adam_params, staleness=self.sampler_staleness
            ),
        )

    # ---- checkpoints of a training model ----------------------------------------------
    def _save(
        self,
        t: Trainer,
        segment: str,
        name: str,
        ttl_seconds: int | None,
        overwrite: bool,
        user_metadata: Mapping[str, str] | None,
    ) -> str:
        """Checkpoint ``t``: training state (``weights``) or current adapters (``sampler_weights``)."""
        validation.check_user_metadata(user_metadata, f"save ({segment})")
        tensors = training.state_tensors(t) if segment == "weights" else training.sampler_tensors(t)
        path = self.checkpoints.write(
            t.model_id,
            segment,
            name,
            tensors,
            training.checkpoint_meta(t),
            ttl_seconds=ttl_seconds,
            overwrite=overwrite,
            user_metadata=user_metadata,
        )
        record_done_work(
            "a checkpoint's usage",
            lambda: self.store.add_usage(t.session_id, t.base_model, {usage.CHECKPOINT: 1}),
        )
        return path

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
        def work(t: Trainer) -> types.SaveWeightsResponse:
            path = self._save(t, "weights", name, ttl_seconds, overwrite, user_metadata)
            return types.SaveWeightsResponse(path=path, type="save_weights")

        await self._refuse_numbered(model_id, seq_id, None if name else validation.EMPTY_SAVE_PATH)
        return await self._trainer_work(model_id, seq_id, work)

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
        def work(t: Trainer) -> types.SaveWeightsForSamplerResponseInternal:
            if name is not None:
                # A named checkpoint is the current weights; only live samplers lag.
                path = self._save(t, "sampler_weights", name, ttl_seconds, False, user_metadata)
                return types.SaveWeightsForSamplerResponseInternal(
                    path=path, type="save_weights_for_sampler"
                )
            if sampling_session_seq_id is None:
                raise EngineUserError(
                    "save_weights_for_sampler needs either a name or a sampling_session_seq_id"
                )
            sampler_id = self.models.new_sampler_id(t.session_id, sampling_session_seq_id)
            adapters = training.sampler_adapters(t, self.sampler_staleness)
            self.models.register_sampler(
                Sampler(sampler_id, t.session_id, t.base_model, t.resolved, t.lora, None),
                adapters,
            )
            return types.SaveWeightsForSamplerResponseInternal(
                sampling_session_id=sampler_id, type="save_weights_for_sampler"
            )

        return await self._trainer_work(model_id, seq_id, work)

    async def load_state(
        self, model_id: str, seq_id: int, path: str, *, with_optimizer: bool
    ) -> types.LoadWeightsResponse:
        def work(t: Trainer) -> types.LoadWeightsResponse:
            tensors, meta = self.checkpoints.load(path, expect="training")
            training.load_state(t, path, tensors, meta, with_optimizer)
            return types.LoadWeightsResponse(path=path, model_id=model_id, type="load_weights")

        try:
            await self._readable(path)
        except APIStatusError:
            await self.release_seq(model_id, seq_id)  # later requests must not wait for it
            raise
        return await self._trainer_work(model_id, seq_id, work)

    async def _readable(self, path: str) -> None:
        """What a server checks before accepting a request that reads checkpoint ``path``: its
        form (`BadRequestError`) and its run (`NotFoundError`), not the checkpoint itself."""
        try:
            run_id = validation.checkpoint_path(path).training_run_id
        except EngineUserError as e:
            raise refused(e) from None
        if await self._run(lambda: self.store.get_run(run_id)) is None:
            raise refusal(404, f"checkpoint {path} does not exist")

    # ---- sampling ---------------------------------------------------------------------
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
            sampler_id = self.models.new_sampler_id(session_id, sampling_session_seq_id)
            spec, adapters, stamp = None, None, None
            if model_path is not None:
                name, spec, adapters, stamp = checkpoint_sampler(
                    self.checkpoints, model_path, base_model, self.models.resolve_model
                )
            else:
                assert base_model is not None
                name = base_model
            resolved = self.models.resolve_model(name)
            name = self._recorded(name, resolved)
            base = self.models.check_files(resolved)  # its files now; a checkpoint's
            source = None if stamp is None else (stamp, base)  # sampler keeps both (`set_aside`)
            sampler = Sampler(
                sampler_id, session_id, name, resolved, spec, model_path, source=source
            )
            self.models.register_sampler(sampler, adapters)
            return sampler_id

        return await self._run(work, plain=True)

    async def get_sampler_base_model(self, sampler_id: str) -> str:
        return (await self.get_sampler(sampler_id)).base_model

    async def get_sampler(self, sampler_id: str) -> types.GetSamplerResponse:
        s = self.models.live_sampler(sampler_id)  # a set-aside one's record: not loaded again
        if s is None:
            s = await self._run(lambda: self.models.sampler(sampler_id), plain=True)
        return types.GetSamplerResponse(
            sampler_id=sampler_id, base_model=s.base_model, model_path=s.model_path
        )

    def has_sampler(self, sampler_id: str) -> bool:
        """Whether ``sampler_id``'s weights are loaded here (not after a server restart)."""
        return self.models.live_sampler(sampler_id) is not None

    async def release_sampler(self, sampler_id: str) -> None:  # its creation went unrecorded
        await self._run(lambda: self.models.release_sampler(sampler_id))

    async def release_model(self, model_id: str) -> None:  # its TrainingClient was dropped
        self._ordering.remove(model_id)
        await self._run(lambda: self.models.release_trainer(model_id))
        return_freed_memory()  # else the tuned allocator keeps it (`cpu.tune_allocator`)

    def sample_overflow(
        self,
        sampler_id: str,
        prompt: Any,
        params: Any,
        num_samples: Any = None,
        sdk_hint: bool = True,
    ) -> str | None:
        """Why a sample does not fit its model's context (or, given ``num_samples``, this
        engine's `Limits.max_sample_tokens`), before it is queued (a 400; `context_overflow`)."""
        return request_overflow(
            self.models, sampler_id, prompt, params, num_samples, self.limits, sdk_hint
        )

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
        logprobs_mode: LogprobsMode = "sampled",
        progress: Callable[[list[NewTokens]], None] | None = None,
    ) -> types.SampleResponse:
        """``progress``: called (on the sampling worker) with each row's new tokens and their
        scores after the prefill and each decode step, for a server that streams its answer.
        ``logprobs_mode``: what the log-probs and top-k report: the sampling distribution's
        (the Tinker API's), or vLLM's "processed_logprobs" or "raw_logprobs" (the model's own;
        the OpenAI-compatible routes'), `engine.sampler`."""
        arguments = locals()  # the request's fields, by name
        req = SampleRequest(**{k: arguments[k] for k in SampleRequest.__dataclass_fields__})

        def begin() -> Started:
            sampler = self.models.sampler(sampler_id)
            return begin_sample(
                sampler,
                seq_id,
                req,
                tokenizer=self.models.tokenizer(sampler.base_model),
                recorder=self._recorder,
                limits=self.limits,
            )

        if self._closed:
            raise RuntimeError("LocalBackend is closed")
        if isinstance(num_samples, int):  # a server checks it before accepting the request
            try:
                validation.check_num_samples(num_samples, self.limits)
            except EngineUserError as e:
                raise refused(e) from None
        overflow = self.sample_overflow(sampler_id, prompt, sampling_params, num_samples)
        if overflow is not None:
            raise refusal(400, overflow)  # as a server (and the hosted service) refuses it
        rows = num_samples if isinstance(num_samples, int) else 1
        listen = None if progress is None else lambda g: progress(g.new_tokens())
        if sampler_id in self.models.set_aside:  # its checkpoint read off the sampling thread
            await mapped(asyncio.to_thread(self.models.bring_back, sampler_id), self.store_dir)
        live = self.models.live_sampler(sampler_id)
        tenant = live.session_id if live is not None else sampler_id
        future = self._scheduler.submit(begin, rows, listen, tenant)
        self._session_samples.add(live, future)
        return await self._on_sampler(future)

    async def save_weights_external(
        self,
        model_id: str,
        seq_id: int,
        name: str,
        *,
        ttl_seconds: int | None = None,
        age_encryption_recipients: Sequence[str] | None = None,
    ) -> types.SaveWeightsExternalResponse:
        """The adapters as ``tinker://<run>/external_weights/<name>`` (`external_weights`)."""

        def work(t: Trainer) -> types.SaveWeightsExternalResponse:
            path = save_external(self.checkpoints, t, name, ttl_seconds, age_encryption_recipients)
            return types.SaveWeightsExternalResponse(path=path, type="save_weights_external")

        return await self._trainer_work(model_id, seq_id, work)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._scheduler.close()
        self._executor.shutdown(wait=True)
        self.models.close()
        self.store.close()
