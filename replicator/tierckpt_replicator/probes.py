"""The probe server: ``/healthz``, ``/readyz`` and ``/metrics`` on ``--probe-port``, on a thread and an
event loop of its own.

Connections to the control API port, however many and however slow, cannot starve the kubelet's
probes (which would restart a healthy replicator) or Prometheus: this server shares no connection
limit, no event loop and no worker with the API. It is a ``GuardedServer`` too
(``tierckpt_replicator.api.guard``: connections per source and in total, header and body deadlines),
and serves only the open endpoints of the table (``tierckpt.protocol.api.served_on("probes")``).
The chart's probes, ServiceMonitor and PodMonitoring use this port; the NetworkPolicy admits it only
from ``networkPolicy.metricsFrom`` (and the node, for the kubelet).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from tierckpt_replicator.api.guard import ApiLimits, GuardedServer

__all__ = ["PROBE_CONNECTIONS", "PROBE_CONNECTIONS_PER_SOURCE", "ProbeServer"]

log = logging.getLogger(__name__)

PROBE_CONNECTIONS = 64
"""Open connections the probe server keeps in all (the kubelet and a few scrapers need a handful)."""
PROBE_CONNECTIONS_PER_SOURCE = 8


class ProbeServer:
    """``start()`` serves ``app`` on ``host:port`` from a new thread; ``stop()`` ends it."""

    def __init__(
        self, app: Any, *, host: str, port: int, header_timeout: float, body_timeout: float, log_level: str
    ) -> None:
        self.host, self.port = host, port
        self._server = GuardedServer(
            app,
            ApiLimits(
                "probe server",
                header_timeout=header_timeout,
                body_timeout=body_timeout,
                total=PROBE_CONNECTIONS,
                per_source=PROBE_CONNECTIONS_PER_SOURCE,
            ),
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=1,
        )
        self.connections = self._server.connections
        self._thread = threading.Thread(target=self._run, name="probe-server", daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        """Serve; returns once the port listens (``RuntimeError`` if it cannot)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the probe server could not listen on {self.host}:{self.port}")
            time.sleep(0.02)
        log.info("probes and metrics on %s:%d", self.host, self.port)

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve())
        except BaseException:  # SystemExit from uvicorn when the port is taken: start() reports it
            log.exception("the probe server stopped")
