"""Request budgets of the bucket protocol, on the scale rig (``tests/backup/scale_rig.py``): many
lightweight nodes (real ``BackupService``s, one per simulated node, many per process) back up a job's
steps and restore it, and every request is counted.

Per backup step, with F data files a rank, R ranks a node, N nodes (docs/benchmarks.md):

* every request but deletes: at most (F+5)*N*R + 24*N + N*ceil(N/1000);
* no node more than (F+5)*R + 40 + 2*ceil(N/1000) + 3*ceil(N*R/1000) (the node that completes the step
  lists its rank commits; every node lists the step's shares once);
* deletes (retention of the step before): at most (F+5)*N*R + 4*N;
* an idle poll: at most one request a node;
* a whole-job restore: at most (F+3)*N*R + 4*N, and the completion object asked for once a node.

At 128 ranks the rig runs against the real fake-gcs-server through google-cloud-storage, behind the
``FaultProxy``, and the proxy's count of requests must equal the rig's model of them, phase by phase; at
1,024 and 10,240 ranks it runs on the in-memory bucket with the same counting (the proxy, a thread and
two connections a request, would take minutes). 32,768 ranks against fake-gcs-server, and 102,400 in
memory: ``bench/bucket_scale_bench.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.backup.helpers import make_store
from tests.backup.scale_rig import CountingStore, Counts, MemoryBucket, Phase, ScaleRig, budget
from tests.fixtures.ramdisk import fresh_ramdisk_dir
from tierckpt_demo.fakegcs import FakeGcsServer, FaultProxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _check_backup(rig: ScaleRig, phase: Phase) -> None:
    limits = budget(rig)
    non_delete = phase.total - phase.by_kind["delete"]
    assert non_delete <= limits["total"], (phase.by_kind, phase.by_object)
    assert phase.node_max <= limits["node"], (phase.node_max_name, phase.node_max, phase.by_object)
    assert phase.by_kind["delete"] <= limits["deletes"], phase.by_object
    assert phase.node_deletes_max <= limits["node_deletes"], phase.by_object


async def _run(rig: ScaleRig, dest: Path | None) -> list[Phase]:
    """Two backed-up steps (the second retires the first), idle polls, and a whole-job restore into
    ``dest`` (None: none)."""
    rig.write_step(10)
    await rig.back_up(10)
    assert await rig.services[rig.names[-1]].complete_steps(rig.job) == (10,)
    rig.write_step(20)
    second = await rig.back_up(20)
    for name in (rig.names[0], rig.names[-1]):
        assert await rig.services[name].complete_steps(rig.job) == (20,)
    _check_backup(rig, second)
    idle = await rig.idle(2)
    assert max(idle.per_node.values()) <= 2 and idle.total <= 2 * rig.n, idle.by_object
    if dest is not None:
        restore = await rig.restore(20, dest)
        assert restore.total <= budget(rig)["restore"], restore.by_object
        assert restore.completion_stats_max == 1  # the completion object, asked for once a node
        assert rig.check_restored(20, dest) == rig.world
    return rig.phases


async def test_the_rigs_count_is_what_reaches_fake_gcs_server(
    gcs_server: FakeGcsServer, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """16 nodes x 8 ranks through google-cloud-storage and the proxy: the budgets hold, and the rig's
    model counts exactly the requests that reached the bucket, phase by phase (a listing of more than
    1,000 objects too: one request a page)."""
    store = make_store(proxy.url, bucket, pool_size=64)
    store.put_bytes("warm-up", b"")  # a client's first upload reads the bucket's metadata, once
    with fresh_ramdisk_dir(tmp_path, "scale") as base:  # the nodes' ramdisks: tmpfs
        rig = ScaleRig(
            base / "nodes",
            lambda node: store,
            nodes=16,
            ranks_per_node=8,
            concurrency=8,
            external=lambda: len(proxy.hits),
        )
        try:
            for phase in await _run(rig, base / "restored"):
                assert phase.external == phase.total, (phase.name, phase.external, phase.by_object)
        finally:
            await rig.close()
    counted = CountingStore(store, "lister", Counts())
    for i in range(1001):
        store.put_bytes(f"many/{i:04d}", b"x")
    before = len(proxy.hits)
    assert len(counted.list("many/")[0]) == 1001
    assert len(proxy.hits) - before == counted.counts.total() == 2


async def test_1024_ranks(tmp_path: Path) -> None:
    """128 nodes x 8 ranks on the counted in-memory bucket."""
    bucket = MemoryBucket()
    with fresh_ramdisk_dir(tmp_path, "scale") as base:  # the nodes' ramdisks: tmpfs
        rig = ScaleRig(base / "nodes", lambda node: bucket, nodes=128, ranks_per_node=8)
        try:
            await _run(rig, base / "restored")
        finally:
            await rig.close()


async def test_10240_ranks(tmp_path: Path) -> None:
    """1,280 nodes x 8 ranks on the counted in-memory bucket, backups only (restores at 128 and 1,024
    ranks here; 32,768 in bench/bucket_scale_bench.py)."""
    bucket = MemoryBucket()
    with fresh_ramdisk_dir(tmp_path, "scale") as base:  # the nodes' ramdisks: tmpfs
        rig = ScaleRig(base / "nodes", lambda node: bucket, nodes=1280, ranks_per_node=8)
        try:
            await _run(rig, None)
        finally:
            await rig.close()
