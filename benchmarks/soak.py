"""Soak a real tinker_sr server with hostile requests while real clients train on it, then
SIGKILL it and check that nothing acknowledged was lost. Prints the figures.

    PYTHONPATH=. python benchmarks/soak.py                # 10,000 requests, 16 clients
    PYTHONPATH=. python benchmarks/soak.py --requests 2000 --clients 4   # a quick look

Phase 1, all at once on one server (127.0.0.1 only):
  * ``--requests`` adversarial requests (`tinker_sr.testing.adversary`) spread over every route
    of the app's own route table, from ``--threads`` threads. Each answer is judged: a status
    >= 500, an error without a JSON detail, an accepted request whose future fails as a
    "server" error, or a future not done in time (a hang) is a problem.
  * ``--clients`` concurrent training clients, half tinker_sr and half the official SDK, each
    training the same LoRA (same seed, same data) for a few steps, sampling and saving a
    checkpoint. Every future must resolve (none lost), sampled sequence ids must be unique
    (none duplicated), and every client's final weights must equal a solo run's.
Phase 2: save checkpoints and sample back to back, SIGKILL the server in the middle of that
(``--kill-after`` seconds), restart it on the same store, and check that every acknowledged
checkpoint and every recorded sampled sequence (phase 1's and those acknowledged just before
the kill) is still there, and that it serves again.

Bounded: stops sending after ``--time-limit`` seconds even below ``--requests`` (and says so).
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import itertools
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TINKER_SR_TORCH_THREADS", "1")

import httpx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tinker_sr.backend.local import LocalBackend  # noqa: E402
from tinker_sr.engine.cpu import describe_machine  # noqa: E402
from tinker_sr.engine.store import Store  # noqa: E402
from tinker_sr.server.app import create_app  # noqa: E402
from tinker_sr.testing.adversary import Adversary, judge, route_table, send  # noqa: E402
from tinker_sr.testing.server import ServerProcess  # noqa: E402

MODEL = "tinker-sr/tiny"
KEY = "tml-soak"
TOKENS = [1, 2, 3, 4, 5]


# ---- the server process: tinker_sr.testing.server.ServerProcess (127.0.0.1, SIGKILL-able)
def start(server: ServerProcess) -> float:
    t0 = time.monotonic()
    server.start()
    return time.monotonic() - t0


def http_client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=300)


def wait_future(http: httpx.Client, promise: dict[str, Any]) -> dict[str, Any]:
    while True:
        got = http.post("/api/v1/retrieve_future", json={"request_id": promise["request_id"]})
        got.raise_for_status()
        body: dict[str, Any] = got.json()
        if body.get("type") != "try_again":
            return body


def real_ids(url: str) -> dict[str, Any]:
    """A session, model, checkpoint and sampler of the soak's own key, for the adversary."""
    with http_client(url) as http:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        body = {"session_id": sid, "model_seq_id": 0, "base_model": MODEL}
        promise = http.post("/api/v1/create_model", json=body | {"lora_config": {"rank": 4}})
        model_id = wait_future(http, promise.json())["model_id"]
        save = {"model_id": model_id, "path": "soak", "seq_id": 1}
        path = wait_future(http, http.post("/api/v1/save_weights", json=save).json())["path"]
        body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": MODEL}
        sampler = http.post("/api/v1/create_sampling_session", json=body).json()
    return {
        "session_id": sid,
        "model_id": model_id,
        "run_id": model_id,
        "sampler_id": sampler["sampling_session_id"],
        "checkpoint": path,
        "kind": "weights",
        "name": "soak",
    }


