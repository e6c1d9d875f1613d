"""Making tierckpt certificates: the CA, keys, signing requests and the certificates it issues.

The identities and what each certificate says are ``tierckpt.protocol.identity``'s; this module does the
cryptography (the ``cryptography`` package, in the replicator, operator and demo extras):

* ``Authority``: the tierckpt CA (made by the chart, cert-manager or the demo rig; its key is read only
  by the operator) issuing node, operator and server certificates;
* ``new_key``/``node_csr``: what a replicator makes for itself (its key never leaves the node);
* ``csr_public_key``: the public key of a request whose signature checks (proof of possession);
* ``node_identity_problem``: what keeps a certificate (and its key) from being a node's own identity;
* ``write_identity``: a private key and its certificate in one 0600 file, replaced atomically (a
  reader never sees a key that does not match the certificate).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TypeAlias

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.identity import OPERATOR_ID, Peer, node_id, node_server_name, peer_from_id

__all__ = [
    "Authority",
    "PrivateKey",
    "PublicKey",
    "certificate_pem",
    "csr_public_key",
    "issued_by",
    "matches_key",
    "named_peer",
    "new_key",
    "node_csr",
    "node_identity_problem",
    "private_pem",
    "validity",
    "write_identity",
    "write_private",
]

PrivateKey: TypeAlias = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
PublicKey: TypeAlias = ec.EllipticCurvePublicKey | rsa.RSAPublicKey

_SKEW = datetime.timedelta(minutes=5)
"""Certificates are valid from a little before their issue: clocks of nodes differ."""
_MAX_CSR_BYTES = 16 << 10


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh P-256 key (fast to make, small handshakes)."""
    return ec.generate_private_key(ec.SECP256R1())


def private_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def certificate_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _common_name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text[:64])])  # X.509's upper bound


