"""Checkpoints on disk and their metadata: save, load, copy, TTL, publish, list, and the
REST views of training runs.

Files live at ``<root>/checkpoints/<run>/<segment>/<name>.safetensors`` (written atomically by
`engine.checkpoints`); an external-weights export is a directory
``<root>/checkpoints/<run>/external_weights/<name>/`` of files for other tools
(`engine.external_weights`), moved into place complete. Their metadata (``tinker://`` path,
type, size, expiry, public flag) lives in the `Store`. One lookup (`CheckpointStore.live`)
decides whether a path exists, so load, TTL, info, publish and copy give the same not-found
message.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from tinker_sr import types
from tinker_sr.engine import checkpoints as ckpt_io
from tinker_sr.engine.store import CheckpointRow, RunRow, Store
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError
from tinker_sr.validation import check_checkpoint_name as check_name
from tinker_sr.validation import expiry

log = logging.getLogger("tinker_sr.engine")

PURGE_EVERY_S = 60.0
"""How often saves look for expired checkpoints to delete (TTLs are at least an hour)."""
STALE_TEMP_S = 3600.0
"""A save's temporary file or folder (``.<name>.<random>.tmp``) untouched this long belongs to
a save that never finished (its process was killed); deleted when the store opens."""
# `write`'s staging folders and `copy`'s links end in 32 hex digits, `checkpoints.save_tensors`'
# temporary files (tempfile.mkstemp) in 8 characters of [a-z0-9_].
_TEMP_NAME = re.compile(r"^\..+\.(?:[0-9a-f]{32}|[a-z0-9_]{8})\.tmp$")

SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def parse_path(path: str) -> types.ParsedCheckpointTinkerPath:
    try:
        return types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError as e:
        raise EngineUserError(
            f"{e}; expected tinker://<run_id>/<weights|sampler_weights|external_weights>/<name>"
        ) from e


def _iso(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _remove(path: Path) -> None:
    """A checkpoint's file, or directory (an external-weights export); gone already is fine.
    Its kind's and its run's folders go too once empty (they stayed, one pair per run)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    kind, run = path.parent, path.parent.parent
    if run.parent.name != "checkpoints":  # not <root>/checkpoints/<run>/<kind>/<file>
        return
    for folder in (kind, run):
        try:
            folder.rmdir()  # only if empty
        except OSError:
            return


def _check_file_name(name: str) -> None:
    """A checkpoint's name becomes a file name: refused, naming the fix, where this process's
    file system encoding cannot write it (a C/POSIX locale: ASCII), instead of failing as an
    internal error when the file is written."""
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        raise EngineUserError(
            f"checkpoint name {name!r:.60} cannot be a file name here: the engine's file "
            f"system encoding is {sys.getfilesystemencoding()} (its locale is not UTF-8 and "
            "Python's UTF-8 mode is off); use a name it can encode, or run the engine in UTF-8 "
            "mode (PYTHONUTF8=1) or a UTF-8 locale"
        ) from None


