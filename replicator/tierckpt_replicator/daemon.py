"""The composition root and lifecycle of the replicator daemon.

``serve(settings)``: build every part (``Daemon``), start the replication worker process, the commit
watcher and the replication loop, stage restores for the jobs already known, then serve the control
API (uvicorn with httptools, on the uvloop event loop the caller runs) until SIGTERM or SIGINT.
Shutdown: back up each job's newest step (bounded by ``preemption_timeout``: a node being preempted
leaves its newest step in the bucket), stop the API, stop the worker, cancel the loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

import tierckpt_replicator
from tierckpt.planning.steps import newest_common_step
from tierckpt.protocol.control import (
    JobPolicy,
    JobStatus,
    NodeInventory,
    NodeStatus,
    PeerAssignment,
    RestorePlan,
    read_control,
    write_control,
)
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import discard_step, job_dir, rank_dir, ranks_in, replica_rank_dir, step_dirs
from tierckpt.protocol.tokens import TokenFile
from tierckpt_replicator.app import create_app
from tierckpt_replicator.assignments import AssignmentStore, load_static
from tierckpt_replicator.backup.jobs import BackupPort, load_job_backups
from tierckpt_replicator.inventory import InventoryScanner, list_jobs
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.peer_client import PeerClient
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.replication.ipc import DataEvent, WorkerConfig
from tierckpt_replicator.replication.manager import ReplicationManager
from tierckpt_replicator.replication.replicas import free_bytes
from tierckpt_replicator.replication.supervisor import WorkerSupervisor
from tierckpt_replicator.replication.transfer import outcome_status
from tierckpt_replicator.restore.stage import Stager
from tierckpt_replicator.settings import Settings
from tierckpt_replicator.watch import CommitWatcher

__all__ = ["Daemon", "serve", "worker_config"]

log = logging.getLogger(__name__)

_GCS_CACHE_SECONDS = 10.0


def worker_config(settings: Settings) -> WorkerConfig:
    assert settings.token_file is not None
    return WorkerConfig(
        node=settings.node_name,
        root=str(settings.root),
        token_file=str(settings.token_file),
        listen_host=settings.listen_host,
        data_port=settings.data_port,
        holder=settings.holder,
        concurrency=settings.concurrency,
        max_incoming=settings.max_incoming,
        bandwidth_bytes_per_s=settings.bandwidth_limit * 1e6,
        transfer_timeout=settings.transfer_timeout,
        connect_timeout=settings.connect_timeout,
        max_manifest_bytes=settings.max_manifest_bytes,
        reserve_bytes=settings.reserve_bytes,
        replica_keep=settings.replica_keep,
        nice=settings.worker_nice,
        idle_class=settings.worker_idle,
        log_level=settings.log_level,
        send_method="sendfile" if settings.send_method == "sendfile" else "mmap",
    )


class Daemon:
    """Every part of one node's replicator, wired together; also the ``Controls`` the API calls."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: Metrics | None = None,
        backup: BackupPort | None = None,
        peer_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if settings.token_file is None:
            raise ValueError("--token-file is required: every request must carry the bearer token it holds")
        self.settings = settings
        self.tokens = TokenFile(settings.token_file)
        self.metrics = metrics or Metrics()
        self.started_at = time.time()
        self.backup = backup
        static = load_static(settings.peers_file) if settings.peers_file else None
        self.assignments = AssignmentStore(settings.root, static)
        self.policies = PolicyStore(settings.root)
        self.scanner = InventoryScanner(
            settings.root, node=settings.node_name, endpoint=settings.api_endpoint, domain=settings.domain
        )
        self.supervisor = WorkerSupervisor(worker_config(settings), on_event=self._on_data_event)
        self.peers = PeerClient(self.tokens, timeout=settings.inventory_timeout, transport=peer_transport)
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
        )
        self.stager = Stager(
            settings=settings,
            assignments=self.assignments,
            supervisor=self.supervisor,
            peers=self.peers,
            metrics=self.metrics,
            own_inventory=self.inventory,
            backup=backup,
        )
        self._gcs_cache: dict[str, tuple[float, dict[int, int]]] = {}
        self._loops: list[asyncio.Task[None]] = []
        self.app = create_app(self)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.settings.root.mkdir(parents=True, exist_ok=True)
        await self.supervisor.start()
        self.watcher.start()
        self._loops.append(asyncio.create_task(self._replication_loop(), name="replication"))
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
        await self.replication.close()
        self.watcher.close()
        await self.supervisor.stop()
        await self.peers.close()
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

    async def _replication_loop(self) -> None:
        while True:
            try:
                self.watcher.refresh()
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
                self._gcs_cache.pop(job, None)

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
        direction = "in" if event.op == "put" else "served" if event.op == "get" else "report"
        self.metrics.transfers.labels(direction, outcome_status(event.status)).inc()
        if event.status == 200 and event.op in ("put", "get"):
            self.metrics.transfer_bytes.labels(direction).inc(event.bytes)
        if event.op == "put":
            self.watcher.kick()

    async def _on_committed(self, job: str, step: int, ranks: tuple[int, ...]) -> None:
        assert self.backup is not None
        # Every node uploads its own primaries: uploads spread over the job's nodes with no hand-off
        # delay; a dead node's ranks are taken over from their replicas by the others' poll().
        await self.backup.on_step_committed(job, step, ranks, {r: (self.settings.node_name,) for r in ranks})

    # ------------------------------------------------------------------ Controls (the API calls these)

    async def inventory(self, job: str) -> NodeInventory:
        bucket = await self._bucket_steps(job)
        inv = self.scanner.inventory(job, gcs=tuple(bucket))
        # a step known only from the bucket still needs its world size, or nobody knows its ranks
        world_sizes = {**{s: ws for s, ws in bucket.items() if ws > 0}, **inv.world_sizes}
        return dataclasses.replace(inv, world_sizes=world_sizes)

    async def _gcs_steps(self, job: str) -> tuple[int, ...]:
        return tuple(sorted(await self._bucket_steps(job)))

    async def _bucket_steps(self, job: str) -> dict[int, int]:
        """Step -> world size of every step complete in the bucket (cached a few seconds)."""
        if self.backup is None:
            return {}
        cached = self._gcs_cache.get(job)
        if cached and time.monotonic() - cached[0] < _GCS_CACHE_SECONDS:
            return cached[1]
        try:
            steps = await self.backup.complete_world_sizes(job)
        except Exception as exc:  # the bucket being unreachable makes its steps unknown, not fatal
            log.warning("job %s: cannot list complete steps in the bucket: %s", job, exc)
            return cached[1] if cached else {}
        self._gcs_cache[job] = (time.monotonic(), steps)
        return steps

    async def put_peers(self, assignment: PeerAssignment) -> tuple[bool, PeerAssignment]:
        before = self.assignments.get(assignment.job)
        stored, current = self.assignments.put(assignment)
        if stored:
            self.watcher.kick()
            node = self.settings.node_name
            old_rank = before.node_ranks.get(node) if before is not None else None
            if node in current.node_ranks and current.node_ranks[node] != old_rank:
                log.info(
                    "job %s: this node now has node rank %d; staging its ranks",
                    current.job,
                    current.node_ranks[node],
                )
                self.stager.start(current.job)
        return stored, current

    async def put_plan(self, plan: RestorePlan) -> tuple[bool, RestorePlan]:
        try:
            current = read_control(self.settings.root, plan.job, RestorePlan.FILE, RestorePlan)
        except FormatError:
            current = None
        if isinstance(current, RestorePlan):
            if current.generation > plan.generation:
                return False, current
            if current == plan and (self.stager.running(plan.job) or plan.job in self.stager.plans):
                return True, current  # the same plan again: staging already under way or done
        write_control(self.settings.root, plan.job, RestorePlan.FILE, plan)
        self.stager.start(plan.job, plan)
        return True, plan

    async def put_policy(self, policy: JobPolicy) -> tuple[bool, JobPolicy]:
        """Store the job's policy (newer generation only); backups follow it from the next step on."""
        return self.policies.put(policy)

    async def backup_now(self, job: str) -> int | None:
        if self.backup is None:
            self.metrics.backups.labels("unconfigured").inc()
            raise LookupError("GCS backup is not configured on this node (--gcs-bucket)")
        try:
            step = await self.backup.backup_now(job, holders=self._placements(job))
        except LookupError:
            self.metrics.backups.labels("unconfigured").inc()
            raise
        except Exception:
            self.metrics.backups.labels("failed").inc()
            raise
        self.metrics.backups.labels("ok").inc()
        self._gcs_cache.pop(job, None)
        return step

    def _placements(self, job: str) -> dict[int, tuple[str, ...]]:
        """Where the copies of this node's primaries are, for the newest step they all share: here,
        and on the peers that confirmed a replica (which may not be the ones ``peers.json`` names)."""
        holdings = self.scanner.holdings(job)
        step = newest_common_step(h.local for h in holdings.ranks.values() if h.local)
        if step is None:
            return {}
        here = self.settings.node_name
        return {
            r: (here, *sorted(self.replication.confirmed.get((job, r, step), ())))
            for r, s in holdings.newest_local().items()
            if s == step
        }

    async def restore(self, job: str) -> None:
        self.stager.start(job)

    async def purge(self, job: str, *, bucket: bool = False) -> bool:
        self.stager.forget(job)
        if bucket and self.backup is not None:  # first: the job's policy on disk names its bucket
            await self.backup.delete_job(job)
            log.info("job %s: purged its backups from the bucket", job)
        path = job_dir(self.settings.root, job)
        existed = path.exists()
        if existed:
            await asyncio.to_thread(remove_job_tree, self.settings.root, job)
            log.info("job %s: purged from this node's ramdisk", job)
        # forgotten once the steps are gone, so no loop sees them as new (and backs them up) meanwhile
        self.replication.forget(job)
        self.assignments.forget(job)
        self.policies.forget(job)
        self.scanner.forget(job)
        return existed

    async def status(self) -> NodeStatus:
        jobs = []
        for job in list_jobs(self.settings.root):
            h = self.scanner.holdings(job)
            a = self.assignments.get(job)
            newest = h.newest_local()
            plan = self.stager.plans.get(job)
            jobs.append(
                JobStatus(
                    job=job,
                    generation=a.generation if a else -1,
                    node_rank=a.node_ranks.get(self.settings.node_name) if a else None,
                    local={r: x.local for r, x in h.ranks.items() if x.local},
                    replicas={r: x.replica for r, x in h.ranks.items() if x.replica},
                    replicated_to={
                        r: tuple(sorted(self.replication.confirmed.get((job, r, s), ())))
                        for r, s in newest.items()
                    },
                    backed_up=await self._gcs_steps(job),
                    local_bytes=h.local_bytes,
                    replica_bytes=h.replica_bytes,
                    lag_seconds=self.replication.lag(job, h),
                    last_replication_at=self.replication.last_replication.get(job, 0.0),
                    restore_step=plan.step if plan else None,
                    restore={r: s.value for r, s in self.stager.states.get(job, {}).items()},
                    backup_error=getattr(self.backup.status(job), "last_error", "") if self.backup else "",
                )
            )
        ok, why = self.ready()
        st = os.statvfs(self.settings.root)
        return NodeStatus(
            node=self.settings.node_name,
            domain=self.settings.domain,
            endpoint=self.settings.api_endpoint,
            software_version=tierckpt_replicator.__version__,
            started_at=self.started_at,
            healthy=ok,
            problems=(why,) if why else (),
            worker_up=self.supervisor.alive,
            worker_restarts=self.supervisor.restarts,
            replicas_k=self.settings.replicas,
            ramdisk_free_bytes=free_bytes(self.settings.root),
            ramdisk_total_bytes=st.f_blocks * st.f_frsize,
            jobs=tuple(jobs),
        )

    def ready(self) -> tuple[bool, str]:
        if not self.supervisor.alive:
            return False, "the replication worker is not running"
        if not os.access(self.settings.root, os.W_OK):
            return False, f"ramdisk root {self.settings.root} is not writable"
        try:
            self.tokens.current()
        except (OSError, ValueError) as exc:
            return False, f"token file unreadable: {exc}"
        return True, ""


