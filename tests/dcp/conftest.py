"""Fixtures for the DCP tests: a fresh ramdisk directory per test (on tmpfs when the machine has one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.ramdisk import fresh_ramdisk_dir

JOB = "dcp-test"


@pytest.fixture
def ramdisk(tmp_path: Path) -> Iterator[Path]:
    """A ramdisk root: a unique directory on the machine's tmpfs."""
    with fresh_ramdisk_dir(tmp_path, "dcp") as d:
        yield d


@pytest.fixture
def job() -> str:
    return JOB
