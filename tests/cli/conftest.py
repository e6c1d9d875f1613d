"""Fixtures for the CLI tests (helpers live in cli_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.cli_helpers import save_steps


@pytest.fixture
def ramdisk(tmp_path: Path) -> Path:
    """A ramdisk root with job ``cli-job``: ranks 0 and 1, steps 10, 20, 30 each."""
    root = tmp_path / "ramdisk"
    for rank in (0, 1):
        save_steps(root, rank=rank, world_size=2)
    return root
