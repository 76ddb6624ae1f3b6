"""tinker_sr's embedded engine against transformers + peft, same weights, same machine, same run.

The model is a random Qwen3 (vocab 32,000, hidden 512, 8 layers, 8 heads / 4 KV heads,
FFN 1536, tied embeddings: ~42M parameters) written once as a Hugging Face directory (with a
BPE tokenizer) and loaded by both sides. LoRA rank 8 (alpha 32) on q,k,v,o,gate,up,down.

* train: one LoRA step (cross_entropy on every position, AdamW), B x T tokens, fp32;
  tokens/s, achieved FLOP/s counted at 4·N per token (forward 2N + input-gradient 2N: the
  base is frozen) as a share of the fp32 matmul peak measured in the same process (the
  faster of torch's BLAS and oneDNN: on the AMD EPYC we measure on, MKL reaches about half
  of oneDNN), and the process's peak RSS. tinker_sr goes through its public API
  (`ServiceClient`), HF through peft + torch.optim.AdamW.
* sample: 8 samples x 128 new tokens from one 32-token prompt, logprobs on (tinker_sr:
  `SamplingClient.sample`; HF: `generate(do_sample=True, num_return_sequences=8)` with the
  scores turned into logprobs).
* train-prompt: the fp32 step with no loss on the first half of every sequence (a prompt:
  zero weights for tinker_sr, label -100 for HF), the shape of an RL or SFT batch.
* train-bf16 (only where the CPU has fast bf16, AMX / avx512_bf16): the same step with
  bf16 matmuls and fp32 master weights: HF under ``torch.autocast("cpu", bfloat16)``,
  tinker_sr with ``TINKER_SR_TRAIN_DTYPE=bf16``.

Every measurement runs in a fresh process (peak RSS is per process); rounds alternate the
order of the two sides, and the report gives per-round ratios and their median. Each process
runs ``--warmup`` untimed steps (default 3) and reports the fastest of ``--reps`` timed ones:
the steady state of a long run (the first steps fault in memory the allocator then keeps).

``--breakdown`` profiles one more tinker_sr step per train process (after the timed ones, so
the figures above are unaffected) and splits its time into matrix products (oneDNN and BLAS
GEMMs, the bf16 attention's batched products), torch's fused attention and everything else,
with the bound that split puts on the share of the peak: 4·N per token over the time of the
matrix products alone, i.e. the share the step would reach if all other work took no time,
and a floor under the step with those products: attention's own products at the peak, the
activations kept for backward written and read once at the copy bandwidth and one exp per
logit at torch's exp rate, each measured in the same process (see ``_step_floor``).

    pip install -e '.[bench]'                      # transformers + peft
    python benchmarks/engine_vs_hf.py              # B=16 T=256, 3 rounds (slow on 2 cores)
    python benchmarks/engine_vs_hf.py --batch 4 --seq 128 --rounds 2   # quicker
    python benchmarks/engine_vs_hf.py --work train --rounds 2 --breakdown  # where time goes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen3.5's linear attention in transformers (tinker_sr adapts q, k and v separately, as Tinker
# does: three rank-8 adapters where peft has one on the fused in_proj_qkv).
LINEAR_TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj")
RANK, ALPHA = 8, 32


def make_model_dir(
    path: Path, arch: str = "qwen3", linear_head_dim: int = 64, dtype: str = "float32"
) -> Path:
    """The benchmark's directory: tokenizer files of the test helper, bigger weights (saved in
    ``dtype``: "bfloat16" is a bf16 checkpoint). ``arch`` "qwen3_5": the same sizes as Qwen3.5's
    text model, six gated DeltaNet layers (4 key / 8 value heads of 64; ``linear_head_dim`` 128,
    Qwen3.5's own width: 2 / 4 heads of 128, the same projections, twice the rule's state per
    token) and two gated-attention layers."""
    linear_heads = 256 // linear_head_dim
    from transformers import Qwen3_5TextConfig, Qwen3Config

    from tinker_sr.testing.hf_model_dir import save_random_model

    sizes: dict[str, Any] = dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )

    def config_of(**special_ids: Any) -> Any:
        if arch != "qwen3_5":
            return Qwen3Config(**sizes, **special_ids)
        return Qwen3_5TextConfig(
            **sizes,
            **special_ids,
            linear_num_key_heads=linear_heads,
            linear_num_value_heads=2 * linear_heads,
            linear_key_head_dim=linear_head_dim,
            linear_value_head_dim=linear_head_dim,
            architectures=["Qwen3_5ForCausalLM"],
        )

    return save_random_model(path, "qwen3", 32000, config_of, dtype)


# ---- one measurement per process ------------------------------------------------------------


def matmul_peak_flops(n: int = 1024, reps: int = 10) -> dict[str, float]:
    """The fp32 matmul rate of torch's BLAS (``a @ b``: MKL on x86) and of oneDNN (inside the
    same torch build; tinker_sr's engine uses it where available, see engine/gemm.py), as
    FLOP/s; "peak" is the faster of the two: the most this machine's torch reaches with a
    matmul call. Also, reported beside it and not part of the peak, oneDNN's rate with ``b``
    reordered once beforehand into its blocked layout ("onednn_packed"): that skips the
    reorder every plain call does, which only a weight that does not change between calls
    allows (the engine does it for a frozen unembedding, `gemm.packed_weight`)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    rates = {"blas": _rate(lambda: a @ b, n, reps)}
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is not None and torch.backends.mkldnn.is_available():
        bt = b.t()
        rates["onednn"] = _rate(lambda: op(a, bt, None, "none", [], ""), n, reps)
    rates["peak"] = max(rates.values())
    reorder = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)
    if op is not None and reorder is not None and "onednn" in rates:
        packed = reorder(bt.contiguous(), n)
        rates["onednn_packed"] = _rate(lambda: op(a, packed, None, "none", [], ""), n, reps)
    return rates


