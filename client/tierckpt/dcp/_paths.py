"""Where a DCP checkpoint lives: root, job, process rank, step id, and finding a rank's committed step.

Defaults follow the contract (``tierckpt.contract.Env``): an explicit argument, else ``TIERCKPT_ROOT`` /
``TIERCKPT_JOB``, else (job only) ``"local"``. The process rank is torch.distributed's global rank when a
process group is up, else ``TIERCKPT_RANK`` / ``RANK``, else 0.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch.distributed as dist

from tierckpt.contract import Env
from tierckpt.errors import FormatError
from tierckpt.format import check_job_id, rank_dir, read_commit, replica_rank_dir, step_dir

__all__ = [
    "default_job",
    "default_root",
    "find_rank_step",
    "parse_step_id",
    "process_rank",
    "process_world_size",
    "require_step_id",
]

LOCAL_JOB = "local"
_STEP_ID_RE = re.compile(r"^(?:step-)?(\d{1,18})$")


def default_root(root: str | os.PathLike[str] | None) -> Path:
    value = root if root is not None else os.environ.get(Env.ROOT)
    if not value:
        raise ValueError(f"no ramdisk root: pass root= or set {Env.ROOT}")
    return Path(value)


def default_job(job: str | None) -> str:
    return check_job_id(job if job is not None else os.environ.get(Env.JOB) or LOCAL_JOB)


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return int(value)
    return None


def process_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int(Env.RANK, "RANK") or 0


def process_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int(Env.WORLD_SIZE, "WORLD_SIZE") or 1


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
    for parent in (rank_dir(root, job, rank), replica_rank_dir(root, job, rank)):
        path = step_dir(parent, step)
        try:
            if read_commit(path) is not None:
                return path
        except FormatError:
            continue
    return None
