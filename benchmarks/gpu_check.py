"""One-call check of the engine on a CUDA GPU: train + sample on cuda, compared with the CPU.

Run on an NVIDIA H200 on 2026-12-04 (docs/performance.md, "GPU"). On a machine with a CUDA
build of torch and an NVIDIA GPU:

    python benchmarks/gpu_check.py                       # tinker-sr/small, 8 x 256, 3 reps
    python benchmarks/gpu_check.py --model-dir DIR       # a local HF Qwen3/Llama directory
    python -m pytest -q tests/engine/test_device.py      # the cuda test runs there too

For each device it runs, through the public API (`ServiceClient` over `LocalBackend`), a LoRA
step (cross_entropy on every position + AdamW) on the same seeded batch, then samples 8 x 128
tokens from the trained adapter; on cuda also with bf16 autocast (`TINKER_SR_TRAIN_DTYPE`).
It prints step and sample times and the differences to the CPU run, and exits non-zero when
the fp32 loss or log-probs differ from the CPU's by more than the tolerances below.

Then, per device, the RL losses on StableReinforce datums (`provenance.build_datum` from a
sampler with ``record_stability_info=True``): every policy loss (StableReinforce's provenance
validation and draws included) must give a finite loss, and the learner's log-probs of the
sampled tokens must match the sampler's (``--no-losses`` skips this part). Sampled tokens
differ between devices, so each device is checked against itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

# isort: off
# tinker_sr first: it asks for passive OpenMP waits, which only works before torch loads
# (with spinning waits a step here took 18x longer on a busy machine).
import tinker_sr as tinker  # noqa: E402

# isort: on
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine.cpu import describe_machine  # noqa: E402

LOSS_RTOL, LOGPROB_ATOL = 1e-3, 2e-3
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
ON_POLICY_ATOL = 2e-3  # fp32 sampler vs learner log-probs of the same tokens, same weights


def _batch(vocab: int, batch: int, seq: int) -> list[types.Datum]:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, vocab, (batch, seq + 1), generator=gen).tolist()
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * seq},
        )
        for r in rows
    ]


@contextlib.contextmanager
def _training_client(
    device: str, model: str, bf16: bool
) -> Iterator[tuple[LocalBackend, tinker.TrainingClient]]:
    """A seeded LoRA r8 training client of ``model`` on ``device`` (bf16 autocast or fp32),
    on an embedded engine with a store of its own, closed on exit."""
    os.environ["TINKER_SR_TRAIN_DTYPE"] = "bf16" if bf16 else "float32"
    with tempfile.TemporaryDirectory(prefix="tinker-sr-gpu-check-") as store:
        backend = LocalBackend(store, device=device)
        service = tinker.ServiceClient(backend=backend)
        training = service.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        try:
            yield backend, training
        finally:
            service.close().result()
            backend.close()


def run(device: str, model: str, args: argparse.Namespace, bf16: bool = False) -> dict[str, Any]:
    with _training_client(device, model, bf16) as (backend, training):
        vocab = backend.models.base(backend.models.resolve_model(model)).config.vocab_size
        data = _batch(vocab, args.batch, args.seq)
        times, first = [], None
        for _ in range(args.reps + 1):  # the first step warms up (kernels, allocator)
            start = time.perf_counter()
            fb = training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            times.append(time.perf_counter() - start)
            first = first or fb
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=128, temperature=1.0, seed=0)
        prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:32])
        start = time.perf_counter()
        out = sampler.sample(prompt, num_samples=8, sampling_params=params).result()
        sample_s = time.perf_counter() - start
    assert first is not None
    return {
        "loss": first.metrics["loss:sum"],
        "logprobs": np.concatenate([o["logprobs"].to_numpy() for o in first.loss_fn_outputs]),
        "step_s": min(times[1:]),
        "sample_s": sample_s,
        "tokens": [s.tokens for s in out.sequences],
        "sample_logprobs": [s.logprobs for s in out.sequences],
    }


def rl_losses(device: str, model: str, bf16: bool = False) -> bool:
    """Each policy loss on provenance datums sampled on ``device``; True when all pass."""
    from tinker_sr.provenance.build import build_datum

    label = f"{device}{'-bf16' if bf16 else ''}"
    ok = True
    with _training_client(device, model, bf16) as (_, training):
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True)
        sampler = sampler.result()
        data, sampled = [], []
        for i in range(4):
            prompt = types.ModelInput.from_ints([1 + i, *range(10, 40)])
            params = types.SamplingParams(max_tokens=32, temperature=1.0, seed=i)
            out = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
            for j, seq in enumerate(out.sequences):
                data.append(build_datum(prompt, seq, float(j % 2) - 0.5))
                sampled.append(np.asarray(seq.logprobs, dtype=np.float64))
        for loss_fn in RL_LOSSES:
            try:
                fb = training.forward_backward(data, loss_fn).result()
            except Exception as exc:  # noqa: BLE001 - report every loss, then fail
                print(f"{label:>9} {loss_fn:<20} FAILED: {type(exc).__name__}: {exc}")
                ok = False
                continue
            loss = float(fb.metrics["loss:sum"])
            learner = [o["logprobs"].to_numpy() for o in fb.loss_fn_outputs]
            gap = max(
                float(np.abs(lp[-len(s) :] - s).max())
                for lp, s in zip(learner, sampled, strict=True)
            )
            good = bool(np.isfinite(loss)) and (bf16 or gap <= ON_POLICY_ATOL)
            ok = ok and good
            print(
                f"{label:>9} {loss_fn:<20} loss {loss:+.5f}, max |learner - sampler logprob| "
                f"{gap:.2e}{'' if good else '  <-- FAILS'}"
            )
    return ok


def compare(name: str, got: dict[str, Any], ref: dict[str, Any], strict: bool) -> bool:
    rel = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
    diff = float(np.abs(got["logprobs"] - ref["logprobs"]).max())
    same_first = sum(g[0] == r[0] for g, r in zip(got["tokens"], ref["tokens"], strict=True))
    ok = rel <= LOSS_RTOL and diff <= LOGPROB_ATOL
    print(
        f"{name}: loss rel diff {rel:.2e}, max |logprob diff| {diff:.2e}, first sampled token "
        f"equal in {same_first}/{len(ref['tokens'])} rows"
        + ("" if ok or not strict else "  <-- FAILS the fp32 tolerance")
    )
    return ok or not strict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="local HF directory (default: built-in)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-losses", action="store_true", help="skip the RL-loss section")
    parser.add_argument(
        "--dry-run-on-cpu", action="store_true", help="run the script's code with 'cpu' as the GPU"
    )
    args = parser.parse_args()
    print(describe_machine())
    gpu = "cpu" if args.dry_run_on_cpu else "cuda"
    if gpu == "cuda" and not torch.cuda.is_available():
        print(
            f"no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda}): nothing to check"
        )
        return 2
    if gpu == "cuda":
        name = torch.cuda.get_device_name(0)
        print(f"GPU: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    model = args.model_dir or "tinker-sr/small"
    results = {
        "cpu": run("cpu", model, args),
        "cuda": run(gpu, model, args),
        "cuda-bf16": run(gpu, model, args, bf16=True),
    }
    n_tok = args.batch * args.seq
    for name, r in results.items():
        print(
            f"{name:>9}: train step {r['step_s'] * 1e3:.1f} ms ({n_tok / r['step_s']:.0f} tokens/s), "
            f"sample 8 x 128 {r['sample_s'] * 1e3:.0f} ms ({8 * 128 / r['sample_s']:.0f} tokens/s)"
        )
    ok = compare("cuda vs cpu (fp32)", results["cuda"], results["cpu"], strict=True)
    compare("cuda bf16 vs cpu (fp32)", results["cuda-bf16"], results["cpu"], strict=False)
    if not args.no_losses:
        for device, bf16 in (("cpu", False), (gpu, False), (gpu, True)):
            ok = rl_losses(device, model, bf16) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
