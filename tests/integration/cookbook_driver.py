"""Run one tinker-cookbook 0.6.1 recipe for a few steps on a local HF model directory.

Used by tests/integration/test_cookbook.py, both ways:

    tinker-sr run cookbook_driver.py JOB MODEL_DIR LOG_DIR        # embedded engine
    TINKER_BASE_URL=http://127.0.0.1:PORT python cookbook_driver.py JOB MODEL_DIR LOG_DIR
                                                                  # official SDK -> tinker-sr serve

The cookbook code runs unchanged; this script only builds its configs (tiny batches, a few
steps, the ``role_colon`` renderer whose stop sequence is the string ``"\\n\\nUser:"``) and
records every ``SamplingClient.sample`` call (its sampler, prompt, sampling params and each
sequence's tokens, log-probs and stop reason) to ``LOG_DIR/samples.jsonl`` so the test can
check how sampling stopped and which weights sampled. The evaluation jobs (``eval_rl``,
``eval_sl``, ``bench_gsm8k``) live in cookbook_evals.py. It also
refuses any connection that is not to 127.0.0.1 (the cookbook fetches a pricing file; tests
use no network).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import sys
from pathlib import Path
from typing import Any

JOBS = (
    "rl_is",
    "rl_ppo",
    "rl_gspo",
    "rl_async_sr",
    "rl_resume",
    "sl",
    "dpo",
    "distill",
    "rl_kl_stream",
    "rl_turns_sr",
    "rl_capture",
    "guess_number",
    "loop_sr",
    *("eval_rl", "eval_sl", "bench_gsm8k"),  # cookbook_evals.py
)
RENDERER = "role_colon"


def renderer_for(model: str) -> str:
    """``role_colon`` for a directory; for a Hub name (found in the local HF cache), the renderer
    the cookbook recommends for it, as a user's config would pick."""
    if Path(model).is_dir():
        return RENDERER
    from tinker_cookbook import model_info

    return model_info.get_recommended_renderer_name(model)


def forbid_network() -> None:
    real_connect = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> Any:
        host = address[0] if isinstance(address, tuple) else address
        if self.family in (socket.AF_INET, socket.AF_INET6) and host not in (
            "127.0.0.1",
            "::1",
            "localhost",
        ):
            raise OSError(f"cookbook_driver: network access to {host!r} refused (offline test)")
        return real_connect(self, address)

    socket.socket.connect = connect  # type: ignore[method-assign]


def record_samples(path: Path) -> None:
    """Wrap `tinker.SamplingClient.sample` (tinker_sr's or the SDK's) to log each call: the
    sampler's id, the prompt, the sampling params and each sequence's tokens, logprobs and stop
    reason."""
    import tinker

    original = tinker.SamplingClient.sample

    def log(call: dict[str, Any], params: Any, response: Any) -> None:
        sequences = [
            {
                "tokens": list(s.tokens),
                "stop_reason": str(s.stop_reason),
                "logprobs": list(s.logprobs or []),
            }
            for s in response.sequences
        ]
        row = {**call, "stop": params.stop, "max_tokens": params.max_tokens}
        row.update(temperature=params.temperature, sequences=sequences)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    class Recorded:
        def __init__(self, future: Any, call: dict[str, Any], params: Any) -> None:
            self._future, self._call, self._params = future, call, params

        def __await__(self) -> Any:
            response = yield from self._future.__await__()
            log(self._call, self._params, response)
            return response

        def result(self, timeout: float | None = None) -> Any:
            response = self._future.result(timeout)
            log(self._call, self._params, response)
            return response

        def __getattr__(self, name: str) -> Any:
            return getattr(self._future, name)

    def sample(self: Any, prompt: Any, num_samples: int, sampling_params: Any, *a: Any, **k: Any):
        # The sampler's id (the SDK's private name, which tinker_sr mirrors) and the prompt.
        call = {"sampler": self._sampling_session_id, "prompt": prompt.to_ints()}
        return Recorded(
            original(self, prompt, num_samples, sampling_params, *a, **k), call, sampling_params
        )

    tinker.SamplingClient.sample = sample  # type: ignore[method-assign]


