"""Helpers for the CLI tests: ramdisks written by the real Checkpointer, and running ``tierckpt``.

``cli(...)`` runs a command in-process through typer's runner with exceptions NOT caught: an error
that escaped the command's clean error reporting would fail the test with its traceback.
``cli_process(...)`` runs the installed console script as a real process, for the end-to-end checks
that a user never sees a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from typer.testing import CliRunner

from tierckpt.checkpointer import Checkpointer
from tierckpt_cli.app import app

__all__ = ["JOB", "Result", "assert_clean_error", "cli", "cli_process", "save_steps"]

JOB = "cli-job"


@dataclasses.dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)
    return Result(result.exit_code, result.stdout, result.stderr)


def cli_process(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Result:
    script = Path(sys.executable).parent / "tierckpt"
    proc = subprocess.run(
        [str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_clean_error(result: Result, code: int, *needles: str) -> None:
    """A failed command: the expected exit code, one ``error:`` line naming the problem, no traceback."""
    assert result.code == code, (result.code, result.output)
    assert "Traceback" not in result.output
    assert "error:" in result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def save_steps(
    root: Path,
    *,
    job: str = JOB,
    rank: int = 0,
    world_size: int = 1,
    steps: tuple[int, ...] = (10, 20, 30),
    keep: int = 3,
) -> list[Path]:
    """Commit ``steps`` of one rank with the real Checkpointer; returns their step directories."""
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, 5), "epoch": 0}
    with Checkpointer(root=root, job=job, rank=rank, world_size=world_size, keep=keep) as ckpt:
        for step in steps:
            state["w"] += 1
            state["epoch"] = step
            ckpt.save(step, state, blocking=True)
    return [root / job / f"rank-{rank:05d}" / f"step-{s:012d}" for s in steps]
