"""The one client of other replicators' control APIs (httpx, bearer token, bounded timeouts)."""

from __future__ import annotations

import logging

import httpx

from tierckpt.protocol.control import NodeInventory, PeerNode
from tierckpt.protocol.errors import FormatError, RetryableError
from tierckpt.protocol.tokens import TokenFile
from tierckpt_replicator.assignments import api_url

__all__ = ["PeerClient"]

log = logging.getLogger(__name__)

MAX_INVENTORY_BYTES = 64 << 20


class PeerClient:
    """``await inventory(node, job)``; every failure is a ``RetryableError`` (the node is unknown now)."""

    def __init__(
        self, tokens: TokenFile, *, timeout: float, transport: httpx.AsyncBaseTransport | None = None
    ):
        self.tokens = tokens
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport, follow_redirects=False)

    async def close(self) -> None:
        await self._client.aclose()

    async def inventory(self, name: str, node: PeerNode, job: str) -> NodeInventory:
        url = f"{api_url(node)}/v1/jobs/{job}/inventory"
        try:
            resp = await self._client.get(url, headers={"Authorization": f"Bearer {self.tokens.text()}"})
        except (httpx.HTTPError, OSError) as exc:
            raise RetryableError(f"inventory of {name} at {url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise RetryableError(f"inventory of {name}: HTTP {resp.status_code}")
        if len(resp.content) > MAX_INVENTORY_BYTES:
            raise RetryableError(f"inventory of {name}: {len(resp.content)} bytes is too large")
        try:
            inv = NodeInventory.from_bytes(resp.content)
        except FormatError as exc:
            raise RetryableError(f"inventory of {name}: malformed ({exc})") from exc
        if inv.job != job or inv.node != name:
            raise RetryableError(f"inventory of {name}: answers for {inv.node}/{inv.job}")
        return inv
