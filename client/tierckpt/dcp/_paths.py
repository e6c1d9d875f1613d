"""Which step a DCP ``checkpoint_id`` names, and where a rank's committed step is on this root.

Root, job, rank and world size come from ``tierckpt.settings.resolve`` (the same rules as
``Checkpointer``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import rank_dir, read_commit, replica_rank_dir, step_dir

__all__ = ["find_rank_step", "parse_step_id", "rank_step_copies", "require_step_id"]

_STEP_ID_RE = re.compile(r"^(?:step-)?(\d{1,18})$")


def parse_step_id(checkpoint_id: object) -> int | None:
    """The step a DCP ``checkpoint_id`` names: an int, ``"1200"``, ``"step-000000001200"``, or a path
    whose last component is one of those. None if it names no step."""
    if isinstance(checkpoint_id, bool):
        return None
    if isinstance(checkpoint_id, int):
        return checkpoint_id if checkpoint_id >= 0 else None
    if isinstance(checkpoint_id, (str, os.PathLike)):
        m = _STEP_ID_RE.match(Path(checkpoint_id).name)
        return int(m.group(1)) if m else None
    return None


def require_step_id(checkpoint_id: object) -> int:
    step = parse_step_id(checkpoint_id)
    if step is None:
        raise ValueError(
            f"checkpoint_id {checkpoint_id!r} names no step: use an int step, '1200' or 'step-000000001200'"
        )
    return step


def find_rank_step(root: Path, job: str, rank: int, step: int) -> Path | None:
    """Rank ``rank``'s committed ``step`` on this root: its primary copy, else a replica held here."""
    copies = rank_step_copies(root, job, rank, step)
    return copies[0] if copies else None


def rank_step_copies(root: Path, job: str, rank: int, step: int) -> list[Path]:
    """Every committed copy of rank ``rank``'s ``step`` on this root: its primary first, then a replica."""
    out = []
    for parent in (rank_dir(root, job, rank), replica_rank_dir(root, job, rank)):
        path = step_dir(parent, step)
        try:
            if read_commit(path) is not None:
                out.append(path)
        except FormatError:
            continue
    return out
