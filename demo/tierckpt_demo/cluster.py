"""A local multi-node cluster on one machine: real replicator processes, one ramdisk per node.

As root, each node is a network namespace on a private bridge (veth pairs, a /24 of its own), with its
own tmpfs mounted as its ramdisk and its own ``tierckpt-replicator`` process started through the
console script; an optional fake-gcs-server listens on the bridge, reachable from every node. Without
root, nodes are loopback ports and plain directories (no link faults then)::

    with LocalCluster(nodes=3, job="demo", gcs=True) as cluster:
        a, b, c = cluster.nodes
        write a step under a.root ...          # the client's format
        cluster.wait_for(lambda: ...)          # replicas appear under b.root/<job>/replicas/
        a.kill_replicator(); a.wipe_ramdisk()  # node lost
        a.restart_replicator()                 # a replaced node: stages its ranks back

Every name is unique per run (the owner's pid is part of it), everything is torn down on exit, on
exceptions and on Ctrl-C, and ``cleanup_stale()`` removes what a killed run left behind. Peers default
to a ring (node i sends to the next ``k`` nodes).

Credentials, as on Kubernetes (``auth="tls"``, the default): the cluster makes a CA in its workdir
(``cluster.ca``), a certificate for each node (its key in a 0600 file) and one for the operator's role,
which the cluster's API client (``cluster.api``) presents; every control and data connection is mutual
TLS. ``cluster.issue(name)`` makes more (say, a node certificate for an attacker's test).
``auth="token"`` runs the legacy shared-token mode instead (``cluster.token``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import ipaddress
import logging
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from tierckpt.protocol.certs import Authority, new_key, write_identity
from tierckpt.protocol.client import SyncReplicatorClient
from tierckpt.protocol.control import PeerAssignment, PeerNode
from tierckpt.protocol.identity import TlsCredentials, TlsFiles
from tierckpt.protocol.tokens import TokenFile
from tierckpt_demo.ports import free_ports
from tierckpt_demo.tmpfs import mount_tmpfs, unmount

__all__ = ["FAST_REPLICATOR_ARGS", "LocalCluster", "Node", "cleanup_stale", "has_netns"]

log = logging.getLogger(__name__)

API_PORT = 8470
FAST_REPLICATOR_ARGS = (
    *("--poll-interval", "1", "--reconcile-interval", "2"),
    *("--connect-timeout", "1", "--transfer-timeout", "3", "--retry-max", "2"),
    *("--inventory-timeout", "2", "--restore-attempts", "4"),
    *("--backup-interval", "0", "--backup-poll-interval", "2", "--backup-takeover-after", "2"),
    *("--reserve-bytes", str(1 << 20), "--log-level", "INFO"),
)
"""Every interval short, so failures are noticed and retried within seconds: the e2e tests' and the
chaos harness's replicators (each adds its own ``--preemption-timeout``)."""
CERT_LIFETIME = datetime.timedelta(days=7)
_RANK_OBJECT = re.compile(r"/steps/[0-9]{12,}/rank-[0-9]{5,}/")
"""An object of one rank's step in the bucket (``tierckpt.protocol.bucket_layout``)."""
_PREFIX = "tck"
_WORKDIR_PREFIX = "tierckpt-cluster-"


