"""A chaos run: rounds of real training with faults injected while it runs, and every invariant checked
after every fault, at every restore and at the end of every round.

Two jobs share a cluster of five nodes in two failure domains (``Rig``): ``native``, whose ranks save
with ``Checkpointer`` as one replica group, on three nodes; and ``dcp``, an FSDP2 model saved through
DCP, on three nodes (two to four as it shrinks and grows). Each round:

1. every job restarts from its checkpoints (the operator's part: ranks, policy, peers, restore plan)
   and trains ``Round.steps`` steps, then holds (trainers stay alive, saving nothing);
2. the round's faults fire as the jobs make progress; a job whose trainers died restarts at once,
   and its restore is checked (``oracle``: newest restorable, bit-exact, agreement, no lost work);
   after each fault every tier is checked for torn steps;
3. once every job is held, transient faults are cleared and the cluster must heal (redundancy and the
   due backup within ``HEAL_BOUND``, with no save), keep to its retention, show no torn step, and hold
   nothing of purged jobs.

Everything that happens is a history ``Entry``, printed as it happens and written to
``history.jsonl``; the run's ``Schedule`` is written to ``schedule.json`` (it replays), and its
``Summary`` to ``summary.json``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TextIO

from tierckpt.protocol.codec import Message
from tierckpt.protocol.control import NodeInventory
from tierckpt.protocol.text import rank_ranges
from tierckpt_demo.chaos.inject import Injector
from tierckpt_demo.chaos.jobs import EVERY, Crash, JobRun, Launch, start_launch
from tierckpt_demo.chaos.operator import BACKUP_EVERY, KEEP_LAST, Operator
from tierckpt_demo.chaos.oracle import (
    HEAL_BOUND,
    INVARIANTS,
    Held,
    Invariant,
    Violation,
    committed_everywhere,
    heal_gaps,
    lost_work,
    newest_restorable,
    retention_excess,
)
from tierckpt_demo.chaos.reference import Anchor, Reference
from tierckpt_demo.chaos.rig import Rig
from tierckpt_demo.chaos.schedule import TRANSIENT, Fault, Round, Schedule, plan_round
from tierckpt_demo.chaos.soak import soak_result
from tierckpt_demo.chaos.tiers import BucketView, job_leftovers, scan_node, torn_on_node

__all__ = ["ChaosOptions", "ChaosRun", "Entry", "Summary"]

log = logging.getLogger(__name__)

ROUND_TIMEOUT = 900.0
"""Longest a round may take; past it the run stops with a liveness violation."""
STALL = 120.0
"""Seconds a job may make no progress while not held (then its transient faults are cleared; if it
still makes none, it is a liveness violation)."""
READY_TIMEOUT = 60.0
MAX_FAILED = 8
"""Attempts of one job in a row that may fail in a round (after three, the transient faults are cleared)."""
SETTLE = 5.0
"""Seconds after a purge (and its interrupted uploads) before nothing of the job may be seen again."""
REPLICA_KEEP = 2
"""The replicators' ``--replica-keep`` (their default)."""
CLIENT_KEEP = 2
"""The trainers' ``keep`` (the client's default)."""


@dataclasses.dataclass(frozen=True)
class Entry(Message):
    """One line of a run's history."""

    KIND = "tierckpt_demo.chaos-entry"
    VERSION = 1

    at: float
    """Seconds since the run started."""
    round: int
    what: Literal["run", "round", "fault", "clear", "restart", "restore", "check", "violation", "note"]
    text: str
    fault: Fault | None = None


