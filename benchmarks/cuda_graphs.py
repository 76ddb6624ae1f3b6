"""Decode on a GPU from CUDA graphs against eager decode, in one process (`engine.cuda_graphs`).

The model is engine_vs_hf.py's random Qwen3 (vocab 32,000, hidden 512, 8 layers, ~42M
parameters) as a Hugging Face directory, or ``--model-dir``; tinker_sr samples a LoRA (rank 8,
untrained) through its public API on ``--device`` (default cuda). Two workloads, the shapes of
rl_sampling.py:

* single: one request, 8 samples x 128 new tokens from a 32-token prompt;
* rl: R concurrent requests (default 32) x 8 samples x 128 tokens, prompts of 32-64 tokens,
  every request issued before any result is awaited (the engine decodes them together).

Each round runs each workload with graphs (the default) and with ``TINKER_SR_CUDA_GRAPHS=0``,
in alternating order; the report gives tokens/s of both, the per-round ratios and their
median, how many graphs were captured and replayed, the time spent in decode steps and in
sampling from their logits (on the CPU, as everywhere), the GPU and the CPU. The same seeds run
both ways: the script also reports how many of the samples' tokens agree (rounding can flip
a draw, after which a sample goes its own way).

    python benchmarks/cuda_graphs.py                 # on a machine with a GPU (~1 min)
    python benchmarks/cuda_graphs.py --quick         # 4 requests x 16 tokens, 1 round
    python benchmarks/cuda_graphs.py --device cpu --quick   # the script's own smoke test
"""

from __future__ import annotations

import argparse
import os
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

# isort: off
import tinker_sr as tinker  # noqa: E402  (first: passive OpenMP waits, as the others)

# isort: on
import torch  # noqa: E402
from engine_vs_hf import RANK, make_model_dir  # noqa: E402
from rl_sampling import SAMPLES, prompts  # noqa: E402

from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine import cuda_graphs, scheduler  # noqa: E402
from tinker_sr.engine.cpu import describe_machine  # noqa: E402
from tinker_sr.engine.sampler import DecodeGroup  # noqa: E402

SPLIT = {"decode": 0.0, "sample": 0.0}  # seconds in decode steps and in sampling after them


def _timing(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    def timed_fn(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            SPLIT[what] += time.perf_counter() - start

    return timed_fn


scheduler.decode = _timing(scheduler.decode, "decode")  # as the sampling thread calls them
DecodeGroup.receive = _timing(DecodeGroup.receive, "sample")  # type: ignore[method-assign]


def sample(sc: Any, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Issue every request, then await them all -> every sample's tokens."""
    futures = [
        sc.sample(
            tinker.types.ModelInput.from_ints(p),
            num_samples=SAMPLES,
            sampling_params=tinker.types.SamplingParams(
                max_tokens=new_tokens, temperature=1.0, seed=i, stop=[]
            ),
        )
        for i, p in enumerate(batch)
    ]
    return [s.tokens for f in futures for s in f.result().sequences]


def timed(sc: Any, batch: list[list[int]], new_tokens: int, graphs: bool) -> tuple[float, Any]:
    os.environ[cuda_graphs.GRAPHS_ENV] = "1" if graphs else "0"
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = sample(sc, batch, new_tokens)
    seconds = time.perf_counter() - start
    return sum(len(t) for t in tokens) / seconds, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of tokens before each pair of samples first differs."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same, total = same + n, total + len(x)
    return same / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="a local HF directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 requests x 16 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.rounds = 4, 16, 1
    with tempfile.TemporaryDirectory(prefix="tinker-sr-graphs-") as tmp:
        model_dir = Path(args.model_dir or Path(tmp) / "qwen3-42m")
        if args.model_dir is None:
            make_model_dir(model_dir)
        backend = LocalBackend(Path(tmp) / "store", device=args.device)
        service = tinker.ServiceClient(backend=backend)
        training = service.create_lora_training_client(
            base_model=str(model_dir), rank=RANK, seed=0, train_unembed=False
        ).result()
        sc = training.save_weights_and_get_sampling_client().result()
        work = {"single": prompts(1, 32, 32), "rl": prompts(args.requests, 32, 64)}
        for batch in work.values():  # warm-up: kernels, allocator, captures, prompt cache
            timed(sc, batch, 8, True)
            timed(sc, batch, 8, False)
        rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in work}
        for r in range(args.rounds):
            for name, batch in work.items():
                order = (True, False) if r % 2 == 0 else (False, True)
                got = {g: timed(sc, batch, args.new_tokens, g) for g in order}
                (on, tok_on), (off, tok_off) = got[True], got[False]
                rows[name].append((on, off, agreement(tok_on, tok_off)))
                print(f"round {r + 1} {name}: graphs {on:,.0f} tokens/s, eager {off:,.0f} "
                      f"({on / off:.2f}x)", flush=True)  # fmt: skip
        graphs = list(cuda_graphs._graphs.values())  # before the models go with the backend
        service.close().result()
        backend.close()
    report(rows, graphs, args)


def report(
    rows: dict[str, list[tuple[float, float, float]]],
    graphs: list[cuda_graphs.GraphedDecode],
    args: argparse.Namespace,
) -> None:
    captured, replayed = sum(g.captures for g in graphs), sum(g.replays for g in graphs)
    failed = [g.failed for g in graphs if g.failed]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"\ndevice: {args.device} | GPU: {gpu} | {describe_machine()}")
    print(f"graphs captured {captured}, replayed {replayed}" + f"; FAILED {failed}" * bool(failed))
    print(f"time in decode steps {SPLIT['decode']:.2f} s, in sampling from their logits "
          f"(on the CPU) {SPLIT['sample']:.2f} s, all rounds, both ways")  # fmt: skip
    for name, got in rows.items():
        ratios = [on / off for on, off, _ in got]
        shape = "1 request" if name == "single" else f"{args.requests} requests"
        print(
            f"{name} ({shape} x {SAMPLES} x {args.new_tokens}): graphs / eager "
            f"{statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)}); "
            f"graphs {statistics.median(on for on, _, _ in got):,.0f} tokens/s, eager "
            f"{statistics.median(off for _, off, _ in got):,.0f}; tokens agreeing before the "
            f"first difference {min(a for _, _, a in got):.1%}"
        )


if __name__ == "__main__":
    main()