def _rate(fn: Any, n: int, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _batch(batch: int, seq: int) -> Any:
    import torch

    return torch.randint(0, 32000, (batch, seq + 1), generator=torch.Generator().manual_seed(0))


def engine_train(
    model_dir: str, batch: int, seq: int, reps: int, prompt: int = 0, breakdown: bool = False
) -> dict[str, Any]:
    import tinker_sr as tinker

    types = tinker.types
    tokens = _batch(batch, seq).tolist()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={
                "target_tokens": row[1:],
                "weights": [0.0] * prompt + [1.0] * (seq - prompt),
            },
        )
        for row in tokens
    ]
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(
        base_model=model_dir, rank=RANK, seed=0, train_unembed=False
    ).result()

    def step() -> None:
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()

    result = _time(step, reps)
    if breakdown:
        result["breakdown"] = _profile_step(step)
        result["floor"] = _step_floor(model_dir, batch, seq, result["matmul_flops"]["peak"])
    return result


# Profiler op names counted as matrix products, and marks of the fused attention kernels:
# torch's (SDPA) and tinker_sr's C kernel under TINKER_SR_COMPILE=1 (its autograd nodes).
_MATMUL_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
_ATTENTION_MARKS = ("scaled_dot_product", "_CausalAttention")


def _profile_step(step: Any) -> dict[str, float]:
    """Self CPU seconds of one profiled step: matrix products, fused attention, the rest. The
    engine computes on its own worker thread, which a profiler started here does not see: the
    engine's forward_backward and optim_step are profiled where they run instead."""
    from torch.profiler import ProfilerActivity, profile

    from tinker_sr.engine import training

    split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}

    def profiled(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = fn(*args, **kwargs)
            for ev in prof.key_averages():
                seconds = ev.self_cpu_time_total / 1e6
                if ev.key in _MATMUL_OPS:
                    split["matmul"] += seconds
                elif any(mark in ev.key for mark in _ATTENTION_MARKS):
                    split["attention"] += seconds
                else:
                    split["other"] += seconds
            return out

        return run

    saved = training.forward_backward, training.optim_step
    training.forward_backward, training.optim_step = map(profiled, saved)
    try:
        step()
    finally:
        training.forward_backward, training.optim_step = saved
    return split


def _step_floor(model_dir: str, batch: int, seq: int, peak: float) -> dict[str, float]:
    """What a train step needs besides its 4·N matrix products, each at a rate measured here:
    attention's own products (causal: half of the T x T blocks; forward QK^T and PV, backward
    those again plus dV, dP, dQ, dK: 7 products, not counted in 4·N) at the matmul peak; the
    activations the forward keeps for backward (`model.activation_bytes`) written once and
    read once at this machine's copy bandwidth; and one exp per logit of the loss at torch's
    exp rate. Added to the measured matrix products this is a floor no implementation with
    these products gets under (it leaves out the gradients flowing between layers, the
    norms' and the loss's other passes, and all per-op overhead)."""
    import torch

    from tinker_sr.engine.hf_config import config_from_hf
    from tinker_sr.engine.model import activation_bytes

    config = config_from_hf(json.loads((Path(model_dir) / "config.json").read_text()), "bench")
    tokens = batch * seq
    n = 32 << 20  # 128 MiB per side: far beyond the caches
    src, dst = torch.randn(n), torch.empty(n)
    copy = min(_seconds(lambda: dst.copy_(src)) for _ in range(10))
    bandwidth = 2 * 4 * n / copy  # bytes read + written per second
    z = torch.randn(256, config.vocab_size)
    exp_rate = z.numel() / min(
        _seconds(lambda: torch.exp(z, out=dst[: z.numel()].view_as(z))) for _ in range(5)
    )
    head = config.head_dim * config.n_heads
    attn_flops = 7 * 2 * batch * seq * seq * head / 2 * config.n_layers
    act = activation_bytes(config, tokens)
    return {
        "bandwidth": bandwidth,
        "exp_rate": exp_rate,
        "attention": attn_flops / peak,
        "activations": 2 * act / bandwidth,
        "loss_exp": tokens * config.vocab_size / exp_rate,
    }


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_model(model_dir: str) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [n for n in TARGETS + LINEAR_TARGETS if n in names]
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)
    return get_peft_model(model, cfg)


