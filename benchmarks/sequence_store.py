"""Recorded sequences in the store: prompts once per 64-token block against a prompt per row.

Each step records ``--requests`` sample requests of ``--samples`` sequences each (one
`Store.put_sequences` call per request, as the sampler makes), touches them all (a training
step's `touch_sequences`) and reads them all back from the file (the cache emptied: a
server restart). The baseline, in the same process and SQLite settings (WAL, synchronous
NORMAL, one transaction per call), is the schema-1 layout: a table holding each sequence's
whole prompt inline. Rounds alternate which side goes first; the table reports each side's
median ms per step and the ratios, and the files' sizes.

Two workloads: ``rl`` (every request's prompt its own: sharing only among a request's
samples) and ``agentic`` (``--requests`` episodes of ``--steps`` turns, each prompt the
conversation so far, which grows by an answer and an observation every turn).

    python benchmarks/sequence_store.py                      # both, 8k-token prompts
    python benchmarks/sequence_store.py --prompt 2048 --quick
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from tinker_sr.engine.cpu import describe_machine
from tinker_sr.engine.store import Store
from tinker_sr.provenance.validate import SequenceRecord

Batch = list[list[SequenceRecord]]  # a step's requests, each its samples' records


class InlineStore:
    """The baseline: the schema-1 table, a prompt per row."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(
            "CREATE TABLE seqs (sequence_id TEXT PRIMARY KEY, session_id TEXT NOT NULL,"
            " prompt_tokens BLOB NOT NULL, sampled_tokens BLOB NOT NULL,"
            " sampler_logprobs BLOB NOT NULL, draws BLOB, draws_k INTEGER NOT NULL,"
            " created_at REAL NOT NULL, last_used_at REAL NOT NULL);"
            "CREATE INDEX seqs_last_used ON seqs(last_used_at);"
        )

    def put(self, records: list[SequenceRecord]) -> None:
        rows = [
            (r.sequence_id, r.session_id, r.prompt_tokens.astype("<i4").tobytes(),
             r.sampled_tokens.astype("<i4").tobytes(), r.sampler_logprobs.tobytes(), None, 0,
             r.created_at, r.last_used_at)
            for r in records
        ]  # fmt: skip
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO seqs VALUES (?,?,?,?,?,?,?,?,?)", rows)
        self.db.execute("COMMIT")

    def touch(self, ids: set[str] | frozenset[str], now: float) -> None:
        self.db.execute("BEGIN")
        self.db.executemany(
            "UPDATE seqs SET last_used_at=? WHERE sequence_id=?", [(now, i) for i in sorted(ids)]
        )
        self.db.execute("COMMIT")

    def get(self, sequence_id: str) -> SequenceRecord:
        """As schema 1's `Store.get` read a row (the cache aside)."""
        (sid, sess, prompt, sampled, lps, _, _, created, used) = self.db.execute(
            "SELECT * FROM seqs WHERE sequence_id=?", (sequence_id,)
        ).fetchone()
        return SequenceRecord(
            sid, sess, np.frombuffer(prompt, dtype="<i4").astype(np.int32),
            np.frombuffer(sampled, dtype="<i4").astype(np.int32),
            np.frombuffer(lps, dtype="<f4").astype(np.float32), None, created, used,
        )  # fmt: skip


def _records(
    prompt: np.ndarray, tag: str, n: int, answer: int, rng: np.random.Generator
) -> list[SequenceRecord]:
    now = time.time()
    return [
        SequenceRecord(f"{tag}-{i}", "sess", prompt, rng.integers(0, 150_000, answer, np.int32),
                       rng.random(answer, dtype=np.float32), None, now, now)
        for i in range(n)
    ]  # fmt: skip


def workload(kind: str, args: argparse.Namespace) -> Iterator[Batch]:
    """Each step's requests (the same for both sides: seeded)."""
    rng = np.random.default_rng(0)
    talks = [rng.integers(0, 150_000, args.prompt // 4, np.int32) for _ in range(args.requests)]
    for step in range(args.steps):
        batch = []
        for r in range(args.requests):
            if kind == "rl":
                prompt = rng.integers(0, 150_000, args.prompt, np.int32)
            else:
                prompt = talks[r].copy()
            batch.append(_records(prompt, f"{step}-{r}", args.samples, args.answer, rng))
            if kind == "agentic":  # the conversation grows by the first answer and an observation
                seen = rng.integers(0, 150_000, 64, np.int32)
                talks[r] = np.concatenate([talks[r], batch[-1][0].sampled_tokens, seen])
        yield batch


def run_side(side: str, kind: str, args: argparse.Namespace, root: Path) -> tuple[list[float], int]:
    """(ms per step for put, touch, get; summed over steps) and the file's bytes."""
    path = root / f"{side}-{kind}.sqlite"
    store: Store | InlineStore = Store(path) if side == "blocks" else InlineStore(path)
    put: Callable[[list[SequenceRecord]], None]
    touch: Callable[[set[str], float], None]
    get: Callable[[str], object]
    if isinstance(store, Store):
        put, touch, get = store.put_sequences, store.touch_sequences, store.get
    else:
        put, touch, get = store.put, store.touch, store.get
    spent = [0.0, 0.0, 0.0]
    for batch in workload(kind, args):
        ids = {r.sequence_id for records in batch for r in records}
        t0 = time.perf_counter()
        for records in batch:
            put(records)
        t1 = time.perf_counter()
        touch(ids, time.time())
        t2 = time.perf_counter()
        if isinstance(store, Store):
            store._seq_cache.clear()  # read from the file, as after a restart
        for i in sorted(ids):
            get(i)
        t3 = time.perf_counter()
        for k, d in enumerate((t1 - t0, t2 - t1, t3 - t2)):
            spent[k] += d * 1e3 / args.steps
    size = sum(p.stat().st_size for p in root.glob(f"{side}-{kind}.sqlite*"))
    return spent, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=8192, help="tokens per prompt (rl)")
    ap.add_argument("--answer", type=int, default=256, help="tokens per sampled sequence")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 3 steps")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 3
    print(describe_machine())
    print(f"{args.requests} requests x {args.samples} samples per step, {args.steps} steps, "
          f"{args.rounds} rounds; rl prompts {args.prompt} tokens")  # fmt: skip
    for kind in ("rl", "agentic"):
        per: dict[str, list[list[float]]] = {"blocks": [], "inline": []}
        sizes: dict[str, int] = {}
        for rnd in range(args.rounds):
            order = ("blocks", "inline") if rnd % 2 == 0 else ("inline", "blocks")
            for side in order:
                with tempfile.TemporaryDirectory() as tmp:
                    spent, sizes[side] = run_side(side, kind, args, Path(tmp))
                per[side].append(spent)
        med = {s: [statistics.median(r[k] for r in per[s]) for k in range(3)] for s in per}
        print(f"\n{kind}: ms per step (median of {args.rounds} rounds)   blocks   inline   ratio")
        for k, name in enumerate(("record (put_sequences)", "touch (a training step)",
                                  "read back, uncached")):  # fmt: skip
            b, i = med["blocks"][k], med["inline"][k]
            print(f"  {name:36s} {b:8.1f} {i:8.1f} {b / i:7.2f}")
        b, i = sizes["blocks"], sizes["inline"]
        print(f"  {'file, MB':36s} {b / 1e6:8.1f} {i / 1e6:8.1f} {b / i:7.2f}")


if __name__ == "__main__":
    main()
