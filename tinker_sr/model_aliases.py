"""Model aliases: ``NAME=TARGET`` entries (``$TINKER_SR_MODEL_ALIASES``, ``--model-alias``),
where a target is a built-in, a directory or a Hub name. Torch-free, so the CLI checks them
before the engine loads."""

from __future__ import annotations

import os

ENV = "TINKER_SR_MODEL_ALIASES"


def alias_entry(entry: str, source: str) -> tuple[str, str]:
    """One ``NAME=TARGET`` entry, stripped; `ValueError` naming ``source`` if it has no '='."""
    if "=" not in entry:
        raise ValueError(f"{source} entry {entry!r} must look like 'name=target'")
    name, target = entry.split("=", 1)
    return name.strip(), target.strip()


def parse_aliases(spec: str | None, source: str = ENV) -> dict[str, str]:
    """``"Qwen/Qwen3-8B=tinker-sr/tiny,*=tinker-sr/tiny"`` → dict (``*``: every name)."""
    parts = (part.strip() for part in (spec or "").split(","))
    return dict(alias_entry(part, source) for part in parts if part)


def env_aliases() -> dict[str, str]:
    """The aliases of ``$TINKER_SR_MODEL_ALIASES`` (`ValueError` naming it if malformed)."""
    return parse_aliases(os.environ.get(ENV), f"${ENV}")
