"""The demo's result: typed report messages, the rich table, and the ``--json`` document.

The JSON document is a ``tierckpt_demo-report`` message (version 1, see docs/quickstart.md, "The
demo's JSON report"): it is decoded with ``DemoReport.from_bytes`` and its fields only ever grow.
"""

from __future__ import annotations

import dataclasses
import statistics

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.text import rank_ranges

__all__ = [
    "Check",
    "DemoConfig",
    "DemoReport",
    "RankResult",
    "ScenarioResult",
    "median",
    "render_report",
    "sparkline",
    "tier_groups",
]


@dataclasses.dataclass(frozen=True)
class Check(Record):
    """One pass/fail fact the demo verified."""

    name: str
    ok: bool
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class RankResult(Record):
    """How one rank came back after a scenario's failure."""

    rank: int
    node: str
    tier: str
    """Where it restored from: ``local``, ``replica``, ``peer``, ``gcs`` (or ``none``: a fresh start)."""
    expected_tier: str
    step: int | None
    bytes: int
    restore_s: float
    """``stage_s + load_s``: the time to have the state back, not counting process start-up."""
    stage_s: float
    """From the restore plan's publication until the node's replicator had the step staged on the
    ramdisk (0 when it was already there)."""
    load_s: float
    """Inside ``Checkpointer.load`` once the step was staged: verify the checksums, copy into the state."""
    state_sha256: str
    """sha256 of every tensor of the restored state (model, optimizer, rank state), in key order."""
    reference_sha256: str
    """The same hash, recorded by the run that saved this step."""
    lost: bool = False
    """This rank's node was wiped by the scenario."""
    fetched: tuple[int, ...] = ()
    """(DCP) ranks whose step the load had its node's replicator fetch (a reshard reads other ranks)."""
    fetched_bytes: int = 0
    """(DCP) bytes the replicator reported moving for this rank's fetch requests."""
    fetch_s: float = 0.0
    """(DCP) time this rank's load waited for them (included in ``load_s``)."""


@dataclasses.dataclass(frozen=True)
class ScenarioResult(Record):
    name: str
    """``local``, ``peer`` or ``gcs``."""
    failure: str
    """What was broken, in a few words."""
    ok: bool
    killed_at_step: int
    expected_step: int | None
    restored_step: int | None
    lost_nodes: tuple[str, ...]
    ranks: tuple[RankResult, ...]
    bytes: int
    """Bytes restored, all ranks together."""
    save_blocking_s: float
    """Median time a save blocked training, over the saves before this failure (all ranks)."""
    save_blocking_max_s: float
    restore_s: float
    """Time until the slowest rank had its state back (the job waits for it)."""
    replayed_steps: int
    """Steps recomputed after the restore whose losses were compared with the first run."""
    checks: tuple[Check, ...]
    world_size: int = 0
    """Ranks after the restore (the DCP demo's ``shrink`` has fewer than before)."""
    fetched: tuple[int, ...] = ()
    """(DCP) ranks whose step some node had its replicator fetch for the load."""
    bucket_reads: int = 0
    """Objects of ranks' steps read from the bucket between the restore plan and the last restore."""
    fetched_bytes: int = 0
    """(DCP) bytes fetched for the ranks' requests, summed over ranks (a step two ranks of one node
    both need is fetched once but counted for each)."""
    fetch_s: float = 0.0
    """(DCP) the longest wait of one rank for its fetches."""


