"""``tierckpt ls``: what a ramdisk or a bucket prefix holds: jobs, ranks, steps, committed or not.

A ramdisk path may be the ramdisk root (every job under it), a job, rank or step directory.
A ``gs://bucket/prefix`` URL lists the backups in the bucket (see ``tierckpt.cli._bucket``).
"""

from __future__ import annotations

import dataclasses
import time

import typer
from rich.table import Table

from tierckpt.cli._common import cli_errors, format_age, format_bytes, out_console, print_json
from tierckpt.cli._ramdisk import StepRecord, scan_path

__all__ = ["ls_command", "render_records"]


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