def record_training(path: Path) -> None:
    """Wrap `tinker.TrainingClient.forward_backward` to log each call's loss and, per datum, the
    sequence ids its provenance names (the sampled spans of the targets) and the lengths of its
    model_input spans."""
    import tinker

    original = tinker.TrainingClient.forward_backward

    def forward_backward(self: Any, data: Any, loss_fn: Any, *a: Any, **k: Any) -> Any:
        rows = []
        for datum in data:
            spans = datum.loss_fn_input_spans or []
            sampled = [s for s in spans if isinstance(s, tinker.SampledProvenanceSpan)]
            ids, inputs = [s.sequence_id for s in sampled], datum.model_input_spans or []
            lengths = [s.length for s in inputs]
            rows.append({"sampled_ids": ids, "spans": len(spans), "input_lengths": lengths})
        with path.open("a") as f:
            f.write(json.dumps({"loss_fn": loss_fn, "datums": rows}) + "\n")
        return original(self, data, loss_fn, *a, **k)

    tinker.TrainingClient.forward_backward = forward_backward  # type: ignore[method-assign]


def no_pricing_download() -> None:
    from tinker_cookbook.utils import cost_estimation

    cost_estimation._pricing_fetched = True  # "already tried": no download, no prices


def digits_builder(model: str, n_batches: int, test_groups: int = 0) -> Any:
    """The cookbook's arithmetic problems, scored by the share of digits in the answer: a random
    tiny model never gets a sum right, and RL needs rewards that differ within a group. With
    `test_groups`, a test split too (that many groups of two, other problems than training's)."""
    import chz
    from tinker_cookbook.recipes.math_rl import arithmetic_env as ar

    class DigitsEnv(ar.ArithmeticEnv):
        def check_answer(self, sample_str: str) -> float:  # type: ignore[override]
            return sum(c.isdigit() for c in sample_str) / max(1, len(sample_str))

    class DigitsDataset(ar.ArithmeticDataset):
        seed_offset = 0  # the test split's problems come from other seeds

        def get_batch(self, index: int) -> Any:
            return super().get_batch(index + self.seed_offset)

        def _make_env_group_builder(self, rng: Any) -> Any:
            builder = super()._make_env_group_builder(rng)
            thunk = builder.env_thunk
            env = thunk.func  # partial(ArithmeticEnv, x, y, ...): swap in the digit score
            assert env is ar.ArithmeticEnv
            return ar.ProblemGroupBuilder(
                env_thunk=ar.partial(DigitsEnv, *thunk.args, **thunk.keywords),
                num_envs=builder.num_envs,
            )

    @chz.chz
    class DigitsBuilder(ar.ArithmeticDatasetBuilder):
        async def __call__(self) -> tuple[Any, Any]:
            tokenizer = ar.get_tokenizer(self.model_name_for_tokenizer)
            renderer = ar.renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
            dataset = DigitsDataset(
                batch_size=self.batch_size,
                renderer=renderer,
                group_size=self.group_size,
                n_batches=self.n_batches,
            )
            if not test_groups:
                return dataset, None
            test = DigitsDataset(
                batch_size=test_groups, renderer=renderer, group_size=2, n_batches=1
            )
            test.seed_offset = 1000
            return dataset, test

    return DigitsBuilder(
        batch_size=2,
        model_name_for_tokenizer=model,
        renderer_name=renderer_for(model),
        n_batches=n_batches,
        group_size=4,
    )


