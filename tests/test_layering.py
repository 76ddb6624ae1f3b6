"""The layering rules of docs/architecture.md, checked on the source rather than trusted.

- The client side (``tinker_sr/clients/``, ``tinker_sr/types/``, ``tinker_sr/validation.py`` and
  the neutral ``tinker_sr/user_errors.py`` / ``tinker_sr/limits.py``) never imports
  ``tinker_sr.engine``: not at the top of a module and not inside a function.
- Importing any of them does not pull the engine in through another module either: the
  module-level imports they reach, followed through the package, never land in the engine.
- The other way round: the engine (and the neutral modules it shares with the clients) never
  imports the clients, the backends, the server or the wire codec.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tinker_sr"
CLIENT_SIDE = sorted(
    [
        *(PACKAGE / "clients").rglob("*.py"),
        *(PACKAGE / "types").rglob("*.py"),
        PACKAGE / "validation.py",
        PACKAGE / "user_errors.py",
        PACKAGE / "limits.py",
    ]
)
# The embedded backend is chosen at run time (clients/holder.py imports backend.local inside a
# function), so the transitive check follows module-level imports only.
ENGINE = "tinker_sr.engine"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, top_level_only: bool, module: str | None = None) -> list[str]:
    """Absolute names of the tinker_sr modules (or names in them) that ``path`` imports;
    ``module`` is the file's dotted name (by default from its place in the package)."""
    module = module or _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    # A relative import is resolved against the file's package (itself for an __init__).
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            anchor = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*anchor, node.module] if node.module else anchor)
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return [n for n in names if n == "tinker_sr" or n.startswith("tinker_sr.")]


def _source(module: str) -> Path | None:
    rel = Path(*module.split("."))
    for candidate in (
        PACKAGE.parent / rel.with_suffix(".py"),
        PACKAGE.parent / rel / "__init__.py",
    ):
        if candidate.is_file():
            return candidate
    return None  # a name inside a module (``from m import f``), not a module


def _is_engine(name: str) -> bool:
    return name == ENGINE or name.startswith(ENGINE + ".")


@pytest.mark.parametrize("path", CLIENT_SIDE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_client_side_never_imports_the_engine(path: Path) -> None:
    engine = [n for n in _imports(path, top_level_only=False) if _is_engine(n)]
    assert not engine, f"{path.relative_to(PACKAGE)} imports {engine}; see docs/architecture.md"


def test_client_side_does_not_reach_the_engine_through_other_modules() -> None:
    seen: dict[str, str] = {}  # module -> the module that first imported it
    todo = [(_module_name(p), "") for p in CLIENT_SIDE]
    while todo:
        module, via = todo.pop()
        if module in seen:
            continue
        seen[module] = via
        path = _source(module)
        if path is None:
            continue
        for name in _imports(path, top_level_only=True):
            # Importing tinker_sr.a.b runs tinker_sr/__init__ and tinker_sr/a/__init__ too.
            parts = name.split(".")
            # The package root is skipped: it is the SDK's entry point, which imports the
            # clients (not the other way round) and engine/cpu.py's torch-free thread defaults.
            todo += [(".".join(parts[:i]), module) for i in range(2, len(parts) + 1)]
    reached = sorted(m for m in seen if _is_engine(m))
    chains = {m: seen[m] for m in reached}
    assert not reached, (
        f"engine modules reached from the client side (module: imported by): {chains}"
    )


ENGINE_SIDE = sorted(
    [
        *(PACKAGE / "engine").rglob("*.py"),
        *(PACKAGE / "tokenization").rglob("*.py"),
        *(PACKAGE / "provenance").rglob("*.py"),
        PACKAGE / "hf_files.py",
        PACKAGE / "validation.py",
        PACKAGE / "user_errors.py",
        PACKAGE / "limits.py",
        PACKAGE / "threads.py",
    ]
)
UPPER_LAYERS = ("tinker_sr.clients", "tinker_sr.backend", "tinker_sr.server", "tinker_sr.wire")


@pytest.mark.parametrize("path", ENGINE_SIDE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engine_side_never_imports_an_upper_layer(path: Path) -> None:
    upper = [
        n
        for n in _imports(path, top_level_only=False)
        if any(n == u or n.startswith(u + ".") for u in UPPER_LAYERS)
    ]
    assert not upper, f"{path.relative_to(PACKAGE)} imports {upper}; see docs/architecture.md"


def test_the_checker_sees_an_engine_import(tmp_path: Path) -> None:
    """The scan must not be blind: function-level and relative engine imports are found."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from tinker_sr.engine.model import Transformer\n"
        "from ..engine import sampler\n"
    )
    found = _imports(probe, top_level_only=False, module="tinker_sr.clients.probe")
    assert {"tinker_sr.engine.model", "tinker_sr.engine.sampler"} <= set(found)
    assert _imports(probe, top_level_only=True, module="tinker_sr.clients.probe") == [
        "tinker_sr.engine",
        "tinker_sr.engine.sampler",
    ]


def test_neutral_modules_import_without_torch() -> None:
    code = (
        "import sys\n"
        "import tinker_sr, tinker_sr.limits, tinker_sr.user_errors, tinker_sr.validation\n"
        "import tinker_sr.clients.sr_lowering, tinker_sr.clients.tokenizers\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
