"""BackupService end to end against the real fake-gcs-server through the real google-cloud-storage
client: two "nodes" (ramdisk roots) back up a job's steps, spread the uploads, complete steps, keep
retention, survive faults, and restore ranks bit-exact into the client format."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.backup.helpers import KiB, make_service, make_store, saved_as, write_cluster_step, write_peers
from tests.fixtures.cluster import write_sparse_step
from tierckpt.protocol import leases
from tierckpt.protocol.bucket_layout import (
    INDEX_CHUNK_RANKS,
    LEGACY_COMPLETE_LIMIT,
    SMALL_OBJECT_LIMIT,
    BucketLayout,
    IndexChunk,
    ObjectTooLarge,
    RankBackup,
    RankRef,
    StepBackup,
    encode_small,
)
from tierckpt.protocol.control import JobPolicy, RestorePlan, Tier, write_control
from tierckpt.protocol.errors import CorruptShardError, MissingCheckpointError
from tierckpt.protocol.format import discard_step, rank_dir, read_manifest, replica_rank_dir, step_dir
from tierckpt_demo.chaos.tiers import BucketView
from tierckpt_demo.fakegcs import FakeGcsServer, FaultProxy, FaultRule
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.backup.fence import JobFenced
from tierckpt_replicator.backup.gcs import GcsStore, RetryPolicy
from tierckpt_replicator.backup.metrics import BackupMetrics
from tierckpt_replicator.backup.service import BackupService, _manifests
from tierckpt_replicator.backup.settings import BackupSettings
from tierckpt_replicator.backup.spread import assign_uploads
from tierckpt_replicator.backup.store import TransientStoreError, UploadCorrupted
from tierckpt_replicator.backup.uploader import StaleStepError
from tierckpt_replicator.inventory import InventoryScanner
from tierckpt_replicator.stepio import open_job

pytestmark = pytest.mark.e2e

JOB = "default_train_0123abcd"
LAYOUT = BucketLayout("t")


class SpyStore:
    """Records every write and delete (in order) on the way to the real store; optionally makes
    completion writers meet at a barrier so they race for real."""

    def __init__(self, inner: GcsStore, barrier: threading.Barrier | None = None) -> None:
        self.inner, self.barrier = inner, barrier
        self.ops: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _log(self, op: str, key: str) -> None:
        with self._lock:
            self.ops.append((op, key))

    def upload_file(self, key: str, fd: int, **kw: object):  # type: ignore[no-untyped-def]
        info = self.inner.upload_file(key, fd, **kw)  # type: ignore[arg-type]
        self._log("upload", key)
        return info

    def put_bytes(self, key: str, data: bytes, **kw: object):  # type: ignore[no-untyped-def]
        if self.barrier is not None and "/complete/" in key:
            self.barrier.wait(timeout=10)
        info = self.inner.put_bytes(key, data, **kw)  # type: ignore[arg-type]
        self._log("put", key)
        return info

    def delete(self, key: str) -> bool:
        self._log("delete", key)
        return self.inner.delete(key)

    def compose(self, key: str, sources):  # type: ignore[no-untyped-def]
        info = self.inner.compose(key, sources)
        self._log("compose", key)
        return info

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    out = {n: tmp_path / n for n in ("node-a", "node-b")}
    for p in out.values():
        p.mkdir()
    write_peers(out, JOB, 4)
    return out


async def _back_up_everywhere(services: dict[str, BackupService], roots: dict[str, Path], step: int) -> None:
    for node, svc in services.items():
        ranks = [r for r in range(4) if (r // 2) == sorted(roots).index(node)]
        await svc.on_step_committed(JOB, step, ranks, {})


# --------------------------------------------------------------------------------------------- happy path


async def test_step_backed_up_by_two_nodes_and_restored_bit_exact(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path], tmp_path: Path
) -> None:
    primaries = write_cluster_step(roots, JOB, 10, 4)
    services = {n: make_service(make_store(gcs_server.url, bucket), roots[n], n) for n in roots}
    await _back_up_everywhere(services, roots, 10)
    reader = make_service(make_store(gcs_server.url, bucket), tmp_path / "reader", "reader")
    assert await reader.complete_steps(JOB) == (10,)

    store = make_store(gcs_server.url, bucket)
    uploaders = [
        RankBackup.from_bytes(store.get_bytes(LAYOUT.rank_commit_key(JOB, 10, r), max_size=1 << 20))
        for r in range(4)
    ]
    per_node = {n: sum(c.uploaded_by == n for c in uploaders) for n in roots}
    assert per_node == {"node-a": 2, "node-b": 2}  # spread over both holders of every rank

    dest = tmp_path / "restored"
    for r in range(4):
        seen: list[int] = []
        await reader.fetch_rank(JOB, 10, r, rank_dir(dest, JOB, r), seen.append)
        got = step_dir(rank_dir(dest, JOB, r), 10)
        assert step_files(got) == step_files(primaries[r])  # data, manifest.json and COMMIT, byte for byte
        assert read_manifest(got).rank == r
        assert seen and seen == sorted(seen) and seen[-1] == read_manifest(got).total_bytes
    assert not list(dest.rglob(".incoming-*"))
    for svc in (*services.values(), reader):
        await svc.close()


async def test_only_due_steps_are_backed_up(gcs_server: FakeGcsServer, bucket: str, tmp_path: Path) -> None:
    root = tmp_path / "n"
    svc = make_service(
        make_store(gcs_server.url, bucket),
        root,
        "n",
        interval_steps=10,
        interval_seconds=0,
        keep_last=5,
    )
    for step in (10, 15, 19, 20, 25):
        write_step(root, JOB, 0, step, sizes=(1000,))
        await svc.on_step_committed(JOB, step, [0], {0: ["n"]})
    assert await svc.complete_steps(JOB) == (10, 20)
    assert svc.status(JOB).newest_complete == 20 and svc.status(JOB).last_uploaded == 20
    await svc.close()


async def test_poll_backs_up_a_due_step_with_no_commit_call(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """A step that was not due when it committed (a backup ran) is due at the next poll: by steps here."""
    root = tmp_path / "n"
    svc = make_service(make_store(gcs_server.url, bucket), root, "n", interval_steps=10, interval_seconds=0)
    write_step(root, JOB, 0, 10, sizes=(1000,))
    await svc.on_step_committed(JOB, 10, [0], {0: ["n"]})
    write_step(root, JOB, 0, 15, sizes=(1000,))
    await svc.poll(JOB)
    assert await svc.complete_steps(JOB) == (10,)  # 5 steps since the last backup: not due
    write_step(root, JOB, 0, 20, sizes=(1000,))  # committed, but nobody calls on_step_committed
    await svc.poll(JOB)
    assert await svc.complete_steps(JOB) == (10, 20)
    await svc.close()


async def test_sliced_upload_is_composed_and_verified(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    src = write_step(root, JOB, 0, 5, sizes=(1100 * KiB, 700 * KiB), files=2)
    spy = SpyStore(make_store(gcs_server.url, bucket))
    svc = make_service(spy, root, "n", slice_size=256 * KiB, range_size=200 * KiB, chunks=False)  # layout 2
    assert await svc.backup_now(JOB) == 5
    assert ("compose", LAYOUT.rank_file_key(JOB, 5, 0, "data-00000.bin", saved_as(src))) in spy.ops
    objects, _ = spy.inner.list(LAYOUT.rank_dir(JOB, 5, 0))
    assert not [o.name for o in objects if "/.parts/" in o.name]  # slices cleaned up
    await svc.fetch_rank(JOB, 5, 0, tmp_path / "out")
    assert step_files(step_dir(tmp_path / "out", 5)) == step_files(src)
    await svc.close()


# --------------------------------------------------------------------------------------------- completion


async def test_completion_is_written_last_and_only_once(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path]
) -> None:
    write_cluster_step(roots, JOB, 10, 4)
    barrier = threading.Barrier(2)
    spies = {n: SpyStore(make_store(gcs_server.url, bucket), barrier) for n in roots}
    services = {n: make_service(spies[n], roots[n], n, takeover_after=1e9) for n in roots}
    # Upload each node's share without completing, then let both nodes complete at the same moment.
    for svc in services.values():
        with open_job(svc.root, JOB) as tree, svc.fences.writing(JOB, 10):
            local = svc._local_copies(JOB, tree, 10, ())
            for r in svc._my_share(JOB, 10, 4, _manifests(local), None, False):
                svc.uploader.upload_rank(JOB, local[r][1])
    results: dict[str, bool] = {}

    def complete(node: str) -> None:
        with services[node].fences.writing(JOB, 10):
            results[node] = services[node].catalog.try_complete(JOB, 10, 4)

    threads = [threading.Thread(target=complete, args=(n,)) for n in roots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {"node-a": True, "node-b": True}  # the loser got 412 and counts it as success
    key = LAYOUT.complete_key(JOB, 10)
    store = make_store(gcs_server.url, bucket)
    done = StepBackup.from_bytes(store.get_bytes(key, max_size=1 << 20))
    winners = [n for n, spy in spies.items() if ("put", key) in spy.ops]
    assert winners == [done.completed_by]
    # Every object of the step was written before the completion object.
    objects, _ = store.list(LAYOUT.step_dir(JOB, 10))
    completion = store.stat(key)
    assert completion is not None and all(o.generation < completion.generation for o in objects)
    assert done.world_size == 4 and [(c.first, c.count) for c in done.index] == [(0, 4)]  # layout 2
    commits = services["node-a"].catalog.rank_commits(JOB, 10)
    for r in range(4):  # each rank's reference, from the index chunk, is its commit object as listed
        ref = services["node-a"].catalog.rank_ref(JOB, 10, r)
        assert (ref.size, ref.crc32c) == (commits[r].size, commits[r].crc32c)
    for svc in services.values():
        await svc.close()


async def test_a_node_joins_a_backup_started_elsewhere(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path]
) -> None:
    write_cluster_step(roots, JOB, 30, 4)
    services = {  # on demand only
        n: make_service(make_store(gcs_server.url, bucket), roots[n], n, interval_steps=0, interval_seconds=0)
        for n in roots
    }
    assert await services["node-a"].backup_now(JOB) == 30  # e.g. SIGTERM on node-a only
    assert await services["node-a"].complete_steps(JOB) == ()
    await services["node-b"].poll(JOB)  # node-b's periodic pass sees the started backup and joins it
    assert await services["node-b"].complete_steps(JOB) == (30,)
    for svc in services.values():
        await svc.close()


async def test_ranks_of_a_silent_holder_are_taken_over(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path]
) -> None:
    write_cluster_step(roots, JOB, 40, 4)
    svc = make_service(make_store(gcs_server.url, bucket), roots["node-a"], "node-a", takeover_after=0.0)
    await svc.on_step_committed(JOB, 40, [0, 1], {})  # node-b never runs
    await svc.poll(JOB)
    assert await svc.complete_steps(JOB) == (40,)
    await svc.close()


async def test_a_step_that_can_no_longer_complete_is_given_up_and_the_next_one_completes(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Node-b is the assigned uploader of one of node-a's ranks but holds no copy (the replica went to a
    fallback node), and node-a's retention removes the step before its takeover window ends: the
    step can never complete. The next due step is backed up at once, not ``stale_after`` later."""
    holders = {r: ("node-a", "node-b") if r < 2 else ("node-b", "node-a") for r in range(4)}  # peers.json
    stuck = next(
        s for s in range(10, 10_000, 10) if "node-b" in {assign_uploads(JOB, s, holders)[r] for r in (0, 1)}
    )
    for r in range(4):  # every rank on its primary only; node-a also holds node-b's replicas
        write_step(roots["node-a" if r < 2 else "node-b"], JOB, r, stuck, world_size=4, sizes=(8 * KiB,))
        if r >= 2:
            shutil.copytree(
                step_dir(rank_dir(roots["node-b"], JOB, r), stuck),
                step_dir(replica_rank_dir(roots["node-a"], JOB, r), stuck),
            )
    services = {
        n: make_service(
            make_store(gcs_server.url, bucket), roots[n], n, takeover_after=1.0, interval_steps=10
        )
        for n in roots
    }
    await _back_up_everywhere(services, roots, stuck)
    commits = make_store(gcs_server.url, bucket).list(LAYOUT.rank_commits_dir(JOB, stuck))[0]
    assert 0 < len(commits) < 4 and await services["node-a"].complete_steps(JOB) == ()
    shutil.rmtree(roots["node-a"] / JOB)  # node-a's retention: the step is gone from every node
    write_cluster_step(roots, JOB, stuck + 10, 4)
    time.sleep(1.0)  # the takeover window of the stuck step ends; stale_after (3600 s) is far off
    await _back_up_everywhere(services, roots, stuck + 10)
    assert await services["node-a"].complete_steps(JOB) == (stuck + 10,)
    assert f"giving up on step {stuck}" in caplog.text
    for svc in services.values():
        await svc.close()


