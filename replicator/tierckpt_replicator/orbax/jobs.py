"""Orbax-mode jobs on this node: the handshake with stock Orbax, its steps adopted, the restore hand-over.

A job is in Orbax mode on this node once the operator sent its session (``OrbaxStore.session``: this
node's process id and the JAX coordinator for a restart attempt). Then, on every pass of the replication
loop (``scan``; the commit watcher wakes it when the job directory changes):

1. every committed Orbax step directory is adopted as this process's primary (``steps.adopt``), and
   retention applied (Orbax leaves it to the replicator); replication and backups take it from there;
2. until the session's handshake is done, ``jax-init-info.txt`` holds its process id and coordinator;
3. a ``replicator.yaml`` is the handshake: parsed and checked against the session. A malformed one is
   reported in ``replicator.errors`` (the job's configured backup schedule stands); one that contradicts
   the session (another node rank or process count, another framework), or a second one in the same
   restart attempt, fails the run (``replicator.failed``). What an earlier run left is removed (restore
   markers, step directories, error files, the consumed ``jax-init-info.txt``), the handshake recorded
   (``OrbaxRun``), and the yaml deleted: Orbax goes on and waits for its restore marker;
4. the hand-over (``_deliver``, a task per job) waits for the restore plan of the session's attempt (the
   operator's, same generation) and for restore staging of this process's rank (``restore.stage``),
   then lays the step out as an Orbax step directory renamed to its restore marker, or writes the
   nothing-to-restore marker, or reports why not in ``replicator.failed``.

Each job's file work runs in a thread, one piece of work per job at a time (``_locks``). The job's
files are the pod's: ``files`` and ``steps`` say how they are read and written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

from tierckpt.protocol.control import RestorePlan, RestoreState, read_control, read_restore_status
from tierckpt.protocol.errors import FormatError, RetryableError, UnsafePathError
from tierckpt.protocol.orbax import (
    ERRORS,
    FAILED,
    REPLICATOR_YAML,
    OrbaxRun,
    OrbaxSession,
    jax_init_info,
    parse_replicator_yaml,
    restore_marker,
    run_name,
)
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.orbax import files
from tierckpt_replicator.orbax.steps import Adopted, adopt, apply_retention, materialize
from tierckpt_replicator.orbax_state import OrbaxStore
from tierckpt_replicator.restore.stage import Stager
from tierckpt_replicator.settings import Settings
from tierckpt_replicator.stepio import open_job, rank_tree

__all__ = ["OrbaxJobs"]

log = logging.getLogger(__name__)

_RUN_FALLBACK = "tierckpt"
"""The run name of restore markers when ``job-name`` cannot be one (Orbax does not read it back)."""


@dataclasses.dataclass(frozen=True)
class _HandOver:
    step: int | None
    failed: str = ""


class OrbaxJobs:
    """Every Orbax-mode job of this node (see the module docstring)."""

    def __init__(
        self,
        *,
        settings: Settings,
        store: OrbaxStore,
        stager: Stager,
        metrics: Metrics,
        kick: Callable[[], None] = lambda: None,
        poll: float = 0.2,
    ) -> None:
        self.settings, self.store, self.stager, self.metrics = settings, store, stager, metrics
        self.kick, self.poll = kick, poll
        self._locks: dict[str, asyncio.Lock] = {}
        self._deliveries: dict[str, asyncio.Task[None]] = {}
        self._refused: set[str] = set()
        """Orbax step directories already reported as not adoptable (each is reported once)."""
        self._gone: set[str] = set()
        """Jobs being purged: left alone until a new session comes."""

    @property
    def node(self) -> str:
        return self.settings.node_name

    # ------------------------------------------------------------------ the control API

    async def put_session(self, session: OrbaxSession) -> tuple[bool, OrbaxSession]:
        """Store the operator's session (newest generation wins); a new one is acted on at once."""
        before = self.store.session(session.job)
        accepted, current = self.store.put_session(session)
        if accepted:
            self._gone.discard(session.job)
        if accepted and current != before:
            log.info(
                "job %s: Orbax session of attempt %d: this node runs process %d of %d, coordinator %s",
                session.job,
                session.generation,
                session.process_id,
                session.num_processes,
                session.coordinator,
            )
            old = self._deliveries.pop(session.job, None)
            if old is not None:
                old.cancel()
            self.kick()
        return accepted, current

    async def forget(self, job: str) -> None:
        """Stop acting for ``job`` (it is being purged): returns once no work on its files is under way."""
        self._gone.add(job)
        task = self._deliveries.pop(job, None)
        if task is not None:
            task.cancel()
        async with self._lock(job):
            self.store.forget(job)
        self._refused = {r for r in self._refused if not r.startswith(f"{job}/")}

    async def close(self) -> None:
        tasks = list(self._deliveries.values())
        self._deliveries.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------------ the loop's pass

    async def scan(self) -> None:
        """One pass over every Orbax-mode job (cheap when nothing changed: a listing per job)."""
        for job in self.store.jobs():
            session = self.store.session(job)
            if session is None or job in self._gone:
                continue
            try:
                async with self._lock(job):
                    result = await asyncio.to_thread(self._pass, job, session, self._protected(job, session))
            except (OSError, FormatError) as exc:
                log.warning("job %s: Orbax pass failed: %s", job, exc)
                continue
            if result:
                self.metrics.orbax_handshakes.labels(job, result).inc()
            run = self.store.run(job)
            if run.generation == session.generation and not run.delivered and job not in self._deliveries:
                task = asyncio.create_task(self._deliver(job, session), name=f"orbax-handover-{job}")
                self._deliveries[job] = task
                task.add_done_callback(functools.partial(self._delivered, job))

    def _lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    def _protected(self, job: str, session: OrbaxSession) -> frozenset[int]:
        """Steps retention must keep on this node: the one the session's restore plan names."""
        plan = _published(self.settings, job)
        if plan is None or plan.step is None or plan.generation != session.generation:
            return frozenset()
        return frozenset({plan.step})

    def _pass(self, job: str, session: OrbaxSession, protect: frozenset[int]) -> str | None:
        """Adopt, keep ``jax-init-info.txt`` current, answer a ``replicator.yaml``; the handshake's
        outcome (``ok``, ``error``, ``failed``), or None without one."""
        with open_job(self.settings.root, job, create=True) as tree:
            run = self.store.run(job)
            self._adopt_all(tree, job, session, run, protect)
            run = self.store.run(job)
            info = jax_init_info(session.process_id, session.coordinator)
            if session.generation > run.generation and files.write_jax_init_info(tree, info):
                log.info("job %s: jax-init-info.txt says process %d", job, session.process_id)
            try:
                data = files.read_yaml(tree)
                unsafe = ""
            except FormatError as exc:  # a link, a FIFO, a directory, too large: refused, never followed
                data, unsafe = b"", _inside(tree, exc)
            if data is None:
                return None
            return self._handshake(tree, job, session, run, data, unsafe)

    def _adopt_all(
        self, tree: Beneath, job: str, session: OrbaxSession, run: OrbaxRun, protect: frozenset[int]
    ) -> list[Adopted]:
        adopted = []
        for step, name in sorted(files.step_dirs(tree).items()):
            if step == run.restored:
                continue  # the step handed over for restore, not a new save
            try:
                got = adopt(tree, name, job_id=job, rank=session.process_id, world_size=session.num_processes)
            except RetryableError as exc:
                log.info("job %s: step %d not adopted yet: %s", job, step, exc)
                continue
            except (FormatError, OSError) as exc:
                if f"{job}/{name}" not in self._refused:
                    self._refused.add(f"{job}/{name}")
                    log.warning("job %s: Orbax step %d cannot be adopted: %s", job, step, exc)
                    with contextlib.suppress(OSError, FormatError):
                        why = _inside(tree, exc)
                        files.report(tree, ERRORS, f"{self._me()}: step {step} is not replicated: {why}")
                continue
            adopted.append(got)
            self.metrics.orbax_adopted.labels(job).inc()
            log.info(
                "job %s: adopted Orbax step %d of process %d (%d files, %d bytes)%s",
                job,
                got.step,
                session.process_id,
                got.files,
                got.bytes,
                ", replacing the step saved before" if got.replaced else "",
            )
        if adopted:
            newest = max(a.step for a in adopted)
            apply_retention(
                rank_tree(tree, "primary", session.process_id),
                keep=self.settings.orbax_keep,
                latest=newest,
                protect=protect,
            )
            if run.restored is not None and newest > run.restored:  # training went on: Orbax is done with it
                files.remove(tree, str(run.restored))
                self.store.put_run(dataclasses.replace(run, restored=None))
        return adopted

    def _handshake(
        self, tree: Beneath, job: str, session: OrbaxSession, run: OrbaxRun, data: bytes, unsafe: str
    ) -> str:
        attempt = session.generation
        if attempt <= run.generation:
            files.report(
                tree,
                FAILED,
                f"{self._me()}: replicator.yaml came again in restart attempt {attempt}, whose handshake "
                "is done: a process that initializes again needs a new attempt of the job (restart it)",
            )
            files.remove(tree, REPLICATOR_YAML)
            log.warning("job %s: a second replicator.yaml in attempt %d; failed the run", job, attempt)
            return "failed"
        problem = fatal = ""
        config = None
        if unsafe:
            problem = f"replicator.yaml refused: {unsafe}"
        else:
            try:
                config = parse_replicator_yaml(data)
            except FormatError as exc:
                problem = f"replicator.yaml is malformed: {exc}"
        if config is not None and config.framework != "orbax":
            fatal = f"replicator.yaml names framework {config.framework!r}: this job is in Orbax mode"
        elif config is not None and (config.node_rank, config.nodes) != (
            session.process_id,
            session.num_processes,
        ):
            fatal = (
                f"replicator.yaml says node-rank {config.node_rank} of {config.nodes} nodes, but this node "
                f"runs process {session.process_id} of {session.num_processes} in restart attempt {attempt} "
                "(jax-init-info.txt): its data is not this node's"
            )
        removed = files.clear_for_handshake(tree)
        if problem:
            files.report(
                tree, ERRORS, f"{self._me()}: {problem}; the job's configured backup schedule applies"
            )
            log.warning("job %s: %s", job, problem)
        if fatal:
            files.report(tree, FAILED, f"{self._me()}: {fatal}")
            log.warning("job %s: failed the run: %s", job, fatal)
        usable = config if config is not None and not fatal else None
        self.store.put_run(
            OrbaxRun(
                job=job,
                generation=attempt,
                run=run_name(config.job_name if config is not None else "", _RUN_FALLBACK),
                backup_interval_steps=(usable.backup_interval_steps or 0) if usable else 0,
                backup_interval_minutes=(usable.backup_interval_minutes or 0) if usable else 0,
                delivered=bool(fatal),
            )
        )
        files.remove(tree, REPLICATOR_YAML)  # Orbax goes on
        log.info(
            "job %s: replicator.yaml of process %d consumed (attempt %d)%s",
            job,
            session.process_id,
            attempt,
            f"; removed {removed}" if removed else "",
        )
        return "failed" if fatal else "error" if problem else "ok"

    def _me(self) -> str:
        return f"tierckpt replicator on {self.node}"

    # ------------------------------------------------------------------ the hand-over

    async def _deliver(self, job: str, session: OrbaxSession) -> None:
        """Wait for this process's rank to be staged under the attempt's plan, then hand it over."""
        waiting_since = time.monotonic()
        said = 0.0
        while (ho := self._hand_over(job, session)) is None:
            waited = time.monotonic() - waiting_since
            if waited - said >= 30:
                said = waited
                log.info(
                    "job %s: attempt %d waits %.0fs for its restore to be staged",
                    job,
                    session.generation,
                    waited,
                )
            await asyncio.sleep(self.poll)
        async with self._lock(job):
            try:
                result = await asyncio.to_thread(self._hand, job, session, ho)
            except (OSError, FormatError) as exc:
                log.error("job %s: the restore hand-over failed: %s", job, exc)
                result = "failed"
        if result:
            self.metrics.orbax_handovers.labels(result).inc()

    def _delivered(self, job: str, task: asyncio.Task[None]) -> None:
        if self._deliveries.get(job) is task:
            del self._deliveries[job]
        if not task.cancelled() and task.exception() is not None:
            log.error("job %s: the restore hand-over stopped: %r", job, task.exception())

    def _hand_over(self, job: str, session: OrbaxSession) -> _HandOver | None:
        """What to hand over once the attempt's plan is staged for this process's rank (None: not yet)."""
        plan = _published(self.settings, job)
        if plan is None or plan.generation != session.generation or self.stager.running(job):
            return None
        staged = self.stager.plans.get(job)
        if staged is None or (staged.step, staged.world_size) != (plan.step, plan.world_size):
            # staging ran for another plan (one this node computed itself after it restarted): every
            # process must get the operator's step, so that one is staged now
            log.info("job %s: staging the operator's plan (step %s) for the hand-over", job, plan.step)
            self.stager.start_for_plan(job, plan)
            return None
        rank = session.process_id
        state = self.stager.states.get(job, {}).get(rank)
        if plan.step is None or state is RestoreState.NONE:
            return _HandOver(None)
        if state is RestoreState.READY and plan.world_size != session.num_processes:
            return _HandOver(
                None,
                f"step {plan.step} was saved by {plan.world_size} processes and this run has "
                f"{session.num_processes}: Orbax restores only onto the topology it saved from",
            )
        if state is RestoreState.READY:
            return _HandOver(plan.step)
        why = "its restore staging did not stage it"
        with contextlib.suppress(OSError, FormatError):
            status = read_restore_status(self.settings.root, job, rank)
            if status is not None and status.message:
                why = status.message
        return _HandOver(None, f"step {plan.step} cannot be restored for process {rank}: {why}")

    def _hand(self, job: str, session: OrbaxSession, ho: _HandOver) -> str | None:
        run = self.store.run(job)
        if run.generation != session.generation or run.delivered:
            return None  # a newer handshake came meanwhile
        rank = session.process_id
        with open_job(self.settings.root, job, create=True) as tree:
            if not ho.failed and ho.step is None:
                files.hand_over_nothing(tree, restore_marker(run.run or _RUN_FALLBACK, 0, rank))
                self.store.put_run(dataclasses.replace(run, delivered=True))
                log.info("job %s: nothing to restore for process %d: it starts fresh", job, rank)
                return "fresh"
            failed = ho.failed
            if not failed and ho.step is not None:
                try:
                    layout = materialize(
                        tree, rank, ho.step, job_id=job, limit=self.settings.transfer.max_manifest_bytes
                    )
                except (FormatError, UnsafePathError, FileNotFoundError) as exc:
                    failed = f"step {ho.step} of process {rank} cannot be laid out: {_inside(tree, exc)}"
                else:
                    # recorded first: once renamed by Orbax, the step's directory is not a new save
                    self.store.put_run(dataclasses.replace(run, delivered=True, restored=ho.step))
                    marker = restore_marker(run.run or _RUN_FALLBACK, ho.step, rank)
                    try:
                        files.hand_over_step(tree, layout, marker, ho.step)
                    except (OSError, FormatError) as exc:
                        files.remove(tree, layout)
                        failed = f"step {ho.step} could not be handed over: {_inside(tree, exc)}"
                    else:
                        log.info("job %s: step %d handed over to process %d (%s)", job, ho.step, rank, marker)
                        return "restore"
            files.report(tree, FAILED, f"{self._me()}: {failed}")
            self.store.put_run(dataclasses.replace(run, delivered=True))
            log.error("job %s: failed the run: %s", job, failed)
            return "failed"


def _inside(tree: Beneath, exc: BaseException) -> str:
    """``exc`` as the pod is told it: paths in its own directory, not where the node keeps it."""
    return str(exc).replace(f"{tree.where}/", "").replace(tree.where, ".")


def _published(settings: Settings, job: str) -> RestorePlan | None:
    """The operator's restore plan of the job (``restore.json`` in its state directory)."""
    try:
        plan = read_control(settings.root, job, RestorePlan.FILE, RestorePlan)
    except (FormatError, OSError):
        return None
    return plan if isinstance(plan, RestorePlan) else None
