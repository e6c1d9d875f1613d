"""Waiting for the node's replicator to stage this rank's restore (``control/restore-rank-NNNNN.json``).

The replicator writes a ``control.RestoreStatus`` while it brings a step to this node's ramdisk.
``wait_for_restore`` waits while that file's ``updated_at`` keeps moving and returns once the state
is ``ready`` or ``none``; ``failed`` raises. A status that stops moving for ``stall_timeout`` seconds
is given up on (logged), and the client loads what the ramdisk holds. Without a status file and
without a replicator URL nothing waits at all.

``restore_target`` decides what a status means for this load (pure): a status older than the newest
local commit is stale (training has saved since), and is ignored. ``staged_step``
(``tierckpt.planning.retention``) is the step a fresh status stages or staged: the writer's retention
keeps it (``snapshot.rankdir``) until the rank saved after it, so a restore to a step older than the
rank's newest survives the crash clean-up of the ``Checkpointer`` that loads it. ``restored_from``
says, after a load, where the step came from (the tier the replicator staged it from, or this node's
own ramdisk).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from tierckpt.planning.retention import staged_step, status_is_fresh
from tierckpt.protocol.control import RestoreState, RestoreStatus, Tier, read_restore_status
from tierckpt.protocol.errors import FormatError, RetryableError
from tierckpt.protocol.format import rank_dir, read_commit, step_dir

__all__ = [
    "USE_LOCAL",
    "Restored",
    "current_status",
    "restore_target",
    "restored_from",
    "staged_step",
    "wait_for_restore",
]

log = logging.getLogger(__name__)

USE_LOCAL = "local"
"""``restore_target`` result: no instruction from the replicator; use the newest local step."""


def wait_for_restore(
    root: Path,
    job: str,
    rank: int,
    *,
    expect_replicator: bool,
    stall_timeout: float,
    poll: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RestoreStatus | None:
    """Wait for the replicator's restore status of ``rank`` to settle; None when there is none."""
    last_seen: float | None = None
    last_progress = clock()
    announced = False
    while True:
        status = read_restore_status(root, job, rank)
        if status is None and not expect_replicator:
            return None
        if status is not None:
            if status.state in (RestoreState.READY, RestoreState.NONE):
                return status
            if status.state is RestoreState.FAILED:
                raise RetryableError(
                    f"the replicator could not stage rank {rank}'s restore: {status.message}"
                )
            if status.updated_at != last_seen:
                last_seen, last_progress = status.updated_at, clock()
        if not announced:
            log.info(
                "waiting for the replicator to stage rank %d's restore (%s)",
                rank,
                status and status.state.value,
            )
            announced = True
        if clock() - last_progress > stall_timeout:
            log.warning(
                "no restore progress for rank %d in %.0f s (status: %s); loading what the ramdisk holds",
                rank,
                stall_timeout,
                status.state.value if status else "absent",
            )
            return status
        sleep(poll)


def current_status(root: Path, job: str, rank: int) -> RestoreStatus | None:
    """The rank's restore status as it is now, without waiting; None when there is none, or when it
    cannot be read (logged: retention then keeps no staged step, a load reports the file itself)."""
    try:
        return read_restore_status(root, job, rank)
    except (OSError, FormatError) as exc:
        log.warning("cannot read rank %d's restore status: %s", rank, exc)
        return None


def restore_target(status: RestoreStatus | None, newest_commit_at: float | None) -> int | str | None:
    """The step a load should take: a step, None (start fresh) or ``USE_LOCAL`` (pure)."""
    if status is None or status.state not in (RestoreState.READY, RestoreState.NONE):
        return USE_LOCAL
    if not status_is_fresh(status, newest_commit_at):
        return USE_LOCAL  # saved since the replicator staged: its instruction is stale
    return status.step if status.state is RestoreState.READY else None


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where the step a rank loaded came from."""

    step: int
    tier: Tier
    """The tier the node's replicator staged the step from (its restore status names this step), else
    ``Tier.LOCAL``: the step was on this node's ramdisk already."""
    committed_at: float
    """When the step was saved (its COMMIT marker; 0.0 when that is unreadable)."""
    total_bytes: int
    staged_at: float
    """When the replicator finished staging it (0.0: it did not stage it)."""


def restored_from(root: str | Path, job: str, rank: int, step: int) -> Restored:
    """Where ``rank``'s ``step``, just loaded from ``<root>/<job>``, came from (reads its COMMIT and the
    replicator's restore status)."""
    try:
        marker = read_commit(step_dir(rank_dir(root, job, rank), step))
    except FormatError:
        marker = None
    try:
        status = read_restore_status(root, job, rank)
    except FormatError:
        status = None
    committed_at, total_bytes = (marker.committed_at, marker.total_bytes) if marker else (0.0, 0)
    if status is not None and status.state is RestoreState.READY and status.step == step and status.source:
        return Restored(step, status.source, committed_at, total_bytes, status.updated_at)
    return Restored(step, Tier.LOCAL, committed_at, total_bytes, 0.0)
