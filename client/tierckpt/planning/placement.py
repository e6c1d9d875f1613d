"""Node-rank assignment and peer planning for a job's nodes (pure: no I/O, no Kubernetes).

Used by the operator and by the local demo, so both place ranks and peers the same way.

Ranks (``assign_ranks``)
    A node rank belongs to the node that holds its shards. After a restart the pod that lands on
    that node takes the rank again; a replacement node inherits a vacated rank, in the vacated
    rank's failure domain where possible; a rank that never had a node goes to the pod whose
    JobSet indices give it as the *initial rank* (``JobShape.initial_rank``). Pods of an earlier
    restart attempt never take a rank (``current_members``).

Peers (``plan_peers``)
    Every node rank sends replicas of its shards to ``k`` peer ranks: in other failure domains
    whenever possible, spread over distinct domains, balanced (least-loaded receivers first),
    deterministic, and kept from the previous plan wherever still valid, so replacing a node
    changes only the edges that touch it. Peers are planned in rank space: ranks stick to nodes,
    so a node replaced inside its failure domain leaves the plan unchanged. With replica groups
    (``partners``: the node ranks hosting other members of a rank's groups), those nodes come first,
    least loaded first and under the same domain rules: they already hold identical data, so a replica
    there costs no transfer.

Both functions run in well under a second for 10,000 nodes (bench/operator_bench.py).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from tierckpt.protocol.errors import ContractError

__all__ = [
    "JobShape",
    "Member",
    "Placement",
    "RankAssignment",
    "ReplicatedJob",
    "Worker",
    "assign_ranks",
    "current_members",
    "peer_churn",
    "plan_node_peers",
    "plan_peers",
]


# ------------------------------------------------------------------------------------------ shape


@dataclasses.dataclass(frozen=True)
class ReplicatedJob:
    """One ``spec.replicatedJobs[]`` entry of a JobSet: ``replicas`` Indexed Jobs of ``parallelism`` pods."""

    name: str
    replicas: int
    parallelism: int

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.parallelism < 1:
            raise ContractError(
                f"replicatedJob {self.name!r}: replicas must be >= 0 and parallelism >= 1 "
                f"(got {self.replicas} and {self.parallelism})"
            )


@dataclasses.dataclass(frozen=True)
class JobShape:
    """The node ranks of a JobSet: one per pod, ``sum(replicas * parallelism)`` in all."""

    replicated_jobs: tuple[ReplicatedJob, ...]

    @property
    def world_size(self) -> int:
        return sum(rj.replicas * rj.parallelism for rj in self.replicated_jobs)

    @property
    def homogeneous(self) -> bool:
        return len({rj.parallelism for rj in self.replicated_jobs}) <= 1

    def offset(self, replicated_job: str) -> int:
        """The first rank of a replicatedJob: the pods of all earlier replicatedJobs come first."""
        start = 0
        for rj in self.replicated_jobs:
            if rj.name == replicated_job:
                return start
            start += rj.replicas * rj.parallelism
        raise ContractError(f"no replicatedJob named {replicated_job!r} in this JobSet")

    def initial_rank(
        self,
        replicated_job: str,
        job_index: int,
        completion_index: int,
        job_global_index: int | None = None,
    ) -> int:
        """The rank a pod gets when no node holds data for it yet.

        ``job_global_index * parallelism + completion_index`` when every replicatedJob has the same
        parallelism and the JobSet stamped the global index; otherwise the offset of the pod's
        replicatedJob plus ``job_index * parallelism + completion_index`` (the same number when both
        apply, since JobSet numbers jobs globally in replicatedJob order).
        """
        rj = next((r for r in self.replicated_jobs if r.name == replicated_job), None)
        if rj is None:
            raise ContractError(f"no replicatedJob named {replicated_job!r} in this JobSet")
        if not 0 <= job_index < rj.replicas:
            raise ContractError(
                f"job index {job_index} out of range for {rj.name!r} ({rj.replicas} replicas)"
            )
        if not 0 <= completion_index < rj.parallelism:
            raise ContractError(
                f"completion index {completion_index} out of range for {rj.name!r} "
                f"(parallelism {rj.parallelism})"
            )
        if job_global_index is not None and self.homogeneous:
            rank = job_global_index * rj.parallelism + completion_index
        else:
            rank = self.offset(rj.name) + job_index * rj.parallelism + completion_index
        if not 0 <= rank < self.world_size:
            raise ContractError(f"initial rank {rank} out of range (world size {self.world_size})")
        return rank


# ------------------------------------------------------------------------------------------ ranks


@dataclasses.dataclass(frozen=True)
class Worker:
    """A training pod as the assignment sees it."""

    pod: str
    initial_rank: int
    attempt: int
    """The JobSet restart attempt the pod belongs to (label ``jobset.sigs.k8s.io/restart-attempt``)."""
    node: str | None = None
    """The node it is scheduled on, or None while pending."""
    rank: int | None = None
    """The rank already delivered to it, if any."""
    rank_generation: int | None = None
    """The assignment generation that rank belongs to."""
    active: bool = True
    """False once the pod is terminating, failed or succeeded."""


@dataclasses.dataclass(frozen=True)
class Member:
    """A scheduled pod of the current attempt: a candidate for a rank."""

    pod: str
    node: str
    initial_rank: int
    rank: int | None = None
    """A rank already delivered in this generation: kept as is."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a rank was last: its node and that node's failure domain."""

    node: str
    domain: str = ""


