"""Fixtures for the client tests: a fresh ramdisk directory per test, and real small tmpfs mounts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fixtures.ramdisk import fresh_ramdisk_dir

JOB = "client-test"


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A ramdisk root: a unique directory on the machine's tmpfs."""
    with fresh_ramdisk_dir(tmp_path, "client") as d:
        yield d


@pytest.fixture
def job() -> str:
    return JOB


@pytest.fixture
def small_tmpfs(tmpfs: Callable[[str], Path]) -> Path:
    """A real 64 MiB tmpfs mounted for this test only (needs root; mark the test ``root``)."""
    return tmpfs("64m")