def has_netns() -> bool:
    """Namespaces, veth, bridges and tmpfs mounts are available (root with iproute2)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _replicator_command() -> list[str]:
    script = Path(sys.executable).parent / "tierckpt-replicator"
    if script.exists():
        return [str(script)]
    found = shutil.which("tierckpt-replicator")
    if found is None:
        raise RuntimeError(
            "the tierckpt-replicator console script is not installed (pip install 'tierckpt[replicator]')"
        )
    return [found]


# ------------------------------------------------------------------------------------------ nodes


class Node:
    """One simulated node: its ramdisk, its replicator process and its network."""

    def __init__(
        self, cluster: LocalCluster, index: int, *, ip: str, api_port: int, data_port: int, probe_port: int
    ) -> None:
        self.cluster, self.index = cluster, index
        self.name = f"node-{index}"
        self.ip, self.api_port, self.data_port, self.probe_port = ip, api_port, data_port, probe_port
        self.dir = cluster.workdir / self.name
        self.root = self.dir / "ramdisk"
        self.log_path = self.dir / "replicator.log"
        self.netns = f"{cluster.prefix}-n{index}" if cluster.netns else None
        self.veth = f"{cluster.prefix}n{index}"  # host side, <= 15 chars
        self.domain = cluster.domain_of(index)
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra_args: list[str] = []

    def __repr__(self) -> str:
        return f"Node({self.name}, {self.ip})"

    @property
    def endpoint(self) -> str:
        """The control API base URL."""
        return f"{self.cluster.scheme}://{self.ip}:{self.api_port}"

    @property
    def tls_files(self) -> TlsFiles:
        """The node's certificate (with its key) and the CA bundle (``auth="tls"``)."""
        return self.cluster.identity_files(self.name)

    @property
    def probe_endpoint(self) -> str:
        """The base URL of /healthz, /readyz and /metrics (the probe server)."""
        return f"http://{self.ip}:{self.probe_port}"

    @property
    def peer_endpoint(self) -> str:
        """The endpoint as peers.json lists it (the data port is explicit when it is not api + 1)."""
        if self.data_port == self.api_port + 1:
            return self.endpoint
        return f"{self.endpoint}/?data={self.data_port}"

    # ---------------------------------------------------------------- processes

    def _wrap(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else list(cmd)

    def run_in_node(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run a command inside the node's network namespace (plainly without namespaces)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self._wrap(cmd), **kwargs)

    def popen_in_node(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self._wrap(cmd), **kwargs)

    def replicator_args(self) -> list[str]:
        c = self.cluster
        if c.auth == "tls":
            files = self.tls_files
            auth = ["--auth", "tls", "--tls-ca", str(files.ca), "--tls-cert", str(files.cert)]
        else:
            auth = ["--auth", "token", "--token-file", str(c.token_file)]
        args = [
            "--node-name",
            self.name,
            "--root",
            str(self.root),
            *auth,
            "--listen-host",
            "0.0.0.0" if self.netns else "127.0.0.1",
            "--api-port",
            str(self.api_port),
            "--data-port",
            str(self.data_port),
            "--probe-port",
            str(self.probe_port),
            "--advertise-host",
            self.ip,
            "--peers-file",
            str(c.peers_file),
            "--replicas",
            str(c.k),
            "--domain",
            self.domain,
        ]
        if c.gcs is not None:
            args += ["--gcs-bucket", c.bucket, "--gcs-endpoint", c.gcs_url]
        return args + list(c.replicator_args) + self.extra_args

    def start_replicator(self, *, wait: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name}: the replicator is already running")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.cluster.env}
        with open(self.log_path, "ab") as logf:
            logf.write(f"---- start {time.strftime('%H:%M:%S')}\n".encode())
            self.proc = self.popen_in_node(
                list(self.cluster.replicator_command(self, self.replicator_args())),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        if wait:
            self.wait_ready()

    def kill_replicator(self, sig: int = signal.SIGKILL) -> None:
        """Kill the replicator and its worker at once (a lost node), by their process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_replicator(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful: preemption backup, then exit); returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        finally:
            self.kill_replicator()
        return proc.returncode

    def restart_replicator(self, *, wait: bool = True) -> None:
        self.kill_replicator()
        self.start_replicator(wait=wait)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: replicator exited with {self.proc.returncode}:\n{self.log_text()}"
                )
            if self._probe_ready():
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: replicator not ready after {timeout}s:\n{self.log_text()}")

    def _probe_ready(self) -> bool:
        return self.cluster.api.ready(self.endpoint, timeout=1.0, node=self.name)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # ---------------------------------------------------------------- ramdisk

    def wipe_ramdisk(self) -> None:
        """Remove everything in the node's ramdisk (the tmpfs stays mounted)."""
        for child in self.root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def fill_ramdisk(self, leave_bytes: int) -> Path:
        """Fill the ramdisk until ``leave_bytes`` are free; returns the filler (delete it to undo)."""
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        path = self.root / ".filler"
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(0, free - leave_bytes))
        return path

    # ---------------------------------------------------------------- network faults

    def cut_link(self) -> None:
        """Take the node's link down: every peer gets ENETUNREACH / timeouts at once."""
        self._need_netns("cut_link")
        _run(["ip", "link", "set", self.veth, "down"])

    def restore_link(self) -> None:
        self._need_netns("restore_link")
        _run(["ip", "link", "set", self.veth, "up"])

    def limit_rate(
        self, rate: str, *, outgoing: bool = False, burst: str = "256kb", latency: str = "400ms"
    ) -> None:
        """Shape the node's incoming link (``outgoing``: its outgoing one) to ``rate`` (``tc tbf``, e.g.
        ``"50mbit"``): a slow peer, or a node whose uploads crawl. Packets wait up to ``latency`` in the
        queue (then they are dropped), so a small ``burst`` and a long ``latency`` also delay them."""
        self._need_netns("limit_rate")
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        if outgoing:
            _run(["tc", "-n", str(self.netns), "qdisc", "replace", "dev", "eth0", *tbf])
        else:
            _run(["tc", "qdisc", "replace", "dev", self.veth, *tbf])

    def unlimit_rate(self, *, outgoing: bool = False) -> None:
        self._need_netns("unlimit_rate")
        if outgoing:
            _run(["tc", "-n", str(self.netns), "qdisc", "del", "dev", "eth0", "root"], check=False)
        else:
            _run(["tc", "qdisc", "del", "dev", self.veth, "root"], check=False)

    def shape_ports(self, rate_kbit: int, ports: Sequence[int], *, outgoing: bool = False) -> None:
        """Shape only the TCP traffic to or from ``ports`` on the node's incoming link (``outgoing``: its
        outgoing one) to ``rate_kbit`` (``tc htb``, a ``u32`` filter per port and direction); other
        traffic (say, training's collectives) passes at full speed. ``unlimit_rate`` removes it."""
        self._need_netns("shape_ports")
        tc = ["tc", "-n", str(self.netns)] if outgoing else ["tc"]
        dev = "eth0" if outgoing else self.veth
        rate = f"{int(rate_kbit)}kbit"
        _run([*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
        _run([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit"])
        _run(
            [
                *tc,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "classid",
                "1:2",
                "htb",
                "rate",
                rate,
                "ceil",
                rate,
            ]
        )
        for port in ports:
            for end in ("dport", "sport"):
                match = ["match", "ip", end, str(int(port)), "0xffff"]
                _run(
                    [
                        *tc,
                        "filter",
                        "add",
                        "dev",
                        dev,
                        "parent",
                        "1:",
                        "protocol",
                        "ip",
                        "prio",
                        "1",
                        "u32",
                        *match,
                        "flowid",
                        "1:2",
                    ]
                )

    def drop_port(self, port: int, *, source: Node | None = None) -> None:
        """Silently drop incoming TCP to ``port`` inside the node (nft), from every node or only from
        ``source``: connects time out. Rules add up until ``clear_drops()``."""
        self._need_netns("drop_port")
        match = f"ip saddr {ipaddress.ip_address(source.ip)} " if source is not None else ""
        script = (
            "add table inet tierckpt\n"
            "add chain inet tierckpt input { type filter hook input priority 0; policy accept; }\n"
            f"add rule inet tierckpt input {match}tcp dport {int(port)} drop\n"
        )
        proc = self.run_in_node(["nft", "-f", "-"], input=script)
        if proc.returncode != 0:
            raise RuntimeError(f"nft failed: {proc.stderr}")

    def clear_drops(self) -> None:
        self._need_netns("clear_drops")
        self.run_in_node(["nft", "delete", "table", "inet", "tierckpt"])

    def firewall(self, rules: Sequence[str]) -> None:
        """Replace the node's incoming firewall (the nft table of ``drop_port``) with ``rules``, each the
        body of one rule of its input hook (``"ip saddr 10.1.2.3 tcp dport 8471 ct state new drop"``);
        no rules: none at all."""
        self._need_netns("firewall")
        self.clear_drops()
        if not rules:
            return
        script = (
            "add table inet tierckpt\n"
            "add chain inet tierckpt input { type filter hook input priority 0; policy accept; }\n"
        ) + "".join(f"add rule inet tierckpt input {rule}\n" for rule in rules)
        proc = self.run_in_node(["nft", "-f", "-"], input=script)
        if proc.returncode != 0:
            raise RuntimeError(f"nft failed: {proc.stderr}")

    def _need_netns(self, what: str) -> None:
        if not self.netns:
            raise RuntimeError(f"{what} needs network namespaces (run as root)")


# ------------------------------------------------------------------------------------------ cluster


class LocalCluster:
    """``nodes`` nodes; see the module docstring. ``netns=None`` uses namespaces when running as root.

    ``job``: the job the static peers file names (others are assigned with ``assign(job)``).
    ``k``: replicas per rank. ``procs_per_node``: process ranks per node (node i holds ranks
    ``i*p .. i*p+p-1``). ``ramdisk_size``: tmpfs size per node (``mount -o size=``). ``gcs``: start a
    fake-gcs-server (memory backend) with bucket ``bucket``. ``domains``: number of failure domains the
    nodes are spread over round-robin (0: none). ``replicator_args``: extra flags for every replicator.
    ``auth``: "tls" (a CA and certificates in the workdir; mutual TLS everywhere) or "token" (legacy).
    ``replicator_command(node, args)``: the command line that runs a node's replicator with ``args`` (say
    in a container of the built image, tests/images); by default this Python's ``tierckpt-replicator``.
    """

    def __init__(
        self,
        nodes: int = 2,
        *,
        job: str = "demo",
        k: int = 1,
        procs_per_node: int = 1,
        ramdisk_size: str = "256m",
        gcs: bool = False,
        bucket: str = "tierckpt",
        domains: int = 0,
        netns: bool | None = None,
        replicator_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        auth: str = "tls",
        start: bool = True,
        count_gcs_reads: bool = False,
        replicator_command: Callable[[Node, list[str]], Sequence[str]] | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if auth not in ("tls", "token"):
            raise ValueError("auth must be 'tls' or 'token'")
        self.auth = auth
        self.size, self.job, self.k, self.procs_per_node = nodes, job, k, procs_per_node
        self.ramdisk_size, self.bucket, self.domains = ramdisk_size, bucket, domains
        self.netns = has_netns() if netns is None else netns
        if self.netns and not has_netns():
            raise RuntimeError("network namespaces need root and iproute2")
        self.replicator_args = tuple(replicator_args)
        self.replicator_command = replicator_command or (lambda node, args: [*_replicator_command(), *args])
        self.env = dict(env or {})
        self.prefix = f"{_PREFIX}{os.getpid() % 100000}{secrets.token_hex(1)}"
        self.token = secrets.token_urlsafe(24)
        self._api: SyncReplicatorClient | None = None
        self.nodes: list[Node] = []
        self.gcs: Any = None
        self.gcs_proxy: Any = None
        """With ``count_gcs_reads``: the ``FaultProxy`` every replicator reaches the bucket through."""
        self._want_gcs = gcs
        self._count_gcs_reads = count_gcs_reads
        self._mounts: list[Path] = []
        self._namespaces: list[str] = []
        self._bridge: str | None = None
        self._closed = False
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-"))
        self.token_file = self.workdir / "token"
        self.peers_file = self.workdir / "peers.json"
        self.tls_dir = self.workdir / "tls"
        self.ca: Authority | None = None
        atexit.register(self.close)
        if start:
            self.start()

    @property
    def scheme(self) -> str:
        return "https" if self.auth == "tls" else "http"

    @property
    def api(self) -> SyncReplicatorClient:
        """The control API client (``tierckpt.protocol.client``) with the operator's credentials (the
        operator's certificate, or the cluster's token): call it with a node's ``endpoint``, e.g.
        ``cluster.api.status(node.endpoint, node=node.name)``."""
        if self._api is None:
            raise RuntimeError("the cluster is not started")
        return self._api

    def domain_of(self, index: int) -> str:
        return f"zone-{index % self.domains}" if self.domains else ""

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> LocalCluster:
        try:
            if self.auth == "tls":
                self._make_credentials()
                self._api = SyncReplicatorClient(
                    tls=TlsCredentials(self.identity_files("operator")), timeout=10.0
                )
            else:
                fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self.token + "\n")
                self._api = SyncReplicatorClient(token=TokenFile(self.token_file), timeout=10.0)
            if self.netns:
                stale = cleanup_stale()
                if stale:
                    log.info("removed leftovers of dead clusters: %s", stale)
                self._make_network()
            else:
                self._make_loopback_nodes()
            for node in self.nodes:
                self._make_ramdisk(node)
            if self._want_gcs:
                self._start_gcs()
            self.peers_file.write_bytes(self.assignment(self.job).to_bytes())
            for node in self.nodes:
                node.start_replicator(wait=False)
            for node in self.nodes:
                node.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Tear everything down; safe to call twice and after a partial start."""
        if self._closed:
            return
        self._closed = True
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.kill_replicator()
        if self._api is not None:
            self._api.close()
        if self.gcs is not None:
            with contextlib.suppress(Exception):
                self.gcs.stop()
        if self.gcs_proxy is not None:
            with contextlib.suppress(Exception):
                self.gcs_proxy.close()
        for mount in reversed(self._mounts):
            unmount(mount)
        for ns in self._namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        if self._bridge:
            _run(["ip", "link", "del", self._bridge], check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)

    # ---------------------------------------------------------------- credentials

    def _make_credentials(self) -> None:
        """The CA, and a certificate for every node and for the operator's role."""
        self.tls_dir.mkdir(mode=0o700)
        self.ca = Authority.create("tierckpt-demo-ca")
        (self.tls_dir / "ca.crt").write_bytes(self.ca.pem)
        for i in range(self.size):
            self.issue(f"node-{i}")
        self.issue("operator", role="operator")

    def identity_files(self, name: str) -> TlsFiles:
        """The files ``issue(name)`` wrote."""
        return TlsFiles(cert=self.tls_dir / f"{name}.pem", ca=self.tls_dir / "ca.crt")

    def issue(
        self, name: str, *, role: str = "node", lifetime: datetime.timedelta = CERT_LIFETIME
    ) -> TlsFiles:
        """A key and a certificate from the cluster's CA, in one 0600 file: for node ``name``, or (role
        "operator") the operator's client certificate."""
        if self.ca is None:
            raise RuntimeError("the cluster has no CA (auth='token')")
        key = new_key()
        if role == "operator":
            cert = self.ca.operator_certificate(key.public_key(), lifetime)
        else:
            cert = self.ca.node_certificate(key.public_key(), name, lifetime)
        files = self.identity_files(name)
        write_identity(files.cert, key, cert)
        return files

    # ---------------------------------------------------------------- building

    def _subnet(self) -> str:
        used = _run(["ip", "-o", "-4", "addr", "show"]).stdout + _run(["ip", "-4", "route"]).stdout
        for _ in range(200):
            net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
            if f"{net}." not in used:
                return net
        raise RuntimeError("no free 10.200-250.x.0/24 subnet for the cluster bridge")

    def _make_network(self) -> None:
        net = self._subnet()
        self.bridge_ip = f"{net}.1"
        self._bridge = f"{self.prefix}br"
        _run(["ip", "link", "add", self._bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self._bridge])
        _run(["ip", "link", "set", self._bridge, "up"])
        for i in range(self.size):
            node = Node(
                self,
                i,
                ip=f"{net}.{10 + i}",
                api_port=API_PORT,
                data_port=API_PORT + 1,
                probe_port=API_PORT + 2,
            )
            self.nodes.append(node)
            ns = node.netns
            assert ns is not None
            _run(["ip", "netns", "add", ns])
            self._namespaces.append(ns)
            _run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", node.veth, "master", self._bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{node.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "route", "add", "default", "via", self.bridge_ip])

    def _make_loopback_nodes(self) -> None:
        self.bridge_ip = "127.0.0.1"
        ports = free_ports(3 * self.size)
        for i in range(self.size):
            api, data, probe = ports[3 * i : 3 * i + 3]
            self.nodes.append(Node(self, i, ip="127.0.0.1", api_port=api, data_port=data, probe_port=probe))

    def _make_ramdisk(self, node: Node) -> None:
        node.root.mkdir(parents=True)
        if self.netns:
            mount_tmpfs(node.root, self.ramdisk_size, name=f"{self.prefix}-n{node.index}")
            self._mounts.append(node.root)

    def _start_gcs(self) -> None:
        from tierckpt_demo.fakegcs import FakeGcsServer, FaultProxy
        from tierckpt_demo.ports import free_port

        port = free_port(self.bridge_ip)
        if self._count_gcs_reads:
            self.gcs_proxy = FaultProxy((self.bridge_ip, port), host=self.bridge_ip)
        url = self.gcs_proxy.url if self.gcs_proxy is not None else None
        self.gcs = FakeGcsServer(host=self.bridge_ip, port=port, external_url=url).start()
        self.gcs.create_bucket(self.bucket)

    @property
    def gcs_url(self) -> str:
        """Where the replicators reach the bucket (through the counting proxy when there is one)."""
        return str(self.gcs_proxy.url if self.gcs_proxy is not None else self.gcs.url)

    def bucket_rank_reads(self, since: float, until: float | None = None) -> int:
        """Downloads of ranks' step objects (data files, manifests, COMMITs) by the replicators between
        ``since`` and ``until`` (wall clock); 0 without ``count_gcs_reads``."""
        if self.gcs_proxy is None:
            return 0
        end = time.time() if until is None else until
        return sum(
            1
            for hit in self.gcs_proxy.hits
            if hit.method == "GET"
            and since <= hit.at <= end
            and "alt=media" in hit.target
            and _RANK_OBJECT.search(unquote(hit.target))
        )

    # ---------------------------------------------------------------- assignments

    def assignment(
        self,
        job: str,
        generation: int = 1,
        node_ranks: dict[str, int] | None = None,
        peers: dict[str, tuple[str, ...]] | None = None,
        attempt: int | None = None,
    ) -> PeerAssignment:
        """A ring: node i sends to the next ``k`` nodes (unless ``peers`` are given); node i has node
        rank i (unless given). Its restart ``attempt`` (a restore plan's generation) is the generation
        unless given."""
        names = [n.name for n in self.nodes]
        if peers is None:
            peers = {
                name: tuple(names[(i + d) % len(names)] for d in range(1, min(self.k, len(names) - 1) + 1))
                for i, name in enumerate(names)
            }
        return PeerAssignment(
            job=job,
            generation=generation,
            nodes={
                n.name: PeerNode(name=n.name, endpoint=n.peer_endpoint, domain=n.domain) for n in self.nodes
            },
            peers=peers,
            node_ranks=node_ranks if node_ranks is not None else {n.name: n.index for n in self.nodes},
            procs_per_node=self.procs_per_node,
            attempt=generation if attempt is None else attempt,
        )

    def assign(self, job: str, generation: int = 1, **kwargs: Any) -> PeerAssignment:
        """Send a peer assignment for ``job`` to every running node (as the operator would)."""
        assignment = self.assignment(job, generation, **kwargs)
        for node in self.nodes:
            if node.running:
                self.api.put_peers(node.endpoint, assignment, node=node.name)
        return assignment

    def ranks_of(self, node: Node) -> range:
        p = self.procs_per_node
        return range(node.index * p, (node.index + 1) * p)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    @staticmethod
    def wait_for(
        predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05, what: str = ""
    ) -> Any:
        """Poll ``predicate`` until it returns something truthy; ``TimeoutError`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")
            time.sleep(interval)


# ------------------------------------------------------------------------------------------ leftovers

_STALE_NS = re.compile(rf"^({_PREFIX}(\d+)[0-9a-f]{{2}})-n\d+$")


def cleanup_stale() -> list[str]:
    """Remove namespaces, bridges, mounts and workdirs of clusters whose owner process is gone."""
    if not has_netns():
        return []
    removed = []
    tmp = Path(tempfile.gettempdir())
    for mount in _run(["findmnt", "-rn", "-o", "TARGET", "-t", "tmpfs"], check=False).stdout.split():
        m = re.search(rf"/{_WORKDIR_PREFIX}(\d+)-", mount)
        if m and not _alive(int(m.group(1))):
            _run(["umount", "-l", mount], check=False)
            removed.append(mount)
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _STALE_NS.match(name)
        if m and not _alive_prefix(m.group(2)):
            _run(["ip", "netns", "del", name], check=False)
            _run(["ip", "link", "del", f"{m.group(1)}br"], check=False)
            removed.append(name)
    for d in tmp.glob(f"{_WORKDIR_PREFIX}*"):
        m = re.match(rf"{_WORKDIR_PREFIX}(\d+)-", d.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _alive_prefix(pid_mod: str) -> bool:
    """Whether any running process has a pid matching this cluster prefix (pid % 100000)."""
    want = int(pid_mod)
    return any(int(p) % 100000 == want for p in os.listdir("/proc") if p.isdigit())