def turns_builder(model: str, n_batches: int, turns: int = 3) -> Any:
    """A multi-turn env whose every observation extends the last one token for token (the
    previous observation, the sampled action, then a user turn): the cookbook merges such a
    rollout into one datum whose provenance names every turn's sequence. Each turn is scored by
    the share of digits in it."""
    import chz
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.rl import types
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class TurnsEnv(types.Env):
        def __init__(self, renderer: Any, question: str) -> None:
            self.renderer, self.turn = renderer, 0
            self.ob = renderer.build_generation_prompt([{"role": "user", "content": question}])
            nudge = "\n\nUser: Digits only, please.\n\nAssistant:"
            self.user_turn = renderer.tokenizer.encode(nudge, add_special_tokens=False)

        async def initial_observation(self) -> Any:
            return self.ob, self.renderer.get_stop_sequences()

        async def step(self, action: Any, *, extra: Any = None) -> Any:
            self.turn += 1
            text = self.renderer.tokenizer.decode(action)
            reward = sum(c.isdigit() for c in text) / max(1, len(text))
            self.ob = self.ob.append(tinker.EncodedTextChunk(tokens=[*action, *self.user_turn]))
            return types.StepResult(
                reward=reward,
                episode_done=self.turn >= turns,
                next_observation=self.ob,
                next_stop_condition=self.renderer.get_stop_sequences(),
            )

    class TurnsGroup(types.EnvGroupBuilder):
        def __init__(self, renderer: Any, question: str) -> None:
            self.renderer, self.question = renderer, question

        async def make_envs(self) -> list[Any]:
            return [TurnsEnv(self.renderer, self.question) for _ in range(4)]

    class TurnsDataset(types.RLDataset):
        def __init__(self, renderer: Any) -> None:
            self.renderer = renderer

        def get_batch(self, index: int) -> list[Any]:
            return [TurnsGroup(self.renderer, f"What is {index} + {i}?") for i in range(2)]

        def __len__(self) -> int:
            return n_batches

    @chz.chz
    class TurnsBuilder(types.RLDatasetBuilder):
        async def __call__(self) -> tuple[Any, None]:
            renderer = renderers.get_renderer(renderer_for(model), tokenizer=get_tokenizer(model))
            return TurnsDataset(renderer), None

    return TurnsBuilder()


def rl_config(job: str, model: str, log: Path) -> Any:
    from tinker_cookbook.rl import train

    if job == "rl_turns_sr":
        builder = turns_builder(model, 2)
    else:
        builder = digits_builder(model, 3 if job in ("rl_async_sr", "rl_resume") else 2)
    extra: dict[str, Any] = {}
    if job == "rl_async_sr":
        extra["async_config"] = train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2)
    if job == "rl_kl_stream":  # KL penalty against the base, post-update KL, streamed halves
        extra.update(
            kl_penalty_coef=0.1,
            kl_reference_config=train.KLReferenceConfig(base_model=model),
            compute_post_kl=True,
            stream_minibatch_config=train.StreamMinibatchConfig(
                groups_per_batch=2, num_minibatches=2
            ),
        )
    loss = {
        "rl_is": "importance_sampling",
        "rl_ppo": "ppo",
        "rl_gspo": "gspo",
        "rl_turns_sr": "stable_reinforce",
    }.get(job)
    return train.Config(
        learning_rate=1e-3,
        dataset_builder=builder,
        model_name=model,
        recipe_name=f"tinker_sr_test_{job}",
        max_tokens=12,
        log_path=str(log),
        eval_every=0,
        save_every=1 if job == "rl_resume" else 0,
        renderer_name=renderer_for(model),
        lora_rank=4,
        loss_fn=loss or "importance_sampling",
        num_groups_to_log=0,
        enable_trace=job == "rl_capture",
        **extra,
    )


def run_rl(job: str, model: str, log: Path) -> dict[str, Any]:
    import chz
    from tinker_cookbook.rl import train

    config = rl_config(job, model, log)
    if job == "rl_capture":
        return run_captured(config, log)
    if job != "rl_resume":
        asyncio.run(train.main(config))
        return {}
    # Resume: one step with a checkpoint, then a second run on the same log_path continues it.
    asyncio.run(train.main(chz.replace(config, max_steps=1)))
    first = checkpoints(log)
    asyncio.run(train.main(chz.replace(config, max_steps=3)))
    return {"checkpoints_after_first_run": first}


