"""Purging a job's backups while another node is uploading them, end to end: three real nodes (network
namespaces on a bridge, a tmpfs each, real replicator processes) and fake-gcs-server. One node's
uploads crawl (its outgoing link shaped to 1 MB/s); another node purges the job with its backups while
that upload is in flight. Nothing of the job is left in the bucket: not when the purge returns, not
after the slow upload finished, not after the other nodes are purged too (as the operator does)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from tests.fixtures.cluster import cluster3, commit_everywhere, committed, new_job, replica_path, wait
from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt.protocol.control import PurgeResult
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

__all__ = ["cluster3"]  # the module-scoped fixture, re-exported for pytest

LAYOUT = BucketLayout("tierckpt")


def test_a_purge_leaves_nothing_of_an_upload_in_flight_on_another_node(cluster3):
    a, b, c = cluster3.nodes
    job = new_job("purge")
    cluster3.assign(job)
    commit_everywhere(cluster3, job, 10, size=3 << 20)
    for r in range(3):
        wait(
            cluster3,
            lambda r=r: any(committed(replica_path(n, job, r, 10)) for n in cluster3.nodes),
            30,
            f"a replica of rank {r}",
        )
    store = GcsStore(GcsSettings(bucket=cluster3.bucket, endpoint=cluster3.gcs.url))

    def objects() -> list[str]:
        return [o.name for o in store.list(LAYOUT.job(job))[0]]

    def rank_commits() -> int:
        return len(store.list(LAYOUT.rank_commits_dir(job, 10))[0])

    def back_up(node) -> None:  # type: ignore[no-untyped-def]
        with contextlib.suppress(Exception):  # node-c's is stopped by the purge: its answer does not matter
            cluster3.api.backup(node.endpoint, job, timeout=90)

    c.limit_rate("8mbit", outgoing=True)  # node-c's uploads crawl: one rank of 3 MiB takes seconds
    try:
        threads = [threading.Thread(target=back_up, args=(n,)) for n in cluster3.nodes]
        for t in threads:
            t.start()
        wait(cluster3, lambda: rank_commits() == 2, 30, "node-a's and node-b's shares in the bucket")
        assert f"backing up step 10 of {job}" in c.log_text()
        assert store.stat(LAYOUT.complete_key(job, 10)) is None  # node-c's share is still on its way
        purged = cluster3.api.purge(a.endpoint, job, backups=True, timeout=120, node=a.name)
        assert purged == PurgeResult(job=job, purged=True, bucket=True)
        assert objects() == []
        for t in threads:
            t.join(120)
    finally:
        c.unlimit_rate(outgoing=True)
    time.sleep(5)  # past node-c's upload and two of its backup polls
    assert objects() == []
    for node in (b, c):  # the operator purges every node
        assert cluster3.api.purge(node.endpoint, job, node=node.name) is not None
    assert objects() == []
