"""Qwen3.5's linear attention: subnormal floats, per-matrix solves, the decode step.

Three costs of the gated DeltaNet on a CPU:

* Subnormal floats. The state decays by ``exp(g)`` per token; in the chunked (WY) form that
  training and prefill run, a chunk's decays and their products reach ``exp(-87)`` and below,
  float32's subnormal range, wherever a head decays by more than ~1.4 per token on average (a
  random Qwen3.5's heads do: transformers draws ``A`` from U(0, 16); fast heads of real
  checkpoints do too). x86 cores compute with subnormal operands or results through slow
  microcode: the step's small batched GEMMs ran ~16x below their speed. The engine zeroes
  decays under ``exp(hybrid.DECAY_FLOOR)`` (~9e-14) and the rows of the solve past it.
* Per-matrix solves. torch's triangular solve calls the BLAS once per 64 x 64 matrix, each
  call a parallel region; with the engine's passive OpenMP waits each wakes the other
  threads. The engine solves the whole batch in one C region (`engine.delta_native`).
* The decode step. torch's elementwise form of one position makes five passes over every
  row's state, each a parallel region; the engine's C kernel makes one region.

This script times, in this one process, one LoRA training client of engine_vs_hf.py's random
~42M-parameter Qwen3.5 (an HF directory with its BPE tokenizer; six DeltaNet layers, two
gated-attention layers), ``--work train``: one ``forward_backward`` of the same datums;
``--work sample``: 8 samples of 128 new tokens from a 64-token prompt; ``--work rule``: the
C rule's forward alone on the model's DeltaNet shapes (8 rows x 256 positions), as prefill and
the training forward run it; ``--work rule-backward``: one forward of it and its backward 10
times:

* now: the engine as it is;
* baseline: the same with the changes of ``--baseline`` undone (default all: the floor off,
  ``DECAY_FLOOR = -inf``; torch's solve; torch's decode step; ``rule``: the chunked form in
  place of the C rule, session 44; ``conv``: torch's conv1d and silu over transposed copies
  in place of the C short convolution, session 45; ``norm``: torch's ops for the gated
  RMSNorm, session 45; ``heads``: torch's ops for q/k's norms and their repeat per value head,
  session 45; ``wide``: the C rule's forward and decode step built as before session 46, each
  state's rows whole at GCC's default 256-bit vectors, in place of column blocks of 64 at 512
  bits, ``TSR_RULE_NARROW``; ``vectors``: the C rule's backward built as before session 47,
  GCC's 256-bit loops with a row's sums each in one register and the recomputed states copied
  then stepped, in place of explicit vectors of the CPU's width (64 bytes with AVX-512, 32 with
  AVX2) with rows' sums reduced a vector's lanes at a time and one pass per recomputed state,
  ``TSR_RULE_PLAIN_BACKWARD``; ``half``: the C convolution and gated norm refusing bfloat16
  operands and autocast, as before session 48, torch's ops in their place; ``stream``: a bf16
  checkpoint's residual adds and RMSNorms as torch's eager bf16 ops, in place of
  `bf16_rows.bf16_stream_rms_norm`'s C passes, session 48; ``stack``: decode's q, k, v and z
  projections of the DeltaNet layers as four products, in place of one by their weights
  stacked, session 48);

alternating the order per round, and prints now / baseline per round, their median and the
largest difference between the two ways' log-probs (training: per datum; sampling: the
sampled tokens', where both ways sampled the same tokens). ``--dtype bfloat16`` writes the
model's weights in bfloat16 (a bf16 checkpoint, which the engine trains and samples in
bfloat16); ``--dtype autocast`` trains float32 weights under bfloat16 autocast
(``TINKER_SR_TRAIN_DTYPE=bf16``, where the CPU has fast bf16).

    python benchmarks/linear_attention.py                # train, 8 datums of 256 tokens
    python benchmarks/linear_attention.py --work sample
    python benchmarks/linear_attention.py --baseline solve --lengths 2048 --rounds 5
    python benchmarks/linear_attention.py --baseline rule     # the C rule vs the chunked form
    python benchmarks/linear_attention.py --baseline conv     # the C convolution vs torch's
    python benchmarks/linear_attention.py --baseline wide --head-dim 128   # Qwen3.5's width
    python benchmarks/linear_attention.py --baseline vectors --work rule-backward --head-dim 128
    python benchmarks/linear_attention.py --baseline half --dtype bfloat16 --head-dim 128
    python benchmarks/linear_attention.py --baseline stream --dtype bfloat16 --head-dim 128
    python benchmarks/linear_attention.py --baseline stack --work sample --head-dim 128
    python benchmarks/linear_attention.py --quick        # smoke test of both works
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_vs_hf import RANK, _seconds, make_model_dir  # noqa: E402
from mixed_lengths import make_data  # noqa: E402

UNDO = (
    "floor", "solve", "step", "rule", "conv", "norm", "heads", "wide", "vectors", "half", "stream",
    "stack",
)  # fmt: skip
# the C rule's build macros that undo a change (native.load builds each variant apart)
BUILDS = {"wide": "TSR_RULE_NARROW", "vectors": "TSR_RULE_PLAIN_BACKWARD"}


@contextlib.contextmanager
def undone(which: set[str]) -> Iterator[None]:
    """The engine with ``which`` (of `UNDO`) of this script's changes undone."""
    from tinker_sr.engine import batching, bf16_rows, delta_native, hybrid

    stream, delta_rows = bf16_rows.bf16_stream_rms_norm, batching.delta_rows
    if "stream" in which:
        bf16_rows.bf16_stream_rms_norm = lambda *_: None  # type: ignore[assignment]
    if "stack" in which:
        batching.delta_rows = _separate_delta_rows
    saved = hybrid.DECAY_FLOOR, delta_native.native_solve_ready, hybrid.gated_delta_step_
    rule, conv, norm = hybrid.delta_rule, hybrid.short_conv_silu, hybrid.gated_rms_norm
    heads, library = hybrid.deltanet_heads, delta_native._library
    defines = tuple(define for name, define in BUILDS.items() if name in which)
    if defines:
        built = delta_native._library(defines)
        delta_native._library = lambda *_: built  # type: ignore[assignment]
    if "half" in which:
        hybrid.short_conv_silu, hybrid.gated_rms_norm = _float32_only(conv), _float32_only(norm)
    if "heads" in which:
        hybrid.deltanet_heads = lambda *_: None  # type: ignore[assignment]
    if "norm" in which:
        hybrid.gated_rms_norm = lambda *_: None  # type: ignore[assignment]
    if "conv" in which:
        hybrid.short_conv_silu = lambda *_: None  # type: ignore[assignment]
    if "rule" in which:
        hybrid.delta_rule = lambda *_: None  # type: ignore[assignment]
    if "floor" in which:
        hybrid.DECAY_FLOOR = float("-inf")  # read per call by `hybrid.decay_exp`
    if "solve" in which:
        delta_native.native_solve_ready = lambda *_: False  # type: ignore[assignment]
    if "step" in which:
        hybrid.gated_delta_step_ = lambda *_: None  # type: ignore[assignment]
    try:
        yield
    finally:
        floor, ready, step = saved
        hybrid.DECAY_FLOOR, hybrid.gated_delta_step_ = floor, step
        hybrid.delta_rule, hybrid.short_conv_silu, hybrid.gated_rms_norm = rule, conv, norm
        hybrid.deltanet_heads, delta_native._library = heads, library
        delta_native.native_solve_ready = ready
        bf16_rows.bf16_stream_rms_norm, batching.delta_rows = stream, delta_rows


