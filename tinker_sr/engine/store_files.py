"""The store's files and what goes wrong with them: a state directory that cannot be
written, a database that is damaged or was emptied, a full disk. Torch-free, shared by the
engine's store (`engine.store`, which still exports the two errors and `make_store_dir`), the
server's state and the command line."""

from __future__ import annotations

import errno
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("tinker_sr")


class StoreDamagedError(RuntimeError):
    """The store's database file does not open as a database (damaged, or not tinker_sr's)."""

    def __init__(self, path: Path, cause: Exception, lost: str | None = None) -> None:
        """``lost``: what moving the file aside gives up (default: the engine's records)."""
        self.path = path
        if lost is None:
            lost = (
                f"the checkpoint files under {path.parent / 'checkpoints'} stay on disk but are "
                "no longer listed"
            )
        super().__init__(
            f"{path}: not a readable tinker_sr store ({cause}); the file is damaged, or is not "
            f"tinker_sr's. Restore it from a backup, or move it aside (mv {path} "
            f"{path}.damaged) to start with an empty one: {lost}"
        )


STORE_SCHEMA = 3
"""The store's schema version (``PRAGMA user_version``): raised only for a change an older
tinker_sr cannot read (new columns and tables are added in place: rows are read and written
by column name, so this version reads a store a later one added columns to). 2: a recorded
sequence names its prompt's blocks (`engine.store_sequences`), which a version reading schema
1 would take for an empty prompt; 3: the blocks as a chain (the prompts of 2's two draft
layouts, on main for an hour, are kept inline when a writer opens the store)."""


class StoreTooNewError(StoreDamagedError):
    """The store was written by a newer tinker_sr (a higher schema version than this reads)."""

    def __init__(self, path: Path, version: int, readable: int | None = None) -> None:
        self.path = path
        RuntimeError.__init__(
            self,
            f"{path}: written by a newer tinker_sr (store schema {version}; this version reads "
            f"up to {readable or STORE_SCHEMA}); upgrade tinker_sr (pip install -U tinker-sr), "
            "or give this one a store of its own (--store DIR or $TINKER_SR_STORE)",
        )


def check_schema(
    db: sqlite3.Connection, path: Path | None, *, stamp: bool, current: int = STORE_SCHEMA
) -> None:
    """`StoreTooNewError` if ``db`` is of a later schema than ``current`` (the engine's store's
    by default); ``stamp``: record ``current``."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > current:
        raise StoreTooNewError(path or Path(":memory:"), version, current)
    if stamp and version < current:
        db.execute(f"PRAGMA user_version = {int(current)}")


class StoreUnwritableError(RuntimeError):
    """The state directory cannot be created or written (read-only, permissions)."""

    def __init__(self, store: Path, cause: BaseException) -> None:
        self.store = store
        super().__init__(
            f"store {store} cannot be written ({cause}); give tinker-sr a writable state "
            "directory with --store DIR (or $TINKER_SR_STORE), or fix its permissions"
        )


def make_store_dir(store: Path) -> None:
    """Create the state directory ``store`` (parents too); `StoreUnwritableError` if it
    cannot be (read-only file system, permissions, a file in its place)."""
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreUnwritableError(store, e) from None


OUT_OF_SPACE = (
    "out of disk space: the file system holding the store is full (or a file-size limit, "
    "ulimit -f, was reached); free space there (old checkpoints: "
    "RestClient.delete_checkpoint), then retry"
)
# safetensors' errors are not OSErrors; they carry the OS error's text.
_OUT_OF_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "File too large")


def is_out_of_space(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a full disk or quota."""
    seen: BaseException | None = e
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:  # a chain may loop back on itself
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if isinstance(seen, sqlite3.OperationalError) and "disk is full" in str(seen):
            return True
        if type(seen).__name__ == "SafetensorError" and any(
            t in str(seen) for t in _OUT_OF_SPACE_TEXT
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def record_done_work(what: str, write: Callable[[], object]) -> None:
    """Run ``write``, a store write recording work already done (usage, last-used times).
    Its failure (a full disk) is logged, not raised: the work happened (a model changed, a
    checkpoint was written), and failing the request would tell its client to repeat it; a
    forward_backward repeated on a full disk's advice added its gradients twice."""
    try:
        write()
    except (OSError, sqlite3.Error) as e:  # anything but a full disk: with its traceback
        log.warning(
            "%s not recorded (%s); the request it follows succeeded", what, e,
            exc_info=not is_out_of_space(e),
        )  # fmt: skip


def unwritable(e: sqlite3.OperationalError) -> bool:
    text = str(e).lower()
    return "unable to open" in text or "readonly" in text or "read-only" in text


def check_not_emptied(path: Path) -> None:
    """An empty database file beside checkpoint files was cut to nothing (a crash, a full
    disk, a bad copy): opened, it would be a new, empty store that silently lists none of
    them. Refused as damaged instead (a missing file is a new store: that is asked for)."""
    try:
        emptied = path.stat().st_size == 0
    except OSError:
        return
    if emptied and any((path.parent / "checkpoints").glob("*/*/*")):
        raise StoreDamagedError(path, ValueError("the file is empty, and checkpoints/ is not"))


def open_read_only(path: Path) -> sqlite3.Connection:
    """``path`` for reading. A WAL database needs its ``-shm`` file, which a read-only
    directory may not let SQLite create: then the file is read as it stands (``immutable``;
    a writer elsewhere is not seen, which a report of a read-only store can afford)."""
    last: sqlite3.DatabaseError | None = None
    for mode in ("mode=ro", "immutable=1"):
        db = sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True, check_same_thread=False)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.DatabaseError as e:
            db.close()
            last = e
            if not isinstance(e, sqlite3.OperationalError):
                break  # not a database: no mode reads it
    assert last is not None
    raise StoreDamagedError(path, last) from last
