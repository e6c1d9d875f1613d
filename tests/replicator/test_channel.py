"""The sealed channel's record layer (replication/channel.py) between real sockets, with a man in the
middle: every byte arrives as sent or the receiver raises; nothing altered, dropped, reordered,
replayed or cut is ever handed over as data."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from tierckpt_replicator.replication import channel
from tierckpt_replicator.replication.channel import FRAME_RECORD, RECORD, TAG, SealedChannel
from tierckpt_replicator.replication.wire import ProtocolError, Status

IKM = bytes(range(64))
_LENGTH = struct.Struct("!I")


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    return a, b


Middle = Callable[[list[bytes]], list[bytes]]


@pytest.fixture
def wire() -> Iterator[Callable[..., tuple[SealedChannel, SealedChannel]]]:
    """``wire(middle=None, ikm=IKM)``: a client channel whose records pass through ``middle`` (a
    function from the list of sealed records the client sent to the list the server gets) to a server
    channel. Records are cut out of the byte stream by their length prefix, as an attacker could."""
    opened: list[socket.socket] = []

    def make(
        middle: Middle | None = None, *, ikm: bytes = IKM, limit: int = RECORD
    ) -> tuple[SealedChannel, SealedChannel]:
        c_out, mitm_in = _pair()
        mitm_out, s_in = _pair()
        opened.extend((c_out, mitm_in, mitm_out, s_in))
        client = SealedChannel(c_out, IKM, server=False, timeout=10)
        server = SealedChannel(s_in, ikm, server=True, limit=limit, timeout=10)
        if middle is None:
            threading.Thread(target=_relay, args=(mitm_in, mitm_out), daemon=True).start()
        else:
            threading.Thread(target=_tamper, args=(mitm_in, mitm_out, middle), daemon=True).start()
        return client, server

    yield make
    for s in opened:
        s.close()


def _relay(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the test is over (its sockets closed)
        while chunk := src.recv(1 << 20):
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)


def _tamper(src: socket.socket, dst: socket.socket, middle: Middle) -> None:
    """Read every record the client sends until it half-closes, pass them through ``middle``, send what
    it returns, half-close."""
    with contextlib.suppress(OSError):  # the test is over (its sockets closed)
        _tamper_all(src, dst, middle)


def _tamper_all(src: socket.socket, dst: socket.socket, middle: Middle) -> None:
    data = b""
    while chunk := src.recv(1 << 20):
        data += chunk
    records, offset = [], 0
    while offset < len(data):
        (n,) = _LENGTH.unpack_from(data, offset)
        records.append(data[offset : offset + _LENGTH.size + n + TAG])
        offset += _LENGTH.size + n + TAG
    dst.sendall(b"".join(middle(records)))
    dst.shutdown(socket.SHUT_WR)


def _send_records(client: SealedChannel, parts: list[bytes]) -> None:
    with contextlib.suppress(OSError):  # the test is over (its sockets closed)
        for part in parts:
            client.send_record(part)
        client.shutdown(socket.SHUT_WR)


def _read_all(server: SealedChannel, bufsize: int = RECORD) -> bytes:
    out = bytearray()
    buf = bytearray(bufsize)
    while k := server.recv_into(buf):
        out += buf[:k]
    return bytes(out)


PARTS = [os.urandom(n) for n in (1, 1000, RECORD, 3 * RECORD + 17, 5)]


@pytest.mark.parametrize("bufsize", [RECORD, 4096, 7])
def test_records_arrive_bit_exact_in_buffers_of_any_size(wire, bufsize):
    client, server = wire()
    t = threading.Thread(target=_send_records, args=(client, PARTS))
    t.start()
    assert _read_all(server, bufsize) == b"".join(PARTS)
    t.join()


def test_frames_go_in_frame_sized_records_and_a_server_takes_no_more_before_bulk(wire):
    """``sendall`` seals at most ``FRAME_RECORD`` a record, which a server takes before it allows bulk;
    a file-sized record before then is refused (413) without being read."""
    client, server = wire(limit=FRAME_RECORD)
    frame = os.urandom(3 * FRAME_RECORD + 1)

    def send() -> None:
        client.sendall(frame)
        client.send_record(os.urandom(FRAME_RECORD + 1))

    threading.Thread(target=send, daemon=True).start()
    assert _read_exactly(server, len(frame)) == frame
    with pytest.raises(ProtocolError, match="sealed record of 65537 bytes") as err:
        server.recv_into(bytearray(RECORD))
    assert err.value.status == Status.TOO_LARGE


def _read_exactly(server: SealedChannel, n: int) -> bytes:
    out = bytearray()
    buf = bytearray(n)
    while len(out) < n:
        k = server.recv_into(buf, n - len(out))
        assert k, "ended early"
        out += buf[:k]
    return bytes(out)


def _flip(record_index: int, byte: int) -> Middle:
    def middle(records: list[bytes]) -> list[bytes]:
        r = bytearray(records[record_index])
        r[byte] ^= 0x01
        records[record_index] = bytes(r)
        return records

    return middle


@pytest.mark.parametrize(
    ("middle", "intact", "why"),
    [
        (_flip(2, 4 + RECORD // 2), 2, "one bit of a file record's ciphertext"),
        (_flip(2, 4 + RECORD + 3), 2, "one bit of its tag"),
        (_flip(1, 3), 1, "one bit of a record's length"),
        (lambda rs: rs[:2] + rs[3:], 2, "a record dropped"),
        (lambda rs: [rs[0], rs[2], rs[1], *rs[3:]], 1, "two records swapped"),
        (lambda rs: [*rs[:3], rs[2], *rs[3:]], 3, "a record replayed"),
        (lambda rs: [rs[0], *rs], 1, "the first record replayed"),
    ],
)
def test_an_altered_stream_raises_before_a_byte_of_it_is_handed_over(wire, middle, intact, why):
    """What came before the damage arrives intact; the damaged record, and all after it, never do."""
    client, server = wire(middle)
    threading.Thread(target=_send_records, args=(client, PARTS)).start()
    out = bytearray()
    buf = bytearray(RECORD)
    with pytest.raises(ProtocolError, match="failed authentication"):
        while k := server.recv_into(buf):
            out += buf[:k]
    assert bytes(out) == b"".join(PARTS[:intact]), why


def test_a_stream_cut_inside_a_record_raises(wire):
    client, server = wire(lambda rs: [rs[0], rs[1][:-5]])
    threading.Thread(target=_send_records, args=(client, PARTS)).start()
    assert _read_exactly(server, len(PARTS[0])) == PARTS[0]
    with pytest.raises(ProtocolError, match="connection closed inside sealed record 1"):
        server.recv_into(bytearray(RECORD))


def test_a_stream_cut_between_records_reads_as_its_end(wire):
    """As on a socket; the data protocol's sizes catch a short file (test_stream: a peer that hangs up
    early)."""
    client, server = wire(lambda rs: rs[:2])
    threading.Thread(target=_send_records, args=(client, PARTS)).start()
    assert _read_all(server) == PARTS[0] + PARTS[1]


def test_keys_of_another_connection_open_nothing(wire):
    client, server = wire(ikm=bytes(64))
    threading.Thread(target=_send_records, args=(client, PARTS)).start()
    with pytest.raises(ProtocolError, match="record 0 failed authentication"):
        server.recv_into(bytearray(RECORD))


def test_the_directions_have_keys_of_their_own(wire):
    """A record reflected back to its sender does not open: each direction has its own key."""
    a, b = _pair()
    client = SealedChannel(a, IKM, server=False, timeout=10)
    reflected = SealedChannel(b, IKM, server=False, timeout=10)  # takes client records as server ones
    client.sendall(b"hello")
    with pytest.raises(ProtocolError, match="failed authentication"):
        reflected.recv_into(bytearray(100))
    a.close()
    b.close()


def test_keys_change_every_epoch(wire, monkeypatch):
    monkeypatch.setattr(channel, "EPOCH_RECORDS", 3)
    derived: list[tuple[bytes, int]] = []
    real_key = SealedChannel._key

    def key(self: SealedChannel, role: bytes, epoch: int) -> object:
        derived.append((role, epoch))
        return real_key(self, role, epoch)

    monkeypatch.setattr(SealedChannel, "_key", key)
    client, server = wire()
    parts = [os.urandom(100 + i) for i in range(10)]
    threading.Thread(target=_send_records, args=(client, parts)).start()
    assert _read_all(server) == b"".join(parts)
    # ten client records: epochs 0..3 on both ends of that direction (and epoch 0 of the other)
    assert sorted(e for r, e in derived if r == b"client") == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_trickling_peer_is_cut_off_by_the_call_timeout():
    """The channel's timeout bounds a whole call, every record it reads included: a peer sending a
    byte a little faster than the timeout cannot hold a call open."""
    a, b = _pair()
    server = SealedChannel(b, IKM, server=True, timeout=0.5)
    stop = threading.Event()

    def trickle() -> None:
        a.sendall(_LENGTH.pack(1000))
        while not stop.wait(0.1):
            a.sendall(b"x")

    threading.Thread(target=trickle, daemon=True).start()
    with pytest.raises(TimeoutError):
        server.recv_into(bytearray(RECORD))
    stop.set()
    a.close()
    b.close()


def test_a_zero_length_record_is_refused(wire):
    a, b = _pair()
    server = SealedChannel(b, IKM, server=True, timeout=5)
    a.sendall(_LENGTH.pack(0))
    with pytest.raises(ProtocolError, match="sealed record of 0 bytes"):
        server.recv_into(bytearray(RECORD))
    a.close()
    b.close()
