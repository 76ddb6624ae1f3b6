"""The evaluation jobs of cookbook_driver.py: how tinker-cookbook 0.6.1 users evaluate.

* ``eval_rl``: ``rl.train`` with ``eval_every=2`` over two steps, so its evaluators run on the
  initial weights (step 0) and on the final ones (step 2): the dataset builder's test split
  (the cookbook's ``RLTestSetEvaluator``) and, through ``evaluator_builders``, the GSM8K
  benchmark as an inline evaluator (``BenchmarkEvaluator``).
* ``eval_sl``: ``supervised.train`` with a test split (``test_size``) and ``eval_every=2``
  over 3 steps, pipelined as the cookbook does by default (``submit_ahead=1``: step 2's
  evaluation starts while step 1's ``forward_backward`` and ``optim_step`` are in flight). The
  test split is scored twice at each evaluation: by the cookbook's ``SamplerNLLEvaluator``
  (``compute_logprobs`` on a ``save_weights_and_get_sampling_client`` snapshot) and, through
  ``evaluator_builders``, by its ``NLLEvaluator`` (the training client's ``forward``).
* ``bench_gsm8k``: the standalone benchmark runner, ``run_benchmark("gsm8k", ...)``, on a
  checkpoint one supervised step away from the base (``create_sampling_client(model_path=)``),
  three times on one ``save_dir``: 3 examples, then 5 (the runner resumes from the 3 it saved),
  then 5 again (nothing left to sample).

GSM8K comes from the Hub (``datasets.load_dataset("openai/gsm8k")``); offline, the name
``gsm8k.py`` imported is replaced with a stand-in holding `GSM8K_ROWS`. Everything else is the
cookbook's own code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from tests.integration.cookbook_driver import (
    checkpoints,
    conversations_builder,
    digits_builder,
    renderer_for,
)

JOBS = ("eval_rl", "eval_sl", "bench_gsm8k")
# GSM8K-shaped rows (the answer's last line is "#### <number>"), one with a thousands comma.
GSM8K_ROWS = [
    {"question": "Ann has 3 apples and buys 4 more. How many apples does she have?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 12 pens. How many pens are in 3 boxes?",
     "answer": "12 * 3 = <<12*3=36>>36\n#### 36"},
    {"question": "Tom had 20 dollars and spent 8. How many dollars are left?",
     "answer": "20 - 8 = <<20-8=12>>12\n#### 12"},
    {"question": "A farm sells 250 eggs a day. How many eggs does it sell in 5 days?",
     "answer": "250 * 5 = <<250*5=1250>>1250\n#### 1,250"},
    {"question": "Six friends share 18 cookies equally. How many does each get?",
     "answer": "18 / 6 = <<18/6=3>>3\n#### 3"},
    {"question": "A train travels 60 miles an hour for 2 hours. How far does it go?",
     "answer": "60 * 2 = <<60*2=120>>120\n#### 120"},
]  # fmt: skip
BENCH_TOKENS = 10  # max_tokens of every benchmark sample


def offline_gsm8k(log: Path) -> None:
    """Replace ``load_benchmark_dataset`` where gsm8k.py imported it; log each load's args."""
    import datasets
    from tinker_cookbook.eval.benchmarks import gsm8k

    def load(path: str, name: str | None = None, split: str = "test", **kw: Any) -> Any:
        with (log / "dataset_loads.jsonl").open("a") as f:
            f.write(json.dumps({"path": path, "name": name, "split": split}) + "\n")
        columns = {key: [row[key] for row in GSM8K_ROWS] for key in ("question", "answer")}
        return datasets.Dataset.from_dict(columns)

    gsm8k.load_benchmark_dataset = load  # type: ignore[attr-defined]


def sample_calls(log: Path) -> list[dict[str, Any]]:
    path = log / "samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_question(tok: Any, call: dict[str, Any]) -> int | None:
    """The row of `GSM8K_ROWS` whose question `call`'s prompt asks (for the tests)."""
    prompt = tok.decode(call["prompt"])
    rows = [i for i, row in enumerate(GSM8K_ROWS) if row["question"] in prompt]
    assert len(rows) <= 1, prompt
    return rows[0] if rows else None


def logprob_gap(client: Any, calls: list[dict[str, Any]]) -> float:
    """The largest difference between the log-probabilities recorded when `calls` sampled and
    `client`'s ``compute_logprobs`` of the same tokens after the same prompt."""
    import tinker

    gap = 0.0
    for call in calls:
        for seq in call["sequences"]:
            full = tinker.ModelInput.from_ints(call["prompt"] + seq["tokens"])
            scored = client.compute_logprobs(full).result()[len(call["prompt"]) :]
            assert len(scored) == len(seq["logprobs"]) == len(seq["tokens"]), (scored, seq)
            gap = max([gap, *(abs(a - b) for a, b in zip(scored, seq["logprobs"], strict=True))])
    return gap


