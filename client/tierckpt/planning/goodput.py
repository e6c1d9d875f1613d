"""What to set, and what goodput to expect: a first-order model of a multi-tier checkpointed job (pure).

Given what was measured (the blocking cost of a save, how long a restore takes from each tier, the
bucket's bandwidth) and what the user knows (nodes, how often one fails, how often a failure loses the
node or every copy), ``recommend`` gives the checkpoint interval, the backup interval and the
replication factor, and ``goodput`` the fraction of wall time spent on useful training for any
settings. docs/goodput.md has the derivation; ``tierckpt plan`` prints it.

The model: while the job is up, failures come at ``rate = nodes / node_mtbf_s`` and a save stops
training for ``save_s`` every ``interval_s`` of it. A failure costs the downtime (``restart_s`` and the
restore from the tier that still holds a copy, ``D`` on average) and the work since that copy (``L``):

    goodput = (interval_s / (interval_s + save_s) - rate * L) / (1 + rate * D)

with each tier's share of the failures:
  * the node survives (a process failure): the local ramdisk, ``interval_s / 2`` of work;
  * the node is lost (``node_loss``): a peer's replica, ``interval_s / 2`` of work, unless every one of
    its ``factor`` peers failed too before the replicas were made again (``rereplicate_s``): the bucket;
  * every copy is lost (``total_loss``: a zone or the whole job at once): the bucket, whose newest
    complete backup is on average ``backup_interval_s / 2 + upload_s`` old.

The checkpoint interval that maximises it (Young, Daly: ``sqrt(2 * save_s / rate) - save_s``) only weighs
the failures restored from the ramdisks (those lose ``interval_s / 2``; the others lose the backup's age
whatever the interval): ``ramdisk_rate`` in place of ``rate``. A backup cannot start before the previous
one completed, so the backup interval is the upload time rounded up to whole checkpoint intervals. The
replication factor is the smallest whose next one gains less than ``factor_gain`` of goodput. Valid while
failures are independent and far apart compared with an interval, a backup and a restore.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from tierckpt.protocol.codec import Message, Record

__all__ = [
    "Assumptions",
    "Breakdown",
    "Comparison",
    "Recommendation",
    "SoakFailure",
    "SoakResult",
    "compare",
    "goodput",
    "recommend",
    "young_daly",
]


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What was measured and what the user knows (seconds, bytes, bytes a second)."""

    nodes: int
    node_mtbf_s: float
    """Mean time between failures of one node, every cause (a restart of its training process too)."""
    save_s: float
    """Training time one local checkpoint costs (the save's blocking time)."""
    restore_local_s: float
    restore_peer_s: float
    restore_bucket_s: float | None = None
    """None: from ``checkpoint_bytes`` and ``bucket_bytes_per_s``."""
    checkpoint_bytes: int = 0
    """The whole job's checkpoint (every rank)."""
    bucket_bytes_per_s: float = 0.0
    """The bucket's bandwidth for the whole job (uploads and restores alike)."""
    restart_s: float = 60.0
    """Rescheduling and starting the processes again, before any restore."""
    node_loss: float = 0.5
    """Fraction of failures that lose the node and its ramdisk."""
    total_loss: float = 0.01
    """Fraction of failures that lose every in-memory copy (a zone, the whole job)."""
    rereplicate_s: float | None = None
    """How long a lost node's ranks have fewer copies (None: ``restore_peer_s``)."""
    backup_upload_s: float | None = None
    """One backup's upload (None: ``checkpoint_bytes / bucket_bytes_per_s``)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.node_mtbf_s <= 0 or self.save_s < 0:
            raise ValueError("nodes >= 1, node_mtbf_s > 0 and save_s >= 0 are needed")
        if min(self.node_loss, self.total_loss) < 0 or self.node_loss + self.total_loss > 1:
            raise ValueError("node_loss and total_loss are fractions of the failures, at most 1 together")
        if self.restore_bucket_s is None and (self.checkpoint_bytes <= 0 or self.bucket_bytes_per_s <= 0):
            raise ValueError("give restore_bucket_s, or checkpoint_bytes and bucket_bytes_per_s")

    @property
    def rate(self) -> float:
        """Failures of the job a second."""
        return self.nodes / self.node_mtbf_s

    @property
    def upload_s(self) -> float:
        """One backup's upload (0 if no bandwidth is known)."""
        if self.backup_upload_s is not None:
            return self.backup_upload_s
        if self.checkpoint_bytes <= 0 or self.bucket_bytes_per_s <= 0:
            return 0.0
        return self.checkpoint_bytes / self.bucket_bytes_per_s

    @property
    def bucket_restore_s(self) -> float:
        if self.restore_bucket_s is not None:
            return self.restore_bucket_s
        return self.checkpoint_bytes / self.bucket_bytes_per_s

    def all_peers_lost(self, factor: int) -> float:
        """Probability that a lost node's ``factor`` peers all fail too while its ranks have fewer copies
        (independent failures); 1 without peers."""
        window = self.rereplicate_s if self.rereplicate_s is not None else self.restore_peer_s
        return min(1.0, window / self.node_mtbf_s) ** factor


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """The waste of one setting, by cause (fractions of wall time: saves, and for failures restored from
    each tier their downtime and redone work); ``goodput = 1 - waste``."""

    interval_s: float
    backup_interval_s: float
    factor: int
    checkpoints: float
    failures_local: float
    failures_peer: float
    failures_bucket: float

    @property
    def waste(self) -> float:
        return self.checkpoints + self.failures_local + self.failures_peer + self.failures_bucket

    @property
    def goodput(self) -> float:
        return max(0.0, 1.0 - self.waste)


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What to set, why, and what it gives."""

    interval_s: float
    backup_interval_s: float
    factor: int
    expected: Breakdown
    by_factor: tuple[Breakdown, ...]
    """The recommended intervals with factors 0, 1, 2, 3."""
    young_daly_s: float
    """``sqrt(2 * save_s * MTBF)`` of the whole job, for reference (every failure from a ramdisk)."""


def young_daly(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises ``save_s / t + t / (2 * mtbf_s)``, with Daly's correction
    (``- save_s``) while ``save_s < 2 * mtbf_s``, else the MTBF."""
    if save_s <= 0:
        return 0.0
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    return max(save_s, math.sqrt(2 * save_s * mtbf_s) - save_s)


