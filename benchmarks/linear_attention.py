"""Qwen3.5's linear attention in a training step: subnormal floats and per-matrix solves.

Two costs of the gated DeltaNet's chunked (WY) form, which the training step and prefill run:

* Subnormal floats. The state decays by ``exp(g)`` per token; within a chunk the decays and
  their products reach ``exp(-87)`` and below, float32's subnormal range, wherever a head
  decays by more than ~1.4 per token on average (a random Qwen3.5's heads do: transformers
  draws ``A`` from U(0, 16); fast heads of real checkpoints do too). x86 cores compute with
  subnormal operands or results through slow microcode: the step's small batched GEMMs ran
  ~16x below their speed. The engine zeroes decays under ``exp(hybrid.DECAY_FLOOR)``
  (~9e-14) and the rows of the solve past it (`hybrid.decay_exp`).
* Per-matrix solves. torch's triangular solve calls the BLAS once per 64 x 64 matrix, each
  call a parallel region; with the engine's passive OpenMP waits each wakes the other
  threads. The engine solves the whole batch in one C region (`engine.tri_solve`).

This script times, in this one process, one LoRA training client of engine_vs_hf.py's random
~42M-parameter Qwen3.5 (an HF directory with its BPE tokenizer; six DeltaNet layers, two
gated-attention layers), one ``forward_backward`` of the same datums:

* now: the engine as it is;
* baseline: the same with the floor off (``DECAY_FLOOR = -inf``) and torch's solve
  (``--baseline floor`` or ``solve``: only that one undone);

alternating the order per round, and prints now / baseline per round, their median and the
largest difference between the two ways' per-datum log-probs.

    python benchmarks/linear_attention.py                # 8 datums of 256 tokens, 3 rounds
    python benchmarks/linear_attention.py --lengths 2048 --rounds 5
    python benchmarks/linear_attention.py --quick        # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_vs_hf import RANK, _seconds, make_model_dir  # noqa: E402
from mixed_lengths import make_data  # noqa: E402


@contextlib.contextmanager
def undone(which: str) -> Iterator[None]:
    """The engine with ``which`` ("floor", "solve" or "both") of this script's changes undone."""
    from tinker_sr.engine import hybrid, tri_solve

    floor, ready = hybrid.DECAY_FLOOR, tri_solve.native_solve_ready
    if which in ("floor", "both"):
        hybrid.DECAY_FLOOR = float("-inf")  # read per call by `hybrid.decay_exp`
    if which in ("solve", "both"):
        tri_solve.native_solve_ready = lambda *_: False  # type: ignore[assignment]
    try:
        yield
    finally:
        hybrid.DECAY_FLOOR, tri_solve.native_solve_ready = floor, ready  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(["256"] * 8), help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", choices=["both", "floor", "solve"], default="both")
    parser.add_argument("--quick", action="store_true", help="lengths 128,128 and 1 round")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.rounds = "128,128", 1
    lengths = [int(x) for x in args.lengths.split(",")]

    import tinker_sr as tinker
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    print(f"model: qwen3_5; forward_backward of {len(lengths)} datums of {lengths} tokens")
    print(f"baseline: {args.baseline} undone")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", "qwen3_5")
        service = tinker.ServiceClient(backend=LocalBackend(Path(tmp) / "store"))
        training = service.create_lora_training_client(
            base_model=str(model_dir), rank=RANK, seed=0, train_unembed=False
        ).result()
        data = make_data(lengths)

        def now() -> Any:
            return training.forward_backward(data, "cross_entropy").result()

        def baseline() -> Any:
            with undone(args.baseline):
                return now()

        # Warm-up (kernel caches, allocator) and the two ways' outputs compared.
        a, b = now().loss_fn_outputs, baseline().loss_fn_outputs
        diff = max(
            float(abs(x["logprobs"].to_torch() - y["logprobs"].to_torch()).max())
            for x, y in zip(a, b, strict=True)
        )
        print(f"per-datum log-probs, now vs baseline: max |difference| {diff:.2e}")
        ratios = []
        for r in range(args.rounds):
            ways = [("now", now), ("baseline", baseline)]
            t = {name: _seconds(fn) for name, fn in (ways if r % 2 == 0 else ways[::-1])}
            ratios.append(t["now"] / t["baseline"])
            print(
                f"round {r}: now {t['now']:.2f} s, baseline {t['baseline']:.2f} s "
                f"-> {ratios[-1]:.2f}x"
            )
    print(
        f"step now / baseline ({args.baseline} undone): {statistics.median(ratios):.2f}x time "
        f"(median of {len(ratios)}; per round {', '.join(f'{x:.2f}' for x in ratios)})"
    )


if __name__ == "__main__":
    main()
