"""RL-shaped sampling: tinker_sr's continuous batching against HF ``generate`` per request.

Issue 11 goal 4. The model is engine_vs_hf.py's random Qwen3 (vocab 32,000, hidden 512,
8 layers, ~42M parameters) written once as a Hugging Face directory and loaded by both sides;
tinker_sr samples a LoRA (rank 8, untrained: the same weights) through its public API.

* rl: R concurrent requests (default 32) x 8 samples x 128 new tokens, prompts of 32-64
  tokens, temperature 1, logprobs on. tinker_sr: every ``SamplingClient.sample`` is issued
  before any result is awaited (the engine decodes them together). HF: ``generate``
  (``do_sample``, ``num_return_sequences=8``, ``output_scores`` turned into logprobs) called
  per request, one after another. HF's time is linear in the number of requests, so it runs
  the first ``--hf-requests`` of them and its tokens/s is compared (goal: >= 3x).
* single: one request, 8 x 128 from a 32-token prompt (goal: >= 1.5x).
* record: the rl workload with ``record_stability_info`` on vs off, tinker_sr only
  (goal: overhead <= 5 %).
* overlap (goal 7, tinker_sr only): a LoRA train step (8 x 128 tokens, cross_entropy +
  Adam) of the sampled model and the single sample request issued together vs one after the
  other; sequential time / overlapped time (> 1: sampling and training overlap).

HF uses the LoRA merged into its weights (``merge_and_unload``: HF's fastest form of the same
weights; ``--hf-peft`` keeps peft's unmerged adapters, as engine_vs_hf.py does). Both sides
run in this one process with the same intra-op thread count; rounds alternate the order of
the sides, and the report gives per-round ratios and their median, with the machine line.

    pip install -e '.[bench]'                       # transformers + peft
    python benchmarks/rl_sampling.py                # 32 requests, 2 rounds (minutes on 2 cores)
    python benchmarks/rl_sampling.py --rounds 3 --hf-requests 8
    python benchmarks/rl_sampling.py --quick        # smoke test: small and fast
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_vs_hf import RANK, hf_model, make_model_dir  # noqa: E402

SAMPLES = 8
RL_TARGET, SINGLE_TARGET, RECORD_TARGET = 3.0, 1.5, 1.05


def prompts(n: int, lo: int, hi: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, 32000, (k,), generator=gen).tolist() for k in lengths]


class Engine:
    """tinker_sr through its public API: a LoRA sampler, with and without stability info."""

    def __init__(self, model_dir: Path, new_tokens: int) -> None:
        import tinker_sr as tinker

        self.types = tinker.types
        self.service = tinker.ServiceClient()
        self.training = training = self.service.create_lora_training_client(
            base_model=str(model_dir), rank=RANK, seed=0, train_unembed=False
        ).result()
        self.plain = training.save_weights_and_get_sampling_client().result()
        self.recording = training.save_weights_and_get_sampling_client(
            record_stability_info=True
        ).result()
        self.new_tokens = new_tokens

    def run(self, batch: list[list[int]], *, record: bool = False) -> int:
        """Issue every request, then await them all; returns the tokens sampled."""
        sc = self.recording if record else self.plain
        futures = [
            sc.sample(
                self.types.ModelInput.from_ints(p),
                num_samples=SAMPLES,
                sampling_params=self.types.SamplingParams(
                    max_tokens=self.new_tokens, temperature=1.0, seed=i, stop=[]
                ),
            )
            for i, p in enumerate(batch)
        ]
        results = [f.result() for f in futures]
        assert all(len(s.logprobs or []) == self.new_tokens for r in results for s in r.sequences)
        return sum(len(s.tokens) for r in results for s in r.sequences)

    def train_and_sample(self, batch: list[list[int]], *, together: bool) -> float:
        """Seconds for one train step and one sample request: issued together, or the
        sample only after the step finished."""
        data = [
            self.types.Datum(
                model_input=self.types.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)},
            )
            for row in prompts(8, 129, 129)
        ]
        start = time.perf_counter()
        fb = self.training.forward_backward(data, "cross_entropy")
        opt = self.training.optim_step(self.types.AdamParams(learning_rate=1e-5))
        if not together:
            fb.result(), opt.result()
        self.run(batch)
        fb.result(), opt.result()
        return time.perf_counter() - start


class HF:
    """transformers ``generate`` per request, logprobs from ``output_scores``."""

    def __init__(self, model_dir: Path, new_tokens: int, peft: bool) -> None:
        model = hf_model(str(model_dir))
        self.model = (model if peft else model.merge_and_unload()).eval()
        self.new_tokens = new_tokens

    def run(self, batch: list[list[int]]) -> int:
        import torch

        total = 0
        for p in batch:
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=torch.tensor([p]),
                    do_sample=True,
                    num_return_sequences=SAMPLES,
                    max_new_tokens=self.new_tokens,
                    min_new_tokens=self.new_tokens,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
                lps = self.model.compute_transition_scores(
                    out.sequences, out.scores, normalize_logits=True
                )
            total += lps.numel()
        return total


def tokens_per_second(fn: Callable[[], int]) -> float:
    start = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hf-requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hf-peft", action="store_true", help="HF with unmerged peft adapters")
    parser.add_argument("--quick", action="store_true", help="4 requests x 16 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.hf_requests, args.new_tokens, args.rounds = 4, 1, 16, 1

    import torch

    from tinker_sr.engine.cpu import default_torch_threads, describe_machine

    torch.set_num_threads(default_torch_threads())  # HF gets the engine's thread count
    print(describe_machine())
    print(
        f"rl: {args.requests} requests x {SAMPLES} x {args.new_tokens} new tokens (HF on the "
        f"first {args.hf_requests}); single: 1 x {SAMPLES} x {args.new_tokens}; "
        f"HF weights: {'peft, unmerged' if args.hf_peft else 'LoRA merged'}"
    )
    rl_batch = prompts(args.requests, 32, 64)
    single = prompts(1, 32, 32)
    with tempfile.TemporaryDirectory(prefix="tinker-sr-rl-") as tmp:
        model_dir = make_model_dir(Path(tmp) / "qwen3")
        engine, hf = (
            Engine(model_dir, args.new_tokens),
            HF(model_dir, args.new_tokens, args.hf_peft),
        )
        # Warm-up: merged weights, allocator, and the engine's one-time GEMM probes (one per
        # weight shape and row count, `engine.batching`): the rl batch meets most row counts.
        engine.run(rl_batch)
        engine.run(rl_batch, record=True)  # the recording sampler's merged weights
        hf.run(single)
        rows = [_round(r, engine, hf, rl_batch, single, args) for r in range(args.rounds)]
        engine.service.close().result()
    _report(rows)


def _round(
    r: int, engine: Engine, hf: HF, rl: list[list[int]], single: list[list[int]], args: Any
) -> dict[str, float]:
    """One round of every measurement; the sides' order alternates between rounds."""
    jobs: dict[str, Callable[[], int]] = {
        # The recording pair runs back to back (in either order), so drift of the machine
        # between measurements does not show up as recording overhead.
        "engine_rl": lambda: engine.run(rl),
        "engine_rl_record": lambda: engine.run(rl, record=True),
        "hf_rl": lambda: hf.run(rl[: args.hf_requests]),
        "engine_single": lambda: engine.run(single),
        "hf_single": lambda: hf.run(single),
    }
    order = list(jobs) if r % 2 == 0 else list(reversed(jobs))
    got = {name: tokens_per_second(jobs[name]) for name in order}
    for together in (r % 2 == 0, r % 2 != 0):
        got[f"overlap_{together}"] = engine.train_and_sample(single, together=together)
    print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    return got


# (label, numerator, denominator, goal) of each reported ratio
RATIOS = (
    ("rl tokens/s, tinker_sr / HF per request", "engine_rl", "hf_rl", f"goal >= {RL_TARGET}"),
    ("single tokens/s, tinker_sr / HF", "engine_single", "hf_single", f"goal >= {SINGLE_TARGET}"),
    (
        "rl time with record_stability_info / without",
        "engine_rl",
        "engine_rl_record",
        f"goal <= {RECORD_TARGET}",
    ),
    (
        "train step + sample: sequential time / issued together",
        "overlap_False",
        "overlap_True",
        "> 1: they overlap",
    ),
)


def _report(rows: list[dict[str, float]]) -> None:
    print()
    for name in ("engine_rl", "hf_rl", "engine_single", "hf_single", "engine_rl_record"):
        print(f"{name}: median {statistics.median(r[name] for r in rows):.0f} tokens/s")
    for label, num, den, goal in RATIOS:
        ratios = [r[num] / r[den] for r in rows]
        per_round = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"{label}: median {statistics.median(ratios):.2f} (rounds: {per_round}; {goal})")


if __name__ == "__main__":
    main()
