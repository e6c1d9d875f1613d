"""Who uploads which rank: spread a step's uploads over the nodes that hold identical copies (pure).

Each rank of a step is held by its primary node and by the nodes it was replicated to. Any of them can
upload it; ``assign_uploads`` picks exactly one per rank so that the busiest node uploads as few ranks
as possible (an optimal semi-matching: no rank can move to lighter node without making it as busy),
with rendezvous hashing on ``(job, step, rank, node)`` breaking ties. It depends only on its inputs,
never on their order, so every node computes the same split without talking to the others.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping, Sequence

__all__ = ["assign_uploads", "rendezvous_score"]


def rendezvous_score(job: str, step: int, rank: int, node: str) -> int:
    """A stable pseudo-random score; the holder with the highest score is the natural uploader."""
    digest = hashlib.blake2b(f"{job}\0{step}\0{rank}\0{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


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
    """Apply cost-reducing paths (move a chain of ranks from a busy node to one at least 2 lighter)
    until none exists; the result minimises the maximum load (Harvey et al., semi-matchings)."""
    by_node: dict[str, set[int]] = {n: set() for n in load}
    for r, n in owner.items():
        by_node[n].add(r)
    improved = True
    while improved:
        improved = False
        for start in sorted(load, key=lambda n: (-load[n], n)):
            path = _cost_reducing_path(start, options, by_node, load)
            if path:
                for r, src, dst in path:
                    by_node[src].discard(r)
                    by_node[dst].add(r)
                    owner[r] = dst
                load[path[0][1]] -= 1
                load[path[-1][2]] += 1
                improved = True
                break


def _cost_reducing_path(
    start: str, options: Mapping[int, list[str]], by_node: Mapping[str, set[int]], load: Mapping[str, int]
) -> list[tuple[int, str, str]] | None:
    """BFS over "rank r on node a could move to node b" edges from ``start`` to a node with load
    <= load[start] - 2; returns the moves (rank, from, to) in order, or None."""
    prev: dict[str, tuple[int, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if load[node] <= load[start] - 2:
            moves = []
            while prev[node] is not None:
                rank, src = prev[node]  # type: ignore[misc]
                moves.append((rank, src, node))
                node = src
            return moves[::-1]
        for r in sorted(by_node[node]):
            for other in options[r]:
                if other not in prev:
                    prev[other] = (r, node)
                    queue.append(other)
    return None
