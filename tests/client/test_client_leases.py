"""The lease file protocol (tierckpt.protocol.leases) on a real directory."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tierckpt.protocol import leases
from tierckpt.protocol.errors import MissingCheckpointError
from tierckpt.protocol.format import Lease, Manifest, commit_step, lease_dir, rank_dir, step_dir


@pytest.fixture
def rank_path(root, job):
    path = rank_dir(root, job, 0)
    for step in (1, 2):
        d = step_dir(path, step)
        d.mkdir(parents=True)
        commit_step(
            d, Manifest(job=job, rank=0, world_size=1, step=step, created_at=0.0, files=(), tensors=())
        )
    step_dir(path, 3).mkdir()  # uncommitted
    return path


def test_acquire_writes_the_lease_file_and_release_removes_it(rank_path):
    lease = leases.acquire(rank_path, 2, "replicator.node-a", ttl=30)
    path = lease_dir(rank_path) / "000000000002.replicator.node-a.json"
    assert Lease.from_bytes(path.read_bytes()) == lease and lease.pid == os.getpid()
    assert leases.leased_steps(rank_path) == {2}
    leases.release(rank_path, lease)
    assert not path.exists() and leases.active(rank_path) == []
    leases.release(rank_path, lease)  # idempotent


def test_only_committed_steps_can_be_leased(rank_path):
    for step in (3, 4):
        with pytest.raises(MissingCheckpointError):
            leases.acquire(rank_path, step, "reader")
    with pytest.raises(MissingCheckpointError):
        leases.acquire(rank_path.parent / "rank-00009", 1, "reader")


def test_expired_leases_do_not_count_and_can_be_purged(rank_path):
    lease = leases.acquire(rank_path, 1, "old", ttl=10)
    leases.acquire(rank_path, 2, "new", ttl=1000)
    later = lease.expires_at + 1
    assert leases.leased_steps(rank_path, now=later) == {2}
    (lease_dir(rank_path) / "000000000001.garbage.json").write_text("{not json")
    assert leases.purge_expired(rank_path, now=later) == 2
    assert sorted(os.listdir(lease_dir(rank_path))) == [".lock", "000000000002.new.json"]


def test_renew_extends_and_fails_once_the_step_is_gone(rank_path):
    lease = leases.acquire(rank_path, 1, "r", ttl=5)
    renewed = leases.renew(rank_path, lease, ttl=500)
    assert renewed.expires_at > lease.expires_at + 400
    leases.release(rank_path, renewed)
    os.unlink(step_dir(rank_path, 1) / "COMMIT")
    with pytest.raises(MissingCheckpointError):
        leases.renew(rank_path, renewed)


def test_a_lease_file_whose_name_disagrees_with_its_content_is_ignored(rank_path):
    lease = leases.acquire(rank_path, 1, "a")
    os.rename(leases.lease_path(rank_path, 1, "a"), leases.lease_path(rank_path, 2, "a"))
    assert leases.active(rank_path) == [] and lease.step == 1


def test_hold_renews_in_the_background_until_the_block_ends(rank_path):
    with leases.hold(rank_path, 2, "holder", ttl=0.3) as held:
        first = held.lease.expires_at
        time.sleep(0.5)
        assert held.lease.expires_at > first and leases.leased_steps(rank_path) == {2}
    assert leases.active(rank_path) == []


def test_lock_serialises_holders(rank_path):
    order = []
    with leases.lock(rank_path):
        t = threading.Thread(target=lambda: leases.acquire(rank_path, 1, "late") and order.append("acquired"))
        t.start()
        time.sleep(0.1)
        order.append("unlocking")
    t.join()
    assert order == ["unlocking", "acquired"]
