"""Purging a job's backups while another node is still writing them, against the real fake-gcs-server:
the purge fences the job in the bucket, waits for the writers it finds, sweeps again, and nothing of
the job is left, whether the other node's upload finishes, or lands after its writer lease lapsed.
The other node's store is wrapped to hold its uploads in flight at the ``ObjectStore`` boundary."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.backup.helpers import make_service, make_store, write_cluster_step, write_peers
from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt_demo.fakegcs import FakeGcsServer
from tierckpt_replicator.backup.fence import JobFenced
from tierckpt_replicator.backup.gcs import GcsStore
from tierckpt_replicator.backup.store import ObjectInfo, TransientStoreError

pytestmark = pytest.mark.e2e

JOB = "default_purge_0123abcd"
LAYOUT = BucketLayout("t")


class HeldStore:
    """A node's store whose file and chunk uploads wait for ``release`` (set by the test) before they
    reach the bucket: an upload in flight for as long as the test wants. ``in_flight`` is set when the
    first one waits. With ``renewals_fail``, rewriting a writer lease fails like a bucket that stopped
    answering."""

    def __init__(self, inner: GcsStore, *, renewals_fail: bool = False) -> None:
        self.inner, self.renewals_fail = inner, renewals_fail
        self.in_flight, self.release = threading.Event(), threading.Event()

    def upload_file(self, key: str, fd: int, **kw: Any) -> ObjectInfo:
        self.in_flight.set()
        assert self.release.wait(60)
        return self.inner.upload_file(key, fd, **kw)

    def put_bytes(self, key: str, data: bytes, **kw: Any) -> ObjectInfo:
        if "/chunks/" in key:  # a chunk of a data file (layout 3): an upload like upload_file's
            self.in_flight.set()
            assert self.release.wait(60)
        if self.renewals_fail and "/writers/" in key and kw.get("if_generation") is not None:
            raise TransientStoreError(f"{key}: 503 (the test's bucket stopped answering)")
        return self.inner.put_bytes(key, data, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def leftovers(store: GcsStore) -> list[str]:
    return [o.name for o in store.list(LAYOUT.job(JOB))[0]]


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    out = {n: tmp_path / n for n in ("node-a", "node-b")}
    write_peers(out, JOB, 4)
    write_cluster_step(out, JOB, 10, 4)
    return out


async def test_a_purge_leaves_nothing_of_an_upload_in_flight_on_another_node(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path]
) -> None:
    store = make_store(gcs_server.url, bucket)
    held = HeldStore(make_store(gcs_server.url, bucket))
    a = make_service(store, roots["node-a"], "node-a")
    b = make_service(held, roots["node-b"], "node-b")
    await a.on_step_committed(JOB, 10, [0, 1], {})
    uploading = asyncio.ensure_future(b.on_step_committed(JOB, 10, [2, 3], {}))
    assert await asyncio.to_thread(held.in_flight.wait, 10)
    purge = asyncio.ensure_future(a.delete_backups(JOB))
    await asyncio.sleep(0.5)  # the purge has swept the bucket once
    held.release.set()  # node-b's uploads land after that, and it goes on writing
    await purge
    assert leftovers(store) == []
    await uploading
    assert leftovers(store) == []
    assert b.fences.fenced(JOB)  # node-b saw the purge: it backs the job up no more
    await b.poll(JOB)
    assert leftovers(store) == []
    for svc in (a, b):
        await svc.close()


async def test_a_write_that_returns_after_its_writer_lease_lapsed_is_deleted_again(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Node-b cannot renew its lease (its bucket stops answering those requests) and its uploads hang:
    the purge takes node-b's writer for gone after ``writer_ttl`` and finishes; the held uploads then
    land, after the purge, and node-b deletes them again."""
    store = make_store(gcs_server.url, bucket)
    held = HeldStore(make_store(gcs_server.url, bucket), renewals_fail=True)
    a = make_service(store, roots["node-a"], "node-a", writer_ttl=4.0)
    b = make_service(held, roots["node-b"], "node-b", writer_ttl=4.0)
    uploading = asyncio.ensure_future(b.on_step_committed(JOB, 10, [2, 3], {}))
    assert await asyncio.to_thread(held.in_flight.wait, 10)
    await a.delete_backups(JOB)
    assert leftovers(store) == []
    held.release.set()
    await uploading
    assert leftovers(store) == []
    assert "returned after its writer lease lapsed" in caplog.text
    for svc in (a, b):
        await svc.close()


async def test_a_lapsed_lease_with_no_purge_keeps_what_landed_and_stops_writing(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path]
) -> None:
    """No purge: a writer whose lease lapsed keeps an object that landed late (another node may have
    uploaded and committed the same object) but starts no further write, and reports the failure."""
    store = make_store(gcs_server.url, bucket)
    held = HeldStore(make_store(gcs_server.url, bucket), renewals_fail=True)
    b = make_service(held, roots["node-b"], "node-b", writer_ttl=4.0)
    uploading = asyncio.ensure_future(b.on_step_committed(JOB, 10, [2, 3], {}))
    assert await asyncio.to_thread(held.in_flight.wait, 10)
    await asyncio.sleep(2.5)  # past the lease's validity (half its ttl: its renewals all fail)
    held.release.set()
    await uploading
    landed = [k for k in leftovers(store) if "/rank-" in k or "/chunks/" in k]
    assert landed and all(  # data (whole files or chunks), no COMMIT after
        "/data-" in k or "/chunks/" in k or k.endswith("objects.pkl") for k in landed
    )
    assert store.list(LAYOUT.rank_commits_dir(JOB, 10))[0] == []
    assert "lapsed" in b.status(JOB).last_error
    await b.close()


async def test_a_backup_request_queued_behind_a_purge_puts_nothing_in_the_bucket(
    gcs_server: FakeGcsServer, bucket: str, roots: dict[str, Path]
) -> None:
    """Found by the chaos soak: an on-demand backup that waited for its turn while the purge ran got it
    once the purge was over (its fence lifted), and put the job back in the bucket. It is refused."""
    store = make_store(gcs_server.url, bucket)
    held = HeldStore(make_store(gcs_server.url, bucket))
    a = make_service(held, roots["node-a"], "node-a")
    b = make_service(store, roots["node-b"], "node-b")
    uploading = asyncio.ensure_future(a.on_step_committed(JOB, 10, [0, 1], {}))
    assert await asyncio.to_thread(held.in_flight.wait, 10)

    async def purge() -> None:  # as the daemon's purge: the backups deleted, then the fence lifted
        await b.delete_backups(JOB)  # waits for node-a's writer
        b.unfence(JOB)

    purging = asyncio.ensure_future(purge())
    await asyncio.sleep(0.5)
    assert b.fences.fenced(JOB) and not purging.done()
    queued = asyncio.ensure_future(b.backup_now(JOB))  # its turn comes after the purge's
    await asyncio.sleep(0.2)
    held.release.set()
    await purging
    await uploading
    (outcome,) = await asyncio.gather(queued, return_exceptions=True)
    assert leftovers(store) == []
    assert isinstance(outcome, JobFenced)
    for svc in (a, b):
        await svc.close()
