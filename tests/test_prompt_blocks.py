"""Recorded prompts are stored once per 64-token block, however many sequences share them
(`engine.store_sequences`: a chain of blocks, each sequence naming its last).

Before schema 2 every sampled sequence stored its whole prompt: ``n`` copies per request, and
in a multi-turn episode (each prompt the conversation so far) a sum that grows with the square
of the turns. These tests read the store's SQLite file as it is on disk."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import numpy as np

from tinker_sr.engine.store import Store
from tinker_sr.provenance.validate import RECORD_TTL_SECONDS, SequenceRecord

DAY = 86400.0


def _record(sid: str, prompt: np.ndarray, sampled: list[int], now: float) -> SequenceRecord:
    s = np.asarray(sampled, dtype=np.int32)
    draws = np.arange(len(s) * 3, dtype=np.int32).reshape(len(s), 3)
    lps = -np.linspace(0.1, 2.0, len(s)).astype(np.float32)
    return SequenceRecord(sid, "sess", prompt, s, lps, draws, now, now)


def _prompt_bytes(path: Path) -> int:
    """Bytes of prompt tokens on disk: inline prompts plus stored blocks."""
    with sqlite3.connect(path) as db:
        inline = db.execute("SELECT COALESCE(SUM(length(prompt_tokens)), 0) FROM sequences")
        total = int(inline.fetchone()[0])
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "prompt_chain" in tables:
            total += int(db.execute("SELECT SUM(length(tokens)) FROM prompt_chain").fetchone()[0])
    return total


def _episode(rng: np.random.Generator, turns: int, n: int) -> list[list[SequenceRecord]]:
    """A multi-turn episode: each turn samples ``n`` sequences of the conversation so far,
    which then grows by the first sample and an observation."""
    conversation = rng.integers(0, 30000, 300).astype(np.int32)
    now, out = time.time(), []
    for turn in range(turns):
        prompt = conversation.copy()  # the sampler's one array for the request's n records
        sampled = [rng.integers(0, 30000, 40).tolist() for _ in range(n)]
        out.append([_record(f"t{turn}s{i}", prompt, sampled[i], now) for i in range(n)])
        observation = rng.integers(0, 30000, 30).astype(np.int32)
        conversation = np.concatenate([conversation, np.int32(sampled[0]), observation])
    return out


def test_an_episodes_prompts_cost_about_one_copy_of_its_last_prompt(tmp_path: Path) -> None:
    path = tmp_path / "engine.sqlite"
    store = Store(path)
    turns = _episode(np.random.default_rng(0), turns=20, n=8)
    for records in turns:
        store.put_sequences(records)
    store.close()

    last = len(turns[-1][0].prompt_tokens)  # 300 + 19 * 70 = 1630 tokens
    every_copy = sum(len(r.prompt_tokens) * 4 for records in turns for r in records)
    stored = _prompt_bytes(path)
    # The final conversation once, plus each turn's last, partial block (< 64 tokens).
    assert stored <= last * 4 + 20 * 64 * 4, (stored, every_copy)
    assert every_copy > 50 * stored  # 617,600 bytes before (each sequence its own), 8,848 now

    reopened = Store(path, cache_size=1)  # every read from the file, none from memory
    for records in turns:
        for rec in records:
            got = reopened.get(rec.sequence_id)
            assert got is not None
            np.testing.assert_array_equal(got.prompt_tokens, rec.prompt_tokens)
            np.testing.assert_array_equal(got.sampled_tokens, rec.sampled_tokens)
            np.testing.assert_array_equal(got.draws, rec.draws)
            np.testing.assert_array_equal(got.sampler_logprobs, rec.sampler_logprobs)
    reopened.close()


def test_prompts_of_every_length_read_back_exactly(tmp_path: Path) -> None:
    store = Store(tmp_path / "engine.sqlite", cache_size=1)
    rng, now = np.random.default_rng(1), time.time()
    lengths = [1, 2, 63, 64, 65, 127, 128, 129, 1000]
    base = rng.integers(-(2**31), 2**31 - 1, max(lengths), dtype=np.int64).astype(np.int32)
    store.put_sequences([_record(f"p{n}", base[:n], [7], now) for n in lengths])
    for n in lengths:
        got = store.get(f"p{n}")
        assert got is not None and got.prompt_tokens.dtype == np.int32
        np.testing.assert_array_equal(got.prompt_tokens, base[:n])
    store.close()


def test_a_block_lives_while_any_sequence_naming_it_lives(tmp_path: Path) -> None:
    """A shares its full blocks with B's longer prompt; B was used since. Expiring A keeps
    every block of B and removes A's own last block; expiring B empties the table."""
    path = tmp_path / "engine.sqlite"
    store = Store(path, cache_size=1)
    rng, now = np.random.default_rng(2), time.time()
    shared = rng.integers(0, 1000, 200).astype(np.int32)  # 3 full blocks and 8 tokens
    longer = np.concatenate([shared, rng.integers(0, 1000, 100).astype(np.int32)])
    store.put_sequences([_record("a", shared, [1, 2], now - 2 * DAY)])
    store.put_sequences([_record("b", longer, [3], now - 2 * DAY)])
    store.touch_sequences({"b"}, now)  # used by a training request today

    store.purge_expired_sequences(now - RECORD_TTL_SECONDS)
    assert store.get("a") is None
    got = store.get("b")
    assert got is not None
    np.testing.assert_array_equal(got.prompt_tokens, longer)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM prompt_chain").fetchone()[0] == 5  # B's only

    store.purge_expired_sequences(now + 2 * DAY)
    assert store.get("b") is None
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM prompt_chain").fetchone()[0] == 0
    store.close()


