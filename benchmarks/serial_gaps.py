"""Where a training step's time goes between its parallel kernels: the serial gaps.

Every C kernel (csrc/) and every oneDNN GEMM of the engine runs as a parallel region over the
cores; between two of them one thread runs Python, torch's dispatch and small ops while the
others wait. This script wraps each kernel and GEMM call with a clock, runs LoRA train steps
(the issue-11 benchmark model and batch by default) and reports, per step, the time inside the
calls (per kernel, and per GEMM shape with its rate), the time between them and the
transitions (call site -> call site) with the largest gaps. A gap includes torch's own
parallel ops between two calls (a residual add, a copy) and this script's bookkeeping (a few
microseconds a call), so it is an upper bound on the single-threaded time; the first step
after the model is built is left out.

    python benchmarks/serial_gaps.py                     # qwen3-bench, 16 x 256, 3 steps
    python benchmarks/serial_gaps.py --model tinker-sr/small --batch 8 --seq 128 --top 10
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled import model_and_batch, model_args  # noqa: E402


def _site(skip: int = 2) -> str:
    """The innermost two tinker_sr frames above the wrapped call, as file:line."""
    frame: Any = sys._getframe(skip)
    found: list[str] = []
    while frame is not None and len(found) < 2:
        name = frame.f_code.co_filename
        if "tinker_sr" in name:
            found.append(f"{os.path.basename(name)}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(found)


def instrument(
    events: list[tuple[float, float, str, str]],
    shapes: list[tuple[float, int, int, int, str]] | None = None,
) -> None:
    """Record (start, end, kernel, site) for every C kernel and oneDNN GEMM call, and with
    ``shapes`` (seconds, M, N, K, weight layout) for every GEMM."""
    from tinker_sr.engine import compiled, gemm

    def timed(fn: Any, name: str) -> Any:
        def call(*args: Any) -> Any:
            site = _site()
            start = time.perf_counter()
            out = fn(*args)
            events.append((start, time.perf_counter(), name, site))
            return out

        return call

    class Timed:
        def __init__(self, lib: Any) -> None:
            self._lib = lib

        def __getattr__(self, name: str) -> Any:
            fn = getattr(self._lib, name)
            return timed(fn, name[4:]) if name.startswith("tsr_") else fn

    rows, attention = compiled._rows_library(), compiled._attention_library()
    compiled._rows_library = lambda: Timed(rows)  # type: ignore[assignment]
    compiled._attention_library = lambda: Timed(attention)  # type: ignore[assignment]
    op = gemm._op()
    if op is not None:
        timed_op = timed(op, "gemm")

        def shaped(x: Any, w: Any, *rest: Any) -> Any:
            y = timed_op(x, w, *rest)
            if shapes is not None:  # the call's own clock: the event `timed_op` just recorded
                begin, end = events[-1][:2]
                kind = "packed" if w.is_mkldnn else ("" if w.is_contiguous() else "w^T")
                m, k = x.numel() // x.shape[-1], x.shape[-1]
                shapes.append((end - begin, m, y.shape[-1], k, kind))
            return y

        gemm._op = lambda: shaped  # type: ignore[assignment]


def main() -> None:
    parser = model_args(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    import tinker_sr as tinker
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    if os.environ.get("TINKER_SR_TRAIN_DTYPE", "").strip().lower().startswith("bf16"):
        # Under autocast the products are torch's bf16 ops and the C kernels (float32 only)
        # stand aside: nothing this script times runs, and every second would read as a gap.
        sys.exit(
            "serial_gaps.py times the float32 step's C kernels and oneDNN GEMMs; with "
            "TINKER_SR_TRAIN_DTYPE=bf16 neither runs. Unset it, or profile the bf16 step with "
            "`python benchmarks/engine_vs_hf.py --work train-bf16 --breakdown`."
        )
    with tempfile.TemporaryDirectory(prefix="tinker-sr-gaps-") as tmp:
        model, data = model_and_batch(args.model, args.batch, args.seq, Path(tmp))
        training = (
            tinker.ServiceClient()
            .create_lora_training_client(base_model=model, rank=8, seed=0, train_unembed=False)
            .result()
        )

        def step() -> None:
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result()

        step()  # builds the C kernels, faults in the step's memory
        events: list[tuple[float, float, str, str]] = []
        shapes: list[tuple[float, int, int, int, str]] = []
        instrument(events, shapes)
        step()
        events.clear()
        shapes.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        per_step = (time.perf_counter() - start) / args.steps
    inside = sum(end - begin for begin, end, _, _ in events) / args.steps
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for one, two in zip(events, events[1:], strict=False):  # consecutive pairs
        gaps[(f"{one[2]}@{one[3]}", f"{two[2]}@{two[3]}")].append(two[0] - one[1])
    between = sum(sum(v) for v in gaps.values()) / args.steps
    print(
        f"model {args.model}, LoRA r8, {args.batch} x {args.seq}: step {per_step:.3f} s, "
        f"{len(events) // args.steps} kernel/GEMM calls a step; inside them {inside:.3f} s "
        f"({inside / per_step:.1%}), between them {between * 1e3:.0f} ms "
        f"({between / per_step:.1%}; the step boundary included)"
    )
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for begin, end, name, _ in events:
        kernels[name].append(end - begin)
    print("time inside each kernel, a step:")
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"  {sum(times) / args.steps * 1e3:7.1f} ms {len(times) / args.steps:4.0f} x "
            f"{statistics.median(times) * 1e6:6.0f} us  {name}"
        )
    by_shape: dict[tuple[int, int, int, str], list[float]] = collections.defaultdict(list)
    for seconds, m, n, k, kind in shapes:
        by_shape[(m, n, k, kind)].append(seconds)
    print("GEMMs by shape (M x N x K, weight layout), a step:")
    for (m, n, k, kind), times in sorted(by_shape.items(), key=lambda kv: -sum(kv[1])):
        rate = 2 * m * n * k * len(times) / sum(times) / 1e9
        print(
            f"  {sum(times) / args.steps * 1e3:7.1f} ms {len(times) / args.steps:4.0f} x "
            f"{m} x {n} x {k} {kind:6s} {rate:5.0f} GFLOP/s"
        )
    print("largest gaps between calls, a step:")
    ranked = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    for (a, b), times in ranked:
        print(
            f"  {sum(times) / args.steps * 1e3:6.1f} ms a step, {len(times) / args.steps:4.0f} x "
            f"{statistics.median(times) * 1e6:5.0f} us  {a} -> {b}"
        )


if __name__ == "__main__":
    main()
