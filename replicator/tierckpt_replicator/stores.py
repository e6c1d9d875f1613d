"""The node's control state, each with one reader that every part shares: the jobs' peer assignments
(``peers.json``), their policies (``policy.json``), the quotas those imply, and the restore plans this
node staged.

``serve`` opens them first, so the backups (``backup.jobs.JobBackups``) and the daemon's parts read
the same stores: no part reads these files by itself.
"""

from __future__ import annotations

import dataclasses

from tierckpt.protocol.control import RestorePlan
from tierckpt_replicator.assignments import AssignmentStore, load_static
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.quota import JobQuotas
from tierckpt_replicator.settings import Settings

__all__ = ["NodeStores"]


@dataclasses.dataclass(frozen=True)
class NodeStores:
    assignments: AssignmentStore
    policies: PolicyStore
    quotas: JobQuotas
    plans: dict[str, RestorePlan] = dataclasses.field(default_factory=dict)
    """Job -> the restore plan this node staged for it last (``restore.stage.Stager`` keeps it; the
    inventory and the backups read it: the steps the run the job went back from saved,
    ``RestorePlan.left_behind``, are nobody's newest)."""

    @classmethod
    def open(cls, settings: Settings) -> NodeStores:
        """The stores under ``--root``; the static peers file (``--peers-file``, local mode) seeds its job."""
        static = load_static(settings.peers_file) if settings.peers_file else None
        policies = PolicyStore(settings.root)
        return cls(
            assignments=AssignmentStore(settings.root, static),
            policies=policies,
            quotas=JobQuotas(settings.root, policies, settings.transfer.job_quota),
        )
