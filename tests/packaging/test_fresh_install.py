"""The base install target alone (``pip install tierckpt``, no extra) into a fresh virtualenv saves and
loads: nothing the client imports is missing from its declared dependencies.

The virtualenv sees no other site-packages. Versions are those of constraints.txt (torch is its CPU
build, from pip's cache), except typer: the oldest line ``typer>=0.12`` allows that needs no pydantic,
so that nothing the client imports arrives only as the dependency of another package (pydantic did,
through typer 0.29). The sources are copied out first, so the build leaves the checkout untouched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.ramdisk import fresh_ramdisk_dir

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TYPER = "typer==0.12.5"
"""Within ``typer>=0.12`` and without pydantic among its dependencies."""
SOURCES = ["pyproject.toml", "README.md", "client", "cli", "demo", "replicator", "csi", "operator"]

SAVE_AND_LOAD = textwrap.dedent(
    """
    import sys

    import torch

    import tierckpt

    assert tierckpt.__file__.startswith(sys.prefix), tierckpt.__file__  # the installed copy
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(64, 33, generator=g), "ids": torch.arange(100), "meta": {"epoch": 3}}
    with tierckpt.Checkpointer(rank=0, world_size=1) as ckpt:
        ckpt.save(5, state, blocking=True)
        got = {"w": torch.zeros(64, 33), "ids": torch.zeros(100, dtype=torch.int64), "meta": {}}
        assert ckpt.load(got) == 5
    for key in ("w", "ids"):
        assert got[key].numpy().tobytes() == state[key].numpy().tobytes(), key
    assert got["meta"] == {"epoch": 3}
    print("saved and loaded step 5")
    """
)


def _run(*args: str, env: dict[str, str], cwd: Path | None = None) -> str:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{args}:\n{done.stdout}{done.stderr}"
    return done.stdout


def test_the_base_install_alone_saves_and_loads(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(REPO / name, src / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TIERCKPT_"))}
    pip = [sys.executable, "-m", "pip"]
    # the wheel is built with this environment's setuptools (build tools are no runtime dependency)
    _run(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src), env=env)
    (wheel,) = tmp_path.glob("tierckpt-*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv), env=env)
    python = str(venv / "bin" / "python")
    constraints = tmp_path / "constraints.txt"
    pinned = (REPO / "constraints.txt").read_text()
    constraints.write_text(re.sub(r"(?m)^typer==.*$", TYPER, pinned))
    # --no-compile: byte-compiling torch's sources at install time takes longer than the rest together
    _run(
        *pip, "--python", python, "install", "-q", "--no-compile", "-c", str(constraints), str(wheel), env=env
    )
    listed = _run(*pip, "--python", python, "list", "--format=freeze", env=env)
    installed = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert "torch" in installed and not installed & {"httpx", "fastapi", "kopf", "grpcio"}, installed
    assert TYPER in listed.lower(), listed
    with fresh_ramdisk_dir(tmp_path, "install") as root:
        env["TIERCKPT_ROOT"] = str(root / "not-yet")
        out = _run(python, "-c", SAVE_AND_LOAD, env=env, cwd=tmp_path)
    assert "saved and loaded step 5" in out
