"""oneDNN's kernel caches on a mixture-of-experts run: at how many entries does a step's
working set of kernels fit?

oneDNN compiles a kernel per product (shapes, strides, layouts) and keeps it in an LRU cache;
`import tinker_sr` caps that cache and ideep's at 128 entries unless the user set a size, and
building a mixture-of-experts model raises them to 512 (`cpu.widen_kernel_caches`). An MoE
layer runs every routed expert on its own rows: four products (forward, and the backward's
with the weights transposed, kernels of their own) per distinct bucketed per-expert row count
(`gemm.bucket_rows`). If a step's kernels do not fit, the LRU evicts each before its next use
and every product recompiles.

Each cache size in ``--caps`` runs in its own process (the size is read once per process),
alternating over ``--rounds``, with ``ONEDNN_VERBOSE=profile_create``: oneDNN itself reports
every kernel creation it had to make (a cache miss) and its milliseconds. Prints, per side,
seconds per step after the first, recompiles and their milliseconds per step after the first,
and RSS after step 2 (the warm-up's second sampler) and at the last step; then the ratios
against the last size. The model: a Qwen3-MoE with Qwen3-30B-A3B's routing (8 of 128 experts)
at a smaller width (``--hidden``, ``--expert-dim``), ``--layers`` layers; each step a LoRA r8
train step on 8 sequences of a newly drawn length, an optimizer step and a 2-sample, 8-token
sample (`shape_buckets.rl_step`).

    python benchmarks/moe_kernel_cache.py                # ~8 min on 2 cores
    python benchmarks/moe_kernel_cache.py --steps 6 --rounds 1 --hidden 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from memory import MIB  # noqa: E402 - benchmarks/memory.py, beside this script
from shape_buckets import BATCH, VOCAB, run_steps  # noqa: E402 - the same RL-shaped steps

CAP_ENVS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def make_moe_dir(path: Path, hidden: int, expert_dim: int, layers: int) -> Path:
    """A Qwen3-MoE directory: the test helper's tokenizer files, 8 of 128 experts per token,
    random weights (seeded)."""
    from transformers import Qwen3MoeConfig

    from tinker_sr.testing.hf_model_dir import save_random_model

    def config_of(**special_ids: Any) -> Any:
        return Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=max(1, hidden // 256),
            head_dim=64,
            max_position_embeddings=4096,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=expert_dim,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=True,
            architectures=["Qwen3MoeForCausalLM"],
            **special_ids,
        )

    return save_random_model(path, "qwen3_moe", VOCAB, config_of)


def recompiles(verbose: str, since_ms: float) -> tuple[int, float]:
    """Kernel creations oneDNN reported (cache misses) after ``since_ms``, and their ms."""
    count, ms = 0, 0.0
    for line in verbose.splitlines():
        fields = line.split(",")
        if len(fields) > 4 and fields[4] == "create:cache_miss" and float(fields[2]) >= since_ms:
            count, ms = count + 1, ms + float(fields[-1])
    return count, ms


def child(args: argparse.Namespace, cap: int, model_dir: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    env |= {name: str(cap) for name in CAP_ENVS}
    env |= {"ONEDNN_VERBOSE": "profile_create", "ONEDNN_VERBOSE_TIMESTAMP": "1"}
    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--min-len", str(args.min_len)]
    cmd += ["--max-len", str(args.max_len), "--child", model_dir]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    count, ms = recompiles(out, got["marks"][1])
    got["misses"], got["miss_ms"] = count / (args.steps - 1), ms / (args.steps - 1)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--caps", default="128,512", help="cache sizes to compare")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = (args.min_len, args.max_len)
    if args.child:
        print(json.dumps(run_steps(args.child, args.steps, lengths)))
        return
    from tinker_sr.engine.cpu import describe_machine

    caps = [int(c) for c in args.caps.split(",")]
    print(describe_machine())
    print(
        f"Qwen3-MoE, 8 of 128 experts, hidden {args.hidden}, expert width {args.expert_dim}, "
        f"{args.layers} layers; {args.steps} steps of a LoRA r8 train step on {BATCH} x "
        f"{lengths[0]}-{lengths[1]} tokens + a 2 x 8-token sample; kernel caches of {caps} "
        "entries",
        flush=True,
    )
    results: dict[int, list[dict[str, Any]]] = {cap: [] for cap in caps}
    with tempfile.TemporaryDirectory(prefix="tinker-sr-moe-cache-") as tmp:
        model_dir = str(
            make_moe_dir(Path(tmp) / "model", args.hidden, args.expert_dim, args.layers)
        )
        for r in range(args.rounds):
            for cap in caps if r % 2 == 0 else caps[::-1]:
                got = child(args, cap, model_dir)
                results[cap].append(got)
                rss = got["rss"]
                print(
                    f"round {r + 1} cap {cap:>4}: {got['seconds_per_step']:.3f} s/step, "
                    f"{got['misses']:.0f} recompiles a step ({got['miss_ms']:.0f} ms) after the "
                    f"first, RSS {rss[1] / MIB:.0f} -> {rss[-1] / MIB:.0f} MiB (step 2, last)",
                    flush=True,
                )
    base = caps[-1]
    for r in range(args.rounds):
        for cap in caps[:-1]:
            ratio = results[cap][r]["seconds_per_step"] / results[base][r]["seconds_per_step"]
            print(f"round {r + 1}: time cap {cap} / cap {base} {ratio:.2f}x")


if __name__ == "__main__":
    main()
