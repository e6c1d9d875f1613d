"""The streaming data endpoint over real loopback sockets: bit-exact copies, and every bad input
refused before it can leave a torn or wrong step behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.cluster import write_sparse_step
from tierckpt.protocol import leases
from tierckpt.protocol.format import committed_steps, job_dir, rank_dir, replica_rank_dir, step_dir
from tierckpt.protocol.tokens import TokenFile
from tierckpt.snapshot.pool import SlotPool
from tierckpt.snapshot.rankdir import make_room
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.controls import remove_job_tree
from tierckpt_replicator.replication import transfer
from tierckpt_replicator.replication.context import DataContext, connect
from tierckpt_replicator.replication.data_server import DataServer
from tierckpt_replicator.replication.erasure import encode_step
from tierckpt_replicator.replication.ipc import FetchSource, PeerAddress, SendTask, WorkerConfig
from tierckpt_replicator.replication.manager import NODE_FAULTS
from tierckpt_replicator.replication.transfer import fetch_step, push_step
from tierckpt_replicator.replication.wire import (
    DataReply,
    DataRequest,
    ProtocolError,
    Status,
    recv_frame,
    send_frame,
)
from tierckpt_replicator.replication.worker import run_send
from tierckpt_replicator.settings import TransferSettings
from tierckpt_replicator.stepio import INCOMING_PREFIX

pytestmark = pytest.mark.e2e

TOKEN = "t0ken-for-tests"
JOB = "ns_job_0123abcd"


@dataclasses.dataclass
class Peer:
    ctx: DataContext
    server: DataServer
    events: list

    @property
    def root(self) -> Path:
        return self.ctx.root

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.ctx.config.node, "127.0.0.1", self.server.port)

    def source(self) -> FetchSource:
        return FetchSource(kind="peer", node=self.ctx.config.node, host="127.0.0.1", port=self.server.port)


@pytest.fixture
def make_peer(tmp_path: Path) -> Iterator:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    servers: list[DataServer] = []

    def make(name: str, root: Path | None = None, **overrides) -> Peer:
        """A peer whose ramdisk is ``tmp_path/name``, or ``root`` (a tmpfs of its own, say)."""
        if root is None:
            root = tmp_path / name
            root.mkdir()
        cfg = WorkerConfig(
            node=name,
            root=str(root),
            auth="token",
            token_file=str(token),
            listen_host="127.0.0.1",
            data_port=0,
            holder=f"replicator-{name}",
            transfer=TransferSettings(**{"transfer_timeout": 5.0, **overrides}),
        )
        events: list = []
        ctx = DataContext.from_config(cfg, emit=events.append)
        server = DataServer(ctx)
        server.start()
        servers.append(server)
        return Peer(ctx, server, events)

    yield make
    for s in servers:
        s.stop()


def no_leftovers(root: Path) -> bool:
    return not [p for p in root.rglob("*") if p.name.startswith(INCOMING_PREFIX)]


def replica(peer: Peer, rank: int, step: int) -> Path:
    return step_dir(replica_rank_dir(peer.root, JOB, rank), step)


@pytest.mark.parametrize("method", ["sendfile", "mmap"])
def test_put_is_bit_exact_and_idempotent(make_peer, method):
    a, b = make_peer("a", send_method=method), make_peer("b")
    src = write_step(a.root, JOB, 3, 100, sizes=(3 << 20, 17, 5 << 20), files=2)
    out = push_step(a.ctx, JOB, 3, 100, b.address)
    assert out.status == "ok" and out.bytes == sum(p.stat().st_size for p in src.glob("data-*"))
    assert step_files(replica(b, 3, 100)) == step_files(src)  # COMMIT and manifest byte for byte too
    assert push_step(a.ctx, JOB, 3, 100, b.address).status == "already"
    assert [e.status for e in b.events] == [200]
    assert not list((rank_dir(a.root, JOB, 3) / "leases").glob("*.json"))  # the sender's lease is gone


def test_get_stages_a_committed_primary(make_peer):
    a, b = make_peer("a"), make_peer("b")
    src = write_step(a.root, JOB, 0, 7, sizes=(9 << 20,))
    assert push_step(a.ctx, JOB, 0, 7, b.address).status == "ok"
    c = make_peer("c")
    progress: list[tuple[int, int]] = []
    out = fetch_step(c.ctx, JOB, 0, 7, b.source(), lambda d, t: progress.append((d, t)))
    assert out.status == "ok"
    staged = step_dir(rank_dir(c.root, JOB, 0), 7)
    assert step_files(staged) == step_files(src)
    assert progress[-1] == (9 << 20, 9 << 20)
    assert fetch_step(c.ctx, JOB, 0, 7, b.source(), lambda d, t: None).status == "already"


def test_local_replica_copy(make_peer):
    a, b = make_peer("a"), make_peer("b")
    src = write_step(a.root, JOB, 1, 5, sizes=(1 << 20, 333))
    push_step(a.ctx, JOB, 1, 5, b.address)
    out = fetch_step(b.ctx, JOB, 1, 5, FetchSource(kind="replica", node="b"), lambda d, t: None)
    assert out.status == "ok"
    assert step_files(step_dir(rank_dir(b.root, JOB, 1), 5)) == step_files(src)


def test_corrupt_source_is_never_committed(make_peer):
    a, b = make_peer("a"), make_peer("b")
    src = write_step(a.root, JOB, 0, 1, sizes=(4 << 20,))
    data = src / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[12345] ^= 0x01
    data.write_bytes(raw)  # bit rot after commit
    out = push_step(a.ctx, JOB, 0, 1, b.address)
    assert out.status == "corrupt"
    assert committed_steps(replica_rank_dir(b.root, JOB, 0)) == []
    assert no_leftovers(b.root)


def test_corrupt_replica_is_detected_reported_and_dropped(make_peer):
    a, b, c = make_peer("a"), make_peer("b"), make_peer("c")
    write_step(a.root, JOB, 2, 9, sizes=(2 << 20,))
    push_step(a.ctx, JOB, 2, 9, b.address)
    f = replica(b, 2, 9) / "data-00000.bin"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(raw)
    out = fetch_step(c.ctx, JOB, 2, 9, b.source(), lambda d, t: None)
    assert out.status == "corrupt"
    assert committed_steps(rank_dir(c.root, JOB, 2)) == [] and no_leftovers(c.root)
    assert not replica(b, 2, 9).exists()  # the holder re-verified its copy and dropped it
    assert any(e.op == "corrupt" and "dropped" in e.message for e in b.events)


def test_wrong_or_missing_token_is_refused(make_peer, tmp_path):
    a, b = make_peer("a"), make_peer("b")
    write_step(a.root, JOB, 0, 1, sizes=(1024,))
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    a.ctx.tokens = TokenFile(wrong)
    assert push_step(a.ctx, JOB, 0, 1, b.address).status == "unauthorized"
    with socket.create_connection(("127.0.0.1", b.server.port), timeout=5) as s:
        send_frame(s, DataRequest(op="get", token="", job=JOB, rank=0, step=1))
        assert recv_frame(s, DataReply).status == Status.UNAUTHORIZED
    assert not (b.root / JOB).exists()


def raw_request(peer: Peer, data: bytes) -> DataReply | None:
    with socket.create_connection(("127.0.0.1", peer.server.port), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        try:
            return recv_frame(s, DataReply)
        except Exception:
            return None


def frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!4sI", b"TKR1", len(body)) + body


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", Status.BAD_REQUEST),  # not our protocol
        (struct.pack("!4sI", b"TKR1", 1 << 30), Status.TOO_LARGE),  # absurd frame size
        (frame({"kind": "tierckpt.data-request", "version": 1, "op": "get"}), Status.BAD_REQUEST),
        (
            frame(
                {
                    "kind": "tierckpt.data-request",
                    "version": 1,
                    "op": "rm",
                    "token": TOKEN,
                    "job": JOB,
                    "rank": 0,
                    "step": 0,
                }
            ),
            Status.BAD_REQUEST,
        ),
        (
            frame(
                {
                    "kind": "tierckpt.data-request",
                    "version": 1,
                    "op": "get",
                    "token": TOKEN,
                    "job": "../../etc",
                    "rank": 0,
                    "step": 0,
                }
            ),
            Status.BAD_REQUEST,
        ),
        (
            frame(
                {
                    "kind": "tierckpt.data-request",
                    "version": 1,
                    "op": "get",
                    "token": TOKEN,
                    "job": JOB,
                    "rank": -1,
                    "step": 0,
                }
            ),
            Status.BAD_REQUEST,
        ),
        (
            frame(
                {
                    "kind": "tierckpt.data-request",
                    "version": 1,
                    "op": "put",
                    "token": TOKEN,
                    "job": JOB,
                    "rank": 0,
                    "step": 0,
                    "commit_size": 1 << 40,
                    "manifest_size": 10,
                }
            ),
            Status.TOO_LARGE,
        ),
        (
            frame(
                {
                    "kind": "tierckpt.data-request",
                    "version": 1,
                    "op": "get",
                    "token": TOKEN,
                    "job": JOB,
                    "rank": 0,
                    "step": 5,
                }
            ),
            Status.NOT_FOUND,
        ),
    ],
)
def test_malformed_requests_get_a_clean_error(make_peer, payload, status):
    b = make_peer("b")
    reply = raw_request(b, payload)
    assert reply is not None and reply.status == status
    assert not (b.root / JOB).exists() and not (b.root / "etc").exists()


def test_a_refused_request_gets_its_answer_even_with_bytes_left_unread(make_peer):
    """The receiver refuses a put before reading its payload; it must not reset the connection over
    the unread bytes (a reset can destroy the answer before the sender reads it)."""
    b = make_peer("b")
    request = frame(
        {
            "kind": "tierckpt.data-request",
            "version": 1,
            "op": "put",
            "token": TOKEN,
            "job": JOB,
            "rank": 0,
            "step": 0,
            "commit_size": 1 << 40,
            "manifest_size": 10,
        }
    )
    with socket.create_connection(("127.0.0.1", b.server.port), timeout=5) as s:
        s.sendall(request + bytes(64 << 10))  # the payload follows at once, as push_step sends it
        assert recv_frame(s, DataReply).status == Status.TOO_LARGE
        assert s.recv(1) == b""  # an orderly end, not ECONNRESET
        s.shutdown(socket.SHUT_WR)


def test_header_that_lies_is_refused(make_peer, tmp_path):
    a, b = make_peer("a"), make_peer("b")
    src = write_step(a.root, JOB, 0, 4, sizes=(1000,))
    commit, manifest = (src / "COMMIT").read_bytes(), (src / "manifest.json").read_bytes()
    evil = manifest.replace(b'"data-00000.bin"', b'"../../../x.bin"')
    # COMMIT ends in its marker crc: change its last two digits to two others (never to the same ones)
    lying = commit[:-3] + (b"98}" if commit.endswith(b"99}") else b"99}")
    assert lying != commit
    for c, m, step in ((commit, manifest, 5), (commit, evil, 4), (lying, manifest, 4)):
        req = DataRequest(
            op="put", token=TOKEN, job=JOB, rank=0, step=step, commit_size=len(c), manifest_size=len(m)
        )
        with socket.create_connection(("127.0.0.1", b.server.port), timeout=5) as s:
            send_frame(s, req, c + m)
            assert recv_frame(s, DataReply).status == Status.BAD_REQUEST
    assert not (b.root / JOB).exists() and not (tmp_path / "x.bin").exists()


def test_a_full_receiver_refuses_before_any_byte_moves(make_peer):
    a, b = make_peer("a"), make_peer("b", reserve_bytes=1 << 62)
    write_step(a.root, JOB, 0, 1, sizes=(1 << 20,))
    out = push_step(a.ctx, JOB, 0, 1, b.address)
    assert out.status == "full" and out.bytes == 0
    assert committed_steps(replica_rank_dir(b.root, JOB, 0)) == [] and no_leftovers(b.root)


@pytest.mark.root
def test_a_full_sender_is_a_fault_of_its_own_not_of_its_peers(make_peer, tmpfs, caplog):
    """The sender's ramdisk is full, so it cannot even write the lease on its primary (ENOSPC): the send
    ends ``local`` with the reason, no other candidate is tried (nor blamed), no traceback is logged."""
    disk = tmpfs("4m", huge="never")
    a, b, c = make_peer("a", root=disk), make_peer("b"), make_peer("c")
    write_step(a.root, JOB, 0, 1, sizes=(1 << 20,))
    filler = disk / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(64 << 10))
            f.flush()
    task = SendTask(id=1, job=JOB, rank=0, step=1, candidates=(b.address, c.address), want=1)
    result = run_send(a.ctx, task)
    assert not result.ok and [(o.node, o.status) for o in result.outcomes] == [("b", "local")]
    assert "No space left on device" in result.outcomes[0].message
    assert "local" not in NODE_FAULTS
    assert not [r for r in caplog.records if r.exc_info]
    assert committed_steps(replica_rank_dir(b.root, JOB, 0)) == []
    filler.unlink()  # room again: the step's own retry gets through
    assert run_send(a.ctx, dataclasses.replace(task, id=2)).ok


def test_a_sparse_step_over_the_quota_is_neither_pushed_nor_taken(make_peer, tmp_path):
    """A step whose data file is one hole, declaring 48 MiB against an 8 MiB quota (``--job-quota``):
    the sender connects to nobody; a receiver sent its header anyway answers 413 before it creates a
    staging directory or reserves a byte; a step within the quota still goes through."""
    quota = 8 << 20
    a, b = make_peer("a", job_quota=quota), make_peer("b", job_quota=quota)
    write_sparse_step(a.root, JOB, 0, 1, declared=48 << 20)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    with listener:
        out = push_step(a.ctx, JOB, 0, 1, PeerAddress("x", "127.0.0.1", listener.getsockname()[1]))
        with pytest.raises(TimeoutError):
            listener.accept()  # not even a connection
    assert out.status == "too_large" and out.bytes == 0
    assert (
        "declares 48.0Mi, over the job's quota of 8.0Mi (its files take 0B on this node's ramdisk"
        in out.message
    )
    forged = write_sparse_step(tmp_path / "elsewhere", JOB, 0, 2, declared=48 << 20)
    commit, manifest = (forged / "COMMIT").read_bytes(), (forged / "manifest.json").read_bytes()
    req = DataRequest(
        op="put", token=TOKEN, job=JOB, rank=0, step=2, commit_size=len(commit), manifest_size=len(manifest)
    )
    with socket.create_connection(("127.0.0.1", b.server.port), timeout=5) as s:
        send_frame(s, req, commit + manifest)
        reply = recv_frame(s, DataReply)
    assert reply.status == Status.TOO_LARGE and "over the job's quota of 8.0Mi" in reply.message
    assert not (b.root / JOB / "replicas").exists() and no_leftovers(b.root)
    assert [(e.op, e.status, e.bytes) for e in b.events] == [("put", Status.TOO_LARGE, 48 << 20)]
    write_step(a.root, JOB, 0, 3, sizes=(1 << 20,))
    assert push_step(a.ctx, JOB, 0, 3, b.address).status == "ok"


def test_a_fragment_of_a_step_over_the_quota_is_refused(make_peer, tmp_path):
    """An erasure-coded fragment is checked against the quota too (the step it belongs to)."""
    b = make_peer("b", job_quota=512 << 10)
    src = write_step(tmp_path / "src", JOB, 0, 5, sizes=(1 << 20,))
    em = encode_step(src, tmp_path / "enc", 2, 1)
    commit, manifest, erasure = (
        (src / "COMMIT").read_bytes(),
        (src / "manifest.json").read_bytes(),
        em.to_bytes(),
    )
    req = DataRequest(
        op="fragment",
        token=TOKEN,
        job=JOB,
        rank=0,
        step=5,
        index=0,
        commit_size=len(commit),
        manifest_size=len(manifest),
        erasure_size=len(erasure),
    )
    with socket.create_connection(("127.0.0.1", b.server.port), timeout=5) as s:
        send_frame(s, req, commit + manifest + erasure)
        reply = recv_frame(s, DataReply)
    assert reply.status == Status.TOO_LARGE and "over the job's quota of 512.0Ki" in reply.message
    assert not (b.root / JOB / "fragments").exists()


def test_connection_dropped_mid_stream_leaves_nothing(make_peer):
    a, b = make_peer("a"), make_peer("b")
    src = write_step(a.root, JOB, 0, 2, sizes=(8 << 20,))
    commit, manifest = (src / "COMMIT").read_bytes(), (src / "manifest.json").read_bytes()
    req = DataRequest(
        op="put", token=TOKEN, job=JOB, rank=0, step=2, commit_size=len(commit), manifest_size=len(manifest)
    )
    with socket.create_connection(("127.0.0.1", b.server.port), timeout=5) as s:
        send_frame(s, req, commit + manifest)
        assert recv_frame(s, DataReply).status == Status.CONTINUE
        s.sendall((src / "data-00000.bin").read_bytes()[: 3 << 20])  # the sender dies after 3 of 8 MiB
    LocalWait.until(lambda: b.events)
    assert b.events[-1].status == Status.ABORTED
    assert committed_steps(replica_rank_dir(b.root, JOB, 0)) == [] and no_leftovers(b.root)
    assert push_step(a.ctx, JOB, 0, 2, b.address).status == "ok"  # a later attempt succeeds


def test_a_sender_that_stalls_mid_stream_is_dropped_after_the_transfer_timeout(make_peer):
    a, b = make_peer("a"), make_peer("b", transfer_timeout=1.0)
    src = write_step(a.root, JOB, 0, 3, sizes=(8 << 20,))
    commit, manifest = (src / "COMMIT").read_bytes(), (src / "manifest.json").read_bytes()
    req = DataRequest(
        op="put", token=TOKEN, job=JOB, rank=0, step=3, commit_size=len(commit), manifest_size=len(manifest)
    )
    with socket.create_connection(("127.0.0.1", b.server.port), timeout=5) as s:
        send_frame(s, req, commit + manifest)
        assert recv_frame(s, DataReply).status == Status.CONTINUE
        s.sendall((src / "data-00000.bin").read_bytes()[: 5 << 20])  # then nothing, connection open
        LocalWait.until(lambda: b.events)
        assert b.events[-1].status == Status.ABORTED
        assert s.recv(1) == b""  # the receiver hung up
    assert committed_steps(replica_rank_dir(b.root, JOB, 0)) == [] and no_leftovers(b.root)


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A port whose listener's accept queue is full: new connections' SYNs are dropped and their connects
    time out, as through a partition that drops a node's new connections."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # the one the queue takes
            yield port


def test_a_send_waiting_on_a_peer_that_does_not_answer_leaves_its_step_free_to_save_again(
    make_peer, monkeypatch
):
    """Soak 7 (seed 1512564371, round 24): node-2 sent rank 0's step 39 to node-4, then to node-3, whose
    one-way partition dropped node-2's new connections; the job meanwhile went back to step 36 and
    trained to 39 again, and its save of step 39 was skipped ("already exists and is leased by a
    reader"): the send held its lease on the primary while its connect waited out the timeout. The job
    was held with only the run it left's step 39 on node-2, which no node sends. A send leases the
    primary while it checks it and once connected, never while it connects."""
    a, b = make_peer("a", connect_timeout=1.0), make_peer("b")
    write_step(a.root, JOB, 0, 39, sizes=(1 << 20,), seed=1)
    rank_path = rank_dir(a.root, JOB, 0)
    saves: list[str | None] = []

    def connect_meanwhile(ctx: DataContext, peer: PeerAddress):
        # while the sender connects, the trainer saves step 39 again (the client's own decision)
        saves.append(make_room(rank_path, 39, SlotPool(rank_path, target=2)))
        return connect(ctx, peer)

    monkeypatch.setattr(transfer, "connect", connect_meanwhile)
    with unanswered_port() as port:
        out = push_step(a.ctx, JOB, 0, 39, PeerAddress("b", "127.0.0.1", port))
    assert saves == [None], f"the save of step 39 was refused while the send connected: {saves}"
    assert out.status == "unreachable" and "timed out" in out.message
    write_step(a.root, JOB, 0, 39, sizes=(1 << 20,), seed=2)
    # connected, the send finds the step gone (replaced since its check): nothing goes out
    out = push_step(a.ctx, JOB, 0, 39, b.address)
    assert saves == [None, None] and out.status == "missing"
    assert committed_steps(replica_rank_dir(b.root, JOB, 0)) == [] and no_leftovers(b.root)
    monkeypatch.undo()
    again = step_files(write_step(a.root, JOB, 0, 39, sizes=(1 << 20,), seed=3))
    assert push_step(a.ctx, JOB, 0, 39, b.address).status == "ok"  # the new save is the one sent
    assert step_files(replica(b, 0, 39)) == again
    assert not leases.leased_steps(rank_path)


def purge_here(peer: Peer) -> None:
    """What a purge does in the worker of ``peer``: fence the job (``ipc.FenceJob``), delete it, lift."""
    assert peer.ctx.fences.fence(JOB, timeout=10)
    remove_job_tree(peer.root, JOB)
    peer.ctx.fences.lift(JOB)


@pytest.mark.parametrize("held", ["before its header", "mid-data"])
def test_a_purge_aborts_a_replica_still_arriving_and_nothing_recreates_the_job(make_peer, held):
    """Found by the chaos soak: a replica whose sender was admitted before the purge committed after it,
    re-creating the job's directory (the membership check is at the start of a transfer only)."""
    a, b = make_peer("a"), make_peer("b", max_incoming=1)
    src = write_step(a.root, JOB, 0, 3, sizes=(8 << 20,))
    commit, manifest = (src / "COMMIT").read_bytes(), (src / "manifest.json").read_bytes()
    data = (src / "data-00000.bin").read_bytes()
    req = DataRequest(
        op="put", token=TOKEN, job=JOB, rank=0, step=3, commit_size=len(commit), manifest_size=len(manifest)
    )
    with socket.create_connection(("127.0.0.1", b.server.port), timeout=5) as s:
        if held == "before its header":
            send_frame(s, req)  # admitted and authorized; the receiver waits for the step's header
            LocalWait.until(lambda: b.server._slots._value == 0)
            rest = commit + manifest + data
        else:
            send_frame(s, req, commit + manifest)
            assert recv_frame(s, DataReply).status == Status.CONTINUE
            s.sendall(data[: 3 << 20])
            rest = data[3 << 20 :]
        purge_here(b)
        with contextlib.suppress(OSError, ProtocolError):  # the sender goes on, as a real one would
            s.sendall(rest)
            recv_frame(s, DataReply)
    assert not job_dir(b.root, JOB).exists()
    assert committed_steps(replica_rank_dir(b.root, JOB, 0)) == []


def test_a_job_being_purged_takes_no_transfer(make_peer):
    a, b = make_peer("a"), make_peer("b")
    write_step(a.root, JOB, 0, 4, sizes=(1 << 20,))
    assert b.ctx.fences.fence(JOB, timeout=10)
    out = push_step(a.ctx, JOB, 0, 4, b.address)
    assert out.status == "unauthorized" and "being purged" in out.message
    assert not job_dir(b.root, JOB).exists()
    b.ctx.fences.lift(JOB)
    assert push_step(a.ctx, JOB, 0, 4, b.address).status == "ok"  # the job returned: served again


def test_busy_receiver_says_so(make_peer):
    a, b = make_peer("a"), make_peer("b", max_incoming=1)
    write_step(a.root, JOB, 0, 1, sizes=(1024,))
    hold = socket.create_connection(("127.0.0.1", b.server.port), timeout=5)
    # an authorized transfer that stalls after its request occupies the only slot (an idle connection
    # does not: test_bounded_resources.py)
    send_frame(
        hold, DataRequest(op="put", token=TOKEN, job=JOB, rank=0, step=9, commit_size=9, manifest_size=9)
    )
    try:
        LocalWait.until(lambda: b.server._slots._value == 0)
        assert push_step(a.ctx, JOB, 0, 1, b.address).status == "busy"
    finally:
        hold.close()


def test_replicas_follow_retention(make_peer):
    a, b = make_peer("a"), make_peer("b", replica_keep=2)
    for step in (1, 2, 3, 4):
        write_step(a.root, JOB, 0, step, sizes=(4096,))
        assert push_step(a.ctx, JOB, 0, step, b.address).status == "ok"
    assert committed_steps(replica_rank_dir(b.root, JOB, 0)) == [3, 4]


def test_concurrent_puts_of_one_step_commit_once(make_peer):
    a, b = make_peer("a"), make_peer("b")
    src = write_step(a.root, JOB, 0, 6, sizes=(6 << 20,))
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(push_step(a.ctx, JOB, 0, 6, b.address).status))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "ok" in results and set(results) <= {"ok", "busy", "already"}
    assert step_files(replica(b, 0, 6)) == step_files(src) and no_leftovers(b.root)


