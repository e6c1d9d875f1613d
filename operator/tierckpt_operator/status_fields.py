"""What a user reads in CheckpointJob and CheckpointConfiguration status (pure).

Conditions follow the Kubernetes convention (type, status, reason, message, lastTransitionTime kept
while the status does not change). Rank sets are written as ranges (``0-7,12``) so that the status of
a 10,000-node job stays small. Tier progress and redundancy are derived from the replicators'
inventories.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tierckpt.protocol.control import NodeInventory, Redundancy, RestorePlan

__all__ = [
    "CONDITION_TYPES",
    "TierProgress",
    "condition",
    "config_status",
    "iso_time",
    "merge_conditions",
    "over_quota_text",
    "parse_ranges",
    "rank_ranges",
    "redundancy_of",
    "redundancy_text",
    "replica_groups",
    "restore_summary",
    "tier_progress",
]

CONDITION_TYPES = ("ConfigResolved", "RanksAssigned", "PeersPublished", "RestorePlanned", "Ready")


def iso_time(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, ok: bool | None, reason: str, message: str = "") -> dict[str, Any]:
    """A condition without its transition time (``merge_conditions`` stamps it)."""
    status = "Unknown" if ok is None else "True" if ok else "False"
    return {"type": kind, "status": status, "reason": reason, "message": message}


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None, new: Iterable[Mapping[str, Any]], now: float
) -> list[dict[str, Any]]:
    """``old`` updated with ``new``: a transition time changes only when a condition's status does."""
    by_type = {c.get("type"): dict(c) for c in old or ()}
    for c in new:
        before = by_type.get(c["type"])
        merged = dict(c)
        if before is not None and before.get("status") == c["status"] and before.get("lastTransitionTime"):
            merged["lastTransitionTime"] = before["lastTransitionTime"]
        else:
            merged["lastTransitionTime"] = iso_time(now)
        by_type[c["type"]] = merged
    order: dict[object, int] = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(by_type.values(), key=lambda c: (order.get(c.get("type"), len(order)), str(c.get("type"))))


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3,7"``."""
    out: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


def parse_ranges(text: str) -> list[int]:
    """Inverse of ``rank_ranges``."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclasses.dataclass(frozen=True)
class TierProgress:
    """Newest steps complete in each tier, over the whole job."""

    local: int | None = None
    """Every rank is in some node's RAM disk."""
    replicated: int | None = None
    """Every rank also has a copy on a peer node (survives the loss of any one node)."""
    backed_up: int | None = None
    """Complete in the bucket."""


def tier_progress(inventories: Sequence[NodeInventory]) -> TierProgress:
    """Derive the newest local, replicated and backed-up steps from node inventories."""
    world: dict[int, set[int]] = defaultdict(set)
    local: dict[int, set[int]] = defaultdict(set)
    replica: dict[int, set[int]] = defaultdict(set)
    for inv in inventories:
        for step, ws in inv.world_sizes.items():
            world[step].add(ws)
        for rank, holdings in inv.ranks.items():
            for step in holdings.local:
                local[step].add(rank)
            for step in holdings.replica:
                replica[step].add(rank)

    def newest(held: Mapping[int, set[int]]) -> int | None:
        for step in sorted(held, reverse=True):
            sizes = world.get(step, set())
            if len(sizes) == 1 and (ws := next(iter(sizes))) > 0 and len(held[step] & set(range(ws))) == ws:
                return step
        return None

    gcs = [s for inv in inventories for s in inv.gcs]
    return TierProgress(local=newest(local), replicated=newest(replica), backed_up=max(gcs, default=None))


def redundancy_of(inventories: Sequence[NodeInventory]) -> Redundancy | None:
    """The job's redundancy from its nodes' own: the highest factor, the fewest copies, and the earliest
    time any node has been degraded since (None: no node reported one, e.g. no local ranks yet)."""
    reported = [inv.redundancy for inv in inventories if inv.redundancy is not None]
    if not reported:
        return None
    since = [r.degraded_since for r in reported if r.degraded_since is not None]
    return Redundancy(
        factor=max(r.factor for r in reported),
        copies=min(r.copies for r in reported),
        degraded_since=min(since) if since else None,
    )


