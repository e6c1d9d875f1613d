"""torch's private APIs: only ``tierckpt.dcp.torch_seams`` imports them, and the torch range that the
"torch" extra declares is the one they were tested with (``TESTED_TORCH``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from tierckpt.dcp.torch_seams import TESTED_TORCH

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "client" / "tierckpt"
ALLOWED = {
    CLIENT / "dcp" / "torch_seams.py": "the one place for them",
    CLIENT / "snapshot" / "objects.py": "reads torch's weights-only allowlist defensively, stands without it",
}


def _private(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "torch" and any(p.startswith("_") for p in parts)


def _private_torch_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [a.name for a in node.names]
            if _private(node.module or "") or any(n.startswith("_") for n in names):
                found.append(f"{where}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if _private(a.name)]
    return found


def test_only_the_seams_module_imports_private_torch_names() -> None:
    modules = [path for path in sorted(CLIENT.rglob("*.py")) if path not in ALLOWED]
    found = [hit for path in modules for hit in _private_torch_imports(path)]
    assert found == [], "\n".join(found)


def test_the_declared_torch_range_is_the_tested_one() -> None:
    """Move ``TESTED_TORCH`` and the extra's range together, with scripts/torch-range.sh passing on both
    ends of the new range."""
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    low, high = TESTED_TORCH
    assert low <= version < high, f"torch {torch.__version__} is not a release the seams were tested with"
    pin = re.search(r'"torch(>=[^"]*)"', (REPO / "pyproject.toml").read_text())
    assert pin is not None and pin.group(1) == ">={}.{},<{}.{}".format(*low, *high), "pyproject.toml's range"
