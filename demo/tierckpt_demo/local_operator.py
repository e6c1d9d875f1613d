"""The demo's stand-in for the operator: peers, restore plans and backups, through the control API.

On Kubernetes the operator plans peers and restore plans and sends them to each node's replicator;
in the local demo this class does the same, with the same pure planning code (``tierckpt.planning.placement``,
``tierckpt.planning.restore_plan``) and the same client of the replicators' API (``tierckpt.protocol.client``,
the cluster's ``api``), so the replicators cannot tell the difference. A refused or failed call raises
``tierckpt.protocol.client.ReplicatorError``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from tierckpt.planning.placement import Member, Placement, assign_ranks, plan_node_peers
from tierckpt.planning.restore_plan import choose_restore
from tierckpt.protocol.control import (
    BackupResult,
    NodeInventory,
    PeerAssignment,
    PeerNode,
    RestorePlan,
    RestoreStatus,
    read_restore_status,
)
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.orbax import OrbaxSession

__all__ = ["LocalOperator"]

BUCKET_PREFIX = "tierckpt"
"""The replicators' default ``--gcs-prefix``."""


class LocalOperator:
    """Operator duties for one job on a ``LocalCluster``: ``procs_per_node`` process ranks on each of the
    job's nodes (all of the cluster's, until ``shrink`` drops some)."""

    def __init__(
        self,
        cluster: Any,
        job: str,
        *,
        wait: Callable[[Callable[[], Any], str, float], Any],
        procs_per_node: int = 1,
    ) -> None:
        """``wait(predicate, what, interval)`` polls until ``predicate()`` is true (the caller's deadline)."""
        self.cluster, self.job, self._wait = cluster, job, wait
        self.procs_per_node = procs_per_node
        self.nodes: list[Any] = list(cluster.nodes)
        """The nodes the job runs on, in node-rank order."""
        self.assignment: PeerAssignment | None = None

    def ranks_of(self, node: Any) -> range:
        """The process ranks ``node`` runs now (its node rank's block)."""
        n, p = self.nodes.index(node), self.procs_per_node
        return range(n * p, (n + 1) * p)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.procs_per_node

    def assign_peers(self, k: int, generation: int = 2) -> PeerAssignment:
        """Peers from ``tierckpt.planning.placement`` across the nodes' failure domains, sent to every
        replicator of the job (and written where a restarted replicator reads its static assignment)."""
        nodes = self.nodes
        self.assignment = PeerAssignment(
            job=self.job,
            generation=generation,
            nodes={n.name: PeerNode(name=n.name, endpoint=n.peer_endpoint, domain=n.domain) for n in nodes},
            peers=plan_node_peers({n.name: n.domain for n in nodes}, k),
            node_ranks={n.name: i for i, n in enumerate(nodes)},
            procs_per_node=self.procs_per_node,
            attempt=generation,  # each assignment here starts an attempt
        )
        self.cluster.peers_file.write_bytes(self.assignment.to_bytes())
        for node in nodes:
            self.cluster.api.put_peers(node.endpoint, self.assignment, node=node.name)
        return self.assignment

    def shrink(self, lost: list[str], k: int) -> PeerAssignment:
        """The job goes on without the ``lost`` nodes (a smaller world): a new assignment for the rest."""
        assert self.assignment is not None
        self.nodes = [n for n in self.nodes if n.name not in lost]
        return self.assign_peers(k, self.assignment.generation + 1)

    def place(self, pods: dict[str, tuple[Any, int]]) -> dict[str, int]:
        """A restart whose ``pods`` (name -> the node it landed on and its initial rank, as the JobSet's
        indices give it) run the job: node ranks stick to the nodes that hold their data
        (``tierckpt.planning.placement.assign_ranks``, the operator's own). Returns pod -> node rank; the
        job's nodes are in the new rank order from then on (send the assignment with ``assign_peers``)."""
        previous = {i: Placement(n.name, n.domain) for i, n in enumerate(self.nodes)}
        members = [Member(pod=pod, node=node.name, initial_rank=r) for pod, (node, r) in pods.items()]
        domains = {node.name: node.domain for node, _ in pods.values()}
        assignment = assign_ranks(len(pods), members, previous, domains)
        by_name = {node.name: node for node, _ in pods.values()}
        self.nodes = [by_name[name] for name in assignment.nodes]
        return dict(assignment.ranks)

    def orbax_sessions(self, port: int = 8476) -> list[OrbaxSession]:
        """Orbax mode, as the operator does for each restart attempt: every node's session (its node rank
        as its process id; process 0's node at ``port`` as the JAX coordinator), with the assignment's
        attempt (its restore plan carries the same)."""
        assert self.assignment is not None
        coordinator = f"{self.nodes[0].ip}:{port}"
        sessions = []
        for rank, node in enumerate(self.nodes):
            session = OrbaxSession(
                job=self.job,
                node=node.name,
                generation=self.assignment.attempt,
                process_id=rank,
                num_processes=len(self.nodes),
                coordinator=coordinator,
            )
            self.cluster.api.put_orbax_session(node.endpoint, session, node=node.name)
            sessions.append(session)
        return sessions

    def inventories(self) -> list[NodeInventory]:
        api = self.cluster.api
        found = [api.inventory(n.endpoint, self.job, node=n.name) for n in self.nodes]
        return [inv for inv in found if inv is not None]

    def replicated(self, step: int) -> bool:
        """Whether every rank's ``step`` is on every one of its node's peers."""
        assert self.assignment is not None
        inv = {i.node: i for i in self.inventories()}
        for node in self.nodes:
            for peer in self.assignment.peers.get(node.name, ()):
                for rank in self.ranks_of(node):
                    holding = inv[peer].ranks.get(rank)
                    if holding is None or step not in holding.replica:
                        return False
        return True

    def backup(self, step: int, timeout: float) -> str:
        """Ask every node to back up its share of the newest step now (as a preemption notice would);
        wait until ``step`` is complete in the bucket. Returns its completion object's URL."""
        from tierckpt.protocol.bucket_layout import BucketLayout

        def one(node: Any) -> BackupResult:
            return self.cluster.api.backup(node.endpoint, self.job, timeout=timeout, node=node.name)  # type: ignore[no-any-return]

        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(one, self.nodes))
        bucket = self.cluster.gcs.client().bucket(self.cluster.bucket)
        key = BucketLayout(BUCKET_PREFIX).complete_key(self.job, step)
        url = f"gs://{self.cluster.bucket}/{key}"
        self._wait(lambda: bucket.blob(key).exists(), url, 0.25)
        return url

    def publish_plan(self, world_size: int | None) -> tuple[RestorePlan, float]:
        """The restore plan from every node's inventory (steps of ``world_size`` ranks; None: any), sent
        to every node; returns it with the time it was decided, once every node has started staging."""
        assert self.assignment is not None
        at = time.time()
        plan = choose_restore(
            self.inventories(), world_size, job=self.job, generation=self.assignment.attempt, decided_at=at
        )
        for node in self.nodes:
            self.cluster.api.put_restore_plan(node.endpoint, plan, node=node.name)
        self._wait(lambda: self._staging_started(at), "the replicators to start staging", 0.1)
        return plan, at

    def _staging_started(self, since: float) -> bool:
        for node in self.nodes:
            for rank in self.ranks_of(node):
                try:
                    st = read_restore_status(node.root, self.job, rank)
                except FormatError:
                    return False
                if not isinstance(st, RestoreStatus) or st.updated_at < since:
                    return False
        return True
