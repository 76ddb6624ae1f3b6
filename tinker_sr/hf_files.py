"""Hugging Face model and tokenizer directories on disk: find them, read their JSON.

Torch-free, so the engine (weights, `tinker_sr.engine.hf`) and the clients (`get_tokenizer()`,
`tinker_sr.clients.tokenizers`) share one lookup. A directory is found, offline, as either
- a local directory holding the marker files (``config.json`` for a model,
  ``tokenizer.json`` / ``tokenizer_config.json`` for a tokenizer), or
- a Hub name ``Org/Name`` (optionally ``Org/Name@revision``) already in the local Hugging Face
  cache: ``$HF_HUB_CACHE`` or ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``, laid out as
  ``models--Org--Name/snapshots/<revision>/`` with ``refs/<branch>`` naming the revision.
  Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from tinker_sr.user_errors import EngineUserError


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, resolved like `huggingface_hub` does (no import needed)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Tinker's variant ids: a base model served with a given context, e.g.
# "Qwen/Qwen3.6-35B-A3B:peft:262144" (tinker-cookbook's recipes use them as model names).
_VARIANT = re.compile(r"(?P<base>[^:]+):peft:(?P<context>[1-9][0-9]{0,9})")


def tinker_variant(name: str) -> tuple[str, int | None]:
    """A Tinker variant id's base model name and context length; other names as they are,
    with None."""
    found = _VARIANT.fullmatch(name)
    return (found["base"], int(found["context"])) if found else (name, None)


def adapter_base_model(name: str, resolved: str) -> str:
    """What an adapter trained on base model `name` (resolved to `resolved`: a built-in name or
    a local directory) names as its base, in ``adapter_config.json``'s
    ``base_model_name_or_path``: a Hub name found in the Hugging Face cache (and a built-in) as
    it is, a path or an alias as the directory it resolved to. A Tinker variant id
    ("Qwen/Qwen3-8B:peft:32768", "<dir>:peft:512") names its base: no loader knows the
    suffix."""
    base = tinker_variant(name)[0]
    hub = cached_hub_model(base)
    return base if resolved == base or (hub is not None and resolved == str(hub)) else resolved


def peft_base_fields(base_model: str) -> dict[str, str]:
    """``adapter_config.json``'s fields naming base model ``base_model``: a Hub name with a
    revision (``org/model@<rev>``, which no loader takes as a name) as the name and PEFT's
    ``revision``; anything else as ``base_model_name_or_path`` alone."""
    repo_id, at, revision = base_model.partition("@")
    parts = repo_id.split("/")
    if at and revision and len(parts) == 2 and all(_NAME_PART.fullmatch(p) for p in parts):
        return {"base_model_name_or_path": repo_id, "revision": revision}
    return {"base_model_name_or_path": base_model}


def is_model_dir(path: str | os.PathLike[str], markers: tuple[str, ...] = MODEL_FILES) -> bool:
    return any((Path(path) / m).is_file() for m in markers)


# What a Hub name's parts may hold. A name reaches the file system (a server resolves names
# its clients send), so nothing else is joined onto the cache: no "..", no absolute path.
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,95}")  # huggingface_hub's rule
_REVISION = re.compile(r"[A-Za-z0-9._-]{1,128}(/[A-Za-z0-9._-]{1,128}){0,4}")  # refs/pr/1


def _safe_revision(revision: str, nested: bool = True) -> bool:
    """A branch, tag or commit that names a place inside the cache (branches may nest:
    "refs/pr/1"; the commit a ref file names may not)."""
    if not _REVISION.fullmatch(revision) or (not nested and "/" in revision):
        return False
    return all(part not in (".", "..") for part in revision.split("/"))


def _ref_target(ref: Path) -> str | None:
    """The commit a ``refs/<branch>`` file names (huggingface_hub writes the 40-hex sha), read
    with a cap, or None when it is unreadable or names anything else."""
    try:
        with ref.open("rb") as f:
            text = f.read(257).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _safe_revision(text, nested=False) else None


def _snapshot(repo: Path, revision: str | None, markers: tuple[str, ...]) -> Path | None:
    """The snapshot of a cached repo for `revision` (a branch, tag or commit; default "main",
    else the most recent snapshot) that holds one of `markers`."""
    snaps = repo / "snapshots"
    if not snaps.is_dir() or (revision is not None and not _safe_revision(revision)):
        return None
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        revision = _ref_target(ref)
        if revision is None:
            return None
    if revision is not None:
        cand = snaps / revision
        return cand if is_model_dir(cand, markers) else None
    found = [p for p in snaps.iterdir() if is_model_dir(p, markers)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_model_dir(name: str, markers: tuple[str, ...] = MODEL_FILES) -> Path | None:
    """The local directory of `name` (a path or a cached Hub name) holding one of `markers`
    (default: a model's config.json; `TOKENIZER_FILES` finds tokenizer-only repos), or None."""
    path = Path(name).expanduser()
    if is_model_dir(path, markers):
        return path.resolve()
    return cached_hub_model(name, markers)


def cached_hub_model(name: str, markers: tuple[str, ...] = MODEL_FILES) -> Path | None:
    """The snapshot of Hub name `name` (``org/model[@revision]``) in the local Hugging Face
    cache, or None; never a path given as `name` (what a server may resolve for a client)."""
    repo_id, _, revision = name.partition("@")
    if repo_id.count("/") != 1 or not all(_NAME_PART.fullmatch(p) for p in repo_id.split("/")):
        return None
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snap = _snapshot(repo, revision or None, markers)
    return snap.absolute() if snap is not None else None


def not_found_hint(name: str) -> str:
    """Where `resolve_model_dir` looked, for error messages."""
    repo = "models--" + name.partition("@")[0].replace("/", "--")
    return (
        f"no local directory {name!r} with config.json, and no snapshot in the Hugging Face "
        f"cache at {hub_cache_dir() / repo}/snapshots (set HF_HOME or HF_HUB_CACHE; "
        "nothing is downloaded)"
    )


def installed_version(package: str) -> str | None:
    """``package``'s installed version, or None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def version_below(package: str, than: tuple[int, int]) -> bool | None:
    """Is the installed ``package`` older than major.minor ``than``? None where it is not
    installed or its version does not start with two numbers ("5.2rc0")."""
    parts = tuple(int(p) for p in (installed_version(package) or "").split(".")[:2] if p.isdigit())
    return parts < than if len(parts) == 2 else None


# The most a model directory's JSON file may hold: real ones are far smaller (config.json a few
# KB, the largest tokenizer.json about 30 MB), and one is read whole into memory.
MAX_JSON_BYTES = 256 * 2**20


def _check_file(path: Path, mode: int, size: int, max_bytes: int | None = None) -> None:
    """Refuse a file that is not a regular one (a FIFO, a device, a socket: reading it could
    block the process, or never end), or one of more than ``max_bytes``."""
    if not stat.S_ISREG(mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a named pipe, a device or a socket, which reading could block forever"
        )
        raise EngineUserError(f"{path}: not a regular file but {kind}; put the model's file there")
    if max_bytes is not None and size > max_bytes:
        raise EngineUserError(
            f"{path}: {size} bytes, over the {max_bytes >> 20} MiB a model directory's JSON "
            "file may hold (real ones are far smaller): the file is damaged or not the "
            "model's; put the model's own file there"
        )


def present(path: Path, max_bytes: int | None = None) -> bool:
    """Is there a file at ``path`` to read (links followed)? False where there is none (or a
    directory); `EngineUserError` naming it where there is something reading would block on
    (a FIFO, a device, a socket) or, with ``max_bytes``, a file larger than that. Checked
    before a library (safetensors, transformers) opens a model directory's files."""
    try:
        st = path.stat()
    except OSError:  # nothing there, a dangling link
        return False
    if stat.S_ISDIR(st.st_mode):
        return False
    _check_file(path, st.st_mode, st.st_size, max_bytes)
    return True


def read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON object; `EngineUserError` naming the file where it cannot be
    read, is not a regular file, holds over `MAX_JSON_BYTES`, is not UTF-8 JSON or not an
    object."""
    try:
        # O_NONBLOCK: opening a FIFO returns at once (and is refused below), where a plain
        # open waits for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:  # checked before fdopen, which refuses a directory with the descriptor open
            st = os.fstat(fd)
            _check_file(path, st.st_mode, st.st_size, MAX_JSON_BYTES)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)  # capped, should it have grown since
        _check_file(path, st.st_mode, len(raw), MAX_JSON_BYTES)
        data = json.loads(raw.decode("utf-8"))
    except EngineUserError:
        raise
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        hint = "; it must be UTF-8 JSON" if isinstance(e, UnicodeDecodeError) else ""
        raise EngineUserError(f"{path}: cannot read JSON ({e}){hint}") from e
    if not isinstance(data, dict):
        raise EngineUserError(f"{path}: expected a JSON object")
    return data


def model_config(root: Path) -> dict[str, Any]:
    """config.json, with a vision-language wrapper's ``text_config`` (Qwen3.5) laid over it:
    the fields of the text model (vocab_size, eos_token_id) that RL samples and trains."""
    config = read_json(root / "config.json")
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def eos_token_ids(root: Path) -> tuple[int, ...]:
    """The EOS ids the model's config files declare: config.json's ``eos_token_id`` (an int or
    a list), then generation_config.json's; first-seen order, no repeats. (`ModelTokenizer`
    adds the tokenizer's eos token after them.)"""
    out: list[int] = []
    for fname in ("config.json", "generation_config.json"):
        f = root / fname
        found = (
            (model_config(root) if fname == "config.json" else read_json(f)) if present(f) else {}
        )
        value = found.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise EngineUserError(
                    f"{f}: eos_token_id={value!r} must be a token id or a list of them; fix {fname}"
                )
            if v is not None and v not in out:
                out.append(v)
    return tuple(out)
