"""Finding rank directories and step directories under a path the user names (ls, verify, gc).

The path may be a ramdisk root (every job under it), a job directory, a rank directory (primary or
replica), or a single step directory. Only the on-ramdisk format (``tierckpt.protocol.format``) is read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tierckpt.protocol import format as fmt
from tierckpt.protocol import leases
from tierckpt.protocol.errors import FormatError
from tierckpt_cli._common import EXIT_USAGE, fail

__all__ = ["RankDir", "StepRecord", "find_rank_dirs", "scan_path", "step_record"]


@dataclasses.dataclass(frozen=True)
class RankDir:
    job: str
    rank: int
    copy: str
    """``primary`` (the rank's own node) or ``replica`` (held for a peer)."""
    path: Path


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step directory of one rank, as found on a ramdisk or in a bucket."""

    job: str
    rank: int
    copy: str
    """``primary``, ``replica`` or ``gcs``."""
    step: int
    state: str
    """``committed``, ``incomplete`` (no commit marker: being written, or a save that died) or ``corrupt``."""
    bytes: int
    age_at: float | None
    """When the step was committed (or last modified, if it is not)."""
    path: str
    detail: str = ""
    leases: tuple[str, ...] = ()
    """Holders of unexpired leases on the step (readers retention must wait for)."""


def _dir_bytes(path: Path) -> int:
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return 0
    return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def step_record(rd: RankDir, step: int, path: Path) -> StepRecord:
    """What the commit marker of one step directory says about it (its data is not read)."""
    base = (rd.job, rd.rank, rd.copy, step)
    try:
        marker = fmt.read_commit(path)
    except FormatError as exc:
        return StepRecord(
            *base, "corrupt", _dir_bytes(path), _mtime(path), str(path), f"unreadable commit marker: {exc}"
        )
    if marker is None:
        return StepRecord(*base, "incomplete", _dir_bytes(path), _mtime(path), str(path))
    if marker.step != step or marker.rank != rd.rank:
        return StepRecord(
            *base,
            "corrupt",
            marker.total_bytes,
            marker.committed_at,
            str(path),
            f"commit marker names rank {marker.rank} step {marker.step}",
        )
    return StepRecord(*base, "committed", marker.total_bytes, marker.committed_at, str(path))


def _job_rank_dirs(job_path: Path) -> list[RankDir]:
    job = job_path.name
    out = [RankDir(job, r, "primary", job_path / f"rank-{r:05d}") for r in fmt.ranks_in(job_path)]
    replicas = job_path / "replicas"
    return out + [RankDir(job, r, "replica", replicas / f"rank-{r:05d}") for r in fmt.ranks_in(replicas)]


def _looks_like_job(path: Path) -> bool:
    return bool(fmt.ranks_in(path)) or (path / "replicas").is_dir() or (path / "control").is_dir()


def _rank_of(path: Path) -> int | None:
    """The rank if ``path`` is a ``rank-NNNNN`` directory."""
    return next((r for r in fmt.ranks_in(path.parent) if path.name == f"rank-{r:05d}"), None)


def _is_job_id(name: str) -> bool:
    try:
        fmt.check_job_id(name)
    except FormatError:
        return False
    return True


def _as_rank_dir(path: Path) -> RankDir | None:
    rank = _rank_of(path)
    if rank is None:
        return None
    copy = "replica" if path.parent.name == "replicas" else "primary"
    job = path.parent.parent.name if copy == "replica" else path.parent.name
    return RankDir(job, rank, copy, path)


def _checked_dir(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not path.exists():
        fail(f"{path}: no such file or directory", EXIT_USAGE)
    if not path.is_dir():
        fail(f"{path}: not a directory (give a ramdisk root, a job, rank or step directory)", EXIT_USAGE)
    return path


def find_rank_dirs(path: str | os.PathLike[str]) -> list[RankDir]:
    """Every rank directory (primaries, then replicas, per job) under a root, job or rank directory."""
    path = _checked_dir(path)
    single = _as_rank_dir(path)
    if single is not None:
        return [single]
    if _looks_like_job(path):
        return _job_rank_dirs(path)
    out: list[RankDir] = []
    for child in sorted(path.iterdir()):
        if child.is_dir() and _is_job_id(child.name) and _looks_like_job(child):
            out += _job_rank_dirs(child)
    return out


def scan_path(path: str | os.PathLike[str]) -> list[StepRecord]:
    """Every step directory under ``path`` (which may itself be one step directory)."""
    path = _checked_dir(path)
    step = fmt.parse_step_name(path.name)
    if step is not None and (rd := _as_rank_dir(path.parent)) is not None:
        return [r for r in _rank_records(rd) if r.step == step]
    return [rec for rd in find_rank_dirs(path) for rec in _rank_records(rd)]


def _rank_records(rd: RankDir) -> list[StepRecord]:
    held: dict[int, list[str]] = {}
    for lease in leases.active(rd.path):
        held.setdefault(lease.step, []).append(lease.holder)
    out = []
    for s, p in sorted(fmt.step_dirs(rd.path).items()):
        rec = step_record(rd, s, p)
        out.append(dataclasses.replace(rec, leases=tuple(sorted(held[s]))) if s in held else rec)
    return out
