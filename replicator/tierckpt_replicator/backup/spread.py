"""Who uploads which rank: spread a step's uploads over the nodes that hold identical copies (pure).

Each rank of a step is held by its primary node and by the nodes it was replicated to (its peers, in
the order of ``peers.json``). Any of them can upload it; ``assign_uploads`` picks exactly one per rank.
The ranks that share their holders (a node's block of ranks) are dealt round-robin over those holders,
starting at an offset rendezvous-hashed per step: with the operator's peer plans, where every node is
the peer of as many nodes as it has peers, every node uploads as many ranks as it runs (exactly, when
that number is a multiple of the holders per rank), and successive steps rotate who uploads what.

Each block is dealt on its own, so a node computes the uploaders of the ranks it holds from their
holders alone: a node of a job of thousands of nodes needs its own neighbourhood of the peer plan, not
the whole of it, and every node computes the same split without talking to the others.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping, Sequence

from tierckpt.protocol.control import PeerAssignment

__all__ = ["assign_uploads", "data_rank", "holders_of", "rendezvous_score"]


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
    """Rank -> the node that uploads it. ``holders``: rank -> the nodes holding a copy, primary first
    (the order matters; every node reads the same order from ``peers.json``). Ranks without holders are
    left out; the order of the ranks does not matter."""
    blocks: dict[tuple[str, ...], list[int]] = collections.defaultdict(list)
    for r, h in holders.items():
        if h:
            blocks[tuple(dict.fromkeys(h))].append(r)
    owner: dict[int, str] = {}
    for nodes, ranks in blocks.items():
        offset = rendezvous_score(job, step, -1, f"spread-{len(nodes)}") % len(nodes)
        for i, r in enumerate(sorted(ranks)):
            owner[r] = nodes[(i + offset) % len(nodes)]
    return owner


def holders_of(
    assignment: PeerAssignment, world_size: int, *, copies: bool = True
) -> dict[int, tuple[str, ...]]:
    """Rank -> the nodes holding it, primary first, from a ``peers.json``: a node's process ranks are held
    by it and (``copies``: its peers hold replicas, not erasure-coded fragments) by its peers, in their
    order. A node's view of a big job's plan names the peers of every node whose ranks it holds."""
    out: dict[int, tuple[str, ...]] = {}
    for node in sorted(assignment.node_ranks):
        peers = assignment.peers.get(node, ()) if copies else ()
        for r in assignment.process_ranks(node, world_size):
            out[r] = (node, *peers)
    return out
