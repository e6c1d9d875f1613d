"""Stage this node's ranks for restore: fetch what is missing from the fastest source, verified.

For a plan (published by the operator, or computed from every node's inventory), each rank this node
is responsible for (``PeerAssignment.process_ranks``: its node rank's block of process ranks) ends up
as a committed primary ``<job>/rank-N/step-S/``, so the client loads it as local:

1. already a local primary: nothing to move;
2. a replica this node holds: copied within the ramdisk (and verified);
3. a peer holding it (the plan's holders): streamed over the data endpoint, crc32c checked on arrival;
   a corrupt copy is reported to its holder and the next source is tried; for a rank the plan rebuilds
   from erasure-coded fragments (``Tier.ERASURE``), ``k`` fragments from its holders, decoded and
   checked against the step's crc32c (``replication.fragment_transfer``);
4. the bucket, through the backup service; a rank whose data files are another replica group
   member's there takes them from the node restoring that member (``restore.fanout``).

Staging runs once per restore: a new node rank (``PUT peers``) and the operator's plan (``PUT
restore-plan``) both ask for it, and whichever comes second keeps the run still staging the same step
into the same ranks (``start_for_assignment``, ``start_for_plan``), so no rank is fetched twice. A run
that already finished is never kept: a new plan stages again (ranks already here are only confirmed),
so every rank's status is newer than the plan, never one a client has saved past since (it would
ignore that one and load its own newest step). Sources are the plan's holders only: a rank the plan
gave no holders comes from the bucket.

Progress goes to ``<job>/control/restore-rank-N.json`` (see ``progress``); the plan comes from the
job's state directory (``restore.json``), never from the job directory a pod can write. While a run
decides what to stage (it computes the plan, or asks the bucket which ranks' data files are another
member's), the ranks this node runs read ``pending``, written again every second (``_Pending``): a
client waits on a status that moves, and one that read nothing for its stall timeout would load what
its ramdisk holds (on a node lost and back: nothing, so the job started afresh). Each rank makes up to
``restore_attempts`` rounds over the sources (tenacity: 1 s between rounds, doubling to ``retry_max``)
before it is marked ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import cast

from tenacity import AsyncRetrying, RetryCallState, retry_if_result, stop_after_attempt, wait_exponential

from tierckpt.planning.retention import FRESH_START
from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.control import (
    NodeInventory,
    PeerAssignment,
    RestorePlan,
    RestoreState,
    Tier,
    read_control,
    write_restore_status,
)
from tierckpt.protocol.errors import FormatError, RetryableError, TierckptError, UnsafePathError
from tierckpt.protocol.format import committed_steps, read_commit
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.backup.jobs import NO_BACKUP, BackupPort
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.replication.ipc import FetchSource, FetchTask, RebuildTask, TaskProgress, TaskResult
from tierckpt_replicator.replication.replicas import drop_above, drop_left_behind
from tierckpt_replicator.replication.supervisor import WorkerSupervisor
from tierckpt_replicator.restore.fanout import FanOut
from tierckpt_replicator.restore.gather import compute_plan
from tierckpt_replicator.restore.progress import ProgressReporter
from tierckpt_replicator.settings import Settings
from tierckpt_replicator.stepio import Copy, open_job, rank_tree, rank_trees, read_status, step_name

__all__ = ["Stager", "confirm_statuses", "invalidate_statuses", "published_plan"]

log = logging.getLogger(__name__)


def published_plan(root: Path, job: str, assignment: PeerAssignment | None) -> RestorePlan | None:
    """The operator's plan (``restore.json`` in the job's state directory), while it stands for the
    attempt of this node's assignment (``RestorePlan.stands_for``); None: compute one."""
    try:
        plan = read_control(root, job, RestorePlan.FILE, RestorePlan)
    except FormatError as exc:
        log.error("job %s: ignoring unreadable restore.json: %s", job, exc)
        return None
    if not isinstance(plan, RestorePlan):
        return None
    if (why := plan.stands_for(assignment)) is not None:
        log.info("job %s: not staging restore.json (%s); recomputing", job, why)
        return None
    return plan


_STATUS_FILE = re.compile(r"restore-rank-([0-9]{5,})\.json")


