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


class ModelUnavailableError(EngineUserError):
    """A base model name that resolves to no model here: ``stem`` says so (what is available,
    where it looked), ``fix`` how to make it available. A caller whose users have a better fix
    re-raises it with that one (`tinker-sr export`: ``--base-model DIR``)."""

    def __init__(self, stem: str, fix: str = "") -> None:
        super().__init__(f"{stem} {fix}" if fix else stem)  # args: the message (it pickles)
        self.stem, self.fix = stem, fix


def official_sdk_hint(obj: object) -> str:
    """Where ``obj`` is one of the official SDK's types (``tinker.Datum``, built by code that
    imports ``tinker``, such as tinker-cookbook's), why a tinker_sr client refuses it and the
    fix, to end an error message with; else ""."""
    module = type(obj).__module__
    if module != "tinker" and not module.startswith("tinker."):
        return ""
    return (
        f" (this is the official SDK's tinker.{type(obj).__name__}: a tinker_sr client takes "
        "tinker_sr's types. Build it from `import tinker_sr as tinker`, or make every "
        "`import tinker`, tinker-cookbook's included, load tinker_sr: call "
        "tinker_sr.install_as_tinker() before importing them, or run the script with "
        "`tinker-sr run`)"
    )


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
