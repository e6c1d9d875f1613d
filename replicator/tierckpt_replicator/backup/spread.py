"""Who uploads which rank: spread a step's uploads over the nodes that hold identical copies (pure).

Each rank of a step is held by its primary node and by the nodes it was replicated to. Any of them can
upload it; ``assign_uploads`` picks exactly one per rank so that the busiest node uploads as few ranks
as possible (the maximum load is optimal), with rendezvous hashing on ``(job, step, rank, node)``
breaking ties. It depends only on its inputs, never on their order, so every node computes the same
split without talking to the others.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping, Sequence

__all__ = ["assign_uploads", "data_rank", "rendezvous_score"]


def rendezvous_score(job: str, step: int, rank: int, node: str) -> int:
    """A stable pseudo-random score; the holder with the highest score is the natural uploader."""
    digest = hashlib.blake2b(f"{job}\0{step}\0{rank}\0{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def data_rank(job: str, step: int, members: Sequence[int]) -> int:
    """The member of a replica group whose upload of ``step`` carries the group's data files (the others
    refer to it). Rendezvous-hashed per step, so the uploads of a group's shard rotate over its members
    (and so over their uploaders) from step to step; every node computes the same one."""
    return max(members, key=lambda m: (rendezvous_score(job, step, m, "data"), m))


def assign_uploads(job: str, step: int, holders: Mapping[int, Sequence[str]]) -> dict[int, str]:
    """Rank -> the node that uploads it. Ranks without holders are left out."""
    options = {r: sorted(set(h)) for r, h in holders.items() if h}
    # Most constrained ranks first, then a hashed order so no node is favoured by rank numbering.
    order = sorted(options, key=lambda r: (len(options[r]), rendezvous_score(job, step, r, ""), r))
    load: dict[str, int] = {n: 0 for nodes in options.values() for n in nodes}
    owner: dict[int, str] = {}
    for r in order:
        node = min(options[r], key=lambda n: (load[n], -rendezvous_score(job, step, r, n), n))
        owner[r] = node
        load[node] += 1
    _rebalance(options, owner, load)
    return owner


def _rebalance(options: Mapping[int, list[str]], owner: dict[int, str], load: dict[str, int]) -> None:
    """Move chains of ranks from the busiest nodes to nodes at least 2 lighter until no such chain
    exists. Then the maximum load is optimal: every node reachable from a busiest one carries at least
    max-1 ranks, and the ranks on those nodes have nowhere else to go in any assignment."""
    by_node: dict[str, set[int]] = {n: set() for n in load}
    for r, n in owner.items():
        by_node[n].add(r)
    while load:
        top = max(load.values())
        path = _chain(sorted(n for n in load if load[n] == top), top - 2, options, by_node, load)
        if path is None:
            return
        for r, src, dst in path:
            by_node[src].discard(r)
            by_node[dst].add(r)
            owner[r] = dst
        load[path[0][1]] -= 1
        load[path[-1][2]] += 1


def _chain(
    starts: list[str],
    target: int,
    options: Mapping[int, list[str]],
    by_node: Mapping[str, set[int]],
    load: Mapping[str, int],
) -> list[tuple[int, str, str]] | None:
    """Breadth-first over "rank r on node a could move to node b" from ``starts`` to a node with load
    <= ``target``; the moves (rank, from, to) in order, or None."""
    prev: dict[str, tuple[int, str] | None] = dict.fromkeys(starts)
    queue = deque(starts)
    while queue:
        node = queue.popleft()
        if load[node] <= target:
            moves = []
            while (step := prev[node]) is not None:
                rank, src = step
                moves.append((rank, src, node))
                node = src
            return moves[::-1]
        for r in sorted(by_node[node]):
            for other in options[r]:
                if other not in prev:
                    prev[other] = (r, node)
                    queue.append(other)
    return None