def invalidate_statuses(root: Path, job: str) -> None:
    """Turn every existing restore status of ``job`` back to ``pending`` (a new staging run begins)."""
    try:
        tree = open_job(root, job)
    except (FileNotFoundError, NotADirectoryError):
        return
    with tree:
        for name in sorted(tree.listdir("control") if tree.is_dir("control") else ()):
            if m := _STATUS_FILE.fullmatch(name):
                _invalidate(tree, int(m.group(1)))


def confirm_statuses(root: Path, job: str, states: Mapping[int, RestoreState], step: int | None) -> bool:
    """Write each rank's restore status again as it is, but updated now; False if one does not say
    what ``states`` and ``step`` say (a pod may have rewritten the file) or cannot be rewritten."""
    try:
        tree = open_job(root, job)
    except (FileNotFoundError, NotADirectoryError):
        return not states
    with tree:
        for rank, state in states.items():
            old = read_status(tree, rank)
            if old is None or (old.state, old.step) != (state, step):
                return False
            try:
                write_restore_status(tree, dataclasses.replace(old, updated_at=time.time()))
            except (OSError, FormatError):
                return False
    return True


def _invalidate(tree: Beneath, rank: int) -> None:
    old = read_status(tree, rank)
    if old is None:
        return
    if old.state != RestoreState.PENDING:
        fresh = dataclasses.replace(
            old,
            state=RestoreState.PENDING,
            step=None,
            source=None,
            bytes_done=0,
            bytes_total=0,
            updated_at=time.time(),
            message="restore restarting",
        )
        with contextlib.suppress(OSError, FormatError):
            write_restore_status(tree, fresh)


