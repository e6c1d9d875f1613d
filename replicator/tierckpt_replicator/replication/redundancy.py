"""Per-job redundancy: how many live copies this node's ranks have against the job's factor (pure).

``assess`` turns the confirmed replicas of each local rank's newest step into a ``Redundancy``; a
step younger than ``grace`` seconds is still being replicated (every save starts that way) and counts
as fully replicated, so only a copy that stays missing makes the job degraded, or one that was lost
(a holder gone, or no longer holding it): that counts at once, whatever the step's age. ``RedundancyLog``
remembers since when each job is degraded and says when a job went below its factor or healed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from tierckpt.protocol.control import Redundancy

__all__ = ["RedundancyLog", "assess"]


def assess(
    *,
    factor: int,
    copies: Mapping[int, int],
    committed_at: Mapping[int, float],
    now: float,
    grace: float,
    lost: Collection[int] = (),
) -> tuple[int, bool]:
    """(fewest copies of any rank past the grace or in ``lost``, whether any of them is short)."""
    settled = [n for rank, n in copies.items() if rank in lost or now - committed_at.get(rank, now) >= grace]
    fewest = min(settled, default=factor)
    return fewest, fewest < factor


class RedundancyLog:
    """Since when each job has been degraded; ``update`` returns the job's ``Redundancy`` and whether
    it just went below its factor (``"degraded"``), just healed (``"healed"``) or neither (``""``)."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}

    def update(
        self, job: str, *, factor: int, copies: int, short: bool, now: float
    ) -> tuple[Redundancy, str]:
        was = job in self._since
        if short and not was:
            self._since[job] = now
        elif not short and was:
            del self._since[job]
        change = "degraded" if short and not was else "healed" if was and not short else ""
        return Redundancy(factor=factor, copies=copies, degraded_since=self._since.get(job)), change

    def forget(self, job: str) -> None:
        self._since.pop(job, None)
