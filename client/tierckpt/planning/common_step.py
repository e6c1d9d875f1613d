"""The newest step that every rank holds (pure): one answer for the client, replicator and backups."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["common_steps", "current_ranks", "newest_common_step"]


def common_steps(per_rank: Iterable[Iterable[int]]) -> list[int]:
    """Steps held by every one of ``per_rank``, newest first ([] when ``per_rank`` is empty)."""
    sets = [set(steps) for steps in per_rank]
    if not sets:
        return []
    return sorted(set.intersection(*sets), reverse=True)


def newest_common_step(per_rank: Iterable[Iterable[int]]) -> int | None:
    """The newest step held by every one of ``per_rank``; None when there is none."""
    steps = common_steps(per_rank)
    return steps[0] if steps else None


def current_ranks(newest: Mapping[int, tuple[float, int]]) -> set[int]:
    """The ranks of ``newest`` (rank -> commit time and world size of its newest step on one node) that
    the job still saves there: those of the world size of the step committed last. A node whose job
    resharded keeps the primaries of the ranks it ran before (nothing retires them), and their steps
    never advance: the node's newest common step stayed at theirs, and it backed up nothing newer."""
    if not newest:
        return set()
    _, world = max(newest.values())
    return {rank for rank, (_, w) in newest.items() if w == world}