class LocalWait:
    @staticmethod
    def until(predicate, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "condition not met in time"
            time.sleep(0.01)


def closed_at_once(port: int) -> bool:
    """A new connection to ``port`` is closed without a word (an orderly close or a reset)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_connections_are_bounded_per_source(make_peer):
    """At most per_source from one address: one more is closed at once, and the others stay."""
    b = make_peer("b", max_incoming=1, data_connections_per_source=3)
    idle = [socket.create_connection(("127.0.0.1", b.server.port), timeout=5) for _ in range(3)]
    try:
        LocalWait.until(lambda: b.server.connections.open == 3)
        assert closed_at_once(b.server.port)
        assert b.server.connections.open == 3 and b.server.connections.refused == 1
    finally:
        for s in idle:
            s.close()
    LocalWait.until(lambda: b.server.connections.open == 0)  # and the connections are released


def test_idle_connections_are_bounded_in_total_and_the_oldest_makes_room(make_peer):
    """In total (4 x max_incoming + 8): when all are open and pending, a new one takes the place of the
    oldest (they all come from one address here), which is closed at once, not at its deadline."""
    b = make_peer("b", max_incoming=1, data_connections_per_source=100, handshake_timeout=30.0)
    total = 12
    idle = [socket.create_connection(("127.0.0.1", b.server.port), timeout=5) for _ in range(total)]
    try:
        LocalWait.until(lambda: b.server.connections.open == total)
        with socket.create_connection(("127.0.0.1", b.server.port), timeout=5):
            assert closed_within(idle[0], 5.0) < 2.0
            LocalWait.until(lambda: b.server.connections.shed == 1)
            assert b.server.connections.open == total
    finally:
        for s in idle:
            s.close()
    LocalWait.until(lambda: b.server.connections.open == 0)


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``sock`` (which sends nothing more), at most ``seconds``."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_idle_connections_hold_no_transfer_slot(make_peer):
    """Slots are taken after the request is authorized: max_incoming idle connections block nothing."""
    a, b = make_peer("a"), make_peer("b", max_incoming=2, handshake_timeout=30.0)
    write_step(a.root, JOB, 0, 1, sizes=(1 << 20,))
    idle = [socket.create_connection(("127.0.0.1", b.server.port), timeout=5) for _ in range(4)]
    try:
        LocalWait.until(lambda: b.server.connections.open == 4)
        assert push_step(a.ctx, JOB, 0, 1, b.address).status == "ok"
        wrong = socket.create_connection(("127.0.0.1", b.server.port), timeout=5)
        with wrong:  # an unauthorized request is refused before it could take a slot either
            send_frame(wrong, DataRequest(op="get", token="nope", job=JOB, rank=0, step=1))
            assert recv_frame(wrong, DataReply).status == Status.FORBIDDEN
        LocalWait.until(lambda: b.server._slots._value == 2)  # the push's slot comes back after its reply
    finally:
        for s in idle:
            s.close()


def test_a_trickled_request_is_closed_at_the_handshake_deadline(make_peer):
    """One deadline for the whole request frame, not a timeout per recv: a byte every 0.2 s (well
    inside the 5 s transfer timeout) does not keep the connection past 1 s."""
    b = make_peer("b", handshake_timeout=1.0)
    sock = socket.create_connection(("127.0.0.1", b.server.port), timeout=5)
    with sock:
        frame = b"TKR1" + struct.pack("!I", 1000) + b"x" * 1000
        start = time.monotonic()
        for byte in frame:
            try:
                sock.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
            if time.monotonic() - start > 4:
                break
        lived = time.monotonic() - start + closed_within(sock, 3)
    assert 0.9 <= lived <= 3.0


def test_a_sender_below_the_rate_floor_is_dropped(make_peer):
    """Authorized, then trickling its data: dropped after one window below the floor, nothing kept."""
    a, b = make_peer("a"), make_peer("b", transfer_timeout=1.0, min_transfer_rate=0.065536)
    src = write_step(a.root, JOB, 0, 2, sizes=(1 << 20,))
    commit, manifest = (src / "COMMIT").read_bytes(), (src / "manifest.json").read_bytes()
    sock = socket.create_connection(("127.0.0.1", b.server.port), timeout=5)
    with sock:
        req = DataRequest(
            op="put",
            token=TOKEN,
            job=JOB,
            rank=0,
            step=2,
            commit_size=len(commit),
            manifest_size=len(manifest),
        )
        send_frame(sock, req, commit + manifest)
        assert recv_frame(sock, DataReply).status == Status.CONTINUE
        start = time.monotonic()
        try:
            for _ in range(40):  # 100 bytes every 0.1 s: 1 kB/s, far below 64 KiB/s
                sock.send(b"x" * 100)
                time.sleep(0.1)
        except OSError:
            pass
        lived = time.monotonic() - start + closed_within(sock, 3)
    assert lived <= 3.0
    LocalWait.until(lambda: b.server._slots._value == b.ctx.config.transfer.max_incoming)
    assert not replica(b, 0, 2).exists() and no_leftovers(b.root)
