"""StableReinforce vs importance_sampling: time and memory of one forward+backward.

A transformer-free setup at a real vocabulary size: logits = hidden @ W with hidden
[B*T, D] requiring grad, split into one row view per datum (as the backend hands the loss a
padded batch). Both losses run on the same batch in one process, in paired runs of alternating
order; the table reports median wall and process-CPU time, the median peak growth of live heap
memory during the step (glibc mallinfo2, sampled), and the bytes autograd saves for backward
(saved_tensors_hooks), split into the logits themselves and any *other* tensor of tokens x vocab
size. The time verdict is the median per-pair CPU-time ratio, which background load on a shared
machine barely moves (wall time is printed next to it).

Baseline in the same run: ``importance_sampling`` (one gathered target per position), plus the
spec's reference sketch (a full ``log_softmax`` copy) to show what the memory criterion guards
against. Targets: StableReinforce time <= 1.10 x importance_sampling, and no extra tokens x vocab
tensor saved for backward.

    python benchmarks/losses.py            # B=16, T=256, D=256, V=32768
    python benchmarks/losses.py --quick    # T=64, fewer repetitions

``--full-step`` times the whole ``forward_backward`` request instead, through the public
embedded API on ``tinker-sr/small``: sequences sampled with ``record_stability_info``, datums
built with provenance (`tinker_sr.provenance.build.build_datum`), and the same datums sent as
``importance_sampling`` and as ``stable_reinforce`` (provenance validation, draw lookup, model,
loss and backward all included) in paired runs of alternating order. Target: <= 1.05.

    python benchmarks/losses.py --full-step
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from tinker_sr.engine.losses import LossDatum, compute_loss  # noqa: E402

TIME_TARGET = 1.10


@dataclass
class Setup:
    hidden: torch.Tensor  # [B*T, D], requires grad
    weight: torch.Tensor  # [D, V]
    data: list[LossDatum]
    b: int
    t: int


def make_setup(b: int, t: int, d: int, v: int, k: int = 8, prompt: int = 64) -> Setup:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(b * t, d, generator=gen).requires_grad_()
    weight = torch.randn(d, v, generator=gen) / d**0.5
    prompt = min(prompt, t // 2)
    sampled = torch.arange(t) >= prompt
    data = []
    for _ in range(b):
        targets = torch.randint(0, v, (t,), generator=gen)
        draws = torch.randint(0, v, (t, k), generator=gen)
        draws[~sampled] = -1
        adv = torch.where(sampled, torch.randn(()), 0.0).float() * torch.ones(t)
        lq = torch.where(sampled, -10.0 + 0.1 * torch.randn(t, generator=gen), 0.0)
        inputs = {"logprobs": lq.float(), "advantages": adv}
        data.append(LossDatum(targets, inputs, draws=draws, sampled_mask=sampled.clone()))
    return Setup(hidden, weight, data, b, t)


def reference_sketch(logits: list[torch.Tensor], data: list[LossDatum]) -> torch.Tensor:
    """spec/losses.md §2.9 as written: materialises a full log_softmax copy."""
    loss = torch.zeros(())
    for z, d in zip(logits, data, strict=True):
        logp = torch.log_softmax(z.float(), dim=-1)
        lx = logp.gather(1, d.target_tokens[:, None]).squeeze(1)
        ly = logp.gather(1, d.draws.clamp_min(0)).mean(1)
        adv, lq = d.inputs["advantages"], d.inputs["logprobs"]
        per_tok = -adv * (lx - ly) + 0.01 * (lq - lx)
        loss = loss + torch.where(d.sampled_mask, per_tok, torch.zeros_like(per_tok)).sum()
    return loss


def loss_step(name: str) -> Callable[[list[torch.Tensor], list[LossDatum]], torch.Tensor]:
    if name == "reference sketch":
        return reference_sketch

    def step(logits: list[torch.Tensor], data: list[LossDatum]) -> torch.Tensor:
        if name == "importance_sampling":  # the IS datum: no provenance fields
            data = [LossDatum(d.target_tokens, d.inputs) for d in data]
        return compute_loss(name, logits, data, {}).loss

    return step


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _live_bytes_reader() -> tuple[Callable[[], int], str]:
    """Live heap bytes from glibc's mallinfo2 (exact, unlike RSS); RSS where that is missing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2

        def live() -> int:
            info = libc.mallinfo2()
            return int(info.uordblks + info.hblkhd)

        return live, "malloc"
    except (OSError, AttributeError):
        page = os.sysconf("SC_PAGE_SIZE")

        def rss() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        return rss, "RSS"