def run_captured(config: Any, log: Path) -> dict[str, Any]:
    """The cookbook's debugging tools as a user wires them: ``enable_trace`` (its tracer wraps
    the clients' methods) and token-level capture (``capture.instrument_tinker`` patches
    ``SamplingClient.sample`` and the training ops) into ``LOG_DIR/capture/*.jsonl``."""
    from tinker_cookbook.capture import (
        CaptureExporter,
        JsonlFileSink,
        capture,
        instrument_tinker,
        uninstrument_tinker,
    )
    from tinker_cookbook.rl import train
    from tinker_cookbook.stores.storage import LocalStorage

    exporter = CaptureExporter(JsonlFileSink(LocalStorage(str(log))))
    instrument_tinker(exporter)
    try:
        with capture(run_id="tinker_sr_test"):
            asyncio.run(train.main(config))
    finally:
        uninstrument_tinker()
        exporter.wait_pending(timeout=30.0)
        exporter.shutdown()
    return {}


def conversations_builder(model: str, *, test_size: int = 0, **common: Any) -> Any:
    """The cookbook's example conversations as its SL dataset builder (batches of 4, up to 192
    tokens, ``common``: more of `ChatDatasetBuilderCommonConfig`; ``test_size`` held out)."""
    import importlib.resources

    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = importlib.resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    config = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model,
        renderer_name=renderer_for(model),
        max_length=192,
        batch_size=4,
        **common,
    )
    return FromConversationFileBuilder(
        common_config=config, file_path=str(data), test_size=test_size
    )


def run_sl(model: str, log: Path) -> dict[str, Any]:
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train

    builder = conversations_builder(model, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = train.Config(
        log_path=str(log),
        model_name=model,
        recipe_name="tinker_sr_test_sl",
        renderer_name=renderer_for(model),
        dataset_builder=builder,
        learning_rate=1e-3,
        lora_rank=4,
        eval_every=0,
        save_every=0,
        max_steps=3,
    )
    asyncio.run(train.main(config))
    return {}


def run_dpo(model: str, log: Path) -> dict[str, Any]:
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    pairs = log.parent / f"{log.name}-comparisons.jsonl"
    rows = []
    for a, b in [(2, 3), (4, 4), (10, 7), (1, 8)]:
        prompt = [{"role": "user", "content": f"What is {a} + {b}?"}]
        rows.append(
            {
                "comparison": {
                    "prompt_conversation": prompt,
                    "completion_A": [{"role": "assistant", "content": str(a + b)}],
                    "completion_B": [{"role": "assistant", "content": f"{a + b + 1} maybe"}],
                },
                "label": "A",
            }
        )
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model,
        renderer_name=renderer_for(model),
        max_length=64,
        batch_size=2,
    )
    config = train_dpo.Config(
        log_path=str(log),
        model_name=model,
        recipe_name="tinker_sr_test_dpo",
        renderer_name=renderer_for(model),
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=common,
            comparison_builder=ComparisonBuilderFromJsonl(train_path=str(pairs)),
        ),
        learning_rate=1e-3,
        lora_rank=4,
        eval_every=0,
        save_every=0,
        max_steps=2,
    )
    train_dpo.main(config)
    return {}


def run_distill(model: str, log: Path) -> dict[str, Any]:
    """On-policy distillation (``distillation.train_on_policy``): the student samples, the
    teacher scores the samples with ``compute_logprobs``, the advantage is the negative
    reverse KL. The teacher is the base model itself, so at step 0 (student = teacher) the KL
    is zero up to rounding; the student then moves away from it."""
    from tinker_cookbook.distillation import train_on_policy as distill
    from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, TeacherConfig

    config = distill.Config(
        learning_rate=1e-2,
        dataset_configs=[
            DistillationDatasetConfig(
                dataset_builder=digits_builder(model, 2),
                teacher_config=TeacherConfig(base_model=model),
                groups_per_batch=2,
            )
        ],
        model_name=model,
        recipe_name="tinker_sr_test_distill",
        renderer_name=renderer_for(model),
        max_tokens=12,
        lora_rank=4,
        log_path=str(log),
        eval_every=0,
        save_every=0,
    )
    asyncio.run(distill.main(config))
    return {}