@dataclasses.dataclass(frozen=True)
class RankAssignment:
    """Who got which rank, and why."""

    ranks: dict[str, int]
    """Pod name -> node rank."""
    nodes: tuple[str, ...]
    """Node rank -> node name."""
    sticky: tuple[int, ...] = ()
    """Ranks that stayed on the node that holds their data."""
    moved: tuple[int, ...] = ()
    """Ranks whose node changed: their data comes from peers or GCS."""
    fresh: tuple[int, ...] = ()
    """Ranks that had no node before."""


def current_members(workers: Iterable[Worker], restarts: int = 0) -> tuple[int, list[Member]]:
    """The current restart attempt and its scheduled, active pods.

    The attempt is the highest of ``restarts`` (the JobSet's ``status.restarts``) and any pod's
    attempt, so a lagging JobSet status never lets stale pods through. A rank delivered in an
    earlier generation is not carried over.
    """
    workers = list(workers)
    attempt = max([restarts, *(w.attempt for w in workers)])
    members = [
        Member(
            pod=w.pod,
            node=w.node,
            initial_rank=w.initial_rank,
            rank=w.rank if w.rank_generation == attempt else None,
        )
        for w in workers
        if w.attempt == attempt and w.active and w.node
    ]
    return attempt, members


def assign_ranks(
    world_size: int,
    members: Sequence[Member],
    previous: Mapping[int, Placement] | None = None,
    domains: Mapping[str, str] | None = None,
) -> RankAssignment:
    """Give each of ``world_size`` ranks to exactly one member, keeping ranks on their nodes.

    Order of preference: a rank already delivered in this generation; the rank that last lived on
    the member's node; a vacated rank from the member's failure domain (``domains``: node ->
    domain); the member's initial rank; any free rank, lowest first. Requires one member per rank.
    """
    if len(members) != world_size:
        raise ContractError(f"need exactly {world_size} scheduled pods to assign ranks, got {len(members)}")
    if len({m.pod for m in members}) != len(members):
        raise ContractError("duplicate pod names among the members")
    previous = {r: p for r, p in (previous or {}).items() if 0 <= r < world_size}
    domains = domains or {}
    pending = sorted(members, key=lambda m: (m.initial_rank, m.pod))
    state = _Assigning(world_size)
    pending = state.keep_delivered(pending)
    pending = state.stick_to_nodes(pending, previous)
    pending = state.fill_vacated_by_domain(pending, previous, domains)
    pending = state.give_initial(pending)
    state.give_lowest_free(pending)
    nodes = {m.pod: m.node for m in members}
    rank_nodes = [""] * world_size
    for pod, rank in state.ranks.items():
        rank_nodes[rank] = nodes[pod]
    sticky: list[int] = []
    moved: list[int] = []
    fresh: list[int] = []
    for rank, node in enumerate(rank_nodes):
        before = previous.get(rank)
        (fresh if before is None else sticky if before.node == node else moved).append(rank)
    return RankAssignment(state.ranks, tuple(rank_nodes), tuple(sticky), tuple(moved), tuple(fresh))