@dataclasses.dataclass(frozen=True)
class Summary(Message):
    KIND = "tierckpt_demo.chaos-summary"
    VERSION = 1

    seed: int
    seconds: float
    rounds: int
    faults: int
    """Faults injected (skipped ones not counted)."""
    by_kind: dict[str, int]
    by_mode: dict[str, int]
    skipped: int
    restores: int
    """Restores checked (every rank restored, all of their invariants looked at)."""
    checks: dict[str, int]
    """Invariant -> times it was checked."""
    violations: tuple[Violation, ...]
    losses_compared: int
    """Replayed steps whose loss was compared with an earlier run's, bit for bit."""
    launches: int
    netem: bool
    stopped: str
    """Why the run ended."""
    out: str

    def lines(self) -> list[str]:
        """The summary as text."""
        minutes, seconds = divmod(int(self.seconds), 60)
        modes: dict[str, list[str]] = {}
        for key, n in sorted(self.by_mode.items()):
            kind, _, mode = key.partition("/")
            modes.setdefault(kind, []).append(f"{mode} {n}")
        kinds = ", ".join(f"{k} {n} ({', '.join(modes.get(k, []))})" for k, n in sorted(self.by_kind.items()))
        checks = ", ".join(f"{k} {n}" for k, n in self.checks.items())
        head = (
            f"chaos run, seed {self.seed}: {self.rounds} rounds, {self.faults} faults injected "
            f"({self.skipped} skipped) in {minutes}m{seconds:02d}s; {len(self.violations)} violation(s)"
        )
        out = [
            head,
            f"faults by kind: {kinds}",
            f"restores checked: {self.restores} (of {self.launches} launches); replayed losses compared: "
            f"{self.losses_compared}",
            f"invariants checked: {checks}",
        ]
        if not self.netem:
            out.append("netem: not in this kernel; delays were emulated by queueing in a token bucket")
        out += [f"VIOLATION {v.invariant} ({v.job}, round {v.round}): {v.detail}" for v in self.violations]
        out.append(f"stopped: {self.stopped}; files in {self.out}")
        return out


@dataclasses.dataclass(frozen=True)
class ChaosOptions:
    seed: int
    out: Path
    duration: float | None = None
    """Seconds after which no new round starts."""
    rounds: int | None = None
    faults: int | None = None
    """Stop once this many faults were drawn."""
    replay: Schedule | None = None
    faults_per_round: tuple[int, int] = (2, 5)
    keep_going: bool = False
    """Go on after a violation (else the run stops at the end of that round)."""
    echo: TextIO | None = sys.stdout


class Stop(Exception):
    """The run cannot go on."""


