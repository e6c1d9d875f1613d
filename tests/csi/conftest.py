"""Fixtures for the CSI node plugin tests: a real tmpfs ramdisk, a fake kubelet pods dir, a real gRPC
server on a unix socket (in a thread, or as a subprocess for restart tests), and teardown that unmounts
everything the test mounted."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.csi.csi_helpers import Node, PluginProcess, unmount_all_under


@pytest.fixture
def node() -> Iterator[Node]:
    # A short base path: unix socket paths are limited to 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="tcsi-"))
    n = Node(
        base=base,
        ramdisk=base / "ramdisk",
        pods=base / "kubelet" / "pods",
        endpoint=f"unix://{base}/csi/csi.sock",
    )
    n.pods.mkdir(parents=True)
    try:
        yield n
    finally:
        unmount_all_under(base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def processes() -> Iterator[list[PluginProcess]]:
    procs: list[PluginProcess] = []
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            p.kill()
