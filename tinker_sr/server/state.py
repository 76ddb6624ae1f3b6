"""The server's own bookkeeping, in SQLite (WAL) at ``<store>/server.sqlite``.

What lives here is what the wire needs and the backend does not know: which API key owns
which session, which session owns which model and sampler, every future (its promise, its
dedupe key and, once done, its encoded result or error), and replies to non-future calls
that must be idempotent. A completed result is committed before anyone can retrieve it, so
an acknowledged result survives a crash; futures still pending at start-up belonged to a
dead process and are failed with a message saying so.

All calls are short and run on the event loop thread (one connection, one lock).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_sr.engine.fork_guard import guard
from tinker_sr.engine.store_files import StoreDamagedError, StoreTooNewError, check_schema
from tinker_sr.user_errors import clip_message

from .store_lock import StoreLock

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    finished TEXT
);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    model_path TEXT,
    created_at REAL
);
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    session_id TEXT,
    kind TEXT NOT NULL,
    dedupe_key TEXT UNIQUE,
    body_hash TEXT,
    promise TEXT NOT NULL,
    status TEXT NOT NULL,
    encoding TEXT,
    result BLOB,
    error TEXT,
    category TEXT,
    created_at REAL NOT NULL,
    done_at REAL
);
CREATE INDEX IF NOT EXISTS futures_done ON futures(done_at);
CREATE INDEX IF NOT EXISTS futures_pending ON futures(status) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS samplers_session ON samplers(session_id);
DROP INDEX IF EXISTS sessions_owner; -- (owner, created_at): unread since sessions_of_owner
CREATE INDEX IF NOT EXISTS sessions_of_owner ON sessions(owner);
CREATE INDEX IF NOT EXISTS models_session ON models(session_id);
CREATE TABLE IF NOT EXISTS replies (
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    reply TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (owner, key)
);
"""

PENDING, COMPLETE, FAILED = "pending", "complete", "failed"

SERVER_SCHEMA = 1
"""server.sqlite's schema version (``PRAGMA user_version``), as `store_files.STORE_SCHEMA` is
the engine store's: raised only for a change an older tinker_sr cannot read, which it then
refuses (`StoreTooNewError`) instead of misreading."""

# Completed futures stay retrievable this long (a poll may be repeated after a network
# error); futures of finished sessions go sooner.
RESULT_TTL_S = 24 * 3600
FINISHED_SESSION_RESULT_TTL_S = 3600


@dataclass(frozen=True)
class FutureRow:
    request_id: str
    owner: str
    session_id: str | None
    kind: str
    body_hash: str | None
    promise: dict[str, Any]
    status: str
    encoding: str | None
    result: bytes | None
    error: str | None
    category: str | None


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    owner: str
    finished: str | None


_LOST_WITH_SERVER_STATE = (
    "the server forgets its futures, sessions and sampling clients (clients made before get a "
    "404 and make new ones); training runs and checkpoints, kept in engine.sqlite, stay"
)


