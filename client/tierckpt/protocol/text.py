"""How tierckpt's programs write protocol values for people: rank lists as ranges."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["rank_ranges"]


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"0 2-4 7"``."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return " ".join(out)
