"""``tierckpt demo``: a local cluster, real training, three failures, three verified recoveries.

What runs (everything is torn down at the end, on errors and on Ctrl-C):

* ``LocalCluster`` (tierckpt_demo.cluster): N nodes, each a network namespace with its own tmpfs
  ramdisk and its own ``tierckpt-replicator`` process (loopback ports and plain directories when not
  root), plus fake-gcs-server as the bucket;
* the demo plays the operator: it assigns peers with ``tierckpt.planning.placement`` (across two failure
  domains) and publishes each restore plan computed by ``tierckpt.planning.restore_plan`` from the nodes'
  inventories, through the replicators' control API;
* one training process per node (``tierckpt_demo.training``, torch.distributed over gloo), inside
  its node's namespace with ``TIERCKPT_ROOT`` = that node's ramdisk, checkpointing through
  ``tierckpt.Checkpointer``;
* the timeline of ``scenarios.plan_segments``: train, kill, break (``scenarios``), restore, check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tierckpt.protocol.control import PeerAssignment
from tierckpt.protocol.errors import TierckptError
from tierckpt.protocol.text import rank_ranges
from tierckpt_demo import scenarios as sc
from tierckpt_demo.launcher import Launcher, kill_process_group, node_files_prefix
from tierckpt_demo.local_operator import LocalOperator
from tierckpt_demo.ports import free_port
from tierckpt_demo.report import (
    Check,
    DemoConfig,
    DemoReport,
    RankResult,
    ScenarioResult,
    dedup_line,
    median,
    tier_groups,
)
from tierckpt_demo.training import TrainerEvent, parse_model_size, read_events

__all__ = ["Demo", "DemoError", "DemoOptions"]

log = logging.getLogger(__name__)

T = TypeVar("T")

JOB = "tierckpt-demo"
_MiB = 1 << 20
_GiB = 1 << 30
_PROCESS_BYTES = 600 * _MiB
"""A node's processes: the launcher (torch imported), the training process, the replicator and its worker."""


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class DemoError(TierckptError):
    """The demo could not go on (a process died, a phase timed out); the message says which and why."""


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    nodes: int = 4
    model_size: str = "small"
    steps: int = 40
    checkpoint_every: int = 5
    scenarios: tuple[str, ...] = ("local", "peer", "gcs")
    keep_workdir: bool = False
    seed: int = 1234
    replicas: int = 1
    """Peers each node's ranks are copied to (K)."""
    domains: int = 2
    netns: bool | None = None
    """Network namespaces (None: when running as root)."""
    timeout: float = 300.0
    """Longest wait for any one phase, in seconds."""
    flip_bit: bool = False
    """Negative control: rank 0 flips one bit of its state after the first restore; checks must fail."""
    procs_per_node: int = 1
    """Training processes per node (the DCP demo runs several, sharded with FSDP2)."""
    dcp: bool = False
    """Checkpoint an FSDP2 model through PyTorch DCP (``tierckpt_demo.dcp_demo``) instead of
    ``Checkpointer``; adds the ``shrink`` scenario (the job resumes on fewer nodes, resharded)."""
    replica_group: bool = False
    """Every rank saves as a member of one replica group (the model is data parallel): each shard is
    written once per node, replicated and uploaded once; the report shows the bytes saved."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def validate(self) -> None:
        if self.nodes < 1 or self.procs_per_node < 1:
            raise ValueError("--nodes and the processes per node must be at least 1")
        if "shrink" in self.scenarios and not self.dcp:
            raise ValueError("the shrink scenario needs --dcp: native checkpoints do not reshard")
        if self.dcp:
            self._validate_dcp()
            if self.replica_group:
                raise ValueError("--replica-group applies to Checkpointer; DCP deduplicates in its planner")
        if self.nodes < 2 and any(s != "local" for s in self.scenarios):
            raise ValueError("the peer and gcs scenarios need at least 2 nodes")
        if self.checkpoint_every < 2:
            raise ValueError("--checkpoint-every must be at least 2 (a recovery must replay some steps)")
        shape = parse_model_size(self.model_size)
        sc.plan_segments(self.steps, self.checkpoint_every, self.scenarios)
        need, have = self.memory_needed(shape.state_bytes), _available_memory()
        if have is not None and need > have:
            raise ValueError(
                f"{self.nodes} nodes with --model-size {self.model_size} need about {need / _GiB:.1f} GiB of "
                f"memory and {have / _GiB:.1f} GiB is available: use a smaller --model-size or fewer --nodes"
            )

    def _validate_dcp(self) -> None:
        from tierckpt_demo.dcp_training import GLOBAL_BATCH

        shrinks = self.scenarios.count("shrink")
        if self.nodes - shrinks < 1:
            raise ValueError(f"{shrinks} shrink scenario(s) need more than {self.nodes} node(s)")
        worlds = {(self.nodes - i) * self.procs_per_node for i in range(shrinks + 1)}
        if any(GLOBAL_BATCH % w for w in worlds):
            raise ValueError(
                f"the DCP demo splits a batch of {GLOBAL_BATCH} rows over the ranks: world sizes "
                f"{sorted(worlds)} must divide it (e.g. --nodes 3 with 2 processes per node)"
            )

    def memory_needed(self, state_bytes: int) -> int:
        """A rough upper bound: per node the client's slots (keep + 1), K replicas kept twice, staging,
        the training process (weights, grads, Adam) and the bucket's copies; plus the processes."""
        per_node = state_bytes * (3 + 2 * self.replicas + 1 + 2 + 3) + _PROCESS_BYTES
        return self.nodes * per_node + _GiB


