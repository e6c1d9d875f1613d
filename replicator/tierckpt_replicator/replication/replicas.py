"""The replica store on disk: what it holds, retention, and room for incoming replicas.

Replicas share the ramdisk with the client's own steps, so a replica is only accepted if, after it,
there is still room for ``reserve_bytes`` plus the client's next save (the size of each local rank's
newest step). Older replicas that retention would drop anyway are dropped first to make room; the
newest complete copy of every rank is never dropped for room.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from tierckpt.protocol import leases
from tierckpt.protocol.control import RestorePlan, read_control
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import (
    check_job_id,
    committed_steps,
    discard_step,
    job_dir,
    rank_dir,
    ranks_in,
    read_commit,
    replica_rank_dir,
    step_dir,
)
from tierckpt_replicator.replication.replica_retention import replicas_to_drop

__all__ = ["apply_retention", "client_headroom", "free_bytes", "held_replicas", "make_room", "pinned_steps"]

log = logging.getLogger(__name__)


def held_replicas(root: Path, job: str) -> dict[int, list[int]]:
    """Rank -> committed replica steps this node holds for ``job``."""
    parent = job_dir(root, job) / "replicas"
    return {r: committed_steps(replica_rank_dir(root, job, r)) for r in ranks_in(parent)}


def pinned_steps(root: Path, job: str) -> set[int]:
    """Steps retention must keep: the published restore plan's step."""
    try:
        plan = read_control(root, job, RestorePlan.FILE, RestorePlan)
    except FormatError:
        return set()
    return {plan.step} if isinstance(plan, RestorePlan) and plan.step is not None else set()


def apply_retention(root: Path, job: str, keep: int) -> list[tuple[int, int]]:
    """Drop the replicas retention allows; returns the ``(rank, step)`` dropped."""
    held = held_replicas(root, job)
    leased = {r: leases.leased_steps(replica_rank_dir(root, job, r)) for r in held}
    drop = replicas_to_drop(held, keep=keep, pinned=pinned_steps(root, job), leased=leased)
    dropped = []
    for rank, steps in drop.items():
        parent = replica_rank_dir(root, job, rank)
        with leases.lock(parent):  # a reader leasing meanwhile either sees the step stay or learns it is gone
            now_leased = leases.leased_steps(parent)
            for step in steps:
                if step not in now_leased:
                    discard_step(step_dir(parent, step))
                    dropped.append((rank, step))
    if dropped:
        log.info("job %s: dropped old replicas %s", job, dropped)
    return dropped


def make_room(root: Path, job: str) -> list[tuple[int, int]]:
    """Drop every replica of ``job`` but the newest (and pinned/leased) ones, to fit a newer one."""
    return apply_retention(root, job, keep=1)


def free_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def client_headroom(root: Path) -> int:
    """Room the client needs for its next save: the newest committed step of every local rank."""
    total = 0
    try:
        jobs = [n for n in os.listdir(root) if (root / n).is_dir()]
    except FileNotFoundError:
        return 0
    for job in jobs:
        try:
            check_job_id(job)
        except FormatError:
            continue
        for rank in ranks_in(job_dir(root, job)):
            steps = committed_steps(rank_dir(root, job, rank))
            if steps:
                with contextlib.suppress(FormatError):
                    marker = read_commit(step_dir(rank_dir(root, job, rank), steps[-1]))
                    total += marker.total_bytes if marker else 0
    return total
