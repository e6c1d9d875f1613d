"""``tierckpt-operator``: settings -> runtime -> (leader election) -> kopf, plus /healthz, /readyz, /metrics
and (``--auth tls``) the node certificate signing endpoint.

The composition root: ``build_runtime`` loads the CA, issues the operator's own certificates, opens the
API adapters and builds the runtime that every handler is given; nothing else constructs a
collaborator. With ``--leader-election`` every replica starts as a standby serving only the admission
webhook (and the signing endpoint, which every replica serves); the one that takes the Lease restarts
kopf with the full set of handlers, and exits if it loses the Lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import kopf
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tierckpt_operator.credentials import OperatorCredentials
from tierckpt_operator.issuer import NodeCertificateIssuer
from tierckpt_operator.kube import Kube, api_client
from tierckpt_operator.leader import LeaseElector
from tierckpt_operator.metrics import Metrics
from tierckpt_operator.registry import build_registry
from tierckpt_operator.replicators import replicator_client
from tierckpt_operator.runtime import Runtime
from tierckpt_operator.settings import Settings, parse_settings

__all__ = ["build_runtime", "main", "run"]

log = logging.getLogger("tierckpt_operator")


def build_runtime(settings: Settings) -> Runtime:
    """The runtime with its adapters open: the Kubernetes API client and the replicators' client (with
    the operator's own certificate, issued here from the CA, unless ``--auth token``)."""
    settings.check_credentials()
    credentials = None
    if settings.auth == "tls":
        credentials = OperatorCredentials(
            Path(settings.ca_cert_file),
            Path(settings.ca_key_file),
            Path(settings.ca_bundle_file or settings.ca_cert_file),
            server_names=[n.strip() for n in settings.issuer_names.split(",") if n.strip()],
            lifetime=datetime.timedelta(hours=settings.cert_hours),
        )
    kube = Kube(api_client(settings.server, settings.kubeconfig), settings.api_concurrency)
    client = replicator_client(settings, credentials.client if credentials is not None else None)
    return Runtime(settings, kube, client, Metrics(), credentials=credentials)


async def _identity(runtime: Runtime) -> tuple[list[asyncio.Task[None]], web.AppRunner | None]:
    """--auth tls: the certificates' renewal, the signing endpoint, and the CA ConfigMap if asked for."""
    s, credentials = runtime.settings, runtime.credentials
    if credentials is None:
        return [], None
    tasks = [asyncio.create_task(credentials.run(), name="certificate-renewal")]
    if s.ca_configmap:
        bundle = Path(s.ca_bundle_file or s.ca_cert_file).read_text()
        await runtime.kube.publish_configmap(s.namespace, s.ca_configmap, {"ca.crt": bundle})
    runner = None
    if s.issuer_port:
        runner = await NodeCertificateIssuer(s, runtime.kube, credentials, runtime.metrics).start()
    return tasks, runner


async def _probes(runtime: Runtime, ready: asyncio.Event) -> web.AppRunner | None:
    """Serve /healthz (process alive), /readyz (kopf ready: webhook answering) and /metrics."""
    port = runtime.settings.metrics_port
    if not port:
        return None

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        return web.Response(text="ready") if ready.is_set() else web.Response(status=503, text="starting")

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(runtime.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", metrics)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def _kopf(runtime: Runtime, role: str, stop: asyncio.Event, ready: asyncio.Event) -> None:
    s = runtime.settings
    runtime.metrics.leader.set(1 if role == "leader" else 0)
    await kopf.operator(
        registry=build_registry(s, runtime, role=role),
        standalone=True,
        clusterwide=not s.namespaces,
        namespaces=s.namespaces,
        stop_flag=stop,
        ready_flag=ready,
    )


async def run(runtime: Runtime, stop: asyncio.Event | None = None, *, signals: bool = True) -> int:
    """Run until ``stop`` (or SIGTERM/SIGINT with ``signals``), then close the runtime's adapters;
    returns the process exit code."""
    settings = runtime.settings
    stop = stop or asyncio.Event()
    if signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    ready = asyncio.Event()
    probes = await _probes(runtime, ready)
    identity_tasks: list[asyncio.Task[None]] = []
    issuer = None
    try:
        identity_tasks, issuer = await _identity(runtime)
        if not settings.leader_election:
            await _kopf(runtime, "leader", stop, ready)
            return 0
        return await _elected(runtime, stop, ready)
    finally:
        for task in identity_tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if issuer is not None:
            await issuer.cleanup()
        await runtime.close()
        if probes is not None:
            await probes.cleanup()


async def _elected(runtime: Runtime, stop: asyncio.Event, ready: asyncio.Event) -> int:
    s = runtime.settings
    # A client of its own, outside the runtime's --api-concurrency slots: renewals never queue behind a
    # burst of pod annotations.
    kube = Kube(await asyncio.to_thread(api_client, s.server, s.kubeconfig))
    identity = s.pod_name or socket.gethostname()
    elector = LeaseElector(kube, s.namespace, s.lease_name, identity, s.lease_duration)
    acquired, lost, standby_stop, leader_stop = (asyncio.Event() for _ in range(4))
    # Every helper task exists before kopf starts: kopf cancels tasks created after its start.
    electing = asyncio.create_task(elector.run(acquired, lost))
    relays = [
        asyncio.create_task(_first((stop, acquired), standby_stop)),
        asyncio.create_task(_first((stop, lost), leader_stop)),
    ]
    try:
        await _kopf(runtime, "webhook", standby_stop, ready)
        if stop.is_set() or lost.is_set():
            return 1 if lost.is_set() and not stop.is_set() else 0
        ready.clear()
        await _kopf(runtime, "leader", leader_stop, ready)
        return 1 if lost.is_set() and not stop.is_set() else 0
    finally:
        electing.cancel()
        for task in relays:
            task.cancel()
        await asyncio.gather(electing, *relays, return_exceptions=True)
        if acquired.is_set() and not lost.is_set():
            await elector.release()
        kube.close()


async def _first(events: tuple[asyncio.Event, ...], then: asyncio.Event) -> None:
    """Set ``then`` as soon as any of ``events`` is set.

    Polls instead of waiting in sub-tasks: kopf cancels every task created after it started when it
    stops, and a cancelled sub-task would look like a set event.
    """
    while not any(e.is_set() for e in events):
        await asyncio.sleep(0.1)
    then.set()


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    try:
        settings.check_credentials()
    except ValueError as exc:
        print(f"tierckpt-operator: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one line per handled watch event
    if settings.kubeconfig:
        os.environ["KUBECONFIG"] = settings.kubeconfig
    sys.exit(asyncio.run(run(build_runtime(settings))))


if __name__ == "__main__":
    main()