# ---- phase 1a: adversarial requests ----------------------------------------------------------
@dataclass
class Attack:
    sent: int = 0
    by_status: collections.Counter[str] = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)
    routes_hit: set[tuple[str, str]] = field(default_factory=set)
    stopped_early: bool = False
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def attack(url: str, ids: dict[str, Any], args: argparse.Namespace) -> Attack:
    with tempfile.TemporaryDirectory() as d:
        backend = LocalBackend(Path(d), persistent=False)
        routes = route_table(create_app(backend))
        backend.close()
    out = Attack()
    deadline = time.monotonic() + args.time_limit
    per_thread = -(-args.requests // args.threads)

    def worker(i: int) -> None:
        adversary = Adversary(args.seed * 1000 + i, routes, ids)
        with http_client(url) as http:
            for n in range(per_thread):
                if time.monotonic() > deadline:
                    out.stopped_early = True
                    return
                route = routes[(i + n * args.threads) % len(routes)]
                req = adversary.request(route)
                try:
                    resp = send(http, req)
                    problem = judge(http, resp, future_timeout_s=args.future_timeout)
                    status = f"{resp.status_code // 100}xx"
                except httpx.HTTPError as e:  # no answer at all: the worst outcome
                    problem, status = f"{type(e).__name__}: {e}", "none"
                with out.lock:
                    out.sent += 1
                    out.by_status[status] += 1
                    out.routes_hit.add(route)
                    if problem is not None:
                        out.problems.append(f"{req.method} {req.path[:80]} ({req.what}): {problem}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.seconds = time.monotonic() - t0
    out.routes_hit = out.routes_hit & set(routes)
    out.by_status["routes in table"] = len(routes)
    return out


# ---- phase 1b: real clients ------------------------------------------------------------------
@dataclass
class ClientRun:
    kind: str
    fingerprint: list[float]
    sequence_ids: list[str]
    checkpoint: str
    futures: int


def workload(url: str, kind: str, index: int, steps: int) -> ClientRun:
    """A few training steps, a sample and a checkpoint: the same weights every time."""
    if kind == "sdk":
        import tinker as sdk
        from tinker import types as T
    else:
        import tinker_sr as sdk  # type: ignore[no-redef]
        from tinker_sr import types as T  # type: ignore[no-redef]
    service = sdk.ServiceClient(base_url=url, api_key=KEY)
    datum = T.Datum(
        model_input=T.ModelInput.from_ints(TOKENS),
        loss_fn_inputs={"target_tokens": TOKENS[1:] + [6], "weights": [1.0] * len(TOKENS)},
    )

    def ready(client_or_future: Any) -> Any:  # both SDKs return futures from some creators
        result = getattr(client_or_future, "result", None)
        return result() if callable(result) else client_or_future

    tc = ready(service.create_lora_training_client(MODEL, rank=4, seed=11))
    futures = 0
    for _ in range(steps):
        fb = tc.forward_backward([datum], "cross_entropy")
        op = tc.optim_step(T.AdamParams(learning_rate=0.05))
        fb.result(timeout=600)
        op.result(timeout=600)
        futures += 2
    sc = ready(service.create_sampling_client(base_model=MODEL))
    params = T.SamplingParams(max_tokens=4, seed=3)
    samples = sc.sample(T.ModelInput.from_ints(TOKENS), 2, params).result(timeout=600)
    path = tc.save_state(f"soak-{kind}-{index}").result(timeout=600).path
    fwd = tc.forward([datum], "cross_entropy").result(timeout=600)
    futures += 3
    logprobs = [float(x) for x in fwd.loss_fn_outputs[0]["logprobs"].data]
    ids = [str(s.sequence_id) for s in samples.sequences if getattr(s, "sequence_id", None)]
    return ClientRun(kind, logprobs, ids, path, futures)


def run_clients(url: str, n: int, steps: int) -> tuple[list[ClientRun], list[str]]:
    kinds = ["tinker_sr" if i % 2 == 0 else "sdk" for i in range(n)]
    runs, errors = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        futs = [pool.submit(workload, url, k, i, steps) for i, k in enumerate(kinds)]
        for f in futs:
            try:
                runs.append(f.result(timeout=1800))
            except Exception as e:  # noqa: BLE001 - every failure is reported
                errors.append(f"{type(e).__name__}: {e}")
    return runs, errors


# ---- phase 2: SIGKILL and restart -------------------------------------------------------------
def acknowledge_until_killed(url: str, stop: threading.Event) -> tuple[list[str], list[str]]:
    """Save checkpoints and sample, back to back, until the server dies under us; return
    what it acknowledged (a future answered with a path / sequence ids) before it died."""
    ids, paths, sequences = real_ids(url), [], []
    prompt = {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]}
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=10) as http:
        for n in itertools.count(2):
            if stop.is_set():
                break
            try:
                save = {"model_id": ids["model_id"], "path": f"live-{n}", "seq_id": n}
                got = wait_future(http, http.post("/api/v1/save_weights", json=save).json())
                paths.append(got["path"])
                body = {"num_samples": 2, "prompt": prompt, "seq_id": n}
                body |= {"sampling_params": {"max_tokens": 3, "seed": n}}
                body["sampling_session_id"] = ids["sampler_id"]
                promise = http.post("/api/v1/asample", json=body).json()
                while True:  # a sample's result is protobuf; JSON is try_again or a failure
                    rid = {"request_id": promise["request_id"]}
                    done = http.post("/api/v1/retrieve_future", json=rid)
                    if not done.headers["content-type"].startswith("application/json"):
                        break
                    if done.json().get("type") != "try_again":
                        raise ValueError(done.text)
                sequences += promise["sample_sequence_ids"]
            except httpx.HTTPError:
                break  # the server is gone: everything acknowledged so far must survive
            except (KeyError, ValueError) as e:  # an answer, but not the expected one
                if not stop.is_set():
                    print(f"    unexpected answer before the kill: {e!r:.300}")
                break
    return paths, sequences


