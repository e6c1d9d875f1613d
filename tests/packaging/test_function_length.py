"""No function longer than 80 lines in the client, the CLI, the demo and the operator (issue 22): a
longer one mixes what should be named parts. A declarative table (a command's options, a metrics
registry) is written as data at module level, not as a function body."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("client/tierckpt", "cli/tierckpt_cli", "demo/tierckpt_demo", "operator/tierckpt_operator")
LIMIT = 80


def _long_functions(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LIMIT:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_80_lines() -> None:
    packages = [REPO / p for p in PACKAGES]
    assert all(p.is_dir() for p in packages)
    assert [f for p in packages for f in _long_functions(p)] == []
