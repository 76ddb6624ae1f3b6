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

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from compiled import alternate, model_and_batch, model_args, report  # noqa: E402 - beside this script


def main() -> None:
    args = model_args(__doc__.splitlines()[0]).parse_args()

    import tinker_sr as tinker
    from tinker_sr.engine import loss_logprobs
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    by_hand = loss_logprobs._lora_parts
    with tempfile.TemporaryDirectory(prefix="tinker-sr-lora-head-") as tmp:
        model, data = model_and_batch(args.model, args.batch, args.seq, Path(tmp))
        types = tinker.types
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
        times, losses = alternate(step, names, args.pairs)
        loss_logprobs._lora_parts = by_hand
        report(times, losses, "by hand", "autograd", "LoRA head by hand / autograd")


if __name__ == "__main__":
    main()
