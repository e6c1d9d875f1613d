"""One collective answer to "is there a DCP checkpoint, and which step": ``agreed_step``.

Every rank calls it; every rank gets the same step, or None everywhere (start fresh). The answer is

1. the operator's restore plan, when there is one: each rank waits for its node's replicator to stage
   its restore (``snapshot.restore_wait``, progress-based) and reads the step from its restore status.
   A status older than this rank's newest commit is stale (training saved since) and ignored;
2. otherwise the newest step that every rank can load, agreed across the process group: each rank
   reports what its node holds (primaries and replicas, with the world size each step was saved with),
   and the group applies the restore rule of ``tierckpt.planning.restore_plan``: a step is loadable when
   every one of its ranks is held on some node (a load fetches what its node lacks from the others).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from tierckpt.planning.restore_plan import restorable_steps
from tierckpt.protocol.control import NodeInventory, RankHoldings
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import (
    committed_steps,
    job_dir,
    rank_dir,
    ranks_in,
    read_commit,
    read_manifest,
    replica_rank_dir,
)
from tierckpt.settings import resolve
from tierckpt.snapshot import agree, restore_wait

__all__ = ["agreed_step", "node_holdings"]

log = logging.getLogger(__name__)

Holdings = tuple[dict[int, RankHoldings], dict[int, int]]
"""Rank -> committed steps held (primary, replica); step -> the world size it was saved with."""


def node_holdings(root: Path, job: str) -> Holdings:
    """The committed DCP steps this node holds for ``job``, and each step's world size."""
    base = job_dir(root, job)
    held: dict[int, RankHoldings] = {}
    paths: dict[int, Path] = {}
    for kind, parent, dir_of in (("local", base, rank_dir), ("replica", base / "replicas", replica_rank_dir)):
        for rank in ranks_in(parent):
            rank_path = dir_of(root, job, rank)
            steps = tuple(committed_steps(rank_path))
            old = held.get(rank, RankHoldings())
            held[rank] = (
                RankHoldings(old.local, steps) if kind == "replica" else RankHoldings(steps, old.replica)
            )
            for step in steps:
                paths.setdefault(step, rank_path / f"step-{step:012d}")
    world: dict[int, int] = {}
    for step, path in paths.items():
        try:
            manifest = read_manifest(path)
        except (FormatError, OSError) as exc:
            log.warning("skipping %s: %s", path, exc)
            continue
        if manifest.manifest_kind == "dcp":
            world[step] = manifest.world_size
    dcp = set(world)
    held = {
        r: RankHoldings(tuple(s for s in h.local if s in dcp), tuple(s for s in h.replica if s in dcp))
        for r, h in held.items()
    }
    return held, world


def _newest_commit_at(rank_path: Path) -> float | None:
    steps = committed_steps(rank_path)
    if not steps:
        return None
    try:
        marker = read_commit(rank_path / f"step-{steps[-1]:012d}")
    except FormatError:
        return None
    return marker.committed_at if marker is not None else None


def agreed_step(
    root: str | os.PathLike[str] | None = None,
    job: str | None = None,
    *,
    process_group: Any = None,
) -> int | None:
    """The step every rank of ``process_group`` loads (the same on all of them), or None everywhere.

    A collective: call it on every rank, before ``dcp.load(state, checkpoint_id=step, ...)``.
    """
    s = resolve(root=root, job=job)
    status = restore_wait.wait_for_restore(
        s.root, s.job, s.rank, expect_replicator=bool(s.replicator_url), stall_timeout=s.restore_wait
    )
    instruction = restore_wait.restore_target(status, _newest_commit_at(rank_dir(s.root, s.job, s.rank)))
    gathered = agree.all_gather((instruction, node_holdings(s.root, s.job)), process_group)
    plans = {i for i, _ in gathered if i != restore_wait.USE_LOCAL}
    if len(plans) == 1:
        step: int | None = next(iter(plans))
        log.info(
            "rank %d: the restore plan says %s", s.rank, "start fresh" if step is None else f"step {step}"
        )
        return step
    if plans:
        log.warning("ranks were told different restore steps %s; agreeing on what the nodes hold", plans)
    now = time.time()
    inventories = [
        NodeInventory(job=s.job, node=f"rank-{r}", endpoint="", updated_at=now, ranks=held, world_sizes=world)
        for r, (_, (held, world)) in enumerate(gathered)
    ]
    restorable = restorable_steps(inventories)
    step = restorable[0][0] if restorable else None
    log.info(
        "rank %d: agreed on %s from what the nodes hold",
        s.rank,
        "no step" if step is None else f"step {step}",
    )
    return step
