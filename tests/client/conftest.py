"""Fixtures for the client tests: a fresh ramdisk directory per test, and real small tmpfs mounts."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

JOB = "client-test"


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A ramdisk root: a unique directory under /dev/shm (tmpfs), else under pytest's tmp_path."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        d = Path(tempfile.mkdtemp(prefix=f"tierckpt-client-{uuid.uuid4().hex[:8]}-", dir=shm))
    else:
        d = tmp_path / "ramdisk"
        d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def job() -> str:
    return JOB


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 MiB tmpfs mounted for this test only (needs root; mark the test ``root``)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    name = f"tierckpt-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", name, str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)
