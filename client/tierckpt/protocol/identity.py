"""Who is on the other end: tierckpt identities in X.509 certificates, and the TLS contexts that carry
them (mutual TLS on the replicators' control API and data plane; spec: docs/security.md).

Every certificate is issued by the release's tierckpt CA and names exactly one identity as a SPIFFE
URI in its subjectAltName:

* ``spiffe://tierckpt.io/node/<node>``: the replicator of Kubernetes node ``<node>`` (also a DNS name
  ``<node>.node.tierckpt.io``, which clients verify as the server name: a connection to a peer only
  succeeds if that peer's certificate names the node the assignment says);
* ``spiffe://tierckpt.io/operator``: the operator (a client certificate only).

``peer_of`` reads the identity from a verified peer certificate (``SSLSocket.getpeercert()``).
``TlsFiles`` names the PEM files (a certificate chain with its key, the CA bundle);
``TlsCredentials`` makes the server and client contexts from them (TLS 1.3 only, client certificates
required) and reloads them in place when the files change (``refresh``), unless its ``check`` refuses
the new files (a replicator's: they must hold its own node identity).

Only the standard library: issuing certificates (``tierckpt.protocol.certs``) needs ``cryptography``,
verifying and presenting them does not.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import check_holder

__all__ = [
    "OPERATOR_ID",
    "TRUST_DOMAIN",
    "CertificateIssued",
    "CertificateRequest",
    "Peer",
    "TlsCredentials",
    "TlsFiles",
    "ca_client_context",
    "node_id",
    "node_server_name",
    "peer_from_id",
    "peer_of",
]

TRUST_DOMAIN = "tierckpt.io"
OPERATOR_ID = f"spiffe://{TRUST_DOMAIN}/operator"
_NODE_PREFIX = f"spiffe://{TRUST_DOMAIN}/node/"
_OURS = f"spiffe://{TRUST_DOMAIN}/"

Role = Literal["operator", "node"]


@dataclasses.dataclass(frozen=True)
class Peer:
    """The identity a verified certificate names: the operator, or one node's replicator."""

    role: Role
    node: str = ""
    """The node's name (role ``node``); "" for the operator."""

    def __str__(self) -> str:
        return "operator" if self.role == "operator" else f"node/{self.node}"

    @classmethod
    def of_node(cls, node: str) -> Peer:
        return cls("node", check_holder(node))


OPERATOR = Peer("operator")


def node_id(node: str) -> str:
    """The SPIFFE ID of ``node``'s replicator."""
    return _NODE_PREFIX + check_holder(node)


def node_server_name(node: str) -> str:
    """The DNS name in ``node``'s certificate that clients verify (the TLS server name they ask for)."""
    return f"{check_holder(node)}.node.{TRUST_DOMAIN}"


def peer_from_id(uri: str) -> Peer | None:
    """The identity a SPIFFE ID of our trust domain names; None for anything else."""
    if uri == OPERATOR_ID:
        return OPERATOR
    if uri.startswith(_NODE_PREFIX):
        try:
            return Peer.of_node(uri[len(_NODE_PREFIX) :])
        except FormatError:
            return None
    return None


def peer_of(cert: dict[str, Any] | None) -> Peer | None:
    """The identity of a verified peer certificate (``getpeercert()``); None unless it names exactly one
    identity of our trust domain."""
    if not cert:
        return None
    ours = [v for kind, v in cert.get("subjectAltName", ()) if kind == "URI" and v.startswith(_OURS)]
    if len(ours) != 1:
        return None
    return peer_from_id(ours[0])


# ------------------------------------------------------------------------------------ signing messages


@dataclasses.dataclass(frozen=True)
class CertificateRequest(Message):
    """The body of ``POST /v1/node-certificates`` (the operator's signing endpoint), sent with the
    replicator's projected ServiceAccount token as its bearer token. Only the CSR's public key (and its
    signature, the proof of possession) is used: the operator decides what the certificate says."""

    KIND = "tierckpt.certificate-request"
    VERSION = 1

    node: str
    """The node the replicator runs on (must be the node its token's pod is bound to)."""
    csr: str
    """A PEM certificate signing request made with the replicator's own private key."""


@dataclasses.dataclass(frozen=True)
class CertificateIssued(Message):
    """The answer: the node's certificate and the CA bundle it chains to."""

    KIND = "tierckpt.certificate-issued"
    VERSION = 1

    node: str
    certificate: str
    """PEM: the node's certificate."""
    ca: str
    """PEM: the CA certificate(s) that verify every tierckpt peer."""
    not_after: float
    """When the certificate expires (Unix time)."""


