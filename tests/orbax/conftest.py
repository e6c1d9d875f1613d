"""Orbax mode tests: when an end-to-end test fails, the tail of every node's replicator log is attached
to its report, and with ``TIERCKPT_TEST_LOGS=<dir>`` the full logs (replicators and trainers) are copied
there (one folder per failed test)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

_TAIL = 6000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("cluster4")
    if not report.failed or cluster is None:
        return
    for node in cluster.nodes:
        report.sections.append((f"{node.name} replicator log (tail)", node.log_text()[-_TAIL:]))
    keep = os.environ.get("TIERCKPT_TEST_LOGS")
    if keep:
        dest = Path(keep) / re.sub(r"[^A-Za-z0-9_.-]", "_", item.nodeid)
        dest.mkdir(parents=True, exist_ok=True)
        for node in cluster.nodes:
            for log in node.dir.glob("*.log"):
                shutil.copy(log, dest / f"{node.name}-{log.name}")
