"""The store's recorded sequences (`engine.store.Store` holds the lock and the cache).

A sequence row keeps what was sampled (tokens, log-probs, draws) and names its prompt by the
row ids of the prompt's 64-token blocks; each block's tokens are stored once, in
``prompt_blocks``, found by a hash that covers the block and every block before it. The
``n`` samples of one request share every block, and a multi-turn episode's next prompt (the
conversation so far) shares every full block of the one before, so the prompts of a 20-turn
episode cost about one copy of the final conversation rather than the sum over turns times
``n`` (each sequence stored its whole prompt before schema 2).

Each block counts the sequences that name it (``refs``): recording adds to the counts of the
blocks a prompt already has (one UPDATE of a few neighbouring rows: a prompt's new blocks
are written together) and writes its new ones; using a sequence (``touch``) does not touch
its blocks; expiring sequences takes theirs off their blocks' counts and deletes the blocks
left at zero. Rows written before schema 2 keep their prompt inline (``prompt_blocks``
NULL) and are read as before.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinker_sr.provenance.validate import SequenceRecord

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64
_HASH_BYTES = 16
_CHAIN_START = b"\0" * _HASH_BYTES  # every hashed input is 16 bytes + a block's tokens
_SQL_VARS = 500  # bound parameters per IN (...) query, well under SQLite's limit

SCHEMA = """
CREATE TABLE IF NOT EXISTS sequences (
    sequence_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    prompt_tokens BLOB NOT NULL,
    sampled_tokens BLOB NOT NULL,
    sampler_logprobs BLOB NOT NULL,
    draws BLOB,
    draws_k INTEGER NOT NULL,
    created_at REAL NOT NULL,
    last_used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sequences_last_used ON sequences(last_used_at);
CREATE TABLE IF NOT EXISTS prompt_blocks (
    block_id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: a block id is its tokens
    block_hash BLOB NOT NULL UNIQUE,
    tokens BLOB NOT NULL,
    refs INTEGER NOT NULL
);
"""

# Added to stores of schema 1 by `Store._add_missing_columns`: the prompt's block ids.
ADDED_COLUMN = ("sequences", "prompt_blocks", "BLOB")

_COLUMNS = (
    "sequence_id, session_id, prompt_tokens, prompt_blocks, sampled_tokens, sampler_logprobs,"
    " draws, draws_k, created_at, last_used_at"
)
_IDS = np.dtype("<i8")  # a sequence's block ids, as its prompt_blocks blob


def prompt_blocks(tokens: np.ndarray) -> list[tuple[bytes, bytes]]:
    """(hash, little-endian int32 bytes) of each 64-token block of ``tokens``, the last one
    possibly shorter. Each hash covers the one before it, so equal hashes mean equal
    prefixes; a block's hash is the same in every prompt that starts the same way."""
    data = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    step, out, prev = BLOCK_TOKENS * 4, [], _CHAIN_START
    for i in range(0, len(data), step):
        chunk = data[i : i + step]
        prev = hashlib.blake2b(prev + chunk, digest_size=_HASH_BYTES).digest()
        out.append((prev, chunk))
    return out


def _i4(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i4").tobytes()


def insert(db: sqlite3.Connection, records: Sequence[SequenceRecord]) -> None:
    """Write ``records`` and their prompts' blocks (the caller holds a transaction). The
    records of one request share one prompt array: its blocks are hashed once, and counted
    once per record."""
    prompts: dict[int, list[tuple[bytes, bytes]]] = {}  # id(prompt array) -> its blocks
    uses: dict[bytes, int] = {}  # block hash -> how many of the records name it
    chunks: dict[bytes, bytes] = {}
    for rec in records:
        pieces = prompts.get(id(rec.prompt_tokens))
        if pieces is None:
            pieces = prompts[id(rec.prompt_tokens)] = prompt_blocks(rec.prompt_tokens)
            chunks.update(pieces)
        for h, _ in pieces:
            uses[h] = uses.get(h, 0) + 1
    sql = "SELECT block_hash, block_id FROM prompt_blocks WHERE block_hash IN ({})"
    ids: dict[bytes, int] = dict(_in_chunks(db, sql, list(uses)))
    db.executemany(
        "UPDATE prompt_blocks SET refs = refs + ? WHERE block_id=?",
        [(uses[h], i) for h, i in ids.items()],
    )
    new = [h for h in uses if h not in ids]  # in prompt order: neighbours on disk
    db.executemany(
        "INSERT INTO prompt_blocks (block_hash, tokens, refs) VALUES (?,?,?)",
        [(h, chunks[h], uses[h]) for h in new],
    )
    ids.update(_in_chunks(db, sql, new))
    rows = []
    for rec in records:
        named = np.array([ids[h] for h, _ in prompts[id(rec.prompt_tokens)]], dtype=_IDS)
        draws = rec.draws
        rows.append(
            (
                rec.sequence_id,
                rec.session_id,
                b"",
                named.tobytes(),
                _i4(rec.sampled_tokens),
                np.ascontiguousarray(rec.sampler_logprobs, dtype="<f4").tobytes(),
                None if draws is None else _i4(draws),
                0 if draws is None else int(draws.shape[1]),
                rec.created_at,
                rec.last_used_at,
            )
        )
    db.executemany(f"INSERT INTO sequences ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)


def fetch(
    db: sqlite3.Connection, sequence_id: str, prompts: dict[bytes, np.ndarray] | None = None
) -> SequenceRecord | None:
    """The stored record of ``sequence_id``; None if there is none (or, never expected, a
    block of its prompt is missing: logged). ``prompts``: prompts already read, by their
    blocks (the samples of one request name the same ones), added to."""
    row = db.execute(f"SELECT {_COLUMNS} FROM sequences WHERE sequence_id=?", (sequence_id,))
    found = row.fetchone()
    if found is None:
        return None
    (sid, sess, inline, named, sampled, lps, draws, k, created, last_used) = found
    prompt = _prompt(db, inline, named, prompts)
    if prompt is None:
        log.warning("recorded sequence %s: a block of its prompt is missing", sid)
        return None
    s = np.frombuffer(sampled, dtype="<i4").astype(np.int32)
    return SequenceRecord(
        sequence_id=sid,
        session_id=sess,
        prompt_tokens=prompt,
        sampled_tokens=s,
        sampler_logprobs=np.frombuffer(lps, dtype="<f4").astype(np.float32),
        draws=None
        if draws is None
        else np.frombuffer(draws, dtype="<i4").astype(np.int32).reshape(len(s), k),
        created_at=created,
        last_used_at=last_used,
    )


def _in_chunks(db: sqlite3.Connection, sql: str, keys: Sequence[object]) -> list[Any]:
    """Rows of ``sql`` (with one ``{}`` for the placeholders) over ``keys``, 500 at a time."""
    rows: list[Any] = []
    for i in range(0, len(keys), _SQL_VARS):
        part = keys[i : i + _SQL_VARS]
        rows += db.execute(sql.format(",".join("?" * len(part))), part).fetchall()
    return rows


def _prompt(
    db: sqlite3.Connection,
    inline: bytes,
    named: bytes | None,
    prompts: dict[bytes, np.ndarray] | None,
) -> np.ndarray | None:
    """A sequence's prompt: inline (schema 1), else from its blocks (None: one is missing)."""
    if named is None:
        return np.frombuffer(inline, dtype="<i4").astype(np.int32)
    prompt = None if prompts is None else prompts.get(named)
    if prompt is None:
        prompt = _read_prompt(db, named)
        if prompt is not None and prompts is not None:
            prompts[named] = prompt
    return prompt


def _read_prompt(db: sqlite3.Connection, named: bytes) -> np.ndarray | None:
    ids = np.frombuffer(named, dtype=_IDS).tolist()
    sql = "SELECT block_id, tokens FROM prompt_blocks WHERE block_id IN ({})"
    tokens = dict(_in_chunks(db, sql, ids))
    if any(i not in tokens for i in ids):
        return None
    return np.frombuffer(b"".join(tokens[i] for i in ids), dtype="<i4").astype(np.int32)


def touch(db: sqlite3.Connection, ids: Sequence[str], now: float) -> None:
    """Set the sequences' ``last_used_at`` to ``now`` (their blocks are not touched)."""
    db.executemany(
        "UPDATE sequences SET last_used_at=? WHERE sequence_id=?", [(now, i) for i in ids]
    )


def purge(db: sqlite3.Connection, older_than: float, now: float) -> int:
    """Delete the sequences last used before ``older_than``, taking them off their blocks'
    counts and deleting the blocks no sequence names any more; rows used "after" ``now``
    (the clock stepped back) count from ``now``. Returns how many sequences went (the
    caller holds a transaction)."""
    db.execute("UPDATE sequences SET last_used_at=? WHERE last_used_at > ?", (now, now))
    gone: dict[int, int] = {}
    expired = db.execute(
        "SELECT prompt_blocks FROM sequences WHERE last_used_at < ? AND prompt_blocks IS NOT NULL",
        (older_than,),
    )
    for (named,) in expired:
        for i in np.frombuffer(named, dtype=_IDS).tolist():
            gone[i] = gone.get(i, 0) + 1
    db.executemany(
        "UPDATE prompt_blocks SET refs = refs - ? WHERE block_id=?",
        [(n, i) for i, n in gone.items()],
    )
    db.executemany("DELETE FROM prompt_blocks WHERE block_id=? AND refs <= 0", [(i,) for i in gone])
    cur = db.execute("DELETE FROM sequences WHERE last_used_at < ?", (older_than,))
    return int(cur.rowcount)
