"""Shared test configuration. Fixtures for real tmpfs mounts, nodes and emulators live in tests/fixtures."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["tests.fixtures.ramdisk"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; runs on the device machine"))
        if "root" in item.keywords and os.geteuid() != 0:
            item.add_marker(pytest.mark.skip(reason="needs root for tmpfs mounts and network namespaces"))
