"""Every Prometheus metric the replicator exports, in one place, and its two views.

Labels stay low-cardinality: ``job`` (one per training job on the node), ``direction``, ``result``,
``source``; never ranks, steps or peers.

A job id names a tenant's job (``<namespace>_<jobset>_<uid>``), so the series labelled with it are
for authenticated callers only:

* ``render_jobs()``: every series, per job: ``GET /v1/metrics`` on the control API (the operator's
  identity only, like every endpoint but a node's inventory);
* ``render()``: the probe port's ``GET /metrics`` (plain HTTP, no credentials: the kubelet,
  Prometheus): every series without a job label as it is, and each per-job one over this node's jobs,
  with no job label: summed (steps, bytes, counters, the number of degraded jobs), or as
  ``_OVER_JOBS`` says (the largest lag, the fewest copies, the oldest backup). So it says nothing
  about which jobs run here, whatever metric is added later.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

__all__ = ["CONTENT_TYPE", "Metrics"]

_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_NS = "tierckpt_replicator"

Over = Callable[[Iterable[float]], float]
_OVER_JOBS: dict[str, tuple[Over, str] | None] = {
    f"{_NS}_replication_lag_seconds": (max, "probe port: the largest of this node's jobs"),
    f"{_NS}_replication_copies": (min, "probe port: the fewest of this node's jobs"),
    f"{_NS}_replication_factor": (max, "probe port: the largest of this node's jobs"),
    "tierckpt_backup_last_success_timestamp_seconds": (min, "probe port: the oldest of this node's jobs"),
    "tierckpt_backup_last_complete_step": None,  # one job's step number means nothing for the node
}
"""How the probe port shows a per-job family (None: not at all); any other is summed over the jobs."""
_SUMMED = (sum, "probe port: summed over this node's jobs")


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._replication(r)
        self._holdings_and_restores(r)
        self._orbax_and_process(r)
        self._node_view = CollectorRegistry(auto_describe=False)
        self._node_view.register(_OverJobs(r))

    def _replication(self, r: CollectorRegistry) -> None:
        """Transfers between nodes, replication, redundancy, replica groups and quota refusals."""
        self.transfer_bytes = Counter(
            f"{_NS}_transfer_bytes", "Step bytes moved between nodes.", ["direction"], registry=r
        )
        self.transfers = Counter(
            f"{_NS}_transfers", "Step transfers by direction and result.", ["direction", "result"], registry=r
        )
        self.replication_seconds = Histogram(
            f"{_NS}_replication_seconds",
            "Time to copy one rank's step to one peer.",
            buckets=_SECONDS,
            registry=r,
        )
        self.replication_lag = Gauge(
            f"{_NS}_replication_lag_seconds",
            "Age of the oldest newest-local step still short of its K replicas (0 when all are replicated).",
            ["job"],
            registry=r,
        )
        self.replication_copies = Gauge(
            f"{_NS}_replication_copies",
            "Fewest peer copies of any local rank's newest step (steps still being replicated excluded).",
            ["job"],
            registry=r,
        )
        self.replication_factor = Gauge(
            f"{_NS}_replication_factor",
            "The job's replication factor applied on this node.",
            ["job"],
            registry=r,
        )
        self.replication_degraded = Gauge(
            f"{_NS}_replication_degraded",
            "1 while some local rank of the job has fewer copies than its replication factor.",
            ["job"],
            registry=r,
        )
        self.redundancy_changes = Counter(
            f"{_NS}_redundancy_changes",
            "Times a job went below its replication factor (degraded) or back to it (healed).",
            ["job", "change"],
            registry=r,
        )
        self.dedup_bytes = Counter(
            f"{_NS}_dedup_bytes",
            "Replica bytes not sent: the peer linked an identical replica group member's data files.",
            registry=r,
        )
        self.group_bytes = Gauge(
            f"{_NS}_replica_group_bytes",
            "Bytes of this node's newest replica group steps, per step: 'logical' (without dedup), "
            "'written' (by the clients), 'replicated' (sent to peers), 'replicated_logical' (what those "
            "sends would have been without dedup).",
            ["job", "kind"],
            registry=r,
        )
        self.group_diverged = Counter(
            f"{_NS}_replica_group_diverged",
            "Replica group steps found to differ from another member's (never deduplicated).",
            ["job"],
            registry=r,
        )
        self.quota_refusals = Counter(
            f"{_NS}_quota_refusals",
            "Steps refused for declaring more bytes than their job's quota: 'send' (a newest local step, "
            "neither replicated nor backed up; counted once), 'receive' (a peer's put or fragment).",
            ["job", "op"],
            registry=r,
        )

    def _holdings_and_restores(self, r: CollectorRegistry) -> None:
        """What this node holds, its restores and backups."""
        self.steps = Gauge(f"{_NS}_steps", "Committed steps held on this node.", ["job", "kind"], registry=r)
        self.held_bytes = Gauge(
            f"{_NS}_held_bytes", "Bytes of committed steps held on this node.", ["job", "kind"], registry=r
        )
        self.restore_bytes = Counter(
            f"{_NS}_restore_bytes", "Bytes staged for restore, by source tier.", ["source"], registry=r
        )
        self.restores = Counter(f"{_NS}_restores", "Rank restores by result.", ["result"], registry=r)
        self.restore_seconds = Histogram(
            f"{_NS}_restore_seconds", "Time to stage one rank for restore.", buckets=_SECONDS, registry=r
        )
        self.backups = Counter(f"{_NS}_backups", "Backups requested, by result.", ["result"], registry=r)

    def _orbax_and_process(self, r: CollectorRegistry) -> None:
        """Orbax mode, the worker process and the control API."""
        self.orbax_adopted = Counter(
            f"{_NS}_orbax_steps_adopted",
            "Steps stock Orbax committed that this node adopted as primaries (Orbax mode).",
            ["job"],
            registry=r,
        )
        self.orbax_handshakes = Counter(
            f"{_NS}_orbax_handshakes",
            "replicator.yaml handshakes answered (Orbax mode): 'ok', 'error' (malformed, reported in "
            "replicator.errors) or 'failed' (replicator.failed).",
            ["job", "result"],
            registry=r,
        )
        self.orbax_handovers = Counter(
            f"{_NS}_orbax_handovers",
            "Restore hand-overs to Orbax: 'restore' (a step), 'fresh' (nothing to restore), 'failed'.",
            ["result"],
            registry=r,
        )
        self.worker_restarts = Counter(
            f"{_NS}_worker_restarts", "Times the replication worker process was restarted.", registry=r
        )
        self.worker_up = Gauge(f"{_NS}_worker_up", "1 while the replication worker runs.", registry=r)
        self.requests = Counter(
            f"{_NS}_api_requests",
            "Control API requests by route and status class.",
            ["route", "code"],
            registry=r,
        )

    def render(self) -> bytes:
        """The probe port's page: no job named (see the module docstring)."""
        return generate_latest(self._node_view)

    def render_jobs(self) -> bytes:
        """``GET /v1/metrics``: every series, per job."""
        return generate_latest(self.registry)


class _OverJobs:
    """A collector: ``source``'s families, each per-job one over the jobs (``_OVER_JOBS``)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not any("job" in sample.labels for sample in family.samples):
                yield family
                continue
            rule = _OVER_JOBS.get(family.name, _SUMMED)
            if rule is None:
                continue
            over, note = rule
            values: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
            for sample in family.samples:
                if sample.name.endswith("_created"):  # a counter's creation time: one per job
                    continue
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "job"))
                values.setdefault((sample.name, labels), []).append(sample.value)
            out = Metric(family.name, f"{family.documentation} ({note})", family.type, family.unit)
            for (name, labels), of_jobs in values.items():
                out.add_sample(name, dict(labels), over(of_jobs))
            yield out
