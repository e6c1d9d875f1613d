"""``tierckpt plan``: what to set (checkpoint interval, backup interval, replication factor) and the
goodput to expect, from what was measured and the failure rate (``tierckpt.planning.goodput``;
docs/goodput.md). ``--soak FILE`` compares the model with a run that measured its goodput."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tierckpt.planning.goodput import (
    Assumptions,
    Breakdown,
    Comparison,
    SoakResult,
    compare,
    goodput,
    recommend,
)
from tierckpt.protocol.errors import FormatError
from tierckpt_cli._common import CliError, cli_errors, out_console, print_json

__all__ = ["plan_command"]

GiB = 1 << 30


# The command's options (typer reads each parameter's ``Annotated`` option; its default is the parameter's).
_Nodes = Annotated[int, typer.Option("--nodes", min=1, help="Nodes of the job.")]
_NodeMtbfHours = Annotated[
    float,
    typer.Option(
        "--node-mtbf-hours", min=0.001, help="Mean time between failures of one node (any cause) [h]."
    ),
]
_SaveS = Annotated[float, typer.Option("--save-s", min=0.0, help="Blocking time of one local save [s].")]
_RestoreLocalS = Annotated[
    float, typer.Option("--restore-local-s", min=0.0, help="Restore from the ramdisk [s].")
]
_RestorePeerS = Annotated[float, typer.Option("--restore-peer-s", min=0.0, help="Restore from a peer [s].")]
_RestoreBucketS = Annotated[
    float | None,
    typer.Option(
        "--restore-bucket-s", min=0.0, help="Restore from the bucket [s] (default: size / bandwidth)."
    ),
]
_CheckpointGib = Annotated[
    float, typer.Option("--checkpoint-gib", min=0.0, help="The job's checkpoint [GiB].")
]
_BucketGibS = Annotated[
    float, typer.Option("--bucket-gib-s", min=0.0, help="The bucket's bandwidth for the whole job [GiB/s].")
]
_RestartS = Annotated[float, typer.Option("--restart-s", min=0.0, help="Rescheduling and restarting [s].")]
_NodeLoss = Annotated[
    float, typer.Option("--node-loss", min=0.0, max=1.0, help="Fraction of failures that lose the node.")
]
_TotalLoss = Annotated[
    float,
    typer.Option(
        "--total-loss", min=0.0, max=1.0, help="Fraction of failures that lose every in-memory copy."
    ),
]
_StepS = Annotated[
    float, typer.Option("--step-s", min=0.0, help="A training step [s], to say intervals in steps.")
]
_IntervalS = Annotated[
    float | None, typer.Option("--interval-s", help="Also rate this checkpoint interval [s].")
]
_BackupMinutes = Annotated[
    float | None, typer.Option("--backup-minutes", help="... this backup interval [min].")
]
_Factor = Annotated[int | None, typer.Option("--factor", min=0, help="... and this replication factor.")]
_Soak = Annotated[
    Path | None, typer.Option("--soak", help="Compare the model with this soak run (a SoakResult).")
]
_Json = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]


def plan_command(
    nodes: _Nodes,
    node_mtbf_hours: _NodeMtbfHours,
    save_s: _SaveS,
    restore_local_s: _RestoreLocalS,
    restore_peer_s: _RestorePeerS,
    restore_bucket_s: _RestoreBucketS = None,
    checkpoint_gib: _CheckpointGib = 0.0,
    bucket_gib_s: _BucketGibS = 0.0,
    restart_s: _RestartS = 60.0,
    node_loss: _NodeLoss = 0.5,
    total_loss: _TotalLoss = 0.01,
    step_s: _StepS = 0.0,
    interval_s: _IntervalS = None,
    backup_minutes: _BackupMinutes = None,
    factor: _Factor = None,
    soak: _Soak = None,
    as_json: _Json = False,
) -> None:
    """Recommend the checkpoint interval (Young-Daly), the backup interval and the replication factor, and
    state the expected goodput."""
    with cli_errors():
        try:
            a = Assumptions(
                nodes=nodes,
                node_mtbf_s=node_mtbf_hours * 3600,
                save_s=save_s,
                restore_local_s=restore_local_s,
                restore_peer_s=restore_peer_s,
                restore_bucket_s=restore_bucket_s,
                checkpoint_bytes=int(checkpoint_gib * GiB),
                bucket_bytes_per_s=bucket_gib_s * GiB,
                restart_s=restart_s,
                node_loss=node_loss,
                total_loss=total_loss,
            )
        except ValueError as exc:
            raise CliError(str(exc), 2) from None
        rec = recommend(a)
        current = None
        if interval_s is not None or backup_minutes is not None or factor is not None:
            backup_s = backup_minutes * 60 if backup_minutes is not None else rec.backup_interval_s
            current = goodput(
                a,
                interval_s=interval_s if interval_s is not None else rec.interval_s,
                backup_interval_s=backup_s,
                factor=factor if factor is not None else rec.factor,
            )
        comparison = None
        if soak is not None:
            try:
                comparison = compare(SoakResult.from_bytes(soak.read_bytes()))
            except (OSError, FormatError) as exc:
                raise CliError(f"{soak}: {exc}") from None
        if as_json:
            print_json(
                {
                    "recommended": {**_row(rec.expected), "young_daly_s": rec.young_daly_s},
                    "by_factor": [_row(b) for b in rec.by_factor],
                    "current": _row(current) if current is not None else None,
                    "soak": dataclasses.asdict(comparison) if comparison is not None else None,
                }
            )
            return
        _print(a, rec.expected, rec.by_factor, current, step_s, rec.young_daly_s)
        if comparison is not None:
            _print_soak(soak, comparison)


def _print_soak(soak: Path | None, comparison: Comparison) -> None:
    table = Table(title=f"soak run {soak}: model against measurement", title_justify="left")
    for col in ("", "measured", "model"):
        table.add_column(col, justify="right" if col else "left")
    table.add_row("goodput", f"{comparison.observed:.2%}", f"{comparison.predicted:.2%}")
    for cause, seen in comparison.observed_waste.items():
        table.add_row(f"  waste: {cause}", f"{seen:.2%}", f"{comparison.predicted_waste[cause]:.2%}")
    out_console.print(table)


def _row(b: Breakdown) -> dict[str, float]:
    return {
        "interval_s": b.interval_s,
        "backup_interval_s": b.backup_interval_s,
        "factor": b.factor,
        "goodput": b.goodput,
        "waste_checkpoints": b.checkpoints,
        "waste_failures_local": b.failures_local,
        "waste_failures_peer": b.failures_peer,
        "waste_failures_bucket": b.failures_bucket,
    }


def _print(
    a: Assumptions,
    best: Breakdown,
    by_factor: tuple[Breakdown, ...],
    current: Breakdown | None,
    step_s: float,
    young_daly_s: float,
) -> None:
    def steps(seconds: float) -> str:
        return f" (every {max(1, math.ceil(seconds / step_s))} steps)" if step_s > 0 else ""

    out_console.print(
        f"job: {a.nodes} nodes, a failure every {a.node_mtbf_s / a.nodes / 3600:.2f} h "
        f"(Young-Daly over every failure: {young_daly_s:.0f} s); one backup uploads in {a.upload_s:.0f} s",
        markup=False,
    )
    backup_min = math.ceil(best.backup_interval_s / 60)
    out_console.print(
        f"save every {best.interval_s:.0f} s{steps(best.interval_s)}; back up every {backup_min} min "
        f"(backup.intervalMinutes){steps(best.backup_interval_s)}; replication factor {best.factor} "
        f"(replication.factor): goodput {best.goodput:.2%}",
        markup=False,
    )
    table = Table(title="expected goodput", title_justify="left")
    for col in ("setting", "interval", "backup", "factor", "goodput", "saves", "local", "peer", "bucket"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    rows = [(f"factor {b.factor}" + (" (recommended)" if b == best else ""), b) for b in by_factor]
    if current is not None:
        rows.append(("as given", current))
    for label, b in rows:
        table.add_row(
            label,
            f"{b.interval_s:.0f} s",
            f"{b.backup_interval_s / 60:.1f} min",
            str(b.factor),
            f"{b.goodput:.2%}",
            f"{b.checkpoints:.2%}",
            f"{b.failures_local:.2%}",
            f"{b.failures_peer:.2%}",
            f"{b.failures_bucket:.2%}",
        )
    out_console.print(table)
