"""When to back up and which backed-up steps to keep (pure functions; no I/O, no clocks).

Every node evaluates these on the same bucket state and gets the same answer, which is what lets the
nodes of a job back up the same steps without talking to each other:

* ``BackupPolicy.due`` decides whether a newly committed step should go to the bucket: on demand
  (API call, preemption), when no complete backup exists yet, or once ``interval_steps`` steps or
  ``interval_seconds`` seconds have passed since the newest *complete* backup. A step that is not
  newer than the newest complete backup is never due, and while another backup of the job is in
  progress (started less than ``stale_after`` seconds ago) no new one starts: nodes join that one.
* ``BackupPolicy.gives_up`` decides when a started backup can no longer complete, so that it stops
  holding new ones back: once its takeover window is over, no node is uploading it and this node
  holds none of its missing ranks (retention removed them, or its replicas went elsewhere).
* ``BackupPolicy.retention`` keeps the newest ``keep_last`` complete steps plus, when ``keep_every``
  is set, the oldest complete step of every ``keep_every``-step window (step 0-999, 1000-1999, ... for
  ``keep_every=1000``), so a step once kept for its window stays kept as newer steps arrive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["BackupPolicy", "Decision", "RetentionPlan"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether a step is due for backup, and why (the reason goes into logs and ``started.json``)."""

    due: bool
    reason: str

    def __bool__(self) -> bool:
        return self.due


@dataclasses.dataclass(frozen=True)
class RetentionPlan:
    keep: tuple[int, ...]
    delete: tuple[int, ...]
    """Complete steps to delete, oldest first (each: completion object first, then the rest)."""


@dataclasses.dataclass(frozen=True)
class BackupPolicy:
    """Backup schedule and retention. All intervals are measured against the newest complete backup.

    ``interval_steps``: back up a step at least this many steps after the newest complete backup
    (0: no step-based schedule). ``interval_seconds``: back up once this long has passed since the
    newest complete backup was completed (0: no time-based schedule). With both 0 backups happen only
    on demand. ``keep_last`` (>= 1): newest complete steps kept. ``keep_every``: also keep the oldest
    complete step of every window of this many steps (0: off). ``stale_after``: a started backup that
    is not complete after this many seconds no longer holds back a new one. ``takeover_after``: the
    seconds after a backup began during which its missing ranks may still be taken over by their
    holders (after that, see ``gives_up``).
    """

    interval_steps: int = 0
    interval_seconds: float = 1800.0
    keep_last: int = 3
    keep_every: int = 0
    stale_after: float = 3600.0
    takeover_after: float = 120.0

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError("keep_last must be at least 1: the newest complete backup is always kept")
        for name in ("interval_steps", "interval_seconds", "keep_every", "stale_after", "takeover_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    @property
    def periodic(self) -> bool:
        return self.interval_steps > 0 or self.interval_seconds > 0

    def due(
        self,
        step: int,
        *,
        newest_complete: tuple[int, float] | None,
        in_progress: Iterable[tuple[int, float]] = (),
        now: float,
        on_demand: bool = False,
    ) -> Decision:
        """Is ``step`` due? ``newest_complete``: ``(step, completed_at)`` of the newest complete backup;
        ``in_progress``: ``(step, started_at)`` of started but incomplete backups; ``now``: wall clock."""
        if newest_complete is not None and step <= newest_complete[0]:
            return Decision(False, f"not newer than the newest complete backup (step {newest_complete[0]})")
        if on_demand:
            return Decision(True, "on demand")
        if not self.periodic:
            return Decision(False, "no backup schedule (on demand only)")
        floor = newest_complete[0] if newest_complete else -1
        running = [s for s, at in in_progress if s > floor and now - at < self.stale_after]
        if running:
            return Decision(False, f"backup of step {max(running)} in progress")
        if newest_complete is None:
            return Decision(True, "no complete backup yet")
        last_step, last_at = newest_complete
        steps, seconds = step - last_step, now - last_at
        if self.interval_steps and steps >= self.interval_steps:
            return Decision(True, f"{steps} steps since the last backup (every {self.interval_steps})")
        if self.interval_seconds and seconds >= self.interval_seconds:
            return Decision(True, f"{seconds:.0f}s since the last backup (every {self.interval_seconds:g}s)")
        return Decision(False, "not due yet")

    def gives_up(self, *, started_at: float, now: float, holds_missing: bool, being_uploaded: bool) -> bool:
        """Can a started, incomplete backup no longer complete? Yes once its takeover window is over
        (every holder of a missing rank has had ``takeover_after`` seconds to upload it), no node holds a
        live writer lease on it (``being_uploaded``) and this node holds none of its missing ranks
        (``holds_missing``: it would upload them now). Such a backup no longer holds new ones back and
        nodes stop joining it; if a holder still completes it, it is kept like any complete step."""
        return now - started_at >= self.takeover_after and not holds_missing and not being_uploaded

    def retention(self, complete: Iterable[int], protect: Iterable[int] = ()) -> RetentionPlan:
        """Which complete steps to keep and delete. ``protect``: steps never deleted (e.g. being restored)."""
        steps = sorted(set(complete))
        keep = set(steps[-self.keep_last :]) | (set(protect) & set(steps))
        if self.keep_every:
            first_of_window: dict[int, int] = {}
            for s in steps:
                first_of_window.setdefault(s // self.keep_every, s)
            keep |= set(first_of_window.values())
        return RetentionPlan(keep=tuple(sorted(keep)), delete=tuple(s for s in steps if s not in keep))
