"""What a real-size bfloat16 checkpoint pays per RL step outside the matmuls of training and
decode, each against its former code in the same process.

The shapes are Qwen3-0.6B's (hidden 1024, 28 layers, q 2048, kv 1024, MLP 3072, vocabulary
151,936 with a tied embedding; random bfloat16 weights built in memory, LoRA rank 8 with
non-zero B, as after a step):

1. **A sampler's merged copy** (`save_weights_and_get_sampling_client`: W + s B A for every
   adapted weight, lm_head included). Now `fused.merged_weight` (one C pass: float32
   accumulation, rounded once to bfloat16); before, the torch expression
   ``W + ((B @ A) * s).to(bf16)`` (a float32 product, its scaling, a conversion and a bfloat16
   add). Timed per shape, totalled over the 28 layers.
2. **A prefill's unembedding of its last position**: ``gemm.linear`` on the [1, 1, 1024]
   hidden state (folded to 2-D) against ``F.linear`` on the same 3-D input.

Rounds alternate (new, old) and report medians; the outputs are compared (the merge: within
bfloat16's rounding, equal but for near-ties; the unembedding: equal).

    python benchmarks/real_size.py
    python benchmarks/real_size.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from tinker_sr.engine import gemm  # noqa: E402
from tinker_sr.engine.cpu import default_torch_threads, describe_machine  # noqa: E402
from tinker_sr.engine.fused import merged_weight  # noqa: E402

HIDDEN, LAYERS, VOCAB, RANK, SCALING = 1024, 28, 151_936, 8, 32.0 / 8
# (name, out, in, how many per model)
SHAPES = [
    ("q_proj", 2048, HIDDEN, LAYERS),
    ("k_proj", 1024, HIDDEN, LAYERS),
    ("v_proj", 1024, HIDDEN, LAYERS),
    ("o_proj", HIDDEN, 2048, LAYERS),
    ("gate_proj", 3072, HIDDEN, LAYERS),
    ("up_proj", 3072, HIDDEN, LAYERS),
    ("down_proj", HIDDEN, 3072, LAYERS),
    ("lm_head (tied)", VOCAB, HIDDEN, 1),
]


def _old_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return w + ((b @ a) * SCALING).to(w.dtype)


def _timed(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _pair(
    new: Callable[[], torch.Tensor], old: Callable[[], torch.Tensor], rounds: int
) -> tuple[float, float]:
    new(), old()  # warm: first-touch pages, kernel loading
    t_new, t_old = [], []
    for _ in range(rounds):
        t_new.append(_timed(new))
        t_old.append(_timed(old))
    return statistics.median(t_new), statistics.median(t_old)


def merge(rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"\n1. merged copy of a LoRA sampler (rank {RANK}), bfloat16, median of {rounds} rounds")
    print(f"{'weight':>16} {'shape':>14} {'now ms':>9} {'before ms':>10} {'ratio':>7} {'same':>7}")
    total_new = total_old = 0.0
    for name, n, k, count in SHAPES:
        w = torch.randn(n, k, generator=gen).bfloat16()
        a = torch.randn(RANK, k, generator=gen) * 0.02
        b = torch.randn(n, RANK, generator=gen) * 0.02
        t_new, t_old = _pair(
            lambda w=w, a=a, b=b: merged_weight([w], [a], [b], SCALING),
            lambda w=w, a=a, b=b: _old_merge(w, a, b),
            rounds,
        )
        got, want = (
            merged_weight([w], [a], [b], SCALING),
            torch.addmm(w.float(), b, a, alpha=SCALING),
        )
        torch.testing.assert_close(got.float(), want, rtol=1.01 * 2**-8, atol=1e-5)
        same = (got == want.bfloat16()).float().mean().item()
        total_new, total_old = total_new + count * t_new, total_old + count * t_old
        print(
            f"{name:>16} {f'{n}x{k}':>14} {t_new * 1e3:9.2f} {t_old * 1e3:10.2f} "
            f"{t_old / t_new:6.2f}x {same:7.4f}"
        )
    print(
        f"{'whole model':>16} {'':>14} {total_new * 1e3:9.0f} {total_old * 1e3:10.0f} "
        f"{total_old / total_new:6.2f}x   (per sampler; 'same': share equal to float32 rounded once)"
    )


def unembed(rounds: int) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16()
    h = torch.randn(1, 12, HIDDEN, generator=gen).bfloat16()[:, -1:]  # a prefill's last position
    with torch.inference_mode():
        t_new, t_old = _pair(lambda: gemm.linear(h, w), lambda: F.linear(h, w), rounds)
        equal = torch.equal(gemm.linear(h, w), F.linear(h, w))
    print(
        f"\n2. a prefill's last position by the {VOCAB}-row unembedding, bfloat16 [1, 1, {HIDDEN}]"
    )
    print(
        f"   gemm.linear (2-D) {t_new * 1e3:.1f} ms vs F.linear (3-D) {t_old * 1e3:.1f} ms: "
        f"{t_old / t_new:.1f}x, equal: {equal}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(default_torch_threads())
    print(describe_machine())
    merge(args.rounds)
    unembed(args.rounds)


if __name__ == "__main__":
    main()
