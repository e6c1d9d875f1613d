"""Purge a deleted job's data: its RAM disk directories on every node, and optionally its backups.

The operator holds no storage credentials: every replicator purges its own node
(``DELETE /v1/jobs/{job}``), and when the configuration says so one replicator deletes the job's GCS
backups (``DELETE /v1/jobs/{job}?bucket=true``): the next is asked at once when one fails, and also
when one has not answered within ``BACKUP_PURGE_HEDGE`` (a node cut off from the bucket retries its
requests for minutes before it fails; found by the chaos soak: a purge held for minutes). Two at work
at once is safe: the bucket's purge lease lets one delete, the other is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from tierckpt.protocol.client import ReplicatorClient
from tierckpt_operator.clusterview import ClusterView
from tierckpt_operator.resources import ConfigSpec

__all__ = ["PurgeResult", "delete_backups", "purge_job"]

log = logging.getLogger(__name__)

BACKUP_PURGE_TIMEOUT = 420.0
"""Seconds one replicator may take to delete the job's backups: it waits for the uploads other nodes
still have in flight (their writer leases) before its last sweep."""
BACKUP_PURGE_HEDGE = 30.0
"""Seconds without an answer after which the next replicator is asked too (at most ``_HEDGED`` at once)."""
_HEDGED = 3


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
        order = sorted(purged) or sorted(targets)
        backups = await delete_backups(client, {n: targets[n] for n in order}, job_id)
    return PurgeResult(tuple(sorted(purged)), failed, backups)


async def delete_backups(
    client: ReplicatorClient, endpoints: dict[str, str], job_id: str, *, hedge: float | None = None
) -> bool:
    """Delete the job's backups through one of ``endpoints`` (node -> endpoint, in order of preference):
    the first is asked; the next when one fails, or when none has answered for ``hedge`` seconds (at
    most ``_HEDGED`` at once; default ``BACKUP_PURGE_HEDGE``). True once one succeeded (the others are
    then abandoned)."""
    hedge = BACKUP_PURGE_HEDGE if hedge is None else hedge
    queue = list(endpoints)
    asking: dict[asyncio.Task[object], str] = {}

    def ask_next() -> None:
        node = queue.pop(0)
        call = client.purge(endpoints[node], job_id, backups=True, timeout=BACKUP_PURGE_TIMEOUT, node=node)
        asking[asyncio.ensure_future(call)] = node

    try:
        while queue or asking:
            if queue and len(asking) < _HEDGED:
                ask_next()
            more = bool(queue) and len(asking) < _HEDGED
            done, _ = await asyncio.wait(
                asking, timeout=hedge if more else None, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                log.warning(
                    "deleting backups of %s: no answer from %s within %.0fs; asking another replicator too",
                    job_id,
                    ", ".join(asking.values()),
                    hedge,
                )
                continue
            for task in done:
                node = asking.pop(task)
                if task.exception() is None:
                    return True
                log.warning("deleting backups of %s through %s failed: %s", job_id, node, task.exception())
        return False
    finally:
        for task in asking:
            task.cancel()
