"""Replication dedup across a replica group (pure; no I/O).

Members of a replica group (docs/format.md, "Replica groups") save identical tensors. When a peer
already holds, committed and verified, step ``s`` of another member whose content key (recomputed by
that peer from its manifest) equals this rank's, the rank's copy there costs no data: the peer links
the identical data files and only the rank's own manifest, ``objects.pkl`` and COMMIT travel
(``DataRequest.base_rank``). Such a peer is the first choice for the rank's replica and counts toward
its replication factor like any other.

Never deduplicated: a step whose record says the members diverged (or whose record's key does not
match its manifest: the inventory reports it as diverged), and members whose keys differ; those are
reported (``differing``) so the daemon can say so.

The inputs are this node's ``StepContent`` of a rank's newest step and the peers' ``StepContent``
lists from their inventories (``NodeInventory.contents``); the manager and the backup spread call these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tierckpt.protocol.control import PeerAssignment, StepContent

__all__ = ["awaiting_members", "differing", "linkable_targets", "member_nodes"]


def _same_group_step(mine: StepContent, other: StepContent) -> bool:
    return (
        other.group == mine.group
        and other.members == mine.members
        and other.step == mine.step
        and other.rank != mine.rank
        and other.rank in mine.members
    )


def linkable_targets(
    mine: StepContent, node: str, peers: Mapping[str, Iterable[StepContent]]
) -> dict[str, int]:
    """Peer node -> the member rank whose committed step there holds exactly ``mine``'s content (the
    lowest such rank). Empty when ``mine`` diverged."""
    if mine.diverged:
        return {}
    out: dict[str, int] = {}
    for peer, contents in peers.items():
        if peer == node:
            continue
        same = [
            c.rank
            for c in contents
            if _same_group_step(mine, c) and not c.diverged and c.content == mine.content
        ]
        if same:
            out[peer] = min(same)
    return out


def differing(mine: StepContent, peers: Mapping[str, Iterable[StepContent]]) -> dict[int, str]:
    """Member rank -> node, for the members of ``mine``'s group whose step ``mine.step`` holds other
    content (or says it diverged): never deduplicated against ``mine``."""
    out: dict[int, str] = {}
    for peer, contents in sorted(peers.items()):
        for c in contents:
            if _same_group_step(mine, c) and (c.diverged or mine.diverged or c.content != mine.content):
                out.setdefault(c.rank, peer)
    return out


def member_nodes(mine: StepContent, assignment: PeerAssignment, world_size: int) -> dict[int, str]:
    """Member rank -> the node that runs it (per the assignment's node ranks), for the other members."""
    out: dict[int, str] = {}
    for name in assignment.node_ranks:
        for r in assignment.process_ranks(name, world_size):
            if r in mine.members and r != mine.rank:
                out[r] = name
    return out


def awaiting_members(
    mine: StepContent,
    node: str,
    members: Mapping[int, str],
    peers: Mapping[str, Iterable[StepContent]],
) -> set[str]:
    """Nodes that run another member of ``mine``'s group and have not reported its step ``mine.step``
    yet (their copy may be about to commit: waiting a moment may save a whole transfer)."""
    waiting = set()
    for rank, peer in members.items():
        if peer == node:
            continue
        if not any(c.rank == rank and c.step >= mine.step for c in peers.get(peer, ())):
            waiting.add(peer)
    return waiting