def _separate_delta_rows(net: Any, h: Any) -> Any:
    """`batching.delta_rows` as before session 48: q, k, v, z, b and a one product each."""
    import torch

    from tinker_sr.engine.batching import linear_rows
    from tinker_sr.engine.hybrid import QKV

    qkv = torch.cat([linear_rows(getattr(net, p), h) for p in QKV], -1)
    z, b, a = (linear_rows(getattr(net, f"in_proj_{p}"), h) for p in "zba")
    return qkv, z, b, a


def _float32_only(fn: Any) -> Any:
    """``fn`` (a DeltaNet C pass) refusing what it refused before session 48: an operand not
    float32 (a bfloat16 checkpoint's), or autocast (the convolution; the gated norm then saw
    autocast's bfloat16 gate). None: the caller runs torch's ops."""
    import torch

    def refusing(*args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(t.dtype != torch.float32 for t in tensors) or (
            fn.__name__ == "short_conv_silu" and torch.is_autocast_enabled("cpu")
        ):
            return None
        return fn(*args)

    return refusing


def _rule_alone(lengths: list[int], head_dim: int, backward: bool) -> tuple[Any, Any]:
    """The C rule alone on the model's DeltaNet shapes: len(lengths) rows of max(lengths)
    positions, 2 x 256 / head_dim value heads of head_dim x head_dim states, a starting state.
    Its forward 20 times (as prefill and the training forward run it), or with ``backward``
    one forward and its backward 10 times; (run, max |output or gradient difference|)."""
    import torch

    from tinker_sr.engine import delta_native

    gen = torch.Generator().manual_seed(0)
    shape = (len(lengths), max(lengths), 512 // head_dim)
    q, k = (torch.nn.functional.normalize(torch.randn(*shape, head_dim, generator=gen), dim=-1)
            for _ in "qk")  # fmt: skip
    v = torch.randn(*shape, head_dim, generator=gen)
    g, beta = -torch.rand(*shape, generator=gen) * 3, torch.rand(*shape, generator=gen)
    state = torch.randn(shape[0], shape[2], head_dim, head_dim, generator=gen) * 0.1

    def run() -> Any:  # 20 calls: one takes a few milliseconds
        for _ in range(20):
            out = delta_native.delta_rule(q, k, v, g, beta, state, -30.0, 64)
        return out

    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta, state)]
    weights = torch.randn(*shape, head_dim, generator=gen)

    def run_backward() -> Any:
        out, final = delta_native.delta_rule(*leaves[:5], leaves[5], -30.0, 64) or ()
        loss = (out * weights).sum() + final.square().sum()
        for _ in range(10):
            grads = torch.autograd.grad(loss, leaves, retain_graph=True)
        return grads

    def differ(a: Any, b: Any) -> float:
        return float(max((x - y).abs().max() for x, y in zip(a, b, strict=True)))

    return (run_backward if backward else run), differ