@dataclasses.dataclass(frozen=True)
class DemoConfig(Record):
    nodes: int
    world_size: int
    network: str
    """``netns`` (a network namespace per node, on a bridge) or ``loopback`` (ports on 127.0.0.1)."""
    model_params: int
    state_bytes: int
    """Bytes one rank checkpoints (parameters, optimizer moments and rank state)."""
    steps: int
    checkpoint_every: int
    scenarios: tuple[str, ...]
    seed: int
    peers: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Node -> the nodes holding replicas of its ranks (from ``tierckpt.planning.placement``)."""
    procs_per_node: int = 1
    checkpointing: str = "native"
    """``native`` (``Checkpointer``) or ``dcp`` (FSDP2 state through ``dcp.async_save``/``dcp.load``)."""


@dataclasses.dataclass(frozen=True)
class DemoReport(Message):
    """The whole demo run. ``ok`` is true exactly when every check of every scenario passed."""

    KIND = "tierckpt_demo-report"
    VERSION = 1

    ok: bool
    config: DemoConfig
    scenarios: tuple[ScenarioResult, ...]
    losses: dict[int, float]
    """Step -> training loss (mean over ranks), as first computed."""
    timings: dict[str, float]
    """``setup_s``, ``training_s`` (all segments), ``total_s``."""
    checks: tuple[Check, ...] = ()
    """Run-wide checks (the whole loss curve, the final state)."""
    workdir: str = ""
    """Kept working directory (``--keep-workdir``), else empty."""
    error: str = ""
    """Why the run stopped early, if it did."""
    dedup: dict[str, int] = dataclasses.field(default_factory=dict)
    """``--replica-group``: bytes ``written`` by the ranks and ``replicated`` to peers by the replicators
    over the run, each with its ``*_logical`` figure without deduplication."""

    @property
    def failed_checks(self) -> list[tuple[str, Check]]:
        out = [("run", c) for c in self.checks if not c.ok]
        for s in self.scenarios:
            out += [(s.name, c) for c in s.checks if not c.ok]
        return out


# ------------------------------------------------------------------------------------- rendering

_TIER_STYLE = {"local": "green", "replica": "cyan", "peer": "blue", "gcs": "magenta", "none": "red"}
_TIER_ORDER = {"local": 0, "replica": 1, "peer": 2, "gcs": 3}
_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 48) -> str:
    """A one-line chart of ``values`` (resampled to ``width``)."""
    if not values:
        return ""
    if len(values) > width:
        values = [values[int(i * len(values) / width)] for i in range(width)]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(_BLOCKS[min(len(_BLOCKS) - 1, int((v - lo) / span * len(_BLOCKS)))] for v in values)


def tier_groups(ranks: tuple[RankResult, ...] | list[RankResult]) -> list[tuple[str, list[RankResult]]]:
    """Ranks grouped by the tier they restored from, fastest tier first."""
    by_tier: dict[str, list[RankResult]] = {}
    for r in ranks:
        by_tier.setdefault(r.tier, []).append(r)
    return [(t, by_tier[t]) for t in sorted(by_tier, key=lambda t: _TIER_ORDER.get(t, 9))]


def _tiers(s: ScenarioResult) -> Text:
    """e.g. ``local 0 2-3`` / ``peer 1``; a rank that came from the wrong tier is listed in red. A DCP
    reshard adds ``fetch 4-5``: the ranks whose steps were fetched to the nodes that lacked them."""
    text = Text()
    for tier, ranks in tier_groups(s.ranks):
        if text:
            text.append("\n")
        text.append(f"{tier:<5} ", style=_TIER_STYLE.get(tier, "white"))
        text.append(rank_ranges([r.rank for r in ranks if r.tier == r.expected_tier]))
        wrong = [r.rank for r in ranks if r.tier != r.expected_tier]
        if wrong:
            text.append(" " + rank_ranges(wrong), style="bold red")
    if s.fetched:
        text.append("\nfetch ", style="blue")
        text.append(rank_ranges(list(s.fetched)))
    return text


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def scenario_table(report: DemoReport) -> Table:
    table = Table(
        title="tierckpt demo: failures and recoveries",
        title_justify="left",
        title_style="bold",
        header_style="bold",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("scenario", min_width=15, max_width=18)
    table.add_column("step", justify="right")
    table.add_column("ranks from", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("save", justify="right", no_wrap=True)
    table.add_column("restore", justify="right", no_wrap=True)
    table.add_column("check", no_wrap=True)
    for s in report.scenarios:
        failed = [c.name for c in s.checks if not c.ok]
        result = (
            Text("✔ bit-exact", style="bold green") if s.ok else Text("✘ " + ", ".join(failed), "bold red")
        )
        table.add_row(
            Text.assemble((s.name, "bold"), "\n", (s.failure, "dim")),
            "-" if s.restored_step is None else str(s.restored_step),
            _tiers(s),
            mib(s.bytes),
            _seconds(s.save_blocking_s),
            _seconds(s.restore_s),
            result,
        )
    table.caption = (
        "save: median time one save blocked training. restore: staging + load, slowest rank. "
        "bit-exact: restored state and replayed losses equal the first run's"
        + (" (after a reshard, losses within 1e-5)." if report.config.checkpointing == "dcp" else ".")
    )
    return table


def dedup_line(d: dict[str, int]) -> str:
    """One line of what the replica group saved: each figure against the bytes without deduplication."""
    parts = []
    for key, what in (("written", "written"), ("replicated", "replicated"), ("uploaded", "uploaded")):
        logical = d.get(f"{key}_logical", 0)
        if logical:
            saved = 1 - d.get(key, 0) / logical
            parts.append(f"{what} {mib(d.get(key, 0))} of {mib(logical)} ({saved:.0%} saved)")
    return "replica group: " + ("; ".join(parts) if parts else "nothing counted")


def render_report(report: DemoReport, console: Console) -> None:
    """Print the final table, the loss curve and any failed check with its detail."""
    parts: list[RenderableType] = [scenario_table(report)]
    if report.losses:
        steps = sorted(report.losses)
        curve = [report.losses[s] for s in steps]
        parts.append(
            Text.assemble(
                ("loss ", "bold"),
                (sparkline(curve), "yellow"),
                f"  {curve[0]:.4f} @ step {steps[0]} → {curve[-1]:.4f} @ step {steps[-1]}",
            )
        )
    c = report.config
    state = (
        f"{mib(c.state_bytes)} per checkpoint sharded over the ranks (FSDP2, DCP)"
        if c.checkpointing == "dcp"
        else f"{mib(c.state_bytes)} per rank per checkpoint"
    )
    parts.append(
        Text(
            f"{c.nodes} nodes ({c.network}), {c.world_size} ranks, {c.model_params:,} parameters, "
            f"{state}, every {c.checkpoint_every} steps; total {report.timings.get('total_s', 0):.1f} s",
            style="dim",
        )
    )
    if report.dedup:
        parts.append(Text(dedup_line(report.dedup), style="cyan"))
    for where, check in report.failed_checks:
        parts.append(Text(f"✘ {where}: {check.name}: {check.detail}", style="red"))
    if report.error:
        parts.append(Text(f"✘ stopped early: {report.error}", style="bold red"))
    if report.workdir:
        parts.append(Text(f"working directory kept at {report.workdir}", style="dim"))
    parts.append(
        Text(
            "ALL CHECKS PASSED" if report.ok else "SOME CHECKS FAILED",
            style="bold green" if report.ok else "bold red",
        )
    )
    console.print(Group(*parts))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
