"""What to send where (pure; no I/O).

``candidate_targets`` orders the nodes a node may copy its ranks to: the peers the assignment names
(in its order), then nodes of other failure domains, then the rest of its own domain; nodes in backoff
go last. ``plan_sends`` turns the newest committed step of each local rank, and what is already known
to be replicated or in flight, into ``SendItem``s: the step, the candidates, and how many more copies
are wanted. The worker walks the candidates in order until that many succeeded, so a dead or full peer
is replaced by the next one at once. A peer that already holds an identical copy of another replica
group member's step (``linkable``, from ``replication.dedup``) goes first among the assigned peers (or
among the fallbacks), with the member's rank as the ``base`` it links the data files from. A step at
its factor but not on the peers the assignment names (a fallback took it while a peer was down) is
copied to those peers once they are out of backoff (linked there when they hold an identical member
step); the manager then retires the fallback's copy (the surplus), so copies return to where the plan
puts them, linked or not. The assigned peers are where the job's backup split (``backup.spread``) and
its failure-domain pairing expect the copies: a copy left on a fallback left its rank without an
uploader until the takeover (found by the replica-group demo: a step saved within the 2 s backoff of
a restarted peer went to a fallback that linked it, and stayed there).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Collection, Mapping

from tierckpt.protocol.control import PeerAssignment

__all__ = ["SendItem", "candidate_targets", "home_peers", "plan_sends", "unplaced"]


@dataclasses.dataclass(frozen=True)
class SendItem:
    job: str
    rank: int
    step: int
    candidates: tuple[str, ...]
    want: int
    bases: dict[str, int] = dataclasses.field(default_factory=dict)
    """Candidate -> the member rank whose identical step it holds (only the small files travel)."""


def _listed(assignment: PeerAssignment, node: str) -> list[str]:
    """The peers the assignment names for ``node``, in its order (the first ``k`` hold the copies)."""
    return [n for n in assignment.peers.get(node, ()) if n != node and n in assignment.nodes]


def home_peers(assignment: PeerAssignment, node: str, k: int) -> list[str]:
    """Where the plan puts the ``k`` copies of ``node``'s ranks (the rest of its listed peers are spares)."""
    return _listed(assignment, node)[: max(k, 0)]


def candidate_targets(
    assignment: PeerAssignment, node: str, *, avoid: Collection[str] = ()
) -> tuple[str, ...]:
    """Nodes ``node`` may replicate to, most preferred first."""
    assigned = _listed(assignment, node)
    own = assignment.nodes[node].domain if node in assignment.nodes else ""
    rest = sorted(n for n in assignment.nodes if n != node and n not in assigned)
    # Rotate the fallbacks by a stable hash of the sender, so fallback load spreads over the cluster.
    if rest:
        shift = zlib.crc32(node.encode()) % len(rest)
        rest = rest[shift:] + rest[:shift]
    other_domain = [n for n in rest if not own or assignment.nodes[n].domain != own]
    same_domain = [n for n in rest if n not in other_domain]
    ordered = assigned + other_domain + same_domain
    return tuple([n for n in ordered if n not in avoid] + [n for n in ordered if n in avoid])


def unplaced(
    *,
    node: str,
    k: int,
    assignment: PeerAssignment,
    newest: Mapping[int, int],
    confirmed: Mapping[tuple[int, int], Collection[str]],
) -> set[int]:
    """The local ranks ``plan_sends`` may send: their newest step has fewer than ``k`` copies, or is not
    on every peer the plan puts its copies on."""
    home = set(home_peers(assignment, node, k))
    have = {r: set(confirmed.get((r, s), ())) for r, s in newest.items()}
    return {r for r, h in have.items() if len(h) < k or not home <= h}


def plan_sends(
    *,
    job: str,
    node: str,
    k: int,
    assignment: PeerAssignment,
    newest: Mapping[int, int],
    confirmed: Mapping[tuple[int, int], Collection[str]],
    in_flight: Collection[tuple[int, int]] = (),
    avoid: Collection[str] = (),
    linkable: Mapping[int, Mapping[str, int]] | None = None,
) -> list[SendItem]:
    """One ``SendItem`` per local rank whose newest step has fewer than ``k`` confirmed copies, or is
    not yet on its assigned peers. ``linkable``: rank -> peers holding an identical member step (node
    -> that member's rank)."""
    base = candidate_targets(assignment, node, avoid=avoid)
    listed = _listed(assignment, node)
    assigned = home_peers(assignment, node, k)
    items = []
    for rank in sorted(newest):
        step = newest[rank]
        if (rank, step) in in_flight:
            continue
        have = set(confirmed.get((rank, step), ()))
        want = k - len(have)
        bases = dict((linkable or {}).get(rank, {}))
        # A linkable peer goes first within its tier only: the assigned peers (the operator's choice of
        # failure domains) before the fallbacks, and dead peers last, whatever they hold.
        ordered = sorted(base, key=lambda n: (n in avoid, n not in listed, n not in bases))
        candidates = tuple(n for n in ordered if n not in have)
        if want > 0 and candidates:
            bases = {n: b for n, b in bases.items() if n in candidates}
            item = SendItem(job=job, rank=rank, step=step, candidates=candidates, want=want, bases=bases)
            items.append(item)
            continue
        # at its factor, but not (all) where the plan says: back to the assigned peers, linked if they can
        back = tuple(n for n in assigned if n not in have and n not in avoid)
        if back:
            bases = {n: b for n, b in bases.items() if n in back}
            item = SendItem(job=job, rank=rank, step=step, candidates=back, want=len(back), bases=bases)
            items.append(item)
    return items