def test_a_block_written_while_the_clock_ran_ahead_expires_with_its_sequence(
    tmp_path: Path,
) -> None:
    path = tmp_path / "engine.sqlite"
    store = Store(path, cache_size=1)
    now = time.time()
    prompt = np.arange(100, dtype=np.int32)
    store.put_sequences([_record("ahead", prompt, [1], now + 30 * DAY)])
    store.purge_expired_sequences(now - RECORD_TTL_SECONDS)  # clamps both to "now"
    got = store.get("ahead")
    assert got is not None
    np.testing.assert_array_equal(got.prompt_tokens, prompt)
    store.purge_expired_sequences(time.time() + 60)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM prompt_chain").fetchone()[0] == 0
    store.close()


def test_a_schema_1_store_keeps_its_inline_prompts_readable(tmp_path: Path) -> None:
    """A store written before blocks: its rows hold their prompts inline, and are read as
    they are, beside new rows, once this version has brought the schema up to date."""
    path = tmp_path / "engine.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE sequences (sequence_id TEXT PRIMARY KEY, session_id TEXT NOT NULL,"
            " prompt_tokens BLOB NOT NULL, sampled_tokens BLOB NOT NULL,"
            " sampler_logprobs BLOB NOT NULL, draws BLOB, draws_k INTEGER NOT NULL,"
            " created_at REAL NOT NULL, last_used_at REAL NOT NULL); PRAGMA user_version = 1;"
        )
        old = np.arange(70, dtype="<i4")
        db.execute(
            "INSERT INTO sequences VALUES (?,?,?,?,?,?,?,?,?)",
            ("old", "sess", old.tobytes(), np.int32([5]).astype("<i4").tobytes(),
             np.float32([-0.5]).astype("<f4").tobytes(), None, 0, time.time(), time.time()),
        )  # fmt: skip
    store = Store(path, cache_size=1)
    store.put_sequences([_record("new", old.astype(np.int32), [6], time.time())])
    for sid in ("old", "new"):
        got = store.get(sid)
        assert got is not None
        np.testing.assert_array_equal(got.prompt_tokens, old)
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 3


def test_a_multi_turn_episode_trains_the_same_from_blocks_read_from_the_file(
    tmp_path: Path,
) -> None:
    """Real sampling (n=4, three turns, stability info recorded), then the trajectory's
    StableReinforce loss from the records the sampler kept in memory and again from the
    records read back from the file (the store's cache emptied): the same outputs."""
    import tinker_sr as tinker
    from tinker_sr.provenance import build_trajectory_datum

    from .conftest import embedded_client

    with embedded_client(tmp_path) as service:
        trainer = service.create_lora_training_client("tinker-sr/tiny", rank=2, seed=0).result()
        sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True)
        params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        conversation, turns = list(b"the conversation so far, " * 6), []
        for k in range(3):
            prompt = tinker.ModelInput.from_ints(conversation)
            seqs = sampler.result().sample(prompt, 4, params).result().sequences
            turns.append((list(b"tool says ok. ") if k else conversation, seqs[0], 1.0 - k))
            conversation = conversation + list(seqs[0].tokens) + list(b"tool says ok. ")
        datum = build_trajectory_datum(turns)
        before = trainer.forward([datum], "stable_reinforce").result()
        store = service.holder.backend.store
        store._seq_cache.clear()  # every record from here on is read from the file
        after = trainer.forward([datum], "stable_reinforce").result()
        assert len(store._seq_cache) == 3
    assert before.metrics == after.metrics
    assert before.loss_fn_outputs[0]["logprobs"].tolist() == (
        after.loss_fn_outputs[0]["logprobs"].tolist()
    )
    # Four samples per turn, each prompt the conversation so far: 12 copies before.
    assert _prompt_bytes(tmp_path / "store" / "engine.sqlite") < len(conversation) * 4 + 3 * 256


