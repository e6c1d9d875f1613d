"""The invariants of a chaos run, as pure functions of what was observed (no I/O).

* ``newest-restorable``: a restore loads at least the newest step that every rank can read from the
  surviving tiers (``newest_restorable`` over the harness's own scan, taken right before the operator
  gathers inventories: copies only appear between the two, a backup may complete, so the restore may
  be newer, never older);
* ``bit-exact``: each rank's restored state is a state saved for that step, and replayed steps give
  the losses they gave the first time (``reference``);
* ``no-torn-step``: no tier shows a committed step that is not whole;
* ``agreement``: every rank restores the same step;
* ``healed``: once the faults are over, every rank's newest step is back on as many other nodes of its
  job as its replication factor asks (and the nodes say so), and the bucket holds the newest step that
  its schedule makes due, within ``HEAL_BOUND`` seconds and with no save;
* ``clean-purge``: after a purge nothing of the job is on any node or in the bucket; ``retention``:
  after the faults, no tier keeps more than its policy allows;
* ``no-lost-work``: a crash costs at most one checkpoint interval of steps beyond what the surviving
  tiers force (``lost_work``);
* ``liveness``: every wait is bounded; a job that cannot restore or train once the faults are over is
  a violation too.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Literal

from tierckpt.protocol.codec import Record

__all__ = [
    "HEAL_BOUND",
    "INVARIANTS",
    "Held",
    "Invariant",
    "Violation",
    "heal_gaps",
    "lost_work",
    "newest_restorable",
    "retention_excess",
]

Invariant = Literal[
    "newest-restorable",
    "bit-exact",
    "no-torn-step",
    "agreement",
    "healed",
    "clean-purge",
    "retention",
    "no-lost-work",
    "liveness",
]
INVARIANTS: tuple[Invariant, ...] = (
    "newest-restorable",
    "bit-exact",
    "no-torn-step",
    "agreement",
    "healed",
    "clean-purge",
    "retention",
    "no-lost-work",
    "liveness",
)

HEAL_BOUND = 60.0
"""Seconds from the end of the last fault to full redundancy, and to the due backup (the rig reconciles
every 2 s and retries within 2 s: healing takes a few seconds; the bound is for a loaded machine)."""

PRIMARY_SLACK = 3
"""Committed steps a rank directory may hold beyond ``keep``: one leased by a send, one by an upload,
and the step of a restore status newer than the rank's commits (docs/format.md, "Retention")."""
REPLICA_SLACK = 3
"""Replica steps beyond ``--replica-keep``: the newest step held for every rank, the plan's step, and one
leased (docs/replicator.md, "Retention of replicas")."""


@dataclasses.dataclass(frozen=True)
class Violation(Record):
    invariant: Invariant
    job: str
    detail: str
    round: int = -1


@dataclasses.dataclass(frozen=True)
class Held:
    """A committed copy of one rank's step on a node's ramdisk."""

    node: str
    rank: int
    step: int
    world: int
    replica: bool


def newest_restorable(
    copies: Iterable[Held], bucket: Mapping[int, int], nodes: Iterable[str], world: int | None
) -> int | None:
    """The newest step every rank can be read back from: each of its ranks has a copy on one of ``nodes``
    or the step is complete in ``bucket`` (step -> world size). ``world``: only steps saved with that many
    ranks (None: any, the job reshards)."""
    on = set(nodes)
    ranks: dict[tuple[int, int], set[int]] = defaultdict(set)
    for c in copies:
        if c.node in on:
            ranks[(c.step, c.world)].add(c.rank)
    whole = {step for (step, w), rs in ranks.items() if rs >= set(range(w)) and world in (None, w)}
    whole |= {step for step, w in bucket.items() if world in (None, w)}
    return max(whole, default=None)


def committed_everywhere(copies: Iterable[Held], nodes: Iterable[str], world: int | None) -> int | None:
    """The newest step whose every rank (of the world that saved it; ``world``: only that one) has a
    committed primary on one of ``nodes``: what a crash now keeps without any other tier. A job that
    reshards (``world`` None) keeps the step it saved on fewer nodes (a job that grew has saved nothing on
    its new node yet, and still restores that step), and counts replicas too: its load reads another
    rank's step from its node's replica store (``dcp.fetch`` stages it there), so a job that restored a
    step saved by a node it left holds that rank's step only as a replica until it saves again."""
    return newest_restorable((c for c in copies if world is None or not c.replica), {}, nodes, world)


def lost_work(last: int, committed: int | None, every: int) -> str:
    """Why a crash at step ``last`` with ``committed`` the newest step every rank had committed lost more
    than one interval ("" if it did not). One interval, plus the save still committing when the
    process died: the next save waits for the previous one's commit, so at most one is in flight."""
    done = committed or 0
    if last - done >= 2 * every:
        return (
            f"the job had trained to step {last} and its newest step committed on every rank was "
            f"{committed}: {last - done} steps lost, more than one interval of {every} plus the save "
            "in flight"
        )
    return ""


def heal_gaps(
    newest: Mapping[int, tuple[str, int]],
    copies: Iterable[Held],
    nodes: Iterable[str],
    factor: int,
) -> list[str]:
    """Ranks whose newest step (``newest``: rank -> (its node, step)) has fewer copies on other nodes of the
    job than ``factor`` asks (at most the number of other nodes)."""
    members = set(nodes)
    want = min(factor, len(members) - 1)
    holders: dict[tuple[int, int], set[str]] = defaultdict(set)
    for c in copies:
        if c.replica and c.node in members:
            holders[(c.rank, c.step)].add(c.node)
    gaps = []
    for rank, (node, step) in sorted(newest.items()):
        have = holders[(rank, step)] - {node}
        if len(have) < want:
            gaps.append(
                f"rank {rank} step {step}: {len(have)}/{want} copies ({', '.join(sorted(have)) or 'none'})"
            )
    return gaps


def retention_excess(copies: Iterable[Held], *, keep: int, replica_keep: int) -> list[str]:
    """Rank directories holding more committed steps than their retention allows (with its exceptions)."""
    steps: dict[tuple[str, int, bool], list[int]] = defaultdict(list)
    for c in copies:
        steps[(c.node, c.rank, c.replica)].append(c.step)
    out = []
    for (node, rank, replica), held in sorted(steps.items()):
        limit = replica_keep + REPLICA_SLACK if replica else keep + PRIMARY_SLACK
        if len(held) > limit:
            kind = "replicas" if replica else "primaries"
            out.append(f"{node}: rank {rank} holds {len(held)} {kind} {sorted(held)} (at most {limit})")
    return out
