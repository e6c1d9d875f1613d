"""THE client of the replicator's control API (``tierckpt.protocol.api``): ``ReplicatorClient`` for
asyncio (the operator, a replicator asking its peers) and ``SyncReplicatorClient`` for threads (the
demo, tests, benchmarks).

Both share everything but the transport: requests are built from the endpoint table (path
parameters checked against the table's patterns and URL-quoted), answers are read up to
``max_answer_bytes`` and decoded into the endpoint's typed message, and one retry policy applies
(``RetryPolicy``, on tenacity): connection errors, timeouts, 408, 425, 429 and 5xx are retried with
exponential backoff; any other answer is final. Failures raise ``ReplicatorError`` (a
``RetryableError`` carrying the endpoint and the last HTTP status); a malformed or oversized answer
raises ``ContractError``.

Credentials: with ``tls`` (``tierckpt.protocol.identity.TlsCredentials``), every call goes over mutual
TLS (``https://`` endpoints only: a plain ``http://`` endpoint is refused before anything is sent), and
a call given the ``node`` it is meant for verifies that the server's certificate names that node before
the request is sent (the TLS server name). With ``token`` (legacy ``--auth token``), the bearer token is
read fresh from ``TokenFile`` for every request, so rotation needs no restart.

This module needs httpx and tenacity, which the ``client`` extra installs (the replicator, operator and
demo extras include it); it and its transport to named nodes (``tierckpt.protocol.node_transport``) are
the only modules of ``tierckpt`` that import an HTTP library.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import ssl
import urllib.parse
import weakref
from typing import Any, TypeVar

import httpx
import tenacity

from tierckpt.protocol import api
from tierckpt.protocol.codec import Message, Record, encode_from_parts, record_bytes
from tierckpt.protocol.control import (
    PLAN_PARTS,
    BackupResult,
    JobPolicy,
    NodeInventory,
    NodePlan,
    NodePlanResult,
    NodeStatus,
    PeerAssignment,
    PurgeResult,
    RestoreAccepted,
    RestorePlan,
)
from tierckpt.protocol.errors import ContractError, FormatError, RetryableError
from tierckpt.protocol.identity import TlsCredentials, node_server_name
from tierckpt.protocol.node_transport import NodeTransport
from tierckpt.protocol.orbax import OrbaxSession
from tierckpt.protocol.tokens import TokenFile

__all__ = [
    "MAX_ANSWER_BYTES",
    "ONE_ATTEMPT",
    "RETRY_STATUSES",
    "ReplicatorClient",
    "ReplicatorError",
    "RetryPolicy",
    "SyncReplicatorClient",
    "api_base",
]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

RETRY_STATUSES = frozenset({408, 425, 429, *range(500, 600)})
"""Answers worth asking again: request timeout, too early, too many requests, any server error."""
MAX_ANSWER_BYTES = 64 << 20
"""The largest answer read by default (an inventory of a big job is a few MiB)."""


class ReplicatorError(RetryableError):
    """A replicator did not answer, refused, or kept failing after all retries."""

    def __init__(self, endpoint: str, message: str, status: int | None = None) -> None:
        super().__init__(f"replicator {endpoint}: {message}")
        self.endpoint = endpoint
        self.status = status
        """The last HTTP status (None: no answer at all)."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries per call; pauses start at ``backoff`` seconds, doubling up to ``max_backoff``."""

    attempts: int = 3
    backoff: float = 0.2
    max_backoff: float = 10.0

    def tenacity_args(self) -> dict[str, Any]:
        """The same arguments for ``tenacity.Retrying`` and ``tenacity.AsyncRetrying``."""
        return {
            "stop": tenacity.stop_after_attempt(max(1, self.attempts)),
            "wait": tenacity.wait_exponential(multiplier=self.backoff, max=self.max_backoff),
            "retry": tenacity.retry_if_exception_type(_Transient),
            "reraise": True,
        }


ONE_ATTEMPT = RetryPolicy(attempts=1)
"""No retry: for callers that ask again at their own pace (a replicator asking its peers)."""