class Stager:
    def __init__(
        self,
        *,
        settings: Settings,
        assignments: AssignmentStore,
        supervisor: WorkerSupervisor,
        peers: ReplicatorClient,
        metrics: Metrics,
        own_inventory: Callable[[str], Awaitable[NodeInventory]],
        backup: BackupPort = NO_BACKUP,
        states: dict[str, dict[int, RestoreState]] | None = None,
        plans: dict[str, RestorePlan] | None = None,
    ) -> None:
        self.settings, self.assignments, self.supervisor = settings, assignments, supervisor
        self.peers, self.metrics, self.backup = peers, metrics, backup
        self.own_inventory = own_inventory
        self.plans: dict[str, RestorePlan] = plans if plans is not None else {}
        """Job -> the plan this node staged last (``plans``: the map to keep them in, which this node's
        inventory and backups read)."""
        self.states: dict[str, dict[int, RestoreState]] = states if states is not None else {}
        """Job -> rank -> the state of its staging (``states``: the map to keep them in, which this
        node's inventory reads)."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._staging: dict[str, tuple[RestorePlan, tuple[int, ...]]] = {}
        """Job -> the plan its current (or last) run decided and the ranks it stages."""
        self.fanout = FanOut(
            node=settings.node_name,
            peers=peers,
            supervisor=supervisor,
            backup=backup,
            local_state=lambda job, rank: self.states.get(job, {}).get(rank),
            local_committed=lambda job, rank, step: self._committed(job, "primary", rank, step),
            wait=settings.restore_fanout_wait,
        )

    @property
    def node(self) -> str:
        return self.settings.node_name

    def start(self, job: str, plan: RestorePlan | None = None) -> asyncio.Task[None]:
        """(Re)start staging ``job``; a run already going for it is cancelled. Every restore status of
        the job is ``pending`` when this returns: no client reads an older run's ``ready`` any more."""
        old = self._tasks.get(job)
        if old is not None and not old.done():
            old.cancel()
        self._staging.pop(job, None)
        try:
            invalidate_statuses(self.settings.root, job)
        except (OSError, FormatError) as exc:  # a job tree a pod made unusable: the run reports it
            log.warning("restore %s: cannot reset the restore statuses: %s", job, exc)
        task = asyncio.create_task(self._run(job, plan), name=f"restore-{job}")
        self._tasks[job] = task
        return task

    def start_for_assignment(self, job: str, assignment: PeerAssignment) -> None:
        """This node got a new node rank: stage its ranks, unless a run already stages exactly them."""
        current = self._staging_same(job, assignment)
        if current is not None:
            log.info("restore %s: this node's ranks already staged for step %s; not again", job, current.step)
            return
        self.start(job)

    def start_for_plan(self, job: str, plan: RestorePlan) -> None:
        """The operator published a new ``plan``: stage it, unless a run still stages its step into the
        ranks it gives this node (then that run goes on under ``plan``, restarting it would fetch its
        ranks again; the ranks it finished are confirmed at once, see ``_confirm_finished``)."""
        if self._staging_same(job, self.assignments.get(job), plan) is not None and self._confirm_finished(
            job, plan
        ):
            log.info("restore %s: step %s already being staged; keeping that run", job, plan.step)
            self.plans[job] = plan
            return
        self.start(job, plan)

    def _staging_same(
        self, job: str, assignment: PeerAssignment | None, plan: RestorePlan | None = None
    ) -> RestorePlan | None:
        """The plan of the run still staging exactly this node's ranks under ``assignment``, and
        ``plan``'s step and world size if given; None if there is no such run (a finished one is not)."""
        decided = self._staging.get(job)
        if decided is None or assignment is None or not self.running(job):
            return None
        current, ranks = decided
        if plan is not None and (current.step, current.world_size) != (plan.step, plan.world_size):
            return None
        return current if assignment.process_ranks(self.node, current.world_size) == ranks else None

    def _confirm_finished(self, job: str, plan: RestorePlan) -> bool:
        """Write again, with the time of ``plan``, the status of each rank the running run finished
        (``ready`` or ``none``), so that none is older than the plan; False if a ``ready`` rank no longer
        holds the step here (the run must start over)."""
        states = self.states.get(job, {})
        done = {r: s for r, s in states.items() if s in (RestoreState.READY, RestoreState.NONE)}
        staged = self._staging.get(job, (plan, ()))[1]
        if plan.step is not None and any(
            s is RestoreState.READY and r in staged and not self._committed(job, "primary", r, plan.step)
            for r, s in done.items()
        ):
            return False
        return confirm_statuses(self.settings.root, job, done, plan.step)

    def running(self, job: str) -> bool:
        task = self._tasks.get(job)
        return task is not None and not task.done()

    async def forget(self, job: str) -> None:
        """Stop staging ``job`` and drop what is known about it. Returns once its staging has ended, so
        none of its status writes (which create the job's directory) comes after a purge deleted it."""
        task = self._tasks.pop(job, None)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        self.plans.pop(job, None)
        self.states.pop(job, None)
        self._staging.pop(job, None)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, job: str, plan: RestorePlan | None) -> None:
        try:
            assignment = self.assignments.get(job)
            async with _Pending(self.settings.root, job) as pending:
                pending.add(assignment.process_ranks(self.node) if assignment is not None else ())
                if plan is None:
                    plan = self._standing_plan(job, assignment) or await compute_plan(
                        job,
                        lambda: self.own_inventory(job),
                        assignment,
                        self.peers,
                        attempts=self.settings.restore_attempts,
                    )
                self.plans[job] = plan
                # the run the job left saved the steps above the plan's (every step, for a fresh start)
                drop_above(self.settings.root, job, FRESH_START if plan.step is None else plan.step)
                running = _running_here(assignment, self.node)
                if running is not None:  # and those of the ranks no process here saves again
                    drop_left_behind(self.settings.root, job, plan, running)
                ranks = self._ranks(job, plan, assignment)
                pending.add(ranks)
                if assignment is not None and assignment.process_ranks(self.node, plan.world_size):
                    self._staging[job] = (plan, ranks)
                ranks = await self.fanout.order(job, plan, ranks)
            self.states[job] = {r: RestoreState.PENDING for r in ranks}
            log.info("restore %s: step %s for ranks %s", job, plan.step, list(ranks))
            self._tell_new_ranks(job, plan, assignment, ranks)
            sem = asyncio.Semaphore(self.settings.transfer.concurrency)
            await asyncio.gather(*(self._stage_rank(job, r, plan, assignment, sem) for r in ranks))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("restore %s: staging failed unexpectedly", job)

    def _standing_plan(self, job: str, assignment: PeerAssignment | None) -> RestorePlan | None:
        """The operator's plan (``published_plan``), unless that restore is over here: a rank of this
        node committed another step after the plan was decided (training went on from it; staging it
        again would drop the newer replicas here). Then the newest restorable step is computed, as after
        any restart outside a restore."""
        plan = published_plan(self.settings.root, job, assignment)
        if plan is None or assignment is None:
            return plan
        try:
            with open_job(self.settings.root, job) as tree:
                saved = _saved_since(tree, assignment.process_ranks(self.node), plan)
        except (OSError, FormatError):
            saved = None  # nothing of this node's ranks readable: nothing saved since
        if saved is not None:
            log.info(
                "restore %s: rank %d saved step %d after the plan of attempt %d was decided: that "
                "restore is over; recomputing",
                job,
                *saved,
                plan.generation,
            )
            return None
        return plan

    def _ranks(self, job: str, plan: RestorePlan, assignment: PeerAssignment | None) -> tuple[int, ...]:
        """This node's ranks of the plan's step: its node rank's block, else (no node rank known, or none
        of its ranks below the step's world size) the ranks whose primaries live here that the step has.
        A rank the step did not have (the job grew since, and this node saved it) has nothing to stage:
        it learns the step from ``_tell_new_ranks``."""
        ranks = assignment.process_ranks(self.node, plan.world_size) if assignment is not None else ()
        if not ranks:
            try:
                with open_job(self.settings.root, job) as tree:
                    ranks = tuple(
                        r for r in rank_trees(tree, "primary") if plan.world_size <= 0 or r < plan.world_size
                    )
            except (FileNotFoundError, NotADirectoryError):
                ranks = ()
            if ranks:
                log.warning(
                    "restore %s: peers.json gives %s no rank of step %s's %d; staging its local ranks %s",
                    job,
                    self.node,
                    plan.step,
                    plan.world_size,
                    list(ranks),
                )
        return ranks

    def _tell_new_ranks(
        self, job: str, plan: RestorePlan, assignment: PeerAssignment | None, staged: tuple[int, ...]
    ) -> None:
        """The ranks this node runs now that did not exist when the plan's step was saved (the job grew):
        nothing of theirs to stage, but they learn the step at once (a DCP load reshards into them)."""
        now = assignment.process_ranks(self.node) if assignment is not None else ()
        for rank in (r for r in now if r not in staged):
            rep = ProgressReporter(self.settings.root, job, rank)
            if plan.step is None:
                rep.finish(RestoreState.NONE, message="no step is restorable: start fresh")
            else:
                rep.update(step=plan.step)
                rep.finish(
                    RestoreState.READY,
                    message=f"rank {rank} has nothing to stage: {plan.world_size} ranks saved it",
                )
            self.states.setdefault(job, {})[rank] = rep.status.state

    async def _stage_rank(
        self,
        job: str,
        rank: int,
        plan: RestorePlan,
        assignment: PeerAssignment | None,
        sem: asyncio.Semaphore,
    ) -> None:
        async with ProgressReporter(self.settings.root, job, rank) as rep:
            if plan.step is None:
                self._done(job, rank, rep, RestoreState.NONE, None, "no step is restorable: start fresh")
                return
            rep.update(force=True, state=RestoreState.STAGING, step=plan.step, source=None, message="")
            step = plan.step

            def failed(attempt: RetryCallState) -> None:
                why = _result(attempt)[1]
                n = attempt.attempt_number
                log.warning("restore %s rank %d step %d, attempt %d: %s", job, rank, step, n, why)
                rep.update(force=True, message=f"attempt {n}: {why}")

            rounds = AsyncRetrying(  # 1 s between rounds, doubling up to --retry-max
                stop=stop_after_attempt(self.settings.restore_attempts),
                wait=wait_exponential(multiplier=1.0, max=self.settings.retry_max),
                retry=retry_if_result(lambda got: got[0] is None),
                after=failed,
                retry_error_callback=_result,  # the last round's (None, why)
            )
            started = time.monotonic()
            try:
                async with sem:  # (tenacity infers no result type: the annotation gives it)
                    result: tuple[Tier | None, str] = await rounds(
                        self._try_sources, job, rank, step, plan, assignment, rep
                    )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: the rank fails now, its client must not wait it out
                log.exception("restore %s rank %d step %d: staging failed unexpectedly", job, rank, step)
                result = None, f"unexpected error: {exc!r}"
            tier, why = result
            if tier is not None:
                self.metrics.restore_seconds.observe(time.monotonic() - started)
                self._done(job, rank, rep, RestoreState.READY, tier, f"staged from {tier.value}")
                return
            self._done(job, rank, rep, RestoreState.FAILED, None, f"every source failed: {why}")

    def _done(
        self, job: str, rank: int, rep: ProgressReporter, state: RestoreState, tier: Tier | None, message: str
    ) -> None:
        rep.finish(state, source=tier, message=message)
        self.states.setdefault(job, {})[rank] = state
        self.metrics.restores.labels(state.value).inc()
        if tier is not None and tier != Tier.LOCAL and rep.status.step is not None:
            staged = max(rep.status.bytes_total, self._staged_bytes(job, rank, rep.status.step))
            self.metrics.restore_bytes.labels(tier.value).inc(staged)

    def _staged_bytes(self, job: str, rank: int, step: int) -> int:
        """The bytes of the step just staged into ``rank``'s directory (its COMMIT says; 0 if unreadable):
        a fetch too small to report progress, and a restore from the bucket, report none."""
        try:
            with open_job(self.settings.root, job) as tree:
                marker = read_commit(rank_tree(tree, "primary", rank).at(step_name(step)))
        except (OSError, FormatError, UnsafePathError):
            return 0
        return 0 if marker is None else marker.total_bytes

    async def _try_sources(
        self,
        job: str,
        rank: int,
        step: int,
        plan: RestorePlan,
        assignment: PeerAssignment | None,
        rep: ProgressReporter,
    ) -> tuple[Tier | None, str]:
        if self._committed(job, "primary", rank, step):
            return Tier.LOCAL, ""
        reasons = []
        if plan.sources.get(rank) == Tier.ERASURE and assignment is not None:
            tier, why = await self._rebuild(job, rank, step, plan, assignment, rep)
            if tier is not None:
                return tier, ""
            reasons.append(why)
        sources = self._sources(job, rank, step, plan, assignment)
        if sources:
            tier, why = await self._fetch(job, rank, step, sources, rep)
            if tier is not None:
                return tier, ""
            reasons.append(why)
        seed = await self.fanout.seed(job, rank, step, plan.world_size, assignment)
        tier, why = await self._from_bucket(job, rank, step, rep, seed)
        if tier is not None:
            return tier, ""
        reasons.append(why)
        return None, "; ".join(reasons)

    def _sources(
        self, job: str, rank: int, step: int, plan: RestorePlan, assignment: PeerAssignment | None
    ) -> tuple[FetchSource, ...]:
        out = []
        if self._committed(job, "replica", rank, step):
            out.append(FetchSource(kind="replica", node=self.node))
        if assignment is not None and plan.sources.get(rank) != Tier.ERASURE:  # the plan's holders only
            out.extend(self._holders(plan, rank, assignment))
        return tuple(out)

    def _holders(self, plan: RestorePlan, rank: int, assignment: PeerAssignment) -> list[FetchSource]:
        """The other nodes the plan names as holding ``rank`` (a copy, or a fragment of it)."""
        names = plan.holders.get(rank, ())
        return [FetchSource.peer(assignment, n) for n in names if n != self.node and n in assignment.nodes]

    async def _rebuild(
        self,
        job: str,
        rank: int,
        step: int,
        plan: RestorePlan,
        assignment: PeerAssignment,
        rep: ProgressReporter,
    ) -> tuple[Tier | None, str]:
        """Rebuild the rank from the erasure-coded fragments the plan's holders hold."""
        sources = tuple(self._holders(plan, rank, assignment))
        task = RebuildTask(id=self.supervisor.next_id(), job=job, rank=rank, step=step, sources=sources)
        result = await self._run_in_worker(task, rep)
        if isinstance(result, str):
            return None, result
        if result.ok:
            return (Tier.LOCAL if result.outcomes[-1].status == "already" else Tier.ERASURE), ""
        why = "; ".join(f"{o.node}: {o.status} {o.message}".strip() for o in result.outcomes)
        return None, f"erasure: {result.message or why}"

    async def _run_in_worker(self, task: FetchTask | RebuildTask, rep: ProgressReporter) -> TaskResult | str:
        """Run ``task`` in the worker, its progress reported to ``rep``; the reason if it could not run."""

        def progress(p: TaskProgress) -> None:
            rep.progress(p.bytes_done, p.bytes_total)

        try:
            return await self.supervisor.run_task(task, progress)
        except RetryableError as exc:
            return str(exc)

    async def _fetch(
        self, job: str, rank: int, step: int, sources: tuple[FetchSource, ...], rep: ProgressReporter
    ) -> tuple[Tier | None, str]:
        task = FetchTask(id=self.supervisor.next_id(), job=job, rank=rank, step=step, sources=sources)
        result = await self._run_in_worker(task, rep)
        if isinstance(result, str):
            return None, result
        if result.ok:
            last = result.outcomes[-1]
            if last.status == "already":
                return Tier.LOCAL, ""
            return (Tier.REPLICA if last.node == self.node else Tier.PEER), ""
        return None, "; ".join(f"{o.node}: {o.status} {o.message}".strip() for o in result.outcomes)

    async def _from_bucket(
        self, job: str, rank: int, step: int, rep: ProgressReporter, seed: tuple[int, Copy] | None = None
    ) -> tuple[Tier | None, str]:
        """``seed``: a rank (and its copy here) whose committed step holds this rank's data files."""
        try:
            if step not in await self.backup.complete_steps(job):
                return None, f"step {step} is not complete in the bucket"
            with open_job(self.settings.root, job, create=True) as tree:
                await self.backup.fetch_rank(
                    job,
                    step,
                    rank,
                    rank_tree(tree, "primary", rank),
                    lambda done: rep.update(bytes_done=done),
                    rank_tree(tree, seed[1], seed[0]).at(step_name(step)) if seed is not None else None,
                )
        except (TierckptError, OSError) as exc:
            return None, f"bucket: {exc}"
        if not self._committed(job, "primary", rank, step):
            return None, "bucket: fetch_rank returned without a committed step"
        return Tier.GCS, ""

    def _committed(self, job: str, copy: Copy, rank: int, step: int) -> bool:
        """Whether this node holds a committed ``copy`` of the step (reached through no symlink)."""
        try:
            with open_job(self.settings.root, job) as tree:
                return read_commit(rank_tree(tree, copy, rank).at(step_name(step))) is not None
        except (FileNotFoundError, NotADirectoryError):
            return False
        except UnsafePathError as exc:
            log.warning("restore %s rank %d: refusing the %s copy of step %d: %s", job, rank, copy, step, exc)
            return False
        except FormatError:
            return False


