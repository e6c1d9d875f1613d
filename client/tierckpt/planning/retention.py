"""Which steps of one rank directory may go (pure: no file access; the caller does the I/O).

Rules (docs/format.md, "Retention"):

* the newest ``keep`` committed steps stay;
* the newest committed step always stays, whatever ``keep`` says;
* after a commit, the steps above the one just committed (``latest``) are not newer but superseded:
  they were saved before training went back to an older step (a restore to it), so they go like older
  ones, and the step just committed counts as the newest;
* an older committed step with an unexpired lease stays until the lease ends ("held");
* every other committed step is retired (its COMMIT removed first, then its files recycled or deleted);
* step directories without a COMMIT are crash leftovers and are discarded, except the one being
  written right now and any that is leased.

``staged_step`` is the step the rank's restore status says the replicator stages or staged for the job's
restore, while the rank committed nothing since: retention keeps it. ``restore_floor`` is where such a
status says the job goes back to (that step, or ``FRESH_START`` when it starts afresh): the rank's steps
above it were saved by the run the job left (the client retires or replaces them at its next commit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from tierckpt.protocol.control import RestoreState, RestoreStatus

__all__ = [
    "FRESH_START",
    "RetentionPlan",
    "plan_retention",
    "restore_floor",
    "staged_step",
    "status_is_fresh",
]

FRESH_START = -1
"""``restore_floor`` of a job told to start afresh: every step it holds is above it."""


@dataclasses.dataclass(frozen=True)
class RetentionPlan:
    kept: tuple[int, ...]
    """Committed steps retained by policy, oldest first."""
    held: tuple[int, ...]
    """Committed steps past the policy that a lease keeps alive, oldest first."""
    retire: tuple[int, ...]
    """Committed steps to remove, oldest first."""
    discard: tuple[int, ...]
    """Uncommitted step directories to remove."""


def plan_retention(
    committed: Iterable[int],
    *,
    keep: int,
    leased: Collection[int] = (),
    uncommitted: Iterable[int] = (),
    in_flight: int | None = None,
    latest: int | None = None,
) -> RetentionPlan:
    """Apply the retention rules to the steps present in one rank directory (``latest``: the step just
    committed, after a commit)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    steps = sorted(set(committed))
    current = steps if latest is None or latest not in steps else [s for s in steps if s <= latest]
    kept = current[-keep:]
    older = sorted(set(steps) - set(kept))
    return RetentionPlan(
        kept=tuple(kept),
        held=tuple(s for s in older if s in leased),
        retire=tuple(s for s in older if s not in leased),
        discard=tuple(
            sorted(s for s in set(uncommitted) if s != in_flight and s not in leased and s not in steps)
        ),
    )


def staged_step(status: RestoreStatus | None, newest_commit_at: float | None) -> int | None:
    """The step the replicator stages (``staging``) or staged (``ready``) into this rank for the job's
    restore, while no commit is newer than the status; None otherwise. Retention must keep it: the next
    load takes it, even when the rank holds newer steps the plan could not use."""
    if status is None or status.state not in (RestoreState.STAGING, RestoreState.READY):
        return None
    return status.step if status_is_fresh(status, newest_commit_at) else None


def restore_floor(status: RestoreStatus | None, newest_commit_at: float | None) -> int | None:
    """The step the job goes back to, by the rank's restore status while no commit is newer than it: the
    step staged (``staging``, ``ready``), or ``FRESH_START`` when the job starts afresh (``none``). None
    when there is no such status (absent, stale, ``pending``, ``failed``)."""
    if status is not None and status.state is RestoreState.NONE and status_is_fresh(status, newest_commit_at):
        return FRESH_START
    return staged_step(status, newest_commit_at)


def status_is_fresh(status: RestoreStatus, newest_commit_at: float | None) -> bool:
    """Whether ``status`` is newer than the rank's newest commit (training has not saved since)."""
    return newest_commit_at is None or newest_commit_at <= status.updated_at
