"""Varying shapes in a long run: oneDNN products at bucketed row counts (`gemm.bucket_rows`,
the engine's default) against exact row counts (the baseline: `bucket_rows` replaced by the
identity in that process), on RL-shaped work whose lengths change every step.

Each step: ``forward_backward`` (cross_entropy) on a batch whose sequence length is drawn anew
(``--min-len``..``--max-len``) and ``optim_step``, then one sample from a prompt of a newly
drawn length. The same seeded lengths for both sides; each side in its own process (RSS is per
process), alternating over ``--rounds``. oneDNN compiles and caches a kernel per product shape,
so with exact row counts a new length is new kernels, kept: the baseline's RSS grows with the
steps. Prints the CPU, each side's seconds per step (after a warm-up step) and RSS growth from
the first step to the last, and the ratios.

    python benchmarks/shape_buckets.py                      # 60 steps x 2 rounds, ~5 min
    python benchmarks/shape_buckets.py --steps 150 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from engine_vs_hf import make_model_dir  # noqa: E402 - benchmarks/engine_vs_hf.py, beside this script
from memory import MIB, rss_bytes  # noqa: E402

BATCH = 8
VOCAB = 32000


def rl_step(training: Any, types: Any, rng: random.Random, gen: Any, lengths: tuple[int, int], step: int) -> float:  # fmt: skip
    """One step of the benchmarks' RL-shaped work (the module docstring); its seconds."""
    import torch

    seq = rng.randint(*lengths)
    rows = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=gen).tolist()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * seq},
        )
        for row in rows
    ]
    prompt = torch.randint(0, VOCAB, (rng.randint(*lengths),), generator=gen).tolist()
    start = time.perf_counter()
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    sampler = training.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=step)
    sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    return time.perf_counter() - start


def run_steps(model_dir: str, steps: int, lengths: tuple[int, int]) -> dict[str, Any]:
    """``steps`` of `rl_step` on a LoRA r8 client of ``model_dir``: seconds per step after the
    first, RSS after each, and when each began (``marks``: ms since the epoch)."""
    import torch

    import tinker_sr as tinker

    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    training = (
        tinker.ServiceClient()
        .create_lora_training_client(base_model=model_dir, rank=8, seed=0, train_unembed=False)
        .result()
    )
    times, rss, marks = [], [], []
    for step in range(steps):
        marks.append(time.time() * 1000)
        times.append(rl_step(training, tinker.types, rng, gen, lengths, step))
        rss.append(rss_bytes())
    return {"seconds_per_step": sum(times[1:]) / max(steps - 1, 1), "rss": rss, "marks": marks}


def run_side(side: str, model_dir: str, steps: int, lengths: tuple[int, int]) -> dict[str, Any]:
    from tinker_sr.engine import gemm

    if side == "exact":
        gemm.bucket_rows = lambda m: m  # the baseline: every product at its own row count
    return run_steps(model_dir, steps, lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=400)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = (args.min_len, args.max_len)
    if args.child:
        side, model_dir = args.child
        print(json.dumps(run_side(side, model_dir, args.steps, lengths)))
        return
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    print(
        f"{args.steps} steps per side: LoRA r8 train step on {BATCH} x {lengths[0]}-{lengths[1]} "
        f"tokens + a 2-sample, 8-token sample from a {lengths[0]}-{lengths[1]}-token prompt"
    )
    results: dict[str, list[dict[str, Any]]] = {"exact": [], "bucketed": []}
    with tempfile.TemporaryDirectory(prefix="tinker-sr-buckets-") as tmp:
        model_dir = str(make_model_dir(Path(tmp) / "model"))
        for r in range(args.rounds):
            for side in ("exact", "bucketed") if r % 2 == 0 else ("bucketed", "exact"):
                cmd = [sys.executable, __file__, "--steps", str(args.steps)]
                cmd += ["--min-len", str(args.min_len), "--max-len", str(args.max_len)]
                cmd += ["--child", side, model_dir]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                got = json.loads(out.strip().splitlines()[-1])
                results[side].append(got)
                rss = got["rss"]
                print(
                    f"round {r + 1} {side:>8}: {got['seconds_per_step']:.3f} s/step, RSS "
                    f"{rss[0] / MIB:.0f} -> {rss[len(rss) // 2] / MIB:.0f} -> "
                    f"{rss[-1] / MIB:.0f} MiB (first, middle, last step)",
                    flush=True,
                )
    for r, (e, b) in enumerate(zip(results["exact"], results["bucketed"], strict=True)):
        grow_e = (e["rss"][-1] - e["rss"][0]) / MIB
        grow_b = (b["rss"][-1] - b["rss"][0]) / MIB
        print(
            f"round {r + 1}: time exact / bucketed {e['seconds_per_step'] / b['seconds_per_step']:.2f}x; "
            f"RSS growth exact {grow_e:+.0f} MiB, bucketed {grow_b:+.0f} MiB"
        )


if __name__ == "__main__":
    main()
