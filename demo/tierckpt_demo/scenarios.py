"""The demo's failure scenarios and the checks made after each recovery (pure: no processes, no I/O).

The run is one training timeline cut into segments. Segment ``i`` trains up to ``kill_at`` (a few
steps past a checkpoint), then every training process is killed with SIGKILL and scenario ``i``
breaks something more:

* ``local``: nothing else. Every rank restores from its own node's ramdisk.
* ``peer``:  one node is lost: its replicator is killed and its ramdisk wiped, then a replacement
  (same name, empty ramdisk) joins. Its rank restores from the peer that holds its replica.
* ``gcs``:   a whole peer group is lost: a node and every node holding its replicas. Ranks with no
  copy left on any surviving node restore from the bucket.
* ``shrink``: (DCP only) one node is lost and not replaced: the job goes on with fewer nodes, so fewer
  ranks, and the checkpoint is resharded; the chunks of the lost node's ranks come from the peers
  that hold their replicas.

Which tier each rank must come back from follows from the peer assignment alone (``expected_tiers``),
and every recovery is checked against what the first run recorded (``check_recovery``): the step,
the tier of every rank, the sha256 of every rank's restored state, and the losses of the replayed
steps, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from tierckpt_demo.report import Check, RankResult

__all__ = [
    "SCENARIOS",
    "Reference",
    "Scenario",
    "Segment",
    "check_recovery",
    "check_run",
    "expected_tiers",
    "lost_nodes",
    "plan_segments",
]


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    """What breaks, in a few words (the report's table)."""
    failure: str
    """What breaks, in a sentence."""
    needs_replication: bool
    """The newest step must be on the peers before the failure."""
    needs_backup: bool
    """The newest step must be complete in the bucket before the failure."""


SCENARIOS: dict[str, Scenario] = {
    "local": Scenario(
        "local",
        "processes killed",
        "every training process killed (SIGKILL)",
        needs_replication=False,
        needs_backup=False,
    ),
    "peer": Scenario(
        "peer",
        "node lost",
        "one node lost: processes killed, replicator killed, ramdisk wiped",
        needs_replication=True,
        needs_backup=False,
    ),
    "gcs": Scenario(
        "gcs",
        "peer group lost",
        "a peer group lost: a node and every node holding its replicas wiped",
        needs_replication=True,
        needs_backup=True,
    ),
    "shrink": Scenario(
        "shrink",
        "node lost, job shrinks",
        "one node lost and not replaced: the job resumes on the other nodes, resharded",
        needs_replication=True,
        needs_backup=False,
    ),
}


# ------------------------------------------------------------------------------------- the timeline


@dataclasses.dataclass(frozen=True)
class Segment:
    """One stretch of training: from wherever the last restore lands up to ``until``."""

    until: int
    scenario: str | None
    """The failure that ends this segment (None: the last segment, which finishes cleanly)."""
    expected_restore: int | None
    """The step the next segment must restore: the newest checkpoint at or before ``until``."""


def plan_segments(steps: int, every: int, scenarios: Sequence[str]) -> list[Segment]:
    """Cut ``steps`` into one segment per scenario plus a final one.

    Each segment ends ``every // 2`` (at least 1) steps past a checkpoint, so the recovery replays a
    few steps whose losses can be compared, and contains a new checkpoint of its own.
    """
    if every < 1:
        raise ValueError("--checkpoint-every must be at least 1")
    for name in scenarios:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}: choose from {', '.join(SCENARIOS)}")
    replay = max(1, every // 2)
    need = (len(scenarios) + 1) * every
    if steps < need:
        raise ValueError(
            f"{steps} steps are too few for {len(scenarios)} scenario(s) with a checkpoint every "
            f"{every} steps: use --steps {need} or more"
        )
    out: list[Segment] = []
    last_kill = 0
    for i, name in enumerate(scenarios):
        ideal = (i + 1) * steps / (len(scenarios) + 1)
        checkpoint = max(every * math.floor(ideal / every), every * (last_kill // every + 1))
        kill = min(checkpoint + replay, steps - 1)
        if kill <= last_kill or kill - checkpoint < 1 or checkpoint <= last_kill:
            raise ValueError(
                f"cannot fit {len(scenarios)} scenario(s) into {steps} steps with a checkpoint "
                f"every {every}: raise --steps"
            )
        out.append(Segment(until=kill, scenario=name, expected_restore=checkpoint))
        last_kill = kill
    out.append(Segment(until=steps, scenario=None, expected_restore=None))
    return out


# ------------------------------------------------------------------------------------- failures


def lost_nodes(scenario: str, victim: str, peers: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The nodes a scenario wipes: none, the victim, or the victim and every node holding its replicas."""
    if scenario == "local":
        return ()
    if scenario in ("peer", "shrink"):
        return (victim,)
    if scenario == "gcs":
        return tuple(sorted({victim, *peers.get(victim, ())}))
    raise ValueError(f"unknown scenario {scenario!r}")


def expected_tiers(
    rank_nodes: Mapping[int, str], peers: Mapping[str, Sequence[str]], lost: Sequence[str]
) -> dict[int, str]:
    """Where each rank's newest step must come from once ``lost`` nodes are wiped.

    Its own node survived: ``local``. Else a surviving node holds its replica: ``peer``. Else ``gcs``.
    (Assumes the newest step was replicated to every peer before the failure.)
    """
    out = {}
    for rank, node in rank_nodes.items():
        if node not in lost:
            out[rank] = "local"
        elif any(p not in lost for p in peers.get(node, ())):
            out[rank] = "peer"
        else:
            out[rank] = "gcs"
    return out


# ------------------------------------------------------------------------------------- checks


@dataclasses.dataclass
class Reference:
    """What the training has computed so far: the first loss of every step, and the state hash every
    rank recorded when it saved each step. Later segments are compared against it, then extend it."""

    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    saved: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    """(rank, step) -> sha256 of the state as saved."""

    def record(self, losses: Mapping[int, float], saved: Mapping[tuple[int, int], str]) -> None:
        for step, loss in losses.items():
            self.losses.setdefault(step, loss)
        for key, digest in saved.items():
            self.saved.setdefault(key, digest)


def _step_check(expected: int | None, ranks: Sequence[RankResult]) -> Check:
    got = sorted({r.step for r in ranks}, key=lambda s: -1 if s is None else s)
    ok = got == [expected]
    return Check(
        "step",
        ok,
        f"every rank restored step {expected}"
        if ok
        else f"expected step {expected} on every rank, got {got}",
    )


def _tier_check(ranks: Sequence[RankResult]) -> Check:
    wrong = [
        f"rank {r.rank}: {r.tier} (expected {r.expected_tier})" for r in ranks if r.tier != r.expected_tier
    ]
    return Check("tier", not wrong, "; ".join(wrong) or "every rank restored from the expected tier")


def _state_check(ranks: Sequence[RankResult]) -> Check:
    wrong = [
        f"rank {r.rank}: sha256 {r.state_sha256[:12]} != saved {r.reference_sha256[:12] or '(none)'}"
        for r in ranks
        if not r.reference_sha256 or r.state_sha256 != r.reference_sha256
    ]
    return Check("state", not wrong, "; ".join(wrong) or "restored state is bit-identical to the saved one")


def _loss_check(
    reference: Mapping[int, float], replayed: Mapping[int, float], tolerance: float = 0.0
) -> tuple[Check, int]:
    common = sorted(set(reference) & set(replayed))
    diverged = [s for s in common if abs(reference[s] - replayed[s]) > tolerance * abs(reference[s])]
    if not common:
        return Check("loss", False, "no replayed step to compare with the first run"), 0
    if diverged:
        s = diverged[0]
        return Check(
            "loss",
            False,
            f"{len(diverged)} of {len(common)} replayed steps differ; first at step "
            f"{s}: {replayed[s]!r} vs {reference[s]!r}",
        ), len(common)
    if tolerance:
        worst = max(abs(reference[s] - replayed[s]) / (abs(reference[s]) or 1.0) for s in common)
        return Check(
            "loss",
            True,
            f"losses of steps {common[0]}-{common[-1]} within {worst:.1e} of the first run's "
            f"(another world size sums in another order; allowed {tolerance:.0e})",
        ), len(common)
    return Check(
        "loss", True, f"losses of steps {common[0]}-{common[-1]} equal the first run's, bit for bit"
    ), len(common)


def check_recovery(
    *,
    expected_step: int | None,
    ranks: Sequence[RankResult],
    reference: Reference,
    replayed: Mapping[int, float],
    tolerance: float = 0.0,
) -> tuple[list[Check], int]:
    """Every check of one recovery, and how many replayed steps were compared (``tolerance``: relative
    difference allowed between replayed and first losses; 0 is bit for bit)."""
    loss, compared = _loss_check(reference.losses, replayed, tolerance)
    return [_step_check(expected_step, ranks), _tier_check(ranks), _state_check(ranks), loss], compared


def check_run(
    *, steps: int, losses: Mapping[int, float], final_models: Mapping[int, str], world_size: int
) -> list[Check]:
    """Run-wide checks: every step was trained, and every rank ended with the same model (data parallel)."""
    missing = sorted(set(range(1, steps + 1)) - set(losses))
    curve = Check(
        "curve",
        not missing,
        f"losses of steps 1-{steps}"
        if not missing
        else f"no loss for steps {missing[:10]}{'...' if len(missing) > 10 else ''}",
    )
    digests = set(final_models.values())
    in_sync = len(final_models) == world_size and len(digests) == 1
    detail = (
        "every rank ended with the same model weights"
        if in_sync
        else (f"{len(final_models)} of {world_size} ranks finished, with {len(digests)} different models")
    )
    return [curve, Check("in-sync", in_sync, detail)]
