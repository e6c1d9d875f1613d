"""The daemon's replication loop: notice commits, plan sends, hand them to the worker, keep count.

Each pass (woken by inotify, or every ``poll_interval``; the daemon's ``commits.CommitFeed`` hands
this manager each job's holdings, ``on_holdings``): for every job with a peer assignment, take
the newest committed step of each local rank and, if fewer than K peers are known to hold it, send it
(``plan.plan_sends``; the worker tries candidates in order until K succeed). Failures back off
exponentially per step (and a failing peer moves to the end of the candidate list for a while).
Every ``reconcile_interval`` the peers' inventories are checked, so a replica a peer lost (node wiped,
replica found corrupt) is sent again. That check runs in the background, every peer and job at once:
a peer that does not answer costs it one ``inventory_timeout``, and never holds up the sends of a
pass; a copy on a peer that does not answer, or that left the plan, no longer counts (it is sent to
the next candidate), so neither the lag nor the redundancy hides a lost replica.

Healing: K is the job's own replication factor (``factor(job)``: its policy's, else ``--replicas``).
When a job's peer plan changes (a new assignment generation, or a new factor), the copies on nodes
that left the plan are forgotten and the job's peers are checked at once, so every step the plan says
should exist on a live peer is sent there at once, without waiting for the next save.

Erasure coding (the job's policy names ``k`` data and ``m`` parity fragments): instead of replicas,
the worker encodes each rank's newest step and sends its ``k + m`` fragments to as many other nodes
(``ErasureTask``); the job's target is then ``m`` (the nodes it may lose) and a rank's copies are the
fragments placed beyond ``k``. Replicas left from before are retired.

Quota: a newest step whose COMMIT declares more bytes than the job's quota (``quota.JobQuotas``; a
sparse file costs the pod nothing, a peer all of it) is not sent, nor encoded; it is logged and counted
once and reported (``over_quota(job)``: the inventory's ``over_quota``, which the operator turns into an
Event). The rank's older steps keep their copies on the peers; its next step within the quota goes out
as usual.

A purge fences the job first (``fence``): no send, fragment, retirement or healing
of it starts any more, and those in flight are waited for; in the worker, its transfers still arriving
are aborted and no new one is taken; ``unfence`` once its steps are gone.

Only the newest step of a rank is ever sent: an older one that is still in flight when a newer one
commits finishes, and the newer one follows. A rank saved in a replica group goes first to peers that
hold an identical member step (they link its data files: ``replication.groups``); such a linked copy
counts toward the factor like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Sequence
from typing import Any

from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.control import PeerAssignment, Redundancy, StepOverQuota
from tierckpt.protocol.errors import ContractError, RetryableError
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.inventory import Holdings, InventoryScanner, list_jobs
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.quota import JobQuotas
from tierckpt_replicator.replication.groups import GroupTracker
from tierckpt_replicator.replication.ipc import (
    ErasureTask,
    Outcome,
    OutcomeStatus,
    PeerAddress,
    RetireTask,
    SendTask,
    TaskResult,
)
from tierckpt_replicator.replication.plan import (
    SendItem,
    candidate_targets,
    home_peers,
    plan_sends,
    unplaced,
)
from tierckpt_replicator.replication.redundancy import RedundancyLog, assess
from tierckpt_replicator.replication.supervisor import WorkerSupervisor

__all__ = ["ReplicationManager"]

log = logging.getLogger(__name__)

NODE_FAULTS: frozenset[OutcomeStatus] = frozenset({"unreachable", "busy", "full", "failed"})
"""Outcomes that put the peer itself in backoff (last among the candidates of every job for a while).
The others are about one job or step: ``unauthorized`` (the peer does not know the job yet, or any
more: its plan is behind), ``corrupt``, ``missing``; the step's own backoff retries those, so one job's
stale plan on a node does not move every other job's replicas off it."""

Key = tuple[str, int, int]

_RECONCILE_PARALLEL = 16
"""Peer inventories asked at once while reconciling."""


