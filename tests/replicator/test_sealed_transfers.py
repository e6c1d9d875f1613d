"""Transfers between data servers over mutual TLS, as deployed: the connection becomes a sealed
channel (replication/channel.py). Real loopback sockets, node certificates of a real CA, and a man in
the middle on the wire: what it sees is ciphertext; a byte it flips or a connection it cuts mid-file
aborts the transfer with nothing committed, and the next attempt commits a bit-exact copy. A peer that
keeps to TLS records (an earlier build) is still served."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierckpt.protocol.certs import Authority, new_key, write_identity
from tierckpt.protocol.control import PeerAssignment, PeerNode
from tierckpt.protocol.format import Manifest, rank_dir, replica_rank_dir, step_dir
from tierckpt.protocol.identity import TlsCredentials, TlsFiles, node_server_name
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.replication.channel import open_channel
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.data_server import DataServer
from tierckpt_replicator.replication.ipc import FetchSource, PeerAddress, WorkerConfig
from tierckpt_replicator.replication.stream import BLOCK
from tierckpt_replicator.replication.transfer import fetch_step, push_step
from tierckpt_replicator.replication.wire import (
    ChannelHello,
    DataReply,
    DataRequest,
    Status,
    recv_exact,
    recv_frame,
    send_frame,
)
from tierckpt_replicator.settings import TransferSettings
from tierckpt_replicator.stepio import INCOMING_PREFIX

pytestmark = pytest.mark.e2e

JOB = "ns_job_0123abcd"
NODES = ("node-a", "node-b")
SIZE = 6 * BLOCK + 12_345
MARK = b"\x5atierckpt-plaintext-marker\xa5" * 8  # repeated through the step's data: must never be seen


@dataclasses.dataclass
class Peer:
    ctx: DataContext
    server: DataServer

    @property
    def root(self) -> Path:
        return self.ctx.root

    @property
    def name(self) -> str:
        return self.ctx.config.node

    def address(self, port: int | None = None) -> PeerAddress:
        return PeerAddress(self.name, "127.0.0.1", port or self.server.port)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    """A CA and a node certificate for each of ``NODES`` (files as a replicator has them)."""
    d = tmp_path_factory.mktemp("pki")
    ca = Authority.create()
    (d / "ca.pem").write_bytes(ca.pem)
    out = {}
    for node in NODES:
        key = new_key()
        cert = ca.node_certificate(key.public_key(), node, datetime.timedelta(hours=1))
        write_identity(d / f"{node}.pem", key, cert)
        out[node] = TlsFiles(cert=d / f"{node}.pem", ca=d / "ca.pem")
    return out


@pytest.fixture
def peers(tmp_path: Path, pki: dict[str, TlsFiles]) -> Iterator[dict[str, Peer]]:
    """``node-a`` and ``node-b``: a data server each, mutual TLS, members of ``JOB``."""
    assignment = PeerAssignment(
        job=JOB,
        generation=1,
        nodes={n: PeerNode(name=n, endpoint=f"https://127.0.0.{i + 1}:8470") for i, n in enumerate(NODES)},
        peers={NODES[0]: (NODES[1],), NODES[1]: (NODES[0],)},
        node_ranks={n: i for i, n in enumerate(NODES)},
    )
    peers_file = tmp_path / "peers.json"
    peers_file.write_bytes(assignment.to_bytes())
    out: dict[str, Peer] = {}
    for node in NODES:
        root = tmp_path / node
        root.mkdir()
        cfg = WorkerConfig(
            node=node,
            root=str(root),
            auth="tls",
            tls_cert=str(pki[node].cert),
            tls_ca=str(pki[node].ca),
            peers_file=str(peers_file),
            listen_host="127.0.0.1",
            data_port=0,
            holder=f"replicator-{node}",
            transfer=TransferSettings(transfer_timeout=5.0, handshake_timeout=2.0),
        )
        server = DataServer(DataContext.from_config(cfg))
        server.start()
        out[node] = Peer(server.ctx, server)
    yield out
    for p in out.values():
        p.server.stop()


class Middle:
    """A TCP relay to ``port`` that records what each side sends (``seen``: the client, ``answered``:
    the server), and may flip the byte at ``flip`` or cut the connection at ``cut`` (offsets in the
    client's stream)."""

    def __init__(self, port: int, *, flip: int = -1, cut: int = -1) -> None:
        self.port, self.flip, self.cut = port, flip, cut
        self.seen = bytearray()
        self.answered = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def address(self) -> int:
        return int(self.listener.getsockname()[1])

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.port))
                threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
                threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                if not upstream:
                    self.answered += chunk
                else:
                    start = len(self.seen)
                    self.seen += chunk
                    if 0 <= self.cut < len(self.seen):
                        dst.sendall(chunk[: self.cut - start])
                        break
                    if start <= self.flip < len(self.seen):
                        chunk = bytearray(chunk)
                        chunk[self.flip - start] ^= 0x40
                        chunk = bytes(chunk)
                dst.sendall(chunk)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def middle() -> Iterator[Callable[..., Middle]]:
    made: list[Middle] = []

    def make(port: int, **kwargs: int) -> Middle:
        made.append(Middle(port, **kwargs))
        return made[-1]

    yield make
    for m in made:
        m.close()


