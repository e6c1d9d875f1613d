"""The FastAPI application factories: the control API (routes from the endpoint table, request metrics;
no interactive docs: the OpenAPI document is a /v1 route, for authenticated callers only) and the probe
server's (``/healthz``, ``/readyz``, ``/metrics``; see ``tierckpt_replicator.probes``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

import tierckpt_replicator
from tierckpt_replicator.api.routes import Controls, install_routes
from tierckpt_replicator.metrics import Metrics

__all__ = ["create_app", "create_probe_app"]


class _CountRequests:
    """Pure ASGI middleware: count responses by route template and status class."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, f"{status // 100}xx").inc()


def create_app(controls: Controls) -> FastAPI:
    app = FastAPI(
        title="tierckpt replicator",
        version=tierckpt_replicator.__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_routes(app, controls)
    app.add_middleware(_CountRequests, metrics=controls.metrics)
    return app


def create_probe_app(controls: Controls) -> FastAPI:
    """The probe port's app: the table's endpoints served on ``probes``, nothing else."""
    app = FastAPI(
        title="tierckpt replicator probes",
        version=tierckpt_replicator.__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_routes(app, controls, "probes")
    return app
