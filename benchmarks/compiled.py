"""The engine's compiled kernels (`tinker_sr/engine/compiled.py`) against torch's kernels:
one LoRA train step, each way, in one process.

Three settings of the same training client: ``torch`` (``$TINKER_SR_NATIVE=0``: torch's
kernels only, the engine before the C kernels), ``default`` (the C attention and row kernels,
what users get) and ``compile`` (``$TINKER_SR_COMPILE=1``: the inductor loops on top).
``--compare A,B`` runs A and B in alternating order (the switches are read per call, so nothing
else changes between the two: same weights, same batch, same oneDNN products; learning rate 0
so every step sees the same weights). Reports the first step of each (C build or inductor
compile), per-pair time ratios A / B and their median, and the largest relative difference
of the loss between the two (float32 rounding: sums run in another order).

The default model is the issue-11 benchmark's Qwen3 directory (engine_vs_hf.py; needs the
``bench`` extra for transformers); ``--model tinker-sr/small`` needs nothing extra.

``--attention`` times the C attention kernel alone (forward + backward, best of 3) against
torch's CPU flash attention (``F.scaled_dot_product_attention``) on the step's shape and on
longer sequences, in the same process; then, on bf16 inputs, the bf16 GEMM attention
(`bf16_attention.bf16_causal_attention`, what bf16 training runs) against torch's flash
attention at RL lengths of a Qwen3-0.6B-shaped layer. It tunes glibc's allocator first, as a
`LocalBackend` does (`cpu.tune_allocator`): with its single heap torch's bf16 flash attention
backward runs ~3x slower than with glibc's per-thread arenas (10.7 vs 35.2 ms at 16 x 25
tokens on an Intel Xeon), and that is what the engine meets.

    python benchmarks/compiled.py                       # default vs torch, Qwen3 dir, 16 x 256
    python benchmarks/compiled.py --compare compile,default
    python benchmarks/compiled.py --model tinker-sr/small --batch 8 --seq 128
    python benchmarks/compiled.py --attention           # the attention kernel alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout


def model_args(description: str) -> argparse.ArgumentParser:
    """A parser with the options this script and lora_head.py share (model, batch, pairs)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="qwen3-bench", help="qwen3-bench, a name or a dir")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=5)
    return parser


def main() -> None:
    parser = model_args(__doc__.splitlines()[0])
    parser.add_argument("--compare", default="default,torch", help="A,B of: " + ",".join(SETTINGS))
    parser.add_argument("--attention", action="store_true", help="the attention kernel alone")
    args = parser.parse_args()
    if args.attention:
        attention_only()
        return

    import tinker_sr as tinker
    from tinker_sr.engine import compiled
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    with tempfile.TemporaryDirectory(prefix="tinker-sr-compiled-") as tmp:
        model, data = model_and_batch(args.model, args.batch, args.seq, Path(tmp))
        types = tinker.types
        training = (
            tinker.ServiceClient()
            .create_lora_training_client(base_model=model, rank=8, seed=0, train_unembed=False)
            .result()
        )

        def step(setting: str) -> tuple[float, float]:
            inductor, native = SETTINGS[setting]
            os.environ[compiled.ENV], os.environ[compiled.NATIVE_ENV] = inductor, native
            compiled.enabled.cache_clear()
            compiled.native_mode.cache_clear()
            start = time.perf_counter()
            out = training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=0.0)).result()
            return time.perf_counter() - start, out.metrics["loss:sum"]

        a, b = args.compare.split(",")
        if a not in SETTINGS or b not in SETTINGS:
            sys.exit(f"--compare: two of {', '.join(SETTINGS)}, e.g. default,torch")
        print(f"model {args.model}, LoRA r8, train step {args.batch} x {args.seq}, fp32")
        firsts = {name: step(name)[0] for name in (b, a)}
        for why in (compiled.failure(), compiled.native_failure()):
            if why:
                sys.exit(f"compiled kernels unavailable here: {why}")
        print(f"first steps (C build / compile): {a} {firsts[a]:.2f} s, {b} {firsts[b]:.2f} s")
        times, losses = alternate(step, (b, a), args.pairs)
        report(times, losses, a, b, f"{a} / {b} time")