def _work(training: Any, work: str, lengths: list[int]) -> tuple[Any, Any]:
    """(run once -> its outputs, max |log-prob difference| between two runs' outputs)."""
    import tinker_sr as tinker

    types = tinker.types
    if work == "train":
        data = make_data(lengths)

        def train() -> Any:
            return training.forward_backward(data, "cross_entropy").result().loss_fn_outputs

        def train_diff(a: Any, b: Any) -> float:
            return max(
                float(abs(x["logprobs"].to_torch() - y["logprobs"].to_torch()).max())
                for x, y in zip(a, b, strict=True)
            )

        return train, train_diff
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(list(range(1000, 1064)))
    params = types.SamplingParams(max_tokens=lengths[0], seed=1, temperature=1.0)

    def sample() -> Any:
        return sampler.sample(prompt, 8, params).result().sequences

    def sample_diff(a: Any, b: Any) -> float:
        same = [(x, y) for x, y in zip(a, b, strict=True) if x.tokens == y.tokens]
        return max(
            (max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) for x, y in same),
            default=float("nan"),
        )

    return sample, sample_diff


def _dtype_note(dtype: str) -> str:
    """What ``--dtype`` runs as (autocast: set here, before the training client is built)."""
    if dtype != "autocast":
        return f"{dtype} weights"
    import os

    from tinker_sr.engine.registry import TRAIN_DTYPE_ENV, train_autocast_dtype

    os.environ[TRAIN_DTYPE_ENV] = "bf16"
    if train_autocast_dtype() is None:
        return "float32 weights, no autocast: this CPU has no fast bf16 (TINKER_SR_TRAIN_DTYPE)"
    return "float32 weights under bfloat16 autocast"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work", choices=["train", "sample", "rule", "rule-backward"], default="train"
    )
    parser.add_argument(
        "--lengths",
        help="train: comma-separated datum lengths (default 8 x 256); sample: the new tokens (128)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--baseline", default="all", help=f"comma-separated of {', '.join(UNDO)}, or all"
    )
    parser.add_argument("--quick", action="store_true", help="short lengths, 1 round, both works")
    parser.add_argument(
        "--head-dim",
        type=int,
        choices=[64, 128],
        default=64,
        help="the DeltaNet heads' width (128: Qwen3.5's own; 2 key / 4 value heads)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "autocast"],
        default="float32",
        help="bfloat16: the weights saved in bfloat16 (a bf16 checkpoint); autocast: float32 "
        "weights trained under bfloat16 autocast (TINKER_SR_TRAIN_DTYPE=bf16)",
    )
    args = parser.parse_args()
    which = set(UNDO) if args.baseline == "all" else set(args.baseline.split(","))
    if which - set(UNDO):
        parser.error(f"--baseline: {sorted(which - set(UNDO))} are not of {UNDO}")
    works = ["train", "sample"] if args.quick else [args.work]
    if args.quick:
        args.rounds = 1

    import tinker_sr as tinker
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    print(
        f"model: qwen3_5, DeltaNet heads of {args.head_dim}, {_dtype_note(args.dtype)}; "
        f"baseline: {', '.join(sorted(which))} undone"
    )
    with tempfile.TemporaryDirectory() as tmp:
        saved = "bfloat16" if args.dtype == "bfloat16" else "float32"
        model_dir = make_model_dir(Path(tmp) / "model", "qwen3_5", args.head_dim, saved)
        service = tinker.ServiceClient(backend=LocalBackend(Path(tmp) / "store"))
        training = service.create_lora_training_client(
            base_model=str(model_dir), rank=RANK, seed=0, train_unembed=False
        ).result()
        for work in works:
            default = "128,128" if args.quick else "256," * 7 + "256"
            if work == "sample":
                default = "16" if args.quick else "128"
            lengths = [int(x) for x in (args.lengths or default).split(",")]
            what = {
                "train": f"forward_backward of {lengths} tokens",
                "sample": f"8 samples of {lengths[0]} tokens",
                "rule": f"20 forwards of the C rule, {len(lengths)} x {max(lengths)} positions",
                "rule-backward": f"one forward of the C rule and 10 backwards, {len(lengths)} x "
                f"{max(lengths)} positions",
            }[work]
            print(f"{work}: {what}")
            run, differ = (
                _rule_alone(lengths, args.head_dim, work == "rule-backward")
                if work.startswith("rule")
                else _work(training, work, lengths)
            )

            def baseline(run: Any = run) -> Any:
                with undone(which):
                    return run()

            # Warm-up (kernel caches, allocator) and the two ways' outputs compared.
            compared = {"rule": "the rule's outputs", "rule-backward": "its gradients"}.get(
                work, "log-probs"
            )
            print(f"{compared}, now vs baseline: max |difference| {differ(run(), baseline()):.2e}")
            ratios = []
            for r in range(args.rounds):
                ways = [("now", run), ("baseline", baseline)]
                t = {name: _seconds(fn) for name, fn in (ways if r % 2 == 0 else ways[::-1])}
                ratios.append(t["now"] / t["baseline"])
                print(
                    f"round {r}: now {t['now']:.2f} s, baseline {t['baseline']:.2f} s "
                    f"-> {ratios[-1]:.2f}x"
                )
            print(
                f"{work} now / baseline: {statistics.median(ratios):.2f}x time (median of "
                f"{len(ratios)}; per round {', '.join(f'{x:.2f}' for x in ratios)})"
            )


if __name__ == "__main__":
    main()
