"""Identities in certificates (``tierckpt.protocol.identity``) and issuing them (``tierckpt.protocol.certs``):
what a certificate names, what a handshake proves, what a CSR may and may not carry, and contexts that
follow renewed files."""

from __future__ import annotations

import base64
import datetime
import os
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from tierckpt.protocol.certs import (
    Authority,
    certificate_pem,
    csr_public_key,
    issued_by,
    matches_key,
    named_peer,
    new_key,
    node_csr,
    node_identity_problem,
    private_pem,
    write_identity,
)
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.identity import (
    OPERATOR_ID,
    Peer,
    TlsCredentials,
    TlsFiles,
    node_id,
    node_server_name,
    peer_of,
)

HOUR = datetime.timedelta(hours=1)


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    authority = Authority.create()
    (tmp_path / "ca.crt").write_bytes(authority.pem)
    return authority


def issue(ca: Authority, tmp_path: Path, name: str, role: str = "node") -> TlsFiles:
    key = new_key()
    if role == "operator":
        cert = ca.operator_certificate(key.public_key(), HOUR)
    else:
        cert = ca.node_certificate(key.public_key(), name, HOUR)
    write_identity(tmp_path / f"{name}.pem", key, cert)
    return TlsFiles(tmp_path / f"{name}.pem", tmp_path / "ca.crt")


def handshake(
    server: ssl.SSLContext, client: ssl.SSLContext, name: str | None
) -> tuple[Peer | None, Peer | None]:
    """(who the server sees, who the client sees) after one handshake; raises what the client raises."""
    seen: dict[str, Peer | None] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as tls:
                    seen["server"] = peer_of(tls.getpeercert())
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                seen["server"] = None

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        raw = socket.create_connection(listener.getsockname())
        try:
            with client.wrap_socket(raw, server_hostname=name) as tls:
                seen["client"] = peer_of(tls.getpeercert())
                tls.sendall(b"x")
        finally:
            raw.close()
            thread.join(5)
    return seen.get("server"), seen.get("client")


def test_certificates_name_exactly_one_identity(ca: Authority, tmp_path: Path) -> None:
    node = issue(ca, tmp_path, "gke-pool-1-abcd")
    operator = issue(ca, tmp_path, "operator", "operator")
    assert named_peer(node.cert.read_bytes()) == Peer.of_node("gke-pool-1-abcd")
    assert named_peer(operator.cert.read_bytes()) == Peer("operator")
    assert node_id("n1") == "spiffe://tierckpt.io/node/n1" and node_server_name("n1") == "n1.node.tierckpt.io"
    # what peer_of accepts from a verified certificate (getpeercert's form)
    assert peer_of({"subjectAltName": (("URI", OPERATOR_ID),)}) == Peer("operator")
    assert peer_of(
        {"subjectAltName": (("URI", node_id("a")), ("DNS", "a.node.tierckpt.io"))}
    ) == Peer.of_node("a")
    for sans in (
        (),  # none
        (("URI", node_id("a")), ("URI", node_id("b"))),  # two identities: neither
        (("URI", "spiffe://other.org/node/a"),),  # another trust domain
        (("URI", "spiffe://tierckpt.io/node/../etc"),),  # not a node name
        (("URI", "spiffe://tierckpt.io/node/a/b"),),
        (("URI", "spiffe://tierckpt.io/admin"),),
        (("DNS", "a.node.tierckpt.io"),),  # a name alone is no identity
    ):
        assert peer_of({"subjectAltName": sans}) is None, sans
    assert peer_of(None) is None


def test_mutual_tls_proves_both_sides_and_the_server_name(ca: Authority, tmp_path: Path) -> None:
    a, b = TlsCredentials(issue(ca, tmp_path, "a")), TlsCredentials(issue(ca, tmp_path, "b"))
    operator = TlsCredentials(issue(ca, tmp_path, "operator", "operator"))
    assert handshake(a.server(), b.client(named=True), node_server_name("a")) == (
        Peer.of_node("b"),
        Peer.of_node("a"),
    )
    assert handshake(a.server(), operator.client(named=True), node_server_name("a"))[0] == Peer("operator")
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):  # b is not c
        handshake(b.server(), a.client(named=True), node_server_name("c"))
    with pytest.raises(ssl.SSLError):  # the operator's certificate is a client's only
        handshake(operator.server(), a.client(), None)
    # another CA's certificate, even one naming the operator, gets nowhere
    other = Authority.create("other")
    key = new_key()
    write_identity(tmp_path / "forged.pem", key, other.operator_certificate(key.public_key(), HOUR))
    forged = TlsCredentials(TlsFiles(tmp_path / "forged.pem", tmp_path / "ca.crt"))
    seen_by_server, _ = _server_view(a.server(), forged.client(named=True), node_server_name("a"))
    assert seen_by_server is None
    # no client certificate at all: the server refuses the handshake
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(tmp_path / "ca.crt")
    assert _server_view(a.server(), bare, node_server_name("a"))[0] is None