def hf_train(
    model_dir: str, batch: int, seq: int, reps: int, bf16: bool, prompt: int = 0
) -> dict[str, float]:
    import torch

    model = hf_model(model_dir)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = _batch(batch, seq)
    labels = tokens[:, :-1].clone()
    labels[:, : prompt + 1] = -100  # HF shifts: label i is the target of position i - 1

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=tokens[:, :-1], labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _time(step, reps)


def engine_sample(model_dir: str, reps: int) -> dict[str, float]:
    import tinker_sr as tinker

    types = tinker.types
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(
        base_model=model_dir, rank=RANK, seed=0, train_unembed=False
    ).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(_batch(1, 31)[0].tolist())
    params = types.SamplingParams(max_tokens=128, temperature=1.0, seed=0)

    def run() -> None:
        out = sampler.sample(prompt, num_samples=8, sampling_params=params).result()
        assert all(s.logprobs is not None for s in out.sequences)

    return _time(run, reps)


def hf_sample(model_dir: str, reps: int) -> dict[str, float]:
    import torch

    model = hf_model(model_dir).eval()
    prompt = _batch(1, 31)

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids=prompt,
                do_sample=True,
                num_return_sequences=8,
                max_new_tokens=128,
                min_new_tokens=128,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)

    return _time(run, reps)


# Untimed runs before the timed ones (`--warmup`; set in the child process). The engine's
# first training steps still fault in memory that the allocator then keeps (measured on the
# 16 x 256 step: ~350k, ~100k, ~36k and then a handful of page faults in steps 1-4); a long
# run is in the steady state after them, and both sides get the same warm-up.
WARMUP = 3


