"""The composition root and lifecycle of the replicator daemon.

``Daemon`` builds every part, each from the parts built before it, and runs them in uvicorn's phases
(``startup``, ``main_loop``, ``shutdown``); what the control API does is
``tierckpt_replicator.controls.NodeControls``. ``serve(settings)``: start the probe server (its own
thread and loop, ``tierckpt_replicator.probes``), obtain this node's certificate (``--auth tls``; see
``identity``), build the daemon; startup: the replication worker process, the commit watcher, the
replication loop (the ``commits.CommitFeed`` hands each pass's holdings to replication and backup),
the backup poll and the certificate renewal, restores staged for the jobs already known; main loop:
the control API (uvicorn's HTTP protocol behind ``api.guard``'s accept loop, admission and deadlines,
over mutual TLS unless ``--auth token``, on the uvloop event loop the caller runs) until SIGTERM or
SIGINT, then a backup of each job's newest step (bounded by ``preemption_timeout``: a node being
preempted leaves its newest step in the bucket); shutdown: cancel the loops, stop the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import ssl
import time
from typing import Any

import httpx

from tierckpt.protocol.client import ONE_ATTEMPT, ReplicatorClient
from tierckpt.protocol.control import RestoreState
from tierckpt.protocol.identity import TlsFiles
from tierckpt.protocol.tokens import TokenFile
from tierckpt_replicator.access import JobMembers
from tierckpt_replicator.api.auth import Authorizer, PeerAuthorizer, TokenAuthorizer
from tierckpt_replicator.api.guard import ApiLimits, GuardedServer
from tierckpt_replicator.app import create_app, create_probe_app
from tierckpt_replicator.backup.jobs import NO_BACKUP, BackupPort, load_job_backups
from tierckpt_replicator.commits import CommitFeed, NewSteps, StepCommitted
from tierckpt_replicator.controls import LocalInventory, NodeControls
from tierckpt_replicator.identity import NodeIdentity
from tierckpt_replicator.inventory import InventoryScanner, list_jobs
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.orbax import OrbaxJobs
from tierckpt_replicator.orbax_state import OrbaxStore
from tierckpt_replicator.probes import ProbeServer
from tierckpt_replicator.replication.fragments import FragmentScanner
from tierckpt_replicator.replication.ipc import DataEvent, WorkerConfig
from tierckpt_replicator.replication.manager import ReplicationManager
from tierckpt_replicator.replication.supervisor import WorkerSupervisor
from tierckpt_replicator.replication.transfer import outcome_status
from tierckpt_replicator.replication.wire import Status
from tierckpt_replicator.restore.requests import FetchRequests
from tierckpt_replicator.restore.stage import Stager
from tierckpt_replicator.settings import Settings
from tierckpt_replicator.stores import NodeStores
from tierckpt_replicator.watch import CommitWatcher

__all__ = ["Daemon", "DataEvents", "serve", "worker_config"]

log = logging.getLogger(__name__)


def worker_config(settings: Settings, tls: TlsFiles | None = None) -> WorkerConfig:
    """What the worker process needs: the data plane's settings whole, who this node is and how it
    authenticates (``tls``: the node's certificate files, ``--auth tls``)."""
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
        transfer=settings.transfer,
        log_level=settings.log_level,
    )


