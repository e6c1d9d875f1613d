"""Waiting for the replicator's restore status (control/restore-rank-NNNNN.json) before loading."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tierckpt import Checkpointer, RetryableError
from tierckpt.integrations.resume import resume_message
from tierckpt.protocol.control import RestoreState, RestoreStatus, Tier, write_restore_status
from tierckpt.protocol.format import job_dir
from tierckpt.snapshot.restore_wait import (
    USE_LOCAL,
    restore_target,
    restored_from,
    staged_step,
    wait_for_restore,
)


def status(
    job: str, state: RestoreState, step: int | None = None, updated_at: float | None = None
) -> RestoreStatus:
    return RestoreStatus(
        job=job,
        rank=0,
        state=state,
        step=step,
        source=Tier.PEER,
        bytes_done=0,
        bytes_total=10,
        updated_at=time.time() if updated_at is None else updated_at,
        message="disk on fire" * (state == "failed"),
    )


def publish(root, job, st: RestoreStatus) -> None:
    write_restore_status(job_dir(root, job), st)


def test_no_status_and_no_replicator_means_no_wait(root, job):
    assert wait_for_restore(root, job, 0, expect_replicator=False, stall_timeout=100) is None


def test_waits_while_the_status_moves_then_returns_ready(root, job):
    publish(root, job, status(job, RestoreState.STAGING))

    def replicator():
        for _i in range(5):
            time.sleep(0.1)
            publish(root, job, status(job, RestoreState.STAGING))
        publish(root, job, status(job, RestoreState.READY, step=4))

    t = threading.Thread(target=replicator)
    t.start()
    got = wait_for_restore(root, job, 0, expect_replicator=True, stall_timeout=0.3, poll=0.02)
    t.join()
    assert got is not None and got.state is RestoreState.READY and got.step == 4


def test_a_stalled_status_is_given_up_on(root, job):
    publish(root, job, status(job, RestoreState.STAGING))
    got = wait_for_restore(root, job, 0, expect_replicator=False, stall_timeout=0.2, poll=0.02)
    assert got is not None and got.state is RestoreState.STAGING
    assert (
        wait_for_restore(root, "other-job", 0, expect_replicator=True, stall_timeout=0.1, poll=0.02) is None
    )


def test_failed_staging_raises(root, job):
    publish(root, job, status(job, RestoreState.FAILED))
    with pytest.raises(RetryableError, match="disk on fire"):
        wait_for_restore(root, job, 0, expect_replicator=False, stall_timeout=1)


def test_restore_target_ignores_stale_statuses():
    ready = status("j", RestoreState.READY, step=3, updated_at=100.0)
    none = status("j", RestoreState.NONE, updated_at=100.0)
    assert restore_target(None, 50.0) == USE_LOCAL
    assert restore_target(ready, 50.0) == 3 and restore_target(ready, None) == 3
    assert restore_target(ready, 150.0) == USE_LOCAL  # saved since the replicator staged
    assert restore_target(none, 50.0) is None and restore_target(none, 150.0) == USE_LOCAL
    assert restore_target(status("j", RestoreState.STAGING, updated_at=100.0), 50.0) == USE_LOCAL


def test_the_staged_step_is_the_fresh_status_step_being_staged_or_ready():
    for state in (RestoreState.STAGING, RestoreState.READY):
        st = status("j", state, step=5, updated_at=100.0)
        assert staged_step(st, 50.0) == 5 and staged_step(st, None) == 5
        assert staged_step(st, 150.0) is None  # the rank saved after it: normal retention again
    for state in (RestoreState.PENDING, RestoreState.NONE, RestoreState.FAILED):
        assert staged_step(status("j", state, step=5, updated_at=100.0), 50.0) is None
    assert staged_step(None, 50.0) is None


def saved_steps(root, job, steps, keep) -> dict[int, torch.Tensor]:
    """Commit ``steps`` in order with a writer that keeps them all; each step's tensor."""
    values = {step: torch.arange(8, dtype=torch.float32) + step for step in steps}
    with Checkpointer(root=root, job=job, keep=keep) as ck:
        for step in steps:
            ck.save(step, {"v": values[step]}, blocking=True)
    return values


