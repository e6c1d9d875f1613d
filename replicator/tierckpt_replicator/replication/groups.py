"""Replica groups as the replication loop sees them: the peers' group contents, what to hold back, and
the bytes each step saved.

``GroupTracker`` keeps the peers' ``NodeInventory.contents`` (asked in the background, at most every
``refresh_every`` seconds per job while a rank's newest step still has peers to reach) and answers,
through the pure ``replication.dedup`` functions, which peers hold an identical member step of each
rank (send only the small files there) and which ranks to hold back for up to ``wait`` seconds after
their commit, because a node running another member of the group has not reported the step yet (its
copy is probably about to commit: waiting saves a whole transfer). Members whose content differs are
logged once per step and counted (``tierckpt_replicator_replica_group_diverged``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.control import PeerAssignment, StepBytes, StepContent
from tierckpt.protocol.errors import ContractError, RetryableError
from tierckpt_replicator.inventory import Holdings
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.replication.dedup import awaiting_members, differing, linkable_targets, member_nodes
from tierckpt_replicator.replication.ipc import Outcome
from tierckpt_replicator.replication.plan import candidate_targets

__all__ = ["GroupTracker"]

log = logging.getLogger(__name__)

_ASK_AT_ONCE = 16
"""Most peer inventories asked per refresh."""


class GroupTracker:
    def __init__(
        self,
        *,
        node: str,
        peers: ReplicatorClient,
        metrics: Metrics,
        kick: Callable[[], None],
        wait: float = 3.0,
        refresh_every: float = 0.5,
    ) -> None:
        self.node, self.peers, self.metrics, self.kick = node, peers, metrics, kick
        self.wait, self.refresh_every = wait, refresh_every
        self._contents: dict[str, dict[str, tuple[StepContent, ...]]] = {}
        self._asked_at: dict[str, float] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._reported: set[tuple[str, int, int]] = set()
        self._diverged: dict[str, tuple[int, ...]] = {}
        self._groups: dict[str, tuple[str, ...]] = {}
        self._bytes: dict[str, StepBytes] = {}

    async def close(self) -> None:
        for task in self._refreshing.values():
            task.cancel()
        await asyncio.gather(*self._refreshing.values(), return_exceptions=True)

    def plan(
        self, job: str, assignment: PeerAssignment, holdings: Holdings, pending: Collection[int]
    ) -> tuple[dict[int, dict[str, int]], set[int]]:
        """For the local ranks in ``pending`` (newest step still short of copies): rank -> peers
        holding an identical member step (peer -> that member's rank), and the ranks to hold back."""
        newest = holdings.newest_local()
        mine = {
            c.rank: c
            for c in holdings.contents
            if c.copy == "local" and newest.get(c.rank) == c.step and c.rank in pending
        }
        self._account_written(job, holdings)
        if not mine:
            return {}, set()
        peers = self._contents.get(job, {})
        linkable: dict[int, dict[str, int]] = {}
        hold: set[int] = set()
        stale = False
        members: set[str] = set()
        now = time.time()
        for rank, content in mine.items():
            self._report_differing(job, content, peers)
            targets = linkable_targets(content, self.node, peers)
            if targets:
                linkable[rank] = targets
            world = holdings.world_sizes.get(content.step, 0)
            nodes = member_nodes(content, assignment, world)
            members |= set(nodes.values())
            waiting = awaiting_members(content, self.node, nodes, peers)
            if waiting and not content.diverged:
                stale = True
                if not targets and now - holdings.newest_commit_at.get(rank, now) < self.wait:
                    hold.add(rank)
        if stale or job not in self._contents:
            self._refresh(job, assignment, members)
        return linkable, hold

    def record(self, job: str, step: int, outcomes: Sequence[Outcome]) -> None:
        """Count the bytes of finished sends of ``step`` (this node's newest, the one accounted)."""
        sent = sum(o.bytes for o in outcomes if o.status == "ok")
        saved = sum(o.saved for o in outcomes if o.status == "ok")
        if saved:
            self.metrics.dedup_bytes.inc(saved)
        acc = self._bytes.get(job)
        if acc is None or acc.step != step:
            return
        acc = dataclasses.replace(
            acc, replicated=acc.replicated + sent, replicated_logical=acc.replicated_logical + sent + saved
        )
        self._bytes[job] = acc
        self._export(job, acc)

    def step_bytes(self, job: str) -> StepBytes | None:
        return self._bytes.get(job)

    def diverged(self, job: str) -> tuple[int, ...]:
        return self._diverged.get(job, ())

    def groups(self, job: str) -> tuple[str, ...]:
        return self._groups.get(job, ())

    def forget(self, job: str) -> None:
        for state in (self._contents, self._asked_at, self._diverged, self._groups, self._bytes):
            state.pop(job, None)
        self._reported = {k for k in self._reported if k[0] != job}

    # ------------------------------------------------------------------ internals

    def _account_written(self, job: str, holdings: Holdings) -> None:
        """The newest local step's accounting: written against logical bytes, recounted on every pass
        (the node's ranks commit one after another); the replicated bytes of the step are kept."""
        newest = holdings.newest_local()
        if not newest:
            return
        step = max(newest.values())
        local = [c for c in holdings.contents if c.copy == "local" and c.step == step]
        self._groups[job] = tuple(sorted({c.group for c in local}))
        if not local:
            self._bytes.pop(job, None)
            return
        prev = self._bytes.get(job)
        acc = StepBytes(
            step=step,
            written=sum(c.written_bytes for c in local),
            written_logical=sum(c.logical_bytes for c in local),
        )
        if prev is not None and prev.step == step:
            if (prev.written, prev.written_logical) == (acc.written, acc.written_logical):
                return
            acc = dataclasses.replace(prev, written=acc.written, written_logical=acc.written_logical)
        self._bytes[job] = acc
        self._export(job, acc)

    def _export(self, job: str, acc: StepBytes) -> None:
        for kind in ("written", "written_logical", "replicated", "replicated_logical"):
            self.metrics.group_bytes.labels(job, kind).set(getattr(acc, kind))

    def _report_differing(
        self, job: str, content: StepContent, peers: Mapping[str, Sequence[StepContent]]
    ) -> None:
        others = differing(content, peers)
        if not content.diverged and not others:
            return
        self._diverged[job] = tuple(sorted(set(self._diverged.get(job, ())) | {content.rank}))
        key = (job, content.rank, content.step)
        if key in self._reported:
            return
        self._reported.add(key)
        self.metrics.group_diverged.labels(job).inc()
        where = f" (on {', '.join(sorted(set(others.values())))})" if others else ""
        log.warning(
            "job %s rank %d step %d: replica group %s members %s hold other content%s; "
            "keeping every copy, not deduplicating",
            job,
            content.rank,
            content.step,
            content.group,
            sorted(others) or [m for m in content.members if m != content.rank],
            where,
        )

    def _refresh(self, job: str, assignment: PeerAssignment, members: Collection[str]) -> None:
        running = self._refreshing.get(job)
        if running is not None and not running.done():
            return
        if time.monotonic() - self._asked_at.get(job, -1e9) < self.refresh_every:
            return
        self._asked_at[job] = time.monotonic()
        # The nodes running other members, nearest first (assigned peers, then other domains), at most
        # _ASK_AT_ONCE: a DDP group of thousands of nodes needs a few identical copies, not all.
        names = [
            n
            for n in candidate_targets(assignment, self.node)
            if n in members and assignment.nodes[n].endpoint
        ][:_ASK_AT_ONCE]
        self._refreshing[job] = asyncio.create_task(self._ask(job, assignment, names), name=f"groups-{job}")

    async def _ask(self, job: str, assignment: PeerAssignment, names: Sequence[str]) -> None:

        async def one(name: str) -> tuple[str, tuple[StepContent, ...]] | None:
            try:
                inv = await self.peers.inventory(assignment.nodes[name].endpoint, job, node=name)
            except (RetryableError, ContractError) as exc:
                log.debug("replica groups: inventory of %s: %s", name, exc)
                return None
            return (name, inv.contents) if inv is not None else None

        answers = await asyncio.gather(*(one(n) for n in names))
        known = dict(self._contents.get(job, {}))
        known.update(a for a in answers if a is not None)
        self._contents[job] = known
        self.kick()