class Daemon:
    """Every part of one node's replicator, wired together, and their lifecycle.

    The phases follow uvicorn's ``Server``: the constructor builds the parts, each from the ones built
    before it (no part runs yet: the control API's app is ready for an in-process transport); then
    ``startup`` (the worker process, the commit watcher, the loops, restores of known jobs),
    ``main_loop`` (the control API until SIGTERM or SIGINT, then the preemption backup) and
    ``shutdown``. ``serve(settings)`` runs them all.

    ``identity`` (``--auth tls``): this node's certificate, already obtained (``serve`` does that);
    without it the daemon loads ``--tls-cert`` (local mode). ``stores``: the node's control state
    (default: opened here). ``backup``: tier 3 (``serve`` passes the node's ``JobBackups``, over the
    same ``stores``; none: ``NO_BACKUP``)."""

    def __init__(
        self,
        settings: Settings,
        *,
        identity: NodeIdentity | None = None,
        metrics: Metrics | None = None,
        stores: NodeStores | None = None,
        backup: BackupPort = NO_BACKUP,
        peer_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        settings.check_credentials()
        self.settings, self.backup = settings, backup
        self.metrics = metrics or Metrics()
        self.started_at = time.time()
        # the node's state on disk (the backup, if any, was built over the same stores)
        stores = stores or NodeStores.open(settings)
        self.assignments, self.policies, self.quotas = stores.assignments, stores.policies, stores.quotas
        self.plans = stores.plans  # the stager keeps them; the backup, if any, reads the same
        # who this node is, and who may call it
        self.identity = (identity or NodeIdentity(settings).loaded()) if settings.auth == "tls" else None
        self.tls = self.identity.credentials() if self.identity is not None else None
        self.tokens = TokenFile(settings.token_file or "") if self.identity is None else None
        self.auth = self._authorizer()
        # what the ramdisk holds, and when it changes
        self.scanner = InventoryScanner(
            settings.root,
            node=settings.node_name,
            endpoint=settings.api_endpoint,
            domain=settings.domain,
            max_manifest_bytes=settings.transfer.max_manifest_bytes,
            fragments=FragmentScanner(settings.transfer.max_manifest_bytes),
            plan_of=self.plans.get,  # the steps the run a job left saved
        )
        self.watcher = CommitWatcher(settings.root, poll_interval=settings.poll_interval)
        self.commits = CommitFeed(self.scanner)
        # the data plane (the worker process) and the peers' control APIs
        files = self.identity.files if self.identity is not None else None
        self.supervisor = WorkerSupervisor(
            worker_config(settings, files), on_event=DataEvents(self.metrics, self.watcher)
        )
        # one attempt per question: the callers ask again (restore planning) or next round (reconcile)
        self.peers = ReplicatorClient(
            token=self.tokens,
            tls=self.tls,
            timeout=settings.inventory_timeout,
            retry=ONE_ATTEMPT,
            transport=peer_transport,
        )
        # tier 2: replication; tier 3: every local commit goes to the backup too
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
            kick=self.watcher.kick,
            factor=functools.partial(self.policies.replication_factor, default=settings.replicas),
            erasure=self.policies.erasure,
            quotas=self.quotas,
        )
        self.uploads = NewSteps(self._upload)
        self.commits.subscribe("replication", self.replication.on_holdings)
        self.commits.subscribe("backup", self.uploads)
        self._build_restores()
        self.controls = self._controls()
        self.app = create_app(self.controls)
        self.probe_app = create_probe_app(self.controls)
        self._loops: list[asyncio.Task[None]] = []

    def _build_restores(self) -> None:
        """This node's inventory (with the bucket's steps), restore staging, the training ranks' fetch
        requests and Orbax mode: over the tiers built before."""
        settings, backup = self.settings, self.backup
        restoring: dict[str, dict[int, RestoreState]] = {}
        self.local_inventory = LocalInventory(
            self.scanner, backup, replication=self.replication, restoring=restoring
        )
        self.stager = Stager(
            settings=settings,
            assignments=self.assignments,
            supervisor=self.supervisor,
            peers=self.peers,
            metrics=self.metrics,
            own_inventory=self.local_inventory,
            backup=backup,
            states=restoring,
            plans=self.plans,
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
            attempts=settings.restore_attempts,
            retry_max=settings.retry_max,
        )
        self.orbax = OrbaxJobs(
            settings=settings,
            store=OrbaxStore(settings.root),
            stager=self.stager,
            metrics=self.metrics,
            kick=self.watcher.kick,
        )

    def _controls(self) -> NodeControls:
        return NodeControls(
            settings=self.settings,
            auth=self.auth,
            metrics=self.metrics,
            started_at=self.started_at,
            backup=self.backup,
            assignments=self.assignments,
            policies=self.policies,
            scanner=self.scanner,
            local_inventory=self.local_inventory,
            supervisor=self.supervisor,
            watcher=self.watcher,
            replication=self.replication,
            uploads=self.uploads,
            stager=self.stager,
            requests=self.requests,
            orbax=self.orbax,
        )

    def _authorizer(self) -> Authorizer:
        """Mutual TLS: peers of the node's jobs by their certificates; else the bearer token."""
        identity = self.identity
        if identity is None:
            assert self.tokens is not None
            return TokenAuthorizer(self.tokens)
        members = JobMembers(self.settings.root, self.assignments)
        return PeerAuthorizer(members, self.settings.node_name, lambda: identity.not_after)

    # ------------------------------------------------------------------ lifecycle

    async def startup(self) -> None:
        """Start the worker process, the commit watcher and the loops; stage restores of known jobs."""
        self.settings.root.mkdir(parents=True, exist_ok=True)
        await self.supervisor.start()
        self.watcher.start()
        self._loops.append(asyncio.create_task(self._replication_loop(), name="replication"))
        self._loops.append(asyncio.create_task(self._backup_loop(), name="backup-poll"))
        if self.identity is not None:
            self._loops.append(asyncio.create_task(self.identity.run(self._reload_tls), name="renewal"))
        if self.settings.restore_on_start:
            jobs = set(list_jobs(self.settings.root))
            if self.assignments.static is not None:
                jobs.add(self.assignments.static.job)
            for job in sorted(jobs):
                if self.assignments.get(job) is not None:
                    self.stager.start(job)

    async def main_loop(self) -> None:
        """Serve the control API until SIGTERM or SIGINT (or the server stops by itself); on a signal,
        back up first (``preemption_backup``)."""
        settings = self.settings
        server = api_server(self)
        mode = "mutual TLS, client certificates of the tierckpt CA" if self.tls else "legacy bearer token"
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
                await self.preemption_backup()
            server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        finally:
            stopped.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def shutdown(self) -> None:
        """Stop the loops, the staging and sends under way, the watcher and the worker, in that order."""
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.uploads.close()
        await self.stager.close()
        await self.requests.close()
        await self.orbax.close()
        await self.replication.close()
        self.watcher.close()
        await self.supervisor.stop()
        await self.peers.aclose()
        await self.backup.close()

    async def preemption_backup(self) -> None:
        """Back up every job's newest step, all within ``preemption_timeout`` seconds."""
        jobs = list_jobs(self.settings.root)

        async def one(job: str) -> None:
            try:
                step = await self.backup.backup_now(job, all_local=True)
                log.info("preemption: job %s backed up at step %s", job, step)
            except LookupError as exc:  # neither the node nor the job's policy names a bucket
                log.info("preemption: job %s not backed up: %s", job, exc)
            except Exception as exc:
                log.error("preemption: backup of job %s failed: %s", job, exc)

        try:
            await asyncio.wait_for(asyncio.gather(*(one(j) for j in jobs)), self.settings.preemption_timeout)
        except asyncio.TimeoutError:
            log.error("preemption: backups did not finish within %.0fs", self.settings.preemption_timeout)

    def _reload_tls(self) -> bool:
        """New certificate files: every context of this process (the API server's, the peers client's)
        loads them, here on the event loop that runs their handshakes; True if it did. Files that do not
        hold this node's identity are refused (logged once per change): the identity in use stays. The
        worker notices by itself, with the same check."""
        if self.tls is None or self.identity is None:
            return False
        try:
            reloaded = self.tls.refresh()
        except (OSError, ValueError, ssl.SSLError) as exc:
            log.error(
                "refusing the replaced certificate files, keeping this node's current identity (valid "
                "until %s): %s",
                time.ctime(self.identity.not_after),
                exc,
            )
            return False
        if reloaded:
            log.info("reloaded this node's certificate (valid until %s)", time.ctime(self.identity.not_after))
        return reloaded

    async def _replication_loop(self) -> None:
        while True:
            try:
                self.watcher.refresh()
                await self.requests.scan()
                await self.orbax.scan()  # Orbax's new steps become primaries before the pass sees them
                await self.commits.run_pass()
                self.replication.reconcile_if_due()
                self._update_gauges()
            except Exception:
                log.exception("replication pass failed; retrying at the next wake-up")
            await self.watcher.wait()

    async def _backup_loop(self) -> None:
        """Join backups other nodes started, take over ranks of dead nodes, apply bucket retention."""
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

    async def _upload(self, committed: StepCommitted) -> None:
        # Every node uploads its own primaries: uploads spread over the job's nodes with no hand-off
        # delay; a dead node's ranks are taken over from their replicas by the others' poll().
        here = (self.settings.node_name,)
        await self.backup.on_step_committed(
            committed.job, committed.step, committed.ranks, {r: here for r in committed.ranks}
        )


