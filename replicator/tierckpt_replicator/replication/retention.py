"""Which replicas a node may drop (pure; no I/O).

Per job, for the replicas this node holds:

* each rank keeps its newest ``keep`` committed steps;
* the newest step held for *every* rank present is kept for all of them, even if newer steps of some
  ranks have arrived meanwhile: it may be the newest step the job can restore from this node;
* steps that are pinned (the published restore plan's step) or leased (being served) are kept.

Nothing is ever dropped that would leave a rank without its newest replica.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

__all__ = ["newest_common_step", "replicas_to_drop"]


def newest_common_step(held: Mapping[int, Sequence[int]]) -> int | None:
    """The newest step held for every rank in ``held`` (None if there is none)."""
    sets = [set(steps) for steps in held.values()]
    if not sets:
        return None
    common = set.intersection(*sets)
    return max(common) if common else None


def replicas_to_drop(
    held: Mapping[int, Sequence[int]],
    *,
    keep: int,
    pinned: Collection[int] = (),
    leased: Mapping[int, Collection[int]] | None = None,
) -> dict[int, list[int]]:
    """Rank -> replica steps that may be deleted now, oldest first (ranks with nothing to drop omitted)."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    leased = leased or {}
    common = newest_common_step(held)
    out: dict[int, list[int]] = {}
    for rank, steps in held.items():
        ordered = sorted(set(steps))
        protected = set(ordered[-keep:]) | set(pinned) | set(leased.get(rank, ()))
        if common is not None:
            protected.add(common)
        drop = [s for s in ordered if s not in protected]
        if drop:
            out[rank] = drop
    return out
