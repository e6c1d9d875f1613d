"""The operator's own certificates, issued with the CA key it holds (``--auth tls``).

* its client certificate (``spiffe://tierckpt.io/operator``): presented on every call to a replicator,
  which lets it call every endpoint there;
* the signing endpoint's server certificate (the names replicators reach it by, no tierckpt identity).

Both are made at start-up into a private directory (0700, removed at exit) and renewed at two thirds
of their life; ``refresh`` reloads every context made from them, on the event loop that runs their
handshakes. The CA files are read again at each renewal (a rotated CA Secret takes effect then).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tierckpt.protocol.certs import Authority, new_key, write_identity
from tierckpt.protocol.identity import TlsCredentials, TlsFiles

__all__ = ["OperatorCredentials"]

log = logging.getLogger(__name__)

_RENEW_AT = 2 / 3


class OperatorCredentials:
    """``client``: the operator's client credentials; ``server``: the signing endpoint's (None without
    ``server_names``); ``authority``: the CA that signs node certificates."""

    def __init__(
        self,
        ca_cert: Path,
        ca_key: Path,
        bundle: Path,
        *,
        server_names: Sequence[str],
        lifetime: datetime.timedelta,
    ) -> None:
        self.ca_cert, self.ca_key, self.bundle = ca_cert, ca_key, bundle
        self.server_names, self.lifetime = tuple(server_names), lifetime
        self.directory = Path(tempfile.mkdtemp(prefix="tierckpt-operator-"))  # 0700
        self.authority = Authority.load(ca_cert, ca_key)
        self.issued_at = 0.0
        self._issue()
        self.client = TlsCredentials(TlsFiles(self.directory / "operator.pem", ca=bundle))
        self.server = (
            TlsCredentials(TlsFiles(self.directory / "issuer.pem", ca=bundle)) if self.server_names else None
        )

    def _issue(self) -> None:
        self.authority = Authority.load(self.ca_cert, self.ca_key)
        key = new_key()
        write_identity(
            self.directory / "operator.pem",
            key,
            self.authority.operator_certificate(key.public_key(), self.lifetime),
        )
        if self.server_names:
            key = new_key()
            cert = self.authority.server_certificate(key.public_key(), self.server_names, self.lifetime)
            write_identity(self.directory / "issuer.pem", key, cert)
        self.issued_at = time.time()

    def refresh(self) -> None:
        """Issue both certificates again and reload every context made from them (on the event loop)."""
        self._issue()
        self.client.refresh()
        if self.server is not None:
            self.server.refresh()
        log.info("renewed the operator's certificates (valid for %s)", self.lifetime)

    async def run(self) -> None:
        """Renew at two thirds of the certificates' life, until cancelled (a failure is retried in a
        minute: the old certificates stay valid meanwhile)."""
        while True:
            due = self.issued_at + _RENEW_AT * self.lifetime.total_seconds()
            await asyncio.sleep(max(1.0, due - time.time()))
            try:
                self.refresh()
            except Exception:
                log.exception("renewing the operator's certificates failed; retrying in a minute")
                self.issued_at = time.time() - _RENEW_AT * self.lifetime.total_seconds() + 60

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
