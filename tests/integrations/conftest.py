"""Fixtures for the framework tests: a fresh ramdisk root per test, a work directory for results."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.ramdisk import fresh_ramdisk_dir


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A ramdisk root: a unique directory on the machine's tmpfs."""
    with fresh_ramdisk_dir(tmp_path, "integrations") as d:
        yield d


@pytest.fixture(scope="module")
def module_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A ramdisk root shared by one module's tests (each uses its own job)."""
    with fresh_ramdisk_dir(tmp_path_factory.mktemp("ramdisk"), "integrations") as d:
        yield d
