"""One rank directory as the DCP writer uses it: reusable mapped data files, and retention.

Data files come from ``snapshot.pool.SlotPool`` (the same pool ``Checkpointer`` uses): they stay
mapped and pre-faulted across saves, and a retired step's files become the next save's, so a save
copies into pages that already exist instead of allocating the ramdisk anew.

Retention differs from ``Checkpointer``'s in one way: a rank's own COMMIT does not make a DCP
checkpoint, the coordinator's does (it commits only after every rank wrote). So a rank retires a
step only when ``keep`` newer *complete* checkpoints exist (steps the coordinator committed), and
never the step being written. A failed save therefore never costs the last complete checkpoint.

As for ``Checkpointer``, steps above the one just committed were saved before training went back to an
older step (a restore to it): they are retired. And while the rank's restore status says the replicator
staged an older step for the job's restore (``went_back_to``), a save of a step the rank already holds
replaces the one the run the job went back from left there.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Collection, Iterable
from pathlib import Path

from tierckpt.planning.retention import restore_floor
from tierckpt.protocol import leases
from tierckpt.protocol.control import RestoreStatus
from tierckpt.protocol.format import (
    committed_steps,
    discard_step,
    read_commit,
    step_dir,
    step_dirs,
)
from tierckpt.snapshot.layout import LayoutPlan
from tierckpt.snapshot.pool import Slot, SlotPool
from tierckpt.snapshot.rankdir import scan_steps, uncommit
from tierckpt.snapshot.shardfile import MappedFile

__all__ = ["RankStore", "live_mapping", "plan_dcp_retention", "went_back_to"]

log = logging.getLogger(__name__)

_live: weakref.WeakValueDictionary[str, RankStore] = weakref.WeakValueDictionary()
"""The rank stores of this process's writers, by rank directory: a load in the same process reads a
step's files through the mappings the writer keeps (pinned and faulted in) instead of mapping them
afresh."""


def live_mapping(rank_path: Path, step: int, name: str) -> MappedFile | None:
    """The mapping a writer of this process keeps of data file ``name`` of ``step`` in ``rank_path``,
    while it still maps the file there (not one replaced since, e.g. by a restore); else None. The
    caller holds a lease on the step (retention never recycles a leased step's files) and does not
    close it."""
    store = _live.get(os.path.realpath(rank_path))
    slot = None if store is None else store.pool.slot_of(step)
    if slot is None:
        return None
    path = step_dir(rank_path, step) / name
    return next((f for f in slot.files if f.path.name == name and f.backs(path)), None)


def plan_dcp_retention(
    committed: Iterable[int], complete: Iterable[int], *, keep: int, leased: Collection[int] = ()
) -> tuple[int, ...]:
    """Committed steps of one rank to retire: those older than the ``keep`` newest complete checkpoints
    (that this rank holds), unless leased. Nothing is retired before ``keep`` complete checkpoints exist."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    held = sorted(set(committed))
    kept = sorted(set(complete) & set(held))[-keep:]
    if len(kept) < keep:
        return ()
    return tuple(s for s in held if s < kept[0] and s not in leased)


def went_back_to(rank_path: Path, restore: RestoreStatus | None, step: int) -> int | None:
    """The older step this rank's job restores, if ``step`` is above it: the replicator staged that step
    for the job's restore, or told it to start afresh (``FRESH_START``), and the rank saved nothing since
    (``restore``, its restore status, is newer than every commit in ``rank_path``). The rank's steps
    above it were saved by the run the job went back from, and saving ``step`` again replaces that
    run's. None otherwise."""
    floor = restore_floor(restore, scan_steps(rank_path).newest_commit_at)
    return floor if floor is not None and floor < step else None


class RankStore:
    """The slot pool and retention of one rank directory."""

    def __init__(self, rank_path: Path, *, keep: int) -> None:
        self.rank_path = rank_path
        self.keep = keep
        rank_path.mkdir(parents=True, exist_ok=True)
        self.pool = SlotPool(rank_path, target=keep + 2)  # keep complete + one unconfirmed + the new one
        self.pool.adopt_spares(committed_count=len(committed_steps(rank_path)))
        self._key = os.path.realpath(rank_path)
        _live[self._key] = self

    def take(self, step: int, plan: LayoutPlan) -> Slot:
        """Mapped data files for ``plan`` inside ``step``'s directory (a spare's pages when one is free)."""
        return self.pool.take(step, plan)

    def forget(self, slot: Slot) -> None:
        self.pool.forget(slot)

    def committed(self, step: int, slot: Slot, complete: Iterable[int] | None) -> None:
        """Track a committed step's slot, then apply retention (``complete`` None: not known now)."""
        self.pool.committed(step, slot)
        if complete is not None:
            self.retire(complete, current=step)

    def retire(self, complete: Iterable[int], *, current: int) -> None:
        leases.purge_expired(self.rank_path)
        with leases.lock(self.rank_path):
            held = leases.leased_steps(self.rank_path)
            committed = committed_steps(self.rank_path)
            superseded = tuple(s for s in committed if s > current and s not in held)
            retire = plan_dcp_retention(
                [s for s in committed if s <= current],
                [s for s in complete if s <= current],
                keep=self.keep,
                leased=held,
            )
            uncommit(self.rank_path, retire + superseded)
        if superseded:
            log.info(
                "retiring steps %s of %s: saved before training went back (%d was just saved)",
                list(superseded),
                self.rank_path,
                current,
            )
        for step in retire + superseded:
            log.debug("retiring DCP step %d of %s", step, self.rank_path)
            self.pool.recycle(step, step_dir(self.rank_path, step))
        self._discard_leftovers(current, held)
        self.pool.trim()

    def _discard_leftovers(self, current: int, leased: Collection[int]) -> None:
        """Remove step directories that never committed (a crashed or failed save), except ``current``."""
        for step, path in step_dirs(self.rank_path).items():
            if step == current or step in leased:
                continue
            try:
                committed = read_commit(path) is not None
            except Exception:  # a corrupt marker: leave it for inspection (verify/CLI report it)
                continue
            if not committed:
                log.warning("removing step %d of %s: it never committed", step, self.rank_path)
                discard_step(path)

    def close(self) -> None:
        if _live.get(self._key) is self:
            del _live[self._key]
        self.pool.close()