class DataEvents:
    """The worker's data events (``DataEvent``: a transfer in, out or reported) counted in ``metrics``;
    a replica that came in wakes the watcher (the next pass sees it)."""

    def __init__(self, metrics: Metrics, watcher: CommitWatcher) -> None:
        self.metrics, self.watcher = metrics, watcher

    def __call__(self, event: DataEvent) -> None:
        incoming, served = event.op in ("put", "fragment"), event.op in ("get", "getfrag")
        direction = "in" if incoming else "served" if served else "report"
        self.metrics.transfers.labels(direction, outcome_status(event.status)).inc()
        if incoming and event.status == Status.TOO_LARGE:  # the data server's quota refusals
            self.metrics.quota_refusals.labels(event.job, "receive").inc()
        if event.status == 200 and (incoming or served):
            self.metrics.transfer_bytes.labels(direction).inc(event.bytes)
        if incoming:
            self.watcher.kick()


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
            keepalive=settings.api_keepalive,
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
        metrics, stores = Metrics(), NodeStores.open(settings)
        backup = load_job_backups(settings, metrics.registry, stores)
        daemon = Daemon(settings, identity=identity, metrics=metrics, stores=stores, backup=backup)
        probe_app.app = daemon.probe_app  # /readyz says when the daemon is ready
        await daemon.startup()
    except BaseException:
        probes.stop()
        raise
    try:
        await daemon.main_loop()
    finally:
        await daemon.shutdown()
        probes.stop()
        log.info("replicator stopped")
