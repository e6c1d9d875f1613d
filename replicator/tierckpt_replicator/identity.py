"""This node's TLS identity (``--auth tls``): the certificate it presents to peers and the operator.

Two sources:

* local mode (``--tls-cert``): files issued by the demo rig's CA (or by hand), used as they are;
* Kubernetes (``--issuer-url``): the replicator makes its own P-256 key (it never leaves the node),
  sends a signing request to the operator (``POST /v1/node-certificates``) with its projected
  ServiceAccount token as the bearer token, and keeps the answer with its key in one 0600 file in
  ``--identity-dir`` (0700). The operator verifies the token with a TokenReview and signs only a
  certificate for the node that token's pod is bound to. The certificate is renewed at two thirds of
  its life (a new key each time); a still-valid certificate is reused after a restart, so a
  replicator restarting while the operator is away keeps serving.

``NodeIdentity.obtain()`` waits (retrying with backoff) until a certificate is at hand;
``NodeIdentity.run(reload)`` renews it forever. The contexts read the files
(``tierckpt.protocol.identity.TlsCredentials``); ``reload`` reloads them.

Whatever the source, the files must hold THIS node's identity (``check_node_files``): a certificate of
the configured CA (``--tls-ca``), valid now, naming this node (``--node-name``) and usable as a server
and a client, with its own key. Another node's certificate, one of a foreign CA or the operator's
client-only one is refused: at start the replicator exits with the reason (``IdentityRefused``); files
replaced later by such a certificate are refused at reload, logged as an error, and the identity in use
stays (peers would refuse the other one; until it expires, the node keeps serving).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import Callable

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from tierckpt.protocol.api import ISSUE_CERTIFICATE
from tierckpt.protocol.certs import (
    new_key,
    node_csr,
    node_identity_problem,
    private_pem,
    validity,
    write_identity,
)
from tierckpt.protocol.errors import FormatError, RetryableError
from tierckpt.protocol.identity import (
    CertificateIssued,
    CertificateRequest,
    TlsCredentials,
    TlsFiles,
    ca_client_context,
)
from tierckpt_replicator.settings import Settings

__all__ = ["IdentityRefused", "NodeIdentity", "check_node_files"]

log = logging.getLogger(__name__)

_RENEW_AT = 2 / 3
"""Renew once this fraction of the certificate's life has passed."""
_MAX_ANSWER = 64 << 10
_IDENTITY_FILE = "node.pem"


class _Refused(RetryableError):
    """The operator did not issue a certificate (it may be starting, or this pod not yet known)."""


class IdentityRefused(ValueError):
    """This node's certificate files do not hold its own identity (the replicator does not start)."""


def check_node_files(files: TlsFiles, node: str) -> None:
    """``ValueError`` saying what is wrong unless ``files`` hold ``node``'s own replicator identity:
    the certificate is valid now, signed by a CA of ``files.ca``, names ``node`` (its SPIFFE ID and
    server name), is a server and client certificate, and ``files.key`` (or the certificate's file)
    holds its private key."""
    try:
        chain, ca = files.cert.read_bytes(), files.ca.read_bytes()
        key = files.key.read_bytes() if files.key is not None else None
    except OSError as exc:
        raise ValueError(f"cannot read this node's certificate files: {exc}") from exc
    why = node_identity_problem(chain, ca, node, key=key)
    if why:
        raise ValueError(f"{files.cert} does not hold this node's identity: {why} (CA bundle {files.ca})")


