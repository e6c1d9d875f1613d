"""Fixtures for the GCS backup tests: one real fake-gcs-server per session, a fresh bucket per test,
and a fault proxy in front of it on demand. Helpers live in ``tests.backup.helpers``."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator

import pytest

from tests.backup.helpers import make_store
from tierckpt_demo.fakegcs import FakeGcsServer, FaultProxy
from tierckpt_replicator.backup.gcs import GcsStore

_counter = itertools.count()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        yield server


@pytest.fixture
def bucket(gcs_server: FakeGcsServer) -> str:
    name = f"tierckpt-test-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}"
    gcs_server.create_bucket(name)
    return name


@pytest.fixture
def proxy(gcs_server: FakeGcsServer) -> Iterator[FaultProxy]:
    with FaultProxy((gcs_server.host, gcs_server.port)) as p:
        yield p


@pytest.fixture
def store(gcs_server: FakeGcsServer, bucket: str) -> GcsStore:
    return make_store(gcs_server.url, bucket)
