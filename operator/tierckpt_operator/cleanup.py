"""Purge a deleted job's data: its RAM disk directories on every node, and optionally its backups.

The operator holds no storage credentials: every replicator purges its own node
(``DELETE /v1/jobs/{job}``), and when the configuration says so one replicator deletes the job's GCS
backups (``DELETE /v1/jobs/{job}?bucket=true``), trying the next if one fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from tierckpt.protocol.client import ReplicatorClient
from tierckpt_operator.clusterview import ClusterView
from tierckpt_operator.resources import ConfigSpec

__all__ = ["PurgeResult", "purge_job"]

log = logging.getLogger(__name__)

BACKUP_PURGE_TIMEOUT = 420.0
"""Seconds one replicator may take to delete the job's backups: it waits for the uploads other nodes
still have in flight (their writer leases) before its last sweep."""


@dataclasses.dataclass(frozen=True)
class PurgeResult:
    purged: tuple[str, ...]
    failed: dict[str, str]
    backups_deleted: bool | None = None
    """None: not asked; False: no replicator managed to."""

    def summary(self) -> str:
        text = f"purged job data on {len(self.purged)} node(s)"
        if self.failed:
            node, why = next(iter(sorted(self.failed.items())))
            text += f"; {len(self.failed)} node(s) failed (first: {node}: {why})"
        if self.backups_deleted is not None:
            text += "; GCS backups deleted" if self.backups_deleted else "; GCS backups NOT deleted"
        return text


async def purge_job(
    client: ReplicatorClient, cluster: ClusterView, job_id: str, config: ConfigSpec | None
) -> PurgeResult:
    """Ask every ready replicator on the configuration's nodes to drop the job."""
    nodes = cluster.nodes()
    targets: dict[str, str] = {}
    for rep in cluster.replicators():
        labels = nodes.get(rep.node)
        if rep.ready and (config is None or labels is None or config.selects(labels)):
            targets.setdefault(rep.node, rep.endpoint)
    results = await asyncio.gather(
        *(client.purge(ep, job_id, node=node) for node, ep in targets.items()), return_exceptions=True
    )
    purged, failed = [], {}
    for node, result in zip(targets, results, strict=True):
        if isinstance(result, BaseException):
            failed[node] = str(result)
        else:
            purged.append(node)
    backups = None
    if config is not None and config.delete_backups:
        backups = False
        for node in sorted(purged) or sorted(targets):
            try:
                await client.purge(
                    targets[node], job_id, backups=True, timeout=BACKUP_PURGE_TIMEOUT, node=node
                )
                backups = True
                break
            except Exception as exc:  # the next replicator may succeed
                log.warning("deleting backups of %s through %s failed: %s", job_id, node, exc)
    return PurgeResult(tuple(sorted(purged)), failed, backups)
