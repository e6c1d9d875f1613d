"""Fixtures for the operator tests: the Kubernetes API emulator, CRDs, and a kubernetes client."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for k8s_emulator

from k8s_emulator import KubeEmulator

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "charts" / "tierckpt" / "crds"
JOBSET_CRD = REPO.parent / "shared" / "k8s" / "jobset.x-k8s.io_jobsets.yaml"


def load_crds() -> list[dict]:
    """Our CRDs (from the chart) and the JobSet CRD (from ../shared/k8s, never copied)."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted(CRD_DIR.glob("*.yaml"))]
    if not JOBSET_CRD.exists():
        pytest.skip(f"the JobSet CRD is not at {JOBSET_CRD}")
    docs.append(yaml.safe_load(JOBSET_CRD.read_text()))
    return docs


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
