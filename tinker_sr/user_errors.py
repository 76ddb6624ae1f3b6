"""The caller's-mistake errors, raised by the engine, the request validator and the client-side
lowering alike.

Torch-free and importing nothing from tinker_sr, so the clients, `tinker_sr.validation` and the
engine can all raise them without the clients importing the engine (docs/architecture.md). The
engine never imports the public client types: the backend turns `EngineUserError` into
`RequestFailedError(category=User)` and any other exception into
`RequestFailedError(category=Server)`.
"""

from __future__ import annotations

from collections.abc import Iterable


class EngineUserError(ValueError):
    """The request is wrong; the message names the field, the datum and the fix.

    A request that raises this must leave the model, optimizer, checkpoints and recorded
    sequences exactly as they were.
    """


class EngineNotFoundError(EngineUserError):
    """A named object (model, checkpoint, sampler, sequence) does not exist."""


def check_same_names(want: Iterable[str], got: Iterable[str], *, mismatch: str, fix: str) -> None:
    """Refuse a state dict whose tensor names are not exactly ``want``'s: ``mismatch`` says
    what does not match, ``fix`` what to load instead."""
    want_set, got_set = set(want), set(got)
    missing, unexpected = sorted(want_set - got_set), sorted(got_set - want_set)
    if missing or unexpected:
        raise EngineUserError(
            f"{mismatch}: {len(missing)} missing (e.g. {missing[:2]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:2]}); {fix}"
        )


# Why the embedded engine and `tinker-sr serve` refuse RestClient's session search, project
# assignment and trace export (one wording for both, as the error-parity tests compare them).
SESSION_QUERIES_UNSUPPORTED = "session search, projects and trace export are not supported"

MAX_MESSAGE_CHARS = 2000


def clip_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut in the middle to at most about ``limit`` characters: an error that echoes
    an oversized value (a 100 KB model name) keeps its start and its fix, not the whole."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]} ... ({len(text) - head - tail} characters left out) ... {text[-tail:]}"
