"""Durable state of the engine: sessions, training runs, checkpoints, recorded sequences,
usage (`engine.usage`: tokens and checkpoints per session, base model and UTC hour).

One SQLite file (WAL) under the store directory. The embedded backend and the server share
this code, so a server restart finds every acknowledged checkpoint and recorded sequence.
Recorded sequences are stored compactly: int32 token ids and draws, float32 logprobs, as
raw little-endian blobs (about 4 + 4 + 4*K bytes per sampled token), and each prompt block
once however many sequences share it (`engine.store_sequences`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_sr.engine import store_sequences
from tinker_sr.engine.fork_guard import guard
from tinker_sr.engine.store_files import (
    StoreDamagedError,
    StoreTooNewError,
    StoreUnwritableError,
    check_not_emptied,
    check_schema,
    make_store_dir,
    open_read_only,
    unwritable,
)
from tinker_sr.engine.usage import UsageRow, hour_bucket
from tinker_sr.provenance.validate import SequenceRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    user_metadata TEXT,
    project_id TEXT,
    display_name TEXT,
    status TEXT,
    closed_at REAL
);
CREATE TABLE IF NOT EXISTS training_runs (
    run_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_rank INTEGER,
    lora_config TEXT NOT NULL,
    user_metadata TEXT,
    created_at REAL NOT NULL,
    last_request_time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    checkpoint_type TEXT NOT NULL,
    tinker_path TEXT NOT NULL UNIQUE,
    file_path TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_bytes INTEGER,
    user_metadata TEXT,
    expires_at REAL,
    public INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, checkpoint_id)
);
CREATE INDEX IF NOT EXISTS training_runs_session ON training_runs(session_id);
CREATE TABLE IF NOT EXISTS usage (
    bucket_start INTEGER NOT NULL,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    kind TEXT NOT NULL,
    quantity INTEGER NOT NULL,
    PRIMARY KEY (bucket_start, session_id, base_model, kind)
);
"""

# Columns added after the first release: (table, column, definition). Stores created before
# a column existed get it through ``ALTER TABLE ... ADD COLUMN`` when they are opened.
_ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("checkpoints", "public", "INTEGER NOT NULL DEFAULT 0"),
    ("sessions", "tags", "TEXT"),
    store_sequences.ADDED_COLUMN,
)

# INSERTs and SELECTs name their columns: a column a later version adds leaves this one working
# (older versions' positional INSERTs failed "... has 10 columns but 9 values were supplied").
_RUN_COLUMNS = (
    "run_id, session_id, base_model, lora_rank, lora_config, user_metadata, created_at,"
    " last_request_time"
)
_CK_COLUMNS = (
    "run_id, checkpoint_id, checkpoint_type, tinker_path, file_path, created_at, size_bytes,"
    " user_metadata, expires_at, public"
)


@dataclass(frozen=True)
class RunRow:
    run_id: str
    session_id: str
    base_model: str
    lora_rank: int | None
    lora_config: dict[str, Any]
    user_metadata: dict[str, str] | None
    created_at: float
    last_request_time: float


@dataclass(frozen=True)
class SessionInfo:
    user_metadata: dict[str, str] | None
    display_name: str | None
    run_ids: list[str]


@dataclass(frozen=True)
class CheckpointRow:
    run_id: str
    checkpoint_id: str  # "<segment>/<name>", e.g. "weights/step-3"
    checkpoint_type: str  # "training" | "sampler" | "external"
    tinker_path: str
    file_path: str
    created_at: float
    size_bytes: int | None
    user_metadata: dict[str, str] | None
    expires_at: float | None
    public: bool = False


def _among(runs: Collection[str] | None) -> tuple[str, list[object]]:
    """A WHERE condition keeping the rows of these training runs (every row for None), and its
    arguments: one JSON list, so any number of runs is one bound parameter."""
    if runs is None:
        return "1", []
    return "run_id IN (SELECT value FROM json_each(?))", [json.dumps(sorted(runs))]


