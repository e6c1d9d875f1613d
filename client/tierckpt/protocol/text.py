"""How tierckpt's programs write protocol values for people: rank lists as ranges, durations."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["duration", "rank_ranges"]


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"0 2-4 7"``."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return " ".join(out)


def duration(seconds: float) -> str:
    """A duration for people: ``42`` -> ``"42 s"``, ``150`` -> ``"2.5 min"``, ``7200`` -> ``"2.0 h"``,
    ``259200`` -> ``"3.0 days"``."""
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