class NodeIdentity:
    def __init__(self, settings: Settings) -> None:
        settings.check_credentials()
        assert settings.auth == "tls" and settings.tls_ca is not None and settings.identity_dir is not None
        self.settings = settings
        self.node = settings.node_name
        self.ca = settings.tls_ca
        self.issued = settings.tls_cert is None
        if self.issued:
            self.files = TlsFiles(cert=settings.identity_dir / _IDENTITY_FILE, ca=self.ca)
        else:
            assert settings.tls_cert is not None
            self.files = TlsFiles(cert=settings.tls_cert, key=settings.tls_key, ca=self.ca)
        self.obtained_at = self.not_after = 0.0

    def credentials(self) -> TlsCredentials:
        """Contexts from the files, which must hold this node's identity (``ValueError`` otherwise, also
        when a later change of the files is refused: see ``TlsCredentials.check``)."""
        return TlsCredentials(self.files, check=self.check)

    def check(self, files: TlsFiles) -> None:
        check_node_files(files, self.node)

    @property
    def renew_at(self) -> float:
        """Two thirds of the way from when this process got the certificate to its expiry (from the
        moment it was obtained, not its notBefore, which the issuer backdates for clock skew)."""
        return self.obtained_at + _RENEW_AT * (self.not_after - self.obtained_at)

    def _use(self, pem: bytes) -> None:
        self.obtained_at, self.not_after = time.time(), validity(pem)[1]

    # ------------------------------------------------------------------ lifecycle

    def loaded(self) -> NodeIdentity:
        """This identity with its static files (``--tls-cert``) loaded; ``IdentityRefused`` if they do not
        load or do not hold this node's identity (an issued certificate must be ``obtain``-ed first)."""
        if self.issued:
            raise ValueError("--issuer-url: obtain() the certificate before the daemon is built")
        try:
            self.credentials()  # this node's identity, and the files load into TLS contexts
            self._use(self.files.cert.read_bytes())
        except ValueError as exc:  # the check says what the files hold instead, and where they are
            raise IdentityRefused(f"--tls-cert: {exc}") from exc
        except (OSError, ssl.SSLError) as exc:
            raise IdentityRefused(f"cannot load --tls-cert {self.files.cert}: {exc}") from exc
        return self

    async def obtain(self) -> None:
        """Make sure a usable certificate is on disk: a static one, a kept one with more than a third of
        its life left, or a new one from the operator (retried with backoff until it comes)."""
        if not self.issued:
            self.loaded()
            return
        directory = self.files.cert.parent
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)
        if self._kept():
            log.info("reusing this node's certificate (valid until %s)", time.ctime(self.not_after))
            return
        await self._request_until_issued()

    async def run(self, reload: Callable[[], bool]) -> None:
        """Renew at two thirds of the certificate's life, forever; static files are looked at every
        ``--tls-reload-interval`` (replaced by hand or by the rig). ``reload()`` loads changed files into
        every context and says whether it did (False: unchanged, or refused and the identity in use
        stays)."""
        while not self.issued:
            await asyncio.sleep(self.settings.tls_reload_interval)
            if reload():
                with contextlib.suppress(OSError, ValueError, FormatError):
                    self._use(self.files.cert.read_bytes())
        while True:
            await asyncio.sleep(max(0.0, self.renew_at - time.time()))
            await self._request_until_issued()
            reload()

    # ------------------------------------------------------------------ internals

    def _kept(self) -> bool:
        """Whether the certificate kept from an earlier run is this node's, from the current CA, loads
        with its key, and has more than a third of its life left."""
        if not self.files.cert.exists():
            return False
        try:
            self.credentials()
            pem = self.files.cert.read_bytes()
        except (OSError, ValueError, ssl.SSLError) as exc:
            log.info("not reusing the kept certificate (%s); asking for a new one", exc)
            return False
        not_before, not_after = validity(pem)
        if not_after - time.time() <= (1 - _RENEW_AT) * (not_after - not_before):
            return False  # due for renewal anyway
        self._use(pem)
        return True

    async def _request_until_issued(self) -> None:
        def failed(attempt: RetryCallState) -> None:
            exc = attempt.outcome.exception() if attempt.outcome is not None else None
            log.warning(
                "no certificate from %s yet (try %d): %s; retrying in %.0fs",
                self.settings.issuer_url,
                attempt.attempt_number,
                exc,
                attempt.upcoming_sleep,
            )

        tries = AsyncRetrying(  # forever: without a certificate the node can neither serve nor send
            wait=wait_exponential(multiplier=0.5, max=30.0),
            retry=retry_if_exception_type((RetryableError, httpx.TransportError, OSError)),
            before_sleep=failed,
            reraise=True,
        )
        await tries(self._request)

    async def _request(self) -> None:
        key = new_key()
        body = CertificateRequest(node=self.node, csr=node_csr(key, self.node)).to_bytes()
        token = self.settings.issuer_token_file.read_text().strip()  # re-read: the kubelet rotates it
        url = self.settings.issuer_url.rstrip("/") + ISSUE_CERTIFICATE.path
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        async with httpx.AsyncClient(
            verify=ca_client_context(self.ca), timeout=10.0, trust_env=False
        ) as http:
            resp = await http.post(url, content=body, headers=headers)
        if resp.status_code != 200 or len(resp.content) > _MAX_ANSWER:
            raise _Refused(f"HTTP {resp.status_code}: {resp.text[:300]!r}")
        try:
            pem = CertificateIssued.from_bytes(resp.content).certificate.encode()
        except FormatError as exc:
            raise _Refused(f"unusable answer: {exc}") from exc
        why = node_identity_problem(pem, self.ca.read_bytes(), self.node, key=private_pem(key))
        if why:
            raise _Refused(f"unusable certificate: {why} (CA bundle {self.ca})")
        write_identity(self.files.cert, key, pem)
        self._use(pem)
        log.info("obtained this node's certificate (valid until %s)", time.ctime(self.not_after))