def _time(fn: Any, reps: int) -> dict[str, float]:
    for _ in range(WARMUP):
        fn()
    times, cpu = [], []
    for _ in range(reps):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    return {
        "seconds": min(times),
        # Process CPU time: on a shared machine it moves less with other processes' load than
        # wall time does (both sides wait passively: OMP_WAIT_POLICY=PASSIVE is inherited).
        "cpu_seconds": min(cpu),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),
        "matmul_flops": matmul_peak_flops(),
    }


def child(
    side: str,
    work: str,
    model_dir: str,
    batch: int,
    seq: int,
    reps: int,
    breakdown: bool,
    warmup: int,
) -> None:
    import torch

    global WARMUP
    WARMUP = warmup
    torch.manual_seed(0)
    prompt = seq // 2 if work == "train-prompt" else 0  # no loss on the first half
    if work == "sample":
        result = engine_sample(model_dir, reps) if side == "engine" else hf_sample(model_dir, reps)
    elif side == "engine":
        result = engine_train(model_dir, batch, seq, reps, prompt, breakdown)
    else:
        result = hf_train(model_dir, batch, seq, reps, work == "train-bf16", prompt)
    print(json.dumps(result))


# ---- driver ---------------------------------------------------------------------------------


def run_child(side: str, work: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", side, work, str(model_dir)]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--reps", str(args.reps)]
    cmd += ["--warmup", str(args.warmup)]
    cmd += ["--breakdown"] if args.breakdown else []
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop chatter on stderr
    if work == "train-bf16":
        env["TINKER_SR_TRAIN_DTYPE"] = "bf16"
    with tempfile.TemporaryDirectory(prefix="tinker-sr-bench-") as store:
        env["TINKER_SR_STORE"] = store
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions per process")
    parser.add_argument(
        "--warmup",
        type=int,
        default=WARMUP,
        help=f"untimed runs per process before the timed ones (default {WARMUP}: steady state)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--arch", choices=["qwen3", "qwen3_5"], default="qwen3", help="qwen3_5: Qwen3.5's hybrid"
    )
    parser.add_argument("--work", nargs="*", default=["train", "sample", "train-bf16"])
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="profile one more tinker_sr train step per process: matmul / attention / other",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.batch, args.seq, args.reps, args.breakdown, args.warmup)
        return

    from tinker_sr.engine.cpu import describe_machine, has_fast_bf16, why_slow_half

    print(describe_machine())
    works = [w for w in args.work if w != "train-bf16" or has_fast_bf16()]
    if works != args.work:
        print(f"train-bf16 skipped: {why_slow_half('bfloat16')}, so bf16 would be emulated")
    n_params = 41_600_000  # recomputed below from the HF model
    with tempfile.TemporaryDirectory(prefix="tinker-sr-hfdir-") as tmp:
        model_dir = make_model_dir(Path(tmp) / args.arch, args.arch)
        import torch
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(model_dir)
        n_params = sum(p.numel() for p in m.parameters())
        del m, torch
        print(
            f"model: {args.arch}, {n_params / 1e6:.1f}M parameters; train batch "
            f"{args.batch} x {args.seq}"
        )
        results: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {w: [] for w in works}
        for r in range(args.rounds):
            for work in works:
                sides = ["engine", "hf"] if r % 2 == 0 else ["hf", "engine"]
                got = {s: run_child(s, work, model_dir, args) for s in sides}
                results[work].append((got["engine"], got["hf"]))
                print(f"round {r + 1} {work}: " + json.dumps(got))
    _report(results, args, n_params)