def run_eval_rl(model: str, log: Path) -> dict[str, Any]:
    """Two RL steps, evaluated at steps 0 and 2 by the test split and inline GSM8K; then the
    samples of the first and the last sampler are scored again by the base model and the
    final checkpoint (``checkpoints.jsonl``'s ``final``), to tell which weights drew them."""
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.eval.benchmark_evaluator import BenchmarkEvaluator
    from tinker_cookbook.rl import train
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    offline_gsm8k(log)
    renderer = renderers.get_renderer(renderer_for(model), tokenizer=get_tokenizer(model))

    def gsm8k_evaluator() -> BenchmarkEvaluator:  # temperature 1: logprobs comparable below
        return BenchmarkEvaluator("gsm8k", renderer, max_examples=3, max_tokens=8, temperature=1.0)

    config = train.Config(
        learning_rate=2e-2,  # the final weights' samples must be told from the base's
        dataset_builder=digits_builder(model, 2, test_groups=2),
        model_name=model,
        recipe_name="tinker_sr_test_eval_rl",
        max_tokens=12,
        log_path=str(log),
        eval_every=2,
        evaluator_builders=[gsm8k_evaluator],
        save_every=0,
        renderer_name=renderer_for(model),
        lora_rank=4,
        num_groups_to_log=0,
    )
    asyncio.run(train.main(config))
    calls = sample_calls(log)
    first = [c for c in calls if c["sampler"] == calls[0]["sampler"]]
    last = [c for c in calls if c["sampler"] == calls[-1]["sampler"]]
    service = tinker.ServiceClient()
    base = service.create_sampling_client(base_model=model).result()
    (final,) = [c["sampler_path"] for c in checkpoints(log) if c["name"] == "final"]
    trained = service.create_sampling_client(model_path=final).result()
    gaps = {
        "first_vs_base": logprob_gap(base, first),
        "last_vs_final": logprob_gap(trained, last),
        "last_vs_base": logprob_gap(base, last),
    }
    return {"logprob_gaps": gaps}


def train_one_step(service: Any, model: str, renderer: Any) -> str:
    """One supervised step on a worked GSM8K answer; the sampler weights' tinker:// path."""
    import tinker
    from tinker_cookbook.supervised.data import conversation_to_datum

    training = service.create_lora_training_client(base_model=model, rank=4).result()
    row = GSM8K_ROWS[-1]
    convo = [
        {"role": "user", "content": row["question"]},
        {"role": "assistant", "content": "60 * 2 = 120. \\boxed{120}"},
    ]
    datum = conversation_to_datum(convo, renderer, max_length=128)
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
    return str(training.save_weights_for_sampler("bench_step1").result().path)


def run_bench_gsm8k(model: str, log: Path) -> dict[str, Any]:
    """``run_benchmark("gsm8k")`` three times on one save_dir (3, 5, 5 examples), each run's
    result and the number of sample calls it made recorded in driver.json."""
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.eval.benchmarks import BenchmarkConfig, run_benchmark
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    offline_gsm8k(log)
    renderer = renderers.get_renderer(renderer_for(model), tokenizer=get_tokenizer(model))
    service = tinker.ServiceClient()
    path = train_one_step(service, model, renderer)
    client = service.create_sampling_client(model_path=path).result()
    save_dir = log / "evals" / "step1"

    async def runs() -> list[dict[str, Any]]:
        done = []
        for n in (3, 5, 5):
            calls = len(sample_calls(log)) if (log / "samples.jsonl").exists() else 0
            config = BenchmarkConfig(
                max_examples=n, max_tokens=BENCH_TOKENS, save_dir=str(save_dir)
            )
            result = await run_benchmark("gsm8k", client, renderer, config)
            new = len(sample_calls(log)) - calls if (log / "samples.jsonl").exists() else 0
            done.append({"result": dataclasses.asdict(result), "sample_calls": new})
        return done

    return {
        "runs": asyncio.run(runs()),
        "sampler_path": path,
        "sampler": client._sampling_session_id,
        "save_dir": str(save_dir),
    }


def run_eval_sl(model: str, log: Path) -> dict[str, Any]:
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.nll_evaluator import NLLEvaluator

    builder = conversations_builder(model, test_size=4)

    def forward_nll() -> NLLEvaluator:  # the same test split, through the training client
        _, test = builder()
        assert test is not None
        return NLLEvaluator.from_dataset(test, name="test_forward")

    config = train.Config(
        log_path=str(log),
        model_name=model,
        recipe_name="tinker_sr_test_eval_sl",
        renderer_name=renderer_for(model),
        dataset_builder=builder,
        evaluator_builders=[forward_nll],
        learning_rate=1e-2,
        lora_rank=4,
        eval_every=2,
        save_every=0,
        max_steps=3,
    )
    asyncio.run(train.main(config))
    return {}


def run(job: str, model: str, log: Path) -> dict[str, Any]:
    runs = {"eval_rl": run_eval_rl, "eval_sl": run_eval_sl, "bench_gsm8k": run_bench_gsm8k}
    return runs[job](model, log)