def _json(v: Any) -> str | None:
    return None if v is None else json.dumps(v, sort_keys=True)


def _unjson(s: str | None) -> Any:
    return None if s is None else json.loads(s)


def default_store_dir() -> Path:
    """``$TINKER_SR_STORE`` (a leading ``~`` expanded, as a shell would: it is often quoted in
    .env files and unit files) or ``~/.cache/tinker_sr`` (here, not in `backend.local`, so
    that a reader of the store such as ``tinker-sr usage`` does not import torch)."""
    env = os.environ.get("TINKER_SR_STORE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinker_sr"


class Store:
    """Thread-safe SQLite store. ``path=None`` keeps everything in memory."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        cache_size: int = 4096,
        read_only: bool = False,
        stamp: bool = True,
    ) -> None:
        """``read_only``: for a reader (``tinker-sr usage``, ``export``): the store as it is,
        also on a read-only file system or another user's store; nothing is created, the
        schema is not brought up to date, and every write fails. ``stamp=False``: missing
        tables and columns are added, but an older store's schema version is left as it is
        (a reader beside an older server, which would refuse its own store on restart)."""
        self._stamp = stamp
        self.path = None if path is None else Path(path)
        if self.path is not None:
            check_not_emptied(self.path)
        self._lock = threading.RLock()  # held for every SQLite call, a fork's too (`guard`)
        guard(self._lock)
        self._seq_cache: OrderedDict[str, SequenceRecord] = OrderedDict()
        self._cache_size = cache_size
        # Prompts read from the file, by their last block: a request's samples share one.
        self._prompts: OrderedDict[int, Any] = OrderedDict()
        with self._lock:
            self._open(read_only)

    def _open(self, read_only: bool) -> None:
        if read_only and self.path is not None:
            self._db = open_read_only(self.path)
            try:
                check_schema(self._db, self.path, stamp=False)
            except StoreTooNewError:
                self._db.close()
                raise
            return
        if self.path is not None:
            make_store_dir(self.path.parent)
        try:
            self._db = sqlite3.connect(
                ":memory:" if self.path is None else str(self.path),
                check_same_thread=False,
                isolation_level=None,  # autocommit; explicit transactions where needed
            )
        except sqlite3.OperationalError as e:
            if self.path is None or not unwritable(e):
                raise
            raise StoreUnwritableError(self.path.parent, e) from None
        try:
            check_schema(self._db, self.path, stamp=False)  # a newer one: left as it is
            if self.path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA + store_sequences.SCHEMA)
            self._add_missing_columns()
            if self._stamp and store_sequences.has_drafts(self._db):  # (a reader: left)
                with self._transaction("BEGIN IMMEDIATE"):
                    store_sequences.migrate_drafts(self._db)
            check_schema(self._db, self.path, stamp=self._stamp)
        except (sqlite3.DatabaseError, StoreTooNewError) as e:
            self._db.close()
            if isinstance(e, StoreTooNewError):
                raise
            if isinstance(e, sqlite3.OperationalError) and self.path is not None and unwritable(e):
                raise StoreUnwritableError(self.path.parent, e) from None
            if isinstance(e, sqlite3.OperationalError) or self.path is None:
                raise  # locked, ...: said as it is
            raise StoreDamagedError(self.path, e) from e

    @classmethod
    def for_reading(cls, path: Path) -> Store:
        """The store at ``path`` for a reader (``tinker-sr usage``, ``export``): opened as a
        writer would, so an older store gets today's tables and columns (its schema version
        left as it is: an older server may be running on it, and would refuse it on its next
        start), or read-only where it cannot be written (a read-only file system, another
        user's store)."""
        try:
            return cls(path, stamp=False)
        except StoreUnwritableError:
            return cls(path, read_only=True)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _add_missing_columns(self) -> None:
        """Bring a store written by an older version up to the current schema."""
        for table, column, definition in _ADDED_COLUMNS:
            if column in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                continue
            try:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
            except sqlite3.OperationalError as e:  # another process may have added it just now
                if "duplicate column" not in str(e).lower():
                    raise

    # ---- sessions ---------------------------------------------------------------------
    def add_session(
        self,
        session_id: str,
        *,
        user_metadata: dict[str, str] | None,
        project_id: str | None,
        display_name: str | None,
        tags: list[str] | None = None,
    ) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO sessions(session_id, created_at, user_metadata, project_id,"
                " display_name, tags) VALUES (?,?,?,?,?,?)",
                (
                    session_id,
                    time.time(),
                    _json(user_metadata),
                    project_id,
                    display_name,
                    json.dumps(tags or []),
                ),
            )

    def session_tags(self, session_id: str) -> list[str] | None:
        """The tags a session was created with (None: no such session)."""
        with self._lock:
            row = self._db.execute(
                "SELECT tags FROM sessions WHERE session_id=?", (session_id,)
            ).fetchone()
        return None if row is None else list(json.loads(row[0] or "[]"))

    def session_exists(self, session_id: str) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM sessions WHERE session_id=?", (session_id,)
            ).fetchone()
        return row is not None

    def list_sessions(self, *, limit: int, offset: int) -> list[str]:
        """Session ids, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id FROM sessions ORDER BY rowid DESC LIMIT ? OFFSET ?",
                (limit, offset),
            ).fetchall()
        return [r[0] for r in rows]

    def session_info(self, session_id: str) -> SessionInfo | None:
        """A session's metadata and training runs (oldest first); None: no such session."""
        with self._lock:
            row = self._db.execute(
                "SELECT user_metadata, display_name FROM sessions WHERE session_id=?",
                (session_id,),
            ).fetchone()
            runs = self._db.execute(
                "SELECT run_id FROM training_runs WHERE session_id=? ORDER BY rowid",
                (session_id,),
            ).fetchall()
        if row is None:
            return None
        return SessionInfo(_unjson(row[0]), row[1], [r[0] for r in runs])

    def close_session(self, session_id: str, status: str) -> None:
        with self._lock:
            # First reason wins, as Tinker's ServiceClient.close documents.
            self._db.execute(
                "UPDATE sessions SET status=?, closed_at=? WHERE session_id=? AND status IS NULL",
                (status, time.time(), session_id),
            )

    def run_session_end(self, run_id: str) -> tuple[str, str] | None:
        """``(session_id, status)`` when training run ``run_id``'s session was closed."""
        with self._lock:
            row = self._db.execute(
                "SELECT s.session_id, s.status FROM training_runs r JOIN sessions s"
                " ON s.session_id = r.session_id WHERE r.run_id=? AND s.status IS NOT NULL",
                (run_id,),
            ).fetchone()
        return None if row is None else (row[0], row[1])

    # ---- training runs ----------------------------------------------------------------
    def add_run(
        self,
        run_id: str,
        session_id: str,
        base_model: str,
        lora_config: dict[str, Any],
        user_metadata: dict[str, str] | None,
    ) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO training_runs ({_RUN_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
                (
                    run_id,
                    session_id,
                    base_model,
                    lora_config.get("rank"),
                    _json(lora_config),
                    _json(user_metadata),
                    now,
                    now,
                ),
            )

    def touch_run(self, run_id: str) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE training_runs SET last_request_time=? WHERE run_id=?", (time.time(), run_id)
            )

    def get_run(self, run_id: str) -> RunRow | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_RUN_COLUMNS} FROM training_runs WHERE run_id=?", (run_id,)
            ).fetchone()
        return None if row is None else self._run_row(row)

    def list_runs(
        self, *, limit: int, offset: int, runs: Collection[str] | None = None
    ) -> tuple[list[RunRow], int]:
        """Training runs (only ``runs`` when given), newest first (the official CLI's
        `tinker run list` shows the first 20: the recent ones)."""
        among, args = _among(runs)
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_RUN_COLUMNS} FROM training_runs WHERE {among} "
                "ORDER BY rowid DESC LIMIT ? OFFSET ?",
                (*args, limit, offset),
            ).fetchall()
            (total,) = self._db.execute(
                f"SELECT COUNT(*) FROM training_runs WHERE {among}", args
            ).fetchone()
        return [self._run_row(r) for r in rows], int(total)

    @staticmethod
    def _run_row(r: tuple[Any, ...]) -> RunRow:
        return RunRow(r[0], r[1], r[2], r[3], _unjson(r[4]), _unjson(r[5]), r[6], r[7])

    # ---- checkpoints ------------------------------------------------------------------
    def put_checkpoint(self, row: CheckpointRow) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO checkpoints ({_CK_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    row.run_id,
                    row.checkpoint_id,
                    row.checkpoint_type,
                    row.tinker_path,
                    row.file_path,
                    row.created_at,
                    row.size_bytes,
                    _json(row.user_metadata),
                    row.expires_at,
                    int(row.public),
                ),
            )

    def get_checkpoint(self, tinker_path: str, *, now: float | None = None) -> CheckpointRow | None:
        """The live checkpoint at ``tinker_path``; expired ones count as missing."""
        with self._lock:
            row = self._ck_by_path(tinker_path)
        if row is None:
            return None
        ck = self._ck_row(row)
        if ck.expires_at is not None and ck.expires_at <= (now or time.time()):
            return None
        return ck

    def list_checkpoints(
        self,
        run_id: str | None = None,
        *,
        limit: int = 1000,
        offset: int = 0,
        newest_first: bool = False,
        runs: Collection[str] | None = None,
    ) -> tuple[list[CheckpointRow], int]:
        """Live checkpoints (of ``run_id``, or of ``runs``, or all), oldest first unless
        ``newest_first`` (the SDK's `list_user_checkpoints` order)."""
        # Insertion order (a save again is a new row), whatever the wall clock did (hunt).
        order = "rowid DESC" if newest_first else "rowid"
        among, args = _among(runs)
        where = f"WHERE {among} AND (expires_at IS NULL OR expires_at > ?)"
        args = [*args, time.time()]
        if run_id is not None:
            where, args = f"{where} AND run_id=?", [*args, run_id]
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_CK_COLUMNS} FROM checkpoints {where} ORDER BY {order} LIMIT ? OFFSET ?",
                (*args, limit, offset),
            ).fetchall()
            (total,) = self._db.execute(
                f"SELECT COUNT(*) FROM checkpoints {where}", args
            ).fetchone()
        return [self._ck_row(r) for r in rows], int(total)

    def delete_checkpoint(self, tinker_path: str) -> CheckpointRow | None:
        with self._lock:
            row = self._ck_by_path(tinker_path)
            if row is None:
                return None
            self._db.execute("DELETE FROM checkpoints WHERE tinker_path=?", (tinker_path,))
        return self._ck_row(row)

    def _ck_by_path(self, tinker_path: str) -> tuple[Any, ...] | None:
        """The raw checkpoint row at ``tinker_path`` (the caller holds the lock)."""
        row: tuple[Any, ...] | None = self._db.execute(
            f"SELECT {_CK_COLUMNS} FROM checkpoints WHERE tinker_path=?", (tinker_path,)
        ).fetchone()
        return row

    def take_expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        """Delete the rows of checkpoints whose TTL ran out by ``now``, in one transaction (no
        row saved meanwhile is taken, by this process or another on the same store); returns
        them. Their files are the caller's to remove (`checkpoint_file_in_use` first)."""
        expired = "expires_at IS NOT NULL AND expires_at <= ?"
        # No DELETE ... RETURNING: SQLite before 3.35 lacks it.
        with self._lock, self._transaction("BEGIN IMMEDIATE"):
            rows = self._db.execute(
                f"SELECT {_CK_COLUMNS} FROM checkpoints WHERE {expired}", (now,)
            ).fetchall()
            self._db.execute(f"DELETE FROM checkpoints WHERE {expired}", (now,))
        return [self._ck_row(r) for r in rows]

    def rebase_checkpoint_files(self, relative: Callable[[str], str]) -> int:
        """Rewrite each checkpoint row's file path as ``relative`` gives it (from the store's
        root); returns how many changed."""
        with self._lock, self._transaction("BEGIN IMMEDIATE"):
            rows = self._db.execute("SELECT tinker_path, file_path FROM checkpoints").fetchall()
            changed = [(relative(f), t) for t, f in rows if relative(f) != f]
            self._db.executemany("UPDATE checkpoints SET file_path=? WHERE tinker_path=?", changed)
        return len(changed)

    def checkpoint_file_in_use(self, file_path: str) -> bool:
        """Whether a checkpoint row (live or not) names ``file_path``: a save that reused an
        expired checkpoint's name after it was taken."""
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM checkpoints WHERE file_path=? LIMIT 1", (file_path,)
            ).fetchone()
        return row is not None

    def set_checkpoint_expiry(self, tinker_path: str, expires_at: float | None) -> bool:
        with self._lock:
            cur = self._db.execute(
                "UPDATE checkpoints SET expires_at=? WHERE tinker_path=?", (expires_at, tinker_path)
            )
        return cur.rowcount > 0

    def set_checkpoint_public(self, tinker_path: str, public: bool) -> bool:
        """Mark a checkpoint public or private; returns whether it exists."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE checkpoints SET public=? WHERE tinker_path=?", (int(public), tinker_path)
            )
        return cur.rowcount > 0

    @staticmethod
    def _ck_row(r: tuple[Any, ...]) -> CheckpointRow:
        return CheckpointRow(
            r[0], r[1], r[2], r[3], r[4], r[5], r[6], _unjson(r[7]), r[8], bool(r[9])
        )

    # ---- recorded sequences -----------------------------------------------------------
    def put_sequences(self, records: list[SequenceRecord]) -> None:
        with self._lock:  # IMMEDIATE: it reads its blocks before writing (another process
            with self._transaction("BEGIN IMMEDIATE"):  # committing between: "locked" at once)
                store_sequences.insert(self._db, records)
            for rec in records:
                self._cache_put(rec)

    def get(self, sequence_id: str) -> SequenceRecord | None:
        """`SequenceLookup` for the provenance validator (ownership is checked there)."""
        with self._lock:
            rec = self._seq_cache.get(sequence_id)
            if rec is not None:
                self._seq_cache.move_to_end(sequence_id)
                return rec
            rec = store_sequences.fetch(self._db, sequence_id, self._prompts)
            while len(self._prompts) > 64:
                self._prompts.popitem(last=False)
            if rec is not None:
                self._cache_put(rec)
            return rec

    def touch_sequences(self, sequence_ids: set[str] | frozenset[str], now: float) -> None:
        """Restart the 24 h expiry window of sequences used by a successful training request."""
        if not sequence_ids:
            return
        ids = sorted(sequence_ids)
        with self._lock:
            with self._transaction():
                store_sequences.touch(self._db, ids, now)
            for i in ids:
                rec = self._seq_cache.get(i)
                if rec is not None:
                    self._seq_cache[i] = _replace_last_used(rec, now)

    def purge_expired_sequences(self, older_than: float) -> int:
        now = time.time()
        with self._lock:  # used while the wall clock ran ahead (then stepped back): from now
            with self._transaction():
                gone = store_sequences.purge(self._db, older_than, now)
            self._prompts.clear()
            for k, r in list(self._seq_cache.items()):
                if r.last_used_at < older_than:
                    del self._seq_cache[k]
                elif r.last_used_at > now:
                    self._seq_cache[k] = _replace_last_used(r, now)
        return gone

    # ---- usage (engine.usage) ----------------------------------------------------------
    def add_usage(
        self, session_id: str, base_model: str, counts: dict[str, int], now: float | None = None
    ) -> None:
        """Add ``counts`` (kind -> quantity) to the session's bucket of the current UTC hour."""
        bucket = hour_bucket(time.time() if now is None else now)
        rows = [(bucket, session_id, base_model, k, int(n)) for k, n in counts.items() if n > 0]
        if not rows:
            return
        with self._lock, self._transaction():
            self._db.executemany(
                "INSERT INTO usage (bucket_start, session_id, base_model, kind, quantity)"
                " VALUES (?,?,?,?,?) ON CONFLICT"
                " (bucket_start, session_id, base_model, kind)"
                " DO UPDATE SET quantity = quantity + excluded.quantity",
                rows,
            )

    def usage_rows(self, start: int, end: int) -> list[UsageRow]:
        """Every bucket starting in ``[start, end)`` (epoch seconds)."""
        rows = self._usage_query(
            "SELECT bucket_start, session_id, base_model, kind, quantity FROM usage"
            " WHERE bucket_start >= ? AND bucket_start < ?",
            (start, end),
        )
        return [UsageRow(*r) for r in rows]

    def newest_usage_bucket(self) -> int | None:
        """The start of the newest hour any usage was recorded in (None: none recorded)."""
        ((newest,),) = self._usage_query("SELECT MAX(bucket_start) FROM usage", ()) or [(None,)]
        return newest

    def _usage_query(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """Nothing from a store of before usage, opened read-only (its schema not updated)."""
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.OperationalError as e:
                if "no such table: usage" not in str(e):
                    raise
                return []

    def session_attributes(
        self, session_ids: set[str]
    ) -> dict[str, tuple[dict[str, str] | None, str | None]]:
        """session id -> (user_metadata, project_id), for the ids that exist. One query per
        500 ids (one per id held the store for seconds at 100,000 sessions, churn hunt)."""
        ids, rows = sorted(session_ids), []
        with self._lock:
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                rows += self._db.execute(
                    "SELECT session_id, user_metadata, project_id FROM sessions WHERE session_id"
                    f" IN ({','.join('?' * len(chunk))})",
                    chunk,
                ).fetchall()
        return {r[0]: (_unjson(r[1]), r[2]) for r in rows}

    def live_checkpoint_sizes(self, now: float) -> list[tuple[str | None, str | None, int]]:
        """(session_id, project_id, size_bytes) of every checkpoint not yet expired."""
        with self._lock:
            rows = self._db.execute(
                "SELECT r.session_id, s.project_id, c.size_bytes FROM checkpoints c"
                " LEFT JOIN training_runs r ON r.run_id = c.run_id"
                " LEFT JOIN sessions s ON s.session_id = r.session_id"
                " WHERE c.expires_at IS NULL OR c.expires_at > ?",
                (now,),
            ).fetchall()
        return [(r[0], r[1], int(r[2] or 0)) for r in rows]

    @contextlib.contextmanager
    def _transaction(self, begin: str = "BEGIN") -> Iterator[None]:
        """One transaction (the caller holds the lock): committed, or rolled back on error."""
        self._db.execute(begin)
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _cache_put(self, rec: SequenceRecord) -> None:
        self._seq_cache[rec.sequence_id] = rec
        self._seq_cache.move_to_end(rec.sequence_id)
        while len(self._seq_cache) > self._cache_size:
            self._seq_cache.popitem(last=False)


def _replace_last_used(rec: SequenceRecord, now: float) -> SequenceRecord:
    from dataclasses import replace

    return replace(rec, last_used_at=now)
