"""The control API's routes, registered from the endpoint table (``tierckpt.protocol.api.ENDPOINTS``).

Every table entry gets exactly one route, at its method and path, answering its success status; the
guards come from the table too (where ``auth``: the caller's credentials, then what that caller may
do, see ``api.auth``; the checked path parameters, the boolean query flags). The handlers below only
parse, check and translate; the work is done by the ``Controls`` they are given
(``tierckpt_replicator.controls``). Malformed input gets a 4xx before anything is changed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from tierckpt.protocol import api
from tierckpt.protocol.codec import Message
from tierckpt.protocol.control import (
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
from tierckpt.protocol.errors import RetryableError, TierckptError
from tierckpt.protocol.orbax import OrbaxSession
from tierckpt_replicator.api.auth import Authorizer, check_path_param, query_flag, read_message
from tierckpt_replicator.api.openapi import install_openapi, route_docs
from tierckpt_replicator.metrics import CONTENT_TYPE, Metrics
from tierckpt_replicator.settings import Settings

__all__ = ["Controls", "Handler", "Handlers", "handlers", "install_routes"]

Handler = Callable[..., Awaitable[Message | Response]]
"""``handler(request, **path_params, **query_flags)``: a message (answered with the endpoint's
success status) or a ready ``Response`` (the probes)."""


class Controls(Protocol):
    """What the API needs from the replicator."""

    settings: Settings
    auth: Authorizer
    metrics: Metrics

    async def inventory(self, job: str) -> NodeInventory: ...
    async def put_peers(self, assignment: PeerAssignment) -> tuple[bool, PeerAssignment]: ...
    async def put_plan(self, plan: RestorePlan) -> tuple[bool, RestorePlan]: ...
    async def put_policy(self, policy: JobPolicy) -> tuple[bool, JobPolicy]: ...
    async def put_orbax_session(self, session: OrbaxSession) -> tuple[bool, OrbaxSession]: ...
    async def backup_now(self, job: str) -> int | None: ...
    async def restore(self, job: str) -> None: ...
    async def purge(self, job: str, *, bucket: bool = False) -> bool: ...
    async def status(self) -> NodeStatus: ...
    def ready(self) -> tuple[bool, str]: ...


def install_routes(app: FastAPI, c: Controls, port: api.Port = "api") -> None:
    """One route per endpoint of the table that ``port`` serves; the API also gets its OpenAPI
    document (the probe server serves only the open probes and metrics)."""
    table = handlers(c, app)
    if set(table) != {ep.name for ep in api.ENDPOINTS}:
        raise AssertionError(f"handlers {sorted(table)} do not match the endpoint table")
    for ep in api.served_on(port):
        app.add_api_route(
            ep.path,
            _route(ep, table[ep.name], c.auth),
            methods=[ep.method],
            status_code=ep.status,
            name=ep.name,
            summary=ep.summary,
            response_class=PlainTextResponse if ep.media_type.startswith("text/") else JSONResponse,
            **route_docs(ep, c.auth.mode),
        )
    if port == "api":
        install_openapi(app, c.auth.mode)


def _route(ep: api.Endpoint, handler: Handler, auth: Authorizer) -> Callable[[Request], Awaitable[Response]]:
    """The ASGI endpoint of ``ep``: guards from the table, then ``handler``, then the answer."""

    async def endpoint(request: Request) -> Response:
        if ep.auth:
            auth.authenticate(request)
        args: dict[str, Any] = {p: check_path_param(p, request.path_params[p]) for p in ep.path_params}
        if ep.auth:
            auth.authorize(request, ep, args.get("job"))
        args.update({q.name: query_flag(request, q.name) for q in ep.query})
        answer = await handler(request, **args)
        if isinstance(answer, Response):
            return answer
        return Response(content=answer.to_bytes(), status_code=ep.status, media_type=ep.media_type)

    endpoint.__name__ = endpoint.__qualname__ = ep.name
    endpoint.handler = handler  # type: ignore[attr-defined]  # for the table test
    return endpoint


def handlers(c: Controls, app: FastAPI) -> dict[str, Handler]:
    """Endpoint name -> its handler (``Handlers``' method of that name)."""
    table = Handlers(c, app)
    return {ep.name: getattr(table, ep.name) for ep in api.ENDPOINTS if hasattr(table, ep.name)}


class Handlers:
    """One method per endpoint, named as it (thin: parse, call ``c``, translate refusals into
    statuses)."""

    def __init__(self, c: Controls, app: FastAPI) -> None:
        self.c, self.app = c, app
        self.limit = c.settings.max_request_bytes

    async def inventory(self, request: Request, job: str) -> NodeInventory:
        return await self.c.inventory(job)

    async def put_peers(self, request: Request, job: str) -> PeerAssignment:
        assignment = await read_message(request, PeerAssignment, limit=self.limit, job=job)
        stored, current = await self.c.put_peers(assignment)
        if not stored:
            raise HTTPException(
                409, f"generation {assignment.generation} is not newer than {current.generation}"
            )
        return current

    async def put_policy(self, request: Request, job: str) -> JobPolicy:
        policy = await read_message(request, JobPolicy, limit=self.limit, job=job)
        stored, current = await self.c.put_policy(policy)
        if not stored:
            raise HTTPException(409, f"generation {policy.generation} is not newer than {current.generation}")
        return current

    async def put_restore_plan(self, request: Request, job: str) -> RestorePlan:
        plan = await read_message(request, RestorePlan, limit=self.limit, job=job)
        stored, current = await self.c.put_plan(plan)
        if not stored:
            raise HTTPException(409, f"generation {plan.generation} is older than {current.generation}")
        return current

    async def put_node_plan(self, request: Request, job: str) -> NodePlanResult:
        plan = await read_message(request, NodePlan, limit=self.limit, job=job)
        if plan.node != self.c.settings.node_name:
            raise HTTPException(400, f"a plan for node {plan.node!r} sent to {self.c.settings.node_name!r}")
        done: list[tuple[str, bool, int]] = []  # part, stored, the generation the node holds
        if plan.policy is not None:
            ok, policy = await self.c.put_policy(plan.policy)
            done.append(("policy", ok, policy.generation))
        if plan.peers is not None:
            ok, peers = await self.c.put_peers(plan.peers)
            done.append(("peers", ok, peers.generation))
        if plan.restore_plan is not None:
            ok, restore = await self.c.put_plan(plan.restore_plan)
            done.append(("restore_plan", ok, restore.generation))
        stored = tuple(name for name, ok, _ in done if ok)
        refused = {name: generation for name, ok, generation in done if not ok}
        return NodePlanResult(job=job, node=plan.node, stored=stored, refused=refused)

    async def put_orbax_session(self, request: Request, job: str) -> OrbaxSession:
        session = await read_message(request, OrbaxSession, limit=self.limit, job=job)
        if session.node != self.c.settings.node_name:
            raise HTTPException(
                400, f"a session for node {session.node!r} sent to {self.c.settings.node_name!r}"
            )
        try:
            stored, current = await self.c.put_orbax_session(session)
        except LookupError as exc:
            raise HTTPException(503, str(exc)) from exc
        if not stored:
            raise HTTPException(
                409, f"generation {session.generation} is not newer than {current.generation}"
            )
        return current

    async def backup(self, request: Request, job: str) -> BackupResult:
        try:
            step = await self.c.backup_now(job)
        except LookupError as exc:
            raise HTTPException(503, str(exc)) from exc
        except RetryableError as exc:
            raise HTTPException(503, f"backup failed, retry later: {exc}") from exc
        except TierckptError as exc:
            raise HTTPException(502, f"backup failed: {exc}") from exc
        return BackupResult(job=job, step=step)

    async def restore(self, request: Request, job: str) -> RestoreAccepted:
        await self.c.restore(job)
        return RestoreAccepted(job=job, staging=True)

    async def purge(self, request: Request, job: str, bucket: bool) -> PurgeResult:
        return PurgeResult(job=job, purged=await self.c.purge(job, bucket=bucket), bucket=bucket)

    async def status(self, request: Request) -> NodeStatus:
        return await self.c.status()

    async def job_metrics(self, request: Request) -> Response:
        return Response(content=self.c.metrics.render_jobs(), media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(self.app.openapi())

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        ok, _why = self.c.ready()  # the reason stays in the logs and /v1/status: probes are unauthenticated
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(content=self.c.metrics.render(), media_type=CONTENT_TYPE)
