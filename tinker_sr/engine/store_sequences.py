"""The store's recorded sequences (`engine.store.Store` holds the lock and the cache).

A sequence row keeps what was sampled (tokens, log-probs, draws) and names its prompt by the
hashes of the prompt's 64-token blocks; each block's tokens are stored once, in
``prompt_blocks``. The ``n`` samples of one request share every block, and a multi-turn
episode's next prompt (the conversation so far) shares every full block of the one before,
so the prompts of a 20-turn episode cost about one copy of the final conversation rather than
the sum over turns times ``n`` (174 KB against 5.8 KB of sampled data in the session-63
agentic hunt; each sequence stored its whole prompt before schema 2).

Expiry follows the sequences: a block's ``last_used_at`` is never older than that of any
live sequence naming it (raised on insert and on touch, and clamped with the sequences after
a backward clock step), so deleting the blocks older than the sequences' cut-off deletes only
blocks no remaining sequence names. Rows written before schema 2 keep their prompt inline
(``prompt_blocks`` NULL) and are read as before.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tinker_sr.provenance.validate import SequenceRecord

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
    block_hash BLOB PRIMARY KEY,
    tokens BLOB NOT NULL,
    last_used_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS prompt_blocks_last_used ON prompt_blocks(last_used_at);
"""

# Added to stores of schema 1 by `Store._add_missing_columns`: the prompt's block hashes.
ADDED_COLUMN = ("sequences", "prompt_blocks", "BLOB")

_COLUMNS = (
    "sequence_id, session_id, prompt_tokens, prompt_blocks, sampled_tokens, sampler_logprobs,"
    " draws, draws_k, created_at, last_used_at"
)


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
    records of one request share one prompt array: its blocks are hashed once."""
    hashes_of: dict[int, bytes] = {}
    blocks: dict[bytes, tuple[bytes, float]] = {}
    rows = []
    for rec in records:
        hashes = hashes_of.get(id(rec.prompt_tokens))
        if hashes is None:
            pieces = prompt_blocks(rec.prompt_tokens)
            hashes = hashes_of[id(rec.prompt_tokens)] = b"".join(h for h, _ in pieces)
            for h, chunk in pieces:
                seen = blocks.get(h)
                blocks[h] = (chunk, max(rec.last_used_at, seen[1] if seen else rec.last_used_at))
        else:
            for i in range(0, len(hashes), _HASH_BYTES):
                h = hashes[i : i + _HASH_BYTES]
                blocks[h] = (blocks[h][0], max(blocks[h][1], rec.last_used_at))
        draws = rec.draws
        rows.append(
            (
                rec.sequence_id,
                rec.session_id,
                b"",
                hashes,
                _i4(rec.sampled_tokens),
                np.ascontiguousarray(rec.sampler_logprobs, dtype="<f4").tobytes(),
                None if draws is None else _i4(draws),
                0 if draws is None else int(draws.shape[1]),
                rec.created_at,
                rec.last_used_at,
            )
        )
    db.executemany(
        "INSERT INTO prompt_blocks (block_hash, tokens, last_used_at) VALUES (?,?,?)"
        " ON CONFLICT (block_hash) DO UPDATE"
        " SET last_used_at = max(last_used_at, excluded.last_used_at)",
        [(h, chunk, used) for h, (chunk, used) in blocks.items()],
    )
    db.executemany(f"INSERT INTO sequences ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)


def fetch(db: sqlite3.Connection, sequence_id: str) -> SequenceRecord | None:
    """The stored record of ``sequence_id``; None if there is none (or, never expected, a
    block of its prompt is missing)."""
    row = db.execute(f"SELECT {_COLUMNS} FROM sequences WHERE sequence_id=?", (sequence_id,))
    found = row.fetchone()
    if found is None:
        return None
    (sid, sess, inline, hashes, sampled, lps, draws, k, created, last_used) = found
    prompt = inline if hashes is None else _joined_blocks(db, hashes)
    if prompt is None:
        return None
    s = np.frombuffer(sampled, dtype="<i4").astype(np.int32)
    return SequenceRecord(
        sequence_id=sid,
        session_id=sess,
        prompt_tokens=np.frombuffer(prompt, dtype="<i4").astype(np.int32),
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


def _split(hashes: bytes) -> list[bytes]:
    return [hashes[i : i + _HASH_BYTES] for i in range(0, len(hashes), _HASH_BYTES)]


def _joined_blocks(db: sqlite3.Connection, hashes: bytes) -> bytes | None:
    keys = _split(hashes)
    sql = "SELECT block_hash, tokens FROM prompt_blocks WHERE block_hash IN ({})"
    tokens = dict(_in_chunks(db, sql, list(dict.fromkeys(keys))))
    if any(k not in tokens for k in keys):
        return None
    return b"".join(tokens[k] for k in keys)


def touch(db: sqlite3.Connection, ids: Sequence[str], now: float) -> None:
    """Set the sequences' ``last_used_at`` to ``now``, and raise their prompts' blocks to it
    (the caller holds a transaction)."""
    db.executemany(
        "UPDATE sequences SET last_used_at=? WHERE sequence_id=?", [(now, i) for i in ids]
    )
    sql = (
        "SELECT prompt_blocks FROM sequences"
        " WHERE prompt_blocks IS NOT NULL AND sequence_id IN ({})"
    )
    named = _unique_hashes(r[0] for r in _in_chunks(db, sql, ids))
    db.executemany(
        "UPDATE prompt_blocks SET last_used_at = max(last_used_at, ?) WHERE block_hash=?",
        [(now, h) for h in named],
    )


def _unique_hashes(joined: Iterable[bytes]) -> list[bytes]:
    return list(dict.fromkeys(h for hashes in joined for h in _split(hashes)))


def purge(db: sqlite3.Connection, older_than: float, now: float) -> int:
    """Delete the sequences last used before ``older_than``, and the blocks no remaining
    sequence names; rows used "after" ``now`` (the clock stepped back) count from ``now``.
    Returns how many sequences went (the caller holds a transaction)."""
    for table in ("sequences", "prompt_blocks"):
        db.execute(f"UPDATE {table} SET last_used_at=? WHERE last_used_at > ?", (now, now))
    gone = db.execute("DELETE FROM sequences WHERE last_used_at < ?", (older_than,)).rowcount
    db.execute("DELETE FROM prompt_blocks WHERE last_used_at < ?", (older_than,))
    return int(gone)
