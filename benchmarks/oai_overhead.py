"""What the OpenAI-compatible API costs beside the Tinker API, on one `tinker-sr serve`.

The same work (R concurrent requests, each one prompt of a tiny Qwen3-shaped Hugging Face
model directory, ``n`` samples of ``max_tokens`` tokens, seeds 0..R-1, log-probs on) goes
through the official SDK's ``SamplingClient.sample`` (the baseline: asample + futures +
protobuf) and through ``openai.AsyncOpenAI`` against ``/oai/api/v1/completions`` (JSON, text
decoding, per-token log-prob entries), in alternating rounds in this run against one server.
Reports each round's ratio (openai / sdk; below 1 is faster) and the median, and checks that
both returned the same number of tokens (the same seeds give the same samples).

    python benchmarks/oai_overhead.py                  # 5 rounds of 64 requests
    python benchmarks/oai_overhead.py --rounds 3 --requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: `python benchmarks/oai_overhead.py`

from tinker_sr.engine.cpu import describe_machine  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.testing.server import running_server  # noqa: E402


def sdk_round(sampler: object, tinker: object, prompts: list[list[int]], a: argparse.Namespace) -> tuple[float, int]:  # fmt: skip
    start = time.perf_counter()
    futures = [
        sampler.sample(  # type: ignore[attr-defined]
            tinker.ModelInput.from_ints(p),  # type: ignore[attr-defined]
            a.n,
            tinker.SamplingParams(max_tokens=a.max_tokens, seed=i),  # type: ignore[attr-defined]
        )
        for i, p in enumerate(prompts)
    ]
    tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
    return time.perf_counter() - start, tokens


async def oai_round(base_url: str, model: str, prompts: list[list[int]], a: argparse.Namespace) -> tuple[float, int]:  # fmt: skip
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="tml-bench")  # one per event loop

    async def one(i: int, p: list[int]) -> int:
        r = await client.completions.create(  # type: ignore[attr-defined]
            model=model, prompt=p, n=a.n, max_tokens=a.max_tokens, seed=i, logprobs=0
        )
        return int(r.usage.completion_tokens)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    await client.close()
    return elapsed, sum(counts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    import tinker

    print(describe_machine(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="oai-bench-"))
    model = str(make_tiny_hf_model_dir(root / "tiny-qwen3"))
    with running_server(root / "store", extra_args=["--model-dir", model]) as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-bench")
        sampler = service.create_sampling_client(base_model=model).result()
        tok = sampler.get_tokenizer()
        prompts = [tok.encode(f"Request {i}: tell me about the number {i * 7}") for i in range(a.requests)]  # fmt: skip
        oai_url = srv.base_url + "/oai/api/v1"
        sdk_round(sampler, tinker, prompts[:4], a)  # warm-up: model, tokenizer, caches
        asyncio.run(oai_round(oai_url, model, prompts[:4], a))
        ratios = []
        for r in range(a.rounds):
            # fresh prompts per round, so neither side finds the other's prompt cache entries
            batch = [p + [r + 5] for p in prompts]
            t_sdk, n_sdk = sdk_round(sampler, tinker, batch, a)
            t_oai, n_oai = asyncio.run(oai_round(oai_url, model, batch, a))
            if n_sdk != n_oai:
                print(f"round {r}: token counts differ: sdk {n_sdk}, openai {n_oai}")
                return 1
            ratios.append(t_oai / t_sdk)
            print(f"round {r}: sdk {t_sdk:.2f} s, openai {t_oai:.2f} s, {n_sdk} tokens each, "
                  f"openai / sdk = {ratios[-1]:.2f}", flush=True)  # fmt: skip
        service.holder.close()
    print(f"median openai / sdk: {statistics.median(ratios):.2f} ({a.requests} requests x n "
          f"{a.n} x {a.max_tokens} tokens per round)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
