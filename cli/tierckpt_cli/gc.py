"""``tierckpt gc``: apply retention to a ramdisk and reclaim its space.

For every rank directory (primaries and replicas) under the path, ``tierckpt.planning.retention`` decides:
the newest ``--keep`` committed steps stay, the newest always stays, a step with an unexpired lease
(``tierckpt.protocol.leases``) or named by the job's published restore plan stays; older ones are retired
(COMMIT removed under the lease lock first, so they stop existing at once, then the files).
Uncommitted step directories older than ``--stale-after`` (crash leftovers) are removed, as are
expired lease files and spare slots.

A primary rank directory whose ``Checkpointer`` is alive (it holds the writer lock) is left alone:
that process applies the same retention itself and owns its uncommitted step and spare slots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import time
from pathlib import Path

import typer
from rich.table import Table

from tierckpt.planning.retention import RetentionPlan, plan_retention
from tierckpt.protocol import format as fmt
from tierckpt.protocol import leases
from tierckpt.protocol.control import RestorePlan, read_control
from tierckpt.protocol.errors import FormatError
from tierckpt_cli._common import cli_errors, format_bytes, out_console, print_json, progress_bar
from tierckpt_cli._ramdisk import RankDir, find_rank_dirs, step_record

__all__ = ["RankGc", "gc_command", "gc_rank"]


@dataclasses.dataclass(frozen=True)
class RankGc:
    job: str
    rank: int
    copy: str
    kept: tuple[int, ...]
    held: tuple[int, ...]
    """Past the policy, but leased or pinned by the restore plan."""
    removed: tuple[int, ...]
    """Committed steps retired, then uncommitted leftovers."""
    freed_bytes: int
    """The removed steps' bytes plus ``spare_bytes``."""
    skipped: str = ""
    """Why the directory was left alone, if it was."""
    spare_bytes: int = 0
    """Spare data files a finished Checkpointer kept for its next save (freed too)."""


def _writer_alive(rank_path: Path) -> bool:
    """Whether a live process holds the rank's writer lock (a running Checkpointer)."""
    try:
        fd = os.open(rank_path / fmt.WRITER_LOCK, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _pinned(rd: RankDir) -> set[int]:
    root = rd.path.parent.parent if rd.copy == "primary" else rd.path.parent.parent.parent
    try:
        plan = read_control(root, rd.job, RestorePlan.FILE, RestorePlan)
    except FormatError:
        return set()
    return {plan.step} if isinstance(plan, RestorePlan) and plan.step is not None else set()


def _plan(rd: RankDir, keep: int, stale_after: float, now: float) -> tuple[RetentionPlan, dict[int, int]]:
    records = [step_record(rd, s, p) for s, p in fmt.step_dirs(rd.path).items()]
    committed = [r.step for r in records if r.state == "committed"]
    stale = [r.step for r in records if r.state != "committed" and now - (r.age_at or now) >= stale_after]
    held = leases.leased_steps(rd.path, now=now) | _pinned(rd)
    return plan_retention(committed, keep=keep, leased=held, uncommitted=stale), {
        r.step: r.bytes for r in records
    }


def _spare_bytes(rank_path: Path) -> int:
    spare = rank_path / fmt.SPARE_DIR
    return sum(f.stat().st_size for f in spare.rglob("*") if f.is_file()) if spare.is_dir() else 0


def gc_rank(rd: RankDir, *, keep: int, stale_after: float, dry_run: bool, now: float | None = None) -> RankGc:
    """Apply retention to one rank directory (or, with ``dry_run``, only say what would go)."""
    now = time.time() if now is None else now
    if rd.copy == "primary" and _writer_alive(rd.path):
        plan, _ = _plan(rd, keep, stale_after, now)
        return RankGc(
            rd.job,
            rd.rank,
            rd.copy,
            plan.kept,
            plan.held,
            (),
            0,
            "a running Checkpointer holds it and applies its own retention",
        )
    if dry_run:
        plan, sizes = _plan(rd, keep, stale_after, now)
    else:
        leases.purge_expired(rd.path, now=now)
        with leases.lock(
            rd.path
        ):  # retire under the lock: a reader either keeps its step or learns it is gone
            plan, sizes = _plan(rd, keep, stale_after, now)
            for step in plan.retire:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(fmt.step_dir(rd.path, step) / fmt.COMMIT_NAME)
        for step in (*plan.retire, *plan.discard):
            fmt.discard_step(fmt.step_dir(rd.path, step))
    spare = _spare_bytes(rd.path)
    if spare and not dry_run:
        shutil.rmtree(rd.path / fmt.SPARE_DIR, ignore_errors=True)
    removed = (*plan.retire, *plan.discard)
    freed = sum(sizes[s] for s in removed) + spare
    return RankGc(rd.job, rd.rank, rd.copy, plan.kept, plan.held, removed, freed, spare_bytes=spare)


def _steps(steps: tuple[int, ...]) -> str:
    return " ".join(map(str, steps)) or "-"


def _table(results: list[RankGc], title: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("job", "rank", "copy", "kept", "held", "removed", "freed", "note"):
        table.add_column(col, justify="right" if col in ("rank", "freed") else "left")
    for r in results:
        table.add_row(
            r.job,
            str(r.rank),
            r.copy,
            _steps(r.kept),
            _steps(r.held),
            _steps(r.removed),
            format_bytes(r.freed_bytes),
            r.skipped or (f"incl. {format_bytes(r.spare_bytes)} of spare slots" if r.spare_bytes else ""),
        )
    return table


def gc_command(
    path: str = typer.Argument(..., help="A ramdisk root, job or rank directory."),
    keep: int = typer.Option(
        2, "--keep", "-k", min=1, help="Committed steps kept per rank (the newest always)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Only show what would be removed."),
    job: str = typer.Option(None, "--job", "-j", help="Only this job."),
    stale_after: float = typer.Option(
        900.0, "--stale-after", min=0.0, help="Remove uncommitted step directories older than this [s]."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
) -> None:
    """Apply retention (keep the newest steps, honour leases) and reclaim ramdisk space."""
    with cli_errors():
        dirs = [rd for rd in find_rank_dirs(path) if job is None or rd.job == job]
        results = []
        with progress_bar(bytes_mode=False) as progress:
            task = progress.add_task("gc", total=len(dirs))
            for rd in dirs:
                progress.update(task, description=f"{rd.job} rank {rd.rank} ({rd.copy})")
                results.append(gc_rank(rd, keep=keep, stale_after=stale_after, dry_run=dry_run))
                progress.advance(task)
        freed = sum(r.freed_bytes for r in results)
        if as_json:
            print_json(
                {
                    "path": path,
                    "dry_run": dry_run,
                    "keep": keep,
                    "freed_bytes": freed,
                    "ranks": [dataclasses.asdict(r) for r in results],
                }
            )
            return
        if not results:
            out_console.print(f"no rank directory found under {path}", markup=False)
            return
        out_console.print(_table(results, title=f"gc {path}" + (" (dry run)" if dry_run else "")))
        verb = "would free" if dry_run else "freed"
        out_console.print(f"{verb} {format_bytes(freed)} in {len(results)} rank directories")
