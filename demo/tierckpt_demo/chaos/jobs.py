"""A training job of a chaos run: its nodes, its launches (one training process per node, forked by that
node's launcher), and what its ranks report.

``JobRun`` is what the operator and the JobSet controller know about the job: the nodes it runs on (in
node-rank order), its replication factor, the generations it has published, and its current
``Launch``. A launch is one attempt of the JobSet: a process per rank, started together, killed
together (``Launch.kill``: when one rank dies the JobSet restarts them all). Each rank writes its
``TrainerEvent`` lines to a file of its own, read back here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from tierckpt.protocol.control import RestorePlan
from tierckpt_demo.chaos.reference import Anchor
from tierckpt_demo.chaos.rig import MODULES, Rig
from tierckpt_demo.chaos.schedule import JobName
from tierckpt_demo.launcher import Launcher, kill_process_group
from tierckpt_demo.training import TrainerEvent, read_events

__all__ = ["EVERY", "Crash", "JobRun", "Launch", "start_launch"]

EVERY = 3
"""Steps between checkpoints."""
STEP_SECONDS = 0.15
"""Each step's stand-in compute time: long enough for faults to land while the job trains."""
RESTORE_WAIT = 60
"""The trainers' ``TIERCKPT_RESTORE_WAIT``: seconds a load waits for a staging status that stopped moving."""
MODEL_SIZE = "tiny"


@dataclasses.dataclass(frozen=True)
class Crash:
    """How a launch ended, for the next restore's checks."""

    last: int
    """The newest step any rank had trained."""
    committed: int | None
    """The newest step every rank had committed on its own ramdisk (scanned before any wipe)."""
    reason: str
    excused: bool = False
    """Saves could fail (a full ramdisk): the lost work is the fault's, not the system's."""


