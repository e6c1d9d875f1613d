"""The operator's part in a chaos run, through the replicators' documented control API.

What ``tierckpt_operator``'s reconcile does for a JobSet attempt, in its order, with the same pure
decisions (``tierckpt.planning``) and the same client (``tierckpt.protocol.client``): node ranks kept on
the nodes that hold them (``assign_ranks``), the job's policy (its CheckpointConfiguration: backup
schedule, retention, replication factor, quota) to every node of the job, the peer plan
(``plan_peers``, keeping the previous plan's edges; replica-group partners first) as a new
generation in milliseconds naming the attempt, then the restore plan from every node's inventory
(``choose_restore``, generation = the attempt, the scale ``RestorePlan.stands_for`` compares). A
purge goes to every node's replicator, then one deletes the backups, as
``tierckpt_operator.cleanup.purge_job`` does.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tierckpt.planning.placement import Member, Placement, assign_ranks, plan_peers
from tierckpt.planning.restore_plan import BUCKET_PATIENCE, bucket_unknown, choose_restore
from tierckpt.protocol.control import JobPolicy, NodeInventory, PeerAssignment, PeerNode, RestorePlan
from tierckpt_demo.chaos.jobs import EVERY, JobRun
from tierckpt_demo.chaos.rig import Rig
from tierckpt_demo.cluster import Node

__all__ = ["BACKUP_EVERY", "KEEP_LAST", "Operator"]

log = logging.getLogger(__name__)

T = TypeVar("T")

BACKUP_EVERY = 2 * EVERY
"""The jobs' backup schedule: a step is due once this many steps passed since the newest complete one."""
KEEP_LAST = 3
CALL_ATTEMPTS = 5
PURGE_TIMEOUT = 420.0
PURGE_HEDGE = 30.0
"""As the operator's ``BACKUP_PURGE_HEDGE``: the next node is asked too after this long with no answer."""
_HEDGED = 3


