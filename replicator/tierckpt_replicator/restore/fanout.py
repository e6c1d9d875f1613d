"""Restore once, fan out: a rank whose data files are another replica group member's in the bucket
gets them from the node restoring that member, not from the bucket again.

A step backed up with replica groups stores each group's data files once, under its *data rank*
(``RankRef.data_from`` of the other members; docs/bucket-layout.md). In a restore from the bucket the
node that runs the data rank (the *seeder*) downloads them as usual. The node of any other member
reads the seeder's inventory (``NodeInventory.restoring``) until the data rank's step is committed
there, fetches that step peer to peer (``get``, every crc32c checked) as a replica, and then takes
only its own small files (manifest, COMMIT, objects) from the bucket, linking the data files from the
replica. Bucket egress for a group's shard is one copy whatever the group's size; the seeder serves the
other members (a star: the seeder's send rate bounds it, see docs/benchmarks.md).

Waits follow progress: while the seeder answers and reports the data rank as ``pending`` or
``staging`` this node waits (up to ``fanout_wait`` seconds); a seeder that does not answer, that failed
its restore, or whose copy cannot be fetched means the bucket, at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.control import PeerAssignment, RankHoldings
from tierckpt.protocol.errors import ContractError, RetryableError
from tierckpt_replicator.assignments import data_endpoint
from tierckpt_replicator.backup.jobs import BackupPort
from tierckpt_replicator.replication.ipc import FetchSource, FetchTask
from tierckpt_replicator.replication.supervisor import WorkerSupervisor

__all__ = ["FanOut"]

log = logging.getLogger(__name__)

_POLL = 0.2
"""Seconds between questions to the seeder."""


class FanOut:
    def __init__(
        self,
        *,
        node: str,
        peers: ReplicatorClient,
        supervisor: WorkerSupervisor,
        backup: BackupPort,
        wait: float = 300.0,
    ) -> None:
        self.node, self.peers, self.supervisor, self.backup = node, peers, supervisor, backup
        self.wait = wait

    async def seed(
        self, job: str, rank: int, step: int, world_size: int, assignment: PeerAssignment | None
    ) -> int | None:
        """The rank whose committed step this node now holds as a replica (fetched from its seeder) and
        whose data files are ``rank``'s, or None: restore ``rank`` from the bucket alone."""
        if assignment is None:
            return None
        source = await self.backup.data_source(job, step, rank)
        if source is None:
            return None
        seeder = next(
            (n for n in assignment.nodes if source in assignment.process_ranks(n, world_size)), None
        )
        if seeder is None or seeder == self.node:
            return None  # the data rank is staged here (or nowhere known): the bucket
        if not await self._wait_committed(job, source, step, seeder, assignment):
            return None
        host, port = data_endpoint(assignment.nodes[seeder])
        task = FetchTask(
            id=self.supervisor.next_id(),
            job=job,
            rank=source,
            step=step,
            sources=(FetchSource(kind="peer", node=seeder, host=host, port=port),),
            into="replica",
        )
        try:
            result = await self.supervisor.run_task(task)
        except RetryableError as exc:
            log.info("restore %s rank %d: seeder %s: %s; reading the bucket", job, rank, seeder, exc)
            return None
        if not result.ok:
            why = "; ".join(f"{o.status} {o.message}".strip() for o in result.outcomes)
            log.info(
                "restore %s rank %d: rank %d from %s failed (%s); reading the bucket",
                job,
                rank,
                source,
                seeder,
                why,
            )
            return None
        log.info(
            "restore %s rank %d: rank %d's step %d fetched from %s (fan-out)", job, rank, source, step, seeder
        )
        return source

    async def _wait_committed(
        self, job: str, source: int, step: int, seeder: str, assignment: PeerAssignment
    ) -> bool:
        """Whether the seeder holds ``source``'s ``step`` committed, waiting while it reports progress."""
        endpoint = assignment.nodes[seeder].endpoint
        deadline = time.monotonic() + self.wait
        while True:
            try:
                inv = await self.peers.inventory(endpoint, job, node=seeder)
            except (RetryableError, ContractError) as exc:
                log.info("restore %s: seeder %s does not answer (%s); reading the bucket", job, seeder, exc)
                return False
            if inv is None:
                log.info("restore %s: seeder %s knows no such job; reading the bucket", job, seeder)
                return False
            if step in inv.ranks.get(source, RankHoldings()).local:
                return True
            state = inv.restoring.get(source)
            if state in ("failed", "none") or time.monotonic() >= deadline:
                log.info(
                    "restore %s: seeder %s has no step %d of rank %d (%s); reading the bucket",
                    job,
                    seeder,
                    step,
                    source,
                    state or "not restoring it",
                )
                return False
            await asyncio.sleep(_POLL)