@dataclasses.dataclass
class Launch:
    """One attempt of a job: a training process per rank."""

    index: int
    job: str
    world: int
    nodes: tuple[str, ...]
    """Rank -> the node it runs on."""
    until: int
    pids: dict[int, int]
    launchers: dict[int, Launcher]
    events: dict[int, Path]
    logs: dict[int, Path]
    plan: RestorePlan | None = None
    oracle: int | None = None
    """The newest restorable step, by the harness's own scan, when the plan was made."""
    crash: Crash | None = None
    """How the attempt before ended."""
    checked: bool = False
    """Its restore was checked."""
    anchors: list[Anchor] = dataclasses.field(default_factory=list)
    seen: dict[int, int] = dataclasses.field(default_factory=dict)
    """Rank -> events already processed."""
    transient: set[str] = dataclasses.field(default_factory=set)
    """Transient faults in force at some point of the attempt."""
    killed: bool = False
    full_ramdisk: bool = False
    """A ramdisk was kept full at some point of the attempt (its saves could fail)."""

    def read(self) -> dict[int, list[TrainerEvent]]:
        return {r: read_events(p) for r, p in self.events.items()}

    def new_events(self) -> dict[int, list[TrainerEvent]]:
        """Each rank's events not returned before."""
        out = {}
        for rank, events in self.read().items():
            done = self.seen.get(rank, 0)
            out[rank] = events[done:]
            self.seen[rank] = len(events)
        return out

    def status(self, rank: int) -> int | None:
        return self.launchers[rank].status(self.pids[rank])

    def failure(self) -> str:
        """Why the attempt cannot go on ("" while it can): a rank reported an error or exited."""
        for rank, events in self.read().items():
            for ev in events:
                if ev.event == "error":
                    return f"rank {rank} failed: {ev.message}"
        for rank in self.pids:
            code = self.status(rank)
            if code is not None and code != 0:
                return f"rank {rank} exited with status {code}"
        return ""

    def held(self) -> bool:
        return all(any(e.event == "held" for e in evs) for evs in self.read().values())

    def last_step(self) -> int:
        steps = [e.step for evs in self.read().values() for e in evs if e.step is not None]
        return max(steps, default=0)

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL every rank (a crash, not a shutdown) and wait until each is gone."""
        self.killed = True
        for rank in self.pids:
            self.kill_rank(rank)
        deadline = time.monotonic() + timeout
        for rank in self.pids:
            while self.status(rank) is None and time.monotonic() < deadline:
                time.sleep(0.02)

    def kill_rank(self, rank: int) -> None:
        """SIGKILL the rank's process group, unless its process exited: once reaped, its pid may be
        another process's (pids wrap at 32768 on a busy machine)."""
        if self.status(rank) is None:
            kill_process_group(self.pids[rank])

    def wait_event(
        self, rank: int, kinds: tuple[str, ...], after: int, timeout: float
    ) -> TrainerEvent | None:
        """The first event of ``kinds`` that ``rank`` writes past its first ``after`` events (polled every
        few milliseconds, so a kill right after it lands in what follows), or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        path = self.events[rank]
        size = -1
        while time.monotonic() < deadline:
            now = path.stat().st_size if path.exists() else 0
            if now != size:
                size = now
                events = read_events(path)
                found = next((e for e in events[after:] if e.event in kinds), None)
                if found is not None:
                    return found
            if self.status(rank) is not None:
                return None
            time.sleep(0.003)
        return None


class JobRun:
    """A job as the operator and the JobSet controller see it."""

    def __init__(self, name: JobName, nodes: list[str], *, tag: str, factor: int) -> None:
        self.name = name
        self.module = MODULES[0] if name == "native" else MODULES[1]
        self.tag = tag
        self.incarnation = 0
        self.nodes = list(nodes)
        """Node rank -> node name."""
        self.factor = factor
        self.attempt = 0
        """The JobSet's restart attempt (the restore plan's generation)."""
        self.peer_generation = 0
        self.policy_generation = 0
        self.peers: tuple[tuple[int, ...], ...] = ()
        self.launch: Launch | None = None
        self.crash: Crash | None = None
        self.restart_reason = ""
        """Why the job waits for a restart ("": it does not)."""
        self.until = 0
        self.progress = 0
        """Steps trained in the current round (replayed ones included)."""
        self.failed_launches = 0
        """Launches in a row that failed."""
        self.on_plan: list[Any] = []
        """Callbacks run once the next restore plan is published (a fault waiting for staging)."""

    @property
    def job_id(self) -> str:
        return f"chaos-{self.name}-{self.tag}-{self.incarnation}"

    @property
    def world(self) -> int:
        return len(self.nodes)

    def node_of(self, slot: int) -> str:
        return self.nodes[slot % len(self.nodes)]


def start_launch(
    rig: Rig, job: JobRun, *, index: int, seed: int, until: int, port: int, workdir: Path
) -> Launch:
    """Fork a training process for every rank of ``job`` on its node."""
    folder = workdir / f"launch-{index:05d}-{job.job_id}"
    folder.mkdir(parents=True)
    master = rig.node(job.nodes[0])
    launch = Launch(index, job.job_id, job.world, tuple(job.nodes), until, {}, {}, {}, {})
    for rank, name in enumerate(job.nodes):
        node = rig.node(name)
        launch.launchers[rank] = rig.launchers[name]
        launch.events[rank] = folder / f"events-rank-{rank:05d}.jsonl"
        launch.logs[rank] = folder / f"rank-{rank:05d}.log"
        argv = [
            "--events",
            str(launch.events[rank]),
            "--model-size",
            MODEL_SIZE,
            "--seed",
            str(seed),
            "--until",
            str(until),
            "--checkpoint-every",
            str(EVERY),
            "--hold",
            "--step-seconds",
            str(STEP_SECONDS),
            "--init-timeout",
            "60",
        ]
        if job.name == "native":
            argv.append("--replica-group")
        env = {
            **os.environ,
            "MASTER_ADDR": master.ip,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(job.world),
            "GLOO_SOCKET_IFNAME": "eth0",
            "TIERCKPT_ROOT": str(node.root),
            "TIERCKPT_JOB": job.job_id,
            "TIERCKPT_NODE_NAME": node.name,
            "TIERCKPT_REPLICATOR_URL": node.endpoint,
            "TIERCKPT_RESTORE_WAIT": str(RESTORE_WAIT),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        launch.pids[rank] = launch.launchers[rank].launch(
            argv, env, str(launch.logs[rank]), module=job.module
        )
    return launch