def _report(
    results: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]],
    args: argparse.Namespace,
    n_params: int,
) -> None:
    print()
    tokens = {w: args.batch * args.seq for w in ("train", "train-prompt", "train-bf16")}
    for work, rounds in results.items():
        n_tok = tokens.get(work, 8 * 128)
        ratios = [h["seconds"] / e["seconds"] for e, h in rounds]
        cpu_ratios = [h["cpu_seconds"] / e["cpu_seconds"] for e, h in rounds]
        e_tps = statistics.median(n_tok / e["seconds"] for e, _ in rounds)
        h_tps = statistics.median(n_tok / h["seconds"] for _, h in rounds)
        print(
            f"{work}: tinker_sr {e_tps:.0f} tokens/s, HF+peft {h_tps:.0f} tokens/s, speed ratio "
            f"median {statistics.median(ratios):.2f} (rounds: "
            + ", ".join(f"{x:.2f}" for x in ratios)
            + "); CPU-time ratio median "
            + f"{statistics.median(cpu_ratios):.2f} (rounds: "
            + ", ".join(f"{x:.2f}" for x in cpu_ratios)
            + ")"
        )
        for side, idx in (("tinker_sr", 0), ("HF+peft", 1)):
            rss = statistics.median(r[idx]["peak_rss_gib"] for r in rounds)
            line = f"    {side:<9} peak RSS {rss:.2f} GiB"
            if work in ("train", "train-prompt"):  # bf16 products run up to 2x the fp32 peak
                share = statistics.median(
                    4 * n_params * n_tok / r[idx]["seconds"] / r[idx]["matmul_flops"]["peak"]
                    for r in rounds
                )
                rate = {
                    k: statistics.median(r[idx]["matmul_flops"].get(k, 0.0) for r in rounds) / 1e9
                    for k in ("peak", "blas", "onednn", "onednn_packed")
                }
                line += (
                    f", {share:.1%} of the fp32 matmul peak ({rate['peak']:.0f} GFLOP/s here: "
                    f"the faster of torch's BLAS {rate['blas']:.0f} and oneDNN "
                    f"{rate['onednn']:.0f})"
                )
                if rate["onednn_packed"]:  # disclosed, not the peak: see matmul_peak_flops
                    packed_share = statistics.median(
                        4 * n_params * n_tok / r[idx]["seconds"]
                        / max(r[idx]["matmul_flops"].get("onednn_packed", 0.0), 1.0)
                        for r in rounds
                    )  # fmt: skip
                    line += (
                        f"; {packed_share:.1%} of oneDNN's rate with a pre-packed weight "
                        f"({rate['onednn_packed']:.0f})"
                    )
            print(line)
        splits = [e["breakdown"] for e, _ in rounds if "breakdown" in e]
        if splits:
            part = {k: statistics.median(b[k] for b in splits) for k in splits[0]}
            peak = statistics.median(e["matmul_flops"]["peak"] for e, _ in rounds)
            total = part["matmul"] + part["attention"] + part["other"]
            line = (
                f"    tinker_sr profiled step, ops' own time {total:.2f} s: matrix products "
                f"{part['matmul']:.2f} s ({part['matmul'] / total:.0%}), fused attention "
                f"{part['attention']:.2f} s ({part['attention'] / total:.0%}), other "
                f"{part['other']:.2f} s ({part['other'] / total:.0%})"
            )
            if work == "train":  # 4·N per token is the work done only for fp32, every position
                line += (
                    "; with every non-matmul op at zero time the step would reach "
                    f"{4 * n_params * n_tok / part['matmul'] / peak:.1%} of the peak"
                )
            print(line)
            floors = [e["floor"] for e, _ in rounds if "floor" in e]
            if work == "train" and floors:
                f = {k: statistics.median(x[k] for x in floors) for k in floors[0]}
                least = part["matmul"] + f["attention"] + f["activations"] + f["loss_exp"]
                print(
                    f"    floor of the step with these matrix products: {least:.2f} s = "
                    f"{4 * n_params * n_tok / least / peak:.1%} of the peak (products "
                    f"{part['matmul']:.2f} s as profiled; attention's products at the peak "
                    f"{f['attention']:.3f} s; activations written and read once at "
                    f"{f['bandwidth'] / 1e9:.0f} GB/s {f['activations']:.3f} s; one exp per "
                    f"logit at {f['exp_rate'] / 1e9:.1f} G/s {f['loss_exp']:.3f} s). 80 % of "
                    f"the peak is a {4 * n_params * n_tok / (0.8 * peak):.2f} s step."
                )


if __name__ == "__main__":
    main()
