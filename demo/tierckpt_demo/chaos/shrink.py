"""Shrinking a failing schedule to a small one that still fails: delta debugging (Zeller's ddmin), first
over whole rounds, then over the faults of the rounds left.

``shrink(schedule, fails, out_of_time)`` calls ``fails(candidate)``, which replays a candidate schedule
and says whether the same invariant broke again; it keeps the smallest failing candidate it found when
time runs out. A replay runs on real processes, so a race may not break again on every replay: what
comes out always failed at least once, and is as small as the time allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

from tierckpt_demo.chaos.schedule import Round, Schedule

__all__ = ["ddmin", "shrink"]

T = TypeVar("T")


def ddmin(items: Sequence[T], fails: Callable[[list[T]], bool], out_of_time: Callable[[], bool]) -> list[T]:
    """A subsequence of ``items`` that still ``fails``, from which no chunk the search tried could be
    removed (1-minimal when it ran to the end). ``items`` itself is taken to fail."""
    current = list(items)
    if not current or out_of_time():
        return current
    if fails([]):
        return []
    n = 2
    while len(current) >= 2 and not out_of_time():
        size = -(-len(current) // n)
        chunks = [current[i : i + size] for i in range(0, len(current), size)]
        for i in range(len(chunks)):
            rest = [x for j, chunk in enumerate(chunks) if j != i for x in chunk]
            if fails(rest):
                current, n = rest, max(n - 1, 2)
                break
            if out_of_time():
                return current
        else:
            if n >= len(current):
                break
            n = min(len(current), 2 * n)
    return current


def shrink(
    schedule: Schedule, fails: Callable[[Schedule], bool], out_of_time: Callable[[], bool]
) -> Schedule:
    """The smallest schedule found that still fails (``schedule`` itself is taken to fail)."""
    rounds = ddmin(
        list(range(len(schedule.rounds))),
        lambda keep: fails(_with_rounds(schedule, keep)),
        out_of_time,
    )
    kept = _with_rounds(schedule, rounds)
    faults = [(r, i) for r, rnd in enumerate(kept.rounds) for i in range(len(rnd.faults))]
    chosen = ddmin(faults, lambda keep: fails(_with_faults(kept, keep)), out_of_time)
    final = _with_faults(kept, chosen)
    return dataclasses.replace(final, note=f"shrunk from {schedule.note} ({schedule.faults} faults)")


def _with_rounds(schedule: Schedule, keep: list[int]) -> Schedule:
    return dataclasses.replace(schedule, rounds=tuple(schedule.rounds[i] for i in sorted(keep)))


def _with_faults(schedule: Schedule, keep: list[tuple[int, int]]) -> Schedule:
    wanted = set(keep)
    rounds = tuple(
        Round(steps=rnd.steps, faults=tuple(f for i, f in enumerate(rnd.faults) if (r, i) in wanted))
        for r, rnd in enumerate(schedule.rounds)
    )
    return dataclasses.replace(schedule, rounds=rounds)
