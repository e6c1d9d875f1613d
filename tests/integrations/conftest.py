"""Fixtures for the framework tests: a fresh ramdisk root per test, a work directory for results."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.ramdisk import fresh_ramdisk_dir
from tests.integrations.harness import Run


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


@pytest.fixture(scope="session")
def lightning_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """An uninterrupted run of the Lightning DDP example (2 ranks): what every resumed run must equal."""
    pytest.importorskip("lightning")
    work = tmp_path_factory.mktemp("lightning-reference")
    with fresh_ramdisk_dir(work, "reference") as root:
        yield Run(
            "lightning_ddp.py", work, "ref", env={"TIERCKPT_ROOT": str(root), "TIERCKPT_JOB": "ref"}
        ).finish()