class _Assigning:
    """The mutable bookkeeping of ``assign_ranks``: each step takes the still-pending members."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ranks: dict[str, int] = {}
        self.taken: set[int] = set()

    def _give(self, member: Member, rank: int) -> None:
        self.ranks[member.pod] = rank
        self.taken.add(rank)

    def keep_delivered(self, pending: list[Member]) -> list[Member]:
        rest = []
        for m in pending:
            if m.rank is not None and 0 <= m.rank < self.world_size and m.rank not in self.taken:
                self._give(m, m.rank)
            else:
                rest.append(m)
        return rest

    def stick_to_nodes(self, pending: list[Member], previous: Mapping[int, Placement]) -> list[Member]:
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank in sorted(previous):
            by_node[previous[rank].node].append(rank)
        rest = []
        for m in pending:
            free = next((r for r in by_node.get(m.node, ()) if r not in self.taken), None)
            if free is None:
                rest.append(m)
            else:
                self._give(m, free)
        return rest

    def fill_vacated_by_domain(
        self, pending: list[Member], previous: Mapping[int, Placement], domains: Mapping[str, str]
    ) -> list[Member]:
        by_domain: dict[str, list[Member]] = defaultdict(list)
        for m in pending:
            by_domain[domains.get(m.node, "")].append(m)
        used: set[str] = set()
        cursor: dict[str, int] = defaultdict(int)
        for rank in sorted(r for r in previous if r not in self.taken):
            domain = previous[rank].domain
            group = by_domain.get(domain)
            if not group:
                continue
            pick = next((m for m in group if m.initial_rank == rank and m.pod not in used), None)
            if pick is None:
                while cursor[domain] < len(group) and group[cursor[domain]].pod in used:
                    cursor[domain] += 1
                if cursor[domain] == len(group):
                    continue
                pick = group[cursor[domain]]
            used.add(pick.pod)
            self._give(pick, rank)
        return [m for m in pending if m.pod not in used]

    def give_initial(self, pending: list[Member]) -> list[Member]:
        rest = []
        for m in pending:
            if 0 <= m.initial_rank < self.world_size and m.initial_rank not in self.taken:
                self._give(m, m.initial_rank)
            else:
                rest.append(m)
        return rest

    def give_lowest_free(self, pending: list[Member]) -> None:
        free = (r for r in range(self.world_size) if r not in self.taken)
        for m, rank in zip(pending, free, strict=False):
            self._give(m, rank)


# ------------------------------------------------------------------------------------------ peers


def plan_peers(
    domains: Sequence[str],
    k: int,
    previous: Sequence[Sequence[int]] = (),
    partners: Sequence[Sequence[int]] = (),
) -> tuple[tuple[int, ...], ...]:
    """``k`` peer ranks for every rank: who receives its replicas.

    ``domains[r]`` is rank ``r``'s failure domain. Each rank gets ``min(k, n - 1)`` distinct peers,
    never itself; all in other domains when enough nodes exist outside its own, spread over as many
    distinct domains as possible. A fresh plan walks a ring that interleaves the domains in
    proportion to their sizes, so with equal domains every rank receives exactly ``k`` streams.
    Otherwise the edges of ``previous`` are kept while they stay valid and missing peers go to the
    least-loaded candidates (ties to the lowest rank). ``partners[r]``: node ranks that hold replica
    group members identical to ``r``'s; they are taken first (other domains first, least loaded,
    never breaking the domain rules). Deterministic.
    """
    n = len(domains)
    want = max(0, min(k, n - 1))
    if want == 0:
        return tuple(() for _ in range(n))
    g = _Graph.of(domains, want)
    if any(partners):
        g.prefer(partners)
    if any(previous):
        g.keep_previous(previous)
        g.fill_least_loaded()
    else:
        g.walk_ring()
    return tuple(tuple(p) for p in g.peers)


@dataclasses.dataclass
class _Graph:
    """A peer plan under construction (domains as small ints)."""

    dom: list[int]
    size: list[int]
    want: int
    peers: list[list[int]]
    load: list[int]

    @classmethod
    def of(cls, domains: Sequence[str], want: int) -> _Graph:
        index = {d: i for i, d in enumerate(sorted(set(domains)))}
        dom = [index[d] for d in domains]
        size = [0] * len(index)
        for d in dom:
            size[d] += 1
        n = len(dom)
        return cls(dom, size, want, [[] for _ in range(n)], [0] * n)

    def max_same(self, r: int) -> int:
        """How many same-domain peers ``r`` may have: only as many as other domains cannot supply."""
        return max(0, self.want - (len(self.dom) - self.size[self.dom[r]]))

    @property
    def distinct(self) -> int:
        """How many distinct other domains a rank's peers should span."""
        return min(self.want, len(self.size) - 1)

    def acceptable(self, r: int, p: int) -> bool:
        """Whether ``p`` may join ``r``'s peers now (domain rules and distinct-domain preference)."""
        mine, d = self.peers[r], self.dom[p]
        if p == r or p in mine:
            return False
        if d == self.dom[r]:
            return sum(1 for q in mine if self.dom[q] == d) < self.max_same(r)
        used = {self.dom[q] for q in mine if self.dom[q] != self.dom[r]}
        return d not in used or self.want - len(mine) - 1 >= self.distinct - len(used)

    def add(self, r: int, p: int) -> None:
        self.peers[r].append(p)
        self.load[p] += 1

    def prefer(self, partners: Sequence[Sequence[int]]) -> None:
        """Give each rank its acceptable partners first: other domains before its own, least-loaded
        first (ties to the lowest rank), so a group's members spread their copies over each other."""
        n = len(self.dom)
        for r in range(min(n, len(partners))):
            options = sorted({p for p in partners[r] if isinstance(p, int) and 0 <= p < n and p != r})
            while len(self.peers[r]) < self.want:
                ok = [p for p in options if self.acceptable(r, p)]
                if not ok:
                    break
                self.add(r, min(ok, key=lambda p: (self.dom[p] == self.dom[r], self.load[p], p)))

    def keep_previous(self, previous: Sequence[Sequence[int]]) -> None:
        n = len(self.dom)
        for r in range(min(n, len(previous))):
            for p in previous[r]:
                if len(self.peers[r]) == self.want:
                    break
                if isinstance(p, int) and 0 <= p < n and self.acceptable(r, p):
                    self.add(r, p)

    def walk_ring(self) -> None:
        """Fresh plan: each rank takes the next acceptable ranks along a domain-interleaved ring."""
        n = len(self.dom)
        seen = [0] * len(self.size)
        keys = []
        for r, d in enumerate(self.dom):
            keys.append(((2 * seen[d] + 1) / (2 * self.size[d]), d, r))
            seen[d] += 1
        ring = [r for _, _, r in sorted(keys)]
        # next_other[i]: the first ring position after i whose domain differs from position i's.
        next_other = [0] * n
        for i in range(2 * n - 1, -1, -1):
            j = (i + 1) % n
            nxt = j if self.dom[ring[j]] != self.dom[ring[i % n]] else next_other[j]
            next_other[i % n] = nxt
        for i, r in enumerate(ring):
            self._walk_from(i, r, ring, next_other)

    def _walk_from(self, i: int, r: int, ring: list[int], next_other: list[int]) -> None:
        n = len(ring)
        for relaxed in (False, True):
            p, steps = (i + 1) % n, 0
            while len(self.peers[r]) < self.want and steps < n:
                if self.dom[ring[p]] == self.dom[r] and not relaxed:
                    q = next_other[p]
                    steps += (q - p) % n or n
                    p = q
                    continue
                if self.acceptable(r, ring[p]):
                    self.add(r, ring[p])
                p, steps = (p + 1) % n, steps + 1
            if len(self.peers[r]) == self.want:
                return

    def fill_least_loaded(self) -> None:
        receivers = _Receivers(self.dom, len(self.size), self.load)
        for r, mine in enumerate(self.peers):
            while len(mine) < self.want:
                used = {self.dom[r]} | {self.dom[p] for p in mine}
                pick = receivers.least_in_new_domain(used)
                if pick is None:
                    pick = self._least_repeat(r, receivers)
                if pick is None:
                    break
                mine.append(pick)
                receivers.take(pick)

    def _least_repeat(self, r: int, receivers: _Receivers) -> int | None:
        """Every other domain is used: the least-loaded rank of one of them, else of ``r``'s own."""
        mine, excluded = self.peers[r], {r, *self.peers[r]}
        options = [
            c
            for d in sorted({self.dom[p] for p in mine if self.dom[p] != self.dom[r]})
            if (c := receivers.least_in_domain(d, excluded)) is not None
        ]
        if not options and sum(1 for p in mine if self.dom[p] == self.dom[r]) < self.max_same(r):
            c = receivers.least_in_domain(self.dom[r], excluded)
            options = [c] if c is not None else []
        return min(options)[1] if options else None