def after_restart(
    server: ServerProcess, checkpoints: list[str], sequences: list[str], kill_after_s: float
) -> dict[str, Any]:
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        live = pool.submit(acknowledge_until_killed, server.base_url, stop)
        time.sleep(kill_after_s)
        server.kill()  # SIGKILL, with saves and samples in flight
        stop.set()
        live_paths, live_sequences = live.result(timeout=120)
    print(
        f"  in flight at the SIGKILL: {len(live_paths)} checkpoints and "
        f"{len(live_sequences)} sequences acknowledged in the last {kill_after_s:.0f} s"
    )
    checkpoints, sequences = checkpoints + live_paths, sequences + live_sequences
    restart_s = start(server)
    found_ckpt = 0
    with http_client(server.base_url) as http:
        for path in checkpoints:
            if http.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == 200:
                found_ckpt += 1
            else:
                print(f"    missing after restart: {path}")
        ids = real_ids(server.base_url)  # serves again: a new session, model, checkpoint
    store = Store(server.store / "engine.sqlite")
    found_seq = sum(store.get(s) is not None for s in sequences)
    return {
        "restart_s": restart_s,
        "checkpoints": (found_ckpt, len(checkpoints)),
        "sequences": (found_seq, len(sequences)),
        "serving": bool(ids["model_id"]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=8, help="adversary threads")
    p.add_argument("--clients", type=int, default=16, help="real clients (half official SDK)")
    p.add_argument("--steps", type=int, default=3, help="training steps per client")
    p.add_argument("--time-limit", type=float, default=1500.0, help="seconds of attack at most")
    p.add_argument("--future-timeout", type=float, default=300.0, help="a future slower = hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-after", type=float, default=5.0, help="seconds of saves before SIGKILL")
    args = p.parse_args()
    print(describe_machine(), flush=True)
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tinker_sr_soak_") as tmp:
        server = ServerProcess(Path(tmp) / "store", api_keys=[KEY])
        url = server.base_url
        try:
            print(f"server up in {start(server):.1f} s at {url}", flush=True)
            url = server.base_url  # the port may change if it was taken meanwhile
            ids = real_ids(url)
            solo = workload(url, "tinker_sr", -1, args.steps)
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
                attack_f = pool.submit(attack, url, ids, args)
                clients_f = pool.submit(run_clients, url, args.clients, args.steps)
                result, (runs, client_errors) = attack_f.result(), clients_f.result()
            phase1_s = time.monotonic() - t0
            alive = httpx.get(f"{url}/api/v1/healthz", timeout=10).status_code == 200
            report_attack(result, alive, failures, args)
            report_clients(runs, client_errors, solo, args, failures)
            # Not ids["checkpoint"]: the adversary may legitimately delete it (DELETE route).
            checkpoints = [solo.checkpoint] + [r.checkpoint for r in runs]
            sequences = solo.sequence_ids + [s for r in runs for s in r.sequence_ids]
            restart = after_restart(server, checkpoints, sequences, args.kill_after)
            report_restart(restart, failures)
            print(f"phase 1 (attack + clients at once): {phase1_s:.1f} s", flush=True)
        finally:
            server.stop()
    print("RESULT: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 0 if not failures else 1


def report_attack(a: Attack, alive: bool, failures: list[str], args: argparse.Namespace) -> None:
    rate = a.sent / a.seconds if a.seconds else 0.0
    print(
        f"adversarial requests: {a.sent} in {a.seconds:.1f} s ({rate:.0f}/s, {args.threads} "
        f"threads); routes hit {len(a.routes_hit)}/{a.by_status['routes in table']}; answers "
        f"{dict((k, v) for k, v in a.by_status.items() if k != 'routes in table')}"
    )
    print(f"  problems (>=500, no detail, server-category, hang): {len(a.problems)}")
    for line in a.problems[:20]:
        print(f"    {line}")
    print(f"  server alive and serving after: {alive}")
    if a.problems:
        failures.append(f"{len(a.problems)} bad answers")
    if a.sent < args.requests:
        failures.append(f"only {a.sent} of {args.requests} requests sent (time limit)")
    if len(a.routes_hit) < a.by_status["routes in table"] or not alive:
        failures.append("not every route attacked, or server not alive")


def report_clients(
    runs: list[ClientRun],
    errors: list[str],
    solo: ClientRun,
    args: argparse.Namespace,
    failures: list[str],
) -> None:
    futures = sum(r.futures for r in runs)
    ids = [s for r in runs for s in r.sequence_ids] + solo.sequence_ids
    dup = len(ids) - len(set(ids))
    same = sum(r.fingerprint == solo.fingerprint for r in runs)
    kinds = collections.Counter(r.kind for r in runs)
    print(
        f"concurrent clients: {len(runs)}/{args.clients} finished ({dict(kinds)}), "
        f"{futures} futures resolved, {len(errors)} failed/lost, {dup} duplicated sequence "
        f"ids; weights equal to the solo run: {same}/{len(runs)}"
    )
    for e in errors[:5]:
        print(f"    {e}")
    if errors or dup or same != len(runs) or len(runs) != args.clients:
        failures.append("concurrent clients")


def report_restart(r: dict[str, Any], failures: list[str]) -> None:
    (ck, ck_n), (sq, sq_n) = r["checkpoints"], r["sequences"]
    print(
        f"SIGKILL + restart ({r['restart_s']:.1f} s): acknowledged checkpoints found {ck}/{ck_n}, "
        f"recorded sequences found {sq}/{sq_n}, serving again: {r['serving']}"
    )
    if ck != ck_n or sq != sq_n or not r["serving"]:
        failures.append("restart lost state")


if __name__ == "__main__":
    sys.exit(main())