def remove_job_tree(root: Path, job: str) -> None:
    """Delete a job's steps (each COMMIT first, so nothing half-deleted looks committed), then the rest."""
    base = job_dir(root, job)
    for parent in [rank_dir(root, job, r) for r in ranks_in(base)] + [
        replica_rank_dir(root, job, r) for r in ranks_in(base / "replicas")
    ]:
        for path in step_dirs(parent).values():
            discard_step(path)
    shutil.rmtree(base, ignore_errors=True)
    if base.exists():  # e.g. a mount point: its contents are gone, the directory stays
        for child in base.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ serving


class _Server(uvicorn.Server):
    """uvicorn, minus its own signal handling: the daemon owns SIGTERM/SIGINT (see ``serve``)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(settings: Settings) -> None:
    """Run the daemon until SIGTERM/SIGINT; then back up (bounded), and shut down in order."""
    metrics = Metrics()
    daemon = Daemon(settings, metrics=metrics, backup=load_job_backups(settings, metrics.registry))
    await daemon.start()
    server = _Server(
        uvicorn.Config(
            daemon.app,
            host=settings.listen_host,
            port=settings.api_port,
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level=settings.log_level.lower(),
            timeout_graceful_shutdown=5,
            limit_concurrency=128,
        )
    )
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
        log.info("replicator stopped")
