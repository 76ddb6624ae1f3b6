"""Multi-turn rollouts: prompts that extend the prompts before them.

An agent, tool or game rollout (tinker-cookbook's multi-turn envs) samples a reply, appends it
and the environment's next message to the conversation, and samples again: each turn's prompt
is the last one plus ~N + O tokens. The engine prefills prompts in fixed 256-token blocks and
keeps them (`tinker_sr.engine.prompt_cache`), so a turn computes only what its prompt adds
after the last whole block the turn before computed. This script measures, in one process:

* rollouts: C conversations x T turns through the public API (a LoRA sampler of
  engine_vs_hf.py's random ~42M-parameter Qwen3): a first prompt of P tokens shared by the
  group (as a group's problem), each turn one ``sample(num_samples=1, max_tokens=N)`` per
  conversation, all issued before any is awaited, then O observation tokens appended. With the
  prompt cache on vs off (``$TINKER_SR_PROMPT_CACHE_MB=0`` for a second ServiceClient), rounds
  alternating the order. Outputs are checked equal bit for bit; prompt tokens computed are
  counted from ``prompt_cache_hit_tokens``.
* chunking: the price of prefilling in blocks where nothing is cached, a prompt of L tokens
  prefilled in blocks (the engine's path) vs in one pass (the path before blocks), alternating.

    python benchmarks/multi_turn.py                   # C=8, T=12, P=400, N=16, O=60, 3 rounds
    python benchmarks/multi_turn.py --arch qwen3_5    # Qwen3.5's hybrid layers (same sizes)
    python benchmarks/multi_turn.py --quick           # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_vs_hf import _seconds, make_model_dir  # noqa: E402
from prompt_cache import Side  # noqa: E402


def rollouts(side: Side, first: list[int], obs: list[list[int]], c: int, n: int) -> list[Any]:
    """C conversations of len(obs) + 1 turns; every turn's responses, in order."""
    convs = [list(first) for _ in range(c)]
    out = []
    for t in range(len(obs) + 1):
        params = [
            side.types.SamplingParams(max_tokens=n, temperature=1.0, seed=1000 * t + i, stop=[])
            for i in range(c)
        ]
        futures = [
            side.sampler.sample(side.types.ModelInput.from_ints(conv), 1, sp)
            for conv, sp in zip(convs, params, strict=True)
        ]
        responses = [f.result() for f in futures]
        out.append(responses)
        if t < len(obs):
            for conv, r in zip(convs, responses, strict=True):
                conv += r.sequences[0].tokens + obs[t]
    return out


def chunking_ratio(model_dir: Path, prompt: list[int], rounds: int) -> list[float]:
    """Per round: seconds of a block prefill of `prompt` / a one-pass prefill of it."""
    import torch

    from tinker_sr.engine.hf import load_model_dir
    from tinker_sr.engine.sampler import DecodeGroup

    model = load_model_dir(model_dir).eval()

    def blocks() -> None:
        DecodeGroup(model, prompt, num_samples=1, max_tokens=1, seed=0).prefill(None)

    def one_pass() -> None:
        with torch.inference_mode():
            model.last_logits(torch.tensor([prompt]), cache=model.new_cache(1, len(prompt) + 1))

    blocks(), one_pass()  # warm-up
    ratios = []
    for r in range(rounds):
        pair = (blocks, one_pass) if r % 2 == 0 else (one_pass, blocks)
        t = {fn.__name__: _seconds(fn) for fn in pair}
        ratios.append(t["blocks"] / t["one_pass"])
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8, help="C")
    parser.add_argument("--turns", type=int, default=12, help="T")
    parser.add_argument("--prompt", type=int, default=400, help="P: first prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=16, help="N: reply tokens per turn")
    parser.add_argument("--obs", type=int, default=60, help="O: tokens appended per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--arch", choices=["qwen3", "qwen3_5"], default="qwen3", help="qwen3_5: hybrid layers"
    )
    parser.add_argument("--quick", action="store_true", help="C=2, T=3, P=300, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.prompt, args.rounds = 2, 3, 300, 1

    import torch

    from tinker_sr.engine.cpu import describe_machine

    C, T, P, N, Ob = args.conversations, args.turns, args.prompt, args.new_tokens, args.obs
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(1000, 30000, (P,), generator=gen).tolist()
    obs = [torch.randint(1000, 30000, (Ob,), generator=gen).tolist() for _ in range(T - 1)]
    print(describe_machine())
    print(f"model: engine_vs_hf.py's {args.arch}")
    print(f"rollouts: C={C} conversations x T={T} turns, P={P}, N={N} reply + O={Ob} per turn")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", args.arch)
        on = Side(model_dir, Path(tmp) / "on", cache=True)
        off = Side(model_dir, Path(tmp) / "off", cache=False)
        a, b = rollouts(on, first, obs, C, N), rollouts(off, first, obs, C, N)  # + warm-up
        for ta, tb in zip(a, b, strict=True):
            for ra, rb in zip(ta, tb, strict=True):
                assert ra.sequences[0].tokens == rb.sequences[0].tokens
                assert ra.sequences[0].logprobs == rb.sequences[0].logprobs
        # Counted on a fresh sampler's first rollout (the warm-up above filled the cache).
        fresh = Side(model_dir, Path(tmp) / "fresh", cache=True)
        counted = rollouts(fresh, first, obs, C, N)
        total = sum(len(first) + t * (N + Ob) for t in range(T)) * C  # upper bound (N: max)
        hit = sum(r.prompt_cache_hit_tokens for turn in counted for r in turn)
        print(
            f"outputs equal with and without the cache; prompt tokens found in the cache: "
            f"{hit} of at most {total} (a fresh sampler)"
        )
        ratios = []
        for r in range(args.rounds):
            order = [(on, "on"), (off, "off")] if r % 2 == 0 else [(off, "off"), (on, "on")]
            t = {name: _seconds(lambda s=side: rollouts(s, first, obs, C, N)) for side, name in order}  # fmt: skip
            ratios.append(t["off"] / t["on"])
            print(
                f"round {r}: cache on {t['on']:.2f} s, off {t['off']:.2f} s -> {ratios[-1]:.2f}x",
                flush=True,
            )
        print(
            f"rollouts, cache on vs off: {statistics.median(ratios):.2f}x (median of "
            f"{len(ratios)}; per round {', '.join(f'{x:.2f}' for x in ratios)})",
            flush=True,
        )
        for L in (700, 2000) if not args.quick else (700,):
            rs = chunking_ratio(model_dir, (first * (L // P + 1))[:L], max(3, args.rounds))
            print(
                f"prefill of {L} tokens in blocks vs one pass (nothing cached): "
                f"{statistics.median(rs):.2f}x the time "
                f"(per round {', '.join(f'{x:.2f}' for x in rs)})"
            )


if __name__ == "__main__":
    main()
