"""A job's policy (``PUT /v1/jobs/{job}/policy``) drives its backups: a real ``tierckpt-replicator``
process with its own ``--gcs-bucket``, a real fake-gcs-server, steps committed on the ramdisk. The
job's steps go to the policy's bucket and prefix on the policy's step interval, retention follows the
policy, an edited policy moves the next backup, and ``DELETE ?bucket=true`` empties the policy's bucket.
Plus the pure rule that merges a policy into the node's settings."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt.protocol.client import ReplicatorClient, SyncReplicatorClient
from tierckpt.protocol.control import JobPolicy, PurgeResult
from tierckpt.protocol.tokens import TokenFile
from tierckpt_demo.fakegcs import FakeGcsServer
from tierckpt_demo.ports import free_port
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.backup.jobs import effective_settings
from tierckpt_replicator.backup.settings import BackupSettings

pytestmark = [pytest.mark.e2e]

TOKEN = "policy-test-token"
NODE_BUCKET, POLICY_BUCKET = "node-bucket", "policy-bucket"


def test_a_policy_overrides_the_node_flags():
    node = BackupSettings(bucket="node-bucket", prefix="n", interval_seconds=600, keep_last=5, parallelism=3)
    assert effective_settings(node, None) is node
    assert effective_settings(BackupSettings(), None) is None  # no bucket anywhere: no backups
    p = JobPolicy(
        job="j",
        generation=1,
        bucket="job-bucket",
        prefix="p/q",
        backup_interval_steps=50,
        backup_interval_minutes=2,
        keep_last=2,
        keep_every=1000,
    )
    got = effective_settings(node, p)
    assert got is not None
    assert (got.bucket, got.prefix) == ("job-bucket", "p/q")
    assert (got.interval_steps, got.interval_seconds) == (50, 120.0)
    assert (got.keep_last, got.keep_every) == (2, 1000)
    assert got.parallelism == 3  # node-level tuning stays
    schedule_only = effective_settings(node, JobPolicy(job="j", generation=1, backup_interval_steps=7))
    assert schedule_only is not None and (schedule_only.bucket, schedule_only.prefix) == ("node-bucket", "n")
    assert effective_settings(BackupSettings(), JobPolicy(job="j", generation=1)) is None
    assert schedule_only.peers_hold_copies  # replicas: a rank's peers may upload it
    coded = effective_settings(node, JobPolicy(job="j", generation=1, erasure_data=2, erasure_parity=1))
    assert coded is not None and not coded.peers_hold_copies  # fragments: only the primary uploads


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        server.create_bucket(NODE_BUCKET)
        server.create_bucket(POLICY_BUCKET)
        yield server


@pytest.fixture
def replicator(tmp_path: Path, gcs: FakeGcsServer) -> Iterator[tuple[str, Path]]:
    """One replicator process backing up to ``NODE_BUCKET`` on demand only (its own flags)."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    root = tmp_path / "ramdisk"
    root.mkdir()
    api_port = free_port()
    exe = Path(sys.executable).with_name("tierckpt-replicator")
    args = [
        str(exe),
        "--node-name",
        "n0",
        "--root",
        str(root),
        "--auth",
        "token",
        "--token-file",
        str(token),
        "--listen-host",
        "127.0.0.1",
        "--advertise-host",
        "127.0.0.1",
        "--api-port",
        str(api_port),
        "--data-port",
        str(free_port()),
        "--probe-port",
        str(free_port()),
        "--gcs-bucket",
        NODE_BUCKET,
        "--gcs-endpoint",
        gcs.url,
        "--backup-interval",
        "0",
        "--backup-interval-steps",
        "0",
        "--backup-poll-interval",
        "1",
        "--poll-interval",
        "0.2",
        "--log-level",
        "INFO",
    ]
    log = tmp_path / "replicator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{api_port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with SyncReplicatorClient(timeout=1) as probe:
                if probe.ready(url):
                    break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield url, root
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(5)


def complete_steps(gcs: FakeGcsServer, bucket: str, prefix: str, job: str) -> list[int]:
    layout = BucketLayout(prefix)
    names = [b.name for b in gcs.client().list_blobs(bucket, prefix=layout.complete_dir(job))]
    return sorted(int(Path(n).stem) for n in names)


def keys(gcs: FakeGcsServer, bucket: str) -> list[str]:
    return [b.name for b in gcs.client().list_blobs(bucket)]


