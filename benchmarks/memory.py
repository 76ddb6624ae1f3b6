"""Bounded memory over long runs (issue 9, item 2): three checks, each in a fresh process.

1. RL loop: ``tinker-sr/small``, LoRA rank 8, a new sampler every step (as the cookbook does:
   ``save_weights_and_get_sampling_client``), 4 samples x 16 tokens, an importance_sampling
   step on them. Peak RSS at step 200 <= 1.10 x peak RSS at step 20.
2. 16 training clients on one base model, each after one optimizer step. RSS growth over
   the idle process <= 1.10 x (base weights + 16 x (adapters + gradient + 2 Adam moments)).
   "Idle" is after a warm-up step on another model in a closed session (torch's first use
   pages in tens of MiB of kernels and pools that no model owns).
3. A server (``session_timeout_s`` short) after 4 sessions with trainers and samplers were
   abandoned and expired: RSS within 10 % of its idle RSS. "Idle" is measured after one
   warm-up session was run and closed (so torch's kernels and thread pools are already
   paged in); the cold start-up RSS is printed too.

    python benchmarks/memory.py                 # all three
    python benchmarks/memory.py --steps 60      # a shorter loop (ratio step N / step 20)
    python benchmarks/memory.py --only clients
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

MODEL = "tinker-sr/small"
RANK = 8
MIB = 1 << 20


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def malloc_heap() -> tuple[int, int] | None:
    """glibc's heap over all arenas (``mallinfo2``): (bytes in use, bytes held from the OS).
    RSS growth with "in use" flat is the allocator holding freed memory (fragmentation, or
    arenas kept); with "in use" growing, live objects. None where there is no mallinfo2 (not
    glibc, or glibc < 2.33)."""
    import ctypes
    import ctypes.util

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )]  # fmt: skip

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        call = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = Info
    info = call()
    return info.uordblks + info.hblkhd, info.arena + info.hblkhd


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- 1. RL loop ------------------------------------------------------------------------------


def rl_loop(steps: int) -> dict[str, float]:
    import numpy as np

    import tinker_sr as tinker

    types = tinker.types
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=MODEL, rank=RANK, seed=0).result()
    prompt = [256, *b"count: "]
    params = types.SamplingParams(max_tokens=16, temperature=1.0)
    peaks: dict[str, float] = {}
    for step in range(1, steps + 1):
        sampler = training.save_weights_and_get_sampling_client().result()
        out = sampler.sample(
            types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params
        ).result()
        data = []
        for i, seq in enumerate(out.sequences):
            full = prompt + list(seq.tokens)
            n_prompt = len(prompt) - 1
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": [0.0] * n_prompt + list(seq.logprobs or []),
                        "advantages": [0.0] * n_prompt + [float(i % 2) - 0.5] * len(seq.tokens),
                    },
                )
            )
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        if step in (1, 20) or step % 20 == 0:
            peaks[str(step)] = peak_rss_bytes() / MIB
            print(f"  step {step:4d}: peak RSS {peaks[str(step)]:.0f} MiB", file=sys.stderr)
    service.close().result()
    del np
    return peaks


# ---- 2. many training clients -------------------------------------------------------------


def many_clients(n: int) -> dict[str, float]:
    import tinker_sr as tinker
    from tinker_sr.engine.model import count_parameters

    types = tinker.types
    service = tinker.ServiceClient()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, 33))),
        loss_fn_inputs={"target_tokens": list(range(2, 34)), "weights": [1.0] * 32},
    )
    # Warm-up on another model, in a session that is then closed: torch pages in its kernels
    # and thread pools on first use (tens of MiB that no model owns).
    warm = tinker.ServiceClient(backend=service.holder.backend)
    c = warm.create_lora_training_client(base_model="tinker-sr/tiny", rank=RANK, seed=0).result()
    c.forward_backward([datum], "cross_entropy").result()
    c.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    warm.close().result()
    idle = rss_bytes()
    clients = []
    for i in range(n):
        c = service.create_lora_training_client(base_model=MODEL, rank=RANK, seed=i).result()
        c.forward_backward([datum], "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        clients.append(c)
    grown = rss_bytes() - idle
    backend = service.holder.backend  # the embedded engine: count what should be there
    trainer = backend.models.trainer(clients[0].model_id)
    base_bytes = count_parameters(backend.models.base(trainer.resolved)) * 4
    adapter_bytes = count_parameters(trainer.model, trainable_only=True) * 4
    per_client = 4 * adapter_bytes  # weights, gradient, Adam m and v
    service.close().result()
    return {
        "idle_mib": idle / MIB,
        "grown_mib": grown / MIB,
        "base_mib": base_bytes / MIB,
        "per_client_mib": per_client / MIB,
        "expected_mib": (base_bytes + n * per_client) / MIB,
    }


# ---- 3. server session expiry --------------------------------------------------------------


def serve(port: int, store: str, timeout_s: float) -> None:
    import uvicorn

    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.server.app import create_app

    backend = LocalBackend(store_dir=store)
    app = create_app(backend, session_timeout_s=timeout_s, close_backend=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def server_expiry(sessions: int, timeout_s: float) -> dict[str, float]:
    import httpx

    from tests._server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="tinker-sr-mem-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, __file__, "--serve", str(port), tmp, str(timeout_s)]
        server = subprocess.Popen(cmd, env=env)
        try:
            for _ in range(1200):
                try:
                    if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            cold = rss_bytes(server.pid)
            _client(url, sessions=1, abandon=False)  # warm-up, closed normally
            time.sleep(1)
            idle = rss_bytes(server.pid)
            _client(url, sessions=sessions, abandon=True)
            busy = rss_bytes(server.pid)
            time.sleep(timeout_s * 1.5 + 5)  # expiry is checked every timeout / 4
            expired = rss_bytes(server.pid)
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {
        "cold_mib": cold / MIB,
        "idle_mib": idle / MIB,
        "busy_mib": busy / MIB,
        "expired_mib": expired / MIB,
    }


def _client(url: str, sessions: int, abandon: bool) -> None:
    """Run `sessions` sessions (trainer, a step, 3 samplers) in a child process; with
    ``abandon`` the child exits without closing them (SIGKILL: no goodbye, no heartbeats)."""
    code = (
        "import sys, tinker_sr as t\n"
        "ty = t.types\n"
        f"svcs = [t.ServiceClient(base_url={url!r}, api_key='tml-mem') for _ in range({sessions})]\n"
        "for s in svcs:\n"
        f"    c = s.create_lora_training_client(base_model={MODEL!r}, rank={RANK}, seed=0).result()\n"
        "    d = ty.Datum(model_input=ty.ModelInput.from_ints(list(range(1, 33))),\n"
        "        loss_fn_inputs={'target_tokens': list(range(2, 34)), 'weights': [1.0] * 32})\n"
        "    c.forward_backward([d], 'cross_entropy').result()\n"
        "    c.optim_step(ty.AdamParams(learning_rate=1e-4)).result()\n"
        "    for _ in range(3):\n"
        "        sc = c.save_weights_and_get_sampling_client().result()\n"
        "        sc.sample(ty.ModelInput.from_ints([1, 2, 3]), num_samples=2,\n"
        "            sampling_params=ty.SamplingParams(max_tokens=8)).result()\n"
        + (
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n"
            if abandon
            else "[s.close().result() for s in svcs]\n"
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], env=env, check=not abandon)


# ---- driver ----------------------------------------------------------------------------------


def _in_child(kind: str, arg: str) -> dict[str, float]:
    """Run one check in a fresh interpreter (RSS figures of this process would mix them)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="tinker-sr-mem-") as tmp:
        env["TINKER_SR_STORE"] = tmp
        done = subprocess.run(
            [sys.executable, __file__, "--child", kind, arg],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--session-timeout", type=float, default=15.0)
    parser.add_argument("--only", choices=["loop", "clients", "server"])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1], float(args.serve[2]))
        return
    if args.child:
        kind, arg = args.child
        result = rl_loop(int(arg)) if kind == "loop" else many_clients(int(arg))
        print(json.dumps(result))
        return

    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    if args.only in (None, "loop"):
        peaks = _in_child("loop", str(args.steps))
        last = str(args.steps)
        ratio = peaks[last] / peaks["20"]
        print(
            f"RL loop, new sampler every step: peak RSS step 1 {peaks['1']:.0f} MiB, step 20 "
            f"{peaks['20']:.0f} MiB, step {last} {peaks[last]:.0f} MiB; step {last} / step 20 = "
            f"{ratio:.3f} (target <= 1.10): {'PASS' if ratio <= 1.10 else 'FAIL'}"
        )
    if args.only in (None, "clients"):
        r = _in_child("clients", str(args.clients))
        ratio = r["grown_mib"] / r["expected_mib"]
        print(
            f"{args.clients} training clients on one base: RSS grew {r['grown_mib']:.0f} MiB over "
            f"the idle process ({r['idle_mib']:.0f} MiB); base {r['base_mib']:.0f} MiB + "
            f"{args.clients} x {r['per_client_mib']:.1f} MiB (adapters, grads, Adam) = "
            f"{r['expected_mib']:.0f} MiB; ratio {ratio:.3f} (target <= 1.10): "
            f"{'PASS' if ratio <= 1.10 else 'FAIL'}"
        )
    if args.only in (None, "server"):
        r = server_expiry(args.sessions, args.session_timeout)
        ratio = r["expired_mib"] / r["idle_mib"]
        print(
            f"server: cold {r['cold_mib']:.0f} MiB, idle (after a closed warm-up session) "
            f"{r['idle_mib']:.0f} MiB, with {args.sessions} abandoned sessions "
            f"{r['busy_mib']:.0f} MiB, after they expired {r['expired_mib']:.0f} MiB; "
            f"expired / idle = {ratio:.3f} (target <= 1.10): {'PASS' if ratio <= 1.10 else 'FAIL'}"
        )


if __name__ == "__main__":
    main()
