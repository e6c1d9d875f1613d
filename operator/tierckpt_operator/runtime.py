"""The operator's shared runtime: settings, API adapters, metrics and the per-job controllers.

Built once by the composition root (``__main__.build_runtime``) with its adapters already open; kopf's
startup handler marks it running, its cleanup handler stops the background loops, and the composition
root closes the adapters when kopf has stopped. Handlers only ever *poke* a job: the job's daemon wakes,
waits ``debounce`` for the burst to settle, and reconciles once, so a storm of pod events costs one
planning round. The controllers see only a ``JobContext``, never this class.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from tierckpt.protocol.client import ReplicatorClient
from tierckpt_operator.clusterview import INDEX_IDS, WATCHED_IDS, ClusterView, WatchedIndex
from tierckpt_operator.config_reporter import ConfigReporter
from tierckpt_operator.credentials import OperatorCredentials
from tierckpt_operator.kube import Kube
from tierckpt_operator.metrics import Metrics
from tierckpt_operator.reconcile import JobContext, JobController, JobKey
from tierckpt_operator.settings import Settings

__all__ = ["Runtime"]


@dataclasses.dataclass
class Runtime:
    settings: Settings
    kube: Kube
    replicators: ReplicatorClient
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    credentials: OperatorCredentials | None = None
    """--auth tls: the CA and the operator's own certificates (its client's, the signing endpoint's)."""
    running: bool = False
    """True between kopf's startup and cleanup: handlers and loops may do I/O."""
    controllers: dict[JobKey, JobController] = dataclasses.field(default_factory=dict)
    node_jobs: dict[str, set[JobKey]] = dataclasses.field(default_factory=lambda: defaultdict(set))
    job_nodes: dict[JobKey, set[str]] = dataclasses.field(default_factory=dict)
    tasks: set[asyncio.Task[Any]] = dataclasses.field(default_factory=set)
    watched: dict[str, WatchedIndex[Any, Any]] = dataclasses.field(
        default_factory=lambda: {name: WatchedIndex() for name in WATCHED_IDS}
    )
    """The indices of pods and nodes the watch handlers keep (``clusterview.WATCHED_IDS``)."""
    jobs: JobContext = dataclasses.field(init=False)
    """What every job controller is given."""
    configs: ConfigReporter = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.jobs = JobContext(
            settings=self.settings,
            kube=self.kube,
            replicators=self.replicators,
            metrics=self.metrics,
            running=self._is_running,
            track_nodes=self.track_nodes,
            forget_pod=self.forget_pod,
        )
        self.configs = ConfigReporter(self.settings, self.kube, self._is_running)

    def _is_running(self) -> bool:
        return self.running

    def view(self, indices: Mapping[str, Any]) -> ClusterView:
        """The cluster: kopf's ``indices`` (a handler's kwargs) and the watched pods and nodes."""
        return ClusterView({**{k: indices[k] for k in INDEX_IDS if k in indices}, **self.watched})

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background loop until ``stop``."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def start(self) -> None:
        """kopf has started: handlers and loops may do I/O."""
        self.running = True

    async def stop(self) -> None:
        """kopf is stopping: no new I/O from loops; background tasks end. Adapters stay open."""
        self.running = False
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close the adapters (after kopf has stopped every handler)."""
        await self.stop()
        await self.replicators.aclose()
        self.kube.close()
        if self.credentials is not None:
            self.credentials.close()

    def controller(self, key: JobKey) -> JobController:
        ctl = self.controllers.get(key)
        if ctl is None:
            ctl = self.controllers[key] = JobController(self.jobs, key)
            self.metrics.jobs.set(len(self.controllers))
        return ctl

    def forget(self, key: JobKey) -> None:
        ctl = self.controllers.pop(key, None)
        if ctl is not None:
            self.track_nodes(key, ())
        self.metrics.jobs.set(len(self.controllers))
        self.metrics.job_degraded(key, False)

    def forget_pod(self, namespace: str, name: str) -> None:
        """A worker pod the API no longer has: out of the watched pods (as its deletion event would)."""
        self.watched["tierckpt_workers"].drop(f"{namespace}/{name}")

    def poke(self, key: JobKey) -> None:
        ctl = self.controllers.get(key)
        if ctl is not None:
            ctl.wake.set()

    def poke_node(self, node: str) -> None:
        for key in list(self.node_jobs.get(node, ())):
            self.poke(key)

    def track_nodes(self, key: JobKey, nodes: Sequence[str]) -> None:
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
