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
from typing import TYPE_CHECKING, Any

from tierckpt_operator.cluster import Cluster
from tierckpt_operator.status import config_status, merge_conditions

if TYPE_CHECKING:
    from tierckpt_operator.runtime import Runtime

__all__ = ["ConfigReporter"]

log = logging.getLogger(__name__)


class ConfigReporter:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.wake = asyncio.Event()
        self.cluster: Cluster | None = None
        self.written: dict[str, dict[str, Any]] = {}

    def poke(self, cluster: Cluster) -> None:
        """Remember the live cluster view (the indices) and schedule a report."""
        self.cluster = cluster
        self.wake.set()

    async def run(self) -> None:
        s = self.rt.settings
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=s.config_status_interval)
            await asyncio.sleep(s.debounce)
            self.wake.clear()
            if self.cluster is None or not self.rt.leading or not self.rt.active:
                continue
            try:
                await self.report(self.cluster)
            except Exception:
                log.exception("CheckpointConfiguration status update failed")

    async def report(self, cluster: Cluster) -> None:
        assert self.rt.kube is not None
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
            if changed and await self.rt.kube.patch_config_status(rec.name, changed):
                self.written[rec.name] = {**before, **changed}
