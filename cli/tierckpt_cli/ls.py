"""``tierckpt ls``: what a ramdisk or a bucket prefix holds: jobs, ranks, steps, committed or not.

A ramdisk path may be the ramdisk root (every job under it), a job, rank or step directory.
A ``gs://bucket/prefix`` URL lists the backups in the bucket (see ``tierckpt_cli._bucket``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from tierckpt_cli._common import cli_errors, format_age, format_bytes, out_console, print_json
from tierckpt_cli._ramdisk import StepRecord, scan_path

if TYPE_CHECKING:
    from tierckpt_cli._bucket import BucketStep

__all__ = ["bucket_table", "ls_command", "ramdisk_table"]


# ------------------------------------------------------------------------------------- output

_STATE_STYLE = {
    "committed": "green",
    "complete": "green",
    "incomplete": "yellow",
    "partial": "yellow",
    "corrupt": "bold red",
}


def _state(state: str, detail: str) -> str:
    text = f"[{_STATE_STYLE.get(state, 'white')}]{state}[/]"
    return f"{text} ({escape(detail)})" if detail else text


def ramdisk_table(records: list[StepRecord], title: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("job", "rank", "copy", "step", "state", "size", "age", "leased by"):
        table.add_column(col, justify="right" if col in ("rank", "step", "size", "age") else "left")
    now = time.time()
    for r in sorted(records, key=lambda r: (r.job, r.copy != "primary", r.rank, r.step)):
        age, state, held = format_age(r.age_at, now), _state(r.state, r.detail), ", ".join(r.leases)
        table.add_row(r.job, str(r.rank), r.copy, str(r.step), state, format_bytes(r.bytes), age, held)
    return table


def bucket_table(steps: list[BucketStep], title: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("job", "step", "state", "ranks", "size", "age"):
        table.add_column(col, justify="right" if col in ("step", "ranks", "size", "age") else "left")
    now = time.time()
    for s in steps:
        ranks = f"{s.ranks}/{s.world_size or '?'}"
        table.add_row(
            s.job,
            str(s.step),
            _state(s.state, s.detail),
            ranks,
            format_bytes(s.bytes),
            format_age(s.age_at, now),
        )
    return table


def _summary(records: list[StepRecord] | list[BucketStep], good: str) -> str:
    jobs = {r.job for r in records}
    ok = sum(r.state == good for r in records)
    total = format_bytes(sum(r.bytes for r in records))
    return f"{len(jobs)} job(s), {len(records)} step(s) listed ({ok} {good}), {total}"


def ls_command(
    location: str = typer.Argument(
        ..., help="A ramdisk path (root, job, rank or step dir) or gs://bucket/prefix."
    ),
    job: str = typer.Option(None, "--job", "-j", help="Only this job."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
    timeout: float = typer.Option(
        30.0, "--timeout", min=0.1, help="Buckets: give up on a call after this long [s]."
    ),
) -> None:
    """List jobs, ranks and steps on a ramdisk or in a bucket: committed or not, sizes, ages."""
    with cli_errors():
        if location.startswith("gs://"):
            from tierckpt_cli._bucket import scan_bucket

            steps = scan_bucket(location, job=job, timeout=timeout)
            _show(location, job, steps, as_json, lambda: bucket_table(steps, location), "complete")
        else:
            records = [r for r in scan_path(location) if job is None or r.job == job]
            _show(location, job, records, as_json, lambda: ramdisk_table(records, location), "committed")


def _show(
    location: str, job: str | None, rows: list[Any], as_json: bool, table: Callable[[], Table], good: str
) -> None:
    if as_json:
        print_json({"location": location, "steps": [dataclasses.asdict(r) for r in rows]})
    elif not rows:
        out_console.print(f"nothing found at {location}" + (f" for job {job}" if job else ""), markup=False)
    else:
        out_console.print(table())
        out_console.print(_summary(rows, good))
