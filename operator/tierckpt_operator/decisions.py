"""A job's rank assignment and peer plan, decided from what the watches show (pure).

``JobState`` is what the operator remembers about a job, kept in the CheckpointJob status so that a
restarted operator carries on: the assignment generation (the JobSet restart attempt), the node,
failure domain and pod of every node rank, and the peer plan. ``decide_assignment`` and
``decide_peers`` turn the current pods and nodes into the next state plus the writes it needs;
``peer_assignment`` builds the ``PeerAssignment`` each replicator receives, ``job_policy`` the
``JobPolicy`` (backup bucket, schedule, retention) its CheckpointConfiguration gives the job, and
``orbax_sessions`` (Orbax mode) each node's ``OrbaxSession``: its node rank as its process id.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tierckpt.planning.placement import Placement, RankAssignment, assign_ranks, current_members, plan_peers
from tierckpt.planning.restore_plan import choose_restore
from tierckpt.protocol.contract import Annotations
from tierckpt.protocol.control import JobPolicy, NodeInventory, PeerAssignment, PeerNode, RestorePlan
from tierckpt.protocol.errors import ContractError, FormatError
from tierckpt.protocol.orbax import OrbaxSession, check_coordinator
from tierckpt_operator.jobsets import JobSetInfo
from tierckpt_operator.pods import WorkerPod
from tierckpt_operator.resources import ConfigSpec

__all__ = [
    "AssignmentDecision",
    "JobState",
    "decide_assignment",
    "decide_peers",
    "group_partners",
    "jax_coordinator",
    "job_policy",
    "orbax_sessions",
    "peer_assignment",
    "peer_views",
    "restore_plan",
]


@dataclasses.dataclass(frozen=True)
class JobState:
    """The operator's memory of one job (persisted in CheckpointJob status)."""

    generation: int | None = None
    """The restart attempt the current ranks belong to; None before the first assignment."""
    nodes: tuple[str, ...] = ()
    """Node rank -> node."""
    domains: tuple[str, ...] = ()
    """Node rank -> failure domain of its node."""
    pods: tuple[str, ...] = ()
    """Node rank -> pod."""
    peers: tuple[tuple[int, ...], ...] = ()
    """Node rank -> peer node ranks."""
    peer_generation: int = 0
    restore_generation: int | None = None
    """The attempt whose restore plan was published."""

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> JobState:
        status = status or {}
        restore = status.get("restore") or {}
        n = len(status.get("nodes") or ())

        def column(key: str) -> tuple[str, ...]:
            values = tuple(str(v) for v in status.get(key) or ())
            return values if len(values) == n else ("",) * n

        return cls(
            generation=status.get("assignmentGeneration"),
            nodes=tuple(str(v) for v in status.get("nodes") or ()),
            domains=column("domains"),
            pods=column("pods"),
            peers=tuple(tuple(int(p) for p in ps) for ps in status.get("peers") or ()),
            peer_generation=int(status.get("peerGeneration") or 0),
            restore_generation=restore.get("generation"),
        )

    def to_status(self) -> dict[str, Any]:
        return {
            "assignmentGeneration": self.generation,
            "nodes": list(self.nodes),
            "domains": list(self.domains),
            "pods": list(self.pods),
            "peers": [list(p) for p in self.peers],
            "peerGeneration": self.peer_generation,
        }

    def placements(self) -> dict[int, Placement]:
        return {
            r: Placement(node, self.domains[r] if r < len(self.domains) else "")
            for r, node in enumerate(self.nodes)
            if node
        }

    @property
    def node_ranks(self) -> dict[str, int]:
        return {node: r for r, node in enumerate(self.nodes) if node}


@dataclasses.dataclass(frozen=True)
class AssignmentDecision:
    """The outcome of one assignment round."""

    attempt: int
    scheduled: int
    needed: int
    state: JobState
    assignment: RankAssignment | None = None
    writes: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    """Pod name -> annotations to write."""
    problem: str = ""
    coordinator: str = ""
    """The address of the pod holding node rank 0 (``tierckpt.io/coordinator``)."""
    coordinator_ip: str = ""
    """The IP of that pod ("" until it runs): the JAX coordinator of an Orbax-mode job, as on GKE (a pod's
    DNS name needs search domains that not every resolver reads)."""
    suspects: tuple[str, ...] = ()
    """Pods that share their rank of the current attempt with another scheduled pod: one of each pair
    may be gone from the API with its deletion never seen (a watch event lost), so they are looked up."""

    @property
    def complete(self) -> bool:
        return self.assignment is not None


