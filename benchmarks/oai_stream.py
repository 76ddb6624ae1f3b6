"""How soon a streamed OpenAI-compatible answer starts, on one `tinker-sr serve`.

One chat request (a tiny random Qwen3 directory with its BPE tokenizer, `make_tiny_hf_model_dir`
with ``--layers`` layers: every id has text; ``n`` samples of up to ``--max-tokens``, ending
early at an end-of-turn token; a seed per round) goes to ``/oai/api/v1/chat/completions``
twice per round, in alternating order: streamed, timing its first text piece and its last,
and unstreamed (the baseline: until session 49 a streamed answer's first piece came after
the whole sample, in one chunk, so the whole answer's time is when it began). Reports per
round the first piece's time over the whole answer's and the streamed answer's end over the
whole answer's (what streaming costs: the worker reports each step, the server decodes and
sends the texts, and the client parses the events, here on the same cores), their medians,
the pieces per answer, and checks the streamed pieces join to the unstreamed answer's text
(and with ``--top-logprobs``, its log-probs: until session 50 such a stream came whole).

    python benchmarks/oai_stream.py                       # 5 rounds, 8 x 256 tokens
    python benchmarks/oai_stream.py --rounds 3 --n 1 --max-tokens 128
    python benchmarks/oai_stream.py --top-logprobs 5      # log-probs and 5 alternatives
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from tinker_sr.engine.cpu import describe_machine  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.testing.server import running_server  # noqa: E402


def streamed(client: Any, kw: dict[str, Any]) -> tuple[float, float, dict[int, list[str]], dict[int, list[Any]]]:  # fmt: skip
    """(first piece's time, last chunk's time, each choice's pieces, each choice's log-prob
    entries) of one streamed answer."""
    start, first = time.perf_counter(), None
    pieces: dict[int, list[str]] = {}
    scores: dict[int, list[Any]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.delta.content:
                first = first or time.perf_counter() - start
                pieces.setdefault(c.index, []).append(c.delta.content)
            if c.logprobs is not None and c.logprobs.content:
                scores.setdefault(c.index, []).extend(c.logprobs.content)
    return first or float("nan"), time.perf_counter() - start, pieces, scores


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8, help="the tiny model's layers")
    ap.add_argument("--top-logprobs", type=int, default=-1, help="ask for log-probs, with so "
                    "many alternatives (0-20; default: no log-probs)")  # fmt: skip
    a = ap.parse_args()
    import openai

    print(describe_machine(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="oai-stream-"))
    model = str(make_tiny_hf_model_dir(root / "model", n_layers=a.layers))
    with running_server(root / "store", extra_args=["--model-dir", model]) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/oai/api/v1", api_key="tml-bench")
        ask = [{"role": "user", "content": "Tell me a long story about the sea."}]
        kw: dict[str, Any] = dict(model=model, messages=ask, n=a.n, max_tokens=a.max_tokens)
        if a.top_logprobs >= 0:
            kw.update(logprobs=True, top_logprobs=a.top_logprobs)
        client.chat.completions.create(**{**kw, "max_tokens": 4})  # warm-up: load, tokenizer
        ratios, ends, counts = [], [], []
        for r in range(a.rounds):
            kw["seed"] = 100 + r  # a prompt cache entry is shared; the samples are new
            order = ("stream", "whole") if r % 2 == 0 else ("whole", "stream")
            for way in order:
                if way == "stream":
                    first, last, pieces, scores = streamed(client, kw)
                else:
                    start = time.perf_counter()
                    whole = client.chat.completions.create(**kw)
                    t_whole = time.perf_counter() - start
            texts = {c.index: c.message.content or "" for c in whole.choices}
            if {i: "".join(p) for i, p in pieces.items()} != {i: t for i, t in texts.items() if t}:
                print(f"round {r}: the streamed pieces differ from the unstreamed answer")
                return 1
            if a.top_logprobs >= 0 and scores != {
                c.index: c.logprobs.content for c in whole.choices if c.logprobs.content
            }:
                print(f"round {r}: the streamed log-probs differ from the unstreamed answer's")
                return 1
            ratios.append(first / t_whole)
            ends.append(last / t_whole)
            counts.append(statistics.median(len(p) for p in pieces.values()))
            print(f"round {r}: first piece {first:.3f} s, stream done {last:.2f} s, whole answer "
                  f"{t_whole:.2f} s: first / whole {ratios[-1]:.3f}, {counts[-1]:.0f} pieces "
                  "a choice", flush=True)  # fmt: skip
    print(f"median first piece / whole answer: {statistics.median(ratios):.3f} (per round "
          f"{', '.join(f'{x:.3f}' for x in ratios)}; {a.n} x {a.max_tokens} tokens"
          + (f", log-probs with {a.top_logprobs} alternatives" if a.top_logprobs >= 0 else "")
          + ")")  # fmt: skip
    print(f"median stream's end / whole answer: {statistics.median(ends):.2f} (per round "
          f"{', '.join(f'{x:.2f}' for x in ends)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
