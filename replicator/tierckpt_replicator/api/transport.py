"""uvicorn's HTTP protocol, telling the app who the client is (``--auth tls``).

uvicorn verifies the client certificate during the handshake (``ssl.CERT_REQUIRED`` against the
tierckpt CA) but passes nothing of it to the application. ``PeerIdentityProtocol`` reads the identity
the verified certificate names once per connection and puts it into every request's ASGI scope under
``api.auth.PEER_SCOPE_KEY``, where the authorizer finds it.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tierckpt.protocol.identity import Peer, peer_of
from tierckpt_replicator.api.auth import PEER_SCOPE_KEY

__all__ = ["PeerIdentityProtocol"]


class PeerIdentityProtocol(HttpToolsProtocol):
    """httptools, plus the client certificate's identity (None without one) in each request's scope."""

    peer: Peer | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        self.peer = peer_of(ssl_object.getpeercert()) if ssl_object is not None else None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        cast("dict[str, Any]", self.scope)[PEER_SCOPE_KEY] = self.peer
