"""The size rules of docs/architecture.md, checked rather than trusted: no file under tinker_sr/
over 700 lines (generated protobuf aside), no function over 80 lines unless a comment says why.

The "why" is a comment starting ``# long:`` on one of the lines just above the ``def`` (or its
decorators), e.g. ``# long: one state machine; split, its states would need a class``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tinker_sr"
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if not p.name.endswith("_pb2.py"))


def _explained(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    above = lines[max(0, first - 4) : first - 1]  # up to three lines above
    return any(line.strip().startswith("# long:") for line in above)


def _long_functions(path: Path, root: Path = PACKAGE) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length > MAX_FUNCTION_LINES and not _explained(lines, node):
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_source_file_is_over_the_limit() -> None:
    sizes = {p: len(p.read_text().splitlines()) for p in SOURCES}
    over = [f"{p.relative_to(PACKAGE)} ({n})" for p, n in sizes.items() if n > MAX_FILE_LINES]
    assert not over, f"files over {MAX_FILE_LINES} lines (split them by job): {over}"


def test_no_function_is_over_the_limit_without_a_reason() -> None:
    over = [f for p in SOURCES for f in _long_functions(p)]
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into steps, or put a "
        f"'# long: <why>' comment above the def): {over}"
    )


def test_the_function_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    probe = tmp_path / "probe.py"
    probe.write_text(f"def long():\n{body}\n\n# long: a table\ndef explained():\n{body}")
    assert _long_functions(probe, root=tmp_path) == ["probe.py:1 long (81 lines)"]
