"""The composition root and lifecycle of the replicator daemon.

``Daemon`` builds every part and wires them together (what the control API does is
``tierckpt_replicator.controls.NodeControls``). ``serve(settings)``: obtain this node's certificate
(``--auth tls``; see ``identity``), start the probe server (its own thread and loop,
``tierckpt_replicator.probes``), build the parts, start the replication worker process, the commit
watcher, the replication loop and the certificate renewal, stage restores for the jobs already known,
then serve the control API (uvicorn's HTTP protocol behind ``api.guard``'s accept loop, admission and
deadlines, over mutual TLS unless ``--auth token``, on the uvloop event loop the caller runs) until
SIGTERM or SIGINT.
Shutdown: back up each job's newest step (bounded by ``preemption_timeout``: a node being preempted
leaves its newest step in the bucket), stop the API, stop the worker, cancel the loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from typing import Any

import httpx

from tierckpt.protocol.client import ONE_ATTEMPT, ReplicatorClient
from tierckpt.protocol.identity import TlsCredentials, TlsFiles
from tierckpt.protocol.tokens import TokenFile
from tierckpt_replicator.access import JobMembers
from tierckpt_replicator.api.auth import Authorizer, PeerAuthorizer, TokenAuthorizer
from tierckpt_replicator.api.guard import ApiLimits, GuardedServer
from tierckpt_replicator.app import create_app, create_probe_app
from tierckpt_replicator.assignments import AssignmentStore, load_static
from tierckpt_replicator.backup.jobs import BackupPort, load_job_backups
from tierckpt_replicator.controls import LocalInventory, NodeControls
from tierckpt_replicator.identity import NodeIdentity
from tierckpt_replicator.inventory import InventoryScanner, list_jobs
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.orbax import OrbaxJobs
from tierckpt_replicator.orbax_state import OrbaxStore
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.probes import ProbeServer
from tierckpt_replicator.quota import JobQuotas
from tierckpt_replicator.replication.fragments import FragmentScanner
from tierckpt_replicator.replication.ipc import DataEvent, WorkerConfig
from tierckpt_replicator.replication.manager import ReplicationManager
from tierckpt_replicator.replication.supervisor import WorkerSupervisor
from tierckpt_replicator.replication.transfer import outcome_status
from tierckpt_replicator.replication.wire import Status
from tierckpt_replicator.restore.requests import FetchRequests
from tierckpt_replicator.restore.stage import Stager
from tierckpt_replicator.settings import Settings
from tierckpt_replicator.watch import CommitWatcher

__all__ = ["Daemon", "serve", "worker_config"]

log = logging.getLogger(__name__)


def worker_config(settings: Settings, tls: TlsFiles | None = None) -> WorkerConfig:
    """What the worker process needs: ``tls``, the node's certificate files (``--auth tls``)."""
    return WorkerConfig(
        node=settings.node_name,
        root=str(settings.root),
        auth="tls" if settings.auth == "tls" else "token",
        token_file=str(settings.token_file or ""),
        tls_cert=str(tls.cert) if tls is not None else "",
        tls_key=str(tls.key) if tls is not None and tls.key is not None else "",
        tls_ca=str(tls.ca) if tls is not None else "",
        peers_file=str(settings.peers_file or ""),
        listen_host=settings.listen_host,
        data_port=settings.data_port,
        holder=settings.holder,
        concurrency=settings.concurrency,
        max_incoming=settings.max_incoming,
        bandwidth_bytes_per_s=settings.bandwidth_limit * 1e6,
        transfer_timeout=settings.transfer_timeout,
        connect_timeout=settings.connect_timeout,
        handshake_timeout=settings.handshake_timeout,
        min_transfer_rate=settings.min_transfer_rate * 1e6,
        connections_per_source=settings.data_connections_per_source,
        max_manifest_bytes=settings.max_manifest_bytes,
        reserve_bytes=settings.reserve_bytes,
        job_quota=settings.job_quota,
        replica_keep=settings.replica_keep,
        nice=settings.worker_nice,
        idle_class=settings.worker_idle,
        log_level=settings.log_level,
        send_method="sendfile" if settings.send_method == "sendfile" else "mmap",
    )


