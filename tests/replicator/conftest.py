"""Replicator tests: shared fixtures live in tests/fixtures (importable as ``fixtures``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