def decide_assignment(
    info: JobSetInfo,
    pods: Iterable[WorkerPod],
    state: JobState,
    domains: Mapping[str, str],
) -> AssignmentDecision:
    """Assign node ranks once every pod of the current attempt is scheduled.

    Pods of older attempts are ignored; a rank delivered in this attempt is kept; otherwise ranks
    stick to the nodes that hold them (``tierckpt.planning.placement.assign_ranks``).
    """
    mine = [p for p in pods if p.job_key == info.key]
    workers = [w for p in mine if (w := p.as_worker(info.shape)) is not None]
    attempt, members = current_members(workers, info.restarts)
    n = info.world_size
    if len(members) != n or len({m.initial_rank for m in members}) != n:
        problem = "" if len(members) <= n else f"{len(members)} scheduled pods for {n} ranks"
        per_rank = collections.Counter(m.initial_rank for m in members)
        suspects = tuple(sorted(m.pod for m in members if per_rank[m.initial_rank] > 1))
        return AssignmentDecision(attempt, len(members), n, state, problem=problem, suspects=suspects)
    try:
        assignment = assign_ranks(n, members, state.placements(), domains)
    except ContractError as exc:
        return AssignmentDecision(attempt, len(members), n, state, problem=str(exc))
    by_name = {p.name: p for p in mine}
    rank0 = next((by_name[pod] for pod, r in assignment.ranks.items() if r == 0), None)
    coordinator = rank0.address if rank0 is not None else ""
    writes = {}
    for pod, rank in assignment.ranks.items():
        want = {
            Annotations.NODE_RANK: str(rank),
            Annotations.NUM_NODES: str(n),
            Annotations.ASSIGNMENT_GENERATION: str(attempt),
            Annotations.COORDINATOR: coordinator,
        }
        p = by_name[pod]
        if (p.rank, p.rank_generation, p.coordinator) != (rank, attempt, coordinator) or p.num_nodes != n:
            writes[pod] = want
    pods_by_rank = [""] * n
    for pod, rank in assignment.ranks.items():
        pods_by_rank[rank] = pod
    new_state = dataclasses.replace(
        state,
        generation=attempt,
        nodes=assignment.nodes,
        domains=tuple(domains.get(node, "") for node in assignment.nodes),
        pods=tuple(pods_by_rank),
    )
    return AssignmentDecision(
        attempt,
        len(members),
        n,
        new_state,
        assignment,
        writes,
        coordinator=coordinator,
        coordinator_ip=rank0.ip if rank0 is not None else "",
    )


def jax_coordinator(address: str, port: int) -> str | None:
    """The JAX coordinator ``host:port`` on the pod at ``address`` (None: no usable address yet)."""
    host = f"[{address}]" if ":" in address else address
    try:
        return check_coordinator(f"{host}:{port}")
    except FormatError:
        return None


def orbax_sessions(job: str, state: JobState, coordinator: str) -> dict[str, OrbaxSession]:
    """Orbax mode: each node's session for the state's restart attempt. A node's process id is its node
    rank, which sticks to the node that holds the rank's data: so does the process id."""
    n = len(state.nodes)
    return {
        node: OrbaxSession(
            job=job,
            node=node,
            generation=state.generation or 0,
            process_id=rank,
            num_processes=n,
            coordinator=coordinator,
        )
        for rank, node in enumerate(state.nodes)
        if node
    }


def decide_peers(
    state: JobState, k: int, partners: Sequence[Sequence[int]] = ()
) -> tuple[tuple[int, ...], ...]:
    """The peer plan for the state's ranks, keeping the previous plan's still-valid edges; nodes that
    host other members of a rank's replica groups (``partners``, see ``group_partners``) first.

    Every reconcile of a job asks for it, and a plan of thousands of nodes takes tens of milliseconds
    (hundreds on a busy machine) while its inputs rarely change: the last few plans are kept, by their
    inputs (``plan_peers`` is pure)."""
    previous = tuple(tuple(p) for p in state.peers) if len(state.peers) == len(state.domains) else ()
    partners = tuple(tuple(p) for p in partners) if len(partners) == len(state.domains) else ()
    return _planned_peers(tuple(state.domains), k, previous, partners)


@functools.lru_cache(maxsize=16)
def _planned_peers(
    domains: tuple[str, ...],
    k: int,
    previous: tuple[tuple[int, ...], ...],
    partners: tuple[tuple[int, ...], ...],
) -> tuple[tuple[int, ...], ...]:
    return plan_peers(domains, k, previous, partners)


