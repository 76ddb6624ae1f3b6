"""The store's recorded sequences (`engine.store.Store` holds the lock and the cache).

A sequence row keeps what was sampled (tokens, log-probs, draws) and names its prompt by the
row id of the prompt's last 64-token block; each block names the block before it (its
``parent``) and is stored once, in ``prompt_chain``, found by a hash that covers the block
and every block before it. The ``n`` samples of one request share every block, and a
multi-turn episode's next prompt (the conversation so far) shares every full block of the one
before, so the prompts of a 20-turn episode cost about one copy of the final conversation
and 8 bytes per sequence, rather than the sum over turns times ``n`` (each sequence stored
its whole prompt before schema 2).

Each block counts what names it (``refs``: the sequences that end on it and the blocks whose
parent it is). Recording writes a prompt's new blocks and adds to two counts at most (the
last block's, the first new block's parent's); using a sequence (``touch``) writes no block;
expiring sequences takes them off their last blocks' counts, and a block left at zero goes,
taking itself off its parent's. Rows written before schema 2, and the prompts of the two
draft layouts of schema 2, are kept inline (``prompt_tokens``; `migrate_drafts`).
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from collections import Counter
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
CREATE TABLE IF NOT EXISTS prompt_chain (
    block_id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: a block id is its tokens
    parent INTEGER,  -- the block before it; NULL for a prompt's first
    block_hash BLOB NOT NULL UNIQUE,
    tokens BLOB NOT NULL,
    refs INTEGER NOT NULL
);
"""

# Added to stores of schema 1 by `Store._add_missing_columns`: the prompt's last block.
ADDED_COLUMN = ("sequences", "prompt_end", "INTEGER")

_COLUMNS = (
    "sequence_id, session_id, prompt_tokens, prompt_end, sampled_tokens, sampler_logprobs,"
    " draws, draws_k, created_at, last_used_at"
)
_CHAIN = """
WITH RECURSIVE up(block_id, parent, tokens, depth) AS (
    SELECT block_id, parent, tokens, 0 FROM prompt_chain WHERE block_id = ?
    UNION ALL
    SELECT b.block_id, b.parent, b.tokens, up.depth + 1
    FROM prompt_chain b JOIN up ON b.block_id = up.parent
)
SELECT parent, tokens FROM up ORDER BY depth DESC
"""


def prompt_blocks(tokens: np.ndarray) -> list[tuple[bytes, bytes]]:
    """(hash, little-endian int32 bytes) of each 64-token block of ``tokens``, the last one
    possibly shorter. Each hash covers the one before it, so equal hashes mean equal
    prefixes; a block's hash is the same in every prompt that starts the same way."""
    data = _i4(tokens)
    step, out, prev = BLOCK_TOKENS * 4, [], _CHAIN_START
    for i in range(0, len(data), step):
        chunk = data[i : i + step]
        prev = hashlib.blake2b(prev + chunk, digest_size=_HASH_BYTES).digest()
        out.append((prev, chunk))
    return out


