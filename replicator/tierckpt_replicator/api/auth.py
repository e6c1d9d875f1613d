"""Request guards for the control API: who is calling and what they may do (``Authorizer``), safe job
ids, flags, bounded and typed bodies.

Two authorizers, one per ``--auth`` mode:

* ``PeerAuthorizer`` (``tls``): the caller is the identity its client certificate names (put into the
  request's scope by ``api.guard``); what it may do is ``tierckpt_replicator.access``'s policy: the
  operator everything, a node only the inventory of a job both belong to.
* ``TokenAuthorizer`` (legacy ``token``): whoever presents the shared bearer token may do everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from fastapi import HTTPException, Request

from tierckpt.protocol import api
from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import check_job_id
from tierckpt.protocol.identity import Peer
from tierckpt.protocol.tokens import TokenFile
from tierckpt_replicator.access import JobMembers, api_refusal

__all__ = [
    "PEER_SCOPE_KEY",
    "Authorizer",
    "PeerAuthorizer",
    "TokenAuthorizer",
    "check_job",
    "check_path_param",
    "query_flag",
    "read_message",
    "require_token",
]

M = TypeVar("M", bound=Message)

PEER_SCOPE_KEY = "tierckpt.peer"
"""Where ``api.guard`` puts the identity of the connection's client certificate in the ASGI scope."""


class Authorizer(Protocol):
    mode: str
    """``tls`` or ``token``: the ``--auth`` mode (and the OpenAPI security scheme)."""

    def authenticate(self, request: Request) -> None:
        """401/403 unless the request carries credentials of a known caller."""

    def authorize(self, request: Request, ep: api.Endpoint, job: str | None) -> None:
        """403 unless that caller may call ``ep`` (for ``job``)."""

    def problem(self) -> str:
        """Why no request could be authorized now ("" if nothing is wrong): for readiness."""


def require_token(request: Request, tokens: TokenFile) -> None:
    """401 without a bearer token, 403 with a wrong one (compared in constant time)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"})
    if not tokens.check(token.strip()):
        raise HTTPException(403, "invalid token")


class TokenAuthorizer:
    """Legacy: the shared bearer token admits its holder to every endpoint."""

    mode = "token"

    def __init__(self, tokens: TokenFile) -> None:
        self.tokens = tokens

    def authenticate(self, request: Request) -> None:
        require_token(request, self.tokens)

    def authorize(self, request: Request, ep: api.Endpoint, job: str | None) -> None:
        pass  # one trust domain: the token is the whole authorization

    def problem(self) -> str:
        try:
            self.tokens.current()
        except (OSError, ValueError) as exc:
            return f"token file unreadable: {exc}"
        return ""


def request_peer(request: Request) -> Peer | None:
    peer = request.scope.get(PEER_SCOPE_KEY)
    return peer if isinstance(peer, Peer) else None


class PeerAuthorizer:
    """Mutual TLS: the caller is its certificate's identity; ``access.api_refusal`` decides."""

    mode = "tls"

    def __init__(self, members: JobMembers, node: str, not_after: Callable[[], float]) -> None:
        self.members, self.node, self.not_after = members, node, not_after

    def authenticate(self, request: Request) -> None:
        if request_peer(request) is None:
            raise HTTPException(401, "a client certificate naming a tierckpt identity is required")

    def authorize(self, request: Request, ep: api.Endpoint, job: str | None) -> None:
        why = api_refusal(request_peer(request), ep.name, job, self.members, self.node)
        if why is not None:
            raise HTTPException(403, why)

    def problem(self) -> str:
        if time.time() >= self.not_after():
            return "this node's certificate has expired (no renewal from the operator)"
        return ""


def check_job(job: str) -> str:
    try:
        return check_job_id(job)
    except FormatError as exc:
        raise HTTPException(400, str(exc)) from exc


def check_path_param(name: str, value: str) -> str:
    """A path parameter of the endpoint table (``tierckpt.protocol.api.PATH_PARAMS``), checked."""
    if name == "job":
        return check_job(value)
    raise HTTPException(500, f"no check for path parameter {name!r}")


_TRUE, _FALSE = ("true", "t", "1", "yes", "y", "on"), ("false", "f", "0", "no", "n", "off")


def query_flag(request: Request, name: str) -> bool:
    """A boolean query parameter: absent is false; anything but true/false (1/0, yes/no, on/off) is 400."""
    value = request.query_params.get(name)
    if value is None or value.lower() in _FALSE:
        return False
    if value.lower() in _TRUE:
        return True
    raise HTTPException(400, f"query parameter {name}={value!r} is not true or false")


async def read_message(request: Request, cls: type[M], *, limit: int, job: str) -> M:
    """The body as a ``cls`` message for ``job``: 413 if over ``limit`` bytes, 400 if malformed."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError as exc:
            raise HTTPException(400, "bad Content-Length") from exc
        if size > limit:
            raise HTTPException(413, f"body of {size} bytes exceeds {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"body exceeds {limit} bytes")
    try:
        msg = cls.from_bytes(bytes(body))
    except FormatError as exc:
        raise HTTPException(400, f"malformed {cls.KIND}: {exc}") from exc
    if getattr(msg, "job", job) != job:
        raise HTTPException(400, f"body is for job {getattr(msg, 'job', None)!r}, the path says {job!r}")
    return msg