class Operator:
    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.api = rig.cluster.api
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="chaos-operator")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- an attempt

    def assign(self, job: JobRun, nodes: list[str]) -> None:
        """Give ``job`` its node ranks on ``nodes`` (one training pod each), keeping every rank on the node
        that ran it; ``job.nodes`` becomes the new rank order."""
        previous = {r: Placement(n, self.rig.node(n).domain) for r, n in enumerate(job.nodes)}
        members = [Member(pod=f"{job.job_id}-{n}", node=n, initial_rank=i) for i, n in enumerate(nodes)]
        domains = {n: self.rig.node(n).domain for n in nodes}
        job.nodes = list(assign_ranks(len(nodes), members, previous, domains).nodes)
        if len(job.peers) != len(job.nodes):
            job.peers = ()

    def policy(self, job: JobRun) -> JobPolicy:
        return JobPolicy(
            job=job.job_id,
            generation=job.policy_generation,
            backup_interval_steps=BACKUP_EVERY,
            backup_interval_minutes=0.0,
            keep_last=KEEP_LAST,
            replication_factor=job.factor,
            quota_bytes=self.rig.ramdisk_bytes,
            config="chaos",
        )

    def publish_policy(self, job: JobRun, *, changed: bool = False) -> None:
        """The policy to every node of the job (a new generation when ``changed``, or the first time)."""
        if changed or job.policy_generation == 0:
            job.policy_generation = max(job.policy_generation + 1, int(time.time() * 1000))
        policy = self.policy(job)
        self._each(job.nodes, lambda n: self.api.put_policy(n.endpoint, policy, node=n.name))

    def publish_peers(self, job: JobRun) -> PeerAssignment:
        domains = [self.rig.node(n).domain for n in job.nodes]
        partners: tuple[tuple[int, ...], ...] = ()
        if job.name == "native":  # its ranks are one replica group: every node holds the same bytes
            partners = tuple(tuple(p for p in range(job.world) if p != r) for r in range(job.world))
        job.peers = plan_peers(domains, job.factor, job.peers, partners)
        job.peer_generation = max(job.peer_generation + 1, int(time.time() * 1000))
        assignment = PeerAssignment(
            job=job.job_id,
            generation=job.peer_generation,
            nodes={
                n: PeerNode(name=n, endpoint=self.rig.node(n).peer_endpoint, domain=self.rig.node(n).domain)
                for n in job.nodes
            },
            peers={job.nodes[r]: tuple(job.nodes[p] for p in ps) for r, ps in enumerate(job.peers)},
            node_ranks={n: r for r, n in enumerate(job.nodes)},
            procs_per_node=1,
            attempt=job.attempt,
        )
        self._each(job.nodes, lambda n: self.api.put_peers(n.endpoint, assignment, node=n.name))
        return assignment

    def inventories(self, job: JobRun) -> list[NodeInventory]:
        found = self._each(
            job.nodes, lambda n: self.api.inventory(n.endpoint, job.job_id, node=n.name), strict=False
        )
        return [inv for inv in found if isinstance(inv, NodeInventory)]

    def publish_plan(self, job: JobRun) -> RestorePlan:
        invs = self.inventories(job)
        deadline = time.monotonic() + BUCKET_PATIENCE
        while bucket_unknown(invs) and time.monotonic() < deadline:  # as the operator waits
            time.sleep(1.0)
            invs = self.inventories(job)
        plan = choose_restore(invs, job=job.job_id, generation=job.attempt, decided_at=time.time())
        self._each(job.nodes, lambda n: self.api.put_restore_plan(n.endpoint, plan, node=n.name))
        return plan

    # ---------------------------------------------------------------- other duties

    def backup_in_background(self, job: JobRun) -> list[concurrent.futures.Future[Any]]:
        """Ask every node of the job to back it up now (a preemption notice), without waiting."""
        return [
            self._pool.submit(self.api.backup, self.rig.node(n).endpoint, job.job_id, timeout=60, node=n)
            for n in job.nodes
        ]

    def purge(self, job_id: str) -> list[str]:
        """Purge the job on every node, then its backups through one of them; the failures, if any."""
        nodes = self.rig.nodes
        results = self._each(
            [n.name for n in nodes],
            lambda n: self.api.purge(n.endpoint, job_id, timeout=120, node=n.name),
            strict=False,
        )
        failed = [f"{n.name}: {r}" for n, r in zip(nodes, results, strict=True) if isinstance(r, Exception)]
        return failed + self._delete_backups(job_id, list(nodes))

    def _delete_backups(self, job_id: str, queue: list[Node]) -> list[str]:
        """The backups through one node, as the operator deletes them (``cleanup.delete_backups``): the
        next node is asked when one fails, or has not answered within ``PURGE_HEDGE`` seconds (at most
        ``_HEDGED`` at once); the first success ends it. The failures on the way."""
        failed: list[str] = []
        asking: dict[concurrent.futures.Future[Any], Node] = {}
        while queue or asking:
            if queue and len(asking) < _HEDGED:
                node = queue.pop(0)
                call = functools.partial(
                    self.api.purge, node.endpoint, job_id, backups=True, timeout=PURGE_TIMEOUT, node=node.name
                )
                asking[self._pool.submit(call)] = node
            more = bool(queue) and len(asking) < _HEDGED
            done, _ = concurrent.futures.wait(
                asking, timeout=PURGE_HEDGE if more else None, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                node = asking.pop(future)
                if future.exception() is None:
                    return failed
                failed.append(f"backups through {node.name}: {future.exception()}")
        return failed

    # ---------------------------------------------------------------- calls

    def _each(
        self, names: list[str], call: Callable[[Node], T], *, strict: bool = True
    ) -> list[T | Exception]:
        """``call`` on every named node at once, each retried a few times (a restarting replicator);
        raises the first failure when ``strict``."""

        def one(name: str) -> T | Exception:
            node = self.rig.node(name)
            error: Exception = RuntimeError("no attempt")
            for attempt in range(CALL_ATTEMPTS):
                try:
                    return call(node)
                except Exception as exc:
                    error = exc
                    time.sleep(0.5 * (attempt + 1))
            return error

        results = list(self._pool.map(one, names))
        if strict:
            for name, r in zip(names, results, strict=True):
                if isinstance(r, Exception):
                    raise RuntimeError(f"{name}: {r}") from r
        return results