async def until(fn, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (got := await asyncio.to_thread(fn)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)
    return got


async def test_job_backs_up_to_its_policy_bucket_on_its_interval(replicator, gcs):
    url, root = replicator
    job = f"policy_{os.getpid()}"
    policy = JobPolicy(
        job=job,
        generation=1,
        bucket=POLICY_BUCKET,
        prefix="pol/team",
        backup_interval_steps=20,
        backup_interval_minutes=0,
        keep_last=2,
        config="fast",
    )
    async with ReplicatorClient(token=TokenFile(root.parent / "token"), timeout=10) as api:
        assert await api.put_policy(url, policy) == policy

        def done(expected: list[int]):
            return lambda: complete_steps(gcs, POLICY_BUCKET, "pol/team", job) == expected

        # 10: the first backup; 20: only 10 steps later (not due); 30: due; 40: not; 50: due.
        # Retention keeps the newest two. A wrongly backed-up 20 or 40 would show up (and stop 30/50).
        write_step(root, job, 0, 10, sizes=(8192, 300))
        await until(done([10]), "step 10 in the policy bucket")
        for step in (20, 30):
            write_step(root, job, 0, step, sizes=(8192, 300))
        await until(done([10, 30]), "step 30 in the policy bucket")
        for step in (40, 50):
            write_step(root, job, 0, step, sizes=(8192, 300))
        await until(done([30, 50]), "step 50 backed up and step 10 retired")
        assert keys(gcs, NODE_BUCKET) == []  # the node's own bucket is not used for this job
        assert all(k.startswith("pol/team/") for k in keys(gcs, POLICY_BUCKET))
        inv = await api.inventory(url, job)
        assert (
            inv is not None and inv.gcs == (30, 50) and inv.world_sizes[30] == 1
        )  # read back from the policy's bucket

        # step 60 is not due under the policy (10 steps after 50); the configuration is edited: a new
        # prefix and every 5 steps. The next backup goes there, and it is of the newest step (the poll
        # runs at once: a step written after the edit could find step 50 already backed up there).
        write_step(root, job, 0, 60, sizes=(8192, 300))
        edited = JobPolicy(
            job=job,
            generation=2,
            bucket=POLICY_BUCKET,
            prefix="pol/edited",
            backup_interval_steps=5,
            backup_interval_minutes=0,
            keep_last=2,
        )
        assert await api.put_policy(url, edited) == edited
        await until(lambda: complete_steps(gcs, POLICY_BUCKET, "pol/edited", job) == [60], "step 60 moved")
        assert complete_steps(gcs, POLICY_BUCKET, "pol/team", job) == [30, 50]  # old backups stay

        # the job is deleted with its backups: the policy's bucket loses them, nothing else does
        assert await api.purge(url, job, backups=True) == PurgeResult(job=job, purged=True, bucket=True)
        assert complete_steps(gcs, POLICY_BUCKET, "pol/edited", job) == []
        assert [k for k in keys(gcs, POLICY_BUCKET) if k.startswith("pol/edited/")] == []


async def test_a_purge_outlasts_every_backup_in_flight(replicator, gcs):
    """Many times over: steps are committed and every one is due, so backups run back to back; the
    commits stop and, at a random moment while the last backups are under way, the job is purged with
    its backups. Nothing of the job is left in the bucket when the purge returns, nor afterwards (no
    backup started during the purge, none in flight landed after it)."""
    url, root = replicator
    rng = random.Random(os.getpid())
    prefix = "stress"
    jobs = [f"stress_{os.getpid()}_{i}" for i in range(15)]

    def left(job: str) -> list[str]:
        layout = BucketLayout(prefix)
        return [b.name for b in gcs.client().list_blobs(POLICY_BUCKET, prefix=layout.job(job))]

    async with ReplicatorClient(token=TokenFile(root.parent / "token"), timeout=60) as api:
        for job in jobs:
            policy = JobPolicy(
                job=job,
                generation=1,
                bucket=POLICY_BUCKET,
                prefix=prefix,
                backup_interval_steps=1,
                backup_interval_minutes=0,
                keep_last=2,
            )
            assert await api.put_policy(url, policy) == policy
            step = 0
            deadline = time.monotonic() + rng.uniform(0.3, 0.8)
            while time.monotonic() < deadline:
                step += 1
                await asyncio.to_thread(write_step, root, job, 0, step, sizes=(1 << 20, 300))
                await asyncio.sleep(0.02)
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            assert await api.purge(url, job, backups=True) == PurgeResult(job=job, purged=True, bucket=True)
            assert left(job) == [], f"{job}: left in the bucket by a backup racing its purge"
        await asyncio.sleep(2.0)  # any upload still in flight would have landed by now
        assert {job: left(job) for job in jobs if left(job)} == {}
