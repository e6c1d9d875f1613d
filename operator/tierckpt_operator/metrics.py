"""Every Prometheus metric of the operator, in one place (served at ``/metrics``, without credentials:
so no label names a job; which jobs are degraded is in their CheckpointJobs, behind Kubernetes RBAC)."""

from __future__ import annotations

from collections.abc import Hashable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]


class Metrics:
    """The operator's metrics, on their own registry (tests may build several operators)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(
            "tierckpt_operator_reconciles", "Job reconcile rounds, by outcome.", ["outcome"], registry=r
        )
        self.reconcile_seconds = Histogram(
            "tierckpt_operator_reconcile_seconds", "Duration of one job reconcile round.", registry=r
        )
        self.assignments = Counter(
            "tierckpt_operator_rank_assignments",
            "Completed rank assignments (one per restart attempt).",
            registry=r,
        )
        self.ranks_moved = Counter(
            "tierckpt_operator_ranks_moved", "Node ranks that changed node at an assignment.", registry=r
        )
        self.replicator_calls = Counter(
            "tierckpt_operator_replicator_calls",
            "Replicator API calls, by call and outcome.",
            ["call", "outcome"],
            registry=r,
        )
        self.webhook_mutations = Counter(
            "tierckpt_operator_webhook_mutations",
            "Admission reviews answered, by kind and outcome.",
            ["kind", "outcome"],
            registry=r,
        )
        self.node_certificates = Counter(
            "tierckpt_operator_node_certificates",
            "Node certificate requests answered, by outcome (issued, unauthenticated, refused, malformed, "
            "throttled: past the source's rate, busy: every API call slot taken).",
            ["outcome"],
            registry=r,
        )
        self.jobs_degraded = Gauge(
            "tierckpt_operator_jobs_degraded",
            "Served jobs with some rank below its replication factor (which: their CheckpointJobs' "
            "status.redundancy and Degraded Events; the metrics port names no job).",
            registry=r,
        )
        self._degraded: set[Hashable] = set()
        self.redundancy_changes = Counter(
            "tierckpt_operator_redundancy_changes",
            "Times a job went below its replication factor (degraded) or back to it (healed).",
            ["change"],
            registry=r,
        )
        self.jobs = Gauge("tierckpt_operator_jobs", "Opted-in JobSets being served.", registry=r)
        self.leader = Gauge("tierckpt_operator_leader", "1 while this replica reconciles.", registry=r)

    def job_degraded(self, job: Hashable, degraded: bool) -> None:
        """Count ``job`` among the degraded ones, or not (a job no longer served: ``False``)."""
        if degraded:
            self._degraded.add(job)
        else:
            self._degraded.discard(job)
        self.jobs_degraded.set(len(self._degraded))
