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
from collections.abc import Collection
from pathlib import Path

from tierckpt.protocol import leases
from tierckpt.protocol.control import RestorePlan, read_control
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import committed_steps, discard_step, read_commit
from tierckpt_replicator.inventory import list_jobs
from tierckpt_replicator.replication.fragments import fragment_trees
from tierckpt_replicator.replication.replica_retention import replicas_to_drop
from tierckpt_replicator.stepio import open_job, rank_trees, step_name

__all__ = [
    "apply_retention",
    "client_headroom",
    "drop_above",
    "drop_left_behind",
    "free_bytes",
    "make_room",
    "pinned_steps",
]

log = logging.getLogger(__name__)


def pinned_steps(root: Path, job: str) -> set[int]:
    """Steps retention must keep: the published restore plan's step."""
    try:
        plan = read_control(root, job, RestorePlan.FILE, RestorePlan)
    except FormatError:
        return set()
    return {plan.step} if isinstance(plan, RestorePlan) and plan.step is not None else set()


def apply_retention(root: Path, job: str, keep: int) -> list[tuple[int, int]]:
    """Drop the replicas retention allows; returns the ``(rank, step)`` dropped."""
    try:
        tree = open_job(root, job)
    except FileNotFoundError:
        return []
    dropped = []
    with tree:
        ranks = rank_trees(tree, "replica")
        held = {r: committed_steps(t) for r, t in ranks.items()}
        leased = {r: leases.leased_steps(ranks[r]) for r in held}
        drop = replicas_to_drop(held, keep=keep, pinned=pinned_steps(root, job), leased=leased)
        for rank, steps in drop.items():
            parent = ranks[rank]
            with leases.lock(
                parent
            ):  # a reader leasing meanwhile either sees the step stay or learns it is gone
                now_leased = leases.leased_steps(parent)
                for step in steps:
                    if step not in now_leased:
                        discard_step(parent.at(step_name(step)))
                        dropped.append((rank, step))
    if dropped:
        log.info("job %s: dropped old replicas %s", job, dropped)
    return dropped


def drop_above(root: Path, job: str, step: int) -> list[tuple[int, int]]:
    """Drop this node's replicas (and erasure-coded fragments) of ``job`` above ``step``, the step the job
    restores (``FRESH_START`` for a fresh start: every step): they were saved by the run the job goes back
    from, and training saves those step numbers again. A leased one stays until its reader is done (a new
    save of its step replaces it). Returns the ``(rank, step)`` dropped."""
    try:
        tree = open_job(root, job)
    except FileNotFoundError:
        return []
    dropped = []
    with tree:
        for rank, parent in [*rank_trees(tree, "replica").items(), *fragment_trees(tree).items()]:
            with leases.lock(parent):
                leased = leases.leased_steps(parent)
                for held in committed_steps(parent):
                    if held > step and held not in leased:
                        discard_step(parent.at(step_name(held)))
                        dropped.append((rank, held))
    if dropped:
        log.info(
            "job %s: dropped copies %s above step %d, the job restores it (saved by the run it left)",
            job,
            dropped,
            step,
        )
    return dropped


def drop_left_behind(
    root: Path, job: str, plan: RestorePlan, running: Collection[int]
) -> list[tuple[int, int]]:
    """Drop the primary steps ``plan`` leaves behind (``RestorePlan.left_behind``: saved by the run the job
    goes back from) of the ranks that no process of this node runs now (not in ``running``). A rank's
    client retires those of its own rank at its first commit; a rank the node ran before the job was
    resized has no client here to do it, and once training saves past the plan's step again, such a
    step would be the rank's newest here while the rank's new save of that step number lives on another
    node (it was sent, counted and read as the job's). A leased one stays until its reader is done.
    Returns the ``(rank, step)`` dropped."""
    try:
        tree = open_job(root, job)
    except FileNotFoundError:
        return []
    dropped = []
    with tree:
        for rank, parent in rank_trees(tree, "primary").items():
            if rank in running:
                continue
            with leases.lock(parent):
                leased = leases.leased_steps(parent)
                for held in committed_steps(parent):
                    step = parent.at(step_name(held))
                    try:
                        marker = read_commit(step)
                    except (FormatError, OSError):
                        continue  # unreadable: the inventory skips it too
                    if (
                        marker is not None
                        and held not in leased
                        and plan.left_behind(held, marker.committed_at)
                    ):
                        discard_step(step)
                        dropped.append((rank, held))
    if dropped:
        log.info(
            "job %s: dropped primary steps %s of ranks this node no longer runs: above step %s, the job "
            "restores it (saved by the run it left)",
            job,
            dropped,
            plan.step,
        )
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
    for job in list_jobs(root):
        try:
            tree = open_job(root, job)
        except (FileNotFoundError, NotADirectoryError, FormatError):
            continue
        with tree:
            for rank in rank_trees(tree, "primary").values():
                steps = committed_steps(rank)
                if steps:
                    with contextlib.suppress(FormatError):
                        marker = read_commit(rank.at(step_name(steps[-1])))
                        total += marker.total_bytes if marker else 0
    return total
