"""A LoRA adapter on the unembedding (``train_unembed=True``, the official SDK's default):
the engine's head with its backward formed in forward (the loss's gradient known ahead,
`loss_grads`), the same by-hand head recomputing the logits in backward
(`loss_logprobs._lora_backward`), and the head's own forward and autograd, one LoRA train step
each, alternating on one training client in one process.

The by-hand paths multiply the frozen weight packed for oneDNN and add the rank-r update in
place; with the gradient known, each chunk's logit gradient is formed while its logits are at
hand (no unembedding product in backward), else backward recomputes the logits and writes the
logit gradient over them; autograd runs `LoraLinear.forward` (three [rows, V] temporaries per
chunk). All see the same weights (learning rate 0) and batch. Reports per-pair ratios and
their median (known gradient / recompute, and by hand / autograd), the step with the frozen
head (``train_unembed=False``) on the same model for scale, and the largest loss difference
between the paths (float32 rounding). ``--loss importance_sampling`` gives each datum a
prompt of a quarter of its positions (advantage 0: no gradient there).

    python benchmarks/lora_head.py                      # issue-11 Qwen3 dir, 16 x 256
    python benchmarks/lora_head.py --loss importance_sampling
    TINKER_SR_TRAIN_DTYPE=bf16 python benchmarks/lora_head.py   # bf16 mixed precision
    python benchmarks/lora_head.py --model tinker-sr/small --batch 8 --seq 128
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from compiled import alternate, model_and_batch, model_args, report  # noqa: E402 - beside this script


def main() -> None:
    parser = model_args(__doc__.splitlines()[0])
    parser.add_argument("--loss", default="cross_entropy", choices=LOSSES)
    args = parser.parse_args()

    import tinker_sr as tinker
    from tinker_sr.engine import loss_logprobs
    from tinker_sr.engine.cpu import describe_machine
    from tinker_sr.engine.registry import train_autocast_dtype

    print(describe_machine())
    by_hand = loss_logprobs._lora_parts
    with tempfile.TemporaryDirectory(prefix="tinker-sr-lora-head-") as tmp:
        model, data = model_and_batch(args.model, args.batch, args.seq, Path(tmp))
        if args.loss != "cross_entropy":
            data = [as_policy_datum(d, args.seq) for d in data]
        types = tinker.types
        service = tinker.ServiceClient()
        clients = {
            unembed: service.create_lora_training_client(
                base_model=model, rank=8, seed=0, train_unembed=unembed
            ).result()
            for unembed in (True, False)
        }

        def step(name: str) -> tuple[float, float]:
            loss_logprobs._lora_parts = (lambda *a: None) if name == "autograd" else by_hand
            loss_logprobs.PRECOMPUTE_HEAD_GRAD = name != "recompute"
            client = clients[name != "frozen head"]
            start = time.perf_counter()
            out = client.forward_backward(data, args.loss).result()
            client.optim_step(types.AdamParams(learning_rate=0.0)).result()
            return time.perf_counter() - start, out.metrics["loss:sum"]

        names = ("known gradient", "recompute", "autograd", "frozen head")
        precision = "bf16 autocast" if train_autocast_dtype() is not None else "fp32"
        shape = f"train step {args.batch} x {args.seq}, {precision}, {args.loss}"
        print(f"model {args.model}, LoRA r8, {shape}")
        for name in names:
            step(name)  # warm-up
        times, losses = alternate(step, names, args.pairs)
        loss_logprobs._lora_parts, loss_logprobs.PRECOMPUTE_HEAD_GRAD = by_hand, True
        report(times, losses, "known gradient", "recompute", "known gradient / recompute")
        label = "LoRA head by hand (recompute) / autograd"
        report(times, losses, "recompute", "autograd", label, list_times=False)


LOSSES = ("cross_entropy", "importance_sampling")


def as_policy_datum(d: Any, seq: int) -> Any:
    """The datum with importance-sampling inputs: sampler log-probs, and advantage 0 on the
    first quarter of the positions (a prompt) and 1 after."""
    import tinker_sr as tinker

    prompt = seq // 4
    inputs = {
        "target_tokens": d.loss_fn_inputs["target_tokens"],
        "logprobs": [-5.0] * seq,
        "advantages": [0.0] * prompt + [1.0] * (seq - prompt),
    }
    return tinker.types.Datum(model_input=d.model_input, loss_fn_inputs=inputs)


if __name__ == "__main__":
    main()
