"""A user's RL loop as they bring it: a Hugging Face model directory with its own BPE
tokenizer, many steps, a new sampler every step, and (``--busy``) another process busy on
every core the whole time.

Each step: ``save_weights_and_get_sampling_client(record_stability_info=True)``, 4 concurrent
sample requests x 4 samples (a string stop, temperature 1), one provenance datum per sample
(`tinker_sr.provenance.build_datum`; reward: an arbitrary deterministic score of the
sampled tokens, advantage = reward minus the group mean),
``stable_reinforce`` + Adam. Prints RSS at checkpoints, the time, and a digest of every step's
loss: two runs with the same seed must print the same digest (deterministic on a CPU, even
with concurrent batched sampling and a busy machine).

    python benchmarks/user_trial.py                       # 300 steps, tiny qwen3 BPE dir
    python benchmarks/user_trial.py --steps 800 --busy    # long, beside busy processes
    python benchmarks/user_trial.py --model-dir DIR       # your own HF directory
    python benchmarks/user_trial.py --family qwen3_5      # a tiny Qwen3.5 (hybrid) instead
    python benchmarks/user_trial.py --real-size --steps 4 # Qwen3-0.6B's shapes, random bf16

``--real-size`` builds (in a temp dir, ~1 min) a random model of Qwen3-0.6B's shapes (596M
parameters, vocabulary 151,936, tied embedding) saved in bfloat16 as the Hub's checkpoints
are, with the tiny directory's BPE tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from memory import MIB, malloc_heap, peak_rss_bytes, rss_bytes  # noqa: E402 - benchmarks/memory.py, beside this script

from tinker_sr.hf_files import read_json  # noqa: E402
from tinker_sr.testing.hf_model_dir import Family  # noqa: E402

PROMPTS = ["User: count to five\n\nAssistant:", "User: name a colour\n\nAssistant:"]


def _busy() -> None:
    while True:
        pass


def trial(
    model_dir: str, steps: int, every: int = 0, lr: float = 1e-3, max_tokens: int = 12
) -> None:
    import tinker_sr as tinker
    from tinker_sr.provenance import build_datum

    types = tinker.types
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=model_dir, rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompts = [types.ModelInput.from_ints(tokenizer.encode(p)) for p in PROMPTS]
    digest = hashlib.sha256()
    report = {1, steps} | {steps * k // 8 for k in range(1, 8)}
    report |= set(range(every, steps, every)) if every > 0 else set()
    start = time.perf_counter()
    phases = dict.fromkeys(("new sampler", "sampling", "training"), 0.0)
    for step in range(1, steps + 1):
        mark = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
        phases["new sampler"] += time.perf_counter() - mark
        mark = time.perf_counter()
        params = types.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, stop=["\n\nUser:"], seed=step
        )
        futures = [
            (prompts[i % 2], sampler.sample(prompts[i % 2], num_samples=4, sampling_params=params))
            for i in range(4)
        ]
        data = []
        for prompt, future in futures:
            sequences = future.result().sequences
            rewards = [float(sum(s.tokens) % 7) for s in sequences]
            mean = sum(rewards) / len(rewards)
            data += [
                build_datum(prompt, s, r - mean) for s, r in zip(sequences, rewards, strict=True)
            ]
        phases["sampling"] += time.perf_counter() - mark
        mark = time.perf_counter()
        out = training.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.01}).result()
        training.optim_step(types.AdamParams(learning_rate=lr)).result()
        phases["training"] += time.perf_counter() - mark
        digest.update(struct.pack("<d", out.metrics["loss:sum"]))
        if step in report:
            heap = malloc_heap()
            held = (
                ""
                if heap is None
                else (f" (malloc heap: {heap[0] / MIB:.1f} MiB in use of {heap[1] / MIB:.1f} held)")
            )
            print(
                f"step {step}: RSS {rss_bytes() / MIB:.1f} MiB{held}, "
                f"{time.perf_counter() - start:.0f} s, loss {out.metrics['loss:sum']:+.6f}",
                flush=True,
            )
    print(
        f"{steps} steps in {time.perf_counter() - start:.0f} s; peak RSS {peak_rss_bytes() / MIB:.0f} MiB; "
        f"loss digest {digest.hexdigest()[:16]}"
    )
    print("time by phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))


def real_size_dir(path: Path) -> Path:
    """A random bfloat16 model of Qwen3-0.6B's config beside the tiny directory's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

    tiny = make_tiny_hf_model_dir(path / "tiny", "qwen3")
    ids = {k: v for k, v in read_json(tiny / "config.json").items() if k.endswith("token_id")}
    config = Qwen3Config(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40_960, rope_theta=1_000_000, rms_norm_eps=1e-6, **ids,
    )  # fmt: skip
    out = path / "qwen3-0.6b-shapes"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model-dir", help="a local HF directory (default: a tiny qwen3 + BPE)")
    parser.add_argument(
        "--family",
        default="qwen3",
        choices=[f for f in get_args(Family) if f not in ("qwen2", "llama", "mistral")],
        help="the tiny directory's architecture when no --model-dir is given",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=12,
        help="sampled tokens per sequence (longer: lengths, so product shapes, vary more)",
    )
    parser.add_argument("--real-size", action="store_true", help="Qwen3-0.6B's shapes, bf16")
    parser.add_argument("--busy", action="store_true", help="one busy process per usable CPU")
    parser.add_argument(
        "--report-every",
        type=int,
        default=0,
        help="also report RSS every N steps (default: 8 reports)",
    )
    args = parser.parse_args()
    from tinker_sr.engine.cpu import available_cpus, describe_machine

    print(describe_machine())
    with tempfile.TemporaryDirectory(prefix="tinker-sr-trial-") as tmp:
        os.environ.setdefault("TINKER_SR_STORE", str(Path(tmp) / "store"))
        model_dir = args.model_dir
        if args.real_size:
            model_dir = str(real_size_dir(Path(tmp)))
        elif model_dir is None:
            from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir

            model_dir = str(make_tiny_hf_model_dir(Path(tmp) / "model", args.family))
        busy = []
        if args.busy:
            busy = [
                multiprocessing.Process(target=_busy, daemon=True) for _ in range(available_cpus())
            ]
            for p in busy:
                p.start()
        print(f"model {model_dir}; {args.steps} steps; busy processes: {len(busy)}")
        try:
            trial(model_dir, args.steps, args.report_every, args.lr, args.max_tokens)
        finally:
            for p in busy:
                p.terminate()


if __name__ == "__main__":
    main()