def goodput(a: Assumptions, *, interval_s: float, backup_interval_s: float, factor: int) -> Breakdown:
    """The model's goodput and waste by cause for these settings (see the module docstring)."""
    if interval_s <= 0 or backup_interval_s <= 0 or factor < 0:
        raise ValueError("intervals must be positive and the factor not negative")
    peers_lost = a.all_peers_lost(factor) if factor > 0 else 1.0
    shares = {
        "local": 1.0 - a.node_loss - a.total_loss,
        "peer": a.node_loss * (1.0 - peers_lost),
        "bucket": a.total_loss + a.node_loss * peers_lost,
    }
    restore = {"local": a.restore_local_s, "peer": a.restore_peer_s, "bucket": a.bucket_restore_s}
    lost = {"local": interval_s / 2, "peer": interval_s / 2, "bucket": backup_interval_s / 2 + a.upload_s}
    rate = {tier: a.rate * share for tier, share in shares.items()}
    down = sum(rate[t] * (a.restart_s + restore[t]) for t in rate)
    scale = 1.0 / (1.0 + down)  # of the wall time, the share the job is up
    cost = {t: rate[t] * (a.restart_s + restore[t] + lost[t]) * scale for t in rate}
    return Breakdown(
        interval_s=interval_s,
        backup_interval_s=backup_interval_s,
        factor=factor,
        checkpoints=a.save_s / (interval_s + a.save_s) * scale,
        failures_local=cost["local"],
        failures_peer=cost["peer"],
        failures_bucket=cost["bucket"],
    )


def recommend(a: Assumptions, *, factor_gain: float = 1e-4, max_factor: int = 3) -> Recommendation:
    """The checkpoint interval, backup interval and replication factor to set (see the module
    docstring); ``factor_gain``: the least goodput another replica must add to be recommended."""
    by_factor = []
    for factor in range(max_factor + 1):
        peers_lost = a.all_peers_lost(factor) if factor > 0 else 1.0
        ramdisk_rate = a.rate * ((1.0 - a.node_loss - a.total_loss) + a.node_loss * (1.0 - peers_lost))
        interval = young_daly(a.save_s, 1.0 / ramdisk_rate) if ramdisk_rate > 0 else 3600.0
        interval = max(interval, 1.0)
        backup = max(1, math.ceil(a.upload_s / interval)) * interval
        by_factor.append(goodput(a, interval_s=interval, backup_interval_s=backup, factor=factor))
    chosen = by_factor[-1]
    for here, more in itertools.pairwise(by_factor):
        if here.factor >= 1 and more.goodput - here.goodput < factor_gain:
            chosen = here
            break
    return Recommendation(
        interval_s=chosen.interval_s,
        backup_interval_s=chosen.backup_interval_s,
        factor=chosen.factor,
        expected=chosen,
        by_factor=tuple(by_factor),
        young_daly_s=young_daly(a.save_s, a.node_mtbf_s / a.nodes),
    )


