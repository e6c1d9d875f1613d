"""The goodput model (tierckpt.planning.goodput): its recommendation is the optimum of its own formula,
its formula agrees with an independent event-by-event simulation of a failing job, and ``compare``
reads a measured run back to the goodput it measured."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from tierckpt.planning.goodput import (
    Assumptions,
    SoakFailure,
    SoakResult,
    compare,
    goodput,
    recommend,
    young_daly,
)

BIG = Assumptions(
    nodes=4096,
    node_mtbf_s=8760 * 3600,
    save_s=2.0,
    restore_local_s=15.0,
    restore_peer_s=40.0,
    checkpoint_bytes=32 << 40,
    bucket_bytes_per_s=50 << 30,
)


def test_young_daly() -> None:
    assert young_daly(2.0, 7700.0) == pytest.approx(math.sqrt(2 * 2.0 * 7700.0) - 2.0)
    assert young_daly(0.0, 100.0) == 0.0
    assert young_daly(300.0, 100.0) == 100.0  # a save longer than two MTBFs: as rarely as failures come


def test_the_recommendation_is_the_optimum_of_the_model() -> None:
    rec = recommend(BIG)
    assert rec.factor == 1  # a second replica gains nothing a node loss needs, at this failure rate
    assert rec.backup_interval_s >= BIG.upload_s  # a backup starts once the previous one completed
    assert rec.backup_interval_s / rec.interval_s == pytest.approx(
        round(rec.backup_interval_s / rec.interval_s)
    )
    best = rec.expected.goodput
    for scale in (0.5, 0.8, 1.25, 2.0):
        other = goodput(
            BIG, interval_s=rec.interval_s * scale, backup_interval_s=rec.backup_interval_s, factor=1
        )
        assert other.goodput <= best + 1e-9
    without_peers = rec.by_factor[0]
    assert without_peers.goodput < best - 0.05  # every lost node restores from the bucket: the backup's age
    assert without_peers.failures_bucket > 10 * rec.expected.failures_bucket


def _simulate(
    a: Assumptions, interval: float, backup: float, factor: int, wall: float, seed: int
) -> SoakResult:
    """An event-by-event run, independent of the model's formulas: training advances between failures,
    saves every ``interval`` of training (costing ``save_s``), backs up every ``backup`` of training (a
    backup counts ``upload_s`` of wall time after its save), and each failure restores from the tier
    that holds a copy, redoing the work since that copy."""
    rng = random.Random(seed)
    t = progress = 0.0  # wall clock; training done and kept
    last_save = last_backup = 0.0  # training progress at the newest save, at the newest complete backup
    pending: list[tuple[float, float]] = []  # (wall time it completes, progress it holds)
    saves, failures = 0, []
    peers_lost = a.all_peers_lost(factor) if factor else 1.0
    next_failure = rng.expovariate(a.rate)
    while t < wall:
        next_save = last_save + interval - progress  # training seconds to the next save
        if t + next_save < next_failure:
            t += next_save + a.save_s
            progress = last_save = last_save + interval
            saves += 1
            if round(progress / interval) % round(backup / interval) == 0:
                pending.append((t + a.upload_s, progress))
            for done, held in [p for p in pending if p[0] <= t]:
                last_backup = max(last_backup, held)
                pending.remove((done, held))
            continue
        progress += next_failure - t
        t = next_failure
        for done, held in [p for p in pending if p[0] <= t]:
            last_backup = max(last_backup, held)
            pending.remove((done, held))
        u = rng.random()
        if u < a.total_loss or (u < a.total_loss + a.node_loss and rng.random() < peers_lost):
            tier, back_to, restore = "bucket", last_backup, a.bucket_restore_s
            pending.clear()
        elif u < a.total_loss + a.node_loss:
            tier, back_to, restore = "peer", last_save, a.restore_peer_s
        else:
            tier, back_to, restore = "local", last_save, a.restore_local_s
        failures.append(
            SoakFailure(tier=tier, lost_work_s=progress - back_to, restart_s=a.restart_s, restore_s=restore)
        )
        progress = last_save = back_to
        t += a.restart_s + restore
        next_failure = t + rng.expovariate(a.rate)
    return SoakResult(
        nodes=a.nodes,
        wall_s=t,
        useful_s=progress,
        interval_s=interval,
        backup_interval_s=backup,
        factor=factor,
        saves=saves,
        save_s=a.save_s,
        upload_s=a.upload_s,
        failures=tuple(failures),
    )


@pytest.mark.parametrize(("mtbf_h", "factor"), [(2000, 1), (8760, 1), (8760, 0)])
def test_the_model_agrees_with_a_simulated_run(mtbf_h: float, factor: int) -> None:
    """Failures every 30 min or every 2 h, a zone lost in 5% of them, with and without peers."""
    a = dataclasses.replace(BIG, node_mtbf_s=mtbf_h * 3600, total_loss=0.05)
    rec = recommend(a)
    interval, backup = rec.interval_s, rec.backup_interval_s
    run = _simulate(a, interval, backup, factor, wall=300 * 24 * 3600, seed=7)
    model = goodput(a, interval_s=interval, backup_interval_s=backup, factor=factor)
    assert run.useful_s / run.wall_s == pytest.approx(model.goodput, abs=0.01)
    seen = compare(run)  # the run read back: its own mix of tiers and costs
    assert seen.observed == pytest.approx(run.useful_s / run.wall_s)
    assert seen.predicted == pytest.approx(seen.observed, abs=0.01)


def test_a_soak_result_round_trips() -> None:
    run = SoakResult(
        nodes=8,
        wall_s=3600.0,
        useful_s=3400.0,
        interval_s=60.0,
        backup_interval_s=600.0,
        factor=1,
        saves=55,
        save_s=1.0,
        failures=(SoakFailure(tier="peer", lost_work_s=30.0, restart_s=60.0, restore_s=20.0),),
    )
    assert SoakResult.from_bytes(run.to_bytes()) == run
    with pytest.raises(ValueError):
        Assumptions(nodes=1, node_mtbf_s=1.0, save_s=1.0, restore_local_s=1.0, restore_peer_s=1.0)