class Daemon:
    """Every part of one node's replicator, wired together, and their lifecycle.

    ``identity`` (``--auth tls``): this node's certificate, already obtained (``serve`` does that);
    without it the daemon loads ``--tls-cert`` (local mode)."""

    def __init__(
        self,
        settings: Settings,
        *,
        identity: NodeIdentity | None = None,
        metrics: Metrics | None = None,
        backup: BackupPort | None = None,
        peer_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        settings.check_credentials()
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.started_at = time.time()
        self.backup = backup
        static = load_static(settings.peers_file) if settings.peers_file else None
        self.assignments = AssignmentStore(settings.root, static)
        self.identity: NodeIdentity | None = None
        self.tls: TlsCredentials | None = None
        self.tokens: TokenFile | None = None
        auth: Authorizer
        if settings.auth == "tls":
            self.identity = identity or NodeIdentity(settings).loaded()
            self.tls = self.identity.credentials()
            members = JobMembers(settings.root, self.assignments)
            auth = PeerAuthorizer(members, settings.node_name, lambda: self._not_after())
        else:
            self.tokens = TokenFile(settings.token_file or "")
            auth = TokenAuthorizer(self.tokens)
        self.policies = PolicyStore(settings.root)
        self.quotas = JobQuotas(settings.root, self.policies, settings.job_quota)
        self.scanner = InventoryScanner(
            settings.root,
            node=settings.node_name,
            endpoint=settings.api_endpoint,
            domain=settings.domain,
            max_manifest_bytes=settings.max_manifest_bytes,
            fragments=FragmentScanner(settings.max_manifest_bytes),
        )
        self.local_inventory = LocalInventory(
            self.scanner, backup, redundancy=lambda job: self.replication.redundancy.get(job)
        )
        files = self.identity.files if self.identity is not None else None
        self.supervisor = WorkerSupervisor(worker_config(settings, files), on_event=self._on_data_event)
        # one attempt per question: the callers ask again (restore planning) or next round (reconcile)
        self.peers = ReplicatorClient(
            token=self.tokens,
            tls=self.tls,
            timeout=settings.inventory_timeout,
            retry=ONE_ATTEMPT,
            transport=peer_transport,
        )
        self.watcher = CommitWatcher(settings.root, poll_interval=settings.poll_interval)
        self.replication = ReplicationManager(
            node=settings.node_name,
            k=settings.replicas,
            scanner=self.scanner,
            assignments=self.assignments,
            supervisor=self.supervisor,
            peers=self.peers,
            metrics=self.metrics,
            retry_max=settings.retry_max,
            reconcile_interval=settings.reconcile_interval,
            on_committed=self._on_committed if backup is not None else None,
            kick=self.watcher.kick,
            factor=lambda job: self.policies.replication_factor(job, settings.replicas),
            erasure=self.policies.erasure,
            quotas=self.quotas,
        )
        self.local_inventory.groups = self.replication.groups
        self.local_inventory.over_quota = self.replication.over_quota
        self.local_inventory.restoring = lambda job: {
            r: s.value for r, s in self.stager.states.get(job, {}).items()
        }
        self.stager = Stager(
            settings=settings,
            assignments=self.assignments,
            supervisor=self.supervisor,
            peers=self.peers,
            metrics=self.metrics,
            own_inventory=self.local_inventory,
            backup=backup,
        )
        self.requests = FetchRequests(
            root=settings.root,
            node=settings.node_name,
            assignments=self.assignments,
            supervisor=self.supervisor,
            peers=self.peers,
            own_inventory=self.local_inventory,
            plan_of=self.stager.plans.get,
            backup=backup,
        )
        self.orbax = OrbaxJobs(
            settings=settings,
            store=OrbaxStore(settings.root),
            stager=self.stager,
            metrics=self.metrics,
            kick=self.watcher.kick,
        )
        self.controls = NodeControls(
            settings=settings,
            auth=auth,
            metrics=self.metrics,
            started_at=self.started_at,
            backup=backup,
            assignments=self.assignments,
            policies=self.policies,
            scanner=self.scanner,
            local_inventory=self.local_inventory,
            supervisor=self.supervisor,
            watcher=self.watcher,
            replication=self.replication,
            stager=self.stager,
            requests=self.requests,
            orbax=self.orbax,
        )
        self._loops: list[asyncio.Task[None]] = []
        self.app = create_app(self.controls)
        self.probe_app = create_probe_app(self.controls)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.settings.root.mkdir(parents=True, exist_ok=True)
        await self.supervisor.start()
        self.watcher.start()
        self._loops.append(asyncio.create_task(self._replication_loop(), name="replication"))
        if self.identity is not None:
            self._loops.append(asyncio.create_task(self.identity.run(self._reload_tls), name="renewal"))
        if self.backup is not None:
            self._loops.append(asyncio.create_task(self._backup_loop(), name="backup-poll"))
        if self.settings.restore_on_start:
            jobs = set(list_jobs(self.settings.root))
            if self.assignments.static is not None:
                jobs.add(self.assignments.static.job)
            for job in sorted(jobs):
                if self.assignments.get(job) is not None:
                    self.stager.start(job)

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.stager.close()
        await self.requests.close()
        await self.orbax.close()
        await self.replication.close()
        self.watcher.close()
        await self.supervisor.stop()
        await self.peers.aclose()
        if self.backup is not None:
            await self.backup.close()

    async def preemption_backup(self) -> None:
        """Back up every job's newest step, all within ``preemption_timeout`` seconds."""
        backup = self.backup
        if backup is None:
            return
        jobs = list_jobs(self.settings.root)

        async def one(job: str) -> None:
            try:
                step = await backup.backup_now(job, all_local=True)
                log.info("preemption: job %s backed up at step %s", job, step)
            except LookupError as exc:  # neither the node nor the job's policy names a bucket
                log.info("preemption: job %s not backed up: %s", job, exc)
            except Exception as exc:
                log.error("preemption: backup of job %s failed: %s", job, exc)

        try:
            await asyncio.wait_for(asyncio.gather(*(one(j) for j in jobs)), self.settings.preemption_timeout)
        except asyncio.TimeoutError:
            log.error("preemption: backups did not finish within %.0fs", self.settings.preemption_timeout)

    def _not_after(self) -> float:
        return self.identity.not_after if self.identity is not None else float("inf")

    def _reload_tls(self) -> bool:
        """New certificate files: every context of this process (the API server's, the peers client's)
        loads them, here on the event loop that runs their handshakes; True if it did. Files that do not
        hold this node's identity are refused (logged once per change): the identity in use stays. The
        worker notices by itself, with the same check."""
        if self.tls is None:
            return False
        try:
            reloaded = self.tls.refresh()
        except (OSError, ValueError, ssl.SSLError) as exc:
            log.error(
                "refusing the replaced certificate files, keeping this node's current identity (valid "
                "until %s): %s",
                time.ctime(self._not_after()),
                exc,
            )
            return False
        if reloaded:
            log.info("reloaded this node's certificate (valid until %s)", time.ctime(self._not_after()))
        return reloaded

    async def _replication_loop(self) -> None:
        while True:
            try:
                self.watcher.refresh()
                await self.requests.scan()
                await self.orbax.scan()  # Orbax's new steps become primaries before the pass sees them
                await self.replication.run_pass()
                self._update_gauges()
            except Exception:
                log.exception("replication pass failed; retrying at the next wake-up")
            await self.watcher.wait()

    async def _backup_loop(self) -> None:
        """Join backups other nodes started, take over ranks of dead nodes, apply bucket retention."""
        assert self.backup is not None
        while True:
            await asyncio.sleep(self.settings.backup_poll_interval)
            for job in list_jobs(self.settings.root):
                try:
                    await self.backup.poll(job)
                except Exception:
                    log.exception("backup poll of job %s failed", job)
                self.local_inventory.forget_bucket(job)

    def _update_gauges(self) -> None:
        self.metrics.worker_up.set(1 if self.supervisor.alive else 0)
        for job in list_jobs(self.settings.root):
            h = self.scanner.holdings(job)
            self.metrics.steps.labels(job, "local").set(len({s for r in h.ranks.values() for s in r.local}))
            self.metrics.steps.labels(job, "replica").set(
                len({s for r in h.ranks.values() for s in r.replica})
            )
            self.metrics.held_bytes.labels(job, "local").set(h.local_bytes)
            self.metrics.held_bytes.labels(job, "replica").set(h.replica_bytes)

    def _on_data_event(self, event: DataEvent) -> None:
        incoming, served = event.op in ("put", "fragment"), event.op in ("get", "getfrag")
        direction = "in" if incoming else "served" if served else "report"
        self.metrics.transfers.labels(direction, outcome_status(event.status)).inc()
        if incoming and event.status == Status.TOO_LARGE:  # the data server's quota refusals
            self.metrics.quota_refusals.labels(event.job, "receive").inc()
        if event.status == 200 and (incoming or served):
            self.metrics.transfer_bytes.labels(direction).inc(event.bytes)
        if incoming:
            self.watcher.kick()

    async def _on_committed(self, job: str, step: int, ranks: tuple[int, ...]) -> None:
        assert self.backup is not None
        # Every node uploads its own primaries: uploads spread over the job's nodes with no hand-off
        # delay; a dead node's ranks are taken over from their replicas by the others' poll().
        await self.backup.on_step_committed(job, step, ranks, {r: (self.settings.node_name,) for r in ranks})


# ------------------------------------------------------------------------------------ serving


def api_server(daemon: Daemon) -> GuardedServer:
    """uvicorn for the daemon's app, behind ``api.guard``'s admission and deadlines; over mutual TLS
    unless ``--auth token``: the guard's accept loop does the handshake (the node's certificate, client
    certificates required and verified against the CA, their identity passed to the app) within the
    connection's deadline."""
    settings, tls = daemon.settings, daemon.tls
    return GuardedServer(
        daemon.app,
        ApiLimits(
            "control API",
            header_timeout=settings.api_header_timeout,
            body_timeout=settings.api_body_timeout,
            total=settings.api_max_connections,
            per_source=settings.api_connections_per_source,
        ),
        host=settings.listen_host,
        port=settings.api_port,
        tls=tls.server if tls is not None else None,  # one context, reloaded in place on renewal
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
    )


class _ProbeApp:
    """The probe server's app: until the daemon is built (while this node's certificate is being
    obtained) ``/healthz`` is ok and everything else unavailable; then the daemon's probe app."""

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        ok = scope.get("path") == "/healthz"
        body = b'{"status":"ok"}' if ok else b'{"status":"unavailable"}'
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200 if ok else 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def serve(settings: Settings) -> None:
    """Run the daemon until SIGTERM/SIGINT; then back up (bounded), and shut down in order."""
    settings.check_credentials()
    probe_app = _ProbeApp()
    probes = ProbeServer(
        probe_app,
        host=settings.listen_host,
        port=settings.probe_port,
        header_timeout=settings.api_header_timeout,
        body_timeout=settings.api_body_timeout,
        log_level=settings.log_level,
    )
    probes.start()  # first: /healthz answers while the certificate comes and the worker starts
    try:
        identity = None
        if settings.auth == "tls":
            identity = NodeIdentity(settings)
            await identity.obtain()
        metrics = Metrics()
        daemon = Daemon(
            settings, identity=identity, metrics=metrics, backup=load_job_backups(settings, metrics.registry)
        )
        probe_app.app = daemon.probe_app  # /readyz says when the daemon is ready
        await daemon.start()
    except BaseException:
        probes.stop()
        raise
    server = api_server(daemon)
    mode = "mutual TLS, client certificates of the tierckpt CA" if daemon.tls else "legacy bearer token"
    log.info("control API on %s:%d (%s)", settings.listen_host, settings.api_port, mode)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(server.serve(), name="control-api")
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            log.info("signal received: backing up, then shutting down")
            await daemon.preemption_backup()
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
    finally:
        stopped.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await daemon.close()
        probes.stop()
        log.info("replicator stopped")