# ------------------------------------------------------------------------------------ a run, measured


@dataclasses.dataclass(frozen=True)
class SoakFailure(Record):
    """One failure of a measured run: the tier its ranks were restored from, and what it cost."""

    tier: str
    """``local``, ``peer`` or ``bucket``."""
    lost_work_s: float
    """Training redone: from the restored step to where the failure struck."""
    restart_s: float
    restore_s: float


@dataclasses.dataclass(frozen=True)
class SoakResult(Message):
    """What a soak run with injected failures measured (a chaos harness writes it): its settings, its
    wall and useful training time, its saves and its failures."""

    KIND = "tierckpt.soak-result"
    VERSION = 1

    nodes: int
    wall_s: float
    useful_s: float
    """Training time that counted (steps never redone), the run's goodput times its wall time."""
    interval_s: float
    backup_interval_s: float
    factor: int
    saves: int
    save_s: float
    """Mean blocking time of a save."""
    upload_s: float = 0.0
    """Mean time from a backup's start to its completion in the bucket."""
    failures: tuple[SoakFailure, ...] = ()


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The model's goodput for a measured run (fed the run's own failure mix and costs) against the
    goodput the run measured, and the waste by cause each way."""

    observed: float
    predicted: float
    observed_waste: dict[str, float]
    predicted_waste: dict[str, float]


def compare(run: SoakResult) -> Comparison:
    """Feed the model what ``run`` measured (its failure rate while up and its mix of tiers, the mean
    restart, restore per tier and backup upload, its save cost and settings) and compare the goodput the
    model predicts with the run's. The model's own assumptions (work lost: half an interval, or half a
    backup interval and an upload) are what is tested; the rest is the noise of a finite run."""
    by_tier: dict[str, list[SoakFailure]] = {"local": [], "peer": [], "bucket": []}
    for f in run.failures:
        by_tier.setdefault(f.tier, []).append(f)
    total = max(1, len(run.failures))

    def mean(values: list[float], default: float) -> float:
        return sum(values) / len(values) if values else default

    restart = mean([f.restart_s for f in run.failures], 0.0)
    up = run.wall_s - sum(f.restart_s + f.restore_s for f in run.failures)  # failures strike while up
    a = Assumptions(
        nodes=run.nodes,
        node_mtbf_s=run.nodes * up / len(run.failures) if run.failures else 1e18,
        save_s=run.save_s,
        restore_local_s=mean([f.restore_s for f in by_tier["local"]], 0.0),
        restore_peer_s=mean([f.restore_s for f in by_tier["peer"]], 0.0),
        restore_bucket_s=mean([f.restore_s for f in by_tier["bucket"]], 0.0),
        restart_s=restart,
        node_loss=len(by_tier["peer"]) / total,
        total_loss=len(by_tier["bucket"]) / total,
        rereplicate_s=0.0,
        backup_upload_s=run.upload_s,
    )
    model = goodput(a, interval_s=run.interval_s, backup_interval_s=run.backup_interval_s, factor=run.factor)
    seen = {
        tier: sum(f.lost_work_s + f.restart_s + f.restore_s for f in fs) / run.wall_s
        for tier, fs in by_tier.items()
    }
    observed_waste = {
        "checkpoints": run.saves * run.save_s / run.wall_s,
        "failures_local": seen.get("local", 0.0),
        "failures_peer": seen.get("peer", 0.0),
        "failures_bucket": seen.get("bucket", 0.0),
    }
    predicted_waste = {
        "checkpoints": model.checkpoints,
        "failures_local": model.failures_local,
        "failures_peer": model.failures_peer,
        "failures_bucket": model.failures_bucket,
    }
    return Comparison(
        observed=run.useful_s / run.wall_s,
        predicted=model.goodput,
        observed_waste=observed_waste,
        predicted_waste=predicted_waste,
    )
