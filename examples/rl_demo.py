"""RL on your laptop with the Tinker API: the loop behind ``tinker-sr demo``, as a script.

    python examples/rl_demo.py                       # embedded engine, no key, no GPU
    python examples/rl_demo.py --base-url http://127.0.0.1:8000   # a `tinker-sr serve` server

Each step does what a Tinker RL recipe does, through the public API only:

1. ``training_client.save_weights_and_get_sampling_client(record_stability_info=True)``;
2. ``sampling_client.sample(...)`` a group of completions per prompt;
3. score them with a verifiable reward (counting upward: "count: 3" -> "45678901");
4. ``build_datum(prompt, sequence, advantage)``: the canonical datum with provenance, which
   ``stable_reinforce`` requires;
5. ``forward_backward(data, "stable_reinforce", {"kl_coeff": 0.01})`` and ``optim_step``,
   submitted back to back, then awaited.

The loop itself is ``rl_loop`` in ``tinker_sr/demo.py`` (one copy, shared with the CLI); read
it there. This script shows how to drive it with your own ServiceClient and your own logging.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import tinker_sr as tinker
from tinker_sr.demo import LOSSES, RLConfig, rl_loop


def print_step(record: dict[str, Any]) -> None:
    samples = "  ".join(f"{p!r}->{c!r}" for p, c in record["example"].items())
    print(
        f"step {record['step']:3d}  reward {record['reward']:.3f}  "
        f"KL(sampler||learner) {record['kl_sampler_learner']:+.1e}  "
        f"entropy {record['entropy']:.2f}  {samples}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=RLConfig.steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss", choices=LOSSES, default="stable_reinforce")
    parser.add_argument("--base-url", default=None, help="a Tinker-compatible server")
    args = parser.parse_args()

    config = RLConfig(steps=args.steps, seed=args.seed, loss=args.loss)
    # Without a base URL the clients run on the embedded engine: CPU, no key, no server.
    # (A tinker_sr server accepts any key starting with "tml-".)
    api_key = "tml-example" if args.base_url else None
    with tinker.ServiceClient(base_url=args.base_url, api_key=api_key) as service_client:
        records = asyncio.run(rl_loop(service_client, config, on_step=print_step))
    first, last = records[0]["reward"], records[-1]["reward"]
    print(f"reward {first:.3f} at step 0 -> {last:.3f} at step {len(records) - 1}")


if __name__ == "__main__":
    main()