def redundancy_text(redundancy: Redundancy) -> str:
    """``replicas: 2/2``, or ``degraded since <time> (replicas: 1/2)``."""
    replicas = f"replicas: {redundancy.copies}/{redundancy.factor}"
    if redundancy.degraded_since is None:
        return replicas
    return f"degraded since {iso_time(redundancy.degraded_since)} ({replicas})"


_OVER_QUOTA_SHOWN = 3


def over_quota_text(inventories: Sequence[NodeInventory]) -> str | None:
    """The ``status.overQuota`` text: the steps the replicators refuse for the job's quota (neither
    replicated nor backed up: they declare more bytes than the job's ramdisk size, sparse files say),
    the first few by node, rank and step; None when there is none."""
    found = sorted(
        (inv.node, o.rank, o.step, o.describe(inv.job)) for inv in inventories for o in inv.over_quota
    )
    if not found:
        return None
    text = "; ".join(f"{node}: {what}" for node, _, _, what in found[:_OVER_QUOTA_SHOWN])
    more = len(found) - _OVER_QUOTA_SHOWN
    return text + (f"; and {more} more" if more > 0 else "")


_BYTE_FIELDS = (
    ("written", "written"),
    ("writtenWithoutDedup", "written_logical"),
    ("replicated", "replicated"),
    ("replicatedWithoutDedup", "replicated_logical"),
    ("uploaded", "uploaded"),
    ("uploadedWithoutDedup", "uploaded_logical"),
)


def replica_groups(inventories: Sequence[NodeInventory]) -> dict[str, Any] | None:
    """The ``status.replicaGroups`` block, or None when no rank saved in a replica group: how many
    groups, which ranks differ from their group (never deduplicated), and the newest accounted step's
    bytes written, replicated and uploaded over every node that answered, each next to what it would
    be without dedup."""
    groups = {c.group for inv in inventories for c in inv.contents if c.copy == "local"}
    if not groups:
        return None
    diverged = {r for inv in inventories for r in inv.diverged}
    accounted = [inv.step_bytes for inv in inventories if inv.step_bytes is not None]
    out: dict[str, Any] = {"groups": len(groups), "divergedRanks": rank_ranges(diverged)}
    if accounted:
        step = max(a.step for a in accounted)
        same = [a for a in accounted if a.step == step]
        out["step"] = step
        out["bytes"] = {name: sum(getattr(a, field) for a in same) for name, field in _BYTE_FIELDS}
    return out


def restore_summary(plan: RestorePlan, published: int) -> dict[str, Any]:
    """The ``status.restore`` block: step, world size and each tier's process ranks as ranges.

    Without a step (nothing to restore) ``step`` is absent and ``freshStart`` is true (a merge patch
    cannot carry null: it would delete the field).
    """
    by_tier: dict[str, list[int]] = defaultdict(list)
    for rank, tier in plan.sources.items():
        by_tier[tier.value].append(rank)
    out: dict[str, Any] = {
        "generation": plan.generation,
        "freshStart": plan.step is None,
        "worldSize": plan.world_size,
        "sources": {tier: rank_ranges(ranks) for tier, ranks in sorted(by_tier.items())},
        "published": published,
    }
    if plan.step is not None:
        out["step"] = plan.step
    if plan.decided_at:
        out["decidedAt"] = iso_time(plan.decided_at)
    return out


def config_status(
    spec_ok: bool,
    error: str,
    selected: int,
    ready: int,
    jobs: int,
    generation: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """CheckpointConfiguration status fields and its Ready condition."""
    fields = {
        "observedGeneration": generation,
        "nodesSelected": selected,
        "nodesReady": ready,
        "nodes": f"{ready}/{selected}",
        "jobs": jobs,
    }
    if not spec_ok:
        cond = condition("Ready", False, "InvalidSpec", error)
    elif ready == 0:
        cond = condition(
            "Ready", False, "NoReadyNodes", f"no ready replicator on the {selected} selected node(s)"
        )
    else:
        cond = condition(
            "Ready", True, "NodesReady", f"{ready}/{selected} selected nodes have a ready replicator"
        )
    return fields, [cond]
