"""CheckpointConfiguration status: selected nodes, nodes with a ready replicator, jobs using it.

One loop for all configurations, woken (and debounced) by configuration, node and replicator
events, and run at least every ``config_status_interval``. It writes status through the API adapter
rather than a kopf timer, so configurations carry no finalizer: deleting one never needs the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from tierckpt_operator.clusterview import ClusterView
from tierckpt_operator.kube import Kube
from tierckpt_operator.settings import Settings
from tierckpt_operator.status_fields import config_status, merge_conditions

__all__ = ["ConfigReporter"]

log = logging.getLogger(__name__)


class ConfigReporter:
    """Writes every configuration's status; ``running`` says whether the operator may do I/O now."""

    def __init__(self, settings: Settings, kube: Kube, running: Callable[[], bool]) -> None:
        self.settings, self.kube, self.running = settings, kube, running
        self.wake = asyncio.Event()
        self.cluster: ClusterView | None = None
        self.written: dict[str, dict[str, Any]] = {}

    def poke(self, cluster: ClusterView) -> None:
        """Remember the live cluster view (the indices) and schedule a report."""
        self.cluster = cluster
        self.wake.set()

    async def run(self) -> None:
        s = self.settings
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=s.config_status_interval)
            await asyncio.sleep(s.debounce)
            self.wake.clear()
            if self.cluster is None or not self.running():
                continue
            try:
                await self.report(self.cluster)
            except Exception:
                log.exception("CheckpointConfiguration status update failed")

    async def report(self, cluster: ClusterView) -> None:
        nodes = cluster.nodes()
        ready_nodes = {r.node for r in cluster.replicators() if r.ready}
        jobsets = cluster.jobsets()
        for rec in cluster.configs():
            spec = rec.spec
            selected = {n for n, labels in nodes.items() if spec is None or spec.selects(labels)}
            jobs = sum(1 for j in jobsets if j.info is not None and j.info.config_name == rec.name)
            fields, conds = config_status(
                spec is not None,
                rec.error,
                len(selected),
                len(selected & ready_nodes),
                jobs,
                spec.generation if spec else 0,
            )
            before = self.written.get(rec.name, {})
            fields["conditions"] = merge_conditions(before.get("conditions"), conds, time.time())
            changed = {k: v for k, v in fields.items() if before.get(k) != v}
            if changed and await self.kube.patch_config_status(rec.name, changed):
                self.written[rec.name] = {**before, **changed}
