"""Install targets into fresh virtualenvs, each alone, and what they must (and must not) bring:

- ``tierckpt[torch]`` (what a training image installs) saves and loads: nothing the training library
  imports is missing from its declared dependencies;
- ``tierckpt[replicator]`` (what the daemon image installs) has neither torch nor numpy, its
  replicators replicate, its CLI verifies a step, and the training library says what to install.

Each virtualenv sees no other site-packages. Versions are those of constraints.txt (torch is its CPU
build, from pip's cache), except typer for the training install: the oldest line ``typer>=0.16``
allows that needs no pydantic, so that nothing the client imports arrives only as the dependency of
another package (pydantic did, through typer 0.29). The sources are copied out first, so the build
leaves the checkout untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.cluster import committed, new_job, replica_path
from tests.fixtures.ramdisk import fresh_ramdisk_dir
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import step_files, write_step

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TYPER = "typer==0.16.0"
"""The oldest ``typer>=0.16`` allows, and without pydantic among its dependencies."""
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


def _run(*args: str, env: dict[str, str], cwd: Path | None = None, check: bool = True) -> str:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0 or not check, f"{args}:\n{done.stdout}{done.stderr}"
    return done.stdout + ("" if check else done.stderr)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TIERCKPT_"))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tierckpt's wheel, built from a copy of the sources with this environment's setuptools (build
    tools are no runtime dependency)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip"]
    _run(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(src), env=_env())
    (built,) = tmp.glob("tierckpt-*.whl")
    return built


def _fresh_install(tmp_path: Path, requirement: str, *, pins: str = "") -> tuple[str, set[str]]:
    """A new virtualenv with ``requirement`` alone, at constraints.txt's versions but for ``pins``
    (``name==version``): its Python, and the distributions installed."""
    env = _env()
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv), env=env)
    python = str(venv / "bin" / "python")
    constraints = tmp_path / "constraints.txt"
    pinned = (REPO / "constraints.txt").read_text()
    for pin in pins.split():
        name = pin.split("==")[0]
        pinned = re.sub(rf"(?m)^{re.escape(name)}==.*$", pin, pinned)
    constraints.write_text(pinned)
    pip = [sys.executable, "-m", "pip", "--python", python]
    # --no-compile: byte-compiling torch's sources at install time takes longer than the rest together
    _run(*pip, "install", "-q", "--no-compile", "-c", str(constraints), requirement, env=env)
    listed = _run(*pip, "list", "--format=freeze", env=env).lower()
    assert all(pin.lower() in listed for pin in pins.split()), listed
    return python, {line.split("==")[0] for line in listed.splitlines()}


def test_the_training_install_saves_and_loads(tmp_path: Path, wheel: Path) -> None:
    python, installed = _fresh_install(tmp_path, f"{wheel}[torch]", pins=TYPER)
    assert {"torch", "numpy"} <= installed, installed
    assert not installed & {"httpx", "fastapi", "kopf", "grpcio"}, installed
    env = _env()
    with fresh_ramdisk_dir(tmp_path, "install") as root:
        env["TIERCKPT_ROOT"] = str(root / "not-yet")
        out = _run(python, "-c", SAVE_AND_LOAD, env=env, cwd=tmp_path)
        # the CLI with the oldest typer allowed: options parsed (typer 0.12 with click 8.5 read them as None)
        listed = json.loads(
            _run(str(Path(python).parent / "tierckpt"), "ls", str(root / "not-yet"), "--json", env=env)
        )
    assert "saved and loaded step 5" in out
    assert [(s["step"], s["state"]) for s in listed["steps"]] == [(5, "committed")], listed


def test_the_replicator_install_has_no_torch_and_runs(tmp_path: Path, wheel: Path) -> None:
    python, installed = _fresh_install(tmp_path, f"{wheel}[replicator]")
    assert "fastapi" in installed and not installed & {"torch", "numpy"}, installed
    bin_dir = Path(python).parent

    def from_the_venv(node: Node, args: list[str]) -> list[str]:
        return [str(bin_dir / "tierckpt-replicator"), *args]

    job = new_job("fresh")
    with LocalCluster(nodes=2, job=job, k=1, replicator_command=from_the_venv) as cluster:
        a, b = cluster.nodes
        source = write_step(a.root, job, 0, 4, world_size=2, sizes=(1 << 20, 333), files=2, seed=4)
        replica = replica_path(b, job, 0, 4)
        try:
            cluster.wait_for(lambda: committed(replica), timeout=60, what="the replica on node-1")
        except TimeoutError:
            raise AssertionError("\n".join(n.log_text()[-3000:] for n in cluster.nodes)) from None
        assert step_files(replica) == step_files(source)
        # the CLI (the base install) verifies steps without torch
        report = json.loads(_run(str(bin_dir / "tierckpt"), "verify", str(a.root), "--json", env=_env()))
        assert report["ok"] and [s["step"] for s in report["steps"]] == [4], report
    # and the training library says what it needs
    refused = _run(python, "-c", "import tierckpt; tierckpt.Checkpointer", env=_env(), check=False)
    assert "pip install 'tierckpt[torch]'" in refused, refused