def test_a_restore_to_an_older_step_survives_the_writers_clean_up_and_training_goes_on_from_it(root, job):
    """The replicator staged the plan's step 5 next to the rank's newer 10 and 15 (a peer group lost:
    nothing newer is restorable everywhere). The writer's crash clean-up (keep=2) keeps step 5, the load
    takes it, and the next save retires 10 and 15: they were saved before training went back."""
    values = saved_steps(root, job, (5, 10, 15), keep=3)
    publish(root, job, status(job, RestoreState.READY, step=5))
    with Checkpointer(root=root, job=job, keep=2) as ck:
        assert ck.committed_steps() == [5, 10, 15]
        dest = {"v": torch.zeros(8)}
        assert ck.load(dest) == 5 and torch.equal(dest["v"], values[5])
        ck.save(6, {"v": dest["v"] + 1}, blocking=True)
        assert ck.committed_steps() == [5, 6]
    with Checkpointer(root=root, job=job, keep=2) as ck:  # a crash later: the status is stale now
        dest = {"v": torch.zeros(8)}
        assert ck.load(dest) == 6 and torch.equal(dest["v"], values[5] + 1)


def test_a_new_plan_releases_the_step_the_old_one_staged(root, job):
    saved_steps(root, job, (5, 10, 15), keep=3)
    publish(root, job, status(job, RestoreState.STAGING, step=5))  # the step is committed, not yet ready
    with Checkpointer(root=root, job=job, keep=2) as ck:
        assert ck.committed_steps() == [5, 10, 15]
    publish(root, job, status(job, RestoreState.PENDING))  # a new plan: restaging begins
    with Checkpointer(root=root, job=job, keep=2) as ck:
        assert ck.committed_steps() == [10, 15]


def test_load_follows_a_fresh_status_and_ignores_a_stale_one(root, job):
    with Checkpointer(root=root, job=job) as ck:
        for step in (1, 2):
            ck.save(step, {"v": torch.full((4,), step)}, blocking=True)
        publish(root, job, status(job, RestoreState.READY, step=1))  # the job-wide plan says step 1
        dest = {}
        assert ck.load(dest) == 1 and int(dest["v"][0]) == 1
        publish(root, job, status(job, RestoreState.NONE))
        assert ck.load({}, allow_missing=True) is None
        ck.save(3, {"v": torch.full((4,), 3)}, blocking=True)  # training went on: the status is stale
        assert ck.load({}) == 3
        publish(root, job, status(job, RestoreState.FAILED))
        with pytest.raises(RetryableError):
            ck.load({})


def test_restored_from_names_the_tier_the_replicator_staged_the_loaded_step_from(root, job):
    with Checkpointer(root=root, job=job) as ck:
        ck.save(4, {"w": torch.ones(8)}, blocking=True)
        ck.save(8, {"w": torch.ones(8)}, blocking=True)
    assert restored_from(root, job, 0, 8).tier is Tier.LOCAL  # no restore status: the node's own copy
    publish(root, job, status(job, RestoreState.READY, step=8))
    staged = restored_from(root, job, 0, 8)
    assert staged.tier is Tier.PEER and staged.total_bytes > 0 and staged.staged_at > 0
    assert 0 < time.time() - staged.committed_at < 60
    assert restored_from(root, job, 0, 4).tier is Tier.LOCAL  # another step than the one staged
    message = resume_message(root, job, 0, 8)
    assert message.startswith(f"tierckpt: resumed job {job!r} from step 8 (saved ") and " s ago)" in message
    assert "rank 0 from a peer node (fetched by the replicator)" in message and str(root / job) in message