class _Backoff:
    """Exponential backoff per key: ``ready(key)`` until ``fail(key)``; ``ok(key)`` resets it.

    Not a retry loop (so not tenacity): nothing waits here. It is bookkeeping the planner reads on
    every pass: which (job, rank, step) sends and which peers are held back until when, across passes
    that are woken by inotify, and a newer step of a rank supersedes its older one's backoff.
    """

    def __init__(self, first: float, cap: float) -> None:
        self.first, self.cap = first, cap
        self._state: dict[object, tuple[float, float]] = {}

    def ready(self, key: object, now: float) -> bool:
        return now >= self._state.get(key, (0.0, 0.0))[0]

    def fail(self, key: object, now: float) -> float:
        delay = min(self._state.get(key, (0.0, self.first / 2))[1] * 2, self.cap)
        self._state[key] = (now + delay, delay)
        return delay

    def ok(self, key: object) -> None:
        self._state.pop(key, None)

    def blocked(self, now: float) -> set[object]:
        return {k for k, (until, _) in self._state.items() if until > now}


class ReplicationManager:
    def __init__(
        self,
        *,
        node: str,
        k: int,
        scanner: InventoryScanner,
        assignments: AssignmentStore,
        supervisor: WorkerSupervisor,
        peers: ReplicatorClient,
        metrics: Metrics,
        retry_max: float = 60.0,
        reconcile_interval: float = 30.0,
        kick: Callable[[], None] = lambda: None,
        factor: Callable[[str], int] | None = None,
        erasure: Callable[[str], tuple[int, int] | None] = lambda job: None,
        quotas: JobQuotas | None = None,
    ) -> None:
        self.node, self.k = node, k
        self.quotas = quotas or JobQuotas(scanner.root, PolicyStore(scanner.root))
        """Each job's quota: newest steps that declare more are neither sent nor encoded."""
        self._over_quota: dict[Key, StepOverQuota] = {}
        self.factor: Callable[[str], int] = factor or (lambda job: k)
        """The job's replication factor (``k``, the node's ``--replicas``, unless its policy says)."""
        self.erasure = erasure
        """The job's erasure code ``(k, m)``, or None when it is replicated."""
        self.placed: dict[Key, dict[str, int]] = {}
        """Erasure-coded jobs: (job, rank, step) -> node -> index of the fragment it confirmed."""
        self.scanner, self.assignments, self.supervisor = scanner, assignments, supervisor
        self.peers, self.metrics = peers, metrics
        self.reconcile_interval = reconcile_interval
        self.kick = kick
        self.confirmed: dict[Key, set[str]] = {}
        self.linked: dict[Key, set[str]] = {}
        """Holders whose copy of a step was linked from a replica group member's (it counts toward the
        factor like any other; the plan leaves it where it is and retirement keeps it first)."""
        self.last_replication: dict[str, float] = {}
        self._in_flight: set[Key] = set()
        self._step_backoff = _Backoff(1.0, retry_max)
        self._node_backoff = _Backoff(2.0, retry_max)
        self._tasks: set[asyncio.Task[None]] = set()
        self._job_tasks: dict[str, set[asyncio.Task[None]]] = {}
        self._fenced: set[str] = set()
        self._last_reconcile = time.monotonic()
        self._reconciling: asyncio.Task[None] | None = None
        self._plans: dict[str, tuple[int, int, tuple[int, int] | None]] = {}
        """Job -> (assignment generation, target, erasure code) last acted on."""
        self.redundancy: dict[str, Redundancy] = {}
        self._degraded = RedundancyLog()
        self._lost: set[Key] = set()
        """Newest steps that lost a confirmed copy (short at once, whatever their age)."""
        self._saves: dict[tuple[str, int], tuple[int, float]] = {}
        """(job, rank) -> its newest step and that step's commit time, as last seen."""
        self.groups = GroupTracker(node=node, peers=peers, metrics=metrics, kick=kick)

    async def close(self) -> None:
        await self.groups.close()
        if self._reconciling is not None:
            self._tasks.add(self._reconciling)
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def lag(self, job: str, holdings: Holdings, now: float | None = None) -> float:
        """Seconds since the oldest local newest-step that still lacks K replicas committed (0 if none)."""
        now = time.time() if now is None else now
        k = self.target(job)
        lags = [
            now - holdings.newest_commit_at.get(rank, now)
            for rank, step in holdings.newest_local().items()
            if self.copies((job, rank, step)) < k
        ]
        return max(lags, default=0.0)

    def target(self, job: str) -> int:
        """The copies each rank's newest step should have: the replication factor, or with erasure
        coding ``m`` (the fragment holders it may lose)."""
        ec = self.erasure(job)
        return ec[1] if ec is not None else self.factor(job)

    def copies(self, key: Key) -> int:
        """Confirmed copies of a step: its replicas, or with erasure coding the fragments beyond ``k``."""
        ec = self.erasure(key[0])
        if ec is None:
            return len(self.confirmed.get(key, ()))
        return max(0, len(set(self.placed.get(key, {}).values())) - ec[0])

    async def run_pass(self) -> None:
        """One pass over every job on its own (the daemon's passes come from its commit feed)."""
        for job in list_jobs(self.scanner.root):
            await self.on_holdings(job, self.scanner.holdings(job))
        self.reconcile_if_due()

    async def on_holdings(self, job: str, holdings: Holdings) -> None:
        """The commit feed's scan of ``job``: plan and start its sends (never raises for the job's
        trouble)."""
        if job in self._fenced:
            return
        try:
            await self._pass_job(job, holdings)
        except ContractError as exc:
            log.error("job %s: cannot replicate: %s", job, exc)

    def reconcile_if_due(self) -> None:
        """Start a reconcile in the background when one is due and none is running."""
        idle = self._reconciling is None or self._reconciling.done()
        if idle and time.monotonic() - self._last_reconcile >= self.reconcile_interval:
            self._last_reconcile = time.monotonic()
            self._reconciling = asyncio.create_task(self._reconcile_logged(), name="reconcile")

    async def _reconcile_logged(self) -> None:
        try:
            await self.reconcile()
        except Exception:
            log.exception("reconcile failed; trying again in %.0fs", self.reconcile_interval)

    async def _pass_job(self, job: str, holdings: Holdings) -> None:
        newest = holdings.newest_local()
        over_quota = self._refuse_over_quota(job, holdings)
        self._prune(job, newest, holdings.newest_commit_at)
        assignment = self.assignments.get(job)
        k = self.target(job)
        if assignment is not None:
            self._notice_plan(job, assignment, k)
        self._assess(job, holdings, k)
        self.metrics.replication_lag.labels(job).set(self.lag(job, holdings))
        if assignment is None or not newest:
            return
        now = time.monotonic()
        in_flight = {(r, s) for (j, r, s) in self._in_flight if j == job}
        in_backoff = {(r, s) for (r, s) in newest.items() if not self._step_backoff.ready((job, r, s), now)}
        in_backoff |= over_quota
        avoid = {n for n in self._node_backoff.blocked(now) if isinstance(n, str)}
        ec = self.erasure(job)
        if ec is not None:
            self._send_fragments_due(job, assignment, newest, ec, in_flight | in_backoff, avoid)
            self._retire_surplus(job, assignment, newest, 0, now)  # replicas from before the code
            return
        confirmed = {(r, s): nodes for (j, r, s), nodes in self.confirmed.items() if j == job}
        unsent = unplaced(node=self.node, k=k, assignment=assignment, newest=newest, confirmed=confirmed)
        unsent -= {r for r, s in newest.items() if (r, s) in in_flight}
        linkable, hold = self.groups.plan(job, assignment, holdings, unsent)
        held = {(r, newest[r]) for r in hold}
        items = plan_sends(
            job=job,
            node=self.node,
            k=k,
            assignment=assignment,
            newest=newest,
            confirmed=confirmed,
            in_flight=in_flight | in_backoff | held,
            avoid=avoid,
            linkable=linkable,
        )
        if held:
            asyncio.get_running_loop().call_later(self.groups.wait, self.kick)
        for item in items:
            self._spawn(job, self._send(item, assignment, self._saves.get((job, item.rank))))
        self._retire_surplus(job, assignment, newest, k, now)

    def _refuse_over_quota(self, job: str, holdings: Holdings) -> set[tuple[int, int]]:
        """The (rank, step) of the newest local steps that declare more than the job's quota: logged and
        counted once each, kept for ``over_quota``, never sent."""
        refused: dict[Key, StepOverQuota] = {}
        quota = self.quotas.of(job)
        for rank, step in holdings.newest_local().items():
            declared = holdings.newest_bytes.get(rank, 0)
            if declared <= quota:
                continue
            key = (job, rank, step)
            over = self._over_quota.get(key)
            if over is None or over.quota != quota:
                limit = self.scanner.max_manifest_bytes
                over = self.quotas.committed_over(job, rank, step, declared=declared, limit=limit)
                if over is None:  # the quota grew meanwhile
                    continue
                log.warning("%s: not replicated, not backed up", over.describe(job))
                self.metrics.quota_refusals.labels(job, "send").inc()
            refused[key] = over
        for key in [k for k in self._over_quota if k[0] == job]:
            del self._over_quota[key]
        self._over_quota.update(refused)
        return {(rank, step) for (_, rank, step) in refused}

    def over_quota(self, job: str) -> tuple[StepOverQuota, ...]:
        """The job's newest local steps refused for its quota, as the last pass found them."""
        return tuple(o for (j, _, _), o in sorted(self._over_quota.items()) if j == job)

    def _send_fragments_due(
        self,
        job: str,
        assignment: PeerAssignment,
        newest: dict[int, int],
        ec: tuple[int, int],
        busy: set[tuple[int, int]],
        avoid: set[str],
    ) -> None:
        """An ``ErasureTask`` for every local rank whose newest step lacks some of its ``k + m`` fragments."""
        base = candidate_targets(assignment, self.node, avoid=avoid)
        for rank, step in sorted(newest.items()):
            key = (job, rank, step)
            placed = self.placed.get(key, {})
            if (rank, step) in busy or len(set(placed.values())) >= sum(ec):
                continue
            candidates = tuple(n for n in base if n not in placed)
            if candidates:
                save = self._saves.get((job, rank))
                self._spawn(job, self._send_fragments(key, ec, candidates, assignment, save))

    async def _send_fragments(
        self,
        key: Key,
        ec: tuple[int, int],
        candidates: tuple[str, ...],
        assignment: PeerAssignment,
        save: tuple[int, float] | None,
    ) -> None:
        async with self._working(key):
            task = ErasureTask(
                id=self.supervisor.next_id(),
                job=key[0],
                rank=key[1],
                step=key[2],
                k=ec[0],
                m=ec[1],
                candidates=tuple(PeerAddress.of(assignment, n) for n in candidates),
                placed=dict(self.placed.get(key, {})),
            )
            result = await self._run(task, key, "fragments of")
            if result is None:
                return
            now = time.monotonic()
            counts = not self._overtaken(key, save)
            for o in result.outcomes:
                self.metrics.transfers.labels("out", o.status).inc()
                if o.status in ("ok", "already") and o.index >= 0:
                    if counts:
                        self.placed.setdefault(key, {})[o.node] = o.index
                    self._node_backoff.ok(o.node)
                    if o.status == "ok":
                        self.metrics.transfer_bytes.labels("out").inc(o.bytes)
                elif o.status in NODE_FAULTS and o.node:
                    self._node_backoff.fail(o.node, now)
            if result.ok:
                self._step_backoff.ok(key)
                self.last_replication[key[0]] = time.time()
            else:
                delay = self._step_backoff.fail(key, now)
                held = len(set(self.placed.get(key, {}).values()))
                log.warning(
                    "fragments of %s rank %d step %d: %d of %d placed (%s); retrying in %.0fs",
                    *key,
                    held,
                    sum(ec),
                    result.message or "too few nodes took one",
                    delay,
                )

    def _retire_surplus(
        self, job: str, assignment: PeerAssignment, newest: dict[int, int], k: int, now: float
    ) -> None:
        """Copies beyond the factor (it dropped, or a copy went back to an assigned peer): keep the most
        preferred ``k`` holders (the peers the plan names first, then linked copies: they cost the holder
        next to nothing), ask the rest to drop theirs."""
        order = {n: i for i, n in enumerate(candidate_targets(assignment, self.node))}
        home = set(home_peers(assignment, self.node, k))
        for rank, step in newest.items():
            key = (job, rank, step)
            have = self.confirmed.get(key, set())
            if len(have) <= k or key in self._in_flight or not self._step_backoff.ready(("retire", key), now):
                continue
            linked = self.linked.get(key, set())
            preference = {n: (n not in home, n not in linked, order.get(n, len(order)), n) for n in have}
            keep = sorted(have, key=preference.__getitem__)[:k]
            surplus = tuple(sorted(n for n in have if n not in keep and n in assignment.nodes))
            if surplus:
                self._spawn(job, self._retire(key, surplus, assignment))

    async def _retire(self, key: Key, holders: tuple[str, ...], assignment: PeerAssignment) -> None:
        async with self._working(key):
            task = RetireTask(
                id=self.supervisor.next_id(),
                job=key[0],
                rank=key[1],
                step=key[2],
                holders=tuple(PeerAddress.of(assignment, n) for n in holders),
            )
            result = await self._run(task, ("retire", key), "retiring")
            if result is None:
                return
            for o in result.outcomes:
                if o.status == "ok":
                    self.confirmed.get(key, set()).discard(o.node)
                    self.linked.get(key, set()).discard(o.node)
            if result.ok:
                self._step_backoff.ok(("retire", key))
                log.info("%s rank %d step %d: surplus copies on %s retired", *key, list(holders))
            else:
                delay = self._step_backoff.fail(("retire", key), time.monotonic())
                log.warning(
                    "retiring %s rank %d step %d: %s; retrying in %.0fs", *key, result.outcomes, delay
                )

    def _spawn(self, job: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(self._unless_fenced(job, coro))
        of_job = self._job_tasks.setdefault(job, set())
        for tasks in (self._tasks, of_job):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _unless_fenced(self, job: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro``, unless ``job`` was fenced before it started (it never began, so it is closed)."""
        if job in self._fenced:
            coro.close()
            return
        await coro

    async def fence(self, job: str) -> None:
        """No send, fragment, retirement or healing of ``job`` starts on this node
        until ``unfence``; returns once those already started have finished, and the worker has aborted
        the job's transfers still arriving and holds none of its tasks (``WorkerSupervisor.fence``)."""
        self._fenced.add(job)
        tasks = self._job_tasks.get(job, set())
        if tasks:
            await asyncio.wait(set(tasks))
        await self.supervisor.fence(job)

    async def unfence(self, job: str) -> None:
        """Lift the fence (call ``forget`` first: the job's steps are gone)."""
        self._fenced.discard(job)
        if not self._job_tasks.get(job):
            self._job_tasks.pop(job, None)
        await self.supervisor.unfence(job)

    async def _send(self, item: SendItem, assignment: PeerAssignment, save: tuple[int, float] | None) -> None:
        """Send ``item``, planned from the rank's newest ``save`` (step, commit time) as the pass saw it."""
        key = (item.job, item.rank, item.step)
        async with self._working(key):
            candidates = tuple(PeerAddress.of(assignment, n) for n in item.candidates)
            task = SendTask(
                id=self.supervisor.next_id(),
                job=item.job,
                rank=item.rank,
                step=item.step,
                candidates=candidates,
                want=item.want,
                bases=item.bases,
            )
            result = await self._run(task, key, "send")
            if result is None:
                return
            self._record(key, result.outcomes, counts=not self._overtaken(key, save))
            self.groups.record(item.job, item.step, result.outcomes)
            if result.ok:
                self._step_backoff.ok(key)
                self.last_replication[item.job] = time.time()
            else:
                delay = self._step_backoff.fail(key, time.monotonic())
                log.warning(
                    "send %s rank %d step %d reached only %d of %d peers; retrying in %.0fs",
                    *key,
                    len(self.confirmed.get(key, ())),
                    self.factor(item.job),
                    delay,
                )

    @contextlib.asynccontextmanager
    async def _working(self, key: Key) -> AsyncIterator[None]:
        """``key`` in flight (no other send, encode or retirement of it starts) until the block ends;
        then the next pass is kicked."""
        self._in_flight.add(key)
        try:
            yield
        finally:
            self._in_flight.discard(key)
            self.kick()

    async def _run(
        self, task: SendTask | ErasureTask | RetireTask, backoff_key: object, what: str
    ) -> TaskResult | None:
        """Run ``task`` in the worker; None, with ``backoff_key`` backed off and logged, if it could not
        run there (the worker down or restarting)."""
        try:
            return await self.supervisor.run_task(task)
        except RetryableError as exc:
            delay = self._step_backoff.fail(backoff_key, time.monotonic())
            where = (task.job, task.rank, task.step)
            log.warning("%s %s rank %d step %d: %s; retrying in %.0fs", what, *where, exc, delay)
            return None

    def _record(self, key: Key, outcomes: Sequence[Outcome], *, counts: bool = True) -> None:
        """A send's outcomes: node backoff and metrics, and (``counts``) the copies confirmed."""
        now = time.monotonic()
        for o in outcomes:
            self.metrics.transfers.labels("out", o.status).inc()
            if o.status in ("ok", "already"):
                if counts:
                    self.confirmed.setdefault(key, set()).add(o.node)
                self._node_backoff.ok(o.node)
                if o.status == "ok":
                    if o.saved > 0 and counts:
                        self.linked.setdefault(key, set()).add(o.node)
                    self.metrics.transfer_bytes.labels("out").inc(o.bytes)
                    self.metrics.replication_seconds.observe(o.seconds)
            elif o.status in NODE_FAULTS:
                self._node_backoff.fail(o.node, now)

    def _overtaken(self, key: Key, save: tuple[int, float] | None) -> bool:
        """Whether the rank saved again (its step anew, or a newer one) since a pass planned a transfer of
        ``key`` from its newest ``save``: the copies the transfer made may be of the earlier save (it read
        the step before the new one replaced it), so they do not count; the next pass sends the new
        save (a peer that got it already answers "already"). A job forgotten meanwhile (purged) counts
        none either."""
        now = self._saves.get((key[0], key[1]))
        if now == save:
            return False
        if now is not None:
            log.info(
                "job %s rank %d: saved again (newest step %d) while step %d was sent; that send's copies "
                "are not counted, the next pass sends the new save",
                key[0],
                key[1],
                now[0],
                key[2],
            )
        return True

    def _notice_plan(self, job: str, assignment: PeerAssignment, k: int) -> None:
        """On a new plan (assignment generation, factor or erasure code): forget the copies on nodes that
        left it and check the job's peers now (in the background), so lost copies are sent again at once."""
        seen = (assignment.generation, k, self.erasure(job))
        before = self._plans.get(job)
        if before == seen:
            return
        self._plans[job] = seen
        if before is None:
            return  # first sight (daemon start): nothing is confirmed yet
        gone: set[str] = set()
        holders: list[tuple[Key, set[str] | dict[str, int]]] = [*self.confirmed.items(), *self.placed.items()]
        for key, held in holders:  # replicas, then erasure-coded fragments
            left = [n for n in held if n not in assignment.nodes] if key[0] == job else []
            for n in left:
                if isinstance(held, set):
                    held.discard(n)
                else:
                    del held[n]
            if left:
                gone.update(left)
                self._lost.add(key)
        log.info(
            "job %s: new peer plan (generation, target, code %s; was %s): healing%s; checking the peers now",
            job,
            seen,
            before,
            f", copies on {sorted(gone)} (gone from the plan) no longer count" if gone else "",
        )
        self._spawn(job, self._heal(job))

    async def _heal(self, job: str) -> None:
        try:
            await self.reconcile(jobs={job})
        except Exception:
            log.exception("job %s: checking the peers' holdings after a plan change failed", job)
        self.kick()

    def _assess(self, job: str, holdings: Holdings, k: int) -> None:
        """The job's redundancy now: gauges, and a log line and a count when it changes."""
        newest = holdings.newest_local()
        if not newest:
            self.redundancy.pop(job, None)
            return
        now = time.time()
        copies = {r: self.copies((job, r, s)) for r, s in newest.items()}
        fewest, short = assess(
            factor=k,
            copies=copies,
            committed_at=holdings.newest_commit_at,
            now=now,
            grace=self.reconcile_interval,
            lost={r for (j, r, s) in self._lost if j == job and newest.get(r) == s},
        )
        red, change = self._degraded.update(job, factor=k, copies=fewest, short=short, now=now)
        self.redundancy[job] = red
        self.metrics.replication_copies.labels(job).set(fewest)
        self.metrics.replication_factor.labels(job).set(k)
        self.metrics.replication_degraded.labels(job).set(1 if red.degraded else 0)
        if change:
            self.metrics.redundancy_changes.labels(job, change).inc()
            if change == "degraded":
                short_ranks = sorted(r for r, n in copies.items() if n < k)
                log.warning(
                    "job %s: below its replication factor %d (ranks %s): re-replicating", job, k, short_ranks
                )
            else:
                log.info("job %s: back at full redundancy (%d of %d copies)", job, fewest, k)

    def _prune(self, job: str, newest: dict[int, int], committed_at: dict[int, float]) -> None:
        """Forget confirmations of steps that are no longer a rank's newest, and of a newest step that was
        committed again (the job went back to an older step and saved this one anew: the copies
        confirmed are of its earlier save, and receivers replace them with the new one)."""
        for rank, step in newest.items():
            at = committed_at.get(rank)
            seen = self._saves.get((job, rank))
            if seen is not None and at is not None and seen[0] == step and seen[1] != at:
                log.info("job %s rank %d: step %d was saved again; sending it again", job, rank, step)
                for held in (self.confirmed, self.linked, self.placed):
                    held.pop((job, rank, step), None)
            if at is not None:
                self._saves[(job, rank)] = (step, at)
        for key in [k for k in self.confirmed if k[0] == job and newest.get(k[1]) != k[2]]:
            del self.confirmed[key]
        for key in [k for k in self.linked if k[0] == job and newest.get(k[1]) != k[2]]:
            del self.linked[key]
        for key in [k for k in self.placed if k[0] == job and newest.get(k[1]) != k[2]]:
            del self.placed[key]
        self._lost = {k for k in self._lost if k[0] != job or newest.get(k[1]) == k[2]}

    async def reconcile(self, jobs: Collection[str] | None = None) -> None:
        """Drop confirmations that peers no longer back up: their inventories lack the step, they do not
        answer, or they left the plan. Every (job, peer) inventory is asked at once (at most
        ``_RECONCILE_PARALLEL`` in flight), so peers that do not answer cost one timeout in all, not
        one each. ``jobs``: only these (default: every job)."""
        by_peer: dict[tuple[str, str], list[Key]] = {}
        for key, nodes in [*self.confirmed.items(), *((k, set(w)) for k, w in self.placed.items())]:
            if jobs is not None and key[0] not in jobs:
                continue
            for n in nodes:
                by_peer.setdefault((key[0], n), []).append(key)
        blocked = self._node_backoff.blocked(time.monotonic())
        for job in jobs if jobs is not None else list_jobs(self.scanner.root):
            a = self.assignments.get(job)
            for n in a.peers.get(self.node, ()) if a is not None else ():
                if n in blocked:  # an assigned peer in backoff: asked too, so it is preferred again once back
                    by_peer.setdefault((job, n), [])
        limit = asyncio.Semaphore(_RECONCILE_PARALLEL)

        async def check(job: str, name: str, keys: list[Key]) -> None:
            assignment = self.assignments.get(job)
            if assignment is None:
                return
            if name not in assignment.nodes:
                log.warning(
                    "%s left the plan of %s: its copies no longer count; sending them again", name, job
                )
                self._uncount(name, keys)
                return
            try:
                async with limit:
                    inv = await self.peers.inventory(assignment.nodes[name].endpoint, job, node=name)
            except (RetryableError, ContractError) as exc:
                log.warning("reconcile: %s (its copies of %s no longer count until it answers)", exc, job)
                self._uncount(name, keys)
                return
            if inv is None:
                log.info("reconcile: %s has no inventory route", name)
                return
            self._node_backoff.ok(name)  # it answers: no longer last among the candidates
            for key in keys:
                h = inv.ranks.get(key[1])
                if h is None or not (key[2] in h.replica or key[2] in h.local or key[2] in h.fragments):
                    log.warning("%s no longer holds %s rank %d step %d; sending it again", name, *key)
                    self._uncount(name, [key])

        await asyncio.gather(*(check(job, name, keys) for (job, name), keys in by_peer.items()))
        if by_peer:
            self.kick()

    def _uncount(self, name: str, keys: list[Key]) -> None:
        for key in keys:
            self.confirmed.get(key, set()).discard(name)
            self.placed.get(key, {}).pop(name, None)
            self._lost.add(key)

    def forget(self, job: str) -> None:
        self.groups.forget(job)
        for save in [k for k in self._saves if k[0] == job]:
            del self._saves[save]
        for key in [k for k in self.confirmed if k[0] == job]:
            del self.confirmed[key]
        for key in [k for k in self.placed if k[0] == job]:
            del self.placed[key]
        self._plans.pop(job, None)
        self._over_quota = {k: o for k, o in self._over_quota.items() if k[0] != job}
        self.redundancy.pop(job, None)
        self._degraded.forget(job)
        self._lost = {k for k in self._lost if k[0] != job}
