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

from tierckpt.planning.common_step import newest_common_step
from tierckpt.planning.retention import plan_retention

__all__ = ["replicas_to_drop"]


def replicas_to_drop(
    held: Mapping[int, Sequence[int]],
    *,
    keep: int,
    pinned: Collection[int] = (),
    leased: Mapping[int, Collection[int]] | None = None,
) -> dict[int, list[int]]:
    """Rank -> replica steps that may be deleted now, oldest first (ranks with nothing to drop omitted).

    Per rank this is the client's own rule (``tierckpt.planning.retention.plan_retention``: newest ``keep``
    kept,
    leased steps held), with the newest common step and the pinned steps held as if leased.
    """
    leased = leased or {}
    common = newest_common_step(held.values())
    out: dict[int, list[int]] = {}
    for rank, steps in held.items():
        hold = set(pinned) | set(leased.get(rank, ())) | ({common} if common is not None else set())
        retire = plan_retention(steps, keep=keep, leased=hold).retire
        if retire:
            out[rank] = list(retire)
    return out
