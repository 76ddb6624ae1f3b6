"""Busy-machine robustness: the engine's defaults beside CPU-bound neighbours.

Two measurements, each in alternating rounds in this one run (report: ratios):

1. idle vs contended. A worker process (a fresh interpreter with the package's defaults,
   exactly what a user gets) runs a LoRA train step (``tinker-sr/small``, rank 8, 8 x 128
   tokens, cross_entropy + AdamW) and a sample (8 samples x 64 new tokens, 32-token prompt,
   logprobs) through the embedded `ServiceClient`. Rounds alternate between idle cores and
   one competing CPU-bound process per usable core. Target: contended / idle <= 2.5 (a fair
   share of the cores is 2x).
2. server vs embedded, both contended. The same work through the official ``tinker`` SDK
   against ``tinker-sr serve`` (a separate server process on the same cores) and through the
   embedded engine. Target: server / embedded <= 1.3.

    python benchmarks/contention.py             # 3 rounds
    python benchmarks/contention.py --rounds 5

The machine may be shared with other work: the figures are per-round ratios of runs made
back to back, and their medians; absolute seconds are informational.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

MODEL = "tinker-sr/small"
WORKLOADS = ("train", "sample")
CONTENDED_TARGET = 2.5
SERVER_TARGET = 1.3


# ---- the worker: one process, a client set up once, one workload per stdin line ----------


def _worker(mode: str, url: str | None) -> None:
    import numpy as np

    if mode == "sdk":
        import tinker  # the unmodified official SDK

        service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    else:
        import tinker_sr as tinker

        service = tinker.ServiceClient()
    types = tinker.types
    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    rng = np.random.default_rng(0)
    batch = []
    for _ in range(8):
        tokens = rng.integers(0, 256, size=129).tolist()
        batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 128},
            )
        )
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(rng.integers(0, 256, size=32).tolist())
    params = types.SamplingParams(max_tokens=64, temperature=1.0, seed=1)

    def train() -> None:
        fb = training.forward_backward(batch, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-5))
        fb.result()
        opt.result()

    def sample() -> None:
        out = sampler.sample(prompt, num_samples=8, sampling_params=params).result()
        assert all(s.logprobs is not None for s in out.sequences)

    work = {"train": train, "sample": sample}
    for name in WORKLOADS:  # warm-up
        work[name]()
    print("ready", flush=True)
    for line in sys.stdin:
        name = line.strip()
        start = time.perf_counter()
        work[name]()
        print(json.dumps({name: time.perf_counter() - start}), flush=True)


class Worker:
    def __init__(self, mode: str, url: str | None = None) -> None:
        cmd = [sys.executable, __file__, "--worker", mode] + (["--url", url] if url else [])
        env = {**os.environ, "PYTHONPATH": str(REPO), "TINKER_TELEMETRY": "0"}
        env.pop("TINKER_SR_TORCH_THREADS", None)  # measure the defaults (OMP_NUM_THREADS
        env.pop("OMP_NUM_THREADS", None)  # would lower them)
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line.strip()

    def time(self, name: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return float(json.loads(self._line())[name])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


@contextlib.contextmanager
def competitors(n: int) -> Iterator[None]:
    """n CPU-bound processes (pure-Python loops) for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.5)
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def measure(worker: Worker, reps: int) -> dict[str, float]:
    return {name: min(worker.time(name) for _ in range(reps)) for name in WORKLOADS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2, help="repetitions per round (min taken)")
    parser.add_argument("--worker", choices=["embedded", "sdk"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.url)
        return

    from tests._server import running_server
    from tinker_sr.engine.cpu import available_cpus, describe_machine

    print(describe_machine())
    n = available_cpus()
    print(f"{MODEL}, LoRA r8; train = 8x128 cross_entropy step, sample = 8 x 64 tokens")
    print(f"contended = {n} competing CPU-bound processes (one per usable core)\n")
    ratios: dict[str, list[float]] = {f"{k}/{w}": [] for k in ("busy", "server") for w in WORKLOADS}
    with tempfile.TemporaryDirectory(prefix="tinker-sr-contention-") as tmp:
        os.environ["TINKER_SR_STORE"] = str(Path(tmp) / "embedded")
        embedded = Worker("embedded")
        with running_server(Path(tmp) / "server") as srv:
            sdk = Worker("sdk", srv.base_url)
            for r in range(args.rounds):
                idle = measure(embedded, args.reps)
                with competitors(n):
                    busy = measure(embedded, args.reps)
                    remote = measure(sdk, args.reps)
                for w in WORKLOADS:
                    ratios[f"busy/{w}"].append(busy[w] / idle[w])
                    ratios[f"server/{w}"].append(remote[w] / busy[w])
                print(
                    f"round {r + 1}: "
                    + "  ".join(
                        f"{w}: idle {idle[w]:.3f}s busy {busy[w]:.3f}s server+sdk(busy) "
                        f"{remote[w]:.3f}s"
                        for w in WORKLOADS
                    )
                )
            sdk.close()
        embedded.close()

    print()
    for key, values in ratios.items():
        kind, w = key.split("/")
        target = CONTENDED_TARGET if kind == "busy" else SERVER_TARGET
        label = "contended / idle" if kind == "busy" else "server+SDK / embedded (contended)"
        med = statistics.median(values)
        per_round = ", ".join(f"{v:.2f}" for v in values)
        verdict = "PASS" if med <= target else "FAIL"
        print(f"{w:<6} {label:<34} median {med:.2f}  [{per_round}]  target <= {target}: {verdict}")


if __name__ == "__main__":
    main()