def api_base(endpoint: str) -> str:
    """``scheme://host:port`` of a replicator endpoint (a ``PeerNode.endpoint`` may add ``?data=PORT``)."""
    parts = urllib.parse.urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError as exc:
        raise ContractError(f"replicator endpoint {endpoint!r}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ContractError(f"replicator endpoint {endpoint!r} is not http(s)://host:port")
    return f"{parts.scheme}://{parts.netloc}"


# ------------------------------------------------------------------------------------ shared core


class _Transient(Exception):
    """One attempt failed in a way worth retrying (no answer, or a status in ``RETRY_STATUSES``)."""

    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclasses.dataclass(frozen=True)
class _Request:
    """One call, built from the endpoint table; the same for both transports."""

    spec: api.Endpoint
    endpoint: str
    url: str
    path: dict[str, str]
    headers: dict[str, str]
    content: bytes | None = None
    body: Message | None = None
    params: dict[str, str] | None = None
    missing_ok: bool = False
    """A 404 answers None (the node has no such job) instead of raising."""
    node: str | None = None
    """The node the server must be (its certificate, over TLS) and the answer must come from (an
    inventory's ``node``)."""
    timeout: float | None = None

    @property
    def what(self) -> str:
        return f"{self.spec.method} {urllib.parse.urlsplit(self.url).path}"


def _build(
    spec: api.Endpoint,
    endpoint: str,
    token: TokenFile | None,
    tls: bool,
    *,
    body: Message | None = None,
    flags: dict[str, bool] | None = None,
    **kw: Any,
) -> _Request:
    path = {name: kw.pop(name) for name in spec.path_params}
    for name, value in path.items():
        if not isinstance(value, str) or not re.fullmatch(api.PATH_PARAMS[name].pattern, value):
            raise ContractError(f"{spec.name}: invalid {name} {value!r}")
    wanted = spec.request
    if (body is None) if wanted is not None else (body is not None):
        raise TypeError(f"{spec.name} takes {wanted.__name__ if wanted else 'no'} body")
    if wanted is not None and not isinstance(body, wanted):
        raise TypeError(f"{spec.name} takes a {wanted.__name__} body, not {type(body).__name__}")
    headers = {"Accept": "application/json"}
    if spec.auth and token is not None:
        try:
            headers["Authorization"] = f"Bearer {token.text()}"
        except (OSError, ValueError) as exc:
            raise ContractError(f"cannot read the bearer token from {token.path}: {exc}") from exc
    if body is not None:
        headers["Content-Type"] = "application/json"
    known = {q.name for q in spec.query}
    params = {name: "true" for name, on in (flags or {}).items() if on and name in known} or None
    base = api_base(endpoint)
    if tls and not base.startswith("https://"):
        raise ContractError(f"{spec.name}: refusing {endpoint!r}: this client speaks only mutual TLS (https)")
    url = base + spec.url_path(**path)
    content = _encoded(body) if body is not None else None
    return _Request(spec, endpoint, url, path, headers, content, body, params, **kw)


_ENCODINGS: dict[int, bytes] = {}
_PARTS: dict[int, bytes] = {}


def _encoded(body: Message) -> bytes:
    """``body.to_bytes()``, made once per message object: the operator sends one policy or restore plan
    (or one whole peer map) to every node of a job. A ``NodePlan`` (one per node) is put together from
    its parts' JSON, each made once however many nodes' plans carry it. Messages are frozen; an entry
    goes with its object."""
    found = _ENCODINGS.get(id(body))
    if found is None:
        if isinstance(body, NodePlan):
            parts = zip(PLAN_PARTS, body.parts(), strict=True)
            encoded = {name: _part(part) if part is not None else b"null" for name, part in parts}
            found = _remember(_ENCODINGS, body, encode_from_parts(body, encoded))
        else:
            found = _remember(_ENCODINGS, body, body.to_bytes())
    return found


def _part(record: Record) -> bytes:
    found = _PARTS.get(id(record))
    return found if found is not None else _remember(_PARTS, record, record_bytes(record))


def _remember(cache: dict[int, bytes], obj: object, encoded: bytes) -> bytes:
    cache[id(obj)] = encoded
    weakref.finalize(obj, cache.pop, id(obj), None)
    return encoded


def _check_size(req: _Request, declared: str | None, limit: int) -> None:
    if declared is not None and re.fullmatch(r"[0-9]{1,19}", declared) and int(declared) > limit:
        raise ContractError(
            f"replicator {req.endpoint}: {req.what}: answer of {declared} bytes exceeds {limit}"
        )


def _append(req: _Request, body: bytearray, chunk: bytes, limit: int) -> None:
    body += chunk
    if len(body) > limit:
        raise ContractError(f"replicator {req.endpoint}: {req.what}: answer exceeds {limit} bytes")


def _transient_status(status: int, content: bytes) -> None:
    """Raise ``_Transient`` for a status worth retrying."""
    if status in RETRY_STATUSES:
        raise _Transient(status, f"HTTP {status} {content[:300].decode(errors='replace')!r}")


def _no_answer(exc: httpx.TransportError) -> _Transient:
    return _Transient(None, f"{type(exc).__name__}: {exc}".rstrip(": "))


def _gave_up(req: _Request, exc: _Transient) -> ReplicatorError:
    log.debug("%s %s failed: %s", req.endpoint, req.what, exc.detail)
    return ReplicatorError(req.endpoint, f"{req.what} failed: {exc.detail}", exc.status)


def _decode(req: _Request, status: int, content: bytes, cls: type[M]) -> M | None:
    """The endpoint's typed answer (None for a tolerated 404), or the error the answer means."""
    if status == 404 and req.missing_ok:
        return None
    if not 200 <= status < 300:
        text = content[:300].decode(errors="replace")
        raise ReplicatorError(req.endpoint, f"{req.what} failed: HTTP {status} {text!r}", status)
    if req.spec.response is not cls:
        raise TypeError(f"{req.spec.name} answers {req.spec.response}, not {cls.__name__}")
    if isinstance(req.body, cls) and content == req.content:
        return req.body  # the node echoed what it was sent, byte for byte: nothing to parse
    try:
        msg = cls.from_bytes(content)
    except FormatError as exc:
        raise ContractError(f"replicator {req.endpoint}: {req.what}: malformed {cls.KIND}: {exc}") from exc
    job, node = getattr(msg, "job", None), getattr(msg, "node", req.node)
    if "job" in req.path and job != req.path["job"]:
        raise ContractError(f"replicator {req.endpoint}: {req.what}: answers for job {job!r}")
    if req.node is not None and node != req.node:
        raise ContractError(f"replicator {req.endpoint}: {req.what}: answers as node {node!r}")
    return msg


def _must(msg: M | None) -> M:
    """An answer of an endpoint that never answers None (no tolerated 404)."""
    assert msg is not None
    return msg


def _limits(concurrency: int, named: bool) -> httpx.Limits:
    """Calls for a named node over TLS get a new connection each in the blocking client: a pooled
    connection is kept by address, and an address may belong to another node by now (a pod IP reused),
    while the server's name is verified only in the handshake. (A handshake costs about a millisecond;
    these calls come seconds apart.) The asyncio client keeps each node's connections apart instead
    (``NodeTransport``), and alive."""
    return httpx.Limits(max_connections=concurrency, max_keepalive_connections=0 if named else concurrency)


def _extensions(req: _Request, tls: bool) -> dict[str, Any] | None:
    """Over TLS, a call for a known node asks for that node's certificate (the server name)."""
    return {"sni_hostname": node_server_name(req.node)} if tls and req.node is not None else None


class _Client:
    """What both clients hold: the credentials, the retry policy and the answer size limit."""

    def __init__(
        self,
        token: TokenFile | None,
        tls: TlsCredentials | None,
        retry: RetryPolicy,
        max_answer_bytes: int,
    ) -> None:
        self.token, self.tls, self.retry, self.max_answer_bytes = token, tls, retry, max_answer_bytes

    def _req(self, spec: api.Endpoint, endpoint: str, **kw: Any) -> _Request:
        return _build(spec, endpoint, self.token, self.tls is not None, **kw)

    def _verify(self, named: bool) -> ssl.SSLContext | bool:
        """httpx's ``verify``: a context that checks the server's name (calls for a known node), one that
        accepts any node of the CA, or (no TLS) the default."""
        return self.tls.client(named=named) if self.tls is not None else True


# ------------------------------------------------------------------------------------ asyncio


class ReplicatorClient(_Client):
    """Typed calls to any replicator, sharing one connection pool and a concurrency limit (asyncio).

    ``tls``: mutual TLS with these credentials; ``token``: the legacy bearer token (neither: no
    credentials). ``transport`` replaces the network (tests). Every method takes ``node=``, the node the
    endpoint belongs to: over TLS the server must prove it is that node. ``keepalive``: how long a node's
    idle TLS connection is kept for its next call.
    """

    def __init__(
        self,
        *,
        token: TokenFile | None = None,
        tls: TlsCredentials | None = None,
        timeout: float = 5.0,
        retry: RetryPolicy = RetryPolicy(),
        concurrency: int = 64,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
        keepalive: float = 30.0,
    ) -> None:
        super().__init__(token, tls, retry, max_answer_bytes)
        self._slots = asyncio.Semaphore(concurrency)
        pools = (False, True) if tls is not None else (False,)
        per_node = (
            NodeTransport(tls.client(named=True), keepalive=keepalive)
            if tls is not None and transport is None
            else None
        )
        self._pools = {
            named: httpx.AsyncClient(
                timeout=timeout,
                limits=_limits(concurrency, named),
                transport=transport or (per_node if named else None),
                trust_env=False,
                follow_redirects=False,
                verify=self._verify(named),
            )
            for named in pools
        }

    async def __aenter__(self) -> ReplicatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for pool in self._pools.values():
            await pool.aclose()

    def _pool(self, req: _Request) -> httpx.AsyncClient:
        return self._pools.get(req.node is not None, self._pools[False])

    async def inventory(self, endpoint: str, job: str, *, node: str | None = None) -> NodeInventory | None:
        """What the node holds of the job; None if it answers 404. ``node``: the name it must answer as."""
        req = self._req(api.INVENTORY, endpoint, job=job, missing_ok=True, node=node)
        return await self._call(req, NodeInventory)

    async def put_peers(
        self, endpoint: str, assignment: PeerAssignment, *, node: str | None = None
    ) -> PeerAssignment:
        req = self._req(api.PUT_PEERS, endpoint, job=assignment.job, body=assignment, node=node)
        return _must(await self._call(req, PeerAssignment))

    async def put_policy(self, endpoint: str, policy: JobPolicy, *, node: str | None = None) -> JobPolicy:
        req = self._req(api.PUT_POLICY, endpoint, job=policy.job, body=policy, node=node)
        return _must(await self._call(req, JobPolicy))

    async def put_restore_plan(
        self, endpoint: str, plan: RestorePlan, *, node: str | None = None
    ) -> RestorePlan:
        req = self._req(api.PUT_RESTORE_PLAN, endpoint, job=plan.job, body=plan, node=node)
        return _must(await self._call(req, RestorePlan))

    async def put_node_plan(
        self, endpoint: str, plan: NodePlan, *, node: str | None = None
    ) -> NodePlanResult:
        """Everything the node lacks of the job's plans, in one call (see ``NodePlan``); which parts it
        stored and which it refused for a newer generation."""
        req = self._req(api.PUT_NODE_PLAN, endpoint, job=plan.job, body=plan, node=node)
        return _must(await self._call(req, NodePlanResult))

    async def put_orbax_session(
        self, endpoint: str, session: OrbaxSession, *, node: str | None = None
    ) -> OrbaxSession:
        req = self._req(api.PUT_ORBAX_SESSION, endpoint, job=session.job, body=session, node=node)
        return _must(await self._call(req, OrbaxSession))

    async def backup(
        self, endpoint: str, job: str, *, timeout: float | None = None, node: str | None = None
    ) -> BackupResult:
        return _must(
            await self._call(
                self._req(api.BACKUP, endpoint, job=job, timeout=timeout, node=node), BackupResult
            )
        )

    async def restore(self, endpoint: str, job: str, *, node: str | None = None) -> RestoreAccepted:
        return _must(await self._call(self._req(api.RESTORE, endpoint, job=job, node=node), RestoreAccepted))

    async def purge(
        self,
        endpoint: str,
        job: str,
        *,
        backups: bool = False,
        timeout: float | None = None,
        node: str | None = None,
    ) -> PurgeResult | None:
        """Delete the job on the node (with ``backups``, its bucket backups too: that waits for the
        uploads other nodes have in flight, so give it a ``timeout`` of a minute or more); None if it
        answers 404."""
        req = self._req(
            api.PURGE,
            endpoint,
            job=job,
            flags={"bucket": backups},
            missing_ok=True,
            timeout=timeout,
            node=node,
        )
        return await self._call(req, PurgeResult)

    async def status(self, endpoint: str, *, node: str | None = None) -> NodeStatus:
        return _must(await self._call(self._req(api.STATUS, endpoint, node=node), NodeStatus))

    async def ready(self, endpoint: str, *, timeout: float | None = None, node: str | None = None) -> bool:
        """Whether ``/readyz`` answers 200 (one attempt; no answer is not ready)."""
        try:
            status, _ = await self._attempt(self._req(api.READYZ, endpoint, timeout=timeout, node=node))
        except (_Transient, ContractError):
            return False
        return status == 200

    async def _call(self, req: _Request, cls: type[M]) -> M | None:
        try:
            # tenacity's __call__ cannot infer the wrapped function's result: the annotation supplies it
            result: tuple[int, bytes] = await tenacity.AsyncRetrying(**self.retry.tenacity_args())(
                self._checked, req
            )
        except _Transient as exc:
            raise _gave_up(req, exc) from exc
        status, content = result
        return _decode(req, status, content, cls)

    async def _checked(self, req: _Request) -> tuple[int, bytes]:
        status, content = await self._attempt(req)
        _transient_status(status, content)
        return status, content

    async def _attempt(self, req: _Request) -> tuple[int, bytes]:
        timeout = req.timeout if req.timeout is not None else httpx.USE_CLIENT_DEFAULT
        try:
            async with (
                self._slots,
                self._pool(req).stream(
                    req.spec.method,
                    req.url,
                    content=req.content,
                    params=req.params,
                    headers=req.headers,
                    timeout=timeout,
                    extensions=_extensions(req, self.tls is not None),
                ) as resp,
            ):
                _check_size(req, resp.headers.get("content-length"), self.max_answer_bytes)
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    _append(req, body, chunk, self.max_answer_bytes)
                return resp.status_code, bytes(body)
        except httpx.TransportError as exc:
            raise _no_answer(exc) from exc


# ------------------------------------------------------------------------------------ threads


class SyncReplicatorClient(_Client):
    """The same calls, blocking (thread-safe: httpx's pool is shared by the calling threads)."""

    def __init__(
        self,
        *,
        token: TokenFile | None = None,
        tls: TlsCredentials | None = None,
        timeout: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        concurrency: int = 64,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(token, tls, retry, max_answer_bytes)
        pools = (False, True) if tls is not None else (False,)
        self._pools = {
            named: httpx.Client(
                timeout=timeout,
                limits=_limits(concurrency, named),
                transport=transport,
                trust_env=False,
                follow_redirects=False,
                verify=self._verify(named),
            )
            for named in pools
        }

    def __enter__(self) -> SyncReplicatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()

    def _pool(self, req: _Request) -> httpx.Client:
        return self._pools.get(req.node is not None, self._pools[False])

    def inventory(self, endpoint: str, job: str, *, node: str | None = None) -> NodeInventory | None:
        req = self._req(api.INVENTORY, endpoint, job=job, missing_ok=True, node=node)
        return self._call(req, NodeInventory)

    def put_peers(
        self, endpoint: str, assignment: PeerAssignment, *, node: str | None = None
    ) -> PeerAssignment:
        req = self._req(api.PUT_PEERS, endpoint, job=assignment.job, body=assignment, node=node)
        return _must(self._call(req, PeerAssignment))

    def put_policy(self, endpoint: str, policy: JobPolicy, *, node: str | None = None) -> JobPolicy:
        req = self._req(api.PUT_POLICY, endpoint, job=policy.job, body=policy, node=node)
        return _must(self._call(req, JobPolicy))

    def put_restore_plan(self, endpoint: str, plan: RestorePlan, *, node: str | None = None) -> RestorePlan:
        req = self._req(api.PUT_RESTORE_PLAN, endpoint, job=plan.job, body=plan, node=node)
        return _must(self._call(req, RestorePlan))

    def put_node_plan(self, endpoint: str, plan: NodePlan, *, node: str | None = None) -> NodePlanResult:
        req = self._req(api.PUT_NODE_PLAN, endpoint, job=plan.job, body=plan, node=node)
        return _must(self._call(req, NodePlanResult))

    def put_orbax_session(
        self, endpoint: str, session: OrbaxSession, *, node: str | None = None
    ) -> OrbaxSession:
        req = self._req(api.PUT_ORBAX_SESSION, endpoint, job=session.job, body=session, node=node)
        return _must(self._call(req, OrbaxSession))

    def backup(
        self, endpoint: str, job: str, *, timeout: float | None = None, node: str | None = None
    ) -> BackupResult:
        return _must(
            self._call(self._req(api.BACKUP, endpoint, job=job, timeout=timeout, node=node), BackupResult)
        )

    def restore(self, endpoint: str, job: str, *, node: str | None = None) -> RestoreAccepted:
        return _must(self._call(self._req(api.RESTORE, endpoint, job=job, node=node), RestoreAccepted))

    def purge(
        self,
        endpoint: str,
        job: str,
        *,
        backups: bool = False,
        timeout: float | None = None,
        node: str | None = None,
    ) -> PurgeResult | None:
        req = self._req(
            api.PURGE,
            endpoint,
            job=job,
            flags={"bucket": backups},
            missing_ok=True,
            timeout=timeout,
            node=node,
        )
        return self._call(req, PurgeResult)

    def status(self, endpoint: str, *, node: str | None = None) -> NodeStatus:
        return _must(self._call(self._req(api.STATUS, endpoint, node=node), NodeStatus))

    def ready(self, endpoint: str, *, timeout: float | None = None, node: str | None = None) -> bool:
        try:
            status, _ = self._attempt(self._req(api.READYZ, endpoint, timeout=timeout, node=node))
        except (_Transient, ContractError):
            return False
        return status == 200

    def _call(self, req: _Request, cls: type[M]) -> M | None:
        try:
            status, content = tenacity.Retrying(**self.retry.tenacity_args())(self._checked, req)
        except _Transient as exc:
            raise _gave_up(req, exc) from exc
        return _decode(req, status, content, cls)

    def _checked(self, req: _Request) -> tuple[int, bytes]:
        status, content = self._attempt(req)
        _transient_status(status, content)
        return status, content

    def _attempt(self, req: _Request) -> tuple[int, bytes]:
        timeout = req.timeout if req.timeout is not None else httpx.USE_CLIENT_DEFAULT
        try:
            with self._pool(req).stream(
                req.spec.method,
                req.url,
                content=req.content,
                params=req.params,
                headers=req.headers,
                timeout=timeout,
                extensions=_extensions(req, self.tls is not None),
            ) as resp:
                _check_size(req, resp.headers.get("content-length"), self.max_answer_bytes)
                body = bytearray()
                for chunk in resp.iter_bytes():
                    _append(req, body, chunk, self.max_answer_bytes)
                return resp.status_code, bytes(body)
        except httpx.TransportError as exc:
            raise _no_answer(exc) from exc