def _i4(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i4").tobytes()


def _ints(raw: bytes) -> np.ndarray:
    """Stored little-endian int32 bytes as an int32 array of its own."""
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def insert(db: sqlite3.Connection, records: Sequence[SequenceRecord]) -> None:
    """Write ``records`` and their prompts' new blocks (the caller holds a transaction). The
    records of one request share one prompt array: its blocks are hashed once."""
    ends: dict[int, int | None] = {}  # id(prompt array) -> its last block's id
    counts: Counter[int] = Counter()  # block id -> what to add to its refs
    for rec in records:
        key = id(rec.prompt_tokens)
        if key not in ends:
            ends[key] = _chain(db, prompt_blocks(rec.prompt_tokens), counts)
        end = ends[key]
        if end is not None:
            counts[end] += 1
    db.executemany(
        "UPDATE prompt_chain SET refs = refs + ? WHERE block_id=?",
        [(n, i) for i, n in counts.items()],
    )
    rows = []
    for rec in records:
        draws = rec.draws
        rows.append(
            (
                rec.sequence_id,
                rec.session_id,
                b"",
                ends[id(rec.prompt_tokens)],
                _i4(rec.sampled_tokens),
                np.ascontiguousarray(rec.sampler_logprobs, dtype="<f4").tobytes(),
                None if draws is None else _i4(draws),
                0 if draws is None else int(draws.shape[1]),
                rec.created_at,
                rec.last_used_at,
            )
        )
    db.executemany(f"INSERT INTO sequences ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)


def _chain(
    db: sqlite3.Connection, pieces: list[tuple[bytes, bytes]], counts: Counter[int]
) -> int | None:
    """The id of the last of a prompt's blocks (None: an empty prompt), writing those not
    stored yet; each new block's parent gets one more use in ``counts``. Stored blocks are a
    prefix of the chain: a block with a child is never deleted."""
    sql = "SELECT block_hash, block_id FROM prompt_chain WHERE block_hash IN ({})"
    stored = dict(_in_chunks(db, sql, [h for h, _ in pieces]))
    parent: int | None = None
    for h, chunk in pieces:
        found = stored.get(h)
        if found is None:
            cur = db.execute(
                "INSERT INTO prompt_chain (parent, block_hash, tokens, refs) VALUES (?,?,?,0)",
                (parent, h, chunk),
            )
            found = int(cur.lastrowid or 0)
            if parent is not None:
                counts[parent] += 1
        parent = found
    return parent


def fetch(
    db: sqlite3.Connection, sequence_id: str, prompts: dict[int, np.ndarray] | None = None
) -> SequenceRecord | None:
    """The stored record of ``sequence_id``; None if there is none (or, never expected, a
    block of its prompt is missing: logged). ``prompts``: prompts already read, by their
    last block (the samples of one request end on the same one), added to."""
    row = db.execute(f"SELECT {_COLUMNS} FROM sequences WHERE sequence_id=?", (sequence_id,))
    found = row.fetchone()
    if found is None:
        return None
    (sid, sess, inline, end, sampled, lps, draws, k, created, last_used) = found
    prompt = _prompt(db, inline, end, prompts)
    if prompt is None:
        log.warning("recorded sequence %s: a block of its prompt is missing", sid)
        return None
    s = _ints(sampled)
    return SequenceRecord(
        sequence_id=sid,
        session_id=sess,
        prompt_tokens=prompt,
        sampled_tokens=s,
        sampler_logprobs=np.frombuffer(lps, dtype="<f4").astype(np.float32),
        draws=None if draws is None else _ints(draws).reshape(len(s), k),
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
    db: sqlite3.Connection, inline: bytes, end: int | None, prompts: dict[int, np.ndarray] | None
) -> np.ndarray | None:
    """A sequence's prompt: inline, else its chain of blocks (None: one is missing)."""
    if end is None:
        return _ints(inline)
    prompt = None if prompts is None else prompts.get(end)
    if prompt is None:
        chain = db.execute(_CHAIN, (end,)).fetchall()
        if not chain or chain[0][0] is not None:  # the walk stopped short of the first block
            return None
        prompt = _ints(b"".join(t for _, t in chain))
        prompt.setflags(write=False)  # one array for every record ending on this block
        if prompts is not None:
            prompts[end] = prompt
    return prompt


def touch(db: sqlite3.Connection, ids: Sequence[str], now: float) -> None:
    """Set the sequences' ``last_used_at`` to ``now`` (their blocks are not touched)."""
    db.executemany(
        "UPDATE sequences SET last_used_at=? WHERE sequence_id=?", [(now, i) for i in ids]
    )


def purge(db: sqlite3.Connection, older_than: float, now: float) -> int:
    """Delete the sequences last used before ``older_than`` and the blocks nothing names any
    more; rows used "after" ``now`` (the clock stepped back) count from ``now``. Returns how
    many sequences went (the caller holds a transaction)."""
    db.execute("UPDATE sequences SET last_used_at=? WHERE last_used_at > ?", (now, now))
    expired = db.execute(
        "SELECT prompt_end FROM sequences WHERE last_used_at < ? AND prompt_end IS NOT NULL",
        (older_than,),
    )
    counts = Counter(end for (end,) in expired)
    gone = db.execute("DELETE FROM sequences WHERE last_used_at < ?", (older_than,)).rowcount
    while counts:  # each round: one block further up the chains that lost their last use
        db.executemany(
            "UPDATE prompt_chain SET refs = refs - ? WHERE block_id=?",
            [(n, i) for i, n in counts.items()],
        )
        sql = "SELECT block_id, parent FROM prompt_chain WHERE refs <= 0 AND block_id IN ({})"
        dead = _in_chunks(db, sql, list(counts))
        db.executemany("DELETE FROM prompt_chain WHERE block_id=?", [(i,) for i, _ in dead])
        counts = Counter(parent for _, parent in dead if parent is not None)
    return int(gone)


def has_drafts(db: sqlite3.Connection) -> bool:
    """Whether the store has the ``prompt_blocks`` table of a draft of schema 2."""
    found = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='prompt_blocks'")
    return found.fetchone() is not None


def migrate_drafts(db: sqlite3.Connection) -> None:
    """Keep inline the prompts of sequences recorded in either draft layout of schema 2
    (``prompt_blocks``: block hashes with a use time, or block ids with counts), and drop
    that table (the caller holds a transaction)."""
    if not has_drafts(db):  # (another process has just done it)
        return
    columns = {r[1] for r in db.execute("PRAGMA table_info(prompt_blocks)")}
    key, width = ("block_hash", 16) if "last_used_at" in columns else ("block_id", 8)
    rows = db.execute(
        "SELECT sequence_id, prompt_blocks FROM sequences WHERE prompt_blocks IS NOT NULL"
    ).fetchall()
    for sid, named in rows:
        keys: list[Any] = [named[i : i + width] for i in range(0, len(named), width)]
        if width == 8:
            keys = [int.from_bytes(k, "little") for k in keys]
        sql = f"SELECT {key}, tokens FROM prompt_blocks WHERE {key} IN ({{}})"
        tokens = dict(_in_chunks(db, sql, keys))
        if all(k in tokens for k in keys):
            joined = b"".join(tokens[k] for k in keys)
            db.execute(
                "UPDATE sequences SET prompt_tokens=?, prompt_blocks=NULL WHERE sequence_id=?",
                (joined, sid),
            )
        else:  # (never expected) unreadable: the sequence is gone, as an expired one
            db.execute("DELETE FROM sequences WHERE sequence_id=?", (sid,))
    db.execute("DROP TABLE prompt_blocks")
