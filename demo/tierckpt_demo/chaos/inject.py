"""How each kind of fault is done to the rig, and undone.

``Injector.fire(fault)`` acts at once and returns what it did, in a sentence (or why it was skipped:
a job too small to shrink, no node left to replace one with). Faults that hit a moment of some work
wait for that work first, within bounds: a trainer is killed right after it announces a save, a
replicator while a transfer of its node is staged on the receiver (the link slowed so that it takes a
moment) or while its node holds a writer lease in the bucket, or while its node stages a restore. If
the moment does not come in time, the kill happens anyway and the sentence says so.

Transient faults (``schedule.TRANSIENT``) stay in force until ``Injector.clear``: network effects are
kept per fault and applied as a whole (``Rig.apply``), a full ramdisk is a filler file, bucket faults are
rules of the ``FaultProxy``.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tierckpt.protocol.control import RestoreState, read_restore_status
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import job_dir
from tierckpt_demo.chaos.jobs import EVERY, JobRun
from tierckpt_demo.chaos.rig import NetState
from tierckpt_demo.chaos.schedule import Fault
from tierckpt_demo.cluster import Node
from tierckpt_demo.fakegcs import FaultRule

if TYPE_CHECKING:
    from tierckpt_demo.chaos.operator import Operator
    from tierckpt_demo.chaos.oracle import Invariant
    from tierckpt_demo.chaos.rig import Rig
    from tierckpt_demo.chaos.tiers import BucketView

__all__ = ["Injector", "RunControl", "other_slot"]

log = logging.getLogger(__name__)

MOMENT_TIMEOUT = 8.0
"""Seconds a fault waits for the moment it should hit (a save, a transfer, an upload, staging)."""
THROTTLE_KBIT = 800
"""A node's link while a fault waits to catch one of its transfers in flight (a 250 KB step: ~2.5 s)."""
LEAVE_BYTES = 64 << 10
"""What a full ramdisk still has free."""
STOP_TIMEOUT = 30.0
"""Seconds a replicator given SIGTERM has to exit (its ``--preemption-timeout`` is 10 s)."""


def other_slot(slot: int, other: int, world: int) -> int:
    """A node rank other than ``slot`` among ``world`` (``other`` picks which)."""
    return (slot + 1 + other % (world - 1)) % world


class RunControl(Protocol):
    """What an injector needs of the run it serves (``runner.ChaosRun``, which builds it): the run's
    parts, and its verbs for what a fault does to a job."""

    jobs: dict[str, JobRun]
    operator: Operator
    bucket: BucketView

    @property
    def rig(self) -> Rig: ...

    def crash(self, job: JobRun, reason: str, *, excused: bool = False) -> None: ...

    def restart(self, job: JobRun) -> None: ...

    def purge(self, job: JobRun) -> str: ...

    def spare_for(
        self, job: JobRun, lost: str | None, *, same_domain: bool, avoid: list[str]
    ) -> str | None: ...

    def other_domain(self, domain: str) -> str: ...

    def violate(self, invariant: Invariant, job: str, detail: str) -> None: ...


