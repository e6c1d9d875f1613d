"""Fixtures for the operator tests: the API emulator with our CRDs, and the end-to-end environment
(operator thread, real replicators, the apiserver's admission calls)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import kmock
import pytest

from tests.fixtures.k8s_emulator import KubeEmulator
from tests.operator.operator_harness import (
    SYSTEM_NS,
    Apiserver,
    Cluster,
    Env,
    Replicators,
    TierckptCA,
    load_crds,
    make_tls,
    operator_settings,
)
from tierckpt_demo.fakegcs import FakeGcsServer


@pytest.fixture
async def kube() -> AsyncIterator[KubeEmulator]:
    """A running emulator (HTTP on 127.0.0.1); ``kube.url`` is its address."""
    async with KubeEmulator() as emulator, kmock.Server(emulator):
        yield emulator


@pytest.fixture
async def kube_with_crds(kube: KubeEmulator) -> KubeEmulator:
    for crd in load_crds():
        resp = await kube.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
        assert resp.status == 201, await resp.text()
    return kube


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="session")
def gcs() -> Iterator[FakeGcsServer]:
    """A fake-gcs-server holding the harness configuration's bucket (``ckpt-bucket``)."""
    with FakeGcsServer() as server:
        server.create_bucket("ckpt-bucket")
        yield server


@pytest.fixture(scope="session")
def webhook_tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tls(tmp_path_factory.mktemp("webhook-tls"))


@pytest.fixture(scope="session")
def tierckpt_ca(tmp_path_factory: pytest.TempPathFactory) -> TierckptCA:
    """The release's CA (what the chart generates into the CA Secret)."""
    return TierckptCA.make(tmp_path_factory.mktemp("tierckpt-ca"))


@pytest.fixture
async def env(
    kube_with_crds: KubeEmulator,
    tmp_path: Path,
    webhook_tls: Path,
    gcs: FakeGcsServer,
    tierckpt_ca: TierckptCA,
) -> AsyncIterator[Env]:
    settings = operator_settings(kube_with_crds, tmp_path, webhook_tls, tierckpt_ca)
    issuer = f"https://127.0.0.1:{settings.issuer_port}"
    replicators = Replicators(tmp_path / "nodes", tierckpt_ca, issuer, gcs.url)
    apiserver = Apiserver(
        kube_with_crds, f"https://127.0.0.1:{settings.webhook_port}", webhook_tls / "ca.crt"
    )
    cluster = Cluster(kube_with_crds, apiserver)
    for ns in (SYSTEM_NS, "team"):
        await cluster.namespace(ns)
    e = Env(kube_with_crds, cluster, replicators, settings)
    try:
        yield e
    finally:
        await e.stop_operator()
        replicators.close()