def _write_step(peer: Peer, step: int) -> dict[str, bytes]:
    """A committed step of rank 0 on ``peer`` whose data repeats ``MARK``; its files by name."""
    block = (MARK * (BLOCK // len(MARK) + 1))[:BLOCK]
    path = write_step(
        "", JOB, 0, step, world_size=2, sizes=(SIZE,), block=block, parent=rank_dir(peer.root, JOB, 0)
    )
    return step_files(path)


def _replica(peer: Peer, step: int) -> Path:
    return step_dir(replica_rank_dir(peer.root, JOB, 0), step)


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(INCOMING_PREFIX)]


def test_a_replica_goes_sealed_bit_exact_and_the_wire_shows_no_plaintext(peers, middle):
    a, b = peers["node-a"], peers["node-b"]
    data = _write_step(a, 1)
    spy = middle(b.server.port)
    out = push_step(a.ctx, JOB, 0, 1, b.address(spy.address))
    assert out.status == "ok", out.message
    assert step_files(_replica(b, 1)) == data  # COMMIT and manifest byte for byte too
    assert len(spy.seen) > SIZE  # all of it went through the middle
    assert not _plaintext(spy.seen) and not _plaintext(spy.answered)


def _plaintext(wire: bytes | bytearray) -> list[bytes]:
    """What of the step's bytes or the protocol's frames shows on the wire (the TLS handshake's server
    name does, and is no secret)."""
    secrets = (MARK[:32], b"data-request", b"data-reply", b"data-channel", JOB.encode())
    return [m for m in secrets if m in wire]


def test_a_step_is_fetched_sealed_bit_exact(peers, middle):
    a, b = peers["node-a"], peers["node-b"]
    data = _write_step(a, 2)
    spy = middle(a.server.port)
    source = FetchSource(kind="peer", node=a.name, host="127.0.0.1", port=spy.address)
    out = fetch_step(b.ctx, JOB, 0, 2, source, lambda done, total: None, into="replica")
    assert out.status == "ok", out.message
    assert step_files(_replica(b, 2)) == data
    assert len(spy.answered) > SIZE
    assert not _plaintext(spy.seen) and not _plaintext(spy.answered)


@pytest.mark.parametrize("fault", ["flip", "cut"])
def test_a_byte_flipped_or_a_connection_cut_mid_file_commits_nothing_and_the_retry_commits(
    peers, middle, fault
):
    """Half-way through the file: the receiver's channel refuses the altered record (or sees the cut),
    aborts the staging, and the sender hears a broken transfer; its next attempt commits."""
    a, b = peers["node-a"], peers["node-b"]
    data = _write_step(a, 3)
    bad = middle(b.server.port, **{fault: SIZE // 2})
    out = push_step(a.ctx, JOB, 0, 3, b.address(bad.address))
    assert out.status == "failed", out
    assert not _replica(b, 3).exists()
    _wait_for(lambda: not _leftovers(b.root), "the aborted staging to be removed")
    again = push_step(a.ctx, JOB, 0, 3, b.address())
    assert again.status == "ok", again.message
    assert step_files(_replica(b, 3)) == data


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _tls_to(peer: Peer, me: str, pki: dict[str, TlsFiles]) -> ssl.SSLSocket:
    ctx = TlsCredentials(pki[me]).client(named=True)
    raw = socket.create_connection(("127.0.0.1", peer.server.port), timeout=10)
    return ctx.wrap_socket(raw, server_hostname=node_server_name(peer.name))


def test_a_peer_that_keeps_to_tls_records_is_still_served(peers, pki):
    """An earlier build sends its request straight after the handshake: it gets the step over TLS."""
    a, b = peers["node-a"], peers["node-b"]
    data = _write_step(a, 4)
    with _tls_to(a, b.name, pki) as sock:
        send_frame(sock, DataRequest(op="get", token="", job=JOB, rank=0, step=4, node=b.name))
        reply = recv_frame(sock, DataReply)
        assert reply.status == Status.OK, reply.message
        recv_exact(sock, reply.commit_size)
        manifest = Manifest.from_bytes(recv_exact(sock, reply.manifest_size))
        for f in manifest.files:
            assert recv_exact(sock, f.size) == data[f.name]


def test_a_second_hello_inside_the_channel_is_a_bad_request(peers, pki):
    a, b = peers["node-a"], peers["node-b"]
    with open_channel(_tls_to(a, b.name, pki)) as channel:
        send_frame(channel, ChannelHello(random="00" * 32))
        reply = recv_frame(channel, DataReply)
    assert reply.status == Status.BAD_REQUEST and "data-request" in reply.message


def test_a_peer_that_refuses_a_sealed_channel_fails_the_transfer_cleanly(peers, pki, tmp_path):
    """An earlier build answers the hello with 400 (not a request): the push fails with that reason
    (the worker retries it later), nothing raises."""
    a, b = peers["node-a"], peers["node-b"]
    _write_step(a, 5)
    ctx = TlsCredentials(pki[b.name]).server()
    listener = socket.create_server(("127.0.0.1", 0))

    def old_server() -> None:
        conn, _ = listener.accept()
        with ctx.wrap_socket(conn, server_side=True) as tls:
            recv_exact(tls, 8)
            send_frame(tls, DataReply(status=Status.BAD_REQUEST, message="malformed tierckpt.data-request"))
            with contextlib.suppress(OSError):
                tls.recv(1 << 16)

    t = threading.Thread(target=old_server, daemon=True)
    t.start()
    out = push_step(a.ctx, JOB, 0, 5, b.address(listener.getsockname()[1]))
    listener.close()
    assert out.status == "failed"
    assert "refused a sealed channel (400)" in out.message


def test_a_request_trickled_into_the_channel_is_closed_at_the_handshake_deadline(peers, pki):
    """The handshake deadline covers the channel too: a sealed record's bytes trickled every 0.2 s
    (each well inside the transfer timeout) do not keep the connection past the 2 s deadline."""
    import time

    a, b = peers["node-a"], peers["node-b"]
    start = time.monotonic()
    with open_channel(_tls_to(a, b.name, pki)) as channel:
        raw = socket.socket(fileno=os.dup(channel.fileno()))
        with raw:
            raw.sendall(struct.pack("!I", 1000))
            for _ in range(40):
                try:
                    raw.sendall(b"x")
                except OSError:
                    break
                time.sleep(0.2)
                if _closed(raw):
                    break
    lived = time.monotonic() - start
    assert lived < 4.0, f"the connection lived {lived:.1f}s"


def _closed(sock: socket.socket) -> bool:
    """Whether the peer has closed ``sock`` (without waiting)."""
    try:
        return sock.recv(1 << 16, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
