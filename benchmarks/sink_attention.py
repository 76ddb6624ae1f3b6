"""gpt-oss's attention (a sink logit per head, a sliding window) as the engine computes it,
through torch's fused attention with the sink as one more key (`gpt_oss.sink_attention`),
against the eager form transformers runs for gpt-oss (scores, mask, concatenated sinks,
softmax, the probabilities kept for backward): forward + backward time per round in one
process, alternating, and each form's peak memory in a fresh subprocess.

    python benchmarks/sink_attention.py                     # B 2, 8 heads (2 KV), D 64, T 1024
    python benchmarks/sink_attention.py --seq 2048 --window 128
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout


def eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int
) -> torch.Tensor:
    """transformers' eager gpt-oss attention (positions from 0, causal, windowed)."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(2, 3) / math.sqrt(D)
    pos = torch.arange(T)
    hidden = pos[None, :] > pos[:, None]
    if window:
        hidden |= pos[None, :] <= pos[:, None] - window
    scores = torch.cat(
        [scores.masked_fill(hidden, -math.inf), sinks.view(1, H, 1, 1).expand(B, H, T, 1)], -1
    )
    probs = torch.softmax(scores - scores.amax(-1, keepdim=True), -1)[..., :-1]
    return probs @ v


def _high_water_mib() -> float:
    """This process's peak resident memory (VmHWM: its own since exec, unlike ru_maxrss,
    which a child starts with its parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def inputs(args: argparse.Namespace) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(args.batch, h, args.seq, 64) for h in (args.heads, args.kv, args.kv)]
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def step(form: str, args: argparse.Namespace, tensors: list[torch.Tensor]) -> float:
    from tinker_sr.engine.gpt_oss import sink_attention

    q, k, v = tensors
    sinks = torch.linspace(-1, 2, args.heads)
    start = time.perf_counter()
    y = (
        eager(q, k, v, sinks, args.window)
        if form == "eager"
        else sink_attention(q, k, v, sinks, args.window, 0)
    )
    y.square().sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--peak-of", choices=["eager", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_of:  # a subprocess: one step, then the peak RSS above the inputs'
        tensors = inputs(args)
        before = _high_water_mib()
        step(args.peak_of, args, tensors)
        print(_high_water_mib() - before)
        return

    from tinker_sr.engine.cpu import describe_machine
    from tinker_sr.engine.gpt_oss import sink_attention

    print(describe_machine())
    print(
        f"B {args.batch}, {args.heads} heads ({args.kv} KV), D 64, T {args.seq}, window {args.window}"
    )
    tensors = inputs(args)
    sinks = torch.linspace(-1, 2, args.heads)
    with torch.no_grad():
        q, k, v = tensors
        diff = (
            (eager(q, k, v, sinks, args.window) - sink_attention(q, k, v, sinks, args.window, 0))
            .abs()
            .max()
        )
    print(f"max |fused - eager| output: {float(diff):.2e}")
    for form in ("eager", "fused"):
        step(form, args, tensors)  # warm up
    ratios = []
    for r in range(args.rounds):
        t = {
            form: step(form, args, tensors)
            for form in (("eager", "fused") if r % 2 == 0 else ("fused", "eager"))
        }
        ratios.append(t["eager"] / t["fused"])
        print(
            f"round {r}: eager {t['eager'] * 1e3:.1f} ms, fused {t['fused'] * 1e3:.1f} ms, eager / fused {ratios[-1]:.2f}"
        )
    print(f"forward + backward, eager / fused: median {statistics.median(ratios):.2f}")
    peaks = {}
    for form in ("eager", "fused"):
        cmd = [sys.executable, __file__, "--peak-of", form, *sys.argv[1:]]
        peaks[form] = float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(
        f"peak memory above the inputs: eager {peaks['eager']:.0f} MiB, fused {peaks['fused']:.0f} MiB "
        f"({peaks['eager'] / max(peaks['fused'], 1):.1f}x)"
    )


if __name__ == "__main__":
    main()
