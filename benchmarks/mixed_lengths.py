"""Training on datums of very different lengths in one call, as RL batches bring them.

An RL batch mixes short and long rollouts (a tool-calling episode of thousands of tokens beside
answers of a hundred). A ``forward_backward`` call that pads every datum to the longest pays
for ``B x longest`` tokens (and for attention over them) instead of the tokens it has. This
script times, in this one process, on one LoRA training client of engine_vs_hf.py's random
~42M-parameter Qwen3 (an HF directory with its BPE tokenizer; ``--arch qwen3_5``: the same sizes
with Qwen3.5's linear-attention layers):

* mixed: all datums in one ``forward_backward`` call (what a user's loop does);
* baseline: the same datums one per call, run back to back (no padding at all);

and prints mixed / baseline per round (1.0: a call costs what its datums cost alone; the
padded batch cost about ``B x longest / sum`` of that) and the largest difference between the
two ways' per-datum log-probs. Rounds alternate the order. The same work as tokens:
``--lengths``; the model's context is 2,048 tokens.

    python benchmarks/mixed_lengths.py                     # 2048,1024,512,256,128,128,64,64
    python benchmarks/mixed_lengths.py --lengths 1500,300,300,300,300 --rounds 5
    python benchmarks/mixed_lengths.py --quick             # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_vs_hf import RANK, _seconds, make_model_dir  # noqa: E402

DEFAULT_LENGTHS = "2048,1024,512,256,128,128,64,64"


def make_data(lengths: list[int], vocab: int = 32000) -> list[Any]:
    """One cross-entropy datum per length: random tokens (seeded), the first quarter a prompt
    (weight 0), the rest weighted 1."""
    import torch

    import tinker_sr as tinker

    types = tinker.types
    gen = torch.Generator().manual_seed(0)
    data = []
    for n in lengths:
        row = torch.randint(1000, vocab, (n + 1,), generator=gen).tolist()
        prompt = n // 4
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={
                    "target_tokens": row[1:],
                    "weights": [0.0] * prompt + [1.0] * (n - prompt),
                },
            )
        )
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--arch", choices=["qwen3", "qwen3_5"], default="qwen3", help="qwen3_5: Qwen3.5's hybrid"
    )
    parser.add_argument("--quick", action="store_true", help="lengths 256,64,32 and 1 round")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.rounds = "256,64,32", 1
    lengths = [int(x) for x in args.lengths.split(",")]

    import tinker_sr as tinker
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    total, padded = sum(lengths), len(lengths) * max(lengths)
    print(
        f"model: {args.arch}; datums: {len(lengths)} of {lengths} tokens = {total} tokens; "
        f"padded to the longest {padded} ({padded / total:.2f}x)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", args.arch)
        service = tinker.ServiceClient(backend=LocalBackend(Path(tmp) / "store"))
        training = service.create_lora_training_client(
            base_model=str(model_dir), rank=RANK, seed=0, train_unembed=False
        ).result()
        data = make_data(lengths)

        def mixed() -> list[Any]:
            return [training.forward_backward(data, "cross_entropy").result()]

        def one_per_call() -> list[Any]:
            futures = [training.forward_backward([d], "cross_entropy") for d in data]
            return [f.result() for f in futures]

        # Warm-up (kernel caches, allocator) and the two ways' outputs compared.
        a = mixed()[0].loss_fn_outputs
        b = [o.loss_fn_outputs[0] for o in one_per_call()]
        diff = max(
            float(abs(x["logprobs"].to_torch() - y["logprobs"].to_torch()).max())
            for x, y in zip(a, b, strict=True)
        )
        print(f"per-datum log-probs, one call vs one per call: max |difference| {diff:.2e}")
        ratios = []
        for r in range(args.rounds):
            ways = [("mixed", mixed), ("baseline", one_per_call)]
            t = {name: _seconds(fn) for name, fn in (ways if r % 2 == 0 else ways[::-1])}
            ratios.append(t["mixed"] / t["baseline"])
            print(
                f"round {r}: one call {t['mixed']:.2f} s ({total / t['mixed']:.0f} tokens/s), "
                f"one per call {t['baseline']:.2f} s -> {ratios[-1]:.2f}x"
            )
    print(
        f"mixed lengths in one call / one per call: {statistics.median(ratios):.2f}x time "
        f"(median of {len(ratios)}; per round {', '.join(f'{x:.2f}' for x in ratios)}; "
        f"padding to the longest would be up to {padded / total:.2f}x)"
    )


if __name__ == "__main__":
    main()
