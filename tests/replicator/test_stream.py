"""Moving shard bytes (replication/stream.py) over real sockets: plain TCP, TLS and the sealed channel,
every sender method, odd sizes, a peer that hangs up early, a source that shrinks, and a ramdisk that
fills up."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierckpt.protocol.errors import FormatError, RamdiskFullError
from tierckpt.protocol.integrity import crc32c
from tierckpt_replicator.replication import stream
from tierckpt_replicator.replication.channel import DataConnection, accept_channel, is_hello, open_channel
from tierckpt_replicator.replication.pacing import Deadline
from tierckpt_replicator.replication.stream import BLOCK
from tierckpt_replicator.replication.wire import ProtocolError, recv_body
from tierckpt_replicator.stepio import preallocate

SIZES = [1, BLOCK - 1, BLOCK, 3 * BLOCK + 12_345]


# The stream functions take open descriptors (the replicator opens files through its safefs trees);
# these open plain test files for them.


@contextlib.contextmanager
def _opened(path: Path, flags: int) -> Iterator[int]:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def create_preallocated(path: Path, size: int) -> None:
    with _opened(path, os.O_RDWR | os.O_CREAT | os.O_EXCL) as fd:
        preallocate(fd, size, str(path))


def send_file(sock: DataConnection, path: Path, size: int, **kwargs) -> None:
    with _opened(path, os.O_RDONLY) as fd:
        stream.send_file(sock, fd, size, where=str(path), **kwargs)


def receive_file(sock: DataConnection, path: Path, size: int, **kwargs) -> int:
    with _opened(path, os.O_WRONLY) as fd:
        return stream.receive_file(sock, fd, size, where=path.name, **kwargs)


def copy_file(src: Path, dst: Path, size: int) -> int:
    with _opened(src, os.O_RDONLY) as fin, _opened(dst, os.O_WRONLY) as fout:
        return stream.copy_file(fin, fout, size, where=str(src))


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway self-signed certificate and key (PEM) for localhost (``cryptography`` comes with
    google-auth, a dependency of the replicator extra)."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    crt = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = tmp_path_factory.mktemp("tls") / "localhost.pem"
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        + crt.public_bytes(serialization.Encoding.PEM)
    )
    return pem


Pair = Callable[[], tuple[DataConnection, DataConnection]]


@pytest.fixture(params=["tcp", "tls", "sealed"])
def connected(request: pytest.FixtureRequest, cert: Path) -> Iterator[Pair]:
    """``connected()``: a (sender, receiver) pair of loopback connections with timeouts: plain TCP,
    TLS, or a sealed channel set up over TLS (the client sends, as a replica is pushed)."""
    opened: list[DataConnection] = []

    def make() -> tuple[DataConnection, DataConnection]:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            client = socket.create_connection(listener.getsockname(), timeout=10)
            server, _ = listener.accept()
        server.settimeout(10)
        if request.param in ("tls", "sealed"):
            server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            server_ctx.load_cert_chain(cert)
            client_ctx = ssl.create_default_context(cafile=str(cert))
            wrapped: dict[str, ssl.SSLSocket] = {}
            t = threading.Thread(
                target=lambda: wrapped.setdefault("server", server_ctx.wrap_socket(server, server_side=True))
            )
            t.start()
            client = client_ctx.wrap_socket(client, server_hostname="localhost")
            t.join()
            server = wrapped["server"]
        if request.param == "sealed":
            return _sealed(client, server)
        opened.extend((client, server))
        return client, server

    def _sealed(client: ssl.SSLSocket, server: ssl.SSLSocket) -> tuple[DataConnection, DataConnection]:
        accepted: dict[str, DataConnection] = {}

        def accept() -> None:
            hello = is_hello(recv_body(server))
            assert hello is not None
            channel = accept_channel(server, hello, Deadline(10, "the test's channel"))
            channel.allow_bulk()
            accepted["server"] = channel

        t = threading.Thread(target=accept)
        t.start()
        sealed = open_channel(client)
        t.join()
        opened.extend((sealed, accepted["server"]))
        return sealed, accepted["server"]

    yield make
    for s in opened:
        s.close()


def _file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", ["sendfile", "mmap"])
def test_send_and_receive_are_bit_exact(tmp_path, connected, method, size):
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    data = _file(src, size)
    create_preallocated(dst, size)
    tx, rx = connected()
    progress: list[int] = []
    sender = threading.Thread(target=send_file, args=(tx, src, size), kwargs={"method": method})
    sender.start()
    crc = receive_file(rx, dst, size, on_bytes=progress.append)
    sender.join()
    assert dst.read_bytes() == data and crc == crc32c(data)
    assert sum(progress) == size and max(progress) <= BLOCK


def test_two_files_back_to_back_on_one_connection(tmp_path, connected):
    """The protocol sends every file of a step on one connection: no byte may spill into the next."""
    tx, rx = connected()
    sizes = (BLOCK + 7, 5)
    srcs = [tmp_path / f"s{i}" for i in range(2)]
    datas = [_file(p, n) for p, n in zip(srcs, sizes, strict=True)]

    def send() -> None:
        for p, n in zip(srcs, sizes, strict=True):
            send_file(tx, p, n)

    sender = threading.Thread(target=send)
    sender.start()
    for i, (n, data) in enumerate(zip(sizes, datas, strict=True)):
        dst = tmp_path / f"d{i}"
        create_preallocated(dst, n)
        assert receive_file(rx, dst, n) == crc32c(data)
        assert dst.read_bytes() == data
    sender.join()


def test_a_peer_that_hangs_up_early_is_a_protocol_error(tmp_path, connected):
    tx, rx = connected()
    dst = tmp_path / "dst.bin"
    create_preallocated(dst, 2 * BLOCK)
    tx.sendall(b"x" * 1000)
    tx.close()
    with pytest.raises(ProtocolError, match=r"connection closed inside dst.bin \(2096152 bytes missing\)"):
        receive_file(rx, dst, 2 * BLOCK)


def test_a_file_of_the_wrong_size_is_not_sent(tmp_path, connected):
    src = tmp_path / "src.bin"
    _file(src, 100)
    tx, _ = connected()
    with pytest.raises(FormatError, match="100 bytes on disk, manifest says 101"):
        send_file(tx, src, 101)


def test_copy_file_checks_what_it_reads(tmp_path):
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    data = _file(src, 2 * BLOCK + 3)
    create_preallocated(dst, len(data))
    assert copy_file(src, dst, len(data)) == crc32c(data) and dst.read_bytes() == data
    with pytest.raises(FormatError, match="manifest says"):
        copy_file(src, dst, len(data) + 1)


def test_copy_file_of_a_source_that_shrinks_midway(tmp_path, monkeypatch):
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    _file(src, 3 * BLOCK)
    create_preallocated(dst, 3 * BLOCK)
    real_preadv = os.preadv

    def shrinking_preadv(fd, buffers, offset):  # the file is truncated after its size was checked
        if offset == 0:
            os.truncate(src, BLOCK)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(stream.os, "preadv", shrinking_preadv)
    with pytest.raises(FormatError, match="shrank while being copied"):
        copy_file(src, dst, 3 * BLOCK)


@pytest.mark.root
def test_a_full_ramdisk_is_a_ramdisk_full_error(tmpfs, connected, tmp_path):
    """Files are preallocated before a transfer; should the ramdisk still fill (a file made without
    preallocation), the receiver says so instead of failing obscurely."""
    disk = tmpfs("1m")
    src = tmp_path / "src.bin"
    _file(src, 4 * BLOCK)
    dst = disk / "dst.bin"
    dst.touch()
    tx, rx = connected()
    sender = threading.Thread(target=lambda: _send_quietly(tx, src))
    sender.start()
    with pytest.raises(RamdiskFullError, match="ramdisk full"):
        receive_file(rx, dst, 4 * BLOCK)
    rx.close()
    sender.join()


def _send_quietly(sock: DataConnection, src: Path) -> None:
    with contextlib.suppress(OSError):  # the receiver gave up
        send_file(sock, src, src.stat().st_size)