def node_csr(key: PrivateKey, node: str) -> str:
    """A signing request for ``node``'s certificate, signed with ``key`` (PEM)."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_common_name(node))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(node_id(node)), x509.DNSName(node_server_name(node))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def csr_public_key(pem: str) -> PublicKey:
    """The public key of a PEM signing request, once its signature checks; ``FormatError`` otherwise.
    Nothing else of the request is trusted."""
    if len(pem) > _MAX_CSR_BYTES:
        raise FormatError(f"certificate request of {len(pem)} bytes exceeds {_MAX_CSR_BYTES}")
    try:
        csr = x509.load_pem_x509_csr(pem.encode())
    except ValueError as exc:
        raise FormatError(f"not a PEM certificate request: {exc}") from exc
    if not csr.is_signature_valid:
        raise FormatError("the certificate request's signature does not match its key")
    key = csr.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey) and key.curve.key_size >= 256:
        return key
    if isinstance(key, rsa.RSAPublicKey) and key.key_size >= 2048:
        return key
    raise FormatError("the request's key must be EC (P-256 or larger) or RSA (2048 bits or more)")


def _spki(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _certificates(pem: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise FormatError(f"not PEM certificates: {exc}") from exc


def validity(pem: bytes) -> tuple[float, float]:
    """When the first certificate of ``pem`` becomes valid and when it expires (Unix times)."""
    cert = _certificates(pem)[0]
    return cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()


def named_peer(pem: bytes) -> Peer | None:
    """The tierckpt identity the first certificate of ``pem`` names (its one SPIFFE URI of our trust
    domain), or None."""
    try:
        cert = _certificates(pem)[0]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (FormatError, x509.ExtensionNotFound):
        return None
    found = [p for u in san.get_values_for_type(x509.UniformResourceIdentifier) if (p := peer_from_id(u))]
    return found[0] if len(found) == 1 else None


def matches_key(pem: bytes, key: PrivateKey) -> bool:
    """Whether the first certificate of ``pem`` is for ``key``."""
    try:
        return _spki(_certificates(pem)[0].public_key()) == _spki(key.public_key())
    except FormatError:
        return False


def issued_by(pem: bytes, ca_bundle: bytes) -> bool:
    """Whether the first certificate of ``pem`` was signed by one of the CA certificates in ``ca_bundle``
    and is valid now."""
    try:
        cert = _certificates(pem)[0]
        cas = _certificates(ca_bundle)
    except FormatError:
        return False
    now = datetime.datetime.now(datetime.timezone.utc)
    if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc:
        return False
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


def node_identity_problem(chain: bytes, ca_bundle: bytes, node: str, *, key: bytes | None = None) -> str:
    """What keeps the first certificate of ``chain`` (PEM; the file may hold its private key too) from
    being ``node``'s replicator identity under the CA certificates of ``ca_bundle``, or "" when nothing
    does. It must be valid now, issued by one of those CAs, name exactly ``node``'s identity and carry
    the DNS name peers ask for, be usable as a TLS server and client, and be the certificate of the
    private key in ``key`` (default: the one in ``chain``)."""
    try:
        cert = _certificates(chain)[0]
        _certificates(ca_bundle)
    except (FormatError, IndexError) as exc:
        return f"not a PEM certificate and CA bundle ({exc or 'no certificate'})"
    now = datetime.datetime.now(datetime.timezone.utc)
    if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc:
        span = f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} to {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        return f"it is not valid now (valid from {span})"
    if not issued_by(chain, ca_bundle):
        return "it is not signed by a CA of the CA bundle"
    own = Peer.of_node(node)
    named = named_peer(chain)
    if named is None:
        return f"it names no tierckpt identity (a node's names {node_id(node)})"
    if named != own:
        who = "the operator's" if named.role == "operator" else f"{named}'s"
        return f"it is {who} certificate, not this node's ({own})"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    if node_server_name(node) not in san.get_values_for_type(x509.DNSName):
        return f"it lacks the DNS name {node_server_name(node)} that peers verify"
    try:
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        usages = set()
    wanted = {ExtendedKeyUsageOID.SERVER_AUTH: "server", ExtendedKeyUsageOID.CLIENT_AUTH: "client"}
    if not set(wanted) <= usages:
        has = ", ".join(name for oid, name in wanted.items() if oid in usages) or "neither"
        return f"it is not a server and client certificate (extended key usage: {has}); a node's is both"
    try:
        private = serialization.load_pem_private_key(chain if key is None else key, password=None)
    except (ValueError, TypeError) as exc:
        return f"no usable private key for it ({exc})"
    if _spki(private.public_key()) != _spki(cert.public_key()):
        return "the private key is not the certificate's"
    return ""


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, readable by its owner only (0600) from the start."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_identity(path: str | os.PathLike[str], key: PrivateKey, cert: x509.Certificate | bytes) -> None:
    """The key and its certificate in one private file (``TlsFiles(cert=path)`` reads both)."""
    cert_bytes = cert if isinstance(cert, bytes) else certificate_pem(cert)
    write_private(path, private_pem(key) + cert_bytes)


@dataclasses.dataclass(frozen=True)
class Authority:
    """A CA certificate and its key, issuing tierckpt certificates."""

    certificate: x509.Certificate
    key: PrivateKey

    @classmethod
    def create(cls, common_name: str = "tierckpt-ca", days: int = 3650) -> Authority:
        key = new_key()
        now = datetime.datetime.now(datetime.timezone.utc)
        name = _common_name(common_name)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> Authority:
        """The CA from its PEM files (the chart's or cert-manager's Secret: tls.crt and tls.key)."""
        try:
            certificate = _certificates(Path(cert).read_bytes())[0]
            private = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
        except (OSError, ValueError) as exc:
            raise FormatError(f"cannot load the CA from {cert} and {key}: {exc}") from exc
        if not isinstance(private, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
            raise FormatError(f"the CA key in {key} is neither EC nor RSA")
        if _spki(private.public_key()) != _spki(certificate.public_key()):
            raise FormatError(f"the CA key in {key} does not match the certificate in {cert}")
        return cls(certificate, private)

    @property
    def pem(self) -> bytes:
        return certificate_pem(self.certificate)

    def save(self, cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> None:
        Path(cert).write_bytes(self.pem)
        write_private(key, private_pem(self.key))

    def node_certificate(
        self, public_key: PublicKey, node: str, lifetime: datetime.timedelta
    ) -> x509.Certificate:
        """``node``'s replicator: a server and client certificate naming only that node."""
        sans: list[x509.GeneralName] = [
            x509.UniformResourceIdentifier(node_id(node)),
            x509.DNSName(node_server_name(node)),
        ]
        return self._issue(public_key, node, sans, lifetime, server=True, client=True)

    def operator_certificate(self, public_key: PublicKey, lifetime: datetime.timedelta) -> x509.Certificate:
        """The operator: a client certificate only."""
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(OPERATOR_ID)]
        return self._issue(public_key, "tierckpt-operator", sans, lifetime, server=False, client=True)

    def server_certificate(
        self, public_key: PublicKey, names: Sequence[str], lifetime: datetime.timedelta
    ) -> x509.Certificate:
        """A server certificate for DNS names and IP addresses (the operator's signing endpoint); it
        names no tierckpt identity, so it authorizes nothing as a client."""
        if not names:
            raise ValueError("a server certificate needs at least one name")
        sans: list[x509.GeneralName] = []
        for name in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        return self._issue(public_key, names[0], sans, lifetime, server=True, client=False)

    def _authority_key_id(self) -> x509.AuthorityKeyIdentifier:
        """The CA's own key identifier, as its certificate states it (verifiers find the issuer by it;
        Helm's genCA, for one, does not derive it from the key the way RFC 5280 suggests)."""
        try:
            ski = self.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        except x509.ExtensionNotFound:
            return x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key())
        return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)

    def _issue(
        self,
        public_key: PublicKey,
        common_name: str,
        sans: list[x509.GeneralName],
        lifetime: datetime.timedelta,
        *,
        server: bool,
        client: bool,
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.timezone.utc)
        not_after = min(now + lifetime, self.certificate.not_valid_after_utc)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
        return (
            x509.CertificateBuilder()
            .subject_name(_common_name(common_name))
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=isinstance(public_key, rsa.RSAPublicKey),
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(self._authority_key_id(), critical=False)
            .sign(self.key, hashes.SHA256())
        )
