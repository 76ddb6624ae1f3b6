"""The engine's allocator tuning (`tinker_sr.engine.cpu.tune_allocator`) on a long training run.

One LoRA training run with shapes drawn at random each step (batch 2-8 x 32-256 tokens, the
same seed both ways), in a fresh process with the tuning on and another with
``TINKER_SR_MALLOC_TUNING=0`` (glibc's defaults), alternating over rounds. Reports, per side:
wall time, RSS between steps at step 25 and at the last step (flat = no growth), peak RSS and
minor page faults per step; then the ratios tuned / default.

    python benchmarks/allocator.py                          # tinker-sr/small, 150 steps, 2 rounds
    python benchmarks/allocator.py --model /path/to/hf_dir --steps 150 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from memory import MIB, rss_bytes  # noqa: E402 - benchmarks/memory.py, beside this script


def child(model: str, steps: int) -> None:
    import tinker_sr as tinker

    types = tinker.types
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=model, rank=8, seed=0).result()
    vocab = training.get_tokenizer().vocab_size if hasattr(training, "get_tokenizer") else 256
    vocab = min(int(vocab), 32000)
    rng = random.Random(0)
    rss_at: dict[int, float] = {}
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch, n = rng.choice([2, 4, 8]), rng.choice([32, 64, 128, 256])
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints([rng.randrange(vocab) for _ in range(n)]),
                loss_fn_inputs={
                    "target_tokens": [rng.randrange(vocab) for _ in range(n)],
                    "weights": [1.0] * n,
                },
            )
            for _ in range(batch)
        ]
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        if step in (25, steps):
            rss_at[step] = rss_bytes() / MIB
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "seconds": time.perf_counter() - start,
                "rss_25": rss_at.get(25, 0.0),
                "rss_last": rss_at[steps],
                "peak": usage.ru_maxrss / 1024,
                "faults_per_step": (usage.ru_minflt - faults0) / steps,
            }
        )
    )


def run(model: str, steps: int, tuned: bool) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TINKER_SR_MALLOC_TUNING": "1" if tuned else "0"}
    cmd = [sys.executable, __file__, "--child", "--model", model, "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinker-sr/small")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.steps)
        return
    if args.steps < 25:
        parser.error("--steps must be >= 25 (RSS is read at step 25 and at the last step)")
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    print(f"model {args.model}, {args.steps} steps of LoRA r8 cross_entropy + Adam, random shapes")
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for tuned in (True, False) if r % 2 == 0 else (False, True):
            got = run(args.model, args.steps, tuned)
            rows[tuned].append(got)
            side = "tuned  " if tuned else "default"
            print(
                f"round {r + 1} {side}: {got['seconds']:.1f} s, RSS step 25 {got['rss_25']:.0f} "
                f"-> step {args.steps} {got['rss_last']:.0f} MiB, peak {got['peak']:.0f} MiB, "
                f"{got['faults_per_step']:.0f} page faults/step"
            )

    def med(tuned: bool, key: str) -> float:
        return statistics.median(g[key] for g in rows[tuned])

    print(
        f"tuned / default: time {med(True, 'seconds') / med(False, 'seconds'):.3f}, "
        f"peak RSS {med(True, 'peak') / med(False, 'peak'):.3f}; tuned RSS last / step 25: "
        f"{med(True, 'rss_last') / med(True, 'rss_25'):.3f} (flat = 1)"
    )


if __name__ == "__main__":
    main()