def run_guess_number(model: str, log: Path) -> dict[str, Any]:
    """The multiplayer recipe ``guess_number`` as its CLI builds it (its renderer
    ``qwen3_5_disable_thinking``): a 10-turn game per episode against a scripted host, each
    turn's prompt the last one plus the reply and the host's answer."""
    from tinker_cookbook.recipes.multiplayer_rl.guess_number import train as guess

    cli = guess.CLIConfig(
        model_name=model,
        group_size=2,
        batch_size=1,
        max_tokens=16,
        eval_every=0,
        save_every=0,
        max_steps=1,
        log_path=str(log),
    )
    asyncio.run(guess.train.main(guess.build_config(cli)))
    return {}


def answer_in_one_token() -> None:
    """Sample every second prompt with ``max_tokens=1``, so every batch holds one-token samples
    (an empty model_input run in ``with_sampled_provenance``) whatever the random model writes:
    whether a sample ends after one token must not depend on the CPU's arithmetic. Installed
    outside `record_samples`, which logs the ``max_tokens`` actually sent."""
    import tinker

    inner, calls = tinker.SamplingClient.sample, [0]

    def sample(self: Any, prompt: Any, num_samples: int, sampling_params: Any, *a: Any, **k: Any):
        calls[0] += 1
        if calls[0] % 2:
            sampling_params = sampling_params.model_copy(update={"max_tokens": 1})
        return inner(self, prompt, num_samples, sampling_params, *a, **k)

    tinker.SamplingClient.sample = sample  # type: ignore[method-assign]


def run_rl_loop(model: str, log: Path) -> dict[str, Any]:
    """The cookbook's minimal RL loop (``recipes/rl_loop.py``, the one users copy) with its
    default loss, ``stable_reinforce``: datums built by hand, provenance named by
    ``Datum.with_provenance``. Offline stand-ins: a GSM8K-shaped dataset, and a reward that
    alternates 0, 1 within every group (the random model never writes a boxed answer), so every
    step trains; every second prompt answered in one token (`answer_in_one_token`)."""
    import datasets
    from tinker_cookbook.recipes import rl_loop

    rows = {
        "question": [f"What is {a} plus {b}?" for a in range(8) for b in range(4)],
        "answer": [f"{a} + {b} = {a + b}\n#### {a + b}" for a in range(8) for b in range(4)],
    }
    train = datasets.Dataset.from_dict(rows)
    datasets.load_dataset = lambda *a, **k: datasets.DatasetDict({"train": train})
    flips = itertools.cycle((0.0, 1.0))
    rl_loop.get_reward = lambda response, answer: next(flips)
    answer_in_one_token()
    config = rl_loop.Config(
        model_name=model,
        batch_size=2,
        group_size=4,
        max_tokens=12,
        max_steps=2,
        save_every=0,
        lora_rank=4,
        log_path=str(log),
    )
    rl_loop.main(config)
    return {}


def checkpoints(log: Path) -> list[dict[str, Any]]:
    path = log / "checkpoints.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str]) -> int:
    job, model, log_dir = argv
    if job not in JOBS:
        raise SystemExit(f"unknown job {job!r}; one of {', '.join(JOBS)}")
    log = Path(log_dir)
    log.mkdir(parents=True, exist_ok=True)
    forbid_network()
    no_pricing_download()
    record_samples(log / "samples.jsonl")
    record_training(log / "training.jsonl")
    if job.startswith("rl_"):
        summary = run_rl(job, model, log)
    elif job == "sl":
        summary = run_sl(model, log)
    elif job == "distill":
        summary = run_distill(model, log)
    elif job == "guess_number":
        summary = run_guess_number(model, log)
    elif job == "loop_sr":
        summary = run_rl_loop(model, log)
    elif job in ("eval_rl", "eval_sl", "bench_gsm8k"):
        from tests.integration import cookbook_evals

        summary = cookbook_evals.run(job, model, log)
    else:
        summary = run_dpo(model, log)
    import tinker

    summary.update(job=job, tinker_module=tinker.__name__, checkpoints=checkpoints(log))
    (log / "driver.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
