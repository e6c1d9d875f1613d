"""The operator's shared runtime: settings, API adapters, metrics and the per-job controllers.

Built once by the composition root (``registry.build_registry``); the adapters are opened in kopf's
startup handler (they need the running event loop) and closed at cleanup. Handlers only ever *poke*
a job: the job's daemon wakes, waits ``debounce`` for the burst to settle, and reconciles once, so a
storm of pod events costs one planning round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import kopf

from tierckpt.protocol.client import ReplicatorClient
from tierckpt_operator.configs import ConfigReporter
from tierckpt_operator.kube import Kube, api_client
from tierckpt_operator.metrics import Metrics
from tierckpt_operator.replicators import replicator_client
from tierckpt_operator.settings import Settings

if TYPE_CHECKING:
    from tierckpt_operator.reconcile import JobController

__all__ = ["JobKey", "Runtime", "post_event"]

log = logging.getLogger(__name__)

JobKey = tuple[str, str]


def post_event(ref: Mapping[str, Any] | None, kind: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event about ``ref`` (an object body or reference) through kopf's queue."""
    if not ref or not ref.get("metadata", {}).get("uid"):
        log.info("%s %s: %s", kind, reason, message)
        return
    try:
        kopf.event(dict(ref), type=kind, reason=reason, message=message[:1000])
    except LookupError:  # outside a running operator (unit tests): log only
        log.info("%s %s: %s", kind, reason, message)


@dataclasses.dataclass
class Runtime:
    settings: Settings
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    kube: Kube | None = None
    replicators: ReplicatorClient | None = None
    leading: bool = True
    stopping: bool = False
    controllers: dict[JobKey, JobController] = dataclasses.field(default_factory=dict)
    node_jobs: dict[str, set[JobKey]] = dataclasses.field(default_factory=lambda: defaultdict(set))
    job_nodes: dict[JobKey, set[str]] = dataclasses.field(default_factory=dict)
    configs: ConfigReporter = dataclasses.field(init=False)
    tasks: set[asyncio.Task[Any]] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.configs = ConfigReporter(self)

    def background(self, coro: Any) -> None:
        """Run a background loop until ``stop``."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def start(self) -> None:
        self.stopping = False
        s = self.settings
        if self.kube is None:
            self.kube = Kube(await asyncio.to_thread(api_client, s.server, s.kubeconfig), s.api_concurrency)
        if self.replicators is None:
            self.replicators = replicator_client(s)

    @property
    def active(self) -> bool:
        """Adapters open and not shutting down: handlers may do I/O."""
        return self.kube is not None and self.replicators is not None and not self.stopping

    async def stop(self) -> None:
        """kopf is stopping: no new I/O from loops; background tasks end. Adapters stay open."""
        self.stopping = True
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close the adapters (after kopf has stopped every handler)."""
        await self.stop()
        if self.replicators is not None:
            await self.replicators.aclose()
            self.replicators = None
        if self.kube is not None:
            self.kube.close()
            self.kube = None

    def controller(self, key: JobKey) -> JobController:
        from tierckpt_operator.reconcile import JobController

        ctl = self.controllers.get(key)
        if ctl is None:
            ctl = self.controllers[key] = JobController(self, key)
            self.metrics.jobs.set(len(self.controllers))
        return ctl

    def forget(self, key: JobKey) -> None:
        ctl = self.controllers.pop(key, None)
        if ctl is not None:
            self.track_nodes(key, ())
        self.metrics.jobs.set(len(self.controllers))

    def poke(self, key: JobKey) -> None:
        ctl = self.controllers.get(key)
        if ctl is not None:
            ctl.wake.set()

    def poke_node(self, node: str) -> None:
        for key in list(self.node_jobs.get(node, ())):
            self.poke(key)

    def track_nodes(self, key: JobKey, nodes: tuple[str, ...] | list[str]) -> None:
        """Remember which jobs use which nodes, to wake them when a node or replicator changes."""
        for node in self.job_nodes.pop(key, ()):
            jobs = self.node_jobs.get(node)
            if jobs is not None:
                jobs.discard(key)
                if not jobs:
                    del self.node_jobs[node]
        current = {n for n in nodes if n}
        if current:
            self.job_nodes[key] = current
        for node in current:
            self.node_jobs[node].add(key)