class CheckpointStore:
    """Checkpoint files under ``root`` plus their rows in ``store``."""

    def __init__(self, store: Store, root: Path, *, purge: bool = True) -> None:
        """``purge``: delete expired checkpoints now (the engine that owns the store does; a
        reader of it, such as ``tinker-sr export``, does not)."""
        self.store = store
        self.root = root.absolute()  # the process may change directory later
        self._last_purge: float | None = None  # time.monotonic(): a throttle, not a date
        if purge:
            store.rebase_checkpoint_files(self.relative)  # rows of before: full paths
            self.purge_expired()
            self.sweep_stale_temp()

    def sweep_stale_temp(self, *, now: float | None = None) -> int:
        """Delete what saves that never finished left (`STALE_TEMP_S`): never listed, so
        nobody could delete it, and up to a whole checkpoint each. One written now (by another
        engine on this store) is recent, and kept. Returns the count."""
        now = time.time() if now is None else now
        removed = 0
        for tmp in self.root.glob("checkpoints/*/*/.*.tmp"):
            # Only names a save gives its temporary (a checkpoint may be named ".x.tmp" too),
            # and never one a checkpoint row names.
            if not _TEMP_NAME.match(tmp.name) or self.store.checkpoint_file_in_use(
                self.relative(str(tmp))
            ):
                continue
            try:
                inside = list(tmp.iterdir()) if tmp.is_dir() else []
                # ctime too: a hard link (a copy) keeps its source's mtime.
                newest = max(max(s.st_mtime, s.st_ctime) for s in map(os.stat, [tmp, *inside]))
                if now - newest >= STALE_TEMP_S:
                    _remove(tmp)
                    removed += 1
            except OSError as e:  # gone meanwhile, or not ours to delete: not worth a failure
                log.warning("could not delete the unfinished save %s: %s", tmp, e)
        if removed:
            log.info("deleted %d temporary files of saves that never finished", removed)
        return removed

    def purge_expired(self, *, every: float = 0.0) -> int:
        """Delete the checkpoints whose TTL ran out, rows and files (a TTL bounds what a run
        keeps on disk; expired ones are no longer listed, so nobody could delete them). Runs
        when the store opens and before each save at most every ``PURGE_EVERY_S``: on the
        thread that saves, so a new checkpoint reusing an expired one's name is never the
        file removed. ``every``: skip if the last purge is more recent. Returns the count."""
        if self._last_purge is not None and time.monotonic() - self._last_purge < every:
            return 0
        self._last_purge = time.monotonic()
        now = time.time()
        rows = self.store.take_expired_checkpoints(now)
        for row in rows:
            if self.store.checkpoint_file_in_use(row.file_path):
                continue  # saved again under the same name meanwhile
            try:
                _remove(self.path_of(row))
            except OSError as e:  # a save or a server start must not fail over an old file
                log.warning("could not delete expired checkpoint %s: %s", row.file_path, e)
        return len(rows)

    def relative(self, file_path: str) -> str:
        """How a row names a checkpoint's file: from the store's root
        (``checkpoints/<run>/<segment>/<file>``), so a store moved, copied or opened from
        another directory finds its own files. A path recorded in full (before) is cut to that
        form by the layout's last four parts; anything else stays as it is."""
        parts = Path(file_path).parts
        if len(parts) >= 4 and parts[-4] == "checkpoints":
            return "/".join(parts[-4:])
        return file_path

    def path_of(self, row: CheckpointRow) -> Path:
        """Where ``row``'s file (or an export's directory) is under this store's root."""
        return self.root / self.relative(row.file_path)

    def file(self, run_id: str, segment: str, name: str) -> Path:
        safe_run = run_id.replace(":", "_")
        return self.root / "checkpoints" / safe_run / segment / f"{name}.safetensors"

    # ---- write / read -----------------------------------------------------------------
    def write(
        self,
        run_id: str,
        segment: str,
        name: str,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, str],
        *,
        ttl_seconds: int | None,
        overwrite: bool,
        user_metadata: Mapping[str, str] | None,
    ) -> str:
        """Save ``tensors`` as ``tinker://<run_id>/<segment>/<name>``; returns that path."""
        check_name(name)
        _check_file_name(name)
        self.purge_expired(every=PURGE_EVERY_S)
        expires_at = expiry(ttl_seconds)
        tinker_path = f"tinker://{run_id}/{segment}/{name}"
        if not overwrite and self.store.get_checkpoint(tinker_path) is not None:
            # save_state(overwrite=True) exists; the SDK's save_weights_for_sampler has no such
            # parameter, so advising it there sent users to a TypeError.
            raise _exists(tinker_path, "pass overwrite=True" if segment == "weights" else None)
        file_path = self.file(run_id, segment, name)
        listed = overwrite and self.store.get_checkpoint(tinker_path) is not None
        size = ckpt_io.save_tensors(file_path, tensors, meta)
        try:
            self._record(run_id, segment, name, file_path, size, user_metadata, expires_at)
        except BaseException:  # a full disk: no unlisted file left taking the space
            if not listed:  # (an overwritten checkpoint keeps its row: its file stays)
                file_path.unlink(missing_ok=True)
            raise
        return tinker_path

    def write_dir(
        self,
        run_id: str,
        segment: str,
        name: str,
        fill: Callable[[Path], None],
        *,
        ttl_seconds: int | None,
        user_metadata: Mapping[str, str] | None,
    ) -> str:
        """A directory checkpoint ``tinker://<run_id>/<segment>/<name>``: `fill` writes its
        files into a fresh private directory, which then replaces the final one in one rename
        (a reader sees all of the files or none). Names are never reused while live."""
        check_name(name)
        _check_file_name(name)
        self.purge_expired(every=PURGE_EVERY_S)
        expires_at = expiry(ttl_seconds)
        tinker_path = f"tinker://{run_id}/{segment}/{name}"
        if self.store.get_checkpoint(tinker_path) is not None:
            raise _exists(tinker_path, None)
        final = self.directory(run_id, segment, name)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.with_name(f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            fill(staging)
            size = sum(f.stat().st_size for f in staging.iterdir())
            ckpt_io.fsync_dir(staging)
            if final.exists():  # left by an expired checkpoint of the same name
                shutil.rmtree(final)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            ckpt_io.fsync_dir(final.parent)
            self._record(run_id, segment, name, final, size, user_metadata, expires_at)
        except BaseException:  # never listed (names are not reused while live): removed
            shutil.rmtree(final, ignore_errors=True)
            raise
        return tinker_path

    def _record(  # noqa: PLR0913 (the row's fields)
        self,
        run_id: str,
        segment: str,
        name: str,
        file_path: Path,
        size: int,
        user_metadata: Mapping[str, str] | None,
        expires_at: float | None,
    ) -> None:
        self.store.put_checkpoint(
            CheckpointRow(
                run_id=run_id,
                checkpoint_id=f"{segment}/{name}",
                checkpoint_type=SEGMENTS[segment],
                tinker_path=f"tinker://{run_id}/{segment}/{name}",
                file_path=self.relative(str(file_path)),
                created_at=time.time(),
                size_bytes=size,
                user_metadata=dict(user_metadata) if user_metadata else None,
                expires_at=expires_at,
            )
        )

    def directory(self, run_id: str, segment: str, name: str) -> Path:
        return self.file(run_id, segment, name).with_suffix("")

    def files(self, path: str) -> tuple[str, dict[str, Path]]:
        """The files of external-weights checkpoint ``path``, by name, and the export's
        version (its creation time: a later export under the same name has another), from one
        lookup."""
        if parse_path(path).checkpoint_type != "external":
            raise EngineUserError(
                f"{path} is not an external weights checkpoint; download URLs exist only for "
                "tinker://<run_id>/external_weights/<name> (written by save_weights_external)"
            )
        row = self.live(path)
        root = self.path_of(row)
        if not root.is_dir():
            raise EngineNotFoundError(f"the files of checkpoint {path} are missing from the store")
        return repr(row.created_at), {f.name: f for f in sorted(root.iterdir()) if f.is_file()}

    def live(self, path: str) -> CheckpointRow:
        """The checkpoint at ``path``; not-found (the same message everywhere) if it does not
        exist or has expired."""
        parse_path(path)
        row = self.store.get_checkpoint(path)
        if row is None:
            raise EngineNotFoundError(
                f"checkpoint {path} does not exist (or has expired); list checkpoints with "
                "RestClient.list_checkpoints(run_id)"
            )
        return row

    def known_run(self, path: str) -> types.ParsedCheckpointTinkerPath:
        """``path`` parsed, in a training run this store knows; else not-found, before
        anything about the checkpoint itself is checked (as a server checks the run's owner
        first: a malformed TTL or the wrong kind is a 400 only in a run that exists)."""
        parsed = parse_path(path)
        if self.store.get_run(parsed.training_run_id) is None:
            raise EngineNotFoundError(f"checkpoint {path} does not exist")
        return parsed

    def copyable(self, path: str) -> None:
        """Refuse to copy ``path``, in this order: a run that does not exist (not-found), an
        external weights export (even one that does not exist), a missing checkpoint."""
        if self.known_run(path).checkpoint_type == "external":
            raise EngineUserError(
                f"copy_weights: {path} is an external weights export, which is not copied; "
                "copy the training checkpoint (tinker://<run>/weights/<name>) instead"
            )
        self.live(path)

    def with_run(self, path: str) -> tuple[CheckpointRow, RunRow]:
        row = self.live(path)
        run = self.store.get_run(row.run_id)
        if run is None:
            raise EngineNotFoundError(f"checkpoint {path} has no training run record")
        return row, run

    def load(self, path: str, *, expect: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Tensors and metadata of ``path``; ``expect="training"`` refuses sampler weights."""
        parsed = parse_path(path)
        if parsed.checkpoint_type == "external":
            raise EngineUserError(
                f"{path} is an external weights export (files for other tools, read with "
                "RestClient.get_external_weights_urls); load or sample from "
                "tinker://<run>/weights/<name> or tinker://<run>/sampler_weights/<name> instead"
            )
        if expect == "training" and parsed.checkpoint_type != "training":
            raise EngineUserError(
                f"{path} is a {parsed.checkpoint_type} checkpoint; training state loads only from "
                "tinker://<run>/weights/<name> (written by save_state)"
            )
        return ckpt_io.load_tensors(self.path_of(self.live(path)), name=path)

    # ---- REST views -------------------------------------------------------------------
    def checkpoint(self, row: CheckpointRow) -> types.Checkpoint:
        return types.Checkpoint(
            checkpoint_id=row.checkpoint_id,
            checkpoint_type=row.checkpoint_type,  # type: ignore[arg-type]
            time=_iso(row.created_at),
            tinker_path=row.tinker_path,
            size_bytes=row.size_bytes,
            public=row.public,
            user_metadata=row.user_metadata,
            expires_at=None if row.expires_at is None else _iso(row.expires_at),
        )

    def list_run(self, run_id: str) -> types.CheckpointsListResponse:
        if self.store.get_run(run_id) is None:
            raise EngineNotFoundError(f"unknown training run {run_id!r}")
        rows, _ = self.store.list_checkpoints(run_id)
        return types.CheckpointsListResponse(checkpoints=[self.checkpoint(r) for r in rows])

    def list_all(
        self, *, limit: int, offset: int, runs: Collection[str] | None = None
    ) -> types.CheckpointsListResponse:
        """A page of the live checkpoints (of ``runs`` only, when given), newest first."""
        rows, total = self.store.list_checkpoints(
            None, limit=limit, offset=offset, newest_first=True, runs=runs
        )
        return types.CheckpointsListResponse(
            checkpoints=[self.checkpoint(r) for r in rows],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=total),
        )

    def training_run(self, run_id: str) -> types.TrainingRun:
        run = self.store.get_run(run_id)
        if run is None:
            raise EngineNotFoundError(f"unknown training run {run_id!r}")
        rows, _ = self.store.list_checkpoints(run_id)  # oldest first, whatever the clock did
        last = {
            kind: next((r for r in reversed(rows) if r.checkpoint_type == kind), None)
            for kind in ("training", "sampler")
        }
        return types.TrainingRun(
            training_run_id=run.run_id,
            base_model=run.base_model,
            model_owner=run.session_id,
            is_lora=True,
            lora_rank=run.lora_rank,
            last_request_time=_iso(run.last_request_time),
            last_checkpoint=None if last["training"] is None else self.checkpoint(last["training"]),
            last_sampler_checkpoint=None
            if last["sampler"] is None
            else self.checkpoint(last["sampler"]),
            user_metadata=run.user_metadata,
        )

    def training_runs(
        self, *, limit: int, offset: int, runs: Collection[str] | None = None
    ) -> types.TrainingRunsResponse:
        """A page of the training runs (of ``runs`` only, when given), newest first."""
        rows, total = self.store.list_runs(limit=limit, offset=offset, runs=runs)
        return types.TrainingRunsResponse(
            training_runs=[self.training_run(r.run_id) for r in rows],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=total),
        )

    def info(self, path: str) -> dict[str, Any]:
        """Base model and LoRA config of a checkpoint (for ``weights_info``)."""
        _, run = self.with_run(path)
        return {"base_model": run.base_model, "is_lora": True, **run.lora_config}

    def weights_info(self, path: str) -> types.WeightsInfoResponse:
        info = self.info(path)
        return types.WeightsInfoResponse(
            base_model=info["base_model"],
            is_lora=True,
            lora_rank=info.get("rank"),
            train_unembed=info.get("train_unembed"),
            train_mlp=info.get("train_mlp"),
            train_attn=info.get("train_attn"),
        )

    # ---- changes ----------------------------------------------------------------------
    def delete(self, run_id: str, checkpoint_id: str) -> None:
        path = f"tinker://{run_id}/{checkpoint_id}"
        try:
            parse_path(path)
        except EngineUserError:  # not <kind>/<name>: no such checkpoint (a server: no route)
            raise EngineNotFoundError(
                f"checkpoint {checkpoint_id!r:.80} of run {run_id!r:.80} does not exist; a "
                "checkpoint_id is <weights|sampler_weights|external_weights>/<name>"
            ) from None
        row = self.store.delete_checkpoint(path)
        if row is None:
            raise EngineNotFoundError(f"checkpoint {path} does not exist")
        _remove(self.path_of(row))

    def set_ttl(self, path: str, ttl_seconds: int | None) -> None:
        self.known_run(path)
        expires_at = expiry(ttl_seconds)
        self.live(path)
        self.store.set_checkpoint_expiry(path, expires_at)

    def set_public(self, path: str, public: bool) -> None:
        if self.known_run(path).checkpoint_type == "external":  # before the checkpoint is looked up
            raise EngineUserError(
                "external_weights checkpoints are not published; publish the training or "
                "sampler checkpoint instead"
            )
        self.live(path)
        self.store.set_checkpoint_public(path, public)

    def copy(
        self,
        row: CheckpointRow,
        source_run: RunRow,
        *,
        session_id: str,
        run_id: str,
        expires_at: float | None,
    ) -> str:
        """Copy checkpoint ``row`` into new run ``run_id`` of ``session_id``; returns its path.

        The copy's file is a hard link to the source's where the file system allows (no bytes
        duplicated; deleting either leaves the other intact), else a byte copy."""
        if row.checkpoint_type == "external":
            raise EngineUserError(
                f"copy_weights: {row.tinker_path} is an external weights export, which is not "
                "copied; copy the training checkpoint (tinker://<run>/weights/<name>) instead"
            )
        segment, name = row.checkpoint_id.split("/", 1)
        target = self.file(run_id, segment, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        source = self.path_of(row)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        new_path = f"tinker://{run_id}/{row.checkpoint_id}"
        self.store.add_run(
            run_id, session_id, source_run.base_model, source_run.lora_config, user_metadata=None
        )
        self.store.put_checkpoint(
            CheckpointRow(
                run_id=run_id,
                checkpoint_id=row.checkpoint_id,
                checkpoint_type=row.checkpoint_type,
                tinker_path=new_path,
                file_path=self.relative(str(target)),
                created_at=time.time(),
                size_bytes=row.size_bytes,
                user_metadata=row.user_metadata,
                expires_at=expires_at,
            )
        )
        return new_path


def _exists(tinker_path: str, overwrite_hint: str | None) -> EngineUserError:
    """The refusal of a save under a name the run already holds."""
    fix = overwrite_hint or "delete it first with RestClient.delete_checkpoint_from_tinker_path"
    return EngineUserError(f"checkpoint {tinker_path} already exists; pick another name (or {fix})")
