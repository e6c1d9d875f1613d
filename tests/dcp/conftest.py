"""Fixtures for the DCP tests: a fresh ramdisk directory per test (on tmpfs when the machine has one)."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

JOB = "dcp-test"


@pytest.fixture
def ramdisk(tmp_path: Path) -> Iterator[Path]:
    """A ramdisk root: a unique directory under /dev/shm (tmpfs), else under pytest's tmp_path."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        root = Path(tempfile.mkdtemp(prefix=f"tierckpt-dcp-{uuid.uuid4().hex[:8]}-", dir=shm))
    else:
        root = tmp_path / "ramdisk"
        root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def job() -> str:
    return JOB