class Injector:
    def __init__(self, run: RunControl) -> None:
        self.run = run
        self.rig = run.rig
        self.net: dict[int, dict[str, NetState]] = {}
        """Fault id -> the network effect it has on each node."""
        self.fillers: dict[int, tuple[str, Path]] = {}
        """Fault id -> (node, the file that fills its ramdisk)."""
        self.rules: dict[int, FaultRule] = {}

    # ---------------------------------------------------------------- dispatch

    def fire(self, fault: Fault, fid: int) -> str:
        job = self.run.jobs[fault.job]
        act = getattr(self, "_" + fault.kind.replace("-", "_"))
        text: str = act(fault, fid, job)
        return text

    def clear(self, fid: int) -> None:
        """Undo what transient fault ``fid`` still does (nothing if it is over)."""
        self.net.pop(fid, None)
        filler = self.fillers.pop(fid, None)
        if filler is not None:
            with contextlib.suppress(FileNotFoundError):
                filler[1].unlink()
        rule = self.rules.pop(fid, None)
        if rule is not None:
            self.rig.proxy.remove_rule(rule)
        self._apply_net()

    def clear_all(self) -> None:
        for fid in {*self.net, *self.fillers, *self.rules}:
            self.clear(fid)

    def full_nodes(self) -> set[str]:
        """Nodes whose ramdisk a fault keeps full."""
        return {name for name, _ in self.fillers.values()}

    def _apply_net(self) -> None:
        merged: dict[str, NetState] = {}
        for effects in self.net.values():
            for node, state in effects.items():
                merged[node] = merged.get(node, NetState()).merge(state)
        self.rig.apply(merged)

    def _effect(self, fid: int, node: str, state: NetState) -> None:
        self.net.setdefault(fid, {})
        self.net[fid][node] = self.net[fid].get(node, NetState()).merge(state)
        self._apply_net()

    # ---------------------------------------------------------------- trainers

    def _trainer_kill(self, f: Fault, fid: int, job: JobRun) -> str:
        if f.mode == "load":
            self.run.crash(job, "restarted for a kill while loading")
            self.run.restart(job)
        launch = job.launch
        if launch is None:
            return "skipped: the job is not running"
        rank = f.slot % launch.world
        if launch.held():
            launch.kill_rank(rank)
            return f"killed rank {rank} of {job.job_id} on {launch.nodes[rank]} while it was held"
        kinds = {"step": ("step",), "save": ("saving",), "saved": ("saved",), "load": ("start",)}[f.mode]
        after = 0 if f.mode == "load" else len(launch.read()[rank])
        ev = None
        for _ in range(4 * EVERY):
            ev = launch.wait_event(rank, kinds, after, MOMENT_TIMEOUT)
            if ev is None or f.mode != "step" or (ev.step or 0) % EVERY:
                break
            after += 1  # a checkpoint step: wait for a plain one
        launch.kill_rank(rank)
        where = f"right after its {ev.event} event (step {ev.step})" if ev else "(the moment did not come)"
        return f"killed rank {rank} of {job.job_id} on {launch.nodes[rank]} {where}"

    # ---------------------------------------------------------------- replicators

    def _replicator_kill(self, f: Fault, fid: int, job: JobRun) -> str:
        name = job.node_of(f.slot)
        if f.mode == "staging":
            return self._kill_while_staging(f, fid, job, name)
        if f.mode == "backup":
            return self._kill_while_backing_up(f, fid, job, name)
        return self._kill_while_sending(f, fid, job, name)

    def _kill_replicator(self, node: Node, f: Fault) -> str:
        how = "stopped (SIGTERM: backs up, then exits)" if f.graceful else "killed (SIGKILL)"
        if f.graceful:
            try:
                node.stop_replicator(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:  # stop_replicator killed it
                self.run.violate(
                    "liveness",
                    "",
                    f"{node.name}'s replicator did not exit within {STOP_TIMEOUT:.0f} s of SIGTERM "
                    "(its preemption backup is bounded by 10 s); killed",
                )
                how = "given SIGTERM, did not exit, killed"
        else:
            node.kill_replicator()
        time.sleep(f.value / 1000)
        node.start_replicator()
        return f"{node.name}'s replicator {how}, back after {f.value} ms"

    def _kill_while_sending(self, f: Fault, fid: int, job: JobRun, name: str) -> str:
        node = self.rig.node(name)
        self._effect(fid, name, NetState(rate_out=THROTTLE_KBIT))
        try:
            self._next_save(job, name)
            receiver = self._wait(lambda: self._receiving(job, name), MOMENT_TIMEOUT)
            if f.mode == "receive":
                target = self.rig.node(receiver) if receiver else node
                what = f"receiving from {name}" if receiver else "(no transfer seen in flight)"
            else:
                target = node
                what = f"sending to {receiver}" if receiver else "(no transfer seen in flight)"
            return f"{self._kill_replicator(target, f)}, {what}"
        finally:
            self.clear(fid)

    def _kill_while_backing_up(self, f: Fault, fid: int, job: JobRun, name: str) -> str:
        node = self.rig.node(name)
        self._effect(fid, name, NetState(rate_out=THROTTLE_KBIT))
        try:
            self.run.operator.backup_in_background(job)
            writing = self._wait(lambda: self._writer_lease(job, name), MOMENT_TIMEOUT)
            what = "while it held a writer lease in the bucket" if writing else "(no upload of it seen)"
            return f"{self._kill_replicator(node, f)}, {what}"
        finally:
            self.clear(fid)

    def _kill_while_staging(self, f: Fault, fid: int, job: JobRun, name: str) -> str:
        """The node is lost and comes back empty; its replicator dies while it stages the restore."""
        node = self.rig.node(name)
        lost = self._lose([name], job)
        self._effect(fid, name, NetState(rate_in=THROTTLE_KBIT))
        seen: dict[str, str] = {}

        def staging_then_kill(restarted: JobRun) -> None:
            ranks = [r for r, n in enumerate(restarted.nodes) if n == name]
            staged = self._wait(lambda: self._staging(node, restarted.job_id, ranks), MOMENT_TIMEOUT)
            seen["what"] = "while it staged" if staged else "(no staging seen)"
            seen["kill"] = self._kill_replicator(node, f)
            self.clear(fid)

        for j in lost:
            if j is job:
                j.on_plan.append(staging_then_kill)
        self.run.restart(job)
        if "kill" not in seen:
            self.clear(fid)
            return f"{name} lost; its replicator was not killed: {job.job_id} did not restart"
        return f"{name} lost and back empty; {seen['kill']}, {seen['what']}"

    def _next_save(self, job: JobRun, name: str) -> None:
        launch = job.launch
        if launch is None or name not in launch.nodes:
            return
        rank = launch.nodes.index(name)
        launch.wait_event(rank, ("saved",), len(launch.read()[rank]), MOMENT_TIMEOUT)

    def _receiving(self, job: JobRun, sender: str) -> str | None:
        """A node with a transfer of one of ``sender``'s ranks staged (``.incoming-*``)."""
        ranks = [r for r, n in enumerate(job.nodes) if n == sender]
        for node in self.rig.nodes:
            if node.name == sender:
                continue
            for rank in ranks:
                where = job_dir(node.root, job.job_id) / "replicas" / f"rank-{rank:05d}"
                with contextlib.suppress(OSError):
                    if any(p.name.startswith(".incoming-") for p in where.iterdir()):
                        return node.name
        return None

    def _writer_lease(self, job: JobRun, name: str) -> bool:
        prefix = self.run.bucket.layout.writers_dir(job.job_id)
        blobs = self.run.bucket.bucket.client.list_blobs(self.run.bucket.bucket, prefix=prefix)
        return any(f"/{name}." in b.name for b in blobs)

    def _staging(self, node: Node, job: str, ranks: list[int]) -> bool:
        for rank in ranks:
            try:
                st = read_restore_status(node.root, job, rank)
            except FormatError:
                continue
            if st is not None and st.state == RestoreState.STAGING:
                return True
        return False

    @staticmethod
    def _wait(predicate: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.01)
        return None

    # ---------------------------------------------------------------- nodes

    def _node_lost(self, f: Fault, fid: int, job: JobRun) -> str:
        name = job.node_of(f.slot)
        self._lose([name], job, f)
        return f"{name} lost{self._comeback(f)}"

    def _nodes_lost(self, f: Fault, fid: int, job: JobRun) -> str:
        first = job.nodes.index(job.node_of(f.slot))
        if job.world < 2:
            return "skipped: the job has one node"
        if f.mode == "peer-group" and job.peers and job.peers[first]:
            second = job.nodes[job.peers[first][0]]
        else:
            second = job.nodes[other_slot(first, f.other, job.world)]
        group = " (a whole peer group)" if f.mode == "peer-group" and job.peers else ""
        self._lose([job.nodes[first], second], job, f)
        return f"{job.nodes[first]} and {second} lost at once{group}{self._comeback(f)}"

    @staticmethod
    def _comeback(f: Fault) -> str:
        name = "under its own name" if f.back == "same" else "and replaced by another node"
        return f", back empty {name}, {'in another' if f.domain == 'other' else 'in the same'} failure domain"

    def _lose(self, names: list[str], job: JobRun, f: Fault | None = None) -> list[JobRun]:
        """Lose ``names`` at once: every job on them crashes, their replicators die, their ramdisks are
        wiped; each comes back empty (in another domain if ``f`` says so), and with ``f.back == "new"``
        another node takes its place in each job."""
        hit = [j for j in self.run.jobs.values() if any(n in j.nodes for n in names)]
        for j in hit:
            self.run.crash(j, f"lost {', '.join(names)}")
        for name in names:
            node = self.rig.node(name)
            node.kill_replicator()
            for fid in [fid for fid, (held, _) in self.fillers.items() if held == name]:
                self.fillers.pop(fid)
            node.wipe_ramdisk()
            if f is not None and f.domain == "other":
                node.domain = self.run.other_domain(node.domain)
            node.start_replicator()
        if f is not None and f.back == "new":
            for j in hit:
                for name in names:
                    if name in j.nodes:
                        spare = self.run.spare_for(j, name, same_domain=f.domain == "same", avoid=names)
                        if spare is not None:
                            j.nodes = [spare if n == name else n for n in j.nodes]
        return hit

    # ---------------------------------------------------------------- network

    def _partition(self, f: Fault, fid: int, job: JobRun) -> str:
        name = job.node_of(f.slot)
        if f.mode == "one-way":
            if job.world < 2:
                return "skipped: the job has one node"
            source = job.nodes[other_slot(job.nodes.index(name), f.other, job.world)]
            self._effect(fid, name, NetState(refuse_from={source}))
            return f"{name} drops new connections from {source} (it still reaches {source})"
        others = {n.name for n in self.rig.nodes if n.name != name}
        self._effect(fid, name, NetState(cut_from=others, cut_from_bucket=True))
        return f"{name} cut off from every other node and from the bucket"

    def _netem(self, f: Fault, fid: int, job: JobRun) -> str:
        name = job.node_of(f.slot)
        if f.mode == "loss":
            self._effect(fid, name, NetState(loss=f.value))
            return f"{name} loses {f.value}% of its replicator and bucket packets"
        if f.mode == "delay":
            self._effect(fid, name, NetState(delay_ms=f.value))
            how = "netem" if self.rig.netem else "queueing in a token bucket (no netem in this kernel)"
            return f"{name}'s incoming packets delayed up to {f.value} ms ({how})"
        self._effect(fid, name, NetState(rate_in=f.value, rate_out=f.value))
        return f"{name}'s link limited to {f.value} kbit/s both ways"

    def _slow_peer(self, f: Fault, fid: int, job: JobRun) -> str:
        name = job.node_of(f.slot)
        self._effect(fid, name, NetState(rate_in=f.value))
        return f"{name} receives at {f.value} kbit/s"

    def _full_ramdisk(self, f: Fault, fid: int, job: JobRun) -> str:
        node = self.rig.node(job.node_of(f.slot))
        try:
            self.fillers[fid] = (node.name, node.fill_ramdisk(LEAVE_BYTES))
        except OSError as exc:
            return f"skipped: could not fill {node.name}'s ramdisk: {exc}"
        return f"{node.name}'s ramdisk filled ({LEAVE_BYTES >> 10} KiB left)"

    def _gcs(self, f: Fault, fid: int, job: JobRun) -> str:
        times = max(1, f.value)
        if f.mode in ("429", "500", "503"):
            rule = FaultRule(action="status", status=int(f.mode), times=times)
            what = f"the next {times} bucket requests answered {f.mode}"
        elif f.mode == "reset-upload":
            rule = FaultRule(
                action="reset_midway", method="POST", path="upload", after_bytes=200, times=times
            )
            what = f"the next {times} uploads reset after 200 bytes"
        elif f.mode == "reset-download":
            rule = FaultRule(
                action="cut_response", method="GET", path="alt=media", after_bytes=100, times=times
            )
            what = f"the next {times} downloads cut after 100 bytes"
        else:
            rule = FaultRule(action="delay", seconds=2.0, times=2 * times)
            what = f"the next {2 * times} bucket requests delayed 2 s"
        self.rules[fid] = self.rig.proxy.add_rule(rule)
        return what

    # ---------------------------------------------------------------- the jobs

    def _purge(self, f: Fault, fid: int, job: JobRun) -> str:
        return self.run.purge(job)

    def _replication_factor(self, f: Fault, fid: int, job: JobRun) -> str:
        before, job.factor = job.factor, f.value
        if before == f.value:
            return f"{job.job_id}'s replication factor set to {f.value} again (no change)"
        self.run.operator.publish_policy(job, changed=True)
        return f"{job.job_id}'s replication factor {before} -> {f.value}"

    def _resize(self, f: Fault, fid: int, job: JobRun) -> str:
        if f.mode == "grow":
            if job.world >= 4:
                return f"skipped: {job.job_id} already runs on {job.world} nodes"
            spare = self.run.spare_for(job, None, same_domain=False, avoid=[])
            if spare is None:
                return "skipped: no node to grow onto"
            self.run.crash(job, f"grows onto {spare}")
            job.nodes = [*job.nodes, spare]
            return f"{job.job_id} grows to {job.world} nodes (+{spare}), resharded"
        if job.world <= 2:
            return f"skipped: {job.job_id} runs on {job.world} nodes"
        name = job.node_of(f.slot)
        self.run.crash(job, f"shrinks without {name}")
        job.nodes = [n for n in job.nodes if n != name]
        return f"{job.job_id} shrinks to {job.world} nodes (without {name}, which keeps its data), resharded"