class ChaosRun:
    def __init__(self, options: ChaosOptions) -> None:
        self.o = options
        self.seed = options.replay.seed if options.replay else options.seed
        self.out = options.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.history: list[Entry] = []
        self._history_file = open(self.out / "history.jsonl", "w")  # noqa: SIM115 - closed in run()
        self.violations: list[Violation] = []
        self.checks: dict[str, int] = dict.fromkeys(INVARIANTS, 0)
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.by_mode: collections.Counter[str] = collections.Counter()
        self.skipped = 0
        self.restores = 0
        self.launches = 0
        self.reference = Reference()
        self.round_index = -1
        self.round_steps = 0
        self.rounds_run: list[Round] = []
        self.purged: set[str] = set()
        self.active: dict[int, tuple[Fault, int]] = {}
        """Transient fault id -> (fault, its job's progress when it is cleared; 0: at the round's end)."""
        self._rig: Rig | None = None
        self.operator: Operator = None  # type: ignore[assignment]
        self.bucket: BucketView = None  # type: ignore[assignment]
        self.jobs: dict[str, JobRun] = {}
        self.injector: Injector = None  # type: ignore[assignment]
        self._fid = 0
        self._port = 0
        self._last_progress: dict[str, float] = {}

    @property
    def rig(self) -> Rig:
        if self._rig is None:
            raise RuntimeError("the rig is not up")
        return self._rig

    # ---------------------------------------------------------------- the run

    def run(self) -> Summary:
        stopped = "done"
        try:
            self._setup()
            index, first = 0, 0
            while True:
                rnd = self._next_round(index, first)
                if rnd is None:
                    stopped = "the schedule is done" if self.o.replay else "its bounds were reached"
                    break
                self.rounds_run.append(rnd)
                self._round(index, rnd)
                index, first = index + 1, first + len(rnd.faults)
                if self.violations and not self.o.keep_going:
                    stopped = "an invariant broke"
                    break
        except Stop as exc:
            stopped = f"stopped: {exc}"
            self._violate("liveness", "", str(exc))
        except KeyboardInterrupt:
            stopped = "interrupted"
        except Exception as exc:
            log.exception("the chaos run failed")
            stopped = f"the harness failed: {type(exc).__name__}: {exc}"
            self._violate("liveness", "", stopped)
        finally:
            self._teardown()
        summary = self.summary(stopped)
        (self.out / "summary.json").write_bytes(summary.to_bytes())
        self._write_soak_results()
        for line in summary.lines():
            self._echo(line)
        self._history_file.close()
        return summary

    def _write_soak_results(self) -> None:
        """Each job's goodput as the trainers measured it (``soak-<job>.json``, for ``tierckpt plan
        --soak``)."""
        for job in self.jobs.values():
            soak = soak_result(
                self.out / "launches", job.job_id, backup_every=BACKUP_EVERY, factor=job.factor
            )
            if soak is not None:
                (self.out / f"soak-{job.job_id}.json").write_bytes(soak.to_bytes())

    def schedule(self) -> Schedule:
        """What ran so far, as a schedule that replays it."""
        note = self.o.replay.note if self.o.replay else f"seed {self.seed}"
        return Schedule(seed=self.seed, rounds=tuple(self.rounds_run), note=note)

    def summary(self, stopped: str) -> Summary:
        return Summary(
            seed=self.seed,
            seconds=time.monotonic() - self.t0,
            rounds=len(self.rounds_run),
            faults=sum(self.by_kind.values()),
            by_kind=dict(self.by_kind),
            by_mode=dict(self.by_mode),
            skipped=self.skipped,
            restores=self.restores,
            checks=dict(self.checks),
            violations=tuple(self.violations),
            losses_compared=self.reference.compared,
            launches=self.launches,
            netem=bool(self._rig and self._rig.netem),
            stopped=stopped,
            out=str(self.out),
        )

    def _next_round(self, index: int, first: int) -> Round | None:
        if self.o.replay is not None:
            return self.o.replay.rounds[index] if index < len(self.o.replay.rounds) else None
        if self.o.rounds is not None and index >= self.o.rounds:
            return None
        if self.o.faults is not None and first >= self.o.faults:
            return None
        if self.o.duration is not None and time.monotonic() - self.t0 >= self.o.duration:
            return None
        return plan_round(self.seed, index, first, every=EVERY, faults=self.o.faults_per_round)

    def _setup(self) -> None:
        self._note("run", f"seed {self.seed}; files in {self.out}")
        self._rig = Rig(self.out / "rig")
        self.bucket = BucketView(self.rig.bucket())
        self.operator = Operator(self.rig)
        self.injector = Injector(self)
        names = [n.name for n in self.rig.nodes]
        tag = f"{self.seed % 100000}"
        self.jobs = {
            "native": JobRun("native", names[0:3], tag=tag, factor=1),
            "dcp": JobRun("dcp", names[1:4], tag=tag, factor=1),
        }
        self.rig.wait_launchers(300)
        self._note(
            "run",
            f"{len(names)} nodes ({', '.join(f'{n.name} {n.domain}' for n in self.rig.nodes)}); "
            + "; ".join(f"{j.name} on {', '.join(j.nodes)}" for j in self.jobs.values()),
        )

    def _teardown(self) -> None:
        self.schedule_file().write_bytes(self.schedule().to_bytes())
        for job in self.jobs.values():
            if job.launch is not None:
                with contextlib.suppress(Exception):
                    job.launch.kill()
        if self._rig is None:
            return
        logs = self.out / "logs"
        logs.mkdir(exist_ok=True)
        for node in self.rig.nodes:
            with contextlib.suppress(OSError):
                shutil.copy(node.log_path, logs / f"replicator-{node.name}.log")
        if self.operator is not None:
            self.operator.close()
        self.rig.close()

    def schedule_file(self) -> Path:
        return self.out / "schedule.json"

    # ---------------------------------------------------------------- a round

    def _round(self, index: int, rnd: Round) -> None:
        self.round_index, self.round_steps = index, rnd.steps
        self._note("round", f"round {index}: {rnd.steps} steps, {len(rnd.faults)} faults")
        for job in self.jobs.values():
            job.progress = 0
            job.failed_launches = 0
            job.until += rnd.steps
            self.crash(job, "a new round")
        pending = list(rnd.faults)
        deadline = time.monotonic() + ROUND_TIMEOUT
        self._last_progress = {name: time.monotonic() for name in self.jobs}
        while True:
            self._poll()
            while pending and self._due(pending[0]):
                self._fire(pending.pop(0))
            self._expire()
            held = all(
                j.launch is not None and not j.restart_reason and j.launch.held() for j in self.jobs.values()
            )
            if held and not pending:
                self._count("liveness")
                break
            if held and pending:
                self._fire(pending.pop(0))  # its job finished the round before reaching it
                continue
            if time.monotonic() > deadline:
                raise Stop(f"round {index} did not finish in {ROUND_TIMEOUT:.0f} s")
            self._stalls()
            time.sleep(0.05)
        self._quiesce()

    def _due(self, fault: Fault) -> bool:
        return self.jobs[fault.job].progress >= fault.at

    def _fire(self, fault: Fault) -> None:
        self._fid += 1
        fid = self._fid
        text = self.injector.fire(fault, fid)
        if text.startswith("skipped"):
            self.skipped += 1
            self._note("fault", f"{fault.describe()}: {text}", fault)
            return
        self.by_kind[fault.kind] += 1
        self.by_mode[f"{fault.kind}/{fault.mode}"] += 1
        self._note("fault", f"{fault.describe()}: {text}", fault)
        explained = f"{fault.kind}/{fault.mode}"
        for job in self.jobs.values():
            if job.launch is not None:
                job.launch.transient.add(explained)
        if fault.kind == "full-ramdisk":
            for job in self.jobs.values():
                if job.launch is not None:
                    job.launch.full_ramdisk = True
        if fault.kind in TRANSIENT:
            job = self.jobs[fault.job]
            self.active[fid] = (fault, job.progress + fault.lasts if fault.lasts else 0)
        self._after_fault()

    def _expire(self) -> None:
        for fid, (fault, until) in list(self.active.items()):
            if until and self.jobs[fault.job].progress >= until:
                self._clear(fid, "its time is over")

    def _clear(self, fid: int, why: str) -> None:
        fault, _ = self.active.pop(fid)
        self.injector.clear(fid)
        self._note("clear", f"{fault.kind}/{fault.mode} cleared: {why}", fault)

    def _clear_all(self, why: str) -> None:
        for fid in list(self.active):
            self._clear(fid, why)
        self.injector.clear_all()

    def _after_fault(self) -> None:
        self._replicators_alive()
        self._check_torn()

    # ---------------------------------------------------------------- jobs

    def crash(self, job: JobRun, reason: str, *, excused: bool = False) -> None:
        """The job's trainers die (all of them: the JobSet restarts every pod); it restarts at next poll."""
        launch = job.launch
        if launch is not None:
            launch.kill()
            self._events(job, launch)  # what it wrote before it died: its last saves, losses, restore
            committed = committed_everywhere(self._copies(job), job.nodes, self._world(job))
            full = launch.full_ramdisk or bool(self.injector.full_nodes() & set(job.nodes))
            job.crash = Crash(launch.last_step(), committed, reason, excused or full)
            job.launch = None
        job.restart_reason = job.restart_reason or reason

    def restart(self, job: JobRun) -> None:
        """The operator's part of a new attempt, then a trainer per rank."""
        reason, job.restart_reason = job.restart_reason or "restart", ""
        began = time.monotonic()
        for name in job.nodes:
            node = self.rig.node(name)
            if not node.running:
                node.start_replicator(wait=False)
            node.wait_ready(READY_TIMEOUT)
        self.operator.assign(job, job.nodes)
        job.attempt += 1
        self.operator.publish_policy(job)
        self.operator.publish_peers(job)
        oracle = self._newest_restorable(job)
        plan = self.operator.publish_plan(job)
        hooks, job.on_plan = job.on_plan, []
        for hook in hooks:
            hook(job)
        self.launches += 1
        self._port += 1
        launch = start_launch(
            self.rig,
            job,
            index=self.launches,
            seed=self.seed % (1 << 31),
            until=job.until,
            port=21000 + self._port % 4000,
            workdir=self.out / "launches",
        )
        launch.plan, launch.oracle, launch.crash = plan, oracle, job.crash
        launch.transient = {f"{f.kind}/{f.mode}" for f, _ in self.active.values()}
        launch.full_ramdisk = bool(self.injector.full_nodes())
        job.crash = None
        job.launch = launch
        self._last_progress[job.name] = time.monotonic()
        sources = ", ".join(f"{tier.value} {rank_ranges(rs)}" for tier, rs in _by_tier(plan.sources).items())
        self._note(
            "restart",
            f"{job.job_id} attempt {job.attempt} ({reason}) on {', '.join(job.nodes)}, peers "
            f"{list(job.peers)}, factor {job.factor}: plan step {plan.step} ({sources or 'fresh'}); "
            f"newest restorable by the harness's scan: {oracle} ({time.monotonic() - began:.1f} s)",
        )

    def _poll(self) -> None:
        self._replicators_alive()
        for job in self.jobs.values():
            if job.restart_reason:
                self._restart_bounded(job)
                continue
            launch = job.launch
            if launch is None:
                continue
            self._events(job, launch)
            failure = launch.failure()
            if failure:
                self._failed(job, launch, failure)

    def _restart_bounded(self, job: JobRun) -> None:
        for attempt in range(3):
            try:
                self.restart(job)
                return
            except (RuntimeError, TimeoutError, OSError) as exc:
                self._violate("liveness", job.job_id, f"the operator could not restart the job: {exc}")
                time.sleep(2 * (attempt + 1))
        raise Stop(f"{job.job_id} could not be restarted")

    def _failed(self, job: JobRun, launch: Launch, failure: str) -> None:
        job.failed_launches += 1
        explained = sorted(launch.transient)
        if explained or launch.killed:
            self._note("note", f"{job.job_id} attempt failed ({failure}); faults in force: {explained}")
        else:
            self._violate(
                "liveness",
                job.job_id,
                f"an attempt failed with no fault in force: {failure}\n{_tail(launch.logs[0])}",
            )
        self.crash(job, f"an attempt failed: {failure}")
        if job.failed_launches >= MAX_FAILED:
            raise Stop(f"{job.job_id} failed {job.failed_launches} attempts in a row")
        if job.failed_launches >= 3 and self.active:
            self._clear_all(f"{job.job_id} failed {job.failed_launches} attempts in a row")

    def _events(self, job: JobRun, launch: Launch) -> None:
        dcp = job.name == "dcp"
        for rank, events in launch.new_events().items():
            for ev in events:
                if ev.event == "saving" and ev.step is not None:
                    self.reference.saving(launch.job, None if dcp else rank, ev.step, ev.sha256)
                    if rank == 0:
                        launch.anchors.append(Anchor(ev.step, ev.sha256, launch.world))
                elif ev.event == "restored" and rank == 0:
                    launch.anchors = [Anchor(-1 if ev.step is None else ev.step, ev.sha256, launch.world)]
                elif ev.event == "step" and rank == 0 and ev.step is not None and ev.loss is not None:
                    job.progress += 1
                    self._last_progress[job.name] = time.monotonic()
                    problem = self.reference.loss(launch.anchors, ev.step, ev.loss)
                    if problem:
                        self._violate("bit-exact", job.job_id, f"replayed loss differs: {problem}")
        if not launch.checked:
            restored = {
                r: next((e for e in evs if e.event == "restored"), None) for r, evs in launch.read().items()
            }
            if all(restored.values()):
                self._check_restore(job, launch, {r: e for r, e in restored.items() if e is not None})

    def _stalls(self) -> None:
        now = time.monotonic()
        for job in self.jobs.values():
            launch = job.launch
            if launch is None or launch.held() or now - self._last_progress[job.name] < STALL:
                continue
            self._last_progress[job.name] = now
            if self.active:
                self._clear_all(f"{job.job_id} made no progress for {STALL:.0f} s")
                continue
            self._violate("liveness", job.job_id, f"no progress for {STALL:.0f} s with no fault in force")
            self.crash(job, "stalled")

    def _replicators_alive(self) -> None:
        for node in self.rig.nodes:
            if node.proc is not None and node.proc.poll() is not None:
                code = node.proc.returncode
                self._violate(
                    "liveness",
                    "",
                    f"{node.name}'s replicator exited by itself ({code}):\n{node.log_text()[-3000:]}",
                )
                node.proc = None
                node.start_replicator()

    # ---------------------------------------------------------------- the oracle's view

    def _copies(self, job: JobRun, nodes: list[str] | None = None) -> list[Held]:
        out: list[Held] = []
        for name in nodes if nodes is not None else job.nodes:
            out += scan_node(name, self.rig.node(name).root, job.job_id)
        return out

    @staticmethod
    def _world(job: JobRun) -> int | None:
        """The world size a step must have been saved with to restore (None: any, the job reshards)."""
        return job.world if job.name == "native" else None

    def _newest_restorable(self, job: JobRun) -> int | None:
        return newest_restorable(
            self._copies(job), self.bucket.complete(job.job_id), job.nodes, self._world(job)
        )

    def _check_restore(self, job: JobRun, launch: Launch, restored: dict[int, Any]) -> None:
        launch.checked = True
        self.restores += 1
        steps = {r: e.step for r, e in restored.items()}
        step = steps[0]
        self._count("agreement", "newest-restorable", "bit-exact", "no-lost-work")
        if len(set(steps.values())) != 1:
            self._violate("agreement", job.job_id, f"ranks restored different steps: {steps}")
        plan = launch.plan
        if launch.oracle is not None and (step is None or step < launch.oracle):
            self._violate(
                "newest-restorable",
                job.job_id,
                f"restored step {step}, but step {launch.oracle} was restorable from the surviving tiers "
                f"(the plan said {plan.step if plan else None}: {dict(plan.sources) if plan else {}})",
            )
        # a DCP rank hashes the whole (unsharded) state: every rank restores one state, the same on all
        if job.name == "dcp" and len({e.sha256 for e in restored.values()}) > 1:
            self._violate("agreement", job.job_id, "ranks restored different states of the same step")
        checked = {0: restored[0]} if job.name == "dcp" else restored
        for rank, ev in checked.items():
            if ev.step is not None:
                problem = self.reference.restored_ok(
                    launch.job, None if job.name == "dcp" else rank, ev.step, ev.sha256
                )
                if problem:
                    self._violate("bit-exact", job.job_id, problem)
        crash = launch.crash
        if crash is not None and not crash.excused:
            problem = lost_work(crash.last, crash.committed, EVERY)
            if problem:
                self._violate("no-lost-work", job.job_id, f"{problem} ({crash.reason})")
        tiers = collections.Counter(e.tier for e in restored.values())
        self._note(
            "restore",
            f"{job.job_id} restored step {step} on {launch.world} ranks "
            f"({', '.join(f'{t} {n}' for t, n in tiers.items())}); newest restorable was {launch.oracle}",
        )

    # ---------------------------------------------------------------- checks

    def _count(self, *invariants: Invariant) -> None:
        for name in invariants:
            self.checks[name] += 1

    def _check_torn(self) -> None:
        self._count("no-torn-step")
        for job in self.jobs.values():
            for node in self.rig.nodes:
                for problem in torn_on_node(node.root, job.job_id):
                    self._violate("no-torn-step", job.job_id, f"{node.name}: {problem}")
            for problem in self.bucket.torn(job.job_id):
                self._violate("no-torn-step", job.job_id, f"bucket: {problem}")

    def _quiesce(self) -> None:
        self._clear_all("the round's training is over")
        for job in self.jobs.values():
            self._check_healed(job)
        for job in self.jobs.values():
            self._check_retention(job)
        self._check_torn()
        self._check_purged()

    def _check_healed(self, job: JobRun) -> None:
        self._count("healed")
        started = time.monotonic()
        problems = self._wait_for(lambda: self._heal_problems(job), HEAL_BOUND)
        took = time.monotonic() - started
        if problems:
            self._violate(
                "healed",
                job.job_id,
                f"not healed {HEAL_BOUND:.0f} s after the last fault: {'; '.join(problems)}",
            )
        else:
            self._note(
                "check", f"{job.job_id} healed {took:.1f} s after the last fault (factor {job.factor})"
            )

    def _heal_problems(self, job: JobRun) -> list[str]:
        copies = self._copies(job)
        newest: dict[int, tuple[str, int]] = {}
        for c in copies:
            mine = not c.replica and c.node == job.nodes[c.rank % job.world] and c.world == job.world
            if mine and (c.rank not in newest or c.step > newest[c.rank][1]):
                newest[c.rank] = (c.node, c.step)
        problems = heal_gaps(newest, copies, job.nodes, job.factor)
        want = min(job.factor, job.world - 1)
        for inv in self.operator.inventories(job):
            problems += _redundancy_problems(inv, job.factor, want)
        if newest:
            complete = self.bucket.complete(job.job_id)
            last = max(complete, default=None)
            committed = min(step for _, step in newest.values())
            if last is None or committed - last >= BACKUP_EVERY:
                problems.append(f"bucket: newest complete step {last}, step {committed} is due")
        return problems

    def _check_retention(self, job: JobRun) -> None:
        self._count("retention")

        def excess() -> list[str]:
            out = retention_excess(
                self._copies(job, [n.name for n in self.rig.nodes]),
                keep=CLIENT_KEEP,
                replica_keep=REPLICA_KEEP,
            )
            complete = sorted(self.bucket.complete(job.job_id))
            if len(complete) > KEEP_LAST:
                out.append(f"bucket: {len(complete)} complete steps {complete}, keep_last {KEEP_LAST}")
            return out

        problems = self._wait_for(excess, 20.0)
        if problems:
            self._violate("retention", job.job_id, "; ".join(problems))

    def _check_purged(self) -> None:
        if not self.purged:
            return
        self._count("clean-purge")
        for job_id in sorted(self.purged):
            left = self._leftovers(job_id)
            if left:
                self._violate("clean-purge", job_id, f"left after its purge: {'; '.join(left[:8])}")

    def _leftovers(self, job_id: str) -> list[str]:
        out = [f"{n.name}: {p}" for n in self.rig.nodes for p in job_leftovers(n.root, job_id)]
        out += [f"bucket: {key}" for key in sorted(self.bucket.objects(job_id))]
        return out

    # ---------------------------------------------------------------- purge

    def purge(self, job: JobRun) -> str:
        """Delete the job while its uploads and transfers are in flight; check that nothing of it is left;
        it comes back as a new job (a new JobSet) that starts fresh."""
        self.crash(job, "deleted")
        job.crash = None
        old = job.job_id
        uploads = self.operator.backup_in_background(job)
        self._wait_for(lambda: [] if self._writing(old) else ["no writer yet"], 5.0)
        for node in self.rig.nodes:
            if not node.running:
                node.start_replicator(wait=False)
            node.wait_ready(READY_TIMEOUT)
        failed = self.operator.purge(old)
        self.purged.add(old)
        self._count("clean-purge")
        left = self._leftovers(old)
        for future in uploads:
            with contextlib.suppress(Exception):
                future.result(timeout=90)
        time.sleep(SETTLE)
        later = self._leftovers(old)
        for when, found in (("when the purge returned", left), (f"{SETTLE:.0f} s after", later)):
            if found:
                self._violate("clean-purge", old, f"left {when}: {'; '.join(found[:8])}")
        job.incarnation += 1
        job.attempt = job.peer_generation = job.policy_generation = 0
        job.peers = ()
        job.until = self.round_steps
        job.restart_reason = "a new job after the purge"
        extra = f"; purge failures: {failed}" if failed else ""
        return (
            f"{old} purged on every node and in the bucket with uploads in flight{extra}; "
            f"{job.job_id} starts fresh"
        )

    def _writing(self, job_id: str) -> bool:
        prefix = self.bucket.layout.writers_dir(job_id)
        return any(True for _ in self.bucket.bucket.client.list_blobs(self.bucket.bucket, prefix=prefix))

    # ---------------------------------------------------------------- nodes

    def spare_for(self, job: JobRun, lost: str | None, *, same_domain: bool, avoid: list[str]) -> str | None:
        """A node to take ``lost``'s place in ``job`` (or to grow it onto), by name, preferring ``lost``'s
        failure domain (``same_domain``) or another one."""
        candidates = [n for n in self.rig.nodes if n.name not in job.nodes and n.name not in avoid]
        if not candidates:
            return None
        domain = self.rig.node(lost).domain if lost else ""
        preferred = [n for n in candidates if (n.domain == domain) == same_domain]
        return (preferred or candidates)[0].name

    def other_domain(self, domain: str) -> str:
        domains = sorted({self.rig.cluster.domain_of(i) for i in range(len(self.rig.nodes))})
        return next((d for d in domains if d != domain), domain)

    # ---------------------------------------------------------------- history

    def violate(self, invariant: Invariant, job: str, detail: str) -> None:
        """Record a violation seen while a fault was injected (the run goes on)."""
        self._violate(invariant, job, detail)

    def _violate(self, invariant: Invariant, job: str, detail: str) -> None:
        v = Violation(invariant, job, detail, self.round_index)
        self.violations.append(v)
        self._note("violation", f"{invariant} ({job or 'cluster'}): {detail}")

    def _note(self, what: Any, text: str, fault: Fault | None = None) -> None:
        entry = Entry(
            at=round(time.monotonic() - self.t0, 3), round=self.round_index, what=what, text=text, fault=fault
        )
        self.history.append(entry)
        self._history_file.write(entry.to_bytes().decode() + "\n")
        self._history_file.flush()
        self._echo(f"{entry.at:8.1f}s r{entry.round:<3d} {what:9s} {text}")

    def _echo(self, line: str) -> None:
        if self.o.echo is not None:
            print(line, file=self.o.echo, flush=True)

    @staticmethod
    def _wait_for(problems: Callable[[], list[str]], timeout: float) -> list[str]:
        """Poll until ``problems()`` is empty; what it still says after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = problems()
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def _redundancy_problems(inv: NodeInventory, factor: int, want: int) -> list[str]:
    """What is wrong with a node's report of its redundancy: at the job's factor, ``want`` copies (fewer
    when the job has too few nodes for its factor, and then it says degraded, as documented)."""
    r = inv.redundancy
    if r is None:
        if any(h.local for h in inv.ranks.values()):
            return [f"{inv.node} reports no redundancy"]
        return []  # nothing of its own to count (a node the job grew onto, no save since)
    if r.factor != factor or r.copies < want or (r.degraded_since is not None and want >= factor):
        since = f", degraded since {r.degraded_since:.0f}" if r.degraded_since is not None else ""
        return [f"{inv.node} reports factor {r.factor}, {r.copies} copies{since}"]
    return []


def _by_tier(sources: dict[int, Any]) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = {}
    for rank, tier in sorted(sources.items()):
        out.setdefault(tier, []).append(rank)
    return out


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
