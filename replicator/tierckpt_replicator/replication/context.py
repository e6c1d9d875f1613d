"""What every piece of the data plane needs, built once by the worker process, and its connections.

``connect`` opens a connection to a peer's data endpoint and, with ``--auth tls``, completes the TLS
handshake before anything is sent: the peer must present a certificate of the tierckpt CA naming the
node the assignment says (its TLS server name), and this node presents its own; then it turns the
connection into a sealed channel (``channel.open_channel``). ``secure`` is the server side: the
handshake of an accepted connection (client certificate required) and the identity that certificate
names (the data server then accepts the channel). With legacy ``--auth token`` both are plain TCP and
the requests carry the shared token (``DataContext.token``).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

from tierckpt.protocol.codec import Message
from tierckpt.protocol.identity import Peer, TlsCredentials, TlsFiles, node_server_name, peer_of
from tierckpt.protocol.tokens import TokenFile
from tierckpt_replicator.access import JobMembers
from tierckpt_replicator.assignments import AssignmentStore, load_static
from tierckpt_replicator.identity import check_node_files
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.quota import JobQuotas
from tierckpt_replicator.replication.channel import DataConnection, open_channel
from tierckpt_replicator.replication.fences import JobFences
from tierckpt_replicator.replication.ipc import PeerAddress, WorkerConfig
from tierckpt_replicator.replication.pacing import Deadline
from tierckpt_replicator.replication.throttle import TokenBucket

__all__ = ["DataContext", "connect", "secure", "unique_holder"]

log = logging.getLogger(__name__)


def _drop(_: Message) -> None:
    pass


@dataclasses.dataclass
class DataContext:
    config: WorkerConfig
    bucket: TokenBucket
    members: JobMembers
    """Who belongs to which job, as this node knows it (the data plane's authorization)."""
    quotas: JobQuotas
    """Each job's quota: no step that declares more is sent, received or staged."""
    tokens: TokenFile | None = None
    """--auth token: the shared bearer token."""
    tls_files: TlsFiles | None = None
    """--auth tls: this node's certificate files (``credentials()`` follows them while they hold this
    node's identity)."""
    emit: Callable[[Message], None] = _drop
    fences: JobFences = dataclasses.field(default_factory=JobFences)
    """The jobs being purged on this node: no connection or task of theirs starts or goes on."""
    _tls: TlsCredentials | None = dataclasses.field(default=None, init=False, repr=False)
    _tls_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def from_config(cls, config: WorkerConfig, emit: Callable[[Message], None] = _drop) -> DataContext:
        root = Path(config.root)
        static = load_static(Path(config.peers_file)) if config.peers_file else None
        ctx = cls(
            config=config,
            bucket=TokenBucket(config.transfer.bandwidth_limit * 1e6),
            members=JobMembers(root, AssignmentStore(root, static)),
            quotas=JobQuotas(root, PolicyStore(root), config.transfer.job_quota),
            emit=emit,
            fences=JobFences(config.fenced),
        )
        if config.auth == "tls":
            key = Path(config.tls_key) if config.tls_key else None
            ctx.tls_files = TlsFiles(cert=Path(config.tls_cert), ca=Path(config.tls_ca), key=key)
            ctx.credentials()  # fail at start on unusable files
        else:
            ctx.tokens = TokenFile(config.token_file)
        return ctx

    @property
    def root(self) -> Path:
        return Path(self.config.root)

    def token(self) -> str:
        """What a request carries in ``DataRequest.token``: the shared token (``--auth token``) or ""."""
        return self.tokens.text() if self.tokens is not None else ""

    def credentials(self) -> TlsCredentials | None:
        """This node's current TLS credentials: new ones once the files changed (the daemon renewed the
        certificate), so no connection thread ever sees a context being reloaded. The files must hold
        this node's identity: at start a ``ValueError`` says why not; a later change that does not is
        refused (logged once) and the credentials in use stay."""
        if self.tls_files is None:
            return None
        with self._tls_lock:
            if self._tls is None:
                self._tls = TlsCredentials(self.tls_files, check=self._check_identity)
            else:
                try:
                    self._tls = self._tls.renewed()
                except (OSError, ValueError, ssl.SSLError) as exc:
                    log.error(
                        "refusing the replaced certificate files, keeping this node's identity: %s", exc
                    )
            return self._tls

    def _check_identity(self, files: TlsFiles) -> None:
        check_node_files(files, self.config.node)


def connect(ctx: DataContext, peer: PeerAddress) -> DataConnection:
    """A connection to ``peer``'s data endpoint, with the transfer timeout set. With TLS, the handshake
    is done and ``peer.node``'s certificate verified (``ssl.SSLError`` otherwise) before the caller
    sends a byte, and the connection is a sealed channel (a peer that refuses one: ``ProtocolError``)."""
    sock = socket.create_connection((peer.host, peer.port), timeout=ctx.config.transfer.connect_timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tls = ctx.credentials()
    if tls is None:
        sock.settimeout(ctx.config.transfer.transfer_timeout)
        return sock
    try:
        wrapped = tls.client(named=True).wrap_socket(sock, server_hostname=node_server_name(peer.node))
    except BaseException:
        sock.close()
        raise
    try:
        channel = open_channel(wrapped)
    except BaseException:
        wrapped.close()
        raise
    channel.settimeout(ctx.config.transfer.transfer_timeout)
    return channel


def secure(ctx: DataContext, conn: socket.socket, deadline: Deadline) -> tuple[socket.socket, Peer | None]:
    """The server side of ``connect``: the TLS handshake of an accepted connection (a client certificate
    of the CA required; ``ssl.SSLError`` otherwise), all of it by ``deadline`` (``TimeoutError``), and
    the identity the certificate names. Token mode: ``conn`` as it is, no identity."""
    tls = ctx.credentials()
    if tls is None:
        return conn, None
    wrapped = tls.server().wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
    try:
        deadline.arm(wrapped)  # one blocking do_handshake: the socket timeout bounds all of it
        wrapped.do_handshake()
    except BaseException:
        wrapped.close()
        raise
    return wrapped, peer_of(wrapped.getpeercert())


def unique_holder(holder: str) -> str:
    """A lease holder name for one transfer (two transfers of one step never share a lease file)."""
    return f"{holder[:110]}.{secrets.token_hex(4)}"