# ------------------------------------------------------------------------------------ TLS contexts


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """The PEM files of one identity: ``cert`` (the certificate chain; it may hold the private key too),
    ``key`` (the private key, unless it is in ``cert``) and ``ca`` (the CA bundle peers are verified
    against)."""

    cert: Path
    ca: Path
    key: Path | None = None

    def stamp(self) -> tuple[tuple[int, int], ...]:
        """Changes whenever one of the files is replaced or rewritten."""
        out = []
        for path in (self.cert, self.key, self.ca):
            if path is not None:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_ino))
        return tuple(out)

    def load_into(self, ctx: ssl.SSLContext) -> None:
        ctx.load_cert_chain(str(self.cert), str(self.key) if self.key is not None else None)
        ctx.load_verify_locations(cafile=str(self.ca))


def _tls13(ctx: ssl.SSLContext) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def ca_client_context(ca: str | os.PathLike[str]) -> ssl.SSLContext:
    """A client context that verifies servers (and their DNS names) against ``ca`` and presents no
    certificate: a replicator asking the operator for its first certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


ContextKind = Literal["server", "server-open", "client", "client-named"]


class TlsCredentials:
    """Contexts made from ``files``: ``server()`` requires and verifies client certificates
    (``server(clients=False)`` asks for none: the operator's signing endpoint, whose callers have no
    certificate yet); ``client(named=True)`` also verifies the server's name (the node the caller
    expects, given as the TLS server name); ``client()`` accepts any certificate of the CA.

    Each kind is made once and then reloaded in place by ``refresh()`` when the files change. Call
    ``refresh`` from the thread that runs the handshakes (the event loop): OpenSSL does not guard a
    context being reloaded against a handshake in another thread. Threaded servers take ``renewed()``
    instead: new credentials once the files changed.

    ``check(files)`` (optional) raises ``ValueError`` for files that must not be used: at construction,
    and for every change of the files. A refused change raises once (from ``refresh`` or ``renewed``)
    and is then ignored: the contexts keep what they hold until the files change again.
    """

    def __init__(self, files: TlsFiles, *, check: Callable[[TlsFiles], None] | None = None) -> None:
        self.files = files
        self.check = check
        self._lock = threading.Lock()
        self._contexts: dict[ContextKind, ssl.SSLContext] = {}
        self._stamp = files.stamp()
        self._refused: tuple[tuple[int, int], ...] | None = None
        if check is not None:
            check(files)
        self.server()  # fail fast on unreadable or mismatched files

    def server(self, *, clients: bool = True) -> ssl.SSLContext:
        return self._context("server" if clients else "server-open")

    def client(self, *, named: bool = False) -> ssl.SSLContext:
        return self._context("client-named" if named else "client")

    def _context(self, kind: ContextKind) -> ssl.SSLContext:
        with self._lock:
            ctx = self._contexts.get(kind)
            if ctx is None:
                if kind in ("server", "server-open"):
                    ctx = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
                    if kind == "server-open":
                        ctx.verify_mode = ssl.CERT_NONE
                else:
                    ctx = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
                    ctx.check_hostname = kind == "client-named"
                self.files.load_into(ctx)
                self._contexts[kind] = ctx
            return ctx

    def changed(self) -> bool:
        """Whether the files changed since the contexts were loaded (a refused change does not count)."""
        try:
            return self.files.stamp() not in (self._stamp, self._refused)
        except FileNotFoundError:
            return False  # mid-replacement: the next look sees the new files

    def refresh(self) -> bool:
        """Reload every context made so far if the files changed; True if they did. Files ``check``
        refuses raise its ``ValueError`` (once) and leave the contexts as they are."""
        if not self.changed():
            return False
        with self._lock:
            stamp = self.files.stamp()
            self._vet(stamp)
            for ctx in self._contexts.values():
                self.files.load_into(ctx)
            self._stamp = stamp
        return True

    def renewed(self) -> TlsCredentials:
        """These credentials while the files are unchanged, else new ones made from them (a threaded
        server never reloads a context that a handshake in another thread may be using). Files
        ``check`` refuses raise its ``ValueError`` (once); these credentials stay in use."""
        if not self.changed():
            return self
        with self._lock:
            self._vet(self.files.stamp())
        return TlsCredentials(self.files, check=self.check)

    def _vet(self, stamp: tuple[tuple[int, int], ...]) -> None:
        if self.check is None:
            return
        try:
            self.check(self.files)
        except ValueError:
            self._refused = stamp
            raise
