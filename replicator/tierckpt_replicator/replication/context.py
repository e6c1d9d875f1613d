"""What every piece of the data plane needs, built once by the worker process."""

from __future__ import annotations

import dataclasses
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

from tierckpt.protocol.codec import Message
from tierckpt.protocol.tokens import TokenFile
from tierckpt_replicator.replication.ipc import PeerAddress, WorkerConfig
from tierckpt_replicator.replication.throttle import TokenBucket

__all__ = ["DataContext", "connect", "unique_holder"]


def _drop(_: Message) -> None:
    pass


@dataclasses.dataclass
class DataContext:
    config: WorkerConfig
    tokens: TokenFile
    bucket: TokenBucket
    emit: Callable[[Message], None] = _drop

    @classmethod
    def from_config(cls, config: WorkerConfig, emit: Callable[[Message], None] = _drop) -> DataContext:
        return cls(
            config=config,
            tokens=TokenFile(config.token_file),
            bucket=TokenBucket(config.bandwidth_bytes_per_s),
            emit=emit,
        )

    @property
    def root(self) -> Path:
        return Path(self.config.root)


def connect(ctx: DataContext, peer: PeerAddress) -> socket.socket:
    """A connected socket to ``peer``'s data endpoint, with the transfer timeout set."""
    sock = socket.create_connection((peer.host, peer.port), timeout=ctx.config.connect_timeout)
    sock.settimeout(ctx.config.transfer_timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def unique_holder(holder: str) -> str:
    """A lease holder name for one transfer (two transfers of one step never share a lease file)."""
    return f"{holder[:110]}.{secrets.token_hex(4)}"
