"""What the wire costs: one training step through a loopback server vs the engine in-process.

The same batch (64 sequences x 128 tokens, ``tinker-sr/tiny``, LoRA rank 8) goes through
``forward_backward`` + ``optim_step`` with a `tinker_sr.ServiceClient` on a `LocalBackend`
(baseline) and with one on ``http://127.0.0.1`` (a ``python -m tinker_sr.server``
subprocess: protobuf encode/decode, HTTP, futures in SQLite, long-polling). Both are
measured in this run, interleaved, after warm-up; the report is the median step time of
each and their ratio (and the ratio of the fastest steps, which on a busy machine shows the
wire's own cost best). Target: remote / local <= 1.15.

    python benchmarks/remote_overhead.py            # 9 measured steps each
    python benchmarks/remote_overhead.py --reps 3   # quicker
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: `python benchmarks/remote_overhead.py`

import tinker_sr  # noqa: E402
from tinker_sr import types  # noqa: E402
from tinker_sr.backend.local import LocalBackend  # noqa: E402

TARGET = 1.15
MODEL = "tinker-sr/tiny"


def make_batch(n: int, length: int, seed: int = 0) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        tokens = rng.integers(0, 256, size=length + 1)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": tokens[1:].astype(np.int64),
                    "weights": np.ones(length, dtype=np.float32),
                },
            )
        )
    return data


def step_time(training: tinker_sr.TrainingClient, batch: list[types.Datum]) -> float:
    start = time.perf_counter()
    fb = training.forward_backward(batch, "cross_entropy")
    opt = training.optim_step(types.AdamParams(learning_rate=1e-4))
    fb.result()
    opt.result()
    return time.perf_counter() - start


def start_server(store: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tinker_sr.server", "--port", str(port), "--store", str(store)]
    proc = subprocess.Popen(cmd + ["--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9, help="measured steps per backend")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    batch = make_batch(args.batch, args.length)

    with tempfile.TemporaryDirectory(prefix="tinker-sr-bench-") as tmp:
        proc, url = start_server(Path(tmp) / "server")
        local_backend = LocalBackend(Path(tmp) / "local")
        try:
            local = tinker_sr.ServiceClient(backend=local_backend)
            remote = tinker_sr.ServiceClient(base_url=url, api_key="tml-bench")
            clients = {
                name: svc.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
                for name, svc in (("local", local), ("remote", remote))
            }
            for _ in range(args.warmup):
                for training in clients.values():
                    step_time(training, batch)
            times: dict[str, list[float]] = {"local": [], "remote": []}
            for _ in range(args.reps):  # interleaved, so drift hits both alike
                for name, training in clients.items():
                    times[name].append(step_time(training, batch))
            local.close().result()
            remote.close().result()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            local_backend.close()

    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = med["remote"] / med["local"]
    print(f"batch: {args.batch} x {args.length} tokens, {MODEL}, LoRA rank 8, {args.reps} reps")
    print(f"{'backend':<8} {'median s':>9} {'min s':>8} {'max s':>8}")
    for name, ts in times.items():
        print(f"{name:<8} {med[name]:9.4f} {min(ts):8.4f} {max(ts):8.4f}")
    verdict = "OK" if ratio <= TARGET else "ABOVE TARGET"
    print(f"remote / local = {ratio:.3f} (median; target <= {TARGET}) {verdict}")
    # On a busy machine the medians carry other processes' noise; the fastest steps show
    # the wire's own cost.
    print(f"remote / local = {min(times['remote']) / min(times['local']):.3f} (fastest steps)")


if __name__ == "__main__":
    main()
