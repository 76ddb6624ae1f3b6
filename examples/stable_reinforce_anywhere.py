"""StableReinforce on any Tinker-compatible service, lowered by the client when needed.

    # a service without stable_reinforce (SkyRL's or Miles' Tinker server on your GPUs, or a
    # `tinker-sr serve --without-stable-reinforce --ignore-stability-info` for a dry run):
    python examples/stable_reinforce_anywhere.py --base-url http://gpu-box:8000 --model Qwen/Qwen3-4B

    # a service that has it (hosted Tinker): compare its implementation with the open one
    python examples/stable_reinforce_anywhere.py --base-url $TINKER_BASE_URL --model ... --check

Training mode runs the RL loop of ``tinker-sr demo`` (``tinker_sr/demo.py``, counting task;
any base model with a byte-compatible tokenizer learns it slowly, the built-in tiny ones
quickly) and prints per step the reward, which path ran (native / lowered 2-D / lowered 1-D)
and the tail mass the client-side draws left out (0 when exact: sample with top_k <= the
``--draw-topk``). ``--check`` runs the forward-only comparisons of docs/stable_reinforce.md
("Checking a hosted implementation against the open one"). Not part of CI: it needs a service.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

import numpy as np

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.clients import sr_lowering
from tinker_sr.clients.sr_lowering import LoweringOptions
from tinker_sr.demo import RLConfig, rl_loop
from tinker_sr.provenance import build_datum

PROMPT = "count: 3"


def train(args: argparse.Namespace) -> None:
    options = LoweringOptions(mode=args.lowering, draw_topk=args.draw_topk)
    with tinker.ServiceClient(
        base_url=args.base_url, api_key=args.api_key, stable_reinforce_lowering=options
    ) as service:
        config = RLConfig(
            base_model=args.model, steps=args.steps, seed=args.seed, lora_rank=args.rank
        )

        def on_step(record: dict[str, Any]) -> None:
            tail = record["loss_metrics"].get("draw_tail_mass:max")
            print(
                f"step {record['step']:3d}  reward {record['reward']:.3f}  "
                f"path {service.stable_reinforce_path}  "
                f"tail mass {'-' if tail is None else f'{tail:.2e}'}  "
                f"KL(q||p) {record['kl_sampler_learner']:+.1e}",
                flush=True,
            )

        asyncio.run(rl_loop(service, config, on_step))


# ---- --check: the service's native stable_reinforce against the open formula ---------------


def _forward(
    tc: tinker.TrainingClient, state: Any, mode: str, data: list[types.Datum], kl: float
) -> types.ForwardBackwardOutput:
    state.options = LoweringOptions(mode=mode)  # type: ignore[arg-type]
    return tc.forward(data, "stable_reinforce", {"kl_coeff": kl}).result()


def _expected_loss(
    tc: tinker.TrainingClient,
    prompt: list[int],
    seqs: list[types.SampledSequence],
    advs: list[float],
    out: types.ForwardBackwardOutput,
    kl: float,
) -> tuple[float, float]:
    """E[loss:sum] over exact draws and its standard error, from the learner's log-probs of
    each sampled position's head (q's support when top_k <= k)."""
    head_data, heads = [], []
    for seq in seqs:
        top = seq.topk_logprobs_np
        assert top is not None, "the service returned no topk_sample_logprobs"
        n = len(prompt) + len(seq.tokens) - 1
        ids = np.zeros((n, top.token_ids.shape[1]), dtype=np.int64)
        ids[len(prompt) - 1 :] = np.asarray(top.token_ids)
        heads.append(np.asarray(top.logprobs, dtype=np.float64))
        head_data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(ids),
                    "weights": types.TensorData.from_numpy(np.zeros(ids.shape, np.float32)),
                },
            )
        )
    scored = tc.forward(head_data, "cross_entropy").result()
    mean, var = 0.0, 0.0
    for seq, adv, q_lp, s, o in zip(
        seqs, advs, heads, scored.loss_fn_outputs, out.loss_fn_outputs, strict=True
    ):
        lp_head = np.asarray(s["logprobs"].to_numpy(), dtype=np.float64)[len(prompt) - 1 :]
        lx = np.asarray(o["logprobs"].to_numpy(), dtype=np.float64)[len(prompt) - 1 :]
        q = np.where(q_lp > -1e4, np.exp(q_lp), 0.0)
        q /= q.sum(axis=1, keepdims=True)
        e_ly = (q * lp_head).sum(axis=1)
        var_ly = (q * (lp_head - e_ly[:, None]) ** 2).sum(axis=1)
        lq = np.asarray(seq.logprobs, dtype=np.float64)
        mean += float((-adv * (lx - e_ly) + kl * (lq - lx)).sum())
        var += float((adv**2 * var_ly / sr_lowering.DRAWS_K).sum())
    return mean, math.sqrt(var)


def check(args: argparse.Namespace) -> int:
    with tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key) as service:
        state = sr_lowering.session_of(service.holder)
        state.options = LoweringOptions(mode="always", draw_topk=args.draw_topk)
        tc = service.create_lora_training_client(
            args.model, rank=args.rank, seed=args.seed
        ).result()
        prompt = tc.get_tokenizer().encode(PROMPT, add_special_tokens=False)
        sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = types.SamplingParams(
            max_tokens=16, seed=args.seed, temperature=1.0, top_k=args.draw_topk, stop=[]
        )
        seqs = list(
            sc.sample(
                types.ModelInput.from_ints(prompt),
                args.samples,
                params,
                topk_sample_logprobs=args.draw_topk,
            )
            .result()
            .sequences
        )
        rng = np.random.default_rng(args.seed)
        advs = [float(a) for a in rng.choice([-1.0, 1.0], size=len(seqs))]
        zero = [build_datum(prompt, s, 0.0) for s in seqs]
        data = [build_datum(prompt, s, a) for s, a in zip(seqs, advs, strict=True)]
        ok = True
        for kl in (0.01, 0.1):
            native = _forward(tc, state, "never", zero, kl)
            lowered = _forward(tc, state, "always", zero, kl)
            for key in ("loss:sum", "kl_penalty:sum"):
                a, b = native.metrics.get(key, math.nan), lowered.metrics[key]
                same = math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
                ok &= same
                print(
                    f"A = 0, kl_coeff {kl}: {key} native {a:+.6f} lowered {b:+.6f} {'ok' if same else 'DIFFERENT'}"
                )
        gap = max(
            float(np.abs(n["logprobs"].to_numpy() - lo["logprobs"].to_numpy()).max())
            for n, lo in zip(native.loss_fn_outputs, lowered.loss_fn_outputs, strict=True)
        )
        ok &= gap < 1e-4
        print(f"learner logprobs: native vs lowered max |diff| {gap:.2e}")
        for mode in ("never", "always"):
            out = _forward(tc, state, mode, data, 0.01)
            mean, se = _expected_loss(tc, prompt, seqs, advs, out, 0.01)
            z = (out.metrics["loss:sum"] - mean) / se if se > 0 else math.nan
            name = "native " if mode == "never" else "lowered"
            print(
                f"A = ±1, {name}: loss:sum {out.metrics['loss:sum']:+.4f}, expected under exact "
                f"draws {mean:+.4f} ± {se:.4f} (z = {z:+.2f})"
            )
            ok &= abs(z) < 4
        print("consistent with the open implementation" if ok else "DIFFERENCES found (see above)")
        return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the Tinker-compatible service")
    parser.add_argument("--api-key", default=None, help="default $TINKER_API_KEY")
    parser.add_argument("--model", default="tinker-sr/tiny")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lowering", choices=("auto", "always", "never"), default="auto")
    parser.add_argument(
        "--draw-topk",
        type=int,
        default=20,
        help="top-k asked of the sampler for client-side draws (default 20; the training loop "
        "samples without top_k, so raise it to the vocabulary size for exact draws)",
    )
    parser.add_argument("--check", action="store_true", help="compare native and lowered")
    parser.add_argument("--samples", type=int, default=16, help="--check: sequences (default 16)")
    args = parser.parse_args()
    if args.check:
        return check(args)
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
