"""Which step a whole job restores, and from which tier each rank reads it (pure; no I/O).

Every party that needs the answer (each node's replicator, the operator, the demo) calls
``choose_restore`` on the inventories it gathered and gets the same ``RestorePlan`` for the same
inventories, whatever their order. The rule:

* A step is *restorable* when every rank ``0 .. world_size-1`` can read it from some tier: a node's
  primary copy, a node's replica, erasure-coded fragments (at least ``k`` distinct fragments of the
  rank's step held by the nodes that answered), or the bucket (a step listed in any inventory's
  ``gcs`` is complete there for every rank).
* Steps whose manifests disagree on the world size, or whose world size differs from the one asked
  for, are skipped (steps of different world sizes never mix).
* A step known only from the bucket, whose world size no manifest records and none was asked for,
  is restorable with ``world_size=0`` (unknown) and empty ``sources``: every rank reads the bucket.
* The newest restorable step wins. None restorable gives a plan with ``step=None`` (start fresh).
* Each rank's source is the fastest tier anyone holds it in (``LOCAL`` < ``REPLICA`` < ``ERASURE`` <
  ``GCS``), and its holders are listed primary holders first, then replica holders, each sorted by
  node name; a rank rebuilt from fragments lists the fragment holders (sorted by name).

Unknown holdings (an unreachable node sends no inventory) simply count as absent.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierckpt.protocol.control import NodeInventory, RestorePlan, Tier
from tierckpt.protocol.errors import ContractError

__all__ = ["BUCKET_PATIENCE", "bucket_unknown", "choose_restore", "restorable_steps"]

BUCKET_PATIENCE = 60.0
"""Seconds a restore plan is held back while no node has listed the bucket (``bucket_unknown``); then it
is chosen from the other tiers, as for a job without backups."""


def choose_restore(
    inventories: Iterable[NodeInventory],
    world_size: int | None = None,
    *,
    job: str | None = None,
    generation: int = 0,
    decided_at: float = 0.0,
) -> RestorePlan:
    """The newest step every rank can restore from some tier, with each rank's source and holders.

    ``world_size`` restricts the choice to steps saved with that many ranks (and is needed to judge a
    step known only from the bucket when no manifest says its world size). ``generation`` and
    ``decided_at`` are copied into the plan unchanged so that independent callers agree byte for byte.
    """
    invs = sorted(inventories, key=lambda inv: inv.node)
    job = _job_of(invs, job)
    steps = restorable_steps(invs, world_size)
    if not steps:
        return RestorePlan(
            job=job,
            step=None,
            world_size=world_size or 0,
            sources={},
            generation=generation,
            decided_at=decided_at,
        )
    step, ws = steps[0]
    sources: dict[int, Tier] = {}
    holders: dict[int, tuple[str, ...]] = {}
    for rank in range(ws):
        primary, replica = _holders(invs, rank, step)
        if primary or replica:
            sources[rank] = Tier.LOCAL if primary else Tier.REPLICA
            holders[rank] = tuple(primary) + tuple(n for n in replica if n not in primary)
        elif (fragments := _fragment_holders(invs, rank, step)) is not None:
            sources[rank], holders[rank] = Tier.ERASURE, fragments
        else:
            sources[rank], holders[rank] = Tier.GCS, ()
    return RestorePlan(
        job=job,
        step=step,
        world_size=ws,
        sources=sources,
        holders=holders,
        generation=generation,
        decided_at=decided_at,
    )


def bucket_unknown(inventories: Iterable[NodeInventory]) -> bool:
    """Whether no node knows the bucket's complete steps (each one's look at it had not answered:
    ``NodeInventory.gcs_pending``): a plan chosen now could start a job afresh over a complete backup,
    so its callers ask again, for a while, before they choose one without the bucket."""
    invs = list(inventories)
    return bool(invs) and all(inv.gcs_pending for inv in invs)


def restorable_steps(
    inventories: Iterable[NodeInventory], world_size: int | None = None
) -> list[tuple[int, int]]:
    """Every restorable ``(step, world_size)``, newest first."""
    invs = list(inventories)
    gcs = {s for inv in invs for s in inv.gcs}
    held: dict[int, set[int]] = {}
    for inv in invs:
        for rank, h in inv.ranks.items():
            for s in (*h.local, *h.replica):
                held.setdefault(s, set()).add(rank)
            for s in h.fragments:
                if _fragment_holders(invs, rank, s) is not None:
                    held.setdefault(s, set()).add(rank)
    fallback_ws = _fallback_world_size(invs, world_size)
    out = []
    for step in sorted(set(held) | gcs, reverse=True):
        ok, ws = _world_size_of(invs, step, world_size)
        if not ok:
            continue
        if step in gcs:
            out.append((step, ws if ws is not None else fallback_ws or 0))
        elif ws is not None and ws > 0 and all(r in held.get(step, ()) for r in range(ws)):
            out.append((step, ws))
    return out


def _job_of(invs: list[NodeInventory], job: str | None) -> str:
    jobs = {inv.job for inv in invs}
    if job is not None:
        jobs.add(job)
    if len(jobs) != 1:
        raise ContractError(f"inventories must describe exactly one job, got {sorted(jobs)}")
    return jobs.pop()


def _world_size_of(invs: list[NodeInventory], step: int, wanted: int | None) -> tuple[bool, int | None]:
    """``(usable, world size)`` of a step: unusable if manifests disagree or differ from ``wanted``."""
    known = {inv.world_sizes[step] for inv in invs if step in inv.world_sizes}
    if len(known) > 1:
        return False, None
    if known:
        ws = known.pop()
        return wanted is None or ws == wanted, ws
    return True, wanted


def _fallback_world_size(invs: list[NodeInventory], wanted: int | None) -> int | None:
    """For a bucket-only step: the asked world size, else the one recorded for the newest known step."""
    if wanted is not None:
        return wanted
    recorded: dict[int, set[int]] = {}
    for inv in invs:
        for step, ws in inv.world_sizes.items():
            recorded.setdefault(step, set()).add(ws)
    for step in sorted(recorded, reverse=True):
        if len(recorded[step]) == 1:
            return next(iter(recorded[step]))
    return None


def _fragment_holders(invs: list[NodeInventory], rank: int, step: int) -> tuple[str, ...] | None:
    """Every node holding a fragment of the rank's step (sorted), if together they hold at least ``k``
    distinct ones (of a code every holder agrees on)."""
    indices, holders, needed = set(), set(), set()
    for inv in invs:
        h = inv.ranks.get(rank)
        if h is not None and step in h.fragments:
            index, k = h.fragments[step]
            indices.add(index)
            holders.add(inv.node)
            needed.add(k)
    if len(needed) != 1 or len(indices) < next(iter(needed)):
        return None
    return tuple(sorted(holders))


def _holders(invs: list[NodeInventory], rank: int, step: int) -> tuple[list[str], list[str]]:
    primary, replica = [], []
    for inv in invs:  # already sorted by node name
        h = inv.ranks.get(rank)
        if h is None:
            continue
        if step in h.local:
            primary.append(inv.node)
        if step in h.replica:
            replica.append(inv.node)
    return primary, replica