def _server_view(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> tuple[Peer | None, bool]:
    try:
        return handshake(server, client, name)[0], True
    except (ssl.SSLError, OSError):
        return None, False


def test_a_csr_gives_only_its_public_key_and_only_when_signed_with_it(ca: Authority) -> None:
    key = new_key()
    pem = node_csr(key, "n1")
    assert csr_public_key(pem).public_numbers() == key.public_key().public_numbers()
    der = x509.load_pem_x509_csr(pem.encode()).public_bytes(serialization.Encoding.DER)
    altered = der.replace(b"n1", b"n2", 1)  # the request says another node; its signature no longer checks
    assert altered != der
    body = base64.encodebytes(altered).decode()
    with pytest.raises(FormatError, match="signature"):
        csr_public_key(f"-----BEGIN CERTIFICATE REQUEST-----\n{body}-----END CERTIFICATE REQUEST-----\n")
    with pytest.raises(FormatError, match="PEM"):
        csr_public_key("not a csr")
    with pytest.raises(FormatError, match="exceeds"):
        csr_public_key("A" * 100_000)
    # a CSR asking to be the operator, and a CA, earns a node certificate naming only the node asked for
    sneaky = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "operator")]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(OPERATOR_ID)]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    public = csr_public_key(sneaky.public_bytes(serialization.Encoding.PEM).decode())
    cert = ca.node_certificate(public, "n1", HOUR)
    assert named_peer(certificate_pem(cert)) == Peer.of_node("n1")
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_issued_by_and_matches_key(ca: Authority, tmp_path: Path) -> None:
    files = issue(ca, tmp_path, "n1")
    pem = files.cert.read_bytes()
    assert issued_by(pem, ca.pem) and not issued_by(pem, Authority.create().pem)
    assert issued_by(pem, Authority.create().pem + ca.pem)  # a bundle during a CA rotation
    key = new_key()
    assert matches_key(certificate_pem(ca.node_certificate(key.public_key(), "n1", HOUR)), key)
    assert not matches_key(pem, key)
    expired = ca.node_certificate(key.public_key(), "n1", -datetime.timedelta(minutes=1))
    assert not issued_by(certificate_pem(expired), ca.pem)


def test_contexts_follow_renewed_files(ca: Authority, tmp_path: Path) -> None:
    files = issue(ca, tmp_path, "a")
    creds = TlsCredentials(files)
    server = creds.server()
    client = TlsCredentials(issue(ca, tmp_path, "b")).client(named=True)
    first = _presented(server, client)
    assert not creds.changed() and not creds.refresh()
    issue(ca, tmp_path, "a")  # renewed: a new key and certificate in the same file
    assert creds.changed() and creds.refresh() and creds.server() is server  # reloaded in place
    assert _presented(server, client) != first


def _presented(server: ssl.SSLContext, client: ssl.SSLContext) -> bytes:
    out: dict[str, bytes] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        thread = threading.Thread(
            target=lambda: server.wrap_socket(listener.accept()[0], server_side=True).close(), daemon=True
        )
        thread.start()
        with client.wrap_socket(
            socket.create_connection(listener.getsockname()), server_hostname=node_server_name("a")
        ) as tls:
            out["cert"] = tls.getpeercert(binary_form=True) or b""
        thread.join(5)
    return out["cert"]


def test_node_identity_problem_names_what_is_not_this_nodes(ca: Authority, tmp_path: Path) -> None:
    key = new_key()
    own = private_pem(key) + certificate_pem(ca.node_certificate(key.public_key(), "n1", HOUR))
    assert node_identity_problem(own, ca.pem, "n1") == ""
    assert node_identity_problem(own, Authority.create().pem + ca.pem, "n1") == ""  # a CA rotation's bundle
    cert_only = certificate_pem(ca.node_certificate(key.public_key(), "n1", HOUR))
    assert node_identity_problem(cert_only, ca.pem, "n1", key=private_pem(key)) == ""  # --tls-key
    cases = {
        "another node's": (own, ca.pem, "n2", "it is node/n1's certificate, not this node's (node/n2)"),
        "a foreign CA's": (own, Authority.create().pem, "n1", "it is not signed by a CA of the CA bundle"),
        "the operator's": (
            private_pem(key) + certificate_pem(ca.operator_certificate(key.public_key(), HOUR)),
            ca.pem,
            "n1",
            "it is the operator's certificate, not this node's (node/n1)",
        ),
        "a server certificate": (
            private_pem(key) + certificate_pem(ca.server_certificate(key.public_key(), ["n1"], HOUR)),
            ca.pem,
            "n1",
            "it names no tierckpt identity",
        ),
        "an expired one": (
            private_pem(key)
            + certificate_pem(ca.node_certificate(key.public_key(), "n1", -datetime.timedelta(minutes=1))),
            ca.pem,
            "n1",
            "it is not valid now",
        ),
        "another key's": (
            private_pem(new_key()) + cert_only,
            ca.pem,
            "n1",
            "the private key is not the certificate's",
        ),
        "no key": (cert_only, ca.pem, "n1", "no usable private key"),
        "not PEM": (b"junk", ca.pem, "n1", "not a PEM certificate"),
    }
    for case, (chain, bundle, node, why) in cases.items():
        assert why in node_identity_problem(chain, bundle, node), case