def model_and_batch(model: str, batch: int, seq: int, tmp: Path) -> tuple[str, list[Any]]:
    """The model to train (``qwen3-bench``: the issue-11 Qwen3 directory, written under
    ``tmp``; else a name or a directory) and a batch of ``batch`` x ``seq`` random-token
    cross-entropy datums; the engine's store goes under ``tmp`` too."""
    import torch

    import tinker_sr as tinker

    os.environ["TINKER_SR_STORE"] = str(tmp / "store")
    if model == "qwen3-bench":
        from engine_vs_hf import make_model_dir

        model = str(make_model_dir(tmp / "qwen3"))
    types = tinker.types
    rows = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator())
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * seq},
        )
        for r in rows.tolist()
    ]
    return model, data


def alternate(
    step: Callable[[str], tuple[float, float]], names: Sequence[str], pairs: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds and losses of ``step(name)`` for each name, ``pairs`` rounds, the order of the
    names reversed every other round."""
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            seconds, loss = step(name)
            times[name].append(seconds)
            losses[name].append(loss)
    return times, losses


def report(
    times: dict[str, list[float]],
    losses: dict[str, list[float]],
    a: str,
    b: str,
    label: str,
    *,
    list_times: bool = True,
) -> None:
    """Each setting's median and per-round step times (unless ``list_times`` is False), then
    the per-pair ratios a / b, their median and the largest relative loss difference between
    a and b."""
    width = max(len(n) for n in times)
    for name, seconds in times.items() if list_times else ():
        print(
            f"{name:>{width}}: median {statistics.median(seconds):.3f} s per step ("
            + ", ".join(f"{t:.3f}" for t in seconds)
            + ")"
        )
    ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
    diff = max(abs(x - y) / abs(y) for x, y in zip(losses[a], losses[b], strict=True))
    print(
        f"{label}: median {statistics.median(ratios):.3f} (pairs: "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f"); loss relative difference <= {diff:.1e}"
    )


# name: ($TINKER_SR_COMPILE, $TINKER_SR_NATIVE)
SETTINGS = {"torch": ("0", "0"), "default": ("0", "auto"), "compile": ("1", "auto")}


# (batch, query heads, KV heads, length, head size): the benchmark step's layer, then longer.
ATTENTION_SHAPES = ((16, 8, 4, 256, 64), (4, 8, 4, 1024, 64), (1, 16, 8, 2048, 128))


# bf16 inputs: Qwen3-0.6B's attention (16 heads of 128, 8 KV heads) at RL lengths.
BF16_ATTENTION_SHAPES = ((16, 16, 8, 25, 128), (16, 16, 8, 96, 128), (8, 16, 8, 256, 128))


def attention_only() -> None:
    from tinker_sr.engine.cpu import describe_machine, tune_allocator

    tune_allocator()  # as the engine runs (see the module's docstring)
    print(describe_machine())
    for b, h, kv, t, d in ATTENTION_SHAPES:
        mine, theirs = _attention_ms(b, h, kv, t, d)
        print(
            f"B {b} x H {h} (KV {kv}) x T {t} x D {d}: C kernel forward + backward {mine:.1f} ms, "
            f"torch flash attention {theirs:.1f} ms, ratio {mine / theirs:.2f}"
        )
    for b, h, kv, t, d in BF16_ATTENTION_SHAPES:
        mine, theirs = _attention_ms(b, h, kv, t, d, bf16=True)
        print(
            f"bf16 B {b} x H {h} (KV {kv}) x T {t} x D {d}: GEMM attention forward + backward "
            f"{mine:.1f} ms, torch flash attention {theirs:.1f} ms, ratio {mine / theirs:.2f}"
        )


def _attention_ms(
    b: int, h: int, kv: int, t: int, d: int, bf16: bool = False
) -> tuple[float, float]:
    """Best of 3 forward + backward times (ms): the C kernel (``bf16``: the bf16 GEMM
    attention), torch's flash attention."""
    import torch
    import torch.nn.functional as F

    from tinker_sr.engine import compiled
    from tinker_sr.engine.bf16_attention import bf16_causal_attention

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v = (
        torch.randn(b, n, t, d, generator=gen).to(dtype).requires_grad_() for n in (h, kv, kv)
    )
    go = torch.randn(b, h, t, d, generator=gen).to(dtype)

    def ours() -> None:
        out = bf16_causal_attention(q, k, v) if bf16 else compiled.attention(q, k, v)
        assert out is not None, compiled.native_failure()
        out.backward(go)

    def torch_flash() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(go)

    best = []
    for fn in (ours, torch_flash):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best.append(min(times) * 1e3)
    return best[0], best[1]


if __name__ == "__main__":
    main()