# --------------------------------------------------------------------------------------------- failures


async def test_a_partial_upload_is_invisible_and_the_previous_backup_survives(
    gcs_server: FakeGcsServer, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    src10 = write_step(root, JOB, 0, 10, sizes=(300 * KiB,))
    fragile = make_store(proxy.url, bucket, retry=RetryPolicy(initial=0.01, maximum=0.02, deadline=0.3))
    svc = make_service(fragile, root, "n", interval_steps=10, interval_seconds=0, keep_last=1)
    assert await svc.backup_now(JOB) == 10
    write_step(root, JOB, 0, 20, sizes=(300 * KiB, 5 * KiB), files=2)
    proxy.add_rule(
        FaultRule(
            action="reset_midway",
            method="POST",
            path="uploadType=multipart",
            after_bytes=50 * KiB,
            skip=1,
            times=None,
        )
    )
    with pytest.raises(TransientStoreError):
        await svc.backup_now(JOB)
    assert proxy.hits_for("reset_midway")
    assert await svc.complete_steps(JOB) == (10,)  # keep_last=1, yet step 10 is still there
    direct = make_store(proxy.upstream_url, bucket)
    assert direct.stat(LAYOUT.rank_commit_key(JOB, 20, 0)) is None
    assert svc.status(JOB).last_error and "TransientStoreError" in svc.status(JOB).last_error
    await svc.fetch_rank(JOB, 10, 0, tmp_path / "out")
    assert step_files(step_dir(tmp_path / "out", 10)) == step_files(src10)
    # Once the bucket is healthy the same step completes, and only then does retention drop step 10.
    proxy.clear_rules()
    assert await svc.backup_now(JOB) == 20
    assert await svc.complete_steps(JOB) == (20,)
    await svc.close()


async def test_transient_errors_are_retried_with_backoff_and_the_backup_succeeds(
    bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    write_step(root, JOB, 0, 7, sizes=(9 << 20,))  # over 8 MiB: a resumable upload
    svc = make_service(make_store(proxy.url, bucket, read_timeout=1.0), root, "n", chunks=False)  # layout 2
    proxy.add_rule(FaultRule(action="status", status=503, method="POST", times=3))
    proxy.add_rule(FaultRule(action="status", status=500, method="PUT", skip=2, times=2))
    proxy.add_rule(FaultRule(action="reset_midway", method="PUT", after_bytes=10 * KiB, skip=5, times=1))
    proxy.add_rule(FaultRule(action="stall", seconds=10, method="GET", times=1))
    assert await svc.backup_now(JOB) == 7
    assert await svc.complete_steps(JOB) == (7,)
    fired = {h.action for h in proxy.hits}
    assert {"status", "reset_midway", "stall"} <= fired
    await svc.close()


async def test_closing_abandons_an_upload_the_bucket_does_not_answer_within_the_grace(
    bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """SIGTERM's shutdown after the preemption backup: an upload stuck on a bucket that does not answer
    (here: every request held for 30 s) does not hold the replicator; it is abandoned, and nothing of the
    step is complete in the bucket."""
    root = tmp_path / "n"
    write_step(root, JOB, 0, 7, sizes=(64 * KiB,))
    svc = make_service(make_store(proxy.url, bucket, read_timeout=30.0), root, "n")
    proxy.add_rule(FaultRule(action="stall", seconds=30, times=None))
    backing_up = asyncio.create_task(svc.backup_now(JOB))
    deadline = time.monotonic() + 10
    while not proxy.hits_for("stall") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert proxy.hits_for("stall"), "the upload reached the bucket"
    start = time.monotonic()
    await svc.close(grace=0.5)
    assert time.monotonic() - start < 5, "the shutdown waited for the stuck upload"
    backing_up.cancel()
    proxy.clear_rules()
    reader = make_service(make_store(proxy.upstream_url, bucket), tmp_path / "reader", "reader")
    assert await reader.complete_steps(JOB) == ()
    await reader.close()


async def test_a_purge_does_not_wait_for_an_upload_the_bucket_does_not_answer(
    bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A node cut off from the bucket while it uploads a step, then the job is purged: the fence its purge
    puts up waited for the backup pass, whose bucket calls retried for minutes, and the purge with it (the
    chaos soak, seed 1727629969, round 7: 15 minutes, the round's liveness bound). It waits ``grace``, then
    goes on: the pass writes nothing more (the job is fenced here) and what it has in flight lands under
    a writer lease that the purge takes away, so nothing of the step is complete."""
    root = tmp_path / "n"
    write_step(root, JOB, 0, 7, sizes=(64 * KiB,))
    svc = make_service(make_store(proxy.url, bucket, read_timeout=30.0), root, "n")
    proxy.add_rule(FaultRule(action="stall", seconds=8, times=None))
    backing_up = asyncio.create_task(svc.backup_now(JOB))
    deadline = time.monotonic() + 10
    while not proxy.hits_for("stall") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert proxy.hits_for("stall"), "the upload reached the bucket"
    start = time.monotonic()
    await svc.fence(JOB, grace=0.5)
    assert time.monotonic() - start < 5, "the purge's fence waited for the stuck upload"
    proxy.clear_rules()
    with pytest.raises((JobFenced, TransientStoreError)):  # it gave up, or was fenced at its next write
        await backing_up
    reader = make_service(make_store(proxy.upstream_url, bucket), tmp_path / "reader", "reader")
    assert await reader.complete_steps(JOB) == ()
    for s in (svc, reader):
        await s.close()


def test_a_replicator_exits_though_threads_it_abandoned_still_run(tmp_path: Path) -> None:
    """The process exits at once (status 0, a log line) instead of the interpreter waiting for them."""
    script = textwrap.dedent(
        """
        import logging, threading, time
        from tierckpt_replicator.__main__ import _exit_past_stuck_threads
        logging.basicConfig(level=logging.INFO)
        threading.Thread(target=time.sleep, args=(60,), name="backup-io_0").start()
        _exit_past_stuck_threads()
        """
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and time.monotonic() - start < 20
    assert "exiting with 1 thread(s) still at work (backup-io_0): abandoned" in done.stderr


async def test_a_dead_bucket_fails_cleanly_and_keeps_the_previous_backup(
    bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    write_step(root, JOB, 0, 10, sizes=(10 * KiB,))
    metrics = BackupMetrics(CollectorRegistry())
    store = make_store(proxy.url, bucket, retry=RetryPolicy(initial=0.01, maximum=0.02, deadline=0.3))
    svc = make_service(store, root, "n", metrics=metrics, interval_steps=1, keep_last=1)
    await svc.on_step_committed(JOB, 10, [0], {})
    write_step(root, JOB, 0, 11, sizes=(10 * KiB,))
    proxy.add_rule(FaultRule(action="status", status=503, method="POST", times=None))
    await svc.on_step_committed(JOB, 11, [0], {})  # never raises: logged and counted
    assert metrics.failures.labels(op="upload")._value.get() >= 1
    with pytest.raises(TransientStoreError):
        await svc.backup_now(JOB)
    proxy.clear_rules()
    assert await svc.complete_steps(JOB) == (10,)
    await svc.close()


async def test_a_killed_uploader_leaves_no_visible_step_and_a_rerun_finishes_it(
    gcs_server: FakeGcsServer, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    for r in range(4):
        write_step(root, JOB, r, 50, world_size=4, sizes=(100 * KiB,), files=1)
    proxy.add_rule(
        # the writer lease, started.json and catalog.json go through, then one data file, then a stall
        FaultRule(action="stall", seconds=60, method="POST", path="uploadType=multipart", skip=4, times=None)
    )
    script = textwrap.dedent(f"""
        import asyncio
        from pathlib import Path
        from prometheus_client import CollectorRegistry
        from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore
        from tierckpt_replicator.backup.metrics import BackupMetrics
        from tierckpt_replicator.backup.service import BackupService
        from tierckpt_replicator.backup.settings import BackupSettings
        store = GcsStore(GcsSettings(bucket={bucket!r}, endpoint={proxy.url!r}))
        settings = BackupSettings(prefix="t", parallelism=1, chunks=False)
        svc = BackupService(settings, node="n", root=Path({str(root)!r}),
                            store=store, metrics=BackupMetrics(CollectorRegistry()))
        asyncio.run(svc.backup_now({JOB!r}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not proxy.hits_for("stall") and time.monotonic() < deadline and proc.poll() is None:
            await asyncio.sleep(0.05)
        assert proxy.hits_for("stall"), proc.communicate(timeout=5)[0] if proc.poll() is not None else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proxy.clear_rules()
    spy = SpyStore(make_store(gcs_server.url, bucket))
    svc = make_service(spy, root, "n", chunks=False)  # layout 2: whole data objects resumed
    assert await svc.complete_steps(JOB) == ()
    before, _ = spy.inner.list(LAYOUT.step_dir(JOB, 50))
    assert [o for o in before if o.name.endswith(".bin")]  # some data objects made it before the kill
    assert await svc.backup_now(JOB) == 50
    assert await svc.complete_steps(JOB) == (50,)
    uploads = [k for op, k in spy.ops if op == "upload"]
    assert len(uploads) < 4  # data objects already in the bucket were not uploaded again
    await svc.close()


async def test_a_corrupt_object_in_the_bucket_is_detected_and_nothing_is_committed(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    src = write_step(root, JOB, 0, 3, sizes=(64 * KiB,))
    svc = make_service(make_store(gcs_server.url, bucket), root, "n", chunks=False)  # chunks: test_chunks.py
    assert await svc.backup_now(JOB) == 3
    key = LAYOUT.rank_file_key(JOB, 3, 0, "data-00000.bin", saved_as(src))
    raw = gcs_server.client().bucket(bucket).blob(key)
    data = bytearray(raw.download_as_bytes())
    data[1234] ^= 0xFF
    raw.upload_from_string(bytes(data))  # same size, one flipped byte
    dest = tmp_path / "out"
    with pytest.raises(CorruptShardError):
        await svc.fetch_rank(JOB, 3, 0, dest)
    assert not step_dir(dest, 3).exists() and not list(dest.glob(".incoming-*"))
    with pytest.raises(MissingCheckpointError):
        await svc.fetch_rank(JOB, 99, 0, dest)
    await svc.close()


async def test_a_rotted_local_shard_is_never_committed_to_the_bucket(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    src = write_step(root, JOB, 0, 4, sizes=(64 * KiB,))
    with open(src / "data-00000.bin", "r+b") as f:  # flip a byte: always a change (a written constant
        f.seek(100)  # equals the random byte there once in 256 runs)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0xFF]))
    svc = make_service(make_store(gcs_server.url, bucket), root, "n", chunks=False)  # chunks: test_chunks.py
    with pytest.raises(UploadCorrupted):
        await svc.backup_now(JOB)
    store = make_store(gcs_server.url, bucket)
    assert (
        store.stat(LAYOUT.rank_file_key(JOB, 4, 0, "data-00000.bin", saved_as(src))) is None
    )  # deleted again
    assert store.stat(LAYOUT.rank_commit_key(JOB, 4, 0)) is None
    assert await svc.complete_steps(JOB) == ()
    await svc.close()


async def test_a_newer_save_of_the_same_step_replaces_an_incomplete_older_one(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    for r in range(2):
        write_step(old_root, JOB, r, 60, world_size=2, sizes=(8 * KiB,), seed=1)
    svc_old = make_service(make_store(gcs_server.url, bucket), old_root, "n")
    with svc_old.fences.writing(JOB, 60):  # a dead attempt's rank 0
        svc_old.uploader.upload_rank(JOB, step_dir(rank_dir(old_root, JOB, 0), 60))
    time.sleep(0.01)
    new = {r: write_step(new_root, JOB, r, 60, world_size=2, sizes=(8 * KiB,), seed=2) for r in range(2)}
    svc = make_service(make_store(gcs_server.url, bucket), new_root, "n")
    assert await svc.backup_now(JOB) == 60
    await svc.fetch_rank(JOB, 60, 0, tmp_path / "out")
    assert step_files(step_dir(tmp_path / "out", 60)) == step_files(new[0])
    # The old attempt can no longer overwrite it.
    with pytest.raises(StaleStepError, match="already complete"), svc_old.fences.writing(JOB, 60):
        svc_old.uploader.upload_rank(JOB, step_dir(rank_dir(old_root, JOB, 1), 60))
    for s in (svc_old, svc):
        await s.close()


class HeldStore(SpyStore):
    """Holds this store's writes of checkpoint objects (not leases) until ``go`` is set (``held`` is set
    when the first waits)."""

    def __init__(self, inner: GcsStore) -> None:
        super().__init__(inner)
        self.held, self.go = threading.Event(), threading.Event()

    def _hold(self, key: str) -> None:
        if "/writers/" in key:
            return
        self.held.set()
        assert self.go.wait(timeout=30)

    def upload_file(self, key: str, fd: int, **kw: object):  # type: ignore[no-untyped-def]
        self._hold(key)
        return super().upload_file(key, fd, **kw)

    def put_bytes(self, key: str, data: bytes, **kw: object):  # type: ignore[no-untyped-def]
        self._hold(key)
        return super().put_bytes(key, data, **kw)


@pytest.mark.parametrize("chunks", [True, False], ids=["chunks", "whole-files"])
async def test_an_older_saves_upload_never_writes_into_the_step_a_newer_save_completed(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path, chunks: bool
) -> None:
    """A node backing up an earlier save of step 60 (its preemption backup) read the bucket before the
    newer save of step 60 completed there, and wrote its rank's objects after: its rank commit was
    refused, but the COMMIT, manifest, chunk list and data objects it had written over the newer save's
    stayed, and the complete step was torn (found by the chaos soak, seed 85416069, rounds 60-61).
    Every object a save writes is its own, so the complete step reads back exactly as it was."""
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    old = write_step(old_root, JOB, 0, 60, world_size=2, sizes=(8 * KiB, 3 * KiB), seed=1)
    time.sleep(0.01)
    new = {
        r: write_step(new_root, JOB, r, 60, world_size=2, sizes=(8 * KiB, 3 * KiB), seed=2) for r in range(2)
    }
    assert step_files(old) != step_files(new[0])
    held = HeldStore(make_store(gcs_server.url, bucket))
    svc_old = make_service(held, old_root, "old", chunks=chunks)

    def upload_old() -> None:
        with svc_old.fences.writing(JOB, 60):
            svc_old.uploader.upload_rank(JOB, step_dir(rank_dir(old_root, JOB, 0), 60))

    late = asyncio.get_running_loop().run_in_executor(None, upload_old)
    assert await asyncio.to_thread(held.held.wait, 30)  # it listed the rank's objects: none yet
    svc = make_service(make_store(gcs_server.url, bucket), new_root, "new", chunks=chunks)
    assert await svc.backup_now(JOB) == 60
    held.go.set()
    with pytest.raises(StaleStepError):
        await late
    reader = make_service(make_store(gcs_server.url, bucket), tmp_path / "reader", "reader", chunks=chunks)
    assert await reader.complete_steps(JOB) == (60,)
    for r in range(2):
        await reader.fetch_rank(JOB, 60, r, tmp_path / f"out-{r}")
        assert step_files(step_dir(tmp_path / f"out-{r}", 60)) == step_files(new[r])
    for s in (svc_old, svc, reader):
        await s.close()


class CompletesBeforeDelete(SpyStore):
    """Runs ``complete()`` (another node completing the step) just before this store deletes a rank
    commit: after the replacing upload checked that the step was not complete, before it replaced the
    commit."""

    def __init__(self, inner: GcsStore, complete: Callable[[], object]) -> None:
        super().__init__(inner)
        self.complete, self.outcome = complete, None

    def delete(self, key: str) -> bool:
        if "/ranks/" in key and self.outcome is None:
            self.outcome = self.complete()
        return super().delete(key)


async def test_a_step_completed_while_a_newer_save_replaced_one_of_its_rank_commits_is_withdrawn(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """Step 3 was saved twice; both ranks of the earlier save were in the bucket, and a node replaced rank
    1's with the newer save's. Another node completed the step from the earlier commits (and checked them
    again) just after the replacing node saw the step incomplete, and before it deleted the old commit:
    the completion's index named a rank commit that no longer existed (found by the chaos soak, seed
    790299293, round 6: `rank commit of its data rank 1: 379 bytes, the chain says 378`). The replacing
    node now looks again once its commit is in: a completion whose index names another commit for its
    rank is withdrawn, so no complete step is ever torn, and the step completes again from the commits
    that are there."""
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    for r in range(2):
        write_step(old_root, JOB, r, 3, world_size=2, sizes=(8 * KiB,), seed=1)
    svc_old = make_service(make_store(gcs_server.url, bucket), old_root, "old")
    with svc_old.fences.writing(JOB, 3):
        for r in range(2):
            svc_old.uploader.upload_rank(JOB, step_dir(rank_dir(old_root, JOB, r), 3))
    time.sleep(0.01)
    write_step(new_root, JOB, 1, 3, world_size=2, sizes=(8 * KiB,), seed=2)

    def complete_on_the_old_node() -> object:
        with svc_old.fences.writing(JOB, 3):
            return svc_old.catalog.complete(JOB, 3, 2)

    store = CompletesBeforeDelete(make_store(gcs_server.url, bucket), complete_on_the_old_node)
    svc_new = make_service(store, new_root, "new")
    with svc_new.fences.writing(JOB, 3):
        svc_new.uploader.upload_rank(JOB, step_dir(rank_dir(new_root, JOB, 1), 3))
    assert store.outcome == "written"  # the race happened: the step was complete before the replacement
    view = BucketView(gcs_server.client().bucket(bucket), prefix="t")
    assert view.torn(JOB) == []
    reader = make_service(make_store(gcs_server.url, bucket), tmp_path / "reader", "reader")
    assert await reader.complete_steps(JOB) == ()  # withdrawn; the new commits complete it again
    with svc_new.fences.writing(JOB, 3):
        assert svc_new.catalog.complete(JOB, 3, 2) == "written"
    assert view.torn(JOB) == []
    for r in range(2):
        await reader.fetch_rank(JOB, 3, r, tmp_path / f"out-{r}")
    for s in (svc_old, svc_new, reader):
        await s.close()


async def test_a_step_saved_again_by_fewer_ranks_completes_without_the_earlier_saves_extra_ranks(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """Step 60 was saved by 3 ranks and rank 2 of it reached the bucket; the job went back to an older
    step, shrank to 2 ranks (a DCP job reshards) and saved step 60 again. Ranks 0 and 1 replace their
    earlier uploads, but nothing replaces rank 2: every completion saw 3 commits of two world sizes and
    refused the step, forever, and no later step was due before it (found by the chaos harness's soak:
    the bucket held step 12 while the job had trained to 30)."""
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    write_step(old_root, JOB, 2, 60, world_size=3, sizes=(8 * KiB,), seed=1)
    svc_old = make_service(make_store(gcs_server.url, bucket), old_root, "n")
    with svc_old.fences.writing(JOB, 60):  # the abandoned run's rank 2
        svc_old.uploader.upload_rank(JOB, step_dir(rank_dir(old_root, JOB, 2), 60))
    time.sleep(0.01)
    new = {r: write_step(new_root, JOB, r, 60, world_size=2, sizes=(8 * KiB,), seed=2) for r in range(2)}
    svc = make_service(make_store(gcs_server.url, bucket), new_root, "n")
    assert await svc.backup_now(JOB) == 60
    assert await svc.complete_steps(JOB) == (60,)
    for r in range(2):
        await svc.fetch_rank(JOB, 60, r, tmp_path / f"out-{r}")
        assert step_files(step_dir(tmp_path / f"out-{r}", 60)) == step_files(new[r])
    for s in (svc_old, svc):
        await s.close()


async def test_a_node_whose_job_resharded_backs_up_the_steps_of_the_ranks_it_runs_now(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """The node ran rank 1 of 3 up to step 9; the job shrank to 2 ranks and the node runs rank 0 now,
    saving steps 9 to 15. Its rank 1 directory stays (nothing retires it), and the node's newest step
    was the newest common to both: 9, already complete, so it backed up nothing newer (the soak's
    healed check: the bucket at step 9 while the job had trained to 15)."""
    root = tmp_path / "node"
    for step in (6, 9):
        write_step(root, JOB, 1, step, world_size=3, sizes=(8 * KiB,), seed=step)
    time.sleep(0.01)
    for step in (9, 12, 15):
        write_step(root, JOB, 0, step, world_size=2, sizes=(8 * KiB,), seed=100 + step)
    svc = make_service(make_store(gcs_server.url, bucket), root, "n")
    assert await svc.backup_now(JOB) == 15
    scanner = InventoryScanner(root, node="n", endpoint="https://n:8470")
    assert scanner.holdings(JOB).newest_common() == 15  # what the replicator tells the service
    await svc.close()


def _spy_leases(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record (holder, step) of every lease the services take on local steps."""
    taken: list[tuple[str, int]] = []
    hold_all = leases.hold_all

    def spy(ranks: Mapping[int, Any], step: int, holder: str, *, ttl: float) -> Any:
        taken.append((holder, step))
        return hold_all(ranks, step, holder, ttl=ttl)

    monkeypatch.setattr(leases, "hold_all", spy)
    return taken


def _save_again(root: Path, rank: int, step: int, world_size: int, seed: int) -> Path:
    """The trainer saves ``step`` of ``rank`` anew (replacing the save the run its job left made)."""
    time.sleep(0.01)
    discard_step(step_dir(rank_dir(root, JOB, rank), step))
    return write_step(root, JOB, rank, step, world_size=world_size, sizes=(8 * KiB,), seed=seed)


async def test_a_job_that_went_back_never_backs_up_nor_leases_a_step_the_run_it_left_saved(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node holds steps 5 and 8 of rank 0; the job went back to step 5 (the restore plan this node
    staged was decided after step 8 was committed), so training saves step 8 again. Step 8 is not the
    node's newest step (``Holdings.left``, as the inventory counts it): neither a poll nor an on-demand
    backup (SIGTERM) uploads it, which would put the run the job left in the bucket as step 8 and lease
    its files while the trainer saves step 8 again (its save fails: "leased ... not overwriting"). The
    new save of step 8 is backed up."""
    root = tmp_path / "node"
    for step in (5, 8):  # the run the job left
        write_step(root, JOB, 0, step, sizes=(8 * KiB,), seed=step)
    time.sleep(0.01)
    plans = {JOB: RestorePlan(JOB, 5, 1, {0: Tier.LOCAL}, decided_at=time.time())}
    taken = _spy_leases(monkeypatch)
    svc = make_service(make_store(gcs_server.url, bucket), root, "n", plan_of=plans.get, interval_steps=1)
    await svc.poll(JOB)
    assert await svc.backup_now(JOB) == 5
    assert await svc.complete_steps(JOB) == (5,)
    assert [s for _, s in taken] == [5], "a step of the run the job left was leased"
    new = _save_again(root, 0, 8, 1, seed=80)
    await svc.poll(JOB)
    assert await svc.complete_steps(JOB) == (5, 8)
    await svc.fetch_rank(JOB, 8, 0, tmp_path / "out")
    assert step_files(step_dir(tmp_path / "out", 8)) == step_files(new)
    await svc.close()


async def test_a_backup_in_progress_is_never_joined_with_a_save_of_the_run_the_job_left(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks 0 (node-a) and 1 (node-b) of 2 went back from step 8 to step 5. node-b's trainer saved
    step 8 anew and began its backup; node-a's has not yet. node-a's poll joins backups in progress:
    its rank 0 of the old step 8 must not go into this one (a step 8 of two runs, complete in the
    bucket: a torn checkpoint), nor be leased; its new save of step 8 completes it."""
    roots = {n: tmp_path / n for n in ("node-a", "node-b")}
    for rank, node in enumerate(sorted(roots)):
        for step in (5, 8):  # the run the job left
            write_step(roots[node], JOB, rank, step, world_size=2, sizes=(8 * KiB,), seed=10 * step + rank)
    time.sleep(0.01)
    plans = {JOB: RestorePlan(JOB, 5, 2, {0: Tier.LOCAL, 1: Tier.LOCAL}, decided_at=time.time())}
    taken = _spy_leases(monkeypatch)
    a, b = (
        make_service(make_store(gcs_server.url, bucket), roots[n], n, plan_of=plans.get, interval_steps=1)
        for n in sorted(roots)
    )
    await a.on_step_committed(JOB, 5, [0], {})
    await b.on_step_committed(JOB, 5, [1], {})
    assert await a.complete_steps(JOB) == (5,)
    new = {1: _save_again(roots["node-b"], 1, 8, 2, seed=801)}
    await b.on_step_committed(JOB, 8, [1], {})
    await a.poll(JOB)
    assert await a.complete_steps(JOB) == (5,), "step 8 completed with a rank of the run the job left"
    assert ("backup.node-a", 8) not in taken, "a step of the run the job left was leased"
    new[0] = _save_again(roots["node-a"], 0, 8, 2, seed=800)
    await a.on_step_committed(JOB, 8, [0], {})
    assert await a.complete_steps(JOB) == (5, 8)
    for rank in (0, 1):
        await a.fetch_rank(JOB, 8, rank, tmp_path / f"out-{rank}")
        assert step_files(step_dir(tmp_path / f"out-{rank}", 8)) == step_files(new[rank])
    for svc in (a, b):
        await svc.close()


async def test_a_rank_committed_by_the_save_a_job_went_back_from_is_uploaded_again_from_the_new_save(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """A 4-rank DCP job saved step 72; this node uploaded its rank 1 and another node rank 3, and the
    step waited for ranks 0 and 2. The job went back to step 63, shrank to 3 ranks and saved 72 again:
    the node's new rank 1 counted as committed (the node remembered committing rank 1, and the bucket
    held a rank 1 commit, the earlier save's), so no node uploaded it or rank 2 (whose holders gave up
    the step: "this node holds none of its missing ranks"), and every completion refused the step
    ("rank commits disagree on the world size"; soak, seed 1512564371, round 40: the bucket held 63
    while the job had saved 72). A rank counts as committed only with the manifest of this node's copy."""
    root, other_root, gone_root = tmp_path / "node", tmp_path / "other", tmp_path / "gone"
    write_step(root, JOB, 1, 72, world_size=4, sizes=(8 * KiB,), seed=1)
    write_step(gone_root, JOB, 3, 72, world_size=4, sizes=(8 * KiB,), seed=1)
    svc = make_service(make_store(gcs_server.url, bucket), root, "n")
    gone = make_service(make_store(gcs_server.url, bucket), gone_root, "g")
    assert await svc.backup_now(JOB) == 72  # the earlier save's rank 1: started, never complete
    with gone.fences.writing(JOB, 72):
        gone.uploader.upload_rank(JOB, step_dir(rank_dir(gone_root, JOB, 3), 72))
    assert await svc.complete_steps(JOB) == ()
    time.sleep(0.01)
    shutil.rmtree(step_dir(rank_dir(root, JOB, 1), 72))  # the client's save of 72 replaces it
    new = {1: write_step(root, JOB, 1, 72, world_size=3, sizes=(8 * KiB,), seed=2)}
    for r in (0, 2):
        new[r] = write_step(other_root, JOB, r, 72, world_size=3, sizes=(8 * KiB,), seed=2)
    other = make_service(make_store(gcs_server.url, bucket), other_root, "o")
    await svc.poll(JOB)  # joins the step in progress with the new save's rank 1
    assert await other.backup_now(JOB) == 72
    assert await other.complete_steps(JOB) == (72,)
    for r in range(3):
        await other.fetch_rank(JOB, 72, r, tmp_path / f"out-{r}")
        assert step_files(step_dir(tmp_path / f"out-{r}", 72)) == step_files(new[r])
    for s in (svc, gone, other):
        await s.close()


async def test_a_newer_save_with_more_ranks_is_not_completed_as_the_older_one(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """The other way round: ranks 0 and 1 of a 2-rank save, then rank 2 of a newer 3-rank save of the
    step. The older save's ranks do not complete the step without the newer one's rank."""
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    for r in range(2):
        write_step(old_root, JOB, r, 60, world_size=2, sizes=(8 * KiB,), seed=1)
    time.sleep(0.01)
    write_step(new_root, JOB, 2, 60, world_size=3, sizes=(8 * KiB,), seed=2)
    store = make_store(gcs_server.url, bucket)
    svc_new = make_service(store, new_root, "m")
    with svc_new.fences.writing(JOB, 60):
        svc_new.uploader.upload_rank(JOB, step_dir(rank_dir(new_root, JOB, 2), 60))
    svc_old = make_service(make_store(gcs_server.url, bucket), old_root, "n")
    with svc_old.fences.writing(JOB, 60):
        for r in range(2):
            svc_old.uploader.upload_rank(JOB, step_dir(rank_dir(old_root, JOB, r), 60))
    assert svc_old.catalog.complete(JOB, 60, 2) == "refused"
    assert await svc_old.complete_steps(JOB) == ()
    for s in (svc_old, svc_new):
        await s.close()


# --------------------------------------------------------------------------------------------- retention


async def test_retention_keeps_the_last_n_and_every_kth_deleting_completion_objects_first(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    spy = SpyStore(make_store(gcs_server.url, bucket))
    svc = make_service(spy, root, "n", interval_steps=10, interval_seconds=0, keep_last=2, keep_every=30)
    for step in range(10, 90, 10):
        write_step(root, JOB, 0, step, sizes=(2 * KiB,))
        await svc.on_step_committed(JOB, step, [0], {})
    assert await svc.complete_steps(JOB) == (10, 30, 60, 70, 80)  # windows 0-29, 30-59, 60-89; last two
    store = spy.inner
    for gone in (20, 40, 50):
        assert store.list(LAYOUT.step_dir(JOB, gone))[0] == []
        deletes = [k for op, k in spy.ops if op == "delete" and f"/{gone:012d}" in k and "/writers/" not in k]
        assert deletes[0] == LAYOUT.complete_key(
            JOB, gone
        )  # the step stops existing before anything else goes
        assert len(deletes) > 3
    await svc.close()


async def test_a_completion_object_this_version_cannot_read_is_never_collected(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """E.g. written by a newer tierckpt during a rolling upgrade: not trusted, but not garbage either."""
    root = tmp_path / "n"
    store = make_store(gcs_server.url, bucket)
    svc = make_service(store, root, "n", interval_steps=10, interval_seconds=0, keep_last=5)
    for step in (10, 20):
        write_step(root, JOB, 0, step, sizes=(KiB,))
        await svc.on_step_committed(JOB, step, [0], {})
    store.put_bytes(LAYOUT.complete_key(JOB, 10), b'{"kind":"tierckpt.backup.step","version":99}')
    write_step(root, JOB, 0, 30, sizes=(KiB,))
    await svc.on_step_committed(JOB, 30, [0], {})
    assert await svc.complete_steps(JOB) == (20, 30)
    assert store.list(LAYOUT.rank_dir(JOB, 10, 0))[0]  # step 10's objects are all still there
    await svc.close()


async def test_a_fenced_job_is_not_backed_up_and_delete_backups_empties_the_job(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    write_step(root, JOB, 0, 1, sizes=(KiB,))
    write_step(root, "other", 0, 1, sizes=(KiB,))
    svc = make_service(make_store(gcs_server.url, bucket), root, "n")
    assert await svc.backup_now(JOB) == 1 and await svc.backup_now("other") == 1
    await svc.fence(JOB)
    assert await svc.complete_steps(JOB) == (1,)  # the bucket keeps backups when a node fences a job
    write_step(root, JOB, 0, 2, sizes=(KiB,))
    with pytest.raises(JobFenced):
        await svc.backup_now(JOB)
    await svc.on_step_committed(JOB, 2, [0], {})
    await svc.poll(JOB)
    assert await svc.complete_steps(JOB) == (1,)
    await svc.delete_backups(JOB)
    assert await svc.complete_steps(JOB) == ()
    assert make_store(gcs_server.url, bucket).list(LAYOUT.job(JOB))[0] == []
    assert await svc.complete_steps("other") == (1,)
    await svc.close()


# --------------------------------------------------------------------------------------------- wiring


async def test_built_from_its_settings_on_their_bucket(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    settings = BackupSettings(bucket=bucket, prefix="t", endpoint=gcs_server.url, interval_seconds=0.0)
    write_step(tmp_path / "n", JOB, 0, 2, sizes=(KiB,))
    svc = BackupService.for_bucket(
        settings, node="n", root=tmp_path / "n", metrics=BackupMetrics(CollectorRegistry())
    )
    assert await svc.backup_now(JOB) == 2
    assert await svc.complete_steps(JOB) == (2,)
    assert await svc.complete_world_sizes(JOB) == {2: 1}
    assert make_store(gcs_server.url, bucket).stat(LAYOUT.complete_key(JOB, 2)) is not None  # prefix "t"
    with pytest.raises(ValueError):
        BackupService.for_bucket(BackupSettings(), node="n", root=tmp_path)  # no bucket
    with pytest.raises(ValueError):
        BackupSettings(bucket=bucket, parallelism=0)
    await svc.close()


async def test_built_by_the_replicator_daemon_from_its_own_settings(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    from tierckpt_replicator.backup.jobs import node_backup_settings
    from tierckpt_replicator.settings import Settings

    settings = Settings(
        node_name="n",
        root=tmp_path / "n",
        gcs_bucket=bucket,
        gcs_prefix="t",
        gcs_endpoint=gcs_server.url,
        backup_interval_steps=5,
        backup_keep_last=1,
    )
    cfg = node_backup_settings(settings)
    assert (cfg.bucket, cfg.prefix, cfg.endpoint) == (bucket, "t", gcs_server.url)
    assert (cfg.interval_steps, cfg.keep_last, cfg.project) == (5, 1, None)
    svc = BackupService.for_bucket(
        cfg, node="n", root=settings.root, metrics=BackupMetrics(CollectorRegistry())
    )
    for step in (5, 10):
        write_step(settings.root, JOB, 0, step, sizes=(KiB,))
        await svc.on_step_committed(JOB, step, [0], {0: ("n",)})
    assert await svc.complete_steps(JOB) == (10,)
    await svc.close()


async def test_a_node_about_to_disappear_uploads_everything_it_holds(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path]
) -> None:
    write_cluster_step(roots, JOB, 70, 4)
    svc = make_service(make_store(gcs_server.url, bucket), roots["node-a"], "node-a")
    assert await svc.backup_now(JOB, all_local=True) == 70  # node-a holds every rank (primary or replica)
    assert await svc.complete_steps(JOB) == (70,)
    await svc.close()


@pytest.mark.root
async def test_restore_into_a_full_ramdisk_fails_cleanly(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    from tierckpt.protocol.errors import RamdiskFullError

    root = tmp_path / "n"
    write_step(root, JOB, 0, 8, sizes=(512 * KiB,))
    svc = make_service(make_store(gcs_server.url, bucket), root, "n")
    assert await svc.backup_now(JOB) == 8
    small = tmpfs("128k")
    with pytest.raises(RamdiskFullError):
        await svc.fetch_rank(JOB, 8, 0, small / "rank")
    assert not [p for p in (small / "rank").rglob("*") if p.is_file()]
    await svc.close()


def test_no_event_loop_is_blocked_by_uploads(gcs_server: FakeGcsServer, bucket: str, tmp_path: Path) -> None:
    """The loop keeps ticking while a backup runs (all bucket I/O is in worker threads)."""
    root = tmp_path / "n"
    write_step(root, JOB, 0, 9, sizes=(9 << 20,))
    svc = make_service(make_store(gcs_server.url, bucket), root, "n")

    async def main() -> int:
        ticks = 0
        task = asyncio.create_task(svc.backup_now(JOB))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.001)
        await task
        await svc.close()
        return ticks

    assert asyncio.run(main()) > 5
    assert os.path.exists(step_dir(rank_dir(root, JOB, 0), 9))


async def test_a_rank_over_its_jobs_quota_uploads_nothing_and_holds_no_later_backup_back(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """Rank 0's step 2 is a 48 MiB hole in a job whose quota is 8 MiB: node a uploads nothing of it and
    marks the step refused, so node b's share of it stays a partial step nobody waits for, and step 3
    (which a started step 2 would hold back for ``stale_after``) is backed up at once."""
    roots = {n: tmp_path / n for n in ("a", "b")}
    services = {}
    for node, root in roots.items():
        root.mkdir()
        write_control(root, JOB, JobPolicy.FILE, JobPolicy(job=JOB, generation=1, quota_bytes=8 << 20))
        services[node] = make_service(
            make_store(gcs_server.url, bucket), root, node, interval_steps=1, interval_seconds=0
        )

    async def save(step: int, *, sparse: bool = False) -> None:
        for rank, node in ((1, "b"), (0, "a")):  # b first: it starts the step's backup
            if sparse and rank == 0:
                write_sparse_step(roots[node], JOB, rank, step, declared=48 << 20, world_size=2)
            else:
                write_step(roots[node], JOB, rank, step, world_size=2, sizes=(1000,))
            await services[node].on_step_committed(JOB, step, [rank], {rank: [node]})

    await save(1)
    await save(2, sparse=True)
    store = make_store(gcs_server.url, bucket)
    assert not store.list(LAYOUT.rank_dir(JOB, 2, 0))[0]
    assert not store.list(LAYOUT.rank_commit_key(JOB, 2, 0))[0]
    assert store.stat(LAYOUT.refused_key(JOB, 2)) is not None
    assert (
        "rank 0 step 2 declares 48.0Mi, over the job's quota of 8.0Mi" in services["a"].status(JOB).last_error
    )
    await save(3)
    assert await services["a"].complete_steps(JOB) == (1, 3)
    for svc in services.values():
        await svc.close()


# --------------------------------------------------------------------------------------------- size bound


async def test_a_layout_1_completion_object_of_32768_ranks_stays_readable(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """An older version wrote completion objects that list every rank (about 112 bytes each, 3.7 MB at
    32,768 ranks) and readers refused anything over 1 MiB: that job's backups were stuck. Such an
    object is read (up to LEGACY_COMPLETE_LIMIT) and its step restores."""
    root = tmp_path / "n"
    src = {r: write_step(root, JOB, r, 10, world_size=2, sizes=(8 * KiB,), seed=r) for r in range(2)}
    svc = make_service(make_store(gcs_server.url, bucket), root, "n")
    assert await svc.backup_now(JOB) == 10
    store = make_store(gcs_server.url, bucket)
    refs = {r: svc.catalog.rank_ref(JOB, 10, r) for r in range(2)}
    legacy = StepBackup(job=JOB, step=10, world_size=2, completed_by="old", completed_at=1.0, ranks=refs)
    body = legacy.to_dict() | {"version": 1, "padding": "x" * (3_700_000)}  # what 32,768 ranks weigh
    store.delete(LAYOUT.complete_key(JOB, 10))
    store.put_bytes(LAYOUT.complete_key(JOB, 10), json.dumps(body).encode())
    reader = make_service(make_store(gcs_server.url, bucket), tmp_path / "r", "reader")
    assert await reader.complete_steps(JOB) == (10,)
    for r in range(2):
        await reader.fetch_rank(JOB, 10, r, tmp_path / "out" / str(r))
        assert step_files(step_dir(tmp_path / "out" / str(r), 10)) == step_files(src[r])
    for s in (svc, reader):
        await s.close()


async def test_an_unreadable_completion_object_stops_no_backup_retention_or_restore(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """A completion object over every reader's bound (or corrupt) is skipped and logged: the other steps
    are listed and restored, new steps are backed up, and retention goes on around it."""
    root = tmp_path / "n"
    svc = make_service(make_store(gcs_server.url, bucket), root, "n", keep_last=2)
    for step in (10, 20):
        write_step(root, JOB, 0, step, sizes=(KiB,))
        await svc.on_step_committed(JOB, step, [0], {})
    store = make_store(gcs_server.url, bucket)
    store.put_bytes(LAYOUT.complete_key(JOB, 20), b"{" + b" " * (LEGACY_COMPLETE_LIMIT + 1) + b"}")
    assert await svc.complete_steps(JOB) == (10,)
    await svc.fetch_rank(JOB, 10, 0, tmp_path / "out")
    for step in (30, 40):  # backed up, and retention still runs (keep_last=2 of the readable ones)
        write_step(root, JOB, 0, step, sizes=(KiB,))
        await svc.on_step_committed(JOB, step, [0], {})
    assert await svc.complete_steps(JOB) == (30, 40)
    assert store.stat(LAYOUT.complete_key(JOB, 20)) is not None  # unreadable: never taken for garbage
    await svc.close()


def test_every_small_object_is_bounded_when_written_and_a_completion_fits_a_million_ranks() -> None:
    chunks = tuple(
        IndexChunk(first=f, count=min(INDEX_CHUNK_RANKS, 1_048_576 - f), size=46_000, crc32c=4_000_000_000)
        for f in range(0, 1_048_576, INDEX_CHUNK_RANKS)
    )
    done = StepBackup(
        job=JOB,
        step=10**11,
        world_size=1_048_576,
        completed_by="n" * 60,
        completed_at=time.time(),
        index_writer="n" * 60 + ".0123abcd",
        index=chunks,
        data_bytes=10**15,
    )
    assert len(encode_small(done, "completion")) <= SMALL_OBJECT_LIMIT  # 1,048,576 ranks: about 80 KB
    ref = RankRef(size=400, crc32c=4_000_000_000, manifest_crc32c=4_000_000_000, total_bytes=10**11)
    inline = StepBackup(
        job=JOB,
        step=1,
        world_size=10_000,
        completed_by="n",
        completed_at=1.0,
        ranks=dict.fromkeys(range(10_000), ref),
    )
    with pytest.raises(ObjectTooLarge, match="over the 1048576 bytes every reader"):
        encode_small(inline, "a layout 1 completion object of 10,000 ranks")


async def test_retention_is_applied_by_another_node_when_the_completer_of_the_newest_step_never_does(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """Found by the chaos harness (four complete steps for a ``keep_last`` of 3, minutes after a
    preemption): two nodes completed steps at once, the one completing the newer step from a view
    without the other's (its retention dropped nothing), and it then left for good; the janitor was only
    ever the completer of the newest step, so nobody applied retention again. Here that completer's
    retention is made to keep one step too many by its ``keep_last``."""
    now = [1000.0]
    a_root, b_root = tmp_path / "a", tmp_path / "b"
    store = make_store(gcs_server.url, bucket)
    a = make_service(store, a_root, "node-a", takeover_after=30.0, clock=lambda: now[0])
    for step in (10, 20, 30):
        write_step(a_root, JOB, 0, step, sizes=(KiB,))
        await a.on_step_committed(JOB, step, [0], {})
    b = make_service(store, b_root, "node-b", keep_last=4)
    write_step(b_root, JOB, 0, 40, sizes=(KiB,))
    await b.on_step_committed(JOB, 40, [0], {})
    await b.close()  # ... and is gone
    assert await a.complete_steps(JOB) == (10, 20, 30, 40)
    await a.poll(JOB)  # overdue only after a grace: the completer may still be about to do it
    assert await a.complete_steps(JOB) == (10, 20, 30, 40)
    now[0] += 61.0
    await a.poll(JOB)
    assert await a.complete_steps(JOB) == (20, 30, 40)
    await a.poll(JOB)  # every node deletes its own ranks of a step retired since its last view
    assert [o.name for o in store.list(LAYOUT.step_dir(JOB, 10))[0]] == []
    await a.close()
