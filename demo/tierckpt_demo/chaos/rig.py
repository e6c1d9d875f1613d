"""The machines of a chaos run: a ``LocalCluster`` of network-namespace nodes with tmpfs ramdisks, real
replicators (mutual TLS) and fake-gcs-server behind a ``FaultProxy``, one training launcher per node,
and the node-level network effects the faults switch on and off.

Network effects are kept per node as a ``NetState`` and applied whole (``Rig.apply``): the node's
firewall (nft, in its namespace) and its link shaping (``tc tbf``, or ``netem`` where the kernel has
it) are rebuilt from the state, so overlapping faults on one node add up and clearing one leaves the
others in force. Rules and shaping match the replicators' ports and the bucket's only: the training
processes' own collectives are neither partitioned nor slowed (a partition of training kills the job,
which the trainer faults cover), nor is the operator's control connection (the operator sees a
partitioned node; it is the nodes that cannot see each other). Where the kernel has no ``netem`` (this
development VM), a delay is a rate at which a 64 KiB window takes that long: queueing, not latency.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from tierckpt_demo.cluster import API_PORT, FAST_REPLICATOR_ARGS, LocalCluster, Node
from tierckpt_demo.launcher import Launcher, node_files_prefix

__all__ = ["CHAOS_REPLICATOR_ARGS", "MODULES", "NetState", "Rig"]

log = logging.getLogger(__name__)

CHAOS_REPLICATOR_ARGS = (*FAST_REPLICATOR_ARGS, "--backup-group-wait", "5", "--preemption-timeout", "10")
"""The e2e tests' short intervals, and a replica group's members waited for at most 5 s."""

MODULES = ("tierckpt_demo.training", "tierckpt_demo.dcp_training")
PORTS = (API_PORT, API_PORT + 1)
"""The replicators' control and data ports (every node uses the same ones, in its own namespace)."""


@dataclasses.dataclass
class NetState:
    """What the faults in force do to one node's network."""

    cut_from: set[str] = dataclasses.field(default_factory=set)
    """Nodes it exchanges no replicator traffic with (either way)."""
    cut_from_bucket: bool = False
    refuse_from: set[str] = dataclasses.field(default_factory=set)
    """Nodes whose new connections it drops (one way: it still reaches them)."""
    loss: int = 0
    """Percent of its replicator and bucket packets dropped."""
    rate_in: int = 0
    """kbit/s of its incoming link (0: unlimited)."""
    rate_out: int = 0
    delay_ms: int = 0

    def merge(self, other: NetState) -> NetState:
        def low(a: int, b: int) -> int:
            return min(x for x in (a, b) if x) if a or b else 0

        return NetState(
            self.cut_from | other.cut_from,
            self.cut_from_bucket or other.cut_from_bucket,
            self.refuse_from | other.refuse_from,
            max(self.loss, other.loss),
            low(self.rate_in, other.rate_in),
            low(self.rate_out, other.rate_out),
            max(self.delay_ms, other.delay_ms),
        )