def _draft_store(path: Path, layout: str, prompts: dict[str, np.ndarray]) -> None:
    """A store as one of the two drafts of schema 2 wrote it (on main for an hour): blocks
    keyed by hash with a use time, each sequence listing their hashes; or keyed by id with
    counts, each sequence listing their ids."""
    from tinker_sr.engine.store_sequences import prompt_blocks

    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE sequences (sequence_id TEXT PRIMARY KEY, session_id TEXT NOT NULL,"
            " prompt_tokens BLOB NOT NULL, sampled_tokens BLOB NOT NULL,"
            " sampler_logprobs BLOB NOT NULL, draws BLOB, draws_k INTEGER NOT NULL,"
            " created_at REAL NOT NULL, last_used_at REAL NOT NULL, prompt_blocks BLOB);"
            + ("CREATE TABLE prompt_blocks (block_hash BLOB PRIMARY KEY, tokens BLOB NOT NULL,"
               " last_used_at REAL NOT NULL) WITHOUT ROWID;" if layout == "hashes" else
               "CREATE TABLE prompt_blocks (block_id INTEGER PRIMARY KEY AUTOINCREMENT,"
               " block_hash BLOB NOT NULL UNIQUE, tokens BLOB NOT NULL, refs INTEGER NOT NULL);")
            + "PRAGMA user_version = 2;"
        )  # fmt: skip
        for sid, prompt in prompts.items():
            named = b""
            for h, chunk in prompt_blocks(prompt):
                if layout == "hashes":
                    db.execute(
                        "INSERT OR IGNORE INTO prompt_blocks VALUES (?,?,?)", (h, chunk, 1.0)
                    )
                    named += h
                else:
                    db.execute("INSERT OR IGNORE INTO prompt_blocks (block_hash, tokens, refs)"
                               " VALUES (?,?,1)", (h, chunk))  # fmt: skip
                    (i,) = db.execute("SELECT block_id FROM prompt_blocks WHERE block_hash=?", (h,))
                    named += int(i[0]).to_bytes(8, "little")
            db.execute(
                "INSERT INTO sequences VALUES (?,?,?,?,?,?,?,?,?,?)",
                (sid, "sess", b"", np.int32([5]).tobytes(), np.float32([-0.5]).tobytes(), None,
                 0, time.time(), time.time(), named),
            )  # fmt: skip


def test_a_store_of_a_draft_layout_keeps_its_prompts(tmp_path: Path) -> None:
    """Both drafts' prompts read back exactly (kept inline), beside new rows; their table
    goes and the schema is 3 (before: "no such column: refs" / "block_id", internal errors
    on every stable_reinforce step, a hunt)."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 30000, 150).astype(np.int32)
    prompts = {"short": base[:10], "shared": base[:130], "longer": base}
    for layout in ("hashes", "ids"):
        path = tmp_path / f"{layout}.sqlite"
        _draft_store(path, layout, prompts)
        Store.for_reading(path).close()  # a reader (`usage`) beside a draft server: no change
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT COUNT(*) FROM prompt_blocks").fetchone()[0] > 0
            assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        store = Store(path, cache_size=1)
        store.put_sequences([_record("new", base, [6], time.time())])
        for sid, prompt in {**prompts, "new": base}.items():
            got = store.get(sid)
            assert got is not None, (layout, sid)
            np.testing.assert_array_equal(got.prompt_tokens, prompt)
        store.close()
        with sqlite3.connect(path) as db:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
            assert "prompt_blocks" not in tables and "prompt_chain" in tables
            assert db.execute("PRAGMA user_version").fetchone()[0] == 3


_RECORDER = """
import sys, time, numpy as np
from tinker_sr.engine.store import Store
from tinker_sr.provenance.validate import SequenceRecord
path, who = sys.argv[1], sys.argv[2]
store, rng = Store(path, cache_size=1), np.random.default_rng(ord(who))
shared, failed = np.arange(64 * 40, dtype=np.int32), []
for i in range(150):
    t = time.time() - (2 * 86400 if who == "B" and i % 2 == 0 else 0)
    tail = rng.integers(0, 30000, int(rng.integers(1, 300))).astype(np.int32)
    prompt = np.concatenate([shared, tail])
    one, lp = np.int32([5]), np.float32([-0.5])
    records = [SequenceRecord(f"{who}{i}-{j}", "s", prompt, one, lp, None, t, t) for j in range(4)]
    try:
        store.put_sequences(records)
        if who == "B" and i % 3 == 0:
            store.purge_expired_sequences(time.time() - 86400)
    except Exception as e:
        failed.append(str(e))
print(who, len(failed), sorted(set(failed))[:2])
"""


def test_two_processes_record_on_one_store(tmp_path: Path) -> None:
    """Two engines on one store (every embedded engine's default is ~/.cache/tinker_sr),
    prompts sharing blocks, one purging: every recording succeeds (a review: recording read
    its blocks before writing in a deferred transaction, and another process's commit in
    between failed it at once with "database is locked", 112 of 400 requests)."""
    import subprocess
    import sys

    path = tmp_path / "engine.sqlite"
    Store(path).close()
    procs = [
        subprocess.Popen([sys.executable, "-c", _RECORDER, str(path), who],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for who in "AB"
    ]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(out.split(" ", 2)[:2] for out, _ in outs) == [["A", "0"], ["B", "0"]], outs