LIVE_BYTES, LIVE_KIND = _live_bytes_reader()


class PeakMemory:
    """Peak growth of live memory while the block runs, sampled every ~0.5 ms."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, LIVE_BYTES())
            time.sleep(0.0005)

    def __enter__(self) -> PeakMemory:
        self.base = self.peak = LIVE_BYTES()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, LIVE_BYTES())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def run_once(setup: Setup, name: str, measure: bool) -> tuple[float, float, int, int, int]:
    """One forward+backward; returns (wall s, process CPU s, peak memory growth, bytes of the
    logits saved for backward, bytes of *other* saved tensors of at least T x V elements).
    Saved tensors count once per storage; the model's hidden states and weight are not the
    loss's."""
    step = loss_step(name)
    setup.hidden.grad = None
    own = {setup.hidden.untyped_storage().data_ptr(), setup.weight.untyped_storage().data_ptr()}
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= setup.t * setup.weight.shape[1]:
            storage = x.untyped_storage()
            if storage.data_ptr() not in own:
                storages[storage.data_ptr()] = storage.nbytes()
        return x

    with PeakMemory() as mem:
        start, cpu_start = time.perf_counter(), time.process_time()
        if measure:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                logits = setup.hidden @ setup.weight
                views = [logits[i * setup.t : (i + 1) * setup.t] for i in range(setup.b)]
                loss = step(views, setup.data)
        else:
            logits = setup.hidden @ setup.weight
            views = [logits[i * setup.t : (i + 1) * setup.t] for i in range(setup.b)]
            loss = step(views, setup.data)
        logits_ptr = logits.untyped_storage().data_ptr()
        del logits, views
        loss.backward()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    saved_logits = storages.pop(logits_ptr, 0)
    return elapsed, cpu, mem.growth, saved_logits, sum(storages.values())


FULL_STEP_TARGET = 1.05