def _saved_since(tree: Beneath, ranks: Iterable[int], plan: RestorePlan) -> tuple[int, int] | None:
    """A (rank, step) of ``ranks`` committed here after ``plan`` was decided, other than its step."""
    for rank in ranks:
        primary = rank_tree(tree, "primary", rank)
        for step in committed_steps(primary):
            marker = read_commit(primary.at(step_name(step)))
            if step != plan.step and marker is not None and marker.committed_at > plan.decided_at:
                return rank, step
    return None


class _Pending:
    """Ranks whose restore status reads ``pending``, written again every second until the block ends
    (then each rank's own ``ProgressReporter`` takes over)."""

    def __init__(self, root: Path, job: str) -> None:
        self.root, self.job = root, job
        self.reporters: dict[int, ProgressReporter] = {}

    def add(self, ranks: Iterable[int]) -> None:
        for rank in ranks:
            if rank not in self.reporters:
                rep = self.reporters[rank] = ProgressReporter(self.root, self.job, rank)
                rep.update(force=True, message="deciding what to stage")
                rep.start()

    async def __aenter__(self) -> _Pending:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for rep in self.reporters.values():
            await rep.stop()


def _result(attempt: RetryCallState) -> tuple[Tier | None, str]:
    """What a finished round of ``Stager._try_sources`` returned."""
    assert attempt.outcome is not None
    return cast("tuple[Tier | None, str]", attempt.outcome.result())


def _running_here(assignment: PeerAssignment | None, node: str) -> tuple[int, ...] | None:
    """The ranks the processes of ``node`` run under ``assignment`` (none: the node has no node rank);
    None if that is not known (no assignment, or no count of processes per node)."""
    if assignment is None:
        return None
    if node not in assignment.node_ranks:
        return ()
    return assignment.process_ranks(node) or None