def test_node_identity_problem_wants_a_server_and_client_certificate(ca: Authority) -> None:
    """A certificate naming the node but usable only as a client (not one the CA issues to nodes) is
    refused too: peers could not verify it as a server."""
    key = new_key()
    client_only = ca._issue(  # the issuer's own builder, to make what it never makes
        key.public_key(),
        "n1",
        [x509.UniformResourceIdentifier(node_id("n1")), x509.DNSName(node_server_name("n1"))],
        HOUR,
        server=False,
        client=True,
    )
    why = node_identity_problem(private_pem(key) + certificate_pem(client_only), ca.pem, "n1")
    assert why.startswith("it is not a server and client certificate (extended key usage: client)")


def test_a_checked_credentials_refuses_a_change_once_and_keeps_its_contexts(
    ca: Authority, tmp_path: Path
) -> None:
    files = issue(ca, tmp_path, "a")
    own, other = files.cert.read_bytes(), issue(ca, tmp_path, "b").cert.read_bytes()
    versions = iter(range(1, 100))

    def put(data: bytes) -> None:
        """Replace a's file (each version with a modification time of its own: a new stamp)."""
        tmp = tmp_path / "a.pem.new"
        tmp.write_bytes(data)
        os.utime(tmp, ns=(0, next(versions) * 10**9))
        os.replace(tmp, files.cert)

    def only_a(f: TlsFiles) -> None:
        why = node_identity_problem(f.cert.read_bytes(), f.ca.read_bytes(), "a")
        if why:
            raise ValueError(why)

    creds = TlsCredentials(files, check=only_a)
    server = creds.server()
    client = TlsCredentials(TlsFiles(tmp_path / "b.pem", tmp_path / "ca.crt")).client(named=True)
    first = _presented(server, client)
    put(other)  # b's certificate in a's file
    assert creds.changed()
    with pytest.raises(ValueError, match="node/b's certificate"):
        creds.refresh()
    assert not creds.changed() and not creds.refresh()  # refused once, then ignored
    assert creds.renewed() is creds
    assert _presented(server, client) == first  # still a's
    put(own)  # a's own again: taken
    assert creds.changed() and creds.refresh()
    put(other)
    with pytest.raises(ValueError, match="node/b's certificate"):
        creds.renewed()
    assert creds.renewed() is creds
    put(own)
    renewed = creds.renewed()
    assert renewed is not creds and _presented(renewed.server(), client) == first
    with pytest.raises(ValueError, match="node/b's certificate"):
        TlsCredentials(TlsFiles(tmp_path / "b.pem", tmp_path / "ca.crt"), check=only_a)


@pytest.mark.parametrize(("keepalive", "connections"), [(0.3, 2), (5.0, 1)])
async def test_the_clients_tls_connection_to_a_node_is_kept_for_its_keepalive(
    ca: Authority, tmp_path: Path, keepalive: float, connections: int
) -> None:
    """The operator calls each replicator every 30 to 60 s: with a keep-alive longer than that, each
    round reuses the node's TLS connection (a handshake per node, not per call: at 4,096 nodes the
    handshakes were 28% of the operator's CPU)."""
    import asyncio

    from tests.fixtures.fake_replicators import FakeNode
    from tierckpt.protocol.client import ReplicatorClient, RetryPolicy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = FakeNode("n1", port, TlsCredentials(issue(ca, tmp_path, "n1")).server())
    await node.start()
    operator = TlsCredentials(issue(ca, tmp_path, "operator", role="operator"))
    client = ReplicatorClient(tls=operator, retry=RetryPolicy(attempts=1), keepalive=keepalive)
    try:
        for _ in range(2):
            inventory = await client.inventory(f"https://127.0.0.1:{port}", "job", node="n1")
            assert inventory is not None and inventory.node == "n1"
            await asyncio.sleep(1.0)
        assert (node.connections, node.requests) == (connections, 2)
    finally:
        await client.aclose()
        assert node.server is not None
        node.server.close()
