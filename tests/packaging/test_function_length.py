"""No function of the node daemons (the replicator, the CSI driver) is longer than 80 lines: a longer
one does several things, and each deserves a name. Generated code (the CSI driver's ``_proto``) is not
ours to split."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TREES = (REPO / "replicator" / "tierckpt_replicator", REPO / "csi" / "tierckpt_csi")
LIMIT = 80


def long_functions() -> list[str]:
    found = []
    for tree in TREES:
        for path in sorted(tree.rglob("*.py")):
            if "_proto" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > LIMIT:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_the_daemons_is_longer_than_80_lines():
    assert not long_functions(), long_functions()