def full_step(reps: int) -> None:
    """stable_reinforce vs importance_sampling as whole requests on the same provenance datums."""
    import tinker_sr as tinker
    from tinker_sr.engine.cpu import describe_machine
    from tinker_sr.provenance.build import build_datum

    types = tinker.types
    print(describe_machine())
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model="tinker-sr/small", rank=8, seed=0)
    training = training.result()
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    data = []
    for i in range(4):
        prompt = types.ModelInput.from_ints([256, *f"prompt {i}: count to ten".encode()])
        params = types.SamplingParams(max_tokens=64, temperature=1.0, seed=i)
        out = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
        for j, seq in enumerate(out.sequences):
            data.append(build_datum(prompt, seq, float(j % 2) - 0.5))

    def timed(loss_fn: str) -> float:
        start = time.process_time()
        training.forward_backward(data, loss_fn).result()
        return time.process_time() - start

    pair = ["importance_sampling", "stable_reinforce"]
    for name in pair:  # warm-up
        timed(name)
    runs: dict[str, list[float]] = {name: [] for name in pair}
    for rep in range(reps):
        for name in pair if rep % 2 == 0 else pair[::-1]:
            runs[name].append(timed(name))
    ratios = [a / b for a, b in zip(runs[pair[1]], runs[pair[0]], strict=True)]
    ratio = statistics.median(ratios)
    n_tok = sum(d.model_input.length for d in data)
    print(
        f"tinker-sr/small LoRA r8, {len(data)} datums with provenance, {n_tok} tokens, {reps} pairs"
    )
    for name in pair:
        print(f"{name:<20} median CPU {statistics.median(runs[name]) * 1e3:8.1f} ms")
    print(
        f"full step stable_reinforce / importance_sampling = {ratio:.3f} (CPU time, median of "
        f"per-pair ratios; target <= {FULL_STEP_TARGET}): "
        f"{'PASS' if ratio <= FULL_STEP_TARGET else 'FAIL'}"
    )
    service.close().result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=64 and fewer repetitions")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--full-step", action="store_true", help="whole requests (see above)")
    args = parser.parse_args()
    if args.full_step:
        full_step(args.reps or 9)
        return
    b, t, d, v = 16, (64 if args.quick else 256), 256, args.vocab
    reps = args.reps or (4 if args.quick else 8)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    setup = make_setup(b, t, d, v)
    names = ["importance_sampling", "stable_reinforce", "reference sketch"]
    mib = 1 << 20
    print(
        f"B={b} T={t} D={d} V={v} K=8  tokens x vocab = {b * t * v * 4 / mib:.0f} MiB (fp32)  "
        f"threads={torch.get_num_threads()}  reps={reps} (medians)"
    )

    for name in names:  # warm-up
        run_once(setup, name, measure=False)
    memory = {name: run_once(setup, name, measure=True) for name in names}
    # Paired, order-alternating repetitions of the two losses under test: each pair runs under
    # nearly the same background load, so the median of per-pair ratios is robust to drift.
    pair = ["importance_sampling", "stable_reinforce"]
    runs: dict[str, list[tuple[float, float, int, int, int]]] = {name: [] for name in pair}
    for rep in range(reps):
        for name in pair if rep % 2 == 0 else pair[::-1]:
            runs[name].append(run_once(setup, name, measure=False))
    runs["reference sketch"] = [memory["reference sketch"]]

    def med(name: str, field: int) -> float:
        return statistics.median(r[field] for r in runs[name])

    def pair_ratio(field: int) -> float:
        sr, base = runs["stable_reinforce"], runs["importance_sampling"]
        return statistics.median(a[field] / b[field] for a, b in zip(sr, base, strict=True))

    header = (
        f"{'loss':<20} {'wall ms':>9} {'CPU ms':>9} {'peak mem MiB':>13} "
        f"{'saved logits MiB':>17} {'other TxV saved MiB':>20}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        _, _, _, saved_logits, saved_other = memory[name]
        note = "  (1 run)" if name == "reference sketch" else ""
        print(
            f"{name:<20} {med(name, 0) * 1e3:>9.1f} {med(name, 1) * 1e3:>9.1f} "
            f"{med(name, 2) / mib:>13.0f} {saved_logits / mib:>17.0f} "
            f"{saved_other / mib:>20.0f}{note}"
        )

    wall_ratio, cpu_ratio, mem_ratio = pair_ratio(0), pair_ratio(1), pair_ratio(2)
    sr, is_ = memory["stable_reinforce"], memory["importance_sampling"]
    saved_ratio = (sr[3] + sr[4]) / max(is_[3] + is_[4], 1)
    print()
    # CPU time is the verdict: wall time also measures whatever else the machine is running.
    print(
        f"time ratio stable_reinforce / importance_sampling (median of {reps} paired runs) = "
        f"{cpu_ratio:.3f} CPU, {wall_ratio:.3f} wall  (target <= {TIME_TARGET:.2f}): "
        f"{'PASS' if cpu_ratio <= TIME_TARGET else 'FAIL'}"
    )
    print(
        f"saved-for-backward bytes ratio = {saved_ratio:.3f}, extra tokens x vocab tensors saved "
        f"= {sr[4] / mib:.0f} MiB: {'PASS' if sr[4] == 0 and saved_ratio <= 1.01 else 'FAIL'}"
    )
    print(f"peak memory ratio = {mem_ratio:.3f} (live {LIVE_KIND} bytes; informational)")


if __name__ == "__main__":
    main()
