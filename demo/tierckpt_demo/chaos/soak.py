"""What a chaos run measured of a job's goodput, as a ``SoakResult`` (``tierckpt plan --soak`` compares it
with the goodput model, docs/goodput.md).

Read from the trainers' own event files (rank 0 of every launch of the job, in launch order; the job's
restore waits for its slowest rank, so a restore's tier is the farthest any rank restored from and its
time the longest). The harness's holds between rounds are not training time and are left out: a launch
counts from its restore (a new round) or from the end of the launch it replaces (a failure: its restart
and restore are downtime), to its last step. A launch that did not end held was a failure, and the next
one's restore says what it cost: the steps from the one restored to the last one trained are redone.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path

from tierckpt.planning.goodput import SoakFailure, SoakResult
from tierckpt_demo.training import TrainerEvent, read_events

__all__ = ["soak_result"]

_TIERS = {"none": 0, "local": 1, "peer": 2, "bucket": 3}


@dataclass(frozen=True)
class _Launch:
    ranks: dict[int, list[TrainerEvent]]

    def first(self, event: str) -> list[TrainerEvent]:
        return [e for evs in self.ranks.values() for e in evs if e.event == event][: len(self.ranks)]

    @property
    def steps(self) -> list[TrainerEvent]:
        return [e for e in self.ranks.get(0, []) if e.event == "step" and e.step is not None]

    @property
    def held(self) -> bool:
        return any(e.event in ("held", "done") for e in self.ranks.get(0, []))


def _launches(launches: Path, job: str) -> list[_Launch]:
    out = []
    for folder in sorted(launches.glob(f"launch-*-{job}")):
        ranks = {int(p.stem.rsplit("-", 1)[1]): read_events(p) for p in folder.glob("events-rank-*.jsonl")}
        if ranks.get(0):
            out.append(_Launch(ranks))
    return out


def soak_result(launches: Path, job: str, *, backup_every: int, factor: int) -> SoakResult | None:
    """The goodput ``job``'s launches (under ``launches``) measured, or None if it never trained."""
    runs = _launches(launches, job)
    gaps = [
        b.time - a.time for r in runs for a, b in itertools.pairwise(r.steps) if b.step == (a.step or 0) + 1
    ]
    if not gaps:
        return None
    step_s = statistics.median(gaps)  # a step's compute, with any save's blocking time excluded
    saves = [e.seconds for r in runs for e in r.ranks.get(0, []) if e.event == "saved"]
    save_s = statistics.fmean(saves) if saves else 0.0
    # steps between saves, from the launches' own saves
    saved_steps = sorted({e.step for r in runs for e in r.ranks.get(0, []) if e.event == "saved" and e.step})
    every = min((b - a for a, b in itertools.pairwise(saved_steps) if b > a), default=1)
    wall = 0.0
    failures = []
    trained: set[int] = set()
    pending: tuple[float, int] | None = None
    """A failure not restored yet: when its launch went, and the last step it trained."""
    for run in runs:
        restored = run.first("restored")
        gone = max(e.time for evs in run.ranks.values() for e in evs)
        end = max((e.time for evs in run.ranks.values() for e in evs if e.event != "held"), default=gone)
        if restored:
            slowest = max(restored, key=lambda e: e.time)
            back_to = min(e.step or 0 for e in restored)
            if pending is not None:
                restore_s = max(e.seconds for e in restored)
                tier = max((e.tier for e in restored), key=lambda t: _TIERS.get(t, 0))
                failures.append(
                    SoakFailure(
                        tier=tier if tier in ("local", "peer") else "bucket",
                        lost_work_s=max(0, pending[1] - back_to) * step_s,
                        restart_s=max(0.0, slowest.time - restore_s - pending[0]),
                        restore_s=restore_s,
                    )
                )
                wall += end - pending[0]
            else:
                wall += end - slowest.time
            trained = {s for s in trained if s <= back_to} | {e.step for e in run.steps if e.step is not None}
        if run.held:
            pending = None
        elif pending is None or restored:  # a launch killed while loading extends the failure before it
            pending = (gone, max(trained, default=0))
    return SoakResult(
        nodes=max(len(r.ranks) for r in runs),
        wall_s=wall,
        useful_s=len(trained) * step_s,
        interval_s=every * step_s,
        backup_interval_s=backup_every * step_s,
        factor=factor,
        saves=len(saves),
        save_s=save_s,
        failures=tuple(failures),
    )
