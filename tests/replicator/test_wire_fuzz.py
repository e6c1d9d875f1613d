"""In-process fuzz of the data plane's frame parser (``wire.recv_frame``) over a socket pair: whatever
arrives, a ``DataRequest`` comes out or ``ProtocolError`` is raised, with the status the server would
answer (400 or 413); never another exception. The end-to-end fuzz is tests/replicator/test_fuzz.py."""

from __future__ import annotations

import socket
import struct

from hypothesis import given
from hypothesis import strategies as st

from tests.fixtures.fuzzing import fuzz_settings
from tierckpt_replicator.replication.wire import (
    MAGIC,
    MAX_FRAME,
    DataRequest,
    ProtocolError,
    Status,
    recv_frame,
)

VALID = DataRequest(op="get", token="", job="j", rank=0, step=1, node="n").to_bytes()


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    body = draw(st.sampled_from([VALID, VALID[:-1], b"[" * 60_000, b""]) | st.binary(max_size=200))
    magic = draw(st.sampled_from([MAGIC, MAGIC, b"TKR0"]) | st.binary(min_size=4, max_size=4))
    size = draw(st.sampled_from([len(body), len(body), MAX_FRAME + 1, 2**32 - 1]) | st.integers(0, len(body)))
    return (struct.pack("!4sI", magic, size) + body)[: draw(st.integers(0, 8 + len(body)))]


@fuzz_settings(600)
@given(wire=frames())
def test_the_frame_parser_returns_a_request_or_raises_protocol_error(wire):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire)
        a.shutdown(socket.SHUT_WR)  # the end: a short frame is a closed connection, not a wait
        b.settimeout(5)
        try:
            req = recv_frame(b, DataRequest)
        except ProtocolError as exc:
            assert exc.status in (0, Status.BAD_REQUEST, Status.TOO_LARGE)  # 0: closed early
            return
        assert isinstance(req, DataRequest)
