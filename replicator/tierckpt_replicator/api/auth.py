"""Request guards for the control API: bearer token, safe job ids, flags, bounded and typed bodies."""

from __future__ import annotations

from typing import TypeVar

from fastapi import HTTPException, Request

from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import check_job_id
from tierckpt.protocol.tokens import TokenFile

__all__ = ["check_job", "check_path_param", "query_flag", "read_message", "require_token"]

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
