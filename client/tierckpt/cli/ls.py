"""``tierckpt ls``: what a ramdisk or a bucket prefix holds: jobs, ranks, steps, committed or not.

A ramdisk path may be the ramdisk root (every job under it), a job directory, or a rank directory.
A ``gs://bucket/prefix`` URL lists the backups in the bucket (see ``tierckpt.cli._bucket``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import typer
from rich.table import Table

from tierckpt import format as fmt
from tierckpt.cli._common import (
    EXIT_USAGE,
    cli_errors,
    fail,
    format_age,
    format_bytes,
    out_console,
    print_json,
)
from tierckpt.errors import FormatError

__all__ = ["StepRecord", "ls_command", "render_records", "scan_path"]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step directory of one rank, as found on a ramdisk or in a bucket."""

    job: str
    rank: int
    copy: str
    """``primary`` (the rank's own node), ``replica`` (held for a peer) or ``gcs``."""
    step: int
    state: str
    """``committed``, ``incomplete`` (no commit marker yet, or a save that died) or ``corrupt``."""
    bytes: int
    age_at: float | None
    """When the step was committed (or last modified, if it is not)."""
    path: str
    detail: str = ""


# ------------------------------------------------------------------------------------- scanning


def _dir_bytes(path: Path) -> int:
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def _step_record(job: str, rank: int, copy: str, step: int, path: Path) -> StepRecord:
    try:
        marker = fmt.read_commit(path)
    except FormatError as exc:
        return StepRecord(
            job,
            rank,
            copy,
            step,
            "corrupt",
            _dir_bytes(path),
            path.stat().st_mtime,
            str(path),
            f"unreadable commit marker: {exc}",
        )
    if marker is None:
        return StepRecord(
            job, rank, copy, step, "incomplete", _dir_bytes(path), path.stat().st_mtime, str(path)
        )
    if marker.step != step or marker.rank != rank:
        return StepRecord(
            job,
            rank,
            copy,
            step,
            "corrupt",
            marker.total_bytes,
            marker.committed_at,
            str(path),
            f"commit marker names rank {marker.rank} step {marker.step}",
        )
    return StepRecord(job, rank, copy, step, "committed", marker.total_bytes, marker.committed_at, str(path))


def _scan_rank(job: str, rank: int, copy: str, rank_path: Path) -> list[StepRecord]:
    return [_step_record(job, rank, copy, s, p) for s, p in sorted(fmt.step_dirs(rank_path).items())]


def _scan_job(job_path: Path) -> list[StepRecord]:
    job = job_path.name
    out: list[StepRecord] = []
    for rank in fmt.ranks_in(job_path):
        out += _scan_rank(job, rank, "primary", job_path / f"rank-{rank:05d}")
    replicas = job_path / "replicas"
    for rank in fmt.ranks_in(replicas):
        out += _scan_rank(job, rank, "replica", replicas / f"rank-{rank:05d}")
    return out


def _looks_like_job(path: Path) -> bool:
    return bool(fmt.ranks_in(path)) or (path / "replicas").is_dir() or (path / "control").is_dir()


def scan_path(path: str | os.PathLike[str]) -> list[StepRecord]:
    """Every step under a ramdisk root, a job directory or a rank directory."""
    path = Path(path)
    if not path.exists():
        fail(f"{path}: no such file or directory", EXIT_USAGE)
    if not path.is_dir():
        fail(
            f"{path}: not a directory (give a ramdisk root, a job directory or a rank directory)", EXIT_USAGE
        )
    rank = _rank_of(path)
    if rank is not None:
        parent = path.parent
        copy = "replica" if parent.name == "replicas" else "primary"
        job = parent.parent.name if copy == "replica" else parent.name
        return _scan_rank(job, rank, copy, path)
    if _looks_like_job(path):
        return _scan_job(path)
    out: list[StepRecord] = []
    for child in sorted(path.iterdir()):
        if child.is_dir() and _is_job_id(child.name) and _looks_like_job(child):
            out += _scan_job(child)
    return out


def _rank_of(path: Path) -> int | None:
    """The rank if ``path`` is a ``rank-NNNNN`` directory."""
    return next((r for r in fmt.ranks_in(path.parent) if path.name == f"rank-{r:05d}"), None)


def _is_job_id(name: str) -> bool:
    try:
        fmt.check_job_id(name)
    except FormatError:
        return False
    return True


# ------------------------------------------------------------------------------------- output

_STATE_STYLE = {"committed": "green", "incomplete": "yellow", "corrupt": "bold red"}


def render_records(records: list[StepRecord], title: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for col, justify in (
        ("job", "left"),
        ("rank", "right"),
        ("copy", "left"),
        ("step", "right"),
        ("state", "left"),
        ("size", "right"),
        ("age", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    now = time.time()
    for r in sorted(records, key=lambda r: (r.job, r.copy != "primary", r.rank, r.step)):
        state = f"[{_STATE_STYLE.get(r.state, 'white')}]{r.state}[/]"
        if r.detail:
            state += f" ({r.detail})"
        table.add_row(
            r.job, str(r.rank), r.copy, str(r.step), state, format_bytes(r.bytes), format_age(r.age_at, now)
        )
    return table


def _summary(records: list[StepRecord]) -> str:
    jobs = {r.job for r in records}
    committed = [r for r in records if r.state == "committed"]
    return (
        f"{len(jobs)} job(s), {len(records)} step copies ({len(committed)} committed), "
        f"{format_bytes(sum(r.bytes for r in records))}"
    )


def ls_command(
    location: str = typer.Argument(..., help="A ramdisk path (root, job or rank dir) or gs://bucket/prefix."),
    job: str = typer.Option(None, "--job", "-j", help="Only this job."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
) -> None:
    """List jobs, ranks and steps on a ramdisk or in a bucket: committed or not, sizes, ages."""
    with cli_errors():
        if location.startswith("gs://"):
            from tierckpt.cli._bucket import scan_bucket

            records = scan_bucket(location, job=job)
        else:
            records = scan_path(location)
        if job is not None:
            records = [r for r in records if r.job == job]
        if as_json:
            print_json({"location": location, "steps": [dataclasses.asdict(r) for r in records]})
            return
        if not records:
            out_console.print(f"nothing found at {location}" + (f" for job {job}" if job else ""))
            return
        out_console.print(render_records(records, title=location))
        out_console.print(_summary(records))