# ------------------------------------------------------------------------------------- trainers


@dataclasses.dataclass
class Trainers:
    """The training processes of one segment, one per node, each forked by its node's launcher."""

    launchers: dict[int, Launcher]
    pids: dict[int, int]
    events: dict[int, Path]
    logs: dict[int, Path]
    launched_at: float = dataclasses.field(default_factory=time.time)

    def read(self) -> dict[int, list[TrainerEvent]]:
        return {r: read_events(p) for r, p in self.events.items()}

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL every process (a crash, not a shutdown) and wait until each is gone."""
        for pid in self.pids.values():
            kill_process_group(pid)
        deadline = time.monotonic() + timeout
        for rank, pid in self.pids.items():
            while self.launchers[rank].status(pid) is None and time.monotonic() < deadline:
                time.sleep(0.02)

    def failure(self) -> str | None:
        """Why the segment cannot go on: a rank exited with an error (or reported one)."""
        for rank, events in self.read().items():
            for ev in events:
                if ev.event == "error":
                    return f"rank {rank} failed: {ev.message}\n{_tail(self.logs[rank])}"
        for rank, pid in self.pids.items():
            code = self.launchers[rank].status(pid)
            if code not in (None, 0):
                return f"rank {rank} exited with status {code}:\n{_tail(self.logs[rank])}"
        return None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


# ------------------------------------------------------------------------------------- the demo


class Demo:
    """One run of the demo; ``run()`` returns the report (and never leaves anything behind)."""

    trainer_module = "tierckpt_demo.training"
    checkpointing = "native"
    """What the report calls the checkpoint path (``Checkpointer``, or ``dcp``)."""
    reshards = False
    """Whether a restore may change the world size (DCP): the restore plan then takes any world size."""
    """The module each training process runs (``tierckpt_demo.dcp_demo`` runs the DCP one)."""

    def __init__(self, options: DemoOptions, console: Console) -> None:
        options.validate()
        self.o = options
        self.console = console
        self.shape = parse_model_size(options.model_size)
        self.segments = sc.plan_segments(options.steps, options.checkpoint_every, options.scenarios)
        self.workdir = Path(tempfile.mkdtemp(prefix="tierckpt-demo-"))
        self.cluster: Any = None
        self.assignment: PeerAssignment | None = None
        self.control: LocalOperator | None = None
        self.reference = sc.Reference()
        self.results: list[ScenarioResult] = []
        self.timings: dict[str, float] = {}
        self.dedup: dict[str, int] = {}
        self.trainers: Trainers | None = None
        self.lost: tuple[str, ...] = ()
        self.rank_nodes: dict[int, str] = {}
        """Rank -> the node that ran it when the last failure struck (where its step was)."""
        self._peers_before: dict[str, tuple[str, ...]] = {}
        """The peers in force when the last failure struck."""
        self.run_checks: list[Check] = []
        self.launchers: dict[int, Launcher] = {}
        self._launchers_ready = False
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._task = self.progress.add_task("starting", total=None)
        self._t0 = time.monotonic()

    # ---------------------------------------------------------------- top level

    @property
    def _operator(self) -> LocalOperator:
        """The demo's stand-in operator (it exists once the cluster is up)."""
        if self.control is None:
            raise RuntimeError("the local operator is not running yet")
        return self.control

    def run(self) -> DemoReport:
        started = self._t0 = time.monotonic()
        error = ""
        try:
            with self.progress, _sigterm_as_interrupt():
                self._setup()
                self._timeline()
        except (TierckptError, TimeoutError, RuntimeError, OSError) as exc:
            error = str(exc)
            log.debug("demo stopped", exc_info=True)
        finally:
            self._teardown(keep=self.o.keep_workdir)
        self.timings["total_s"] = time.monotonic() - started
        return self._report(error)

    def _report(self, error: str) -> DemoReport:
        names = [n.name for n in self.cluster.nodes] if self.cluster else []
        config = DemoConfig(
            nodes=self.o.nodes,
            world_size=self.o.world_size,
            network="netns" if self.cluster is not None and self.cluster.netns else "loopback",
            model_params=self.shape.params,
            state_bytes=self.shape.state_bytes,
            steps=self.o.steps,
            checkpoint_every=self.o.checkpoint_every,
            scenarios=self.o.scenarios,
            seed=self.o.seed,
            peers=dict(self.assignment.peers) if self.assignment else {n: () for n in names},
            procs_per_node=self.o.procs_per_node,
            checkpointing=self.checkpointing,
        )
        ran_all = len(self.results) == len(self.o.scenarios)
        checks = self.run_checks
        ok = (
            not error
            and ran_all
            and all(s.ok for s in self.results)
            and bool(checks)
            and all(c.ok for c in checks)
        )
        return DemoReport(
            ok=ok,
            config=config,
            scenarios=tuple(self.results),
            losses=dict(self.reference.losses),
            timings=self.timings,
            checks=tuple(checks),
            workdir=str(self.workdir) if self.o.keep_workdir else "",
            error=error or ("" if ran_all else "not every scenario ran"),
            dedup=dict(self.dedup),
        )

    def _say(self, text: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self._t0:6.1f}s[/] {text}", highlight=False)

    def _phase(self, text: str, total: int | None = None, completed: int = 0) -> None:
        self.progress.update(self._task, description=text, total=total, completed=completed)

    # ---------------------------------------------------------------- setup and teardown

    def _ramdisk_size(self) -> str:
        """Room for the client's slots (keep + 1), replicas of K peers, staging, and slack."""
        per_rank = self.shape.state_bytes + _MiB
        need = per_rank * (3 + 3 * self.o.replicas + 2) + 96 * _MiB
        return f"{need // _MiB}m"

    def _setup(self) -> None:
        from tierckpt_demo.cluster import LocalCluster, cleanup_stale

        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            cleanup_stale()
        self._phase(f"starting {self.o.nodes} nodes (replicators, ramdisks) and fake-gcs-server")
        every = self.o.checkpoint_every
        self.cluster = LocalCluster(
            self.o.nodes,
            job=JOB,
            k=self.o.replicas,
            procs_per_node=self.o.procs_per_node,
            ramdisk_size=self._ramdisk_size(),
            gcs=True,
            count_gcs_reads=True,
            domains=min(self.o.domains, self.o.nodes),
            netns=self.o.netns,
            replicator_args=[
                "--no-restore-on-start",
                "--poll-interval",
                "1",
                "--reconcile-interval",
                "2",
                "--inventory-timeout",
                "2",
                "--backup-poll-interval",
                "2",
                "--backup-interval-steps",
                str(2 * every),
                "--log-level",
                "INFO",
            ],
        )
        self._start_launchers()
        self.control = control = LocalOperator(
            self.cluster, JOB, wait=self._wait, procs_per_node=self.o.procs_per_node
        )
        self.assignment = control.assign_peers(self.o.replicas)
        self.timings["setup_s"] = time.monotonic() - t0
        mode = "network namespaces + tmpfs" if self.cluster.netns else "loopback ports + directories"
        peers = ", ".join(f"{n}→{'+'.join(p)}" for n, p in self.assignment.peers.items())
        ranks = f" x {self.o.procs_per_node} ranks" if self.o.procs_per_node > 1 else ""
        self._say(
            f"[green]✔[/] cluster up in {self.timings['setup_s']:.1f} s: {self.o.nodes} nodes{ranks} "
            f"({mode}), peers {peers}" + (f"; workdir {self.workdir}" if self.o.keep_workdir else "")
        )
        self._say(
            f"  model: {self.shape.params:,} parameters, {self.shape.state_bytes / _MiB:.1f} MiB "
            f"per rank per checkpoint, checkpoint every {every} steps"
        )

    def _teardown(self, *, keep: bool) -> None:
        """Stop and remove everything the run started; a second Ctrl-C does not cut this short."""
        with _signals_ignored():
            self._cleanup(keep=keep)

    def _cleanup(self, *, keep: bool) -> None:
        if self.trainers is not None:
            self.trainers.kill()
        for launcher in self.launchers.values():
            launcher.close()
        if self.cluster is not None:
            if keep:
                for node in self.cluster.nodes:
                    with contextlib.suppress(OSError):
                        shutil.copy(node.log_path, self.workdir / f"replicator-{node.name}.log")
            self.cluster.close()
        if not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---------------------------------------------------------------- the timeline

    def _timeline(self) -> None:
        t0 = time.monotonic()
        plan_at = self._publish_plan(None)
        before: dict[int, list[TrainerEvent]] = {}
        for i, segment in enumerate(self.segments):
            self._wait_launchers()
            self.trainers = self._launch(i, segment)
            events = self._wait_segment(i, segment)
            if i > 0:
                self._judge(self.segments[i - 1], before, events, plan_at)
            self._record(events)
            before = events
            if segment.scenario is None:
                self._finish(events)
                break
            self._prepare_failure(segment)
            self.trainers.kill()
            self.trainers = None
            lost = self._break(segment.scenario)
            self._say(
                f"[yellow]✘[/] {sc.SCENARIOS[segment.scenario].failure} at step {segment.until}"
                + (f": {', '.join(lost)}" if lost else "")
            )
            self.lost = lost
            plan_at = self._publish_plan(segment.expected_restore)
        self.timings["training_s"] = time.monotonic() - t0

    def _finish(self, events: dict[int, list[TrainerEvent]]) -> None:
        if self.o.replica_group:
            self._account()
        finals = {r: e.sha256 for r, evs in events.items() for e in evs if e.event == "done"}
        self.run_checks = sc.check_run(
            steps=self.o.steps,
            losses=self.reference.losses,
            final_models=finals,
            world_size=self._operator.world_size,
        )
        for c in self.run_checks:
            self._say(f"{'[green]✔[/]' if c.ok else '[red]✘[/]'} {c.name}: {c.detail}")

    def _account(self) -> None:
        """Replica groups: what the ranks wrote over the run (their saves' accounting) and what the
        replicators sent to their peers (their counters: bytes sent, and bytes a peer linked instead),
        each against the bytes without deduplication."""
        out = self.dedup
        sent = linked = 0
        for node in self._operator.nodes:
            counters = _counters(f"{node.probe_endpoint}/metrics")
            sent += int(counters.get(("tierckpt_replicator_transfer_bytes_total", "out"), 0))
            linked += int(counters.get(("tierckpt_replicator_dedup_bytes_total", ""), 0))
        out["replicated"], out["replicated_logical"] = sent, sent + linked
        self._say(dedup_line(out))

    def _record(self, events: dict[int, list[TrainerEvent]]) -> None:
        if self.o.replica_group:
            for evs in events.values():
                for e in evs:
                    if e.event == "saved":
                        self.dedup["written"] = self.dedup.get("written", 0) + e.written_bytes
                        self.dedup["written_logical"] = self.dedup.get("written_logical", 0) + e.logical_bytes
        losses = {
            e.step: e.loss
            for e in events.get(0, [])
            if e.event == "step" and e.step is not None and e.loss is not None
        }
        saved = {
            (r, e.step): e.sha256
            for r, evs in events.items()
            for e in evs
            if e.event == "saved" and e.step is not None
        }
        self.reference.record(losses, saved)

    # ---------------------------------------------------------------- training segments

    def _launch(self, index: int, segment: sc.Segment) -> Trainers:
        nodes = self._operator.nodes
        port = 29500 + index if self.cluster.netns else free_port()
        seg_dir = self.workdir / f"segment-{index}"
        seg_dir.mkdir()
        trainers = Trainers({}, {}, {}, {})
        for node in nodes:
            for local, rank in enumerate(self._operator.ranks_of(node)):
                trainers.launchers[rank] = self.launchers[node.index]
                trainers.events[rank] = seg_dir / f"events-rank-{rank:05d}.jsonl"
                trainers.logs[rank] = seg_dir / f"rank-{rank:05d}.log"
                argv = [
                    "--events",
                    str(trainers.events[rank]),
                    "--model-size",
                    self.o.model_size,
                    "--seed",
                    str(self.o.seed),
                    "--until",
                    str(segment.until),
                    "--checkpoint-every",
                    str(self.o.checkpoint_every),
                ]
                if segment.scenario is not None:
                    argv.append("--hold")
                if self.o.flip_bit and index == 1 and rank == 0:
                    argv.append("--flip-restored-bit")
                if self.o.replica_group:
                    argv.append("--replica-group")
                env = {**os.environ, **self._trainer_env(node, rank, local, nodes[0].ip, port)}
                trainers.pids[rank] = trainers.launchers[rank].launch(argv, env, str(trainers.logs[rank]))
        return trainers

    def _start_launchers(self) -> None:
        """One launcher per node, inside its namespace; they import torch while the cluster settles."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        prefix = node_files_prefix(self.workdir, self.cluster.nodes) if self.cluster.netns else []
        for node in self.cluster.nodes:
            self.launchers[node.index] = Launcher(
                partial(node.popen_in_node, env=env), prefix, module=self.trainer_module
            )

    def _wait_launchers(self) -> None:
        if not self._launchers_ready:
            self._phase("starting the training launchers (importing torch once per node)")
            for launcher in self.launchers.values():
                launcher.wait_ready(self.o.timeout)
            self._launchers_ready = True

    def _trainer_env(self, node: Any, rank: int, local: int, master_ip: str, port: int) -> dict[str, str]:
        return {
            "MASTER_ADDR": master_ip,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(self._operator.world_size),
            "GLOO_SOCKET_IFNAME": "eth0" if self.cluster.netns else "lo",
            "TIERCKPT_ROOT": str(node.root),
            "TIERCKPT_JOB": JOB,
            "TIERCKPT_NODE_NAME": node.name,
            "TIERCKPT_REPLICATOR_URL": node.endpoint,
            "TIERCKPT_RESTORE_WAIT": str(int(self.o.timeout)),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def _wait_segment(self, index: int, segment: sc.Segment) -> dict[int, list[TrainerEvent]]:
        """Follow the segment until every rank is held (or done); returns every rank's events."""
        assert self.trainers is not None
        trainers = self.trainers
        final = "held" if segment.scenario is not None else "done"
        what = f"segment {index + 1}/{len(self.segments)}: training to step {segment.until}"
        self._phase(what + " (starting processes)", total=segment.until)
        state: dict[str, Any] = {}

        def reached() -> dict[int, list[TrainerEvent]] | None:
            failure = trainers.failure()
            if failure:
                raise DemoError(f"{what}: {failure}")
            events = trainers.read()
            steps = [e.step for e in events.get(0, []) if e.event == "step" and e.step is not None]
            if steps:
                if "first" not in state:
                    state["first"] = steps[0]
                self._phase(what, total=segment.until, completed=steps[-1])
            done = all(any(e.event == final for e in evs) for evs in events.values())
            return events if done else None

        events = self._wait(reached, what)
        first = state.get("first", segment.until)
        up = max(e.time for evs in events.values() for e in evs if e.event == "start")
        end = max(e.time for evs in events.values() for e in evs)
        self._say(
            f"[green]✔[/] segment {index + 1}: trained steps {first}-{segment.until}, "
            f"{sum(e.event == 'saved' for e in events[0])} checkpoint(s) "
            f"[dim](processes up in {up - self.trainers.launched_at:.1f} s, then {end - up:.1f} s)[/]"
        )
        return events

    def _wait(self, predicate: Callable[[], T | None], what: str, interval: float = 0.1) -> T:
        deadline = time.monotonic() + self.o.timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {self.o.timeout:.0f} s: {what}")
            time.sleep(interval)

    # ---------------------------------------------------------------- failures

    def _prepare_failure(self, segment: sc.Segment) -> None:
        """Make sure the newest checkpoint reached the tiers the scenario will need."""
        scenario = sc.SCENARIOS[segment.scenario or ""]
        step = segment.expected_restore
        assert step is not None and self.control is not None
        control = self.control
        if scenario.needs_replication:
            self._phase(f"waiting for step {step} to reach every peer")
            t0 = time.monotonic()
            self._wait(lambda: control.replicated(step), f"replication of step {step} to the peers")
            self._say(
                f"[green]✔[/] step {step} replicated to every peer ({time.monotonic() - t0:.1f} s after "
                "the processes were held)"
            )
        if scenario.needs_backup:
            self._phase(f"backing up step {step} to GCS")
            t0 = time.monotonic()
            url = control.backup(step, self.o.timeout)
            took = time.monotonic() - t0
            self._say(f"[green]✔[/] step {step} complete in the bucket ({took:.1f} s): {url}")

    def _break(self, scenario: str) -> tuple[str, ...]:
        """Inject the failure; returns the wiped nodes (replaced by fresh, empty ones, except when the job
        shrinks: then it goes on without them)."""
        assert self.assignment is not None
        nodes = self._operator.nodes
        self.rank_nodes = {r: n.name for n in nodes for r in self._operator.ranks_of(n)}
        self._peers_before = dict(self.assignment.peers)
        victim = {"gcs": nodes[0], "shrink": nodes[-1]}.get(scenario, nodes[min(1, len(nodes) - 1)]).name
        lost = sc.lost_nodes(scenario, victim, self.assignment.peers)
        for name in lost:
            node = self.cluster.node(name)
            node.kill_replicator()
            node.wipe_ramdisk()
        if scenario == "shrink":
            self.assignment = self._operator.shrink(list(lost), self.o.replicas)
            return lost
        for name in lost:
            self.cluster.node(name).start_replicator()
        return lost

    def _publish_plan(self, expected: int | None) -> float:
        """The operator's part after a failure: publish the restore plan; it must pick ``expected``."""
        self._phase("publishing a restore plan" if expected is not None else "publishing a fresh-start plan")
        assert self.control is not None
        plan, at = self._operator.publish_plan(None if self.reshards else self._operator.world_size)
        if plan.step != expected:
            raise DemoError(f"the restore plan chose step {plan.step}, expected {expected} ({plan.sources})")
        return at

    # ---------------------------------------------------------------- checks

    def _judge(
        self,
        previous: sc.Segment,
        before: dict[int, list[TrainerEvent]],
        events: dict[int, list[TrainerEvent]],
        plan_at: float,
    ) -> None:
        """Check the recovery from ``previous``'s failure, seen in the events of the segment after it.

        ``before``: the events of the segment the failure ended (its saves' blocking times).
        """
        assert self.assignment is not None and previous.scenario is not None
        rank_nodes = {r: self.rank_nodes.get(r, "") for r in events}
        expected = sc.expected_tiers(rank_nodes, self._peers_before, self.lost)
        ranks = [self._rank_result(r, rank_nodes[r], expected[r], events[r], plan_at) for r in sorted(events)]
        replayed = {
            e.step: e.loss
            for e in events.get(0, [])
            if e.event == "step" and e.loss is not None and e.step is not None and e.step <= previous.until
        }
        checks, compared = sc.check_recovery(
            expected_step=previous.expected_restore,
            ranks=ranks,
            reference=self.reference,
            replayed=replayed,
            tolerance=self._loss_tolerance(previous),
        )
        restored_at = max(
            (e.time for evs in events.values() for e in evs if e.event == "restored"), default=0.0
        )
        bucket_reads = self.cluster.bucket_rank_reads(plan_at, restored_at)
        checks += self._recovery_checks(previous.scenario, ranks, bucket_reads)
        saves = [e.seconds for evs in before.values() for e in evs if e.event == "saved"]
        result = ScenarioResult(
            name=previous.scenario,
            failure=sc.SCENARIOS[previous.scenario].title,
            ok=all(c.ok for c in checks),
            killed_at_step=previous.until,
            expected_step=previous.expected_restore,
            restored_step=ranks[0].step if ranks else None,
            lost_nodes=self.lost,
            ranks=tuple(ranks),
            bytes=sum(r.bytes for r in ranks),
            save_blocking_s=median(saves),
            save_blocking_max_s=max(saves, default=0.0),
            restore_s=max((r.restore_s for r in ranks), default=0.0),
            replayed_steps=compared,
            checks=tuple(checks),
            world_size=len(ranks),
            fetched=tuple(sorted({f for r in ranks for f in r.fetched})),
            bucket_reads=bucket_reads,
            fetched_bytes=sum(r.fetched_bytes for r in ranks),
            fetch_s=max((r.fetch_s for r in ranks), default=0.0),
        )
        self.results.append(result)
        tiers = ", ".join(f"{t} {rank_ranges([r.rank for r in rs])}" for t, rs in tier_groups(ranks))
        head = f"{result.name}: restored step {result.restored_step} ({tiers}) in {result.restore_s:.2f} s"
        if result.ok:
            extra = [c.detail for c in checks if c.name not in ("step", "tier", "state")]
            self._say(f"[green]✔[/] {head}; state bit-exact; " + "; ".join(extra))
        else:
            self._say(f"[red]✘[/] {head}; " + "; ".join(c.detail for c in checks if not c.ok))

    def _loss_tolerance(self, previous: sc.Segment) -> float:
        """Relative difference allowed between replayed and first losses (0: bit for bit)."""
        return 0.0

    def _recovery_checks(self, scenario: str, ranks: list[RankResult], bucket_reads: int) -> list[Check]:
        """Checks beyond step, tier, state and loss (the DCP demo adds its own)."""
        return []

    def _rank_result(
        self, rank: int, node: str, expected: str, events: list[TrainerEvent], plan_at: float
    ) -> RankResult:
        lost = node in self.lost
        restored = next((e for e in events if e.event == "restored"), None)
        if restored is None:
            return RankResult(rank, node, "none", expected, None, 0, 0.0, 0.0, 0.0, "", "", lost)
        stage_s = max(0.0, restored.staged_at - plan_at) if restored.staged_at else 0.0
        reference = self.reference.saved.get((rank, restored.step), "") if restored.step is not None else ""
        return RankResult(
            rank,
            node,
            restored.tier,
            expected,
            restored.step,
            restored.bytes,
            stage_s + restored.seconds,
            stage_s,
            restored.seconds,
            restored.sha256,
            reference,
            lost,
            restored.fetched,
            restored.fetched_bytes,
            restored.fetch_s,
        )


def _counters(url: str) -> dict[tuple[str, str], float]:
    """(sample name, its ``direction`` label or "") -> value, from a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, sample.labels.get("direction", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM cleans up like Ctrl-C does."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM for the block (in the main thread; elsewhere, do nothing)."""
    try:
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
