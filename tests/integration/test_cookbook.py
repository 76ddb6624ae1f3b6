"""tinker-cookbook 0.6.1 recipes run unchanged on tinker_sr, both ways, on a BPE model.

Each recipe runs a few steps in a subprocess (tests/integration/cookbook_driver.py), two at a
time ahead of the tests that check them (`jobs`):

* ``embedded``: ``tinker-sr run cookbook_driver.py ...``: ``import tinker`` is tinker_sr, the
  embedded engine does the work;
* ``sdk``: plain ``python cookbook_driver.py ...`` with the official SDK 0.38, against a real
  ``tinker-sr serve`` on 127.0.0.1 started here.

The model is a tiny random Qwen3 in Hugging Face format with a trained BPE tokenizer (ids are not
bytes; EOS ``<|im_end|>`` is id >= 259), made by `make_tiny_hf_model_dir`; its EOS logit is
raised so that sampling ends on EOS often enough to check. The cookbook loads the tokenizer by
model name, offline: the model name is the directory's path. Recipes use the ``role_colon``
renderer, whose stop sequence is the string ``"\\n\\nUser:"``.

Needs ``tinker-cookbook==0.6.1`` (installed by .ci/run with ``--no-deps``; see docs/testing.md).
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook 0.6.1 is not installed")
pytest.importorskip("transformers")

from tests._server import REPO, ServerProcess, running_server  # noqa: E402

DRIVER = Path(__file__).with_name("cookbook_driver.py")
STOP = "\n\nUser:"
WAYS = ("embedded", "sdk")
_JOB_LIMIT_S = 420


HUB_NAME = "Qwen/Qwen3-8B"  # the tiny model, as a user's HF cache would hold a real one
LLAMA_HUB = "meta-llama/Llama-3.1-8B-Instruct"  # the tiny Llama 3 chat model, likewise
MOE_HUB = "Qwen/Qwen3-30B-A3B"  # a tiny Qwen3-MoE (2 of 8 experts), likewise
Q35_HUB = "Qwen/Qwen3.5-4B"  # a tiny Qwen3.5 (hybrid linear attention): the cookbook's default
# A tiny Qwen3-VL-MoE (a vision-language checkpoint, trained on text), named by a Tinker variant
# id as the cookbook's recipes name models: its renderer is ``qwen3_vl_instruct``.
VL_HUB = "Qwen/Qwen3-VL-30B-A3B-Instruct"
VL_VARIANT = VL_HUB + ":peft:262144"
LLAMA_TOKENIZER = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"
# A tiny gpt-oss (sinks, windows, biased experts) with the harmony tokens: the cookbook's
# ``gpt_oss_no_sysprompt`` renderer stops on the <|return|> and <|call|> ids.
GPT_OSS_HUB = "openai/gpt-oss-20b"


def offline_env(tmp: Path, hf_home: Path | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HOME": str(hf_home or tmp / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TINKER_TELEMETRY": "0",
        "TINKER_SR_TORCH_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for name in (
        "TINKER_BASE_URL",
        "TINKER_API_KEY",
        "TINKER_SR_BACKEND",
        "TINKER_SR_MODEL_ALIASES",
        "HF_HUB_CACHE",
    ):
        env.pop(name, None)
    return env


def raise_eos_logit(model_dir: Path, eos_id: int) -> None:
    """Make EOS a likely next token everywhere (~20 % per step with these numbers): every
    embedding gets a shared component along one axis and EOS's output row a larger one, so the
    output layer (tied, or Llama's own) scores EOS above the rest. Measured with transformers on
    the seed-0 model."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    key = next(
        k
        for k in weights
        if k.endswith("model.embed_tokens.weight")
        or k.endswith("language_model.embed_tokens.weight")
    )  # Qwen3.5: under model.language_model.
    emb = weights[key]
    emb[:, 0] += 0.3
    weights.get("lm_head.weight", emb)[eos_id, 0] = 1.3
    save_file(weights, path, metadata={"format": "pt"})


def _qwen_chat_model(tmp_path_factory: pytest.TempPathFactory, name: str, family: Any) -> Any:
    """A tiny model of `family` with Qwen's chat tokens, its first EOS made likely."""
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir, tiny_model_info

    path = make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / name, family)
    info = tiny_model_info(path)
    raise_eos_logit(path, info.eos_token_ids[0])
    return info


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _qwen_chat_model(tmp_path_factory, "tiny-qwen3", "qwen3")


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Llama with Llama 3's chat tokens (the cookbook's ``llama3`` renderer stops on
    ``<|eot_id|>``, which config.json lists as an EOS beside ``<|end_of_text|>``)."""
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir, tiny_model_info

    path = make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama3", "llama3")
    info = tiny_model_info(path)
    raise_eos_logit(path, info.special_ids["<|eot_id|>"])
    return info


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Qwen3-MoE with Qwen's chat tokens (the cookbook's ``qwen3`` renderer)."""
    return _qwen_chat_model(tmp_path_factory, "tiny-moe", "qwen3_moe")


