"""The control API routes (all under ``/v1``, bearer token required) and the open probes.

Routes only parse, check and translate; the work is done by the ``Controls`` they are given (the
daemon). Malformed input gets a 4xx before anything is changed.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from tierckpt.protocol.codec import Message
from tierckpt.protocol.control import JobPolicy, NodeInventory, NodeStatus, PeerAssignment, RestorePlan
from tierckpt.protocol.errors import RetryableError, TierckptError
from tierckpt.protocol.tokens import TokenFile
from tierckpt_replicator.api.auth import check_job, read_message, require_token
from tierckpt_replicator.metrics import CONTENT_TYPE, Metrics
from tierckpt_replicator.settings import Settings

__all__ = ["Controls", "install_routes"]


class Controls(Protocol):
    """What the API needs from the daemon."""

    settings: Settings
    tokens: TokenFile
    metrics: Metrics

    async def inventory(self, job: str) -> NodeInventory: ...
    async def put_peers(self, assignment: PeerAssignment) -> tuple[bool, PeerAssignment]: ...
    async def put_plan(self, plan: RestorePlan) -> tuple[bool, RestorePlan]: ...
    async def put_policy(self, policy: JobPolicy) -> tuple[bool, JobPolicy]: ...
    async def backup_now(self, job: str) -> int | None: ...
    async def restore(self, job: str) -> None: ...
    async def purge(self, job: str, *, bucket: bool = False) -> bool: ...
    async def status(self) -> NodeStatus: ...
    def ready(self) -> tuple[bool, str]: ...


def _message(msg: Message, status: int = 200) -> Response:
    return Response(content=msg.to_bytes(), status_code=status, media_type="application/json")


def install_routes(app: FastAPI, c: Controls) -> None:
    app.include_router(_v1_routes(c))
    _install_probes(app, c)


def _v1_routes(c: Controls) -> APIRouter:
    v1 = APIRouter(prefix="/v1")
    limit = c.settings.max_request_bytes

    def guard(request: Request, job: str | None = None) -> str:
        require_token(request, c.tokens)
        return check_job(job) if job is not None else ""

    @v1.get("/jobs/{job}/inventory")
    async def get_inventory(job: str, request: Request) -> Response:
        return _message(await c.inventory(guard(request, job)))

    @v1.put("/jobs/{job}/peers")
    async def put_peers(job: str, request: Request) -> Response:
        job = guard(request, job)
        assignment = await read_message(request, PeerAssignment, limit=limit, job=job)
        stored, current = await c.put_peers(assignment)
        if not stored:
            raise HTTPException(
                409, f"generation {assignment.generation} is not newer than {current.generation}"
            )
        return _message(current)

    @v1.put("/jobs/{job}/restore-plan")
    async def put_restore_plan(job: str, request: Request) -> Response:
        job = guard(request, job)
        plan = await read_message(request, RestorePlan, limit=limit, job=job)
        stored, current = await c.put_plan(plan)
        if not stored:
            raise HTTPException(409, f"generation {plan.generation} is older than {current.generation}")
        return _message(current, 202)

    @v1.put("/jobs/{job}/policy")
    async def put_policy(job: str, request: Request) -> Response:
        job = guard(request, job)
        policy = await read_message(request, JobPolicy, limit=limit, job=job)
        stored, current = await c.put_policy(policy)
        if not stored:
            raise HTTPException(409, f"generation {policy.generation} is not newer than {current.generation}")
        return _message(current)

    @v1.post("/jobs/{job}/backup")
    async def post_backup(job: str, request: Request) -> JSONResponse:
        job = guard(request, job)
        try:
            step = await c.backup_now(job)
        except LookupError as exc:
            raise HTTPException(503, str(exc)) from exc
        except RetryableError as exc:
            raise HTTPException(503, f"backup failed, retry later: {exc}") from exc
        except TierckptError as exc:
            raise HTTPException(502, f"backup failed: {exc}") from exc
        return JSONResponse({"job": job, "step": step})

    @v1.post("/jobs/{job}/restore")
    async def post_restore(job: str, request: Request) -> JSONResponse:
        job = guard(request, job)
        await c.restore(job)
        return JSONResponse({"job": job, "staging": True}, status_code=202)

    @v1.delete("/jobs/{job}")
    async def delete_job(job: str, request: Request, bucket: bool = False) -> JSONResponse:
        job = guard(request, job)
        return JSONResponse({"job": job, "purged": await c.purge(job, bucket=bucket), "bucket": bucket})

    @v1.get("/status")
    async def get_status(request: Request) -> Response:
        guard(request)
        return _message(await c.status())

    return v1


def _install_probes(app: FastAPI, c: Controls) -> None:
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ok, _why = c.ready()  # the reason stays in the logs and /v1/status: probes are unauthenticated
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(content=c.metrics.render(), media_type=CONTENT_TYPE)
