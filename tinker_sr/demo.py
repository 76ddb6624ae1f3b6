"""`tinker-sr demo`: a small RL run on the embedded engine, written as a Tinker user writes it.

The first half of this file is the RL loop itself. It uses only the public API
(``import tinker_sr as tinker``, ``tinker.types`` and the provenance datum builder), so the
same code runs unchanged on the embedded engine, on a ``tinker-sr serve`` server
(``--base-url``) or, with ``import tinker``, on any Tinker-compatible service.
``examples/rl_demo.py`` runs it as a plain script. The second half is the command line:
progress bar, JSONL log and plot.

The task: count upward. Each prompt ends in a digit ("count: 3") and the completion should
continue "45678901", wrapping 9 -> 0. Every byte is scored, so the reward is verifiable and
dense: 0.25 for a digit plus 0.75 for the right successor of the byte before it, averaged over
the completion. The built-in models start from random weights, so the reward starts near 0.01;
a few minutes of CPU are enough to see it climb.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import numpy as np

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.clients.sr_lowered import k3_mean
from tinker_sr.clients.sr_lowering import LoweringOptions
from tinker_sr.engine import usage
from tinker_sr.plot import Panel, plot_curves
from tinker_sr.provenance import build_datum

# ---- the task: a verifiable reward ------------------------------------------------------------

PROMPTS: tuple[str, ...] = ("count: 0", "count: 3", "count: 7")
DIGITS = frozenset(b"0123456789")
DIGIT_CREDIT = 0.25


def byte_rewards(prompt: str, completion: Sequence[int]) -> list[float]:
    """Counting upward from the prompt's last digit, one byte at a time, wrapping 9 -> 0.

    Each completion byte earns 0.25 for being a digit and 0.75 more for being the successor
    of the byte before it (the prompt's last byte for the first one).
    """
    prev = prompt.encode()[-1]
    out = []
    for t in completion:
        r = 0.0
        if t in DIGITS:
            r += DIGIT_CREDIT
            if prev in DIGITS and t - 48 == (prev - 48 + 1) % 10:
                r += 1.0 - DIGIT_CREDIT
        out.append(r)
        prev = t
    return out


def reward(prompt: str, completion: Sequence[int]) -> float:
    """The completion's reward: the mean byte reward, so "45678901" after "count: 3" is 1.0."""
    return float(np.mean(byte_rewards(prompt, completion))) if completion else 0.0


# Loss names the loop accepts. "reinforce" is plain REINFORCE: cross_entropy weighted by the
# advantages, with no off-policy correction at all (the baseline StableReinforce fixes).
LOSSES = ("stable_reinforce", "importance_sampling", "ppo", "cispo", "reinforce")
DEFAULT_STALENESS = 3  # optimizer steps a --stress stale sampler lags


@dataclass(frozen=True)
class RLConfig:
    """Everything that decides a run. Same config and seed: same run."""

    base_model: str = "tinker-sr/tiny"
    loss: str = "stable_reinforce"
    loss_config: Mapping[str, float] | None = None  # None: {"kl_coeff": 0.01} for stable_reinforce
    steps: int = 80
    seed: int = 0
    group_size: int = 16  # samples per prompt; the advantage is reward minus the group mean
    max_tokens: int = 8
    temperature: float = 1.0
    learning_rate: float = 3e-3
    lora_rank: int = 8
    grad_clip_norm: float = 0.0

    def loss_fn_config(self) -> dict[str, float] | None:
        if self.loss_config is not None:
            return dict(self.loss_config)
        return {"kl_coeff": 0.01} if self.loss == "stable_reinforce" else None


def _to_loss_input(datum: types.Datum, loss: str) -> types.Datum:
    """The provenance datum in the form ``loss`` takes."""
    if loss != "reinforce":
        return datum
    inputs = datum.loss_fn_inputs
    return replace(
        datum,
        loss_fn_inputs={"target_tokens": inputs["target_tokens"], "weights": inputs["advantages"]},
    )


async def rl_loop(
    service_client: tinker.ServiceClient,
    config: RLConfig,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``config.steps`` steps of sample → score → train; return one record per step."""
    if config.loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {config.loss!r}")
    training_client = await service_client.create_lora_training_client(
        config.base_model, rank=config.lora_rank, seed=config.seed
    )
    tokenizer = training_client.get_tokenizer()
    # No BOS: the same ids whichever tokenizer the backend hands out (HF's encode adds one).
    prompts = {
        p: types.ModelInput.from_ints(tokenizer.encode(p, add_special_tokens=False))
        for p in PROMPTS
    }
    loss_fn = cast(types.LossFnType, "cross_entropy" if config.loss == "reinforce" else config.loss)
    adam = types.AdamParams(
        learning_rate=config.learning_rate, grad_clip_norm=config.grad_clip_norm
    )
    records: list[dict[str, Any]] = []
    for step in range(config.steps):
        t0 = time.perf_counter()
        # Stability info is recorded for every sample, so StableReinforce can use its draws.
        sampling_client = await training_client.save_weights_and_get_sampling_client(
            record_stability_info=True
        )
        responses = await _sample_prompts(sampling_client, prompts, config, step)
        t_sample = time.perf_counter() - t0
        data, sequences, by_prompt, examples = _score(prompts, responses, tokenizer, config.loss)

        # Submitted back to back: the optimizer step runs right after the gradient pass.
        fb_future = training_client.forward_backward(
            data, loss_fn=loss_fn, loss_fn_config=config.loss_fn_config()
        )
        optim_future = training_client.optim_step(adam)
        fb, optim = await fb_future, await optim_future
        elapsed = time.perf_counter() - t0

        record = {
            "step": step,
            "reward": float(np.mean(list(by_prompt.values()))),
            "reward_by_prompt": by_prompt,
            "example": examples,
            **_off_policy_stats(sequences, fb),
            "loss": fb.metrics.get("loss:sum", float("nan")),
            "grad_norm": _grad_norm(optim.metrics or {}),
            "loss_metrics": dict(sorted(fb.metrics.items())),
            "optim_metrics": dict(sorted((optim.metrics or {}).items())),
            "time_s": elapsed,
            "sample_time_s": t_sample,
            "tokens_per_s": sum(len(s.tokens) for s in sequences) / elapsed,
        }
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records


async def _sample_prompts(
    sampling_client: tinker.SamplingClient,
    prompts: Mapping[str, types.ModelInput],
    config: RLConfig,
    step: int,
) -> list[types.SampleResponse]:
    """One group of samples per prompt, all in flight at once."""
    return list(
        await asyncio.gather(
            *(
                sampling_client.sample(
                    prompt=model_input,
                    num_samples=config.group_size,
                    sampling_params=types.SamplingParams(
                        max_tokens=config.max_tokens,
                        temperature=config.temperature,
                        stop=[],  # always max_tokens bytes: the reward is per byte
                        seed=(config.seed * 1_000_003 + step * 101 + i) % 2**62,
                    ),
                )
                for i, model_input in enumerate(prompts.values())
            )
        )
    )


def _score(
    prompts: Mapping[str, types.ModelInput],
    responses: Sequence[types.SampleResponse],
    tokenizer: Any,
    loss: str,
) -> tuple[list[types.Datum], list[types.SampledSequence], dict[str, float], dict[str, str]]:
    """Rewards, group-mean advantages and training data of one step's samples."""
    data: list[types.Datum] = []
    sequences: list[types.SampledSequence] = []
    by_prompt: dict[str, float] = {}
    examples: dict[str, str] = {}
    for (prompt, model_input), response in zip(prompts.items(), responses, strict=True):
        rewards = np.array([reward(prompt, s.tokens) for s in response.sequences])
        by_prompt[prompt] = float(rewards.mean())
        examples[prompt] = tokenizer.decode(response.sequences[0].tokens)
        advantages = rewards - rewards.mean()
        for seq, adv in zip(response.sequences, advantages, strict=True):
            datum = build_datum(model_input, seq, float(adv))
            data.append(_to_loss_input(datum, loss))
            sequences.append(seq)
    return data, sequences, by_prompt, examples


def _off_policy_stats(
    sequences: Sequence[types.SampledSequence], fb: types.ForwardBackwardOutput
) -> dict[str, float]:
    """Sampler-vs-learner statistics over every sampled token, from the sampler's logprobs
    and the learner's logprobs that forward_backward returns (so every loss gets them)."""
    lq = np.concatenate([np.asarray(s.logprobs, dtype=np.float64) for s in sequences])
    lp = np.concatenate(
        [
            np.asarray(out["logprobs"].tolist(), dtype=np.float64)[-len(s.tokens) :]
            for s, out in zip(sequences, fb.loss_fn_outputs, strict=True)
        ]
    )
    log_ratio = lp - lq
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(log_ratio)
        return {
            # k1 estimate of KL(sampler || learner) per token; k3 is its never-negative twin.
            "kl_sampler_learner": float(np.mean(-log_ratio)),
            "kl_k3": k3_mean(log_ratio),
            "importance_ratio_max": float(np.max(ratio)),
            "importance_ratio_min": float(np.min(ratio)),
            # Monte-Carlo estimate of the sampler's per-token entropy.
            "entropy": float(np.mean(-lq)),
        }


def _grad_norm(metrics: Mapping[str, float]) -> float:
    for key, value in metrics.items():
        if key.startswith("grad_norm"):
            return float(value)
    return float("nan")


# ---- the command line ---------------------------------------------------------------------------

TIMING_KEYS = ("time_s", "sample_time_s", "tokens_per_s")
# stress setting -> (sampler dtype, stale sampler?)
STRESS: dict[str, tuple[str | None, bool]] = {
    "none": (None, False),
    "stale": (None, True),
    "bf16": ("bfloat16", False),
    "both": ("bfloat16", True),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tinker-sr demo`` (also used by ``python -m tinker_sr.demo``)."""
    parser.add_argument(
        "--steps", type=int, default=RLConfig.steps, help="RL steps (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the whole run (default 0)")
    parser.add_argument("--loss", choices=LOSSES, default="stable_reinforce")
    parser.add_argument(
        "--kl-coeff", type=float, default=None, help="stable_reinforce kl_coeff (default 0.01)"
    )
    parser.add_argument(
        "--model", default="tinker-sr/tiny", choices=("tinker-sr/tiny", "tinker-sr/small")
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=RLConfig.group_size,
        help="samples per prompt (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=RLConfig.learning_rate,
        help="Adam learning rate (default %(default)s)",
    )
    parser.add_argument(
        "--out", default="tinker-sr-demo", help="output directory (default ./%(default)s)"
    )
    parser.add_argument(
        "--base-url", default=None, help="run the same loop against this Tinker-compatible server"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="key for --base-url (default: as every client picks it: $TINKER_API_KEY, else "
        "tml-local for a server on this machine, else the `tinker auth login` key)",
    )
    parser.add_argument(
        "--stress",
        choices=tuple(STRESS),
        default="none",
        help="off-policy stress on the embedded engine: a stale sampler, a "
        "bfloat16 sampler, or both (default none)",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        default=None,
        help="with --stress stale/both: optimizer steps the sampler lags "
        f"(default {DEFAULT_STALENESS})",
    )
    parser.add_argument(
        "--lowering",
        choices=("auto", "always", "never"),
        default="auto",
        help="stable_reinforce on a service without it: lower it to cross_entropy in the client "
        "(auto: when the service lacks it; always; never). Client-side draws use the full "
        "vocabulary as top-k, so they are exact (default auto)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar; print only the result"
    )


@contextlib.contextmanager
def open_service_client(
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    stress: str = "none",
    staleness: int = DEFAULT_STALENESS,
    lowering: LoweringOptions | None = None,
) -> Iterator[tinker.ServiceClient]:
    """A ServiceClient on a fresh, throw-away embedded engine with the requested off-policy
    stress, or on the server at ``base_url``. Closes both on exit. ``lowering``: how
    stable_reinforce runs on a service without it (`LoweringOptions`)."""
    if stress not in STRESS:
        raise ValueError(f"stress must be one of {', '.join(STRESS)}, got {stress!r}")
    if base_url is not None:
        if stress != "none":
            raise ValueError(
                f"stress {stress!r} configures the embedded engine's sampler and cannot apply "
                "to a remote server; drop the stress setting or the base URL"
            )
        with tinker.ServiceClient(
            base_url=base_url, api_key=_key(api_key, base_url), stable_reinforce_lowering=lowering
        ) as client:
            yield client
        return
    if staleness < 1 and stress in ("stale", "both"):
        raise ValueError(f"staleness must be >= 1 with stress {stress!r}, got {staleness}")
    from tinker_sr.backend.local import LocalBackend

    dtype, stale = STRESS[stress]
    with tempfile.TemporaryDirectory(prefix="tinker-sr-demo-") as store:
        backend = LocalBackend(
            store,
            persistent=False,
            sampler_dtype=dtype,
            sampler_staleness=staleness if stale else 0,
        )
        try:
            with tinker.ServiceClient(
                backend=backend, stable_reinforce_lowering=lowering
            ) as client:
                yield client
        finally:
            backend.close()


def _key(api_key: str | None, base_url: str) -> str:
    """The key for ``--base-url``, as every client picks it (``--api-key``, ``$TINKER_API_KEY``,
    ``tml-local`` for a server on this machine, the stored login), else a placeholder that a
    tinker-sr server without configured keys accepts."""
    from tinker_sr.clients.holder import default_api_key

    return default_api_key(api_key, base_url.rstrip("/")) or "tml-tinker-sr-demo"


SERVER_WAIT_S = 15.0
"""How long ``--base-url`` may take to answer (a server started just before the demo)."""


def _server_problem(base_url: str, api_key: str | None) -> str | None:
    """Why the server at ``base_url`` cannot run the demo, or None. A server that does not
    answer yet is given `SERVER_WAIT_S` to start (`tinker-sr serve ... &` just before the demo);
    then one line says so. Without this a dead URL took a minute of retries and ended in a
    long traceback."""
    from tinker_sr.backend.remote import RemoteBackend
    from tinker_sr.clients.holder import submit

    async def check() -> None:
        backend = RemoteBackend(base_url=base_url, api_key=_key(api_key, base_url), max_retries=0)
        try:
            await backend.get_server_capabilities()
        finally:
            await backend.aclose()

    deadline = time.monotonic() + SERVER_WAIT_S
    while True:
        try:
            submit(check()).result(timeout=60)
            return None
        except tinker.APIConnectionError:
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            return (
                f"cannot reach {base_url} (waited {SERVER_WAIT_S:g} s); is a server running "
                "there? Start one with `tinker-sr serve --port PORT`, or drop --base-url to run "
                "on the embedded engine"
            )
        except TimeoutError:
            return f"{base_url} accepted the connection but did not answer in 60 s"
        except tinker.AuthenticationError as e:
            return f"{base_url} refused the API key ({e}); pass the server's key with --api-key"
        except tinker.TinkerError as e:
            return f"{base_url}: {type(e).__name__}: {e}"


_PATHS = {
    "native": "natively (the service implements it)",
    "lowered-2d": "lowered by the client to cross_entropy with 2-D targets (same gradient)",
    "lowered-1d": "lowered by the client to K+1 cross_entropy calls with 1-D targets "
    "(same gradient)",
}


def usage_line(client: tinker.ServiceClient, since: float) -> str | None:
    """What the run used, as the service counts it (`AdminClient.get_billing_usage`, this
    session's events since the hour of ``since``); None from a service that does not say."""
    session = client.holder._session_id
    start, end = (
        datetime.fromtimestamp(t, UTC)
        for t in (usage.hour_bucket(since), usage.hour_bucket(time.time()) + usage.HOUR_S)
    )
    try:
        report = tinker.AdminClient(client.holder).get_billing_usage(start, end)
        events = [e.event_info for e in report.result(timeout=20).data if e.session_id == session]
    except (tinker.TinkerError, NotImplementedError, TimeoutError):
        return None
    n: dict[str, int] = {}
    for info in events:
        kind = usage.event_kind(info)
        n[kind] = n.get(kind, 0) + getattr(info, "token_count", 0)
    cached = n.get(usage.PREFILL_CACHED, 0)
    prompts = n.get(usage.PREFILL, 0) + cached
    return (
        f"usage:   {n.get(usage.TRAINING, 0):,} tokens trained, {n.get(usage.SAMPLE, 0):,} "
        f"sampled, {prompts:,} prompt tokens ({cached:,} from the prompt cache)"
    )


def _lowering_options(mode: str, base_model: str) -> LoweringOptions:
    """Client-side draws over the whole vocabulary (the demo's models are small), so a
    lowered run draws from exactly the sampler's distribution."""
    from tinker_sr.engine.model import BUILTIN_CONFIGS

    vocab = BUILTIN_CONFIGS[base_model].vocab_size
    return LoweringOptions(mode=mode, draw_topk=vocab)  # type: ignore[arg-type]


# What the demo's PNG shows (`tinker_sr.plot.plot_curves` draws it, as for `tinker-sr plot`).
DEMO_PANELS = (
    Panel("reward", "reward"),
    Panel("kl_k3", "KL(sampler ‖ learner) per token, k3", log=True),
    Panel("entropy", "sampler entropy per token (nats)"),
    Panel("grad_norm", "gradient norm", log=True),
)


def summary_window(steps: int, window: int = 5) -> int:
    """Steps averaged at each end by `summarize`: ``window``, or half a shorter run."""
    return max(1, min(window, steps // 2 or 1))


def summarize(records: Sequence[Mapping[str, Any]], window: int = 5) -> tuple[float, float]:
    """Initial and final reward: means over the first and last `summary_window` steps."""
    w = summary_window(len(records), window)
    first = float(np.mean([r["reward"] for r in records[:w]]))
    last = float(np.mean([r["reward"] for r in records[-w:]]))
    return first, last


def _steps(n: int) -> str:
    return "step" if n == 1 else f"{n} steps"


LOG_NAME, PLOT_NAME, CONFIG_NAME = "metrics.jsonl", "learning_curves.png", "config.json"


def _config_from_args(args: argparse.Namespace) -> RLConfig | str:
    """The run's config, or why the arguments do not make one."""
    if args.steps < 1:
        return "--steps must be >= 1"
    if args.group_size < 1:
        return f"--group-size must be >= 1 (samples per prompt), got {args.group_size}"
    if args.staleness is not None and args.stress not in ("stale", "both"):
        return "--staleness only applies with --stress stale or --stress both"
    if args.staleness is not None and args.staleness < 1:
        return f"--staleness must be >= 1 (optim steps the sampler lags), got {args.staleness}"
    if args.base_url is not None and args.stress != "none":
        return (
            f"--stress {args.stress} stresses the embedded engine's sampler; it "
            "cannot be combined with --base-url (a remote server decides its own sampler)."
        )
    loss_config = None
    if args.kl_coeff is not None:
        if args.loss != "stable_reinforce":
            return "--kl-coeff only applies to --loss stable_reinforce"
        loss_config = {"kl_coeff": args.kl_coeff}
    return RLConfig(
        base_model=args.model,
        loss=args.loss,
        loss_config=loss_config,
        steps=args.steps,
        seed=args.seed,
        group_size=args.group_size,
        learning_rate=args.lr,
    )


def _staleness(args: argparse.Namespace) -> int:
    return DEFAULT_STALENESS if args.staleness is None else int(args.staleness)


def _write_config(
    path: Path, config: RLConfig, args: argparse.Namespace, sr_path: str | None
) -> None:
    record = {
        **asdict(config),
        "loss_fn_config": config.loss_fn_config(),
        "stress": args.stress,
        "staleness": _staleness(args) if args.stress in ("stale", "both") else 0,
        "base_url": args.base_url,
        "stable_reinforce_path": sr_path,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def _cannot_run(args: argparse.Namespace) -> tuple[int, str] | None:
    """(exit code, why) when the demo cannot run where it was asked to: a server that cannot
    serve it (1), or an embedded engine on a device this machine lacks or with a rate card
    it cannot read (2, as serve says)."""
    if args.base_url is not None:
        problem = _server_problem(args.base_url, args.api_key)
        return None if problem is None else (1, problem)
    from tinker_sr.cli import environment_problem
    from tinker_sr.engine.device import resolve_device
    from tinker_sr.engine.usage import RateCard

    try:
        resolve_device()  # $TINKER_SR_DEVICE
        RateCard.resolve(None)  # $TINKER_SR_RATE_CARD
    except ValueError as e:
        return 2, str(e)
    problem = environment_problem()  # $TINKER_SR_MODEL_ALIASES, $TINKER_SR_MODEL_DTYPE
    return None if problem is None else (2, problem)


class _RunLog:
    """The run's ``metrics.jsonl``, opened at its first step: a run that fails before one
    leaves a previous run's files in ``--out`` as they were; one that starts replaces them
    (its plot and config too, so the directory never mixes two runs)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._file: Any = None

    def write(self, record: Mapping[str, Any]) -> None:
        if self._file is None:
            for previous in (PLOT_NAME, CONFIG_NAME):
                (self.out / previous).unlink(missing_ok=True)
            self._file = (self.out / LOG_NAME).open("w")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _output_dir(value: str) -> Path | str:
    """``--out`` made ready to write, or why it cannot be."""
    out = Path(value).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        return f"--out {value}: cannot write there ({e.strerror or e}); pass a writable directory"
    return out


def _banner(args: argparse.Namespace, config: RLConfig) -> str:
    where = args.base_url or "embedded engine"
    stress = "" if args.stress == "none" else f", stress={args.stress}"
    if args.stress in ("stale", "both"):
        stress += f" (k={_staleness(args)})"
    return (
        f"tinker-sr demo: {config.loss} on {config.base_model} ({where}{stress}), "
        f"{config.steps} steps, {len(PROMPTS)} prompts x {config.group_size} samples, seed {config.seed}"
    )


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed ``args`` (see `add_arguments`); returns the exit code."""
    from tqdm import tqdm

    config = _config_from_args(args)
    if isinstance(config, str):
        print(f"tinker-sr demo: {config}", file=sys.stderr)
        return 2
    if (refused := _cannot_run(args)) is not None:
        print(f"tinker-sr demo: {refused[1]}", file=sys.stderr)
        return refused[0]
    out = _output_dir(args.out)
    if isinstance(out, str):
        print(f"tinker-sr demo: {out}", file=sys.stderr)
        return 2
    log_path, plot_path = out / LOG_NAME, out / PLOT_NAME
    if not args.quiet:
        print(_banner(args, config))
    bar = tqdm(total=config.steps, unit="step", disable=args.quiet, dynamic_ncols=True)
    t0, started = time.perf_counter(), time.time()
    with contextlib.closing(_RunLog(out)) as log:

        def on_step(record: dict[str, Any]) -> None:
            log.write(record)
            bar.set_postfix(
                reward=f"{record['reward']:.3f}",
                kl=f"{record['kl_sampler_learner']:+.1e}",
                tok_s=f"{record['tokens_per_s']:.0f}",
            )
            bar.update(1)

        try:
            with open_service_client(
                base_url=args.base_url,
                api_key=args.api_key,
                stress=args.stress,
                staleness=_staleness(args),
                lowering=_lowering_options(args.lowering, config.base_model),
            ) as service_client:
                records = asyncio.run(rl_loop(service_client, config, on_step))
                sr_path = service_client.stable_reinforce_path
                used = usage_line(service_client, started)
        except tinker.TinkerError as e:  # the service refused: its message, not a traceback
            bar.close()
            print(f"tinker-sr demo: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        finally:
            bar.close()
    wall = time.perf_counter() - t0

    _write_config(out / CONFIG_NAME, config, args, sr_path)
    initial, final = summarize(records)
    examples = ", ".join(f"{p!r} -> {c!r}" for p, c in records[-1]["example"].items())
    lines = [
        f"reward {initial:.3f} -> {final:.3f} (mean of the first / last "
        f"{_steps(summary_window(len(records)))}) in {wall:.0f} s",
        *([f"stable_reinforce ran: {_PATHS[sr_path]}"] if sr_path is not None else []),
        f"samples at the last step: {examples}",
        *([used] if used is not None else []),
        f"metrics: {log_path}",
    ]
    if not args.no_plot:
        try:
            title = f"tinker-sr demo: {config.loss}"
            plot_curves({config.loss: records}, plot_path, DEMO_PANELS, title=title)
            lines.append(f"plot:    {plot_path}")
        except ImportError:  # the run is done and saved: say so, and how to get the plot
            lines.append(
                "plot:    not drawn: matplotlib is not installed "
                "(pip install 'tinker-sr[plot]', or pass --no-plot)"
            )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tinker_sr.demo", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
