"""What the training processes saved and computed, to hold every restore and every replay against (pure).

``Reference.saved`` collects, per job, rank and step, the sha256 of every state a rank was about to save
(the trainers announce it before the save starts, so a step that committed always has one): a restored
state must be one of them. A step saved twice (the job went back and trained it again) may have two.

``Reference.losses`` holds the losses of the steps trained after each *anchor*: a state known by its
sha256 (a restored one, or one that was saved) at its step, with the world size trained on. Training is
deterministic, so two runs from the same anchor on the same world size must give the same loss at every
step, bit for bit; a run that differs says a restore did not give back what was saved.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

__all__ = ["Anchor", "Reference"]

FRESH = "fresh"
"""The anchor of a run that restored nothing (its sha256 stands for the initial state)."""


@dataclasses.dataclass(frozen=True)
class Anchor:
    step: int
    sha256: str
    world: int


class Reference:
    def __init__(self) -> None:
        self.saved: dict[tuple[str, int | None, int], set[str]] = defaultdict(set)
        """(job, rank or None for a job-wide state, step) -> sha256 of each state saved for it."""
        self.losses: dict[Anchor, dict[int, float]] = defaultdict(dict)
        self.compared = 0
        """Losses found equal to an earlier run's."""

    def saving(self, job: str, rank: int | None, step: int, sha256: str) -> None:
        self.saved[(job, rank, step)].add(sha256)

    def restored_ok(self, job: str, rank: int | None, step: int, sha256: str) -> str:
        """Why a restored state is not one saved for ``step`` ("" if it is)."""
        known = self.saved.get((job, rank, step), set())
        if sha256 in known:
            return ""
        who = f"rank {rank}" if rank is not None else "the job"
        if not known:
            return f"{who} restored step {step}, for which no save was announced (sha256 {sha256[:12]})"
        saved = ", ".join(s[:12] for s in sorted(known))
        return f"{who} restored step {step} as sha256 {sha256[:12]}, saved as {saved}"

    def loss(self, anchors: list[Anchor], step: int, loss: float) -> str:
        """Record ``loss`` at ``step`` for every anchor before it; why it differs from a loss an earlier run
        from the same anchor computed ("" if none did)."""
        problem = ""
        for a in anchors:
            if a.step >= step:
                continue
            seen = self.losses[a]
            if step not in seen:
                seen[step] = loss
            elif seen[step] == loss:
                self.compared += 1
            elif not problem:
                problem = (
                    f"step {step} from the state of step {a.step} ({a.sha256[:12]}, {a.world} ranks): "
                    f"loss {loss!r}, an earlier run from the same state computed {seen[step]!r}"
                )
        return problem
