"""A LoRA adapter on the unembedding (``train_unembed=True``, the official SDK's default):
the engine's by-hand head (`loss_logprobs._lora_backward`) against the head's own forward and
autograd, one LoRA train step each, alternating on one training client in one process.

The by-hand path multiplies the frozen weight packed for oneDNN, adds the rank-r update in
place, and writes the logit gradient over the recomputed logits; the other path runs
`LoraLinear.forward` (three [rows, V] temporaries per chunk) and autograd over it. Both see
the same weights (learning rate 0) and batch. Reports per-pair ratios and their median, the
step with the frozen head (``train_unembed=False``) on the same model for scale, and the
largest loss difference between the two head paths (float32 rounding).

    python benchmarks/lora_head.py                      # issue-11 Qwen3 dir, 16 x 256
    python benchmarks/lora_head.py --model tinker-sr/small --batch 8 --seq 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-bench", help="qwen3-bench, a name or a dir")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()

    import torch

    import tinker_sr as tinker
    from tinker_sr.engine import loss_logprobs
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    by_hand = loss_logprobs._lora_parts
    with tempfile.TemporaryDirectory(prefix="tinker-sr-lora-head-") as tmp:
        os.environ["TINKER_SR_STORE"] = str(Path(tmp) / "store")
        model = args.model
        if model == "qwen3-bench":
            from engine_vs_hf import make_model_dir

            model = str(make_model_dir(Path(tmp) / "qwen3"))
        types = tinker.types
        rows = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator())
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(r[:-1]),
                loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * args.seq},
            )
            for r in rows.tolist()
        ]
        service = tinker.ServiceClient()
        clients = {
            unembed: service.create_lora_training_client(
                base_model=model, rank=8, seed=0, train_unembed=unembed
            ).result()
            for unembed in (True, False)
        }

        def step(name: str) -> tuple[float, float]:
            loss_logprobs._lora_parts = by_hand if name == "by hand" else (lambda *a: None)
            client = clients[name != "frozen head"]
            start = time.perf_counter()
            out = client.forward_backward(data, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=0.0)).result()
            return time.perf_counter() - start, out.metrics["loss:sum"]

        names = ("by hand", "autograd", "frozen head")
        print(f"model {args.model}, LoRA r8, train step {args.batch} x {args.seq}, fp32")
        for name in names:
            step(name)  # warm-up
        times: dict[str, list[float]] = {n: [] for n in names}
        losses: dict[str, list[float]] = {n: [] for n in names}
        for i in range(args.pairs):
            for name in names if i % 2 == 0 else names[::-1]:
                seconds, loss = step(name)
                times[name].append(seconds)
                losses[name].append(loss)
        loss_logprobs._lora_parts = by_hand
        for name in names:
            print(
                f"{name:>12}: median {statistics.median(times[name]):.3f} s per step ("
                + ", ".join(f"{t:.3f}" for t in times[name])
                + ")"
            )
        ratios = [a / b for a, b in zip(times["by hand"], times["autograd"], strict=True)]
        diff = max(
            abs(a - b) / abs(b) for a, b in zip(losses["by hand"], losses["autograd"], strict=True)
        )
        print(
            "LoRA head by hand / autograd: median "
            f"{statistics.median(ratios):.3f} (pairs: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f"); loss relative difference <= {diff:.1e}"
        )


if __name__ == "__main__":
    main()
