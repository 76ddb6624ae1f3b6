"""Sampling as tinker-cookbook's RL rollouts ask for it: one request per group member.

The cookbook's ``rl.train`` samples a group of G envs that share one problem with G concurrent
``sample(num_samples=1)`` calls on the same prompt, for every group of a batch. The engine's
prompt cache (`tinker_sr.engine.prompt_cache`) prefills each prompt once and copies the result
into the group's other requests; a prefill also unembeds only the last prompt position. This
script measures both, in this one process, against baselines run beside them:

* groups: B groups x G requests x 1 sample, prompts of P tokens (one per group), N new tokens,
  all issued before any is awaited, through the public API (a LoRA sampler of engine_vs_hf.py's
  random ~42M-parameter Qwen3). With the cache vs with it off (``$TINKER_SR_PROMPT_CACHE_MB=0``
  for a second ServiceClient); rounds alternate the order. Also: one request with G samples,
  the same work asked the other way (the cookbook's alternative), with the cache on.
* prefill: the model's last-position logits of a P-token prompt through ``last_logits`` vs
  ``forward(...)[:, -1]`` (every position unembedded, as before).

Outputs are checked equal with and without the cache (tokens and logprobs, bit for bit).

    python benchmarks/prompt_cache.py                  # B=4, G=8, P=300, N=64, 3 rounds
    python benchmarks/prompt_cache.py --prompt 1000 --rounds 2
    python benchmarks/prompt_cache.py --quick          # smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_vs_hf import RANK, _seconds, make_model_dir  # noqa: E402


class Side:
    """A LoRA sampler on its own ServiceClient, made with the prompt cache on or off."""

    def __init__(self, model_dir: Path, store: Path, cache: bool) -> None:
        import tinker_sr as tinker
        from tinker_sr.backend.local import LocalBackend

        before = os.environ.get("TINKER_SR_PROMPT_CACHE_MB")
        if not cache:
            os.environ["TINKER_SR_PROMPT_CACHE_MB"] = "0"
        try:  # the engine reads it when it starts
            self.backend = LocalBackend(store)
        finally:
            os.environ.pop("TINKER_SR_PROMPT_CACHE_MB", None)
            if before is not None:
                os.environ["TINKER_SR_PROMPT_CACHE_MB"] = before
        self.service = tinker.ServiceClient(backend=self.backend)
        self.types = tinker.types
        training = self.service.create_lora_training_client(
            base_model=str(model_dir), rank=RANK, seed=0, train_unembed=False
        ).result()
        self.sampler = training.save_weights_and_get_sampling_client().result()

    def groups(self, prompts: list[list[int]], group: int, new_tokens: int) -> list[Any]:
        """Every group member's request issued before any is awaited; the responses."""
        params = [
            self.types.SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, stop=[])
            for i in range(group)
        ]
        futures = [
            self.sampler.sample(self.types.ModelInput.from_ints(p), 1, sp)
            for p in prompts
            for sp in params
        ]
        return [f.result() for f in futures]

    def one_request_per_group(self, prompts: list[list[int]], group: int, new_tokens: int) -> None:
        sp = self.types.SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, stop=[])
        futures = [
            self.sampler.sample(self.types.ModelInput.from_ints(p), group, sp) for p in prompts
        ]
        [f.result() for f in futures]


def prefill_ratio(model_dir: Path, prompt: list[int], reps: int) -> dict[str, float]:
    """Seconds of the old prefill (all positions unembedded) / the new one, best of reps."""
    import torch

    from tinker_sr.engine.hf import load_model_dir

    model = load_model_dir(model_dir).eval()
    tokens = torch.tensor([prompt])
    with torch.inference_mode():
        old = min(_seconds(lambda: model(tokens)[:, -1]) for _ in range(reps))
        new = min(_seconds(lambda: model.last_logits(tokens)) for _ in range(reps))
        same = torch.allclose(model(tokens)[:, -1], model.last_logits(tokens), atol=1e-4)
    return {"old_s": old, "new_s": new, "ratio": old / new, "close": float(same)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4, help="B: groups in the batch")
    parser.add_argument("--group-size", type=int, default=8, help="G: requests per group")
    parser.add_argument("--prompt", type=int, default=300, help="P: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="N")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="B=2, G=4, P=64, N=8, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.group_size, args.prompt, args.new_tokens, args.rounds = 2, 4, 64, 8, 1

    import torch

    from tinker_sr.engine.cpu import describe_machine

    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1000, 30000, (args.prompt,), generator=gen).tolist()
        for _ in range(args.groups)
    ]
    B, G, P, N = args.groups, args.group_size, args.prompt, args.new_tokens
    print(describe_machine())
    print(f"groups: B={B} x G={G} requests x 1 sample, P={P} prompt tokens, N={N} new tokens")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model")
        on = Side(model_dir, Path(tmp) / "on", cache=True)
        off = Side(model_dir, Path(tmp) / "off", cache=False)
        # Warm-up, and the outputs compared bit for bit.
        a, b = on.groups(prompts, G, N), off.groups(prompts, G, N)
        for ra, rb in zip(a, b, strict=True):
            assert ra.sequences[0].tokens == rb.sequences[0].tokens
            assert ra.sequences[0].logprobs == rb.sequences[0].logprobs
        hits = [sum(r.prompt_cache_hit_tokens for r in x) for x in (a, b)]
        assert hits[1] == 0, f"the cache was not off: {hits[1]} hit tokens"
        print(
            f"outputs equal with and without the cache; prompt_cache_hit_tokens {hits[0]} "
            f"of {B * G * P} (cache off: {hits[1]})"
        )
        ratios = []
        for r in range(args.rounds):
            order = [(on, "on"), (off, "off")] if r % 2 == 0 else [(off, "off"), (on, "on")]
            t = {name: _seconds(lambda s=side: s.groups(prompts, G, N)) for side, name in order}
            single = _seconds(lambda: on.one_request_per_group(prompts, G, N))
            ratios.append(t["off"] / t["on"])
            print(
                f"round {r}: cache on {t['on']:.2f} s, off {t['off']:.2f} s -> {ratios[-1]:.2f}x; "
                f"one request of {G} samples per group {single:.2f} s "
                f"(G requests with the cache take {t['on'] / single:.2f}x its time)"
            )
        pre = prefill_ratio(model_dir, prompts[0], reps=5)
    print(
        f"groups, cache on vs off: {statistics.median(ratios):.2f}x tokens/s (median of "
        f"{len(ratios)}; per round {', '.join(f'{x:.2f}' for x in ratios)})"
    )
    print(
        f"prefill of {P} tokens, last position unembedded vs all: {pre['ratio']:.2f}x "
        f"({pre['old_s'] * 1e3:.1f} ms -> {pre['new_s'] * 1e3:.1f} ms; logits agree: {bool(pre['close'])})"
    )


if __name__ == "__main__":
    main()