@pytest.fixture(scope="module")
def q35_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Qwen3.5 as the Hub ships it (the vision-language checkpoint) with Qwen's chat
    tokens (the cookbook's ``qwen3_5`` renderer)."""
    return _qwen_chat_model(tmp_path_factory, "tiny-q35", "qwen3_5")


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Qwen3-VL-MoE as the Hub ships it, with Qwen's chat tokens."""
    return _qwen_chat_model(tmp_path_factory, "tiny-vl", "qwen3_vl_moe")


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir, tiny_model_info

    path = make_tiny_hf_model_dir(tmp_path_factory.mktemp("models") / "tiny-gpt-oss", "gpt_oss")
    info = tiny_model_info(path)
    raise_eos_logit(path, info.special_ids["<|return|>"])
    return info


@pytest.fixture(scope="module")
def hf_home(
    tmp_path_factory: pytest.TempPathFactory,
    model: Any,
    llama3_model: Any,
    moe_model: Any,
    q35_model: Any,
    vl_model: Any,
    gpt_oss_model: Any,
) -> Path:
    """An HF_HOME whose hub cache holds the models as `HUB_NAME` and `LLAMA_HUB`, and the
    tokenizer repo the cookbook reads for Llama 3 (refs/main -> a snapshot), as
    ``huggingface-cli download`` leaves real ones."""
    home = tmp_path_factory.mktemp("hf_home")
    # The cookbook loads every meta-llama/Llama-3* tokenizer from an ungated copy of its own.
    cached = (
        (HUB_NAME, model),
        (LLAMA_HUB, llama3_model),
        (LLAMA_TOKENIZER, llama3_model),
        (MOE_HUB, moe_model),
        (Q35_HUB, q35_model),
        (VL_HUB, vl_model),
        (GPT_OSS_HUB, gpt_oss_model),
    )
    for name, info in cached:
        repo, rev = home / "hub" / ("models--" + name.replace("/", "--")), "b" * 40
        shutil.copytree(info.path, repo / "snapshots" / rev)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(rev)
    return home


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, model: Any, hf_home: Path
) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("cookbook_server")
    # A server loads only the models its operator names (issue 10, item 12): a directory, and
    # a Hub name found in the server's HF cache.
    flags = ["--model-dir", str(model.path)]
    flags += [
        arg
        for hub in (HUB_NAME, LLAMA_HUB, MOE_HUB, Q35_HUB, VL_HUB, GPT_OSS_HUB)
        for arg in ("--model-dir", hub)
    ]
    with running_server(tmp / "store", env=offline_env(tmp, hf_home), extra_args=flags) as srv:
        yield srv


