"""How the embedded engine's errors reach `LocalBackend`'s callers: a caller's mistake as the
Tinker error a server gives for it, an engine bug (or a full disk) as a server-side failure
whose text does not tell where the store is."""

from __future__ import annotations

import errno
import re
import resource
import traceback
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from tinker_sr import types
from tinker_sr.backend.base import WorkNotStarted
from tinker_sr.engine.store_files import OUT_OF_SPACE, is_out_of_space
from tinker_sr.errors import APIStatusError, RequestFailedError, refusal
from tinker_sr.threads import is_thread_refusal, thread_limit_text
from tinker_sr.user_errors import EngineNotFoundError, EngineUserError

T = TypeVar("T")


def user_error(msg: str) -> RequestFailedError:
    """A request's failure for the caller's mistake (category user), as a future's."""
    return RequestFailedError(
        f"Request failed: {msg}",
        request_id=uuid.uuid4().hex,
        category=types.RequestErrorCategory.User,
    )


def refused(e: EngineUserError) -> APIStatusError:
    """The refusal a server answers a plain call with: 404 for something unknown, else 400."""
    return refusal(404 if isinstance(e, EngineNotFoundError) else 400, str(e))


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR)


def store_unwritable(e: BaseException, store_dir: Path) -> str | None:
    """The failure's text where the store (or a folder in it) cannot be written: read-only,
    permissions, a file in a folder's place; else None."""
    name = getattr(e, "filename", None)
    root = str(store_dir.absolute())
    if not isinstance(e, OSError) or e.errno not in _UNWRITABLE or not name:
        return None
    if not str(name).startswith(root):
        return None
    where = hide_paths(name, store_dir)
    return (
        f"the store cannot be written ({e.strerror}: {where}); make the store folder and "
        "everything in it writable by the server's user (or use another store: --store, "
        "$TINKER_SR_STORE), then retry"
    )


def hide_paths(e: object, store_dir: Path) -> str:
    """An error's (or a path's) text without the store's path (a server must not tell where
    it is)."""
    text = str(e)
    paths = {str(store_dir.resolve()), str(store_dir.absolute())}  # never a bare "store"
    for path in sorted(paths, key=len, reverse=True):  # the longer first: one may hold the other
        text = text.replace(path, "<store>")
    return text


_ALLOCATION = re.compile(
    r"tried to allocate (?:(\d+) bytes|([\d.]+ ?[KMGTP]i?B))|unable to allocate ([\d.]+ ?[KMGTP]i?B)",
    re.IGNORECASE,
)
# torch's allocators' words (CPU on Linux, CPU elsewhere, CUDA / other accelerators)
_TORCH_OOM = ("can't allocate memory", "DefaultCPUAllocator: not enough memory", "out of memory.")


def out_of_memory(e: BaseException) -> str | None:
    """The failure's text where the work ran out of memory (torch's allocator, CPU or CUDA, or
    a `MemoryError`, numpy's too): what it asked for and the ways out; else None."""
    text = str(e)
    oom = isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and any(words in text for words in _TORCH_OOM)
    )
    if not oom:
        return None
    found = _ALLOCATION.search(text)
    asked = ""
    if found and found.group(1):
        n = int(found.group(1))
        size = f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
        asked = f" (one allocation asked for {size})"
    elif found:
        asked = f" (one allocation asked for {found.group(2) or found.group(3)})"
    return (
        f"the engine ran out of memory running this request{asked}; split a large request "
        "(fewer or shorter datums per forward_backward / forward, fewer samples or tokens per "
        "sample request, shorter prompts for prompt log-probs), retry once other work has "
        "freed memory, or free memory on this machine"
    )


def out_of_os_resources(e: BaseException) -> str | None:
    """The failure's text where the process ran out of open files or could not start a thread
    (operating-system limits, not the request's fault), naming the limit and the way out;
    else None. Looked for along the exception's causes, and in the text of libraries that
    report errno in words (safetensors: "Too many open files (24)")."""
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            break
        text = str(seen)
        if (isinstance(seen, OSError) and seen.errno == errno.ENFILE) or (
            "Too many open files in system" in text
        ):
            return (
                "this machine ran out of open files (every process's together: its file "
                "table, fs.file-max, is full): retry once other work has closed some, or raise "
                "fs.file-max"
            )
        if (isinstance(seen, OSError) and seen.errno == errno.EMFILE) or (
            "Too many open files" in text
        ):
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            return (
                f"this process ran out of open files (its limit is {limit}): "
                "retry once other work has closed some; raise the limit (ulimit -n) before "
                "starting the server or script, or close idle clients"
            )
        if is_thread_refusal(seen):
            return thread_limit_text()
        seen = seen.__cause__ or seen.__context__
    return None


async def mapped(work: Awaitable[T], store_dir: Path, *, plain: bool = False) -> T:
    """``work``'s result, its errors as Tinker errors: a caller's mistake as `user_error` (with
    ``plain``, a direct call: as `refused`), running out of memory as a user error naming the
    fix, anything else as a server-side failure. The failed work's frames are cleared: its
    tensors (gigabytes, for a request too large) are freed now, not when the error is."""
    try:
        return await work
    except EngineUserError as e:
        traceback.clear_frames(e.__traceback__)
        if plain:
            raise refused(e) from e
        raise user_error(str(e)) from e
    except (RequestFailedError, WorkNotStarted):
        raise
    except Exception as e:  # an engine bug (or a full disk): a server-side failure
        traceback.clear_frames(e.__traceback__)
        if (no_room := out_of_memory(e)) is not None:
            if plain:
                raise refusal(400, no_room) from e
            raise user_error(no_room) from e
        if (exhausted := out_of_os_resources(e)) is not None:
            if plain:  # a direct call: 503, which clients retry
                raise refusal(503, exhausted) from e
            text = exhausted
        else:
            text = (
                OUT_OF_SPACE
                if is_out_of_space(e)
                else store_unwritable(e, store_dir)
                or f"internal error: {type(e).__name__}: {hide_paths(e, store_dir)}"
            )
        raise RequestFailedError(
            f"Request failed: {text}",
            request_id=uuid.uuid4().hex,
            category=types.RequestErrorCategory.Server,
        ) from e
