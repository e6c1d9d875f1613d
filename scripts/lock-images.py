"""Write (or check) the locks the images install: every Python package at one version, with its hashes.

    python scripts/lock-images.py            # rewrite images/*.lock from pyproject.toml and constraints.txt
    python scripts/lock-images.py --check    # exit 1 if a lock is not what they give now

Each image installs exactly its lock (``pip install --no-deps --require-hashes``), so the lock is the
image's whole Python content, and what the vulnerability scan (scripts/audit-images.sh) reads:

- ``images/daemon.lock``: ``tierckpt[replicator,operator,csi]`` (the CLI comes with the base install);
- ``images/training-torch.lock``: torch and its own dependencies, the stand-in for the torch a training
  image already has (constraints.txt's CPU build);
- ``images/training.lock``: what ``tierckpt[torch]`` adds on top of that torch.

pip resolves the requirements of those install targets (from pyproject.toml, not the source tree, so
nothing is built) under constraints.txt, for this interpreter (CPython 3.11 on x86_64 Linux, as the
images' Debian Python), and reports each file's sha256. Run it with the dev virtualenv after changing
pyproject.toml's dependencies or constraints.txt (``scripts/setup.sh --refreeze``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "images"
CONSTRAINTS = REPO / "constraints.txt"

DAEMON_EXTRAS = ("replicator", "operator", "csi")
TRAINING_EXTRAS = ("torch",)
_SELF = re.compile(r"^tierckpt\[([^\]]+)\]$")


def requirements(extras: tuple[str, ...], project: dict[str, Any]) -> list[str]:
    """The base install's requirements plus those of ``extras`` (and the extras they include)."""
    optional: dict[str, list[str]] = project["optional-dependencies"]
    out, seen, todo = list(project["dependencies"]), set(), list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            if m := _SELF.match(req.replace(" ", "")):
                todo += m.group(1).split(",")
            else:
                out.append(req)
    return sorted(set(out))


def _sha256(url: str) -> str:
    digest = hashlib.sha256()
    with open(unquote(urlparse(url).path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resolve(reqs: list[str]) -> dict[str, tuple[str, str]]:
    """pip's resolution of ``reqs`` under constraints.txt: normalized name -> (version, sha256)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--only-binary", ":all:", "--report", str(report), "-c", str(CONSTRAINTS), *reqs]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"lock-images: pip could not resolve {reqs}:\n{done.stderr}")
        installs = json.loads(report.read_text())["install"]
    out = {}
    for item in installs:
        name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
        info = item["download_info"]
        sha = info.get("archive_info", {}).get("hashes", {}).get("sha256") or _sha256(info["url"])
        out[name] = (item["metadata"]["version"], sha)
    return out


def render(title: str, what: str, pins: dict[str, tuple[str, str]]) -> str:
    lines = [
        f"# {title}: written by scripts/lock-images.py from pyproject.toml and constraints.txt; do not edit.",
        f"# {what}",
    ]
    for name in sorted(pins):
        version, sha = pins[name]
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{sha}")
    return "\n".join(lines) + "\n"


def locks() -> dict[Path, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    daemon = resolve(requirements(DAEMON_EXTRAS, project))
    training = resolve(requirements(TRAINING_EXTRAS, project))
    torch = resolve([f"torch=={training['torch'][0]}"])
    added = {n: pin for n, pin in training.items() if torch.get(n) != pin}
    for clash in added.keys() & torch.keys():
        wanted = added[clash][0]
        raise SystemExit(f"lock-images: tierckpt[torch] wants {clash} {wanted}, torch brings another")
    return {
        IMAGES / "daemon.lock": render(
            "images/daemon.lock",
            f"tierckpt[{','.join(DAEMON_EXTRAS)}]: the daemon image's Python packages",
            daemon,
        ),
        IMAGES / "training-torch.lock": render(
            "images/training-torch.lock",
            "torch and its dependencies: the training image's stand-in for the user's own torch",
            torch,
        ),
        IMAGES / "training.lock": render(
            "images/training.lock", "what tierckpt[torch] adds to a training image that has torch", added
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    stale = []
    for path, text in locks().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(REPO))
        else:
            path.write_text(text)
            print(f"lock-images: wrote {path.relative_to(REPO)} ({text.count('--hash')} packages)")
    if stale:
        print(f"lock-images: {', '.join(map(str, stale))} out of date: run python scripts/lock-images.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