class Rig:
    """The cluster, its launchers and its network effects; ``close()`` tears everything down."""

    def __init__(self, workdir: Path, *, nodes: int = 5, domains: int = 2, ramdisk: str = "96m") -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.cluster = LocalCluster(
            nodes,
            job="chaos-static",
            k=1,
            ramdisk_size=ramdisk,
            gcs=True,
            count_gcs_reads=True,
            domains=domains,
            netns=True,
            replicator_args=CHAOS_REPLICATOR_ARGS,
        )
        self.ramdisk_bytes = _size(ramdisk)
        self.launchers: dict[str, Launcher] = {}
        self._applied: dict[str, NetState] = {}
        try:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
            prefix = node_files_prefix(workdir, self.cluster.nodes)
            for node in self.cluster.nodes:
                self.launchers[node.name] = Launcher(partial(node.popen_in_node, env=env), prefix, MODULES)
            self.netem = _has_netem(self.cluster.nodes[0])
        except BaseException:
            self.close()
            raise

    @property
    def nodes(self) -> list[Node]:
        return list(self.cluster.nodes)

    def node(self, name: str) -> Node:
        return self.cluster.node(name)

    @property
    def proxy(self) -> Any:
        """The ``FaultProxy`` in front of the bucket (every replicator goes through it)."""
        return self.cluster.gcs_proxy

    def bucket(self) -> Any:
        """The bucket, reached directly (not through the proxy: the checks see no injected fault)."""
        return self.cluster.gcs.client().bucket(self.cluster.bucket)

    def wait_launchers(self, timeout: float) -> None:
        for launcher in self.launchers.values():
            launcher.wait_ready(timeout)

    def close(self) -> None:
        def close(launcher: Launcher) -> None:
            with contextlib.suppress(Exception):
                launcher.close()

        with ThreadPoolExecutor(max(1, len(self.launchers))) as pool:  # each waits up to 10 s for its exit
            list(pool.map(close, self.launchers.values()))
        self.cluster.close()

    # ---------------------------------------------------------------- network effects

    def apply(self, states: dict[str, NetState]) -> None:
        """Make every node's network what ``states`` says (nodes not named: untouched by faults)."""
        for node in self.cluster.nodes:
            want = states.get(node.name, NetState())
            if self._applied.get(node.name, NetState()) == want:
                continue
            node.firewall(self._rules(want))
            self._shape(node, want)
            self._applied[node.name] = want

    def _rules(self, s: NetState) -> list[str]:
        ports = "{ " + ", ".join(str(p) for p in PORTS) + " }"
        rules = []
        for name in sorted(s.cut_from):
            ip = self.node(name).ip
            rules += [f"ip saddr {ip} tcp dport {ports} drop", f"ip saddr {ip} tcp sport {ports} drop"]
        proxy = self.proxy
        if s.cut_from_bucket:
            rules.append(f"ip saddr {proxy.host} tcp sport {proxy.port} drop")
        for name in sorted(s.refuse_from - s.cut_from):
            rules.append(f"ip saddr {self.node(name).ip} tcp dport {ports} ct state new drop")
        if s.loss:
            for match in (
                f"tcp dport {ports}",
                f"tcp sport {ports}",
                f"ip saddr {proxy.host} tcp sport {proxy.port}",
            ):
                rules.append(f"{match} numgen random mod 100 < {s.loss} drop")
        return rules

    def _shape(self, node: Node, s: NetState) -> None:
        node.unlimit_rate()
        node.unlimit_rate(outgoing=True)
        ports = [*PORTS, self.proxy.port]
        if s.delay_ms and self.netem:
            rate = [] if not s.rate_in else ["rate", f"{s.rate_in}kbit"]
            _tc(
                [
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    node.veth,
                    "root",
                    "netem",
                    "delay",
                    f"{s.delay_ms}ms",
                    *rate,
                ]
            )
        elif s.delay_ms or s.rate_in:
            node.shape_ports(min(x for x in (s.rate_in, _queueing(s.delay_ms)) if x), ports)
        if s.rate_out:
            node.shape_ports(s.rate_out, ports, outgoing=True)


def _queueing(delay_ms: int) -> int:
    """Without netem: the rate (kbit/s) at which a 64 KiB window takes ``delay_ms`` to pass, so that
    transfers see about that much delay (0: none)."""
    return 64 * 8 * 1000 // delay_ms if delay_ms else 0


def _tc(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def _has_netem(node: Node) -> bool:
    """Whether this kernel has the netem qdisc (tried on the node's loopback, then removed)."""
    proc = node.run_in_node(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"])
    if proc.returncode != 0:
        log.info("no netem in this kernel (%s): delays are emulated by queueing", proc.stderr.strip())
        return False
    node.run_in_node(["tc", "qdisc", "del", "dev", "lo", "root"])
    return True


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    return int(text[:-1]) * units[text[-1].lower()] if text[-1].lower() in units else int(text)