class ServerState:
    def __init__(self, path: Path | None) -> None:
        """``path=None`` keeps everything in memory (a server without a store). A store is
        this server's alone while it runs: `StoreInUseError` if another server holds it
        (`tinker_sr.server.store_lock`)."""
        self._lock = threading.Lock()  # held for every SQLite call, a fork's too (`guard`)
        guard(self._lock)
        self._store_lock = StoreLock(path.parent) if path is not None else None
        with self._lock:
            self._db = sqlite3.connect(
                str(path) if path is not None else ":memory:",
                check_same_thread=False,
                isolation_level=None,  # autocommit; each statement is its own transaction
            )
        try:
            with self._lock:
                self._open_schema(path)
        except StoreTooNewError:
            self.close()
            raise
        except sqlite3.DatabaseError as e:
            self.close()
            if isinstance(e, sqlite3.OperationalError) or path is None:
                raise  # locked, full, unwritable: said as it is
            raise StoreDamagedError(path, e, _LOST_WITH_SERVER_STATE) from e
        # Samplers made by this process have created_at >= _started, older ones less, even
        # if the wall clock was stepped back since they were written (`add_sampler`).
        with self._lock:
            (newest,) = self._db.execute("SELECT MAX(created_at) FROM samplers").fetchone()
        self._started = max(time.time(), (newest or 0.0) + 1e-3)

    def _open_schema(self, path: Path | None) -> None:
        check_schema(self._db, path, stamp=False, current=SERVER_SCHEMA)  # a newer one: as it is
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit survives a process crash (SIGKILL); only an OS crash may lose
        # the last transactions, which is the usual WAL trade-off.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(samplers)")}
        if "created_at" not in columns:  # a store from before the column (its rows: NULL)
            self._db.execute("ALTER TABLE samplers ADD COLUMN created_at REAL")
        check_schema(self._db, path, stamp=True, current=SERVER_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._store_lock is not None:
            self._store_lock.release()

    def _one(self, sql: str, args: tuple[Any, ...]) -> Any:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # ---- start-up -----------------------------------------------------------------------

    def fail_orphans(self) -> int:
        """Fail futures left pending by a previous process; returns how many."""
        # One pass over the pending rows only (the partial index; a store keeps a day of
        # futures, millions on a busy server): dedupe_key cleared so that a resubmission with
        # the same seq_id runs instead of replaying the failure.
        assert PENDING == "pending"  # the literal the partial index `futures_pending` names
        return self._exec(
            "UPDATE futures SET status=?, error=?, category=?, done_at=?, dedupe_key=NULL "
            "WHERE status='pending'",
            (
                FAILED,
                "the server restarted before this request finished, so it was not executed "
                "(or its result was lost); submit it again",
                "server",
                time.time(),
            ),
        )

    def prune(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self._lock:
            # Rows written while the wall clock ran ahead (then stepped back) would outlive
            # their time by the step: they count from now instead.
            self._db.execute("UPDATE futures SET done_at=? WHERE done_at > ?", (now, now))
            self._db.execute("UPDATE replies SET created_at=? WHERE created_at > ?", (now, now))
            self._db.execute(
                "UPDATE sessions SET last_heartbeat=? WHERE last_heartbeat > ?", (now, now)
            )
            cur = self._db.execute(
                "DELETE FROM futures WHERE status != ? AND (done_at < ? OR (done_at < ? AND "
                "session_id IN (SELECT session_id FROM sessions WHERE finished IS NOT NULL)))",
                (PENDING, now - RESULT_TTL_S, now - FINISHED_SESSION_RESULT_TTL_S),
            )
            self._db.execute("DELETE FROM replies WHERE created_at < ?", (now - RESULT_TTL_S,))
            # One row per sampler ever made (one per RL step): those of sessions finished and
            # quiet for as long as results are kept go with them.
            self._db.execute(
                "DELETE FROM samplers WHERE session_id IN (SELECT session_id FROM sessions "
                "WHERE finished IS NOT NULL AND last_heartbeat < ?)",
                (now - RESULT_TTL_S,),
            )
            return cur.rowcount

    # ---- sessions, models, samplers --------------------------------------------------------

    def add_session(self, session_id: str, owner: str) -> None:
        now = time.time()
        self._exec(
            "INSERT OR REPLACE INTO sessions (session_id, owner, created_at, last_heartbeat, "
            "finished) VALUES (?, ?, ?, ?, NULL)",
            (session_id, owner, now, now),
        )

    def session(self, session_id: str) -> SessionRow | None:
        row = self._one(
            "SELECT session_id, owner, finished FROM sessions WHERE session_id=?", (session_id,)
        )
        return SessionRow(*row) if row else None

    def session_ids_of(self, owner: str, *, limit: int, offset: int) -> list[str]:
        """``owner``'s session ids, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id FROM sessions WHERE owner=? "
                "ORDER BY rowid DESC LIMIT ? OFFSET ?",  # creation order, whatever the clock
                (owner, limit, offset),
            ).fetchall()
        return [r[0] for r in rows]

    def sampler_ids_of(self, session_id: str) -> list[str]:
        """The sampling sessions created in ``session_id``, in creation order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT sampler_id FROM samplers WHERE session_id=? ORDER BY rowid", (session_id,)
            ).fetchall()
        return [r[0] for r in rows]

    def heartbeat(self, session_id: str) -> None:
        self._exec(
            "UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id)
        )

    def unfinished_sessions(self) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id FROM sessions WHERE finished IS NULL"
            ).fetchall()
        return [r[0] for r in rows]

    def finish_session(self, session_id: str, status: str) -> bool:
        """First finish wins; returns whether this call finished it."""
        return bool(
            self._exec(
                "UPDATE sessions SET finished=? WHERE session_id=? AND finished IS NULL",
                (status, session_id),
            )
        )

    def add_model(self, model_id: str, session_id: str) -> None:
        self._exec(
            "INSERT OR REPLACE INTO models (model_id, session_id) VALUES (?, ?)",
            (model_id, session_id),
        )

    def model_session(self, model_id: str) -> SessionRow | None:
        return self._session_of("models", "model_id", model_id)

    def model_ids_of(self, owner: str) -> set[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT m.model_id FROM models m JOIN sessions s ON m.session_id = s.session_id "
                "WHERE s.owner=?",
                (owner,),
            ).fetchall()
        return {r[0] for r in rows}

    def add_sampler(self, sampler_id: str, session_id: str, model_path: str | None) -> None:
        self._exec(
            "INSERT OR REPLACE INTO samplers (sampler_id, session_id, model_path, created_at) "
            "VALUES (?, ?, ?, ?)",
            (sampler_id, session_id, model_path, max(time.time(), self._started)),
        )

    def sampler_predates_start(self, sampler_id: str) -> bool:
        """Whether ``sampler_id`` was created before this server process started."""
        row = self._one("SELECT created_at FROM samplers WHERE sampler_id=?", (sampler_id,))
        return row is not None and (row[0] is None or row[0] < self._started)

    def sampler_model_path(self, sampler_id: str) -> str | None:
        row = self._one("SELECT model_path FROM samplers WHERE sampler_id=?", (sampler_id,))
        return row[0] if row else None

    def sampler_session(self, sampler_id: str) -> SessionRow | None:
        return self._session_of("samplers", "sampler_id", sampler_id)

    def _session_of(self, table: str, key: str, value: str) -> SessionRow | None:
        """The session that owns row ``value`` of ``table`` (``models`` / ``samplers``).
        ``table`` and ``key`` are this module's constants, never request data."""
        row = self._one(
            f"SELECT s.session_id, s.owner, s.finished FROM {table} x JOIN sessions s "
            f"ON x.session_id = s.session_id WHERE x.{key}=?",
            (value,),
        )
        return SessionRow(*row) if row else None

    # ---- futures ---------------------------------------------------------------------------

    def find_future(self, dedupe_key: str) -> FutureRow | None:
        return self._future_where("dedupe_key=?", dedupe_key)

    def get_future(self, request_id: str) -> FutureRow | None:
        return self._future_where("request_id=?", request_id)

    def _future_where(self, clause: str, value: str) -> FutureRow | None:
        row = self._one(
            "SELECT request_id, owner, session_id, kind, body_hash, promise, status, encoding, "
            f"result, error, category FROM futures WHERE {clause}",
            (value,),
        )
        if row is None:
            return None
        return FutureRow(*row[:5], json.loads(row[5]), *row[6:])  # type: ignore[call-arg]

    def add_future(
        self,
        request_id: str,
        *,
        owner: str,
        session_id: str | None,
        kind: str,
        dedupe_key: str | None,
        body_hash: str | None,
        promise: dict[str, Any],
    ) -> bool:
        """Insert a pending future; False if ``dedupe_key`` is already taken."""
        try:
            self._exec(
                "INSERT INTO futures (request_id, owner, session_id, kind, dedupe_key, body_hash, "
                "promise, status, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    request_id,
                    owner,
                    session_id,
                    kind,
                    dedupe_key,
                    body_hash,
                    json.dumps(promise),
                    PENDING,
                    time.time(),
                ),
            )
        except sqlite3.IntegrityError:
            return False
        return True

    def complete_future(self, request_id: str, encoding: str, result: bytes) -> None:
        self._exec(
            "UPDATE futures SET status=?, encoding=?, result=?, done_at=? WHERE request_id=?",
            (COMPLETE, encoding, result, time.time(), request_id),
        )

    def fail_future(self, request_id: str, error: str, category: str) -> None:
        self._exec(
            "UPDATE futures SET status=?, error=?, category=?, done_at=? WHERE request_id=?",
            (FAILED, clip_message(error), category, time.time(), request_id),
        )

    # ---- idempotent replies of plain calls ----------------------------------------------------

    def reply(self, owner: str, key: str) -> tuple[str, dict[str, Any]] | None:
        row = self._one(
            "SELECT body_hash, reply FROM replies WHERE owner=? AND key=?", (owner, key)
        )
        return (row[0], json.loads(row[1])) if row else None

    def save_reply(self, owner: str, key: str, body_hash: str, reply: dict[str, Any]) -> None:
        self._exec(
            "INSERT OR REPLACE INTO replies (owner, key, body_hash, reply, created_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (owner, key, body_hash, json.dumps(reply), time.time()),
        )
