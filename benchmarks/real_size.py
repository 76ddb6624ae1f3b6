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

3. **A training step's residual adds and RMSNorms**: the 57 of a forward (two a layer and
   the final norm) and their backward, on RL-sized batches (``--tokens``, default 400: 16
   sequences of 25) with the residual stream in bfloat16, as a bf16 checkpoint trains. Now
   `bf16_rows.bf16_stream_rms_norm` (one C pass a row each way); before, torch's eager bf16
   ops (`fused.rms_norm`'s node after the add).

Rounds alternate (new, old) and report medians; the outputs are compared (the merge: within
bfloat16's rounding, equal but for near-ties; the unembedding: equal; the norms: the share of
gradients equal to the eager ones' bits, and the largest difference against the largest
gradient).

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


def norms(rounds: int, tokens: int) -> None:
    from tinker_sr.engine import bf16_rows, fused

    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(1, tokens, HIDDEN, generator=gen).bfloat16()
    ys = [torch.randn(1, tokens, HIDDEN, generator=gen).bfloat16() for _ in range(2 * LAYERS)]
    gains = [(torch.rand(HIDDEN, generator=gen) + 0.5).bfloat16() for _ in range(2 * LAYERS + 1)]
    grads = [torch.randn(1, tokens, HIDDEN, generator=gen).bfloat16() for _ in range(len(gains))]

    def chain() -> torch.Tensor:
        """The residual stream through 56 add + norms and the final one; backward from each
        normalised row (what the sublayers' products would send back); x0's gradient."""
        h = x0.clone().requires_grad_()
        leaves = [y.clone().requires_grad_() for y in ys]
        outs = []
        for y, w in zip(leaves, gains, strict=False):
            h, out = fused.add_rms_norm(h, y, w, 1e-6)
            outs.append(out)
        outs.append(fused.rms_norm(h, gains[-1], 1e-6))
        torch.autograd.backward(outs, grads)
        assert leaves[0].grad is not None
        return leaves[0].grad

    real = bf16_rows.bf16_stream_rms_norm

    def eager() -> torch.Tensor:
        bf16_rows.bf16_stream_rms_norm = lambda *_: None  # type: ignore[assignment]
        try:
            return chain()
        finally:
            bf16_rows.bf16_stream_rms_norm = real

    t_new, t_old = _pair(chain, eager, rounds)
    got, want = chain().float(), eager().float()
    print(
        f"\n3. a bf16 step's {2 * LAYERS + 1} residual adds + RMSNorms, forward and backward, "
        f"[1, {tokens}, {HIDDEN}]"
    )
    print(
        f"   C passes {t_new * 1e3:.1f} ms vs torch's bf16 ops {t_old * 1e3:.1f} ms: "
        f"{t_new / t_old:.2f}x time; first sublayer's gradient: "
        f"{(got == want).float().mean().item():.6f} equal, largest difference "
        f"{((got - want).abs().max() / want.abs().max()).item():.1e} of the largest value"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=400, help="the norms' rows (3.)")
    args = parser.parse_args()
    torch.set_num_threads(default_torch_threads())
    print(describe_machine())
    merge(args.rounds)
    unembed(args.rounds)
    norms(args.rounds, args.tokens)


if __name__ == "__main__":
    main()