def run_job(
    way: str,
    job: str,
    model: Any,
    tmp: Path,
    server: ServerProcess | None,
    *,
    name: str | None = None,
    hf_home: Path | None = None,
) -> Path:
    """Run `job` on the model, named by its directory or (`name`, with `hf_home`) by a Hub
    name found in the HF cache."""
    log = tmp / f"{way}-{job}"
    env = offline_env(tmp, hf_home)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    args = [str(DRIVER), job, name or str(model.path), str(log)]
    if way == "embedded":
        env["TINKER_SR_STORE"] = str(tmp / "store")
        cmd = [sys.executable, "-m", "tinker_sr", "run", *args]
    else:
        assert server is not None
        env.update(TINKER_BASE_URL=server.base_url, TINKER_API_KEY="tml-cookbook-test")
        cmd = [sys.executable, *args]
    proc = subprocess.run(
        cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=_JOB_LIMIT_S
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    summary = json.loads((log / "driver.json").read_text())
    assert summary["tinker_module"] == ("tinker_sr" if way == "embedded" else "tinker")
    return log


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_rl_sampling(log: Path, model: Any, stop: list[Any] | None = None) -> dict[str, int]:
    """Every rollout sample used the renderer's stop (default: ``role_colon``'s string) and
    ended on it, on the model's EOS or at max_tokens; return how many ended which way."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.path)
    eos = set(model.eos_token_ids)
    ends = {"eos": 0, "stop_string": 0, "length": 0}
    rollouts = [c for c in jsonl(log / "samples.jsonl") if c["stop"] is not None]
    assert rollouts, "no rollout sampling was recorded"
    for call in rollouts:
        assert call["stop"] == (stop or [STOP]), call["stop"]
        for seq in call["sequences"]:
            tokens, reason = seq["tokens"], seq["stop_reason"]
            assert not eos & set(tokens[:-1]), f"sampling ran past EOS: {tokens}"
            assert STOP not in tok.decode(tokens[:-1]), f"sampling ran past {STOP!r}: {tokens}"
            if tokens and tokens[-1] in eos:
                assert reason == "stop", seq
                ends["eos"] += 1
            elif STOP in tok.decode(tokens):
                assert reason == "stop", seq
                ends["stop_string"] += 1
            else:
                assert reason == "length" and len(tokens) == call["max_tokens"], seq
                ends["length"] += 1
    assert ends["eos"] > 0, f"no sequence stopped on the model's EOS {sorted(eos)}: {ends}"
    return ends


def check_steps(log: Path, n: int, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The training rows of metrics.jsonl (the cookbook appends a token-usage-only row)."""
    rows = [r for r in jsonl(log / "metrics.jsonl") if keys[0] in r]
    assert [r["step"] for r in rows] == list(range(n)), [r["step"] for r in rows]
    for row in rows:
        for key in keys:
            assert key in row and math.isfinite(row[key]), (key, row)
    return rows


def check_on_policy_numerics(rows: list[dict[str, Any]]) -> None:
    """The cookbook's sampler-vs-learner check (its rl_numerics_check recipe): on-policy steps
    compare the log-probabilities recorded at sampling with the learner's for the same tokens
    and weights. Both are float32 here, so they agree to rounding (observed ~1e-7 for the
    mean difference, ~1e-13 for half its mean square); a sampler computing another
    distribution (a mask, a position or a temperature bug) shows up as 1e-3 and more."""
    assert rows
    for row in rows:
        kl_v1, kl_v2 = row["optim/kl_sample_train_v1"], row["optim/kl_sample_train_v2"]
        assert abs(kl_v1) < 1e-5 and 0 <= kl_v2 < 1e-9, (row["step"], kl_v1, kl_v2)


@pytest.fixture(params=WAYS)
def way(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# The recipe each test runs, when not a parameter of its own (`test_rl_train`'s ``job``).
_JOB_OF = {
    "test_rl_train_async_off_policy_stable_reinforce": "rl_async_sr",
    "test_rl_train_resumes_from_its_checkpoint": "rl_resume",
    "test_supervised_train": "sl",
    "test_dpo_through_forward_backward_custom": "dpo",
    "test_on_policy_distillation_from_the_base_model": "distill",
    "test_rl_kl_penalty_post_kl_and_streamed_minibatches": "rl_kl_stream",
    "test_multi_turn_stable_reinforce_one_datum_names_every_turn": "rl_turns_sr",
    "test_a_hub_name_from_the_hf_cache_with_the_recommended_renderer": "rl_is",
    "test_the_cookbooks_trace_and_capture_record_the_run": "rl_capture",
    "test_a_multi_turn_game_reuses_each_turns_prompt": "guess_number",
    "test_the_minimal_rl_loop_names_provenance_with_datum_with_provenance": "loop_sr",
    "test_rl_train_evaluates_the_test_split_and_gsm8k_inline": "eval_rl",
    "test_supervised_evals_score_the_test_split_on_the_pipelined_weights": "eval_sl",
    "test_the_gsm8k_benchmark_on_a_checkpoint_resumes_from_its_save_dir": "bench_gsm8k",
}
JobKey = tuple[str, str, str | None]  # (way, job, Hub name or None: the model's directory)
# Jobs at once. Each is a subprocess of its own (one torch thread; the sdk way's server
# serves each job's client), so running two side by side changes no job's inputs, and on two
# cores it nearly halves the module's time, most of which is each subprocess importing the
# cookbook, transformers and torch.
_PARALLEL_JOBS = 2


def _job_key(item: pytest.Item) -> JobKey | None:
    name = getattr(item, "originalname", item.name)
    params: dict[str, Any] = getattr(getattr(item, "callspec", None), "params", {})
    job = params.get("job", _JOB_OF.get(name))
    return None if job is None else (params["way"], job, params.get("hub"))


class Jobs:
    """The selected tests' jobs, started in the tests' order `_PARALLEL_JOBS` at a time,
    ahead of the tests that check them; `log` waits for one (its failure fails that test)."""

    def __init__(self) -> None:
        self.futures: dict[JobKey, Future[Path]] = {}

    def log(self, key: JobKey) -> Path:
        assert key in self.futures, f"{key} was not started: is its test in _JOB_OF?"
        return self.futures[key].result()


@pytest.fixture(scope="module")
def jobs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Jobs]:
    here = Path(__file__)
    keys = [k for it in request.session.items if it.path == here and (k := _job_key(it))]
    # Fixtures resolve here, on the test thread; the pool's threads only run subprocesses.
    models = {None: request.getfixturevalue("model")}
    if any(hub for _, _, hub in keys):
        models |= {
            HUB_NAME: models[None],
            LLAMA_HUB: request.getfixturevalue("llama3_model"),
            MOE_HUB: request.getfixturevalue("moe_model"),
            Q35_HUB: request.getfixturevalue("q35_model"),
            VL_VARIANT: request.getfixturevalue("vl_model"),
            GPT_OSS_HUB: request.getfixturevalue("gpt_oss_model"),
        }
    home = request.getfixturevalue("hf_home") if len(models) > 1 else None
    srv = request.getfixturevalue("server") if any(w == "sdk" for w, _, _ in keys) else None
    with ThreadPoolExecutor(_PARALLEL_JOBS, thread_name_prefix="cookbook-job") as pool:
        pending = Jobs()
        for key in dict.fromkeys(keys):
            way, job, hub = key
            tmp = tmp_path_factory.mktemp(f"{way}-{job}")
            server = srv if way == "sdk" else None
            pending.futures[key] = pool.submit(
                run_job, way, job, models[hub], tmp, server, name=hub, hf_home=home if hub else None
            )
        try:
            yield pending
        finally:  # a stopped session leaves no job running against a closing server
            for future in pending.futures.values():
                future.cancel()


# Over the wire (``sdk``) once: the other losses differ in the engine only (a loss's name and
# config cross the wire alike for every loss: tests/test_wire.py).
@pytest.mark.parametrize(
    ("way", "job"),
    [("embedded", "rl_is"), ("embedded", "rl_ppo"), ("embedded", "rl_gspo"), ("sdk", "rl_is")],
)
def test_rl_train(way: str, job: str, model: Any, jobs: Jobs) -> None:
    log = jobs.log((way, job, None))
    rows = check_steps(log, 2, ("optim/lr", "env/all/reward/total"))
    assert all(r["tokens/trained"] > 0 for r in rows)
    # Rewards differ within groups, so advantages (and gradients) are not all zero.
    assert any(r["env/all/by_group/frac_mixed"] > 0 for r in rows)
    # Each group member samples with a request of its own on the group's prompt: the engine
    # prefills it once and reports the other three as cache hits, which the cookbook counts.
    assert all(r["tokens/prefill_cached"] == 3 * r["tokens/prefill_uncached"] > 0 for r in rows)
    check_on_policy_numerics(rows)
    check_rl_sampling(log, model)


def test_rl_train_async_off_policy_stable_reinforce(way: str, model: Any, jobs: Jobs) -> None:
    log = jobs.log((way, "rl_async_sr", None))
    rows = check_steps(log, 3, ("optim/lr",))
    assert all(r["tokens/trained"] > 0 for r in rows)
    # The first groups_per_batch * (max_steps_off_policy + 1) = 4 rollouts all start on the
    # initial weights, so step 1 trains on data one step stale; the cap of 1 holds throughout
    # (step 2's staleness depends on when its rollouts started, so only the cap is checked).
    staleness = [r["async/staleness_max"] for r in rows]
    assert staleness[1] == 1 and max(staleness) == 1, staleness
    check_on_policy_numerics([r for r in rows if r["async/staleness_max"] == 0])
    check_rl_sampling(log, model)


def test_rl_train_resumes_from_its_checkpoint(way: str, model: Any, jobs: Jobs) -> None:
    log = jobs.log((way, "rl_resume", None))
    summary = json.loads((log / "driver.json").read_text())
    first = summary["checkpoints_after_first_run"]
    assert [c["batch"] for c in first if c["name"] != "final"] == [1], first
    # The second run (a new session) picked up at batch 1 from the saved state: it trained
    # steps 1 and 2 only, its token counts continue the first run's, and step 0 is logged once.
    check_steps(log, 3, ("optim/lr",))
    second = summary["checkpoints"][len(first) :]
    assert [(c["name"], c["batch"]) for c in second] == [("000002", 2), ("000003", 3), ("final", 3)]
    assert second[0]["state_path"].split("/")[2] != first[0]["state_path"].split("/")[2]
    trained = [c["cumulative_tokens"]["trained"] for c in (first[0], *second)]
    assert trained == sorted(trained) and trained[0] > 0


def test_supervised_train(way: str, model: Any, jobs: Jobs) -> None:
    log = jobs.log((way, "sl", None))
    rows = check_steps(log, 3, ("train_mean_nll", "num_loss_tokens"))
    assert all(r["num_loss_tokens"] > 0 for r in rows)
    final = json.loads((log / "driver.json").read_text())["checkpoints"][-1]
    assert final["name"] == "final" and final["sampler_path"].startswith("tinker://")


def test_dpo_through_forward_backward_custom(way: str, model: Any, jobs: Jobs) -> None:
    log = jobs.log((way, "dpo", None))
    rows = check_steps(log, 2, ("dpo_loss", "accuracy", "chosen_reward", "rejected_reward"))
    # Step 0: the policy is the reference, so the DPO loss is log 2; after one update the
    # chosen completions (the right sums) gained on the rejected ones.
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert rows[1]["margin"] > rows[0]["margin"]


def test_on_policy_distillation_from_the_base_model(way: str, model: Any, jobs: Jobs) -> None:
    log = jobs.log((way, "distill", None))
    rows = check_steps(log, 2, ("teacher_kl", "optim/kl_sample_train_v1"))
    # Step 0: the student is the teacher (both the base model), so the reverse KL between the
    # sampled tokens' log-probabilities and the teacher's is zero up to float32 rounding...
    assert abs(rows[0]["teacher_kl"]) < 1e-5, rows[0]["teacher_kl"]
    check_on_policy_numerics(rows)
    # ...and after one update the student has moved away from its teacher.
    assert abs(rows[1]["teacher_kl"]) > 1e-4, rows[1]["teacher_kl"]
    check_rl_sampling(log, model)


def test_rl_kl_penalty_post_kl_and_streamed_minibatches(way: str, model: Any, jobs: Jobs) -> None:
    """``rl.train`` with a KL penalty against the base model (a second sampling client's
    ``compute_logprobs``), post-update KL, and each batch streamed as two minibatches (two
    ``forward_backward`` calls per ``optim_step``)."""
    log = jobs.log((way, "rl_kl_stream", None))
    rows = check_steps(log, 2, ("kl_policy_base", "kl_pre_post_v1", "optim/kl_sample_train_v1"))
    # Step 0 samples from the untrained policy, which is the base: their KL is rounding.
    assert abs(rows[0]["kl_policy_base"]) < 1e-5, rows[0]["kl_policy_base"]
    assert all(r["kl_pre_post_v2"] > 0 for r in rows)  # every update moved the policy
    check_on_policy_numerics(rows)  # both minibatches trained on the weights they sampled
    check_rl_sampling(log, model)


def test_multi_turn_stable_reinforce_one_datum_names_every_turn(
    way: str, model: Any, jobs: Jobs
) -> None:
    """A three-turn env whose observations extend each other token for token: the cookbook
    merges each rollout into one datum whose provenance names three sampled sequences (one per
    turn, each turn's prompt the whole conversation so far), and ``stable_reinforce`` trains on
    it; every turn's sampled log-probabilities match the learner's."""
    log = jobs.log((way, "rl_turns_sr", None))
    rows = check_steps(log, 2, ("optim/lr", "env/all/turns_per_episode"))
    assert all(r["env/all/turns_per_episode"] == 3 and r["tokens/trained"] > 0 for r in rows)
    calls = jsonl(log / "training.jsonl")
    assert len(calls) == 2 and all(c["loss_fn"] == "stable_reinforce" for c in calls), calls
    seen: set[str] = set()
    for call in calls:
        assert len(call["datums"]) == 8  # 2 groups x 4 rollouts, one datum each
        for datum in call["datums"]:
            ids = datum["sampled_ids"]
            assert len(set(ids)) == 3 and datum["spans"] == 6, datum  # prompt + sample per turn
            assert not seen & set(ids), "a sequence id named by two datums"
            seen.update(ids)
    check_on_policy_numerics(rows)
    check_rl_sampling(log, model)


# Every model embedded; over the wire (``sdk``) the plain one and gpt-oss, whose harmony stop
# ids are the ones a server could get wrong (the other renderers differ in the client only).
@pytest.mark.parametrize(
    ("way", "hub"),
    [("embedded", h) for h in (HUB_NAME, LLAMA_HUB, MOE_HUB, Q35_HUB, VL_VARIANT, GPT_OSS_HUB)]
    + [("sdk", HUB_NAME), ("sdk", GPT_OSS_HUB)],
)
def test_a_hub_name_from_the_hf_cache_with_the_recommended_renderer(
    way: str, hub: str, jobs: Jobs, request: pytest.FixtureRequest
) -> None:
    """What a user's config says: ``model_name="Qwen/Qwen3-8B"``,
    ``"meta-llama/Llama-3.1-8B-Instruct"``, the MoE ``"Qwen/Qwen3-30B-A3B"``, ``"Qwen/Qwen3.5-4B"``
    or the Tinker variant id ``"Qwen/Qwen3-VL-30B-A3B-Instruct:peft:262144"``, found offline in
    the local HF cache (the engine's, the server's and the cookbook's tokenizer alike), and the
    renderer the cookbook recommends for it (``qwen3``, ``qwen3_5``, ``qwen3_vl_instruct``: stop
    on the ``<|im_end|>`` id; ``llama3``: BOS, role headers, stop on the ``<|eot_id|>`` id);
    ``"openai/gpt-oss-20b"`` with ``gpt_oss_no_sysprompt`` (harmony; stop on the ``<|return|>``
    and ``<|call|>`` ids)."""
    fixture = {HUB_NAME: "model", LLAMA_HUB: "llama3_model", MOE_HUB: "moe_model",
               Q35_HUB: "q35_model", VL_VARIANT: "vl_model", GPT_OSS_HUB: "gpt_oss_model"}[hub]  # fmt: skip
    model = request.getfixturevalue(fixture)
    log = jobs.log((way, "rl_is", hub))
    rows = check_steps(log, 2, ("optim/lr", "env/all/reward/total"))
    assert all(r["tokens/trained"] > 0 for r in rows)
    check_on_policy_numerics(rows)
    ends_on = {LLAMA_HUB: ["<|eot_id|>"], GPT_OSS_HUB: ["<|return|>", "<|call|>"]}
    stop = [model.special_ids[t] for t in ends_on.get(hub, ["<|im_end|>"])]
    ends = check_rl_sampling(log, model, stop=stop)  # token ids, not strings
    assert ends["stop_string"] == 0, ends


def test_the_cookbooks_trace_and_capture_record_the_run(way: str, model: Any, jobs: Jobs) -> None:
    """``enable_trace=True`` and ``capture.instrument_tinker`` patch the clients' methods (the
    sampler's id read from the SDK's private ``_sampling_session_id``): every sample call and
    training op lands in the capture files with its tokens, logprobs and metrics."""
    log = jobs.log((way, "rl_capture", None))
    check_steps(log, 2, ("optim/lr", "env/all/reward/total"))
    samples = jsonl(log / "capture" / "sample.jsonl")
    recorded = [s for c in jsonl(log / "samples.jsonl") for s in c["sequences"]]
    assert len(samples) == 16 and sum(len(r["samples"]) for r in samples) == len(recorded)
    assert {r["status"] for r in samples} == {"ok"}
    # One sampler per step, each named on every call it answered.
    ids = [r["sampling_session_id"] for r in samples]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 2, ids
    captured = sorted(json.dumps(s["tokens"]) for r in samples for s in r["samples"])
    assert captured == sorted(json.dumps(s["tokens"]) for s in recorded)
    for row in samples:
        for s in row["samples"]:
            assert len(s["logprobs"]) == len(s["tokens"]) and all(lp <= 0 for lp in s["logprobs"])
    ops = jsonl(log / "capture" / "train_op.jsonl")
    by_op = collections.Counter(r["op"] for r in ops if r["status"] == "ok")
    assert by_op["forward_backward"] == 2 and by_op["optim_step"] == 2, by_op
    fb = [r for r in ops if r["op"] == "forward_backward"]
    assert all(r["num_data"] == 8 and math.isfinite(r["metrics"]["loss:sum"]) for r in fb), fb
    traced = {e["name"] for e in jsonl(log / "trace_events.jsonl")}
    assert {"forward_backward", "optim_step", "sample"} <= traced, sorted(traced)


@pytest.mark.parametrize("hub", [Q35_HUB])
def test_a_multi_turn_game_reuses_each_turns_prompt(
    way: str, hub: str, jobs: Jobs, q35_model: Any
) -> None:
    """The ``guess_number`` recipe on its model family (Qwen3.5, hybrid layers): 10 turns per
    episode, each prompt the one before plus a reply and the host's answer (~700 tokens by the
    last turn). The engine finds each turn's head in its prompt cache (256-token blocks and the
    linear-attention states where the turn before stopped), which the cookbook logs as
    ``tokens/prefill_cached``. Before: the whole prompt was prefilled every turn, and only the
    group's identical first prompts were cached (397 tokens, against 10,484 computed)."""
    log = jobs.log((way, "guess_number", hub))
    (row,) = check_steps(log, 1, ("optim/lr", "env/all/reward/total"))
    assert row["env/all/turns_per_episode"] == 10, row
    cached, uncached = row["tokens/prefill_cached"], row["tokens/prefill_uncached"]
    assert cached > uncached > 0, (cached, uncached)
    check_on_policy_numerics([row])


@pytest.mark.parametrize("hub", [HUB_NAME])
def test_the_minimal_rl_loop_names_provenance_with_datum_with_provenance(
    way: str, hub: str, jobs: Jobs
) -> None:
    """``recipes/rl_loop.py`` as shipped (its default loss ``stable_reinforce``): every datum
    names its one sampled sequence through ``Datum.with_provenance`` (a prompt span and a
    sampled span, the targets shifted by one), and the engine trains on it."""
    log = jobs.log((way, "loop_sr", hub))
    rows = [r for r in jsonl(log / "metrics.jsonl") if "reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    calls = jsonl(log / "training.jsonl")
    trained = [r for r in rows if "grad_norm:mean" in r]
    assert calls and len(calls) == len(trained), (calls, rows)
    assert all(math.isfinite(r["grad_norm:mean"]) and r["grad_norm:mean"] > 0 for r in trained)
    for call in calls:
        assert call["loss_fn"] == "stable_reinforce" and call["datums"], call
        for datum in call["datums"]:
            assert len(datum["sampled_ids"]) == 1 and datum["spans"] == 2, datum
    # Every second prompt is sampled with max_tokens=1 (the driver): its one-token samples'
    # model_input runs are empty (length 0), refused before; the others' are not.
    sent = [c["max_tokens"] for c in jsonl(log / "samples.jsonl")]
    assert sent == [1, 12] * 2, sent
    lengths = [d["input_lengths"] for c in calls for d in c["datums"]]
    assert any(x[1] == 0 for x in lengths) and any(x[1] > 0 for x in lengths), lengths


def test_rl_train_evaluates_the_test_split_and_gsm8k_inline(
    way: str, model: Any, jobs: Jobs
) -> None:
    """``rl.train`` with ``eval_every=2`` over 2 steps: the test split (``RLTestSetEvaluator``)
    and GSM8K through ``evaluator_builders`` (``BenchmarkEvaluator``, 3 examples) run before
    step 0 on the initial weights and after step 1 on the final ones, their metrics logged at
    steps 0 and 2. The samples of the first evaluation have the base model's log-probabilities
    (LoRA starts at zero), the last's the final checkpoint's and not the base's."""
    from transformers import AutoTokenizer

    from tests.integration.cookbook_evals import gsm8k_question

    log = jobs.log((way, "eval_rl", None))
    check_steps(log, 2, ("optim/lr", "env/all/reward/total"))
    keys = ("eval/gsm8k/score", "eval/gsm8k/num_examples", "test/env/all/reward/total")
    evals = [r for r in jsonl(log / "metrics.jsonl") if keys[0] in r]
    assert [r["step"] for r in evals] == [0, 2], evals
    for row in evals:
        assert all(math.isfinite(row[k]) for k in row if k.startswith(("eval/", "test/")))
        assert row["eval/gsm8k/num_examples"] == 3 and row["eval/gsm8k/num_errors"] == 0
        assert row["test/env/all/total_episodes"] == 4, row  # 2 test groups of 2
    loads = jsonl(log / "dataset_loads.jsonl")
    assert loads == [{"path": "openai/gsm8k", "name": "main", "split": "test"}] * 2, loads
    tok = AutoTokenizer.from_pretrained(model.path)
    calls = jsonl(log / "samples.jsonl")
    samplers = list(dict.fromkeys(c["sampler"] for c in calls))
    assert len(samplers) == 3, samplers  # step 0 (evals and rollouts), step 1, final evals
    first = [c for c in calls if c["sampler"] == samplers[0]]
    last = [c for c in calls if c["sampler"] == samplers[2]]
    # The evaluations ran before step 0's 8 rollouts and after step 1's, nothing else.
    assert len(first) == 7 + 8 and len(last) == 7 and calls[-7:] == last
    for evaluation in (first[:7], last):
        bench = [c for c in evaluation if gsm8k_question(tok, c) is not None]
        assert sorted(gsm8k_question(tok, c) for c in bench) == [0, 1, 2]
        assert all(c["max_tokens"] == 8 and c["temperature"] == 1.0 for c in bench), bench
        assert all(c["max_tokens"] == 12 for c in evaluation if c not in bench)
    test_split = sorted(tok.decode(c["prompt"]) for c in last if c["max_tokens"] == 12)
    assert test_split == sorted(tok.decode(c["prompt"]) for c in first[:7] if c["max_tokens"] == 12)
    assert not set(test_split) & {tok.decode(c["prompt"]) for c in first[7:]}
    gaps = json.loads((log / "driver.json").read_text())["logprob_gaps"]
    assert gaps["first_vs_base"] < 1e-4 and gaps["last_vs_final"] < 1e-4, gaps
    assert gaps["last_vs_base"] > 1e-2, gaps


def test_supervised_evals_score_the_test_split_on_the_pipelined_weights(
    way: str, model: Any, jobs: Jobs
) -> None:
    """``supervised.train`` (``submit_ahead=1``) with ``test_size=4`` and ``eval_every=2``: at
    steps 0 and 2 the test split's NLL from a ``save_weights_and_get_sampling_client``
    snapshot's ``compute_logprobs`` (``test/nll``) equals the training client's ``forward``
    (``test_forward/nll``), though step 2's evaluation was sent while step 1's update was in
    flight: both ran on the weights after it, which have learned (the NLL fell)."""
    log = jobs.log((way, "eval_sl", None))
    check_steps(log, 3, ("train_mean_nll",))
    rows = [r for r in jsonl(log / "metrics.jsonl") if "test/nll" in r]
    assert [r["step"] for r in rows] == [0, 2], rows
    for row in rows:
        assert math.isfinite(row["test/bpb"]) and row["test/nll"] > 0, row
        assert row["test/nll"] == pytest.approx(row["test_forward/nll"], abs=1e-4), row
    assert rows[1]["test/nll"] < rows[0]["test/nll"] - 0.05, rows


def test_the_gsm8k_benchmark_on_a_checkpoint_resumes_from_its_save_dir(
    way: str, model: Any, jobs: Jobs
) -> None:
    """``run_benchmark("gsm8k")`` on a ``tinker://`` checkpoint, three times on one save_dir:
    3 examples, then 5 (only the 2 new ones sampled), then 5 again (none). Each example is
    sampled once, by that checkpoint's sampler, with the benchmark's settings (its default
    temperature 0.6, max_tokens 10, the renderer's stop); the score is the cookbook's own
    grading of what was sampled, and the saved trajectories and result.json agree."""
    from tinker_cookbook import renderers
    from tinker_cookbook.eval.benchmarks._common import check_gsm8k
    from transformers import AutoTokenizer

    from tests.integration.cookbook_evals import BENCH_TOKENS, GSM8K_ROWS, gsm8k_question

    log = jobs.log((way, "bench_gsm8k", None))
    summary = json.loads((log / "driver.json").read_text())
    runs = summary["runs"]
    assert [r["sample_calls"] for r in runs] == [3, 2, 0], runs
    assert [r["result"]["num_examples"] for r in runs] == [3, 5, 5], runs
    assert summary["sampler_path"].startswith("tinker://"), summary["sampler_path"]
    tok = AutoTokenizer.from_pretrained(model.path)
    renderer = renderers.get_renderer("role_colon", tokenizer=tok)
    calls = jsonl(log / "samples.jsonl")
    asked = [gsm8k_question(tok, c) for c in calls]
    assert sorted(asked[:3]) == [0, 1, 2] and sorted(asked[3:]) == [3, 4], asked
    graded = {"correct": [0, 0], "truncated": [0, 0]}  # after the first run, after the second
    for i, call in enumerate(calls):
        assert call["sampler"] == summary["sampler"] and call["stop"] == [STOP], call
        assert call["temperature"] == 0.6 and call["max_tokens"] == BENCH_TOKENS, call
        (seq,) = call["sequences"]
        expected = GSM8K_ROWS[asked[i]]["answer"].split("####")[-1].strip()
        if seq["stop_reason"] == "length":
            outcome = "truncated"
        else:
            message, end = renderer.parse_response(seq["tokens"])
            text = renderers.get_text_content(message)
            outcome = "correct" if end.is_clean and check_gsm8k(text, expected) else "wrong"
        for run in (0, 1) if i < 3 else (1,):
            graded.setdefault(outcome, [0, 0])[run] += 1
    for run, n in ((0, 3), (1, 5), (2, 5)):
        result, k = runs[run]["result"], min(run, 1)
        assert result["num_errors"] == 0, result
        assert result["num_correct"] == graded["correct"][k], (result, graded)
        assert result["num_truncated"] == graded["truncated"][k], (result, graded)
        assert result["score"] == pytest.approx(graded["correct"][k] / n)
    save = Path(summary["save_dir"])
    stored = jsonl(save / "gsm8k" / "trajectories.jsonl")
    assert len({t["example_id"] for t in stored}) == len(stored) == 5, stored
    assert all(t["error"] is None for t in stored)
    saved = json.loads((save / "gsm8k" / "result.json").read_text())
    assert {k: saved[k] for k in ("score", "num_examples", "num_correct")} == {
        k: runs[2]["result"][k] for k in ("score", "num_examples", "num_correct")
    }
