"""``tierckpt verify``: check every committed step under a path, byte for byte.

For each step: the commit marker, the manifest against it, every file's presence, size and crc32c
(``tierckpt.verify.step_problems``, which names the damaged tensor when a crc disagrees). Steps
without a commit marker do not exist to readers; they are listed as ``incomplete`` but are not
failures. Exit status 1 when any committed step has a problem.
"""

from __future__ import annotations

import dataclasses
import time

import typer
from rich.markup import escape
from rich.table import Table

from tierckpt.protocol.format import read_manifest
from tierckpt_cli._common import (
    EXIT_FAILED,
    cli_errors,
    err_console,
    format_bytes,
    out_console,
    print_json,
    progress_bar,
)
from tierckpt_cli._ramdisk import StepRecord, scan_path

__all__ = ["StepCoverage", "StepVerdict", "coverage", "verify_command", "verify_records"]


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    job: str
    rank: int
    copy: str
    step: int
    verdict: str
    """``ok``, ``corrupt`` or ``incomplete`` (skipped: not committed)."""
    bytes: int
    problems: tuple[str, ...]
    path: str
    world_size: int = 0
    """Ranks the step was saved with (from its manifest; 0 when unreadable)."""


@dataclasses.dataclass(frozen=True)
class StepCoverage:
    """Which ranks of one step verified under the path: all of them makes the step complete here."""

    job: str
    step: int
    world_size: int
    ranks: tuple[int, ...]
    complete: bool


def coverage(verdicts: list[StepVerdict]) -> list[StepCoverage]:
    """Per job and step: the ranks whose copy (primary or replica) verified, against the world size."""
    groups: dict[tuple[str, int], list[StepVerdict]] = {}
    for v in verdicts:
        groups.setdefault((v.job, v.step), []).append(v)
    out = []
    for (job, step), vs in sorted(groups.items()):
        world = max(v.world_size for v in vs)
        ranks = tuple(sorted({v.rank for v in vs if v.verdict == "ok"}))
        out.append(StepCoverage(job, step, world, ranks, world > 0 and ranks == tuple(range(world))))
    return out


def _verify_one(record: StepRecord) -> StepVerdict:
    from tierckpt.verify import step_problems

    base = (record.job, record.rank, record.copy, record.step)
    if record.state == "incomplete":
        return StepVerdict(*base, "incomplete", record.bytes, (), record.path)
    if record.state == "corrupt":
        return StepVerdict(*base, "corrupt", record.bytes, (record.detail,), record.path)
    problems = tuple(str(p) for p in step_problems(record.path))
    if problems:
        return StepVerdict(*base, "corrupt", record.bytes, problems, record.path)
    world = read_manifest(record.path).world_size
    return StepVerdict(*base, "ok", record.bytes, (), record.path, world)


def verify_records(records: list[StepRecord]) -> list[StepVerdict]:
    """Verify each step in turn, with a progress bar (by bytes) on stderr."""
    out = []
    with progress_bar() as progress:
        task = progress.add_task("verifying", total=sum(r.bytes for r in records if r.state == "committed"))
        for r in records:
            progress.update(task, description=f"{r.job} rank {r.rank} step {r.step}")
            out.append(_verify_one(r))
            if r.state == "committed":
                progress.advance(task, r.bytes)
    return out


_STYLE = {"ok": "green", "corrupt": "bold red", "incomplete": "yellow"}


def _table(verdicts: list[StepVerdict], title: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("job", "rank", "copy", "step", "verdict", "size", "problems"):
        table.add_column(col, justify="right" if col in ("rank", "step", "size", "problems") else "left")
    for v in verdicts:
        note = str(len(v.problems)) if v.problems else ("not committed" if v.verdict == "incomplete" else "")
        verdict = f"[{_STYLE[v.verdict]}]{v.verdict}[/]"
        table.add_row(v.job, str(v.rank), v.copy, str(v.step), verdict, format_bytes(v.bytes), note)
    return table


def _print_problems(verdicts: list[StepVerdict]) -> None:
    """Every problem in full, below the table (paths are long; a table cell would cut them)."""
    for v in verdicts:
        for problem in v.problems:
            out_console.print(
                f"[red]✘[/] {escape(v.job)} rank {v.rank} ({v.copy}) step {v.step}: {escape(problem)}",
                soft_wrap=True,
            )


def _print_coverage(steps: list[StepCoverage]) -> None:
    from tierckpt.protocol.text import rank_ranges

    for c in steps:
        if not c.world_size:
            continue
        here = f"ranks {rank_ranges(list(c.ranks))}" if c.ranks else "no rank"
        note = (
            "[green]complete here[/]" if c.complete else "the other ranks live on other nodes or are damaged"
        )
        out_console.print(f"{escape(c.job)} step {c.step}: {here} of {c.world_size} verified; {note}")


def verify_command(
    path: str = typer.Argument(..., help="A ramdisk root, job, rank or step directory."),
    job: str = typer.Option(None, "--job", "-j", help="Only this job."),
    step: int = typer.Option(None, "--step", "-s", help="Only this step.", min=0),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
) -> None:
    """Check checksums and completeness of every committed step under PATH."""
    with cli_errors():
        records = [
            r for r in scan_path(path) if (job is None or r.job == job) and (step is None or r.step == step)
        ]

        t0 = time.monotonic()
        verdicts = verify_records(records)
        seconds = time.monotonic() - t0
        bad = [v for v in verdicts if v.verdict == "corrupt"]
        if as_json:
            print_json(
                {
                    "path": path,
                    "ok": not bad,
                    "seconds": seconds,
                    "steps": [dataclasses.asdict(v) for v in verdicts],
                    "coverage": [dataclasses.asdict(c) for c in coverage(verdicts)],
                }
            )
        elif not verdicts:
            out_console.print(f"no step found under {path}", markup=False)
        else:
            out_console.print(_table(verdicts, title=f"verify {path}"))
            _print_problems(verdicts)
            _print_coverage(coverage(verdicts))
            ok = sum(v.verdict == "ok" for v in verdicts)
            checked = sum(v.bytes for v in verdicts if v.verdict != "incomplete")
            out_console.print(
                f"{ok} ok, {len(bad)} corrupt, {len(verdicts) - ok - len(bad)} incomplete; "
                f"{format_bytes(checked)} checked in {seconds:.2f} s"
            )
        if bad:
            err_console.print(f"[bold red]error:[/] {len(bad)} corrupt step(s)")
            raise typer.Exit(EXIT_FAILED)
