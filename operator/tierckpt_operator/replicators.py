"""The only module that calls the replicators' control API (``/v1`` on each node, httpx).

Retry policy lives here once: connection errors, timeouts, 429 and 5xx are retried with exponential
backoff; any other answer is final. Every request carries the bearer token, read fresh from the
mounted Secret so rotation needs no restart. Wire bodies are the typed messages of
``tierckpt.protocol.control``; malformed answers raise ``ContractError``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tierckpt.protocol.control import JobPolicy, NodeInventory, PeerAssignment, RestorePlan
from tierckpt.protocol.errors import ContractError, FormatError, RetryableError

__all__ = ["ReplicatorClient", "ReplicatorError", "TokenFile"]

log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
_MAX_BODY = 64 << 20


class ReplicatorError(RetryableError):
    """A replicator did not answer, or kept failing, after all retries."""

    def __init__(self, endpoint: str, message: str, status: int | None = None) -> None:
        super().__init__(f"replicator {endpoint}: {message}")
        self.endpoint = endpoint
        self.status = status


class TokenFile:
    """The bearer token in a file (a mounted Secret), re-read whenever the file changes (rotation)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._token = ""

    def __call__(self) -> str:
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp != self._stamp:
            token = self.path.read_text().strip()
            if not token:
                raise ContractError(f"token file {self.path} is empty")
            self._token, self._stamp = token, stamp
        return self._token


class ReplicatorClient:
    """Typed calls to one replicator at a time, sharing a connection pool and a concurrency limit."""

    def __init__(
        self,
        *,
        token: Callable[[], str | None] = lambda: None,
        timeout: float = 5.0,
        retries: int = 3,
        concurrency: int = 64,
        backoff: float = 0.2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._token = token
        self._retries = max(1, retries)
        self._backoff = backoff
        self._slots = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    # ------------------------------------------------------------------------------ API

    async def inventory(self, endpoint: str, job: str) -> NodeInventory | None:
        """What the node holds for the job; None if it holds nothing (404)."""
        resp = await self._request("GET", endpoint, f"/v1/jobs/{_seg(job)}/inventory", ok_missing=True)
        if resp is None:
            return None
        return _decode(NodeInventory, endpoint, resp)

    async def put_peers(self, endpoint: str, assignment: PeerAssignment) -> None:
        await self._request(
            "PUT", endpoint, f"/v1/jobs/{_seg(assignment.job)}/peers", body=assignment.to_bytes()
        )

    async def put_policy(self, endpoint: str, policy: JobPolicy) -> None:
        await self._request("PUT", endpoint, f"/v1/jobs/{_seg(policy.job)}/policy", body=policy.to_bytes())

    async def put_restore_plan(self, endpoint: str, plan: RestorePlan) -> None:
        await self._request("PUT", endpoint, f"/v1/jobs/{_seg(plan.job)}/restore-plan", body=plan.to_bytes())

    async def purge(self, endpoint: str, job: str, *, backups: bool = False) -> None:
        """Delete the job's data on the node (and, with ``backups``, its GCS backups); a 404 is success."""
        params = {"bucket": "true"} if backups else None
        await self._request("DELETE", endpoint, f"/v1/jobs/{_seg(job)}", params=params, ok_missing=True)

    # ------------------------------------------------------------------------------ transport

    async def _request(
        self,
        method: str,
        endpoint: str,
        path: str,
        *,
        body: bytes | None = None,
        params: dict[str, str] | None = None,
        ok_missing: bool = False,
    ) -> httpx.Response | None:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        url = _base(endpoint) + path
        last = ""
        status: int | None = None
        for attempt in range(self._retries):
            if attempt:
                await asyncio.sleep(self._backoff * 2 ** (attempt - 1))
            try:
                async with self._slots:
                    resp = await self._http.request(method, url, content=body, params=params, headers=headers)
            except httpx.HTTPError as exc:
                last, status = f"{type(exc).__name__}: {exc}".rstrip(": "), None
                continue
            status = resp.status_code
            if resp.status_code == 404 and ok_missing:
                return None
            if resp.is_success:
                return resp
            last = f"HTTP {resp.status_code} {resp.text[:300]!r}"
            if resp.status_code not in _RETRY_STATUS:
                break
        log.debug("%s %s failed: %s", method, url, last)
        raise ReplicatorError(endpoint, f"{method} {path} failed: {last}", status)


def _base(endpoint: str) -> str:
    """``scheme://host:port`` of an endpoint (a query such as ``?data=PORT`` names the data port)."""
    parts = urllib.parse.urlsplit(endpoint)
    return f"{parts.scheme}://{parts.netloc}"


def _seg(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _decode(cls: Any, endpoint: str, resp: httpx.Response) -> Any:
    if len(resp.content) > _MAX_BODY:
        raise ContractError(f"replicator {endpoint}: answer of {len(resp.content)} bytes is too large")
    try:
        return cls.from_bytes(resp.content)
    except FormatError as exc:
        raise ContractError(f"replicator {endpoint}: malformed {cls.KIND}: {exc}") from exc
