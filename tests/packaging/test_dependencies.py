"""Each install target declares exactly the third-party packages its code imports (scripts/check-deps.py,
deptry once per target), and the check catches a package declared in the wrong target."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "check-deps.py"


def _check(pyproject: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = [] if pyproject is None else ["--pyproject", str(pyproject)]
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, cwd=REPO)


def _report(out: str, target: str) -> str:
    """The lines the check printed for one install target."""
    return out.split(f"== {target}:", 1)[1].split("\n== ", 1)[0]


def test_every_install_target_declares_exactly_what_its_code_imports() -> None:
    done = _check()
    assert done.returncode == 0, done.stdout + done.stderr
    for target in (
        "tierckpt",
        "tierckpt[torch]",
        "tierckpt[client]",
        "tierckpt[replicator]",
        "tierckpt[dev]",
    ):
        assert "every import declared" in _report(done.stdout, target), done.stdout


def test_an_undeclared_import_and_a_dependency_in_the_wrong_target_fail_the_check(tmp_path: Path) -> None:
    """pydantic left out of the base install (typer happens to bring it), httpx put there instead of the
    "client" extra that tierckpt.protocol.client needs it for."""
    text = (REPO / "pyproject.toml").read_text()
    pydantic = next(line for line in text.splitlines() if line.strip().startswith('"pydantic'))
    broken = tmp_path / "pyproject.toml"
    broken.write_text(text.replace(pydantic + "\n", '  "httpx>=0.27",\n', 1))
    done = _check(broken)
    assert done.returncode == 1, done.stdout + done.stderr
    base = _report(done.stdout, "tierckpt")
    assert "'pydantic' imported but it is a transitive dependency" in base, base
    assert "'httpx' defined as a dependency but not used in the codebase" in base, base
