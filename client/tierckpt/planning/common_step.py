"""The newest step that every rank holds (pure): one answer for the client, replicator and backups."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["common_steps", "newest_common_step"]


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
