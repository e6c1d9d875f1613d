"""Restore once, fan out: a rank whose data files are another replica group member's in the bucket
gets them from the node restoring that member, not from the bucket again.

A step backed up with replica groups stores each group's data files once, under its *data rank*
(``RankRef.data_from`` of the other members; docs/bucket-layout.md). In a restore from the bucket the
node that runs the data rank (the *seeder*) downloads them as usual. The node of any other member
reads the seeder's inventory (``NodeInventory.restoring``) until the data rank's step is committed
there, fetches that step peer to peer (``get``, every crc32c checked) as a replica, and then takes
only its own small files (manifest, COMMIT, objects) from the bucket, linking the data files from the
replica. Bucket egress for a group's shard is one copy whatever the group's size; the seeder serves
the other members, and every node that already fetched it serves those still waiting (a tree growing
from the seeder: a holder busy with others answers 503, and the next holder or round is tried). A
member on the seeder's own node links from the data rank's staged primary once it is committed
(``order`` puts the ranks that carry data first, so a member never holds the staging slot its data
rank waits for).

Waits follow progress: while the seeder answers and reports the data rank as ``pending`` or
``staging`` this node waits (up to ``fanout_wait`` seconds); a seeder that does not answer, that failed
its restore, or whose copy cannot be fetched means the bucket, at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable

from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.control import PeerAssignment, RankHoldings, RestorePlan, RestoreState, Tier
from tierckpt.protocol.errors import ContractError, RetryableError, TierckptError
from tierckpt_replicator.backup.jobs import BackupPort
from tierckpt_replicator.replication.ipc import FetchSource, FetchTask
from tierckpt_replicator.replication.plan import candidate_targets
from tierckpt_replicator.replication.supervisor import WorkerSupervisor
from tierckpt_replicator.stepio import Copy

__all__ = ["FanOut"]

log = logging.getLogger(__name__)

_POLL = 0.2
"""Seconds between questions to the seeder."""
_ASK_AT_ONCE = 16
"""Most inventories asked for copies already fanned out."""


class FanOut:
    def __init__(
        self,
        *,
        node: str,
        peers: ReplicatorClient,
        supervisor: WorkerSupervisor,
        backup: BackupPort,
        local_state: Callable[[str, int], RestoreState | None],
        local_committed: Callable[[str, int, int], bool],
        wait: float = 300.0,
    ) -> None:
        self.node, self.peers, self.supervisor, self.backup = node, peers, supervisor, backup
        self.local_state, self.local_committed = local_state, local_committed
        self.wait = wait

    async def order(self, job: str, plan: RestorePlan, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """``ranks`` with those whose data files are their own first (stable otherwise)."""
        if plan.step is None or not any(plan.sources.get(r) == Tier.GCS for r in ranks):
            return ranks
        try:
            refer = {r for r in ranks if await self.backup.data_source(job, plan.step, r) is not None}
        except (TierckptError, OSError) as exc:
            log.info("restore %s: data sources unknown (%s)", job, exc)
            return ranks
        return tuple(sorted(ranks, key=lambda r: r in refer))

    async def seed(
        self, job: str, rank: int, step: int, world_size: int, assignment: PeerAssignment | None
    ) -> tuple[int, Copy] | None:
        """The rank (and which copy of it here: its staged primary, or a replica fetched from its
        seeder) whose committed step holds ``rank``'s data files, or None: the bucket alone."""
        if assignment is None or self.wait <= 0:  # --restore-fanout-wait 0: fan-out off
            return None
        try:
            source = await self.backup.data_source(job, step, rank)
        except (TierckptError, OSError) as exc:  # e.g. the step is not complete in the bucket
            log.info("restore %s rank %d: data source of step %d unknown (%s)", job, rank, step, exc)
            return None
        if source is None:
            return None
        seeder = next(
            (n for n in assignment.nodes if source in assignment.process_ranks(n, world_size)), None
        )
        if seeder is None:
            return None
        if seeder == self.node:
            return (source, "primary") if await self._wait_local(job, source, step) else None
        if not await self._wait_committed(job, source, step, seeder, assignment):
            return None
        deadline = time.monotonic() + self.wait
        while True:
            holders = await self._holders(job, source, step, seeder, world_size, assignment)
            task = FetchTask(
                id=self.supervisor.next_id(),
                job=job,
                rank=source,
                step=step,
                sources=tuple(FetchSource.peer(assignment, n) for n in holders),
                into="replica",
            )
            try:
                result = await self.supervisor.run_task(task)
            except RetryableError as exc:
                log.info("restore %s rank %d: fan-out: %s; reading the bucket", job, rank, exc)
                return None
            if result.ok:
                got = result.outcomes[-1].node
                log.info(
                    "restore %s rank %d: rank %d's step %d came from %s (fan-out)",
                    job,
                    rank,
                    source,
                    step,
                    got,
                )
                return source, "replica"
            why = "; ".join(f"{o.node}: {o.status} {o.message}".strip() for o in result.outcomes)
            if any(o.status != "busy" for o in result.outcomes) or time.monotonic() >= deadline:
                log.info(
                    "restore %s rank %d: rank %d not fetched (%s); reading the bucket", job, rank, source, why
                )
                return None
            await asyncio.sleep(_POLL)  # every holder is serving others: one of them is free soon

    async def _holders(
        self, job: str, source: int, step: int, seeder: str, world_size: int, assignment: PeerAssignment
    ) -> list[str]:
        """Nodes to fetch ``source``'s step from: those running other members that already hold a
        copy (fetched earlier in this fan-out), ordered by a hash of this node so that the load spreads
        (a tree growing from the seeder), then the seeder."""
        others = [
            n
            for n in candidate_targets(assignment, self.node)
            if n not in (seeder, self.node) and assignment.process_ranks(n, world_size)
        ][:_ASK_AT_ONCE]

        async def holds(name: str) -> bool:
            try:
                inv = await self.peers.inventory(assignment.nodes[name].endpoint, job, node=name)
            except (RetryableError, ContractError):
                return False
            h = inv.ranks.get(source) if inv is not None else None
            return h is not None and (step in h.replica or step in h.local)

        found = [
            n for n, ok in zip(others, await asyncio.gather(*(holds(n) for n in others)), strict=True) if ok
        ]
        found.sort(key=lambda n: zlib.crc32(f"{self.node}/{n}".encode()))
        return [*found, seeder]

    async def _wait_local(self, job: str, source: int, step: int) -> bool:
        """Whether this node's own staging of ``source`` committed ``step`` (waiting while it runs)."""
        deadline = time.monotonic() + self.wait
        while not self.local_committed(job, source, step):
            state = self.local_state(job, source)
            if state not in (RestoreState.PENDING, RestoreState.STAGING) or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL)
        return True

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