def group_partners(inventories: Iterable[NodeInventory], nodes: int) -> tuple[tuple[int, ...], ...]:
    """Node rank -> the other node ranks running members of its ranks' replica groups, from the
    replicators' inventories (process rank ``p`` of a step of world size ``w`` runs on node rank
    ``p // (w // nodes)``, torchrun's contiguous blocks). Members whose saves diverged are left out:
    they hold other bytes. () when no inventory reports a group."""
    out: list[set[int]] = [set() for _ in range(nodes)]
    found = False
    for inv in inventories:
        for c in inv.contents:
            world = inv.world_sizes.get(c.step, 0)
            if c.copy != "local" or c.diverged or nodes <= 0 or world < nodes or world % nodes:
                continue
            per = world // nodes
            mine = c.rank // per
            if mine >= nodes:
                continue
            found = True
            out[mine] |= {m // per for m in c.members if m // per != mine and m // per < nodes}
    return tuple(tuple(sorted(s)) for s in out) if found else ()


def job_policy(job: str, spec: ConfigSpec, generation: int = 0) -> JobPolicy:
    """The policy the replicators of ``job`` follow, from its CheckpointConfiguration."""
    return JobPolicy(
        job=job,
        generation=generation,
        bucket=spec.bucket,
        prefix=spec.prefix,
        backup_interval_steps=spec.backup.interval_steps,
        backup_interval_minutes=float(spec.backup.interval_minutes),
        keep_last=spec.backup.retention.keep_last,
        keep_every=spec.backup.retention.keep_every,
        replication_factor=spec.replication_factor,
        erasure_data=spec.erasure_data,
        erasure_parity=spec.erasure_parity,
        delete_backups_on_deletion=spec.delete_backups,
        quota_bytes=spec.ramdisk_bytes,
        config=spec.name,
    )


def restore_plan(
    job: str, state: JobState, inventories: Sequence[NodeInventory], world_size: int | None, decided_at: float
) -> RestorePlan:
    """The restore plan of the state's attempt from the nodes' inventories (steps of ``world_size``
    ranks; None: any). Its generation is the attempt, which every peer assignment of the attempt names
    (``PeerAssignment.attempt``): a replicator stages it under any of them (``RestorePlan.stands_for``)."""
    return choose_restore(
        inventories, world_size, job=job, generation=state.generation or 0, decided_at=decided_at
    )


def peer_assignment(job: str, state: JobState, endpoints: Mapping[str, str]) -> PeerAssignment:
    """The whole job's ``PeerAssignment``: every node, its peers and its node rank."""
    return _assignment(job, state, endpoints, range(len(state.nodes)), None)


def peer_views(
    job: str,
    state: JobState,
    endpoints: Mapping[str, str],
    partners: Sequence[Sequence[int]] = (),
    previous: Mapping[str, PeerAssignment] | None = None,
) -> dict[str, PeerAssignment]:
    """Each node's own view of the plan (a few kilobytes each, O(nodes x peers^2) in all): itself and
    its peers; the nodes that send to it and their peers (the holders of every rank it holds, from
    which it computes its share of a backup); the nodes running other members of its ranks' replica
    groups (``partners``). ``num_nodes`` says how many node ranks the job has.

    For big jobs, where the whole map would be megabytes sent to every node. ``previous``: the views of
    the last plan; a node whose view says the same keeps that view (with its generation): one node
    replaced changes a handful of views, and making all 4,096 again took about 0.3 s of a replacement.
    """
    senders: list[list[int]] = [[] for _ in state.nodes]
    for r, ps in enumerate(state.peers):
        for p in ps:
            senders[p].append(r)
    partners = partners if len(partners) == len(state.nodes) else ()
    out = {}
    for r, node in enumerate(state.nodes):
        givers = sorted({r, *senders[r]})
        ranks = {*givers, *(p for g in givers for p in state.peers[g]), *(partners[r] if partners else ())}
        old = previous.get(node) if previous else None
        if old is not None and _says(old, job, state, endpoints, ranks, givers):
            out[node] = old
        else:
            out[node] = _assignment(job, state, endpoints, sorted(ranks), givers)
    return out


def _says(
    view: PeerAssignment,
    job: str,
    state: JobState,
    endpoints: Mapping[str, str],
    ranks: set[int],
    givers: Sequence[int],
) -> bool:
    """Whether ``view`` holds what ``_assignment`` would make of these ranks and givers (but for the
    generation), without making it."""
    if (view.job, view.attempt, view.num_nodes) != (job, state.generation or 0, len(state.nodes)):
        return False
    if len(view.node_ranks) != len(ranks) or len(view.peers) != len(givers) or len(view.nodes) != len(ranks):
        return False
    for r in ranks:
        name = state.nodes[r]
        known = view.nodes.get(name)
        if view.node_ranks.get(name) != r or known is None:
            return False
        if (known.endpoint, known.domain) != (endpoints.get(name, ""), state.domains[r]):
            return False
    return all(
        view.peers.get(state.nodes[g]) == tuple(state.nodes[p] for p in state.peers[g]) for g in givers
    )


def _assignment(
    job: str,
    state: JobState,
    endpoints: Mapping[str, str],
    ranks: Iterable[int],
    givers: Sequence[int] | None,
) -> PeerAssignment:
    """The plan's ``ranks`` (their nodes and node ranks) and the peers of ``givers`` (None: of all)."""
    ranks = list(ranks)
    nodes = {
        state.nodes[r]: PeerNode(state.nodes[r], endpoints.get(state.nodes[r], ""), state.domains[r])
        for r in ranks
    }
    senders = range(len(state.nodes)) if givers is None else givers
    peers = {state.nodes[r]: tuple(state.nodes[p] for p in state.peers[r]) for r in senders}
    return PeerAssignment(
        job=job,
        generation=state.peer_generation,
        nodes=nodes,
        peers=peers,
        node_ranks={state.nodes[r]: r for r in ranks},
        num_nodes=0 if givers is None else len(state.nodes),
        attempt=state.generation or 0,
    )
