"""Request guards for the control API: bearer token, safe job ids, bounded and typed bodies."""

from __future__ import annotations

from typing import TypeVar

from fastapi import HTTPException, Request

from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import check_job_id
from tierckpt.protocol.tokens import TokenFile

__all__ = ["check_job", "read_message", "require_token"]

M = TypeVar("M", bound=Message)


def require_token(request: Request, tokens: TokenFile) -> None:
    """401 without a bearer token, 403 with a wrong one (compared in constant time)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"})
    if not tokens.check(token.strip()):
        raise HTTPException(403, "invalid token")


def check_job(job: str) -> str:
    try:
        return check_job_id(job)
    except FormatError as exc:
        raise HTTPException(400, str(exc)) from exc


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