class _Receivers:
    """Least-loaded receivers per domain: one heap per domain plus a heap of the domains' best."""

    def __init__(self, dom: list[int], ndomains: int, load: list[int]) -> None:
        self.dom, self.load = dom, load
        self.heaps: list[list[tuple[int, int]]] = [[] for _ in range(ndomains)]
        for r, d in enumerate(dom):
            self.heaps[d].append((load[r], r))
        for h in self.heaps:
            heapq.heapify(h)
        self.best = [(h[0][0], h[0][1], d) for d, h in enumerate(self.heaps) if h]
        heapq.heapify(self.best)

    def _top(self, d: int) -> tuple[int, int] | None:
        h = self.heaps[d]
        while h and h[0][0] != self.load[h[0][1]]:
            heapq.heappop(h)
        return h[0] if h else None

    def take(self, r: int) -> None:
        """Count one more stream into ``r`` and re-rank its domain."""
        d = self.dom[r]
        self.load[r] += 1
        heapq.heappush(self.heaps[d], (self.load[r], r))
        top = self._top(d)
        if top is not None:
            heapq.heappush(self.best, (top[0], top[1], d))

    def least_in_new_domain(self, excluded: set[int]) -> int | None:
        """The least-loaded rank of any domain not in ``excluded``."""
        stash, found = [], None
        while self.best:
            entry = heapq.heappop(self.best)
            if self._top(entry[2]) != (entry[0], entry[1]):
                continue  # stale
            stash.append(entry)
            if entry[2] not in excluded:
                found = entry[1]
                break
        for entry in stash:
            heapq.heappush(self.best, entry)
        return found

    def least_in_domain(self, d: int, excluded: set[int]) -> tuple[int, int] | None:
        """(load, rank) of the least-loaded rank of domain ``d`` not in ``excluded``."""
        h, stash, found = self.heaps[d], [], None
        while self._top(d) is not None:
            entry = heapq.heappop(h)
            stash.append(entry)
            if entry[1] not in excluded:
                found = entry
                break
        for entry in stash:
            heapq.heappush(h, entry)
        return found


def plan_node_peers(
    node_domains: Mapping[str, str],
    k: int,
    previous: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, tuple[str, ...]]:
    """``plan_peers`` over node names (ranks by sorted name), for callers without node ranks."""
    nodes = sorted(node_domains)
    rank = {n: i for i, n in enumerate(nodes)}
    prev = [[rank[p] for p in (previous or {}).get(n, ()) if p in rank] for n in nodes]
    plan = plan_peers([node_domains[n] for n in nodes], k, prev)
    return {nodes[r]: tuple(nodes[p] for p in ps) for r, ps in enumerate(plan)}


def peer_churn(old: Sequence[Sequence[int]], new: Sequence[Sequence[int]]) -> int:
    """How many (sender, receiver) edges differ between two plans (added plus removed)."""
    a = {(r, p) for r, ps in enumerate(old) for p in ps}
    b = {(r, p) for r, ps in enumerate(new) for p in ps}
    return len(a ^ b)
