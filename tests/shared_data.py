"""Data files the tests read from ``../shared`` beside the checkout (never copied into the repository).

Outside CI a missing file skips the tests that need it, with the path in the reason. In CI (``CI`` set)
it fails them: CI always has ``shared/`` beside the clone, so a missing file means a broken setup, and
the operator end-to-end tests must never be skipped silently.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["JOBSET_CRD", "require_jobset_crd"]

REPO = Path(__file__).resolve().parents[1]
JOBSET_CRD = REPO.parent / "shared" / "k8s" / "jobset.x-k8s.io_jobsets.yaml"


def require_jobset_crd() -> Path:
    """The JobSet CRD's path; skips the calling test (fails it in CI) when the file is absent."""
    if JOBSET_CRD.exists():
        return JOBSET_CRD
    reason = f"the JobSet CRD is not at {JOBSET_CRD}"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must have shared/ beside the checkout")
    pytest.skip(reason)
