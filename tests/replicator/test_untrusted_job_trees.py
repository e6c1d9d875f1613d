"""A training pod writes anything into its job directory: nothing it plants there makes the replicator
read, send, upload or delete another job's data (issue 10, defect 2).

Job A's pod links into job B on the same node, three ways: a rank directory (``A/rank-00001 ->
B/rank-00000``), a step directory (``A/rank-00001/step-50 -> B/.../step-50``) and a data file of a step
whose COMMIT and manifest are A's own. For each: A's inventory does not list B's steps, a push of A
sends no byte of B, the data endpoint serves no byte of B (and keeps serving), A's backup uploads no
byte of B, and purging A leaves B intact. Every part here is the real one (real sockets, a real data
server, fake-gcs-server); the replicator's own end to end (control API, logs) is in
``test_cluster_e2e.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backup.helpers import make_service, make_store
from tierckpt.protocol.format import committed_steps, rank_dir, step_dir
from tierckpt_demo.fakegcs import FakeGcsServer
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.controls import remove_job_tree
from tierckpt_replicator.inventory import InventoryScanner
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.data_server import DataServer
from tierckpt_replicator.replication.ipc import PeerAddress, WorkerConfig
from tierckpt_replicator.replication.transfer import push_step
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, recv_frame, send_frame
from tierckpt_replicator.settings import TransferSettings

pytestmark = pytest.mark.e2e

A, B = "ns_tenant_aaaaaaaa", "ns_victim_bbbbbbbb"
STEP = 50
TOKEN = "t0ken-for-tests"
KINDS = ("rank", "step", "file")


@dataclasses.dataclass
class Planted:
    root: Path
    kind: str
    victim: dict[str, bytes]
    """B's step files, name -> bytes, as they were before anything ran."""

    def secret(self) -> bytes:
        return self.victim["data-00000.bin"]

    def victim_intact(self) -> bool:
        path = step_dir(rank_dir(self.root, B, 0), STEP)
        return committed_steps(rank_dir(self.root, B, 0)) == [STEP] and step_files(path) == self.victim


def plant(root: Path, kind: str) -> Planted:
    """Job B's rank 0 with a secret; job A's own rank 0; and A's "rank 1" leading into B."""
    victim = write_step(root, B, 0, STEP, sizes=(300_000,), seed=7)
    write_step(root, A, 0, STEP, world_size=2, sizes=(100_000,), seed=1)
    a1 = rank_dir(root, A, 1)
    if kind == "rank":
        a1.symlink_to(rank_dir(root, B, 0))
    elif kind == "step":
        a1.mkdir()
        step_dir(a1, STEP).symlink_to(victim)
    else:  # A's own COMMIT and manifest (forged with the sizes and checksums of B's bytes: the worst
        # case), naming a data file that is a link to B's
        own = write_step(root, A, 1, STEP, world_size=2, sizes=(300_000,), seed=7)
        (own / "data-00000.bin").unlink()
        (own / "data-00000.bin").symlink_to(victim / "data-00000.bin")
    return Planted(root, kind, step_files(victim))


@pytest.fixture(params=KINDS)
def planted(request: pytest.FixtureRequest, tmp_path: Path) -> Planted:
    root = tmp_path / "ramdisk"
    root.mkdir()
    (tmp_path / "token").write_text(TOKEN + "\n")
    return plant(root, str(request.param))


def context(planted: Planted) -> DataContext:
    cfg = WorkerConfig(
        node="node-a",
        root=str(planted.root),
        auth="token",  # the legacy bearer token: these tests are about job trees, not identity
        token_file=str(planted.root.parent / "token"),
        listen_host="127.0.0.1",
        data_port=0,
        holder="replicator-node-a",
        transfer=TransferSettings(transfer_timeout=5.0),
    )
    return DataContext.from_config(cfg, emit=lambda event: None)


class Recorder:
    """A peer's data port that answers every put with "continue" and records every byte it receives."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(5)
                try:
                    req = recv_frame(conn, DataRequest)
                    self.received += conn.recv(req.commit_size + req.manifest_size, socket.MSG_WAITALL)
                    send_frame(conn, DataReply(status=Status.CONTINUE))
                    while chunk := conn.recv(1 << 16):
                        self.received += chunk
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.close()


def test_inventory_lists_none_of_the_other_jobs_steps(planted: Planted) -> None:
    holdings = InventoryScanner(planted.root, node="node-a", endpoint="").holdings(A)
    assert holdings.ranks[0].local == (STEP,)
    if planted.kind != "file":  # a data file is not read by the scan; A's own COMMIT is A's
        assert 1 not in holdings.ranks or holdings.ranks[1].local == ()
    assert planted.victim_intact()


def test_a_push_sends_no_byte_of_the_other_job(planted: Planted, recorder: Recorder) -> None:
    out = push_step(context(planted), A, 1, STEP, PeerAddress("peer", "127.0.0.1", recorder.port))
    assert out.status in ("failed", "missing"), out
    recorder.close()
    assert planted.secret()[:4096] not in bytes(recorder.received)
    assert recorder.connections == 0, "refused before connecting: not even A's header went out"
    assert planted.victim_intact()


def _get(port: int, job: str, rank: int, step: int) -> tuple[DataReply, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        send_frame(sock, DataRequest(op="get", token=TOKEN, job=job, rank=rank, step=step, node="x"))
        reply = recv_frame(sock, DataReply)
        rest = bytearray()
        while chunk := sock.recv(1 << 16):
            rest += chunk
    return reply, bytes(rest)


def test_the_data_endpoint_serves_no_byte_of_the_other_job_and_keeps_serving(planted: Planted) -> None:
    server = DataServer(context(planted))
    server.start()
    try:
        reply, body = _get(server.port, A, 1, STEP)
        assert reply.status in (Status.NOT_FOUND, Status.CORRUPT), reply
        assert planted.secret()[:4096] not in body
        reply, body = _get(server.port, A, 0, STEP)  # the node still serves A's own step
        assert (
            reply.status == Status.OK
            and len(body) == reply.commit_size + reply.manifest_size + reply.total_bytes
        )
    finally:
        server.stop()
    assert planted.victim_intact()


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        yield server


def test_a_backup_uploads_no_byte_of_the_other_job(planted: Planted, gcs: FakeGcsServer) -> None:
    bucket = f"untrusted-{planted.kind}-{os.getpid()}"
    gcs.create_bucket(bucket)
    store = make_store(gcs.url, bucket)
    svc = make_service(store, planted.root, "node-a")

    async def backup() -> None:
        try:
            await svc.backup_now(A, all_local=True)
        except Exception:  # the refused rank fails its upload; what matters is what reached the bucket
            pass
        finally:
            await svc.close()

    asyncio.run(backup())
    objects = store.list("")[0]
    if planted.kind != "step":  # (with no committed step in its rank 1, A has no step to back up)
        assert objects, "A's own rank was backed up"
    for obj in objects:
        assert planted.secret()[:4096] not in store.get_bytes(obj.name, max_size=1 << 24), obj.name
    assert planted.victim_intact()


def test_purging_the_job_leaves_the_other_job_intact(planted: Planted) -> None:
    remove_job_tree(planted.root, A)
    assert not os.path.lexists(planted.root / A)
    assert planted.victim_intact()
    shutil.rmtree(planted.root / B)
