"""Benchmark the replicator on a real multi-node cluster on this machine (``tierckpt_demo.cluster``).

Measured in the same run, between the same network namespaces (root) or over loopback (otherwise, or
``--loopback``), each with the CPU-seconds per GiB that the receiving and the sending side spent:

* **raw TCP**: a Python sender ``sendall``-ing from memory to a receiver ``recv_into``-ing a reused
  buffer, node A -> node B: the link's speed as Python can drive it;
* **raw TCP into the ramdisk**: the same receiver ``pwrite``-ing every block into a new file in B's
  ramdisk, preallocated (``posix_fallocate``) when the first byte arrives: the pages a receiver must
  allocate are counted, and they are of the kind the replicator gets (huge pages on a
  ``huge=within_size`` tmpfs only come with preallocation); and, for comparison with earlier
  figures, **into a file preallocated before the clock starts** (its page allocation not counted);
* **raw sendfile ramdisk to ramdisk**: a file of A's ramdisk ``sendfile``-d into the same receiver
  (what the replicator's I/O costs on both ends, without its crc32c and protocol);
* **data path**: one rank's step pushed from A's ramdisk to B's running replicator (``sendfile`` and
  the ``mmap`` sender; B preallocates, receives with crc32c, verifies, commits): GB/s and its ratio
  to each baseline (target >= 0.8 of raw TCP into the ramdisk); the cluster runs with ``--auth``
  (mutual TLS with node certificates by default, as deployed: each connection a sealed channel, whose
  sender encrypts from a mapping whatever the send method, so the two data path rows are the same
  configuration there);
* **TLS cost** (unless ``--skip-tls``; needs the cluster's CA, so ``--auth tls``): the same push to two
  of the worker's data servers on B (``DataServer``, one over plain TCP with the legacy token, one over
  mutual TLS with node certificates), interleaved with the other rounds: GB/s and CPU of each, their
  ratio, and each against raw TCP; plus the time of a tiny step's push (connection set-up, and the TLS
  handshake where there is one);
* **receive stages** (``--stages``): what B's receiver does per GiB, each stage alone in B's
  ramdisk (allocating pages, copying into allocated pages, crc32c) next to raw TCP's receive cost:
  the budget that bounds the ratio on this machine;
* **receiver variants** (``--receivers``): the replicator's receive loop against a shared mapping of
  the file (``recv_into`` straight into the pages) and ``splice`` socket -> pipe -> file, over TLS
  records (``ssl`` with B's node certificate, when the cluster has a CA: what TLS costs the loop) and
  over a sealed channel set up on that TLS connection (what the data path runs);
* **several ranks at once** (``--streams N``, with the TLS data servers): N raw TCP flows into B's
  ramdisk at once against N ranks' steps pushed at once to B's mutual TLS data server (one sending
  process, a thread per rank, as the worker): aggregate GB/s, CPU per GiB of all receivers and of all
  senders, and the ratio per round;
* **end to end**: a step committed in A's ramdisk until its replica is committed on B;
* **restore**: node A lost, time until its rank is staged back from its peer, versus from the bucket
  (fake-gcs-server, memory backend, on this machine) when the peer is lost too;
* **healing** (unless ``--skip-healing``; ``--only-healing`` measures nothing else): node A lost and
  replaced, seconds from the new peer plan until the job is back at full redundancy (A's rank staged
  again, every rank's step replicated on a live node other than its primary's, no node degraded), for
  the step size of ``--size-mib``, with no save in between;
* **erasure coding** (``--only-erasure K,M``, on its own cluster of K + M + 1 nodes): one rank's step
  placed as K + M fragments on the other nodes against one replica: the bytes the peers hold, the
  time from the commit until every fragment (or the replica) is committed, and the time to restore
  the rank after its node is lost (rebuilt from K fragments, or copied from the replica);
* **training slowdown**: a torch MLP on one thread, its steps/s in idle windows and in windows where
  A commits a new step every ``--interval`` s for the replicators to send, interleaved; for each
  worker configuration: ``unprotected`` (nice 0), ``nice 10`` (the default), ``SCHED_IDLE``
  (``--worker-idle``) and ``cap`` (``--bandwidth-limit``, nice 10), each repeated ``--train-repeat``
  times (median and spread), with the replication rate achieved meanwhile (A's bytes out).

Every transfer path is measured once per round and rounds are interleaved, so a drift of the
machine's load hits all of them; figures are medians over rounds.

The ramdisks are tmpfs mounts; ``--huge`` sets their ``huge=`` option: ``within_size`` (default: what
the chart's CSI driver and the demo rig mount), or ``never`` (4 KiB pages, where allocating and writing
pages costs several times more CPU; the steadier choice on a VM whose virtio-balloon reports free pages
to the host, where each fresh huge page faults on the host at its first touch, as on the dev VM). In
loopback mode the cluster lives under ``$TMPDIR``: point it at a tmpfs (bench/device_replication.sh
does).

Run as root from the repository root: ``.venv/bin/python bench/replicator_bench.py [--size-mib 256]
[--stages] [--receivers] [--json]``. Needs about 4x ``--size-mib`` of RAM for the ramdisks plus 3x
for the bucket emulator.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from tierckpt.protocol.control import JobPolicy, RestoreState, RestoreStatus, read_restore_status
from tierckpt.protocol.format import (
    commit_step,
    rank_dir,
    read_manifest,
    replica_rank_dir,
    step_dir,
)
from tierckpt_demo.cluster import LocalCluster, Node, has_netns
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.replication.ipc import WorkerConfig
from tierckpt_replicator.settings import TransferSettings

MiB = 1 << 20
GiB = 1 << 30
RAW_PORT = 9555
STREAM_PORT = 9600
"""The first of ``--streams`` consecutive ports of the raw TCP flows at once."""
SERVER_PORTS = {"token": 9556, "tls": 9557}
"""The ports of the TLS cost's data servers on B, per auth mode."""
RECEIVERS = ("replicator", "mmap", "splice")
DATA_JOB = "bench_datapath"
"""The job the data path measurements push: assigned on B only (A's own replicator leaves it alone)."""
TRAIN_CONFIGS = ("unprotected", "nice10", "idle", "cap")


# ------------------------------------------------------------------------------------------ steps


def make_step(parent: Path, job: str, rank: int, step: int, size: int, world_size: int, blob: bytes) -> Path:
    """Commit a one-file step of ``size`` bytes in the client format (content: ``blob`` repeated)."""
    return write_step("", job, rank, step, world_size=world_size, sizes=(size,), block=blob, parent=parent)


def committed(path: Path) -> bool:
    return (path / "COMMIT").exists()


def mount_of(path: Path) -> str:
    """``fstype options`` of the mount holding ``path`` (from /proc/self/mountinfo)."""
    best, found = "", "?"
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4]
            tail = fields[fields.index("-") + 1 :]
            inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, found = point, f"{tail[0]} {tail[2]}"
    return found


def tree_cpu(pid: int | None) -> float:
    """CPU-seconds so far of process ``pid`` and its descendants (a replicator: the daemon and its
    worker; a data server)."""
    import psutil

    if pid is None:
        return 0.0
    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
    return total


# ------------------------------------------------------------------------------------------ raw TCP

_RECEIVER = """
import os, resource, socket, sys, time
n, mode = int(sys.argv[1]), sys.argv[3]; dest = sys.argv[4] if len(sys.argv) > 4 else ""
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[2]))); s.listen(1)
fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if dest else -1
if mode == "preallocated": os.posix_fallocate(fd, 0, n)
print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); view = memoryview(buf); got = 0; t0 = None
while got < n:
    k = c.recv_into(view)
    if not k: break
    if t0 is None:
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if mode == "ramdisk": os.posix_fallocate(fd, 0, n)  # timed, as the replicator's preallocation
    if fd >= 0: os.pwrite(fd, view[:k], got)
    got += k
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(got, time.perf_counter() - t0, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, t0, flush=True)
if fd >= 0: os.close(fd); os.unlink(dest)
"""

_SENDER = """
import os, resource, socket, sys
n, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
src = sys.argv[4] if len(sys.argv) > 4 else ""
s = socket.create_connection((host, port)); sent = 0
if src:  # the file's pages straight from A's ramdisk, as the replicator sends
    fd = os.open(src, os.O_RDONLY)
    while sent < n: sent += os.sendfile(s.fileno(), fd, sent, min(4 << 20, n - sent))
else:  # a cached buffer: no sender reading a ramdisk can be cheaper
    blob = bytes(4 << 20)
    while sent < n:
        k = min(len(blob), n - sent); s.sendall(memoryview(blob)[:k]); sent += k
s.close(); r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime + r.ru_stime)
"""


@dataclasses.dataclass
class Rate:
    """One measured transfer: bytes per second, and CPU-seconds per GiB of each side."""

    bps: float
    rx_cpu: float
    tx_cpu: float


def raw_tcp(a: Node, b: Node, size: int, mode: str = "discard", src: Path | None = None) -> Rate:
    """Plain Python TCP from A to B, timed from the first byte to the last (no connection set-up).
    ``mode``: ``discard`` (received into a reused buffer), ``ramdisk`` (a new file in B's ramdisk
    preallocated when the first byte arrives, as the replicator preallocates, so both get the same kind
    of pages, then each block ``pwrite``-n into it) or ``preallocated`` (the file preallocated before
    the clock starts: its page allocation not counted). ``src``: send this file of A's ramdisk with
    ``sendfile`` instead of a cached buffer."""
    dest = [str(b.root / ".bench-raw")] if mode != "discard" else []
    rx = b.popen_in_node(
        [sys.executable, "-c", _RECEIVER, str(size), str(RAW_PORT), mode, *dest],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rx.stdout is not None
    assert rx.stdout.readline().strip() == "ready"
    file = [str(src)] if src is not None else []
    tx = a.run_in_node([sys.executable, "-c", _SENDER, str(size), b.ip, str(RAW_PORT), *file], check=True)
    got, seconds, cpu, _ = rx.stdout.readline().split()
    rx.wait()
    return Rate(int(got) / float(seconds), float(cpu) / (size / GiB), float(tx.stdout) / (size / GiB))


def raw_tcp_streams(a: Node, b: Node, size: int, streams: int) -> Rate:
    """``streams`` raw TCP flows at once, A's cached buffers into new files of B's ramdisk (``raw_tcp``'s
    ``ramdisk`` mode, a receiver and a sender process each): the aggregate from the first byte any
    receiver got to the last, and the CPU-seconds per GiB of all receivers and of all senders."""
    receivers = []
    for i in range(streams):
        rx = b.popen_in_node(
            [
                sys.executable,
                "-c",
                _RECEIVER,
                str(size),
                str(STREAM_PORT + i),
                "ramdisk",
                str(b.root / f".bench-raw{i}"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        receivers.append(rx)
    senders = [
        a.popen_in_node(
            [sys.executable, "-c", _SENDER, str(size), b.ip, str(STREAM_PORT + i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(streams)
    ]
    tx_cpu = sum(float(tx.communicate()[0]) for tx in senders)
    got = rx_cpu = 0.0
    first, last = float("inf"), 0.0
    for rx in receivers:
        assert rx.stdout is not None
        n, seconds, cpu, t0 = (float(x) for x in rx.stdout.readline().split())
        rx.wait()
        got, rx_cpu = got + n, rx_cpu + cpu
        first, last = min(first, t0), max(last, t0 + seconds)
    return Rate(got / (last - first), rx_cpu / (got / GiB), tx_cpu / (got / GiB))


# ------------------------------------------------------------------------------------------ data path

_PUSH = """
import json, resource, sys, time
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.ipc import PeerAddress, WorkerConfig
from tierckpt_replicator.replication.transfer import push_step
config, job, peer, host, port, steps = sys.argv[1:7]
ctx = DataContext.from_config(WorkerConfig.from_bytes(config.encode()))
out = []
for step in json.loads(steps):
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    o = push_step(ctx, job, 0, step, PeerAddress(peer, host, int(port)))
    t1 = time.perf_counter(); r1 = resource.getrusage(resource.RUSAGE_SELF)
    out.append([o.status, o.bytes, t1 - t0, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime])
print(json.dumps(out))
"""

_PUSH_MANY = """
import json, resource, sys, time
from concurrent.futures import ThreadPoolExecutor
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.ipc import PeerAddress, WorkerConfig
from tierckpt_replicator.replication.transfer import push_step
config, job, peer, host, port, step, ranks = sys.argv[1:8]
ctx = DataContext.from_config(WorkerConfig.from_bytes(config.encode()))
to = PeerAddress(peer, host, int(port))
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
with ThreadPoolExecutor(int(ranks)) as pool:
    outs = list(pool.map(lambda r: push_step(ctx, job, r, int(step), to), range(int(ranks))))
t1 = time.perf_counter(); r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
print(json.dumps([[o.status for o in outs], sum(o.bytes for o in outs), t1 - t0, cpu]))
"""

_DATA_SERVER = """
import sys
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.data_server import DataServer
from tierckpt_replicator.replication.ipc import WorkerConfig
server = DataServer(DataContext.from_config(WorkerConfig.from_bytes(sys.argv[1].encode())))
server.start(); print("ready", flush=True); sys.stdin.read(); server.stop()
"""


def node_config(
    cluster: LocalCluster,
    node: Node,
    *,
    auth: str,
    method: str,
    port: int = 0,
    token: Path | None = None,
    streams: int = 1,
) -> WorkerConfig:
    """A data plane configuration as ``node``'s worker has it: its certificate (``auth="tls"``) or a
    token file (``auth="token"``: ``token``, else one made for the plain runs of a TLS cluster); room for
    ``streams`` transfers at once from one source."""
    tls = node.tls_files if auth == "tls" else None
    if auth == "token" and token is None:
        token = cluster.workdir / "bench-token"
        if not token.exists():
            token.write_text(secrets.token_urlsafe(24))
    return WorkerConfig(
        node=node.name,
        root=str(node.root),
        listen_host="0.0.0.0",
        data_port=port,
        holder=f"bench-{node.name}",
        transfer=TransferSettings(
            transfer_timeout=60.0,
            send_method="mmap" if method == "mmap" else "sendfile",
            max_incoming=max(4, streams),
            data_connections_per_source=max(8, 2 * streams),
        ),
        auth="tls" if auth == "tls" else "token",
        tls_cert=str(tls.cert) if tls else "",
        tls_ca=str(tls.ca) if tls else "",
        token_file=str(token) if auth == "token" else "",
        peers_file=str(cluster.workdir / "bench-peers.json"),
    )


def assign_data_job(cluster: LocalCluster) -> None:
    """The data path's job, on B only: A and B are its members there, and A's replicator never sees it."""
    b = cluster.nodes[1]
    assignment = cluster.assignment(DATA_JOB)
    (cluster.workdir / "bench-peers.json").write_bytes(assignment.to_bytes())
    cluster.api.put_peers(b.endpoint, assignment, node=b.name)


class DataServers:
    """Two of the worker's data servers on B, one per auth mode (plain TCP with the token, mutual TLS),
    receiving into B's ramdisk beside B's own replicator (ports: ``SERVER_PORTS``)."""

    def __init__(self, cluster: LocalCluster, streams: int = 1) -> None:
        b = cluster.nodes[1]
        self.procs: dict[str, subprocess.Popen[str]] = {}
        for auth, port in SERVER_PORTS.items():
            config = node_config(cluster, b, auth=auth, method="mmap", port=port, streams=streams)
            config = config.to_bytes().decode()
            proc = b.popen_in_node(
                [sys.executable, "-c", _DATA_SERVER, config],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            self.procs[auth] = proc

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
            proc.wait(10)


def data_path(
    cluster: LocalCluster,
    size: int,
    blob: bytes,
    method: str,
    *,
    repeat: int = 1,
    servers: DataServers | None = None,
    auth: str | None = None,
) -> list[Rate]:
    """push_step A -> B, one ``Rate`` per repetition: to B's real replicator (the cluster's own auth
    mode), or with ``servers`` to B's data server for ``auth``. Timed in full: lease, connection (and
    TLS handshake), header, B's preallocation, the bytes, verification and the commit. The sender's CPU
    is the push's own; the receiver's is its process tree's over the run, shared evenly by the steps."""
    a, b = cluster.nodes[0], cluster.nodes[1]
    job = DATA_JOB
    steps = list(range(1, repeat + 1))
    for s in steps:
        make_step(rank_dir(a.root, job, 0), job, 0, s, size, 1, blob)
    if servers is None:  # B's replicator, which checks the cluster's own credentials
        auth = cluster.auth
        config = node_config(cluster, a, auth=auth, method=method, token=cluster.token_file)
        dest, receiver = b.data_port, b.proc.pid if b.proc is not None else None
    else:
        assert auth is not None, "pushing to a data server needs its auth mode"
        config = node_config(cluster, a, auth=auth, method=method)
        dest, receiver = SERVER_PORTS[auth], servers.procs[auth].pid
    cpu0 = tree_cpu(receiver)
    proc = a.run_in_node(
        [
            sys.executable,
            "-c",
            _PUSH,
            config.to_bytes().decode(),
            job,
            b.name,
            b.ip,
            str(dest),
            json.dumps(steps),
        ],
        check=True,
    )
    rx_cpu = (tree_cpu(receiver) - cpu0) / len(steps)
    rates = []
    for status, nbytes, seconds, tx_cpu in json.loads(proc.stdout):
        assert status == "ok", status
        rates.append(Rate(nbytes / seconds, rx_cpu / (size / GiB), tx_cpu / (size / GiB)))
    for s in steps:  # free the ramdisks for what follows
        for p in (step_dir(rank_dir(a.root, job, 0), s), step_dir(replica_rank_dir(b.root, job, 0), s)):
            subprocess.run(["rm", "-rf", str(p)], check=True)
    return rates


def data_path_streams(
    cluster: LocalCluster, size: int, blob: bytes, servers: DataServers, streams: int
) -> Rate:
    """``streams`` ranks' steps pushed from A to B's mutual TLS data server at once (one process, a
    thread per rank, as the worker sends): the aggregate over the batch, timed in full, and the
    CPU-seconds per GiB of B's server and of A's sender."""
    a, b = cluster.nodes[0], cluster.nodes[1]
    job, step = DATA_JOB, 1
    for r in range(streams):
        make_step(rank_dir(a.root, job, r), job, r, step, size, streams, blob)
    config = node_config(cluster, a, auth="tls", method="sendfile").to_bytes().decode()
    receiver = servers.procs["tls"].pid
    cpu0 = tree_cpu(receiver)
    port = str(SERVER_PORTS["tls"])
    proc = a.run_in_node(
        [sys.executable, "-c", _PUSH_MANY, config, job, b.name, b.ip, port, str(step), str(streams)],
        check=True,
    )
    rx_cpu = tree_cpu(receiver) - cpu0
    statuses, nbytes, seconds, tx_cpu = json.loads(proc.stdout)
    assert set(statuses) == {"ok"}, statuses
    for r in range(streams):
        for p in (step_dir(rank_dir(a.root, job, r), step), step_dir(replica_rank_dir(b.root, job, r), step)):
            subprocess.run(["rm", "-rf", str(p)], check=True)
    return Rate(nbytes / seconds, rx_cpu / (nbytes / GiB), tx_cpu / (nbytes / GiB))


def push_latency(
    cluster: LocalCluster, blob: bytes, servers: DataServers, auth: str, repeat: int = 20
) -> float:
    """Median seconds of pushing a 4 KiB step to B's data server for ``auth`` (mostly connection
    set-up, and the TLS handshake)."""
    rates = data_path(cluster, 4096, blob[:4096], "mmap", repeat=repeat, servers=servers, auth=auth)
    return statistics.median(4096 / r.bps for r in rates)


# ------------------------------------------------------------------------------------------ stages

_STAGES = """
import ctypes, json, os, resource, sys
from tierckpt.protocol.integrity import crc32c_address
d, size = sys.argv[1], int(sys.argv[2]); block = 1 << 20
buf = bytearray(os.urandom(block)); view = memoryview(buf)
addr = ctypes.addressof((ctypes.c_char * block).from_buffer(buf))
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
def median(fn, setup=lambda: None, reps=3):
    out = []
    for _ in range(reps):
        arg = setup(); c0 = cpu(); fn(arg); out.append(cpu() - c0)
    return sorted(out)[len(out) // 2] / (size / (1 << 30))
path = os.path.join(d, ".bench-stage")
def fresh(allocate):
    if os.path.exists(path): os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    if allocate: os.posix_fallocate(fd, 0, size)
    return fd
def write(fd):
    for off in range(0, size, block): os.pwrite(fd, view, off)
    os.close(fd)
def crc(_):
    c = 0
    for _ in range(0, size, block): c = crc32c_address(addr, block, c)
out = {
    "allocate_pages": median(lambda fd: (os.posix_fallocate(fd, 0, size), os.close(fd)), lambda: fresh(0)),
    "copy_into_allocated_pages": median(write, lambda: fresh(True)),
    "copy_into_new_pages": median(write, lambda: fresh(False)),
    "crc32c_in_cache": median(crc),
}
os.unlink(path); print(json.dumps(out))
"""


def receive_stages(a: Node, b: Node, size: int) -> dict[str, float]:
    """CPU-seconds per GiB of each stage of receiving into B's ramdisk, alone (1 MiB blocks)."""
    proc = b.run_in_node([sys.executable, "-c", _STAGES, str(b.root), str(size)], check=True)
    out: dict[str, float] = json.loads(proc.stdout)
    return out


# ------------------------------------------------------------------------------------------ receivers

_RX_VARIANT = """
import ctypes, mmap, os, queue, socket, ssl, sys, threading, time
from pathlib import Path
from tierckpt.protocol.integrity import crc32c_address
from tierckpt_replicator.replication.stream import BLOCK, receive_file
from tierckpt_replicator.stepio import preallocate
mode, size, port, dest, cert = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.settimeout(60)
if mode in ("tls", "sealed"):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(cert)
    c = ctx.wrap_socket(c, server_side=True)
if mode == "sealed":
    from tierckpt_replicator.replication import channel, pacing, wire
    c = channel.accept_channel(c, channel.is_hello(wire.recv_body(c)), pacing.Deadline(60, "hello"))
    c.allow_bulk()
t0 = time.perf_counter()
fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644); preallocate(fd, size, str(dest)); os.close(fd)

def behind(base):  # a thread computing the crc32c of each range right after it was written
    ends, state = queue.SimpleQueue(), {"crc": 0, "done": 0}
    def run():
        while (end := ends.get()) is not None:
            state["crc"] = crc32c_address(base + state["done"], end - state["done"], state["crc"])
            state["done"] = end
    t = threading.Thread(target=run); t.start()
    return ends, t, state

if mode in ("replicator", "tls", "sealed"):
    fd = os.open(dest, os.O_WRONLY); crc = receive_file(c, fd, size, where=str(dest)); os.close(fd)
else:
    fd = os.open(dest, os.O_RDWR); mm = mmap.mmap(fd, size); head = ctypes.c_char.from_buffer(mm)
    ends, t, state = behind(ctypes.addressof(head)); done = 0
    if mode == "mmap":
        view = memoryview(mm)
        while done < size:
            end = min(done + 4 * BLOCK, size)
            while done < end:
                k = c.recv_into(view[done:end])
                assert k, "closed"
                done += k
            ends.put(done)
        view.release()
    else:
        r, w = os.pipe(); c.settimeout(None); mark = 0
        while done < size:
            n = os.splice(c.fileno(), w, min(1 << 16, size - done))
            assert n, "closed"
            while n:
                k = os.splice(r, fd, n, offset_dst=done); done += k; n -= k
            if done - mark >= 4 * BLOCK or done == size:
                ends.put(done); mark = done
    ends.put(None); t.join(); crc = state["crc"]; del head; mm.close(); os.fsync(fd); os.close(fd)
print(size / (time.perf_counter() - t0), crc, flush=True)
dest.unlink()
"""

_TX_FILE = """
import os, socket, ssl, sys
from pathlib import Path
from tierckpt_replicator.replication.stream import send_file
path, host, port, method, tls = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
with socket.create_connection((host, port)) as s:
    if tls != "0":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        s = ctx.wrap_socket(s)
    if tls == "sealed":
        from tierckpt_replicator.replication.channel import open_channel
        s = open_channel(s)
    fd = os.open(path, os.O_RDONLY)
    send_file(s, fd, os.fstat(fd).st_size, where=str(path), method=method)
    try:  # until the receiver hangs up: closing over unread bytes (a TLS ticket) would reset the stream
        s.recv(1)
    except OSError:
        pass
"""


def receiver_variant(a: Node, b: Node, src: Path, want_crc: int, mode: str, cert: str = "") -> float:
    """Bytes per second of one receive loop (``replicator``, ``tls``, ``sealed``, ``mmap`` or
    ``splice``) from A's ramdisk file into a preallocated file in B's ramdisk, its crc32c checked; timed
    from the connection on (the TLS handshake, and the sealed channel's set-up, excluded). ``cert``:
    the PEM file (key included) B serves TLS with."""
    size = src.stat().st_size
    rx = b.popen_in_node(
        [sys.executable, "-c", _RX_VARIANT, mode, str(size), str(RAW_PORT), str(b.root / ".bench-rx"), cert],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    tls = {"tls": "1", "sealed": "sealed"}.get(mode, "0")
    a.run_in_node(
        [sys.executable, "-c", _TX_FILE, str(src), b.ip, str(RAW_PORT), "sendfile", tls], check=True
    )
    rate, crc = rx.stdout.readline().split()
    rx.wait()
    assert int(crc) == want_crc, f"{mode}: crc32c {int(crc):08x}, want {want_crc:08x}"
    return float(rate)


# ------------------------------------------------------------------------------------------ end to end


def end_to_end(cluster: LocalCluster, size: int, blob: bytes, repeat: int) -> list[float]:
    """Seconds from a step's COMMIT on A to its replica's COMMIT on B."""
    a, b = cluster.nodes[0], cluster.nodes[1]
    job = cluster.job
    hidden = rank_dir(a.root, job, 0) / ".bench"
    times = []
    for i in range(repeat):
        step = 100 + i
        staged = make_step(hidden, job, 0, step, size, 1, blob)  # written out of sight, then moved in
        t0 = time.perf_counter()
        os.rename(staged, step_dir(rank_dir(a.root, job, 0), step))
        target = step_dir(replica_rank_dir(b.root, job, 0), step)
        while not committed(target):
            if time.perf_counter() - t0 > 120:
                raise TimeoutError(f"no replica of step {step} on {b.name}:\n{a.log_text()[-3000:]}")
            time.sleep(0.001)
        times.append(time.perf_counter() - t0)
        if i:
            subprocess.run(["rm", "-rf", str(step_dir(rank_dir(a.root, job, 0), step - 1))], check=True)
    return times


# ------------------------------------------------------------------------------------------ restore


def wait_ready(node: Node, job: str, rank: int, timeout: float = 300) -> RestoreStatus:
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = read_restore_status(node.root, job, rank)
        except Exception:
            st = None
        if isinstance(st, RestoreStatus) and st.state in (RestoreState.READY, RestoreState.FAILED):
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node.name}: rank {rank} not restored:\n{node.log_text()[-3000:]}")
        time.sleep(0.005)


def bucket_steps(cluster: LocalCluster, node: Node, job: str) -> tuple[int, ...]:
    """The steps ``node`` knows to be complete in the bucket (its inventory's ``gcs``)."""
    inv = cluster.api.inventory(node.endpoint, job)
    return inv.gcs if inv is not None else ()


def restore_times(cluster: LocalCluster, size: int, blob: bytes) -> dict[str, Any]:
    a, b, _ = cluster.nodes
    for node in cluster.nodes:  # nothing else may be staged while the restores are timed
        cluster.api.purge(node.endpoint, cluster.job)
    job = "bench_restore"
    cluster.assign(job)
    for node in cluster.nodes:
        make_step(rank_dir(node.root, job, node.index), job, node.index, 7, size, 3, blob)
    for i in range(3):
        peer = cluster.nodes[(i + 1) % 3]
        LocalCluster.wait_for(
            lambda i=i, peer=peer: committed(step_dir(replica_rank_dir(peer.root, job, i), 7)),
            timeout=300,
            what="replicas",
        )
    threads = [
        threading.Thread(target=cluster.api.backup, args=(n.endpoint, job), kwargs={"timeout": 600})
        for n in cluster.nodes
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    LocalCluster.wait_for(lambda: 7 in bucket_steps(cluster, a, job), timeout=600, interval=0.5)
    out: dict[str, Any] = {}
    # 1. node A lost: rank 0 comes back from B's replica
    a.kill_replicator()
    a.wipe_ramdisk()
    a.start_replicator()
    t0 = time.perf_counter()
    cluster.assign(job, generation=2)
    st = wait_ready(a, job, 0)
    out["peer_seconds"], out["peer_source"] = time.perf_counter() - t0, st.source.value if st.source else None
    # 2. A and B lost: rank 0 only in the bucket
    for node in (a, b):
        node.kill_replicator()
        node.wipe_ramdisk()
        node.start_replicator()
    t0 = time.perf_counter()
    cluster.assign(job, generation=3)
    st = wait_ready(a, job, 0)
    out["gcs_seconds"], out["gcs_source"] = time.perf_counter() - t0, st.source.value if st.source else None
    out["gcs_over_peer"] = out["gcs_seconds"] / out["peer_seconds"]
    return out


# ------------------------------------------------------------------------------------------ healing


def _replicated(cluster: LocalCluster, job: str, rank: int, step: int) -> bool:
    primary = cluster.nodes[rank]
    return any(
        n is not primary and n.running and committed(step_dir(replica_rank_dir(n.root, job, rank), step))
        for n in cluster.nodes
    )


def _restored(node: Node, job: str, rank: int) -> bool:
    try:
        st = read_restore_status(node.root, job, rank)
    except Exception:
        return False
    return isinstance(st, RestoreStatus) and st.state == RestoreState.READY


def _healthy(cluster: LocalCluster, node: Node, job: str) -> bool:
    jobs = [j for j in cluster.api.status(node.endpoint, node=node.name).jobs if j.job == job]
    return bool(jobs) and jobs[0].redundancy is not None and jobs[0].redundancy.degraded_since is None


def healing_seconds(
    cluster: LocalCluster, size: int, blob: bytes, *, job: str = "bench_heal", timeout: float = 600
) -> float:
    """Seconds from a replacement's new peer plan until the job is back at full redundancy.

    Every node commits one step of ``size`` bytes and it is replicated; node A is lost (replicator
    killed, RAM disk wiped) and comes back empty, as a replacement; the new plan (generation 2) goes to
    every node and the clock starts. Full redundancy: A staged its rank again (from its peer's replica),
    every rank's step has a committed replica on a live node other than its primary's, and every node
    reports ``Redundancy.degraded_since`` None. Nothing is saved meanwhile."""
    a = cluster.nodes[0]
    step = 5
    cluster.assign(job)
    for node in cluster.nodes:
        make_step(rank_dir(node.root, job, node.index), job, node.index, step, size, cluster.size, blob)
    LocalCluster.wait_for(
        lambda: all(_replicated(cluster, job, r, step) for r in range(cluster.size)),
        timeout=timeout,
        what="replicas",
    )
    a.kill_replicator()
    a.wipe_ramdisk()
    a.start_replicator()
    started = time.perf_counter()
    cluster.assign(job, generation=2)

    def healed() -> bool:
        return (
            _restored(a, job, 0)
            and committed(step_dir(rank_dir(a.root, job, 0), step))
            and all(_replicated(cluster, job, r, step) for r in range(cluster.size))
            and all(_healthy(cluster, n, job) for n in cluster.nodes)
        )

    LocalCluster.wait_for(healed, timeout=timeout, interval=0.05, what="full redundancy")
    seconds = time.perf_counter() - started
    for node in cluster.nodes:
        cluster.api.purge(node.endpoint, job, node=node.name)
    return seconds


def erasure_vs_replica(cluster: LocalCluster, size: int, blob: bytes, k: int, m: int) -> dict[str, Any]:
    """Node A's one-rank step as ``k + m`` fragments on the other nodes against one replica: bytes on
    the peers, commit -> fully placed, and the restore after A is lost (see the module docstring)."""
    a, step, out = cluster.nodes[0], 7, {}
    for mode, (ek, em) in (("replica", (0, 0)), ("erasure", (k, m))):
        job = f"bench_{mode}"
        policy = JobPolicy(
            job=job, generation=1, erasure_data=ek, erasure_parity=em, backup_interval_minutes=0
        )
        for node in cluster.nodes:
            cluster.api.put_policy(node.endpoint, policy, node=node.name)
        cluster.assign(job)
        kind, want = ("fragments", ek + em) if ek else ("replicas", 1)
        started = time.perf_counter()
        make_step(rank_dir(a.root, job, 0), job, 0, step, size, 1, blob)
        for _ in range(60000):  # every 10 ms, at most 600 s
            if len(_held(cluster, job, kind, step)) == want:
                break
            time.sleep(0.01)
        else:
            raise TimeoutError(f"{kind} of {job} not placed")
        placed = time.perf_counter() - started
        peer_bytes = sum(
            f.stat().st_size
            for p in _held(cluster, job, kind, step)
            for f in p.iterdir()
            if f.suffix == ".bin"
        )
        a.kill_replicator()
        a.wipe_ramdisk()
        a.start_replicator()
        cluster.api.put_policy(a.endpoint, policy, node=a.name)
        started = time.perf_counter()
        cluster.assign(job, generation=2)
        st = wait_ready(a, job, 0)
        out[mode] = {
            "peer_bytes": peer_bytes,
            "peer_bytes_over_step": peer_bytes / size,
            "place_seconds": placed,
            "restore_seconds": time.perf_counter() - started,
            "restore_source": st.source.value if st.source else None,
        }
        for node in cluster.nodes:
            cluster.api.purge(node.endpoint, job, node=node.name)
    out["code"] = {"k": k, "m": m}
    return out


def _held(cluster: LocalCluster, job: str, kind: str, step: int) -> list[Path]:
    """The committed copies (``replicas``) or fragments (``fragments``) of rank 0's step on B, C, ..."""
    paths = (step_dir(n.root / job / kind / "rank-00000", step) for n in cluster.nodes[1:])
    return [p for p in paths if committed(p)]


def _erasure_line(x: dict[str, Any]) -> str:
    c = x["code"]
    parts = [
        f"{label}: peers hold {r['peer_bytes_over_step']:.2f}x the step, "
        f"placed in {r['place_seconds']:.2f} s, "
        f"restored from {r['restore_source']} in {r['restore_seconds']:.2f} s"
        for label, r in (("one replica", x["replica"]), (f"erasure k={c['k']} m={c['m']}", x["erasure"]))
    ]
    return "; ".join(parts)


def healing(cluster: LocalCluster, size: int, blob: bytes, repeat: int) -> dict[str, Any]:
    """``healing_seconds`` ``repeat`` times (a new job each): the median and every round."""
    rounds = [healing_seconds(cluster, size, blob, job=f"bench_heal_{i}") for i in range(repeat)]
    return {"seconds": statistics.median(rounds), "rounds_seconds": rounds, "state_bytes_per_rank": size}


def _healing_line(x: dict[str, Any]) -> str:
    rounds = ", ".join(f"{s:.2f}" for s in x["rounds_seconds"])
    return (
        f"healing after a node loss ({x['state_bytes_per_rank'] >> 20} MiB per rank): full redundancy "
        f"{x['seconds']:.2f} s after the new plan (rounds {rounds})"
    )


# ------------------------------------------------------------------------------------------ training

_TRAIN = """
import json, sys, time, torch
torch.set_num_threads(1); seconds = float(sys.argv[1])
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
opt = torch.optim.SGD(model.parameters(), lr=1e-3); x = torch.randn(256, 1024)
def step():
    opt.zero_grad(); model(x).square().mean().backward(); opt.step()
for _ in range(20): step()
print("ready", flush=True); out = []; end = time.perf_counter() + seconds
while time.perf_counter() < end:
    t0 = time.perf_counter(); step(); out.append([t0, time.perf_counter() - t0])
print(json.dumps(out), flush=True)
"""

_WORKER_ARGS = {
    "unprotected": ["--worker-nice", "0"],
    "nice10": [],  # the default: --worker-nice 10
    "idle": ["--worker-idle"],
    "cap": [],  # --bandwidth-limit, added in main
}
_TRAIN_LABELS = {
    "unprotected": "worker at nice 0, no cap",
    "nice10": "worker at nice 10 (default)",
    "idle": "worker under SCHED_IDLE",
    "cap": "bandwidth cap, nice 10",
}


def bytes_out(node: Node) -> float:
    """Step bytes ``node``'s replicator has sent so far (its ``/metrics``)."""
    import httpx

    text = httpx.get(f"{node.probe_endpoint}/metrics", timeout=10).text
    m = re.search(r'^tierckpt_replicator_transfer_bytes_total\{direction="out"\} (\S+)$', text, re.M)
    if m is None and "tierckpt_replicator_transfer_bytes" not in text:
        raise RuntimeError(f"{node.name}: no transfer_bytes_total in its /metrics")
    return float(m.group(1)) if m else 0.0  # the label appears with the first transfer


def _renice(cluster: LocalCluster, nice: int) -> None:
    """Set the niceness of every replicator process (daemon and worker) of the cluster."""
    for node in cluster.nodes:
        if node.proc is not None:
            for pid in _tree(node.proc.pid):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, pid, nice)


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _settle(node: Node, quiet: float = 1.0, timeout: float = 60.0) -> None:
    """Wait until ``node`` has sent nothing for ``quiet`` seconds (a restart may resend a step)."""
    deadline = time.monotonic() + timeout
    last = bytes_out(node)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = bytes_out(node)
        if now == last:
            return
        last = now


def training_slowdown(
    cluster: LocalCluster, size: int, blob: bytes, *, seconds: float, interval: float, rounds: int = 3
) -> dict[str, Any]:
    """Median training step time in idle windows vs replicating windows (a new step every ``interval``
    s), interleaved ``rounds`` times in one training process so drifts of the machine's load hit both;
    and the rate at which A's replicator sent meanwhile."""
    a = cluster.nodes[0]
    _settle(a)
    window = seconds / 2
    total = window * 2 * rounds
    loader = _Load(a, cluster.job, size, blob, interval)  # writes its one data file now, before timing
    train = a.popen_in_node([sys.executable, "-c", _TRAIN, str(total)], stdout=subprocess.PIPE, text=True)
    assert train.stdout is not None and train.stdout.readline().strip() == "ready"
    start = time.perf_counter()
    loader.start()
    windows: list[tuple[float, float, str]] = []
    sent, busy_seconds = 0.0, 0.0
    for r in range(rounds):
        for phase in ("idle", "replicating"):
            t0 = start + (2 * r + (phase == "replicating")) * window
            if phase == "replicating":
                before = bytes_out(a)
                loader.active.set()
            time.sleep(max(0.0, t0 + window - time.perf_counter()))
            loader.active.clear()
            if phase == "replicating":
                sent += bytes_out(a) - before
                busy_seconds += window
            windows.append((t0, t0 + window, phase))
    samples = json.loads(train.stdout.readline())
    train.wait()
    loader.stop.set()
    loader.active.set()
    loader.join()
    loader.cleanup()
    if loader.error is not None:
        raise loader.error
    phases: dict[str, list[float]] = {"idle": [], "replicating": []}
    for t, d in samples:  # steps wholly inside a window (the load stops within ~0.1 s of its end)
        for lo, hi, phase in windows:
            if lo + 0.2 <= t and t + d <= hi:
                phases[phase].append(d)
    idle, busy = statistics.median(phases["idle"]), statistics.median(phases["replicating"])
    return {
        "idle_steps_per_s": 1 / idle,
        "replicating_steps_per_s": 1 / busy,
        "slowdown_pct": (busy / idle - 1) * 100,
        "replication_mbps": sent / busy_seconds / 1e6,
        "steps_committed": loader.count,
        "samples": {k: len(v) for k, v in phases.items()},
    }


def training_configs(
    cluster: LocalCluster, size: int, blob: bytes, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """``training_slowdown`` under each worker configuration, ``--train-repeat`` times each."""
    out: dict[str, dict[str, Any]] = {}
    for name in args.train_configs:
        extra = list(_WORKER_ARGS[name])
        if name == "cap":
            extra += ["--bandwidth-limit", str(args.cap_mbps)]
        for node in cluster.nodes:
            node.extra_args = extra
            node.restart_replicator()
        runs = [
            training_slowdown(cluster, size, blob, seconds=args.train_seconds, interval=args.interval)
            for _ in range(args.train_repeat)
        ]
        med = statistics.median
        out[name] = {
            "label": _TRAIN_LABELS[name] + (f" {args.cap_mbps:g} MB/s" if name == "cap" else ""),
            "worker_args": extra,
            "slowdown_pct": med(r["slowdown_pct"] for r in runs),
            "slowdown_pct_runs": [r["slowdown_pct"] for r in runs],
            "idle_steps_per_s": med(r["idle_steps_per_s"] for r in runs),
            "replicating_steps_per_s": med(r["replicating_steps_per_s"] for r in runs),
            "replication_mbps": med(r["replication_mbps"] for r in runs),
            "replication_mbps_runs": [r["replication_mbps"] for r in runs],
            "runs": runs,
        }
    for node in cluster.nodes:
        node.extra_args = []
    return out


class _Load(threading.Thread):
    """While ``active`` is set, commit a new step in A's rank dir every ``interval`` s (the replicator
    sends each one).

    The steps share one data file (hard links) and only their manifest and COMMIT are written, so the
    load is replication alone: none of the CPU time goes into producing the steps."""

    def __init__(self, a: Node, job: str, size: int, blob: bytes, interval: float) -> None:
        super().__init__(daemon=True)
        self.parent = rank_dir(a.root, job, 0)
        self.job, self.size, self.interval = job, size, interval
        self.stop, self.active = threading.Event(), threading.Event()
        self.count = 0
        self.error: BaseException | None = None
        self.first = 1_000_000 + int(time.time()) % 100_000 * 10
        self.template = make_step(self.parent / ".bench", job, 0, self.first, size, 1, blob)
        self.manifest = read_manifest(self.template)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.error = exc

    def cleanup(self) -> None:
        """Remove the template and the steps committed (the next run starts from an empty rank)."""
        subprocess.run(["rm", "-rf", str(self.template)], check=True)
        for old in self.parent.glob("step-*"):
            subprocess.run(["rm", "-rf", str(old)], check=False)

    def _run(self) -> None:
        step = self.first + 1
        while True:
            self.active.wait()
            if self.stop.is_set():
                return
            t0 = time.perf_counter()
            staged = self.parent / ".bench" / f"s{step}"
            staged.mkdir()
            os.link(self.template / "data-00000.bin", staged / "data-00000.bin")
            commit_step(staged, dataclasses.replace(self.manifest, step=step, created_at=time.time()))
            os.rename(staged, step_dir(self.parent, step))
            self.count += 1
            for old in self.parent.glob("step-*"):
                if old.name != step_dir(self.parent, step).name:
                    subprocess.run(["rm", "-rf", str(old)], check=False)
            step += 1
            self.stop.wait(max(0.0, self.interval - (time.perf_counter() - t0)))


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(__doc__.split("\n\n", 1)[1]),
    )
    p.add_argument("--size-mib", type=int, default=256, help="bytes of one rank's step (MiB) [256]")
    p.add_argument(
        "--repeat", type=int, default=5, help="interleaved rounds of the transfer measurements (medians) [5]"
    )
    p.add_argument(
        "--huge",
        choices=("within_size", "never", "keep"),
        default="within_size",
        help="tmpfs huge= option of the ramdisks (keep: as mounted) [within_size, as the chart mounts them]",
    )
    p.add_argument("--loopback", action="store_true", help="nodes on loopback ports, no network namespaces")
    p.add_argument("--stages", action="store_true", help="also measure the receiver's stages alone")
    p.add_argument(
        "--receivers", action="store_true", help="also compare receive loops (replicator, mmap, splice, TLS)"
    )
    p.add_argument(
        "--train-seconds",
        type=float,
        default=8.0,
        help="seconds of one idle + one replicating window; 3 rounds are interleaved [8]",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between replicated steps while training [1]"
    )
    p.add_argument(
        "--train-configs",
        default=",".join(TRAIN_CONFIGS),
        help=f"worker configurations to train beside, from {','.join(TRAIN_CONFIGS)} [all]",
    )
    p.add_argument("--train-repeat", type=int, default=3, help="runs of each training configuration [3]")
    p.add_argument("--cap-mbps", type=float, default=100.0, help="--bandwidth-limit of the 'cap' run [100]")
    p.add_argument(
        "--send-method",
        choices=("mmap", "sendfile"),
        default="sendfile",
        help="the replicators' --send-method (end to end, training, restore) [sendfile]",
    )
    p.add_argument(
        "--auth",
        choices=("tls", "token"),
        default="tls",
        help="the cluster's replicators' --auth (TLS cost and the 'tls' receive loop need tls) [tls]",
    )
    p.add_argument("--skip-tls", action="store_true", help="skip the plain vs TLS data server comparison")
    p.add_argument(
        "--streams",
        type=int,
        default=0,
        help="also N ranks at once: N raw TCP flows into B's ramdisk against N pushes to B's TLS data "
        "server, aggregates (needs the TLS data servers) [0: off]",
    )
    p.add_argument("--skip-restore", action="store_true", help="skip the restore measurement")
    p.add_argument("--skip-healing", action="store_true", help="skip the healing measurement")
    p.add_argument("--only-healing", action="store_true", help="measure the healing time only")
    p.add_argument(
        "--only-erasure",
        metavar="K,M",
        default="",
        help="measure erasure coding (K data, M parity fragments) against one replica only",
    )
    p.add_argument("--skip-training", action="store_true", help="skip the training slowdown measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    args.train_configs = [c for c in args.train_configs.split(",") if c]
    if unknown := set(args.train_configs) - set(TRAIN_CONFIGS):
        p.error(f"unknown --train-configs {sorted(unknown)}")
    size = args.size_mib * MiB
    blob = secrets.token_bytes(8 * MiB)
    ramdisk = f"{max(512, (8 + 3 * args.streams) * args.size_mib)}m"
    netns = has_netns() and not args.loopback
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "netns": netns,
            "cpu_model": _cpu_model(),
        },
        "size_bytes": size,
        "send_method": args.send_method,
        "auth": args.auth,
    }
    args_rep = [
        "--poll-interval",
        "1",
        "--backup-interval",
        "0",
        "--log-level",
        "WARNING",
        "--transfer-timeout",
        "60",
        "--send-method",
        args.send_method,
    ]
    if args.only_erasure:
        k, m = (int(x) for x in args.only_erasure.split(","))
        with LocalCluster(
            nodes=k + m + 1, job="bench_job", k=1, ramdisk_size=ramdisk, replicator_args=args_rep, netns=netns
        ) as cluster:
            if netns and args.huge != "keep":
                for node in cluster.nodes:
                    subprocess.run(["mount", "-o", f"remount,huge={args.huge}", str(node.root)], check=True)
            result["machine"]["ramdisk"] = mount_of(cluster.nodes[0].root)
            result["erasure"] = erasure_vs_replica(cluster, size, blob, k, m)
        print(json.dumps(result, indent=2) if args.json else _erasure_line(result["erasure"]))
        return 0
    with LocalCluster(
        nodes=3,
        job="bench_job",
        k=1,
        gcs=not args.skip_restore,
        ramdisk_size=ramdisk,
        replicator_args=args_rep,
        netns=netns,
        auth=args.auth,
    ) as cluster:
        a, b = cluster.nodes[0], cluster.nodes[1]
        if netns and args.huge != "keep":
            for node in cluster.nodes:
                subprocess.run(["mount", "-o", f"remount,huge={args.huge}", str(node.root)], check=True)
        result["machine"]["ramdisk"] = mount_of(b.root)
        _renice(cluster, 0)  # transfers at the baselines' priority; the training runs set their own
        if args.only_healing:
            result["healing"] = healing(cluster, size, blob, args.repeat)
            print(json.dumps(result, indent=2) if args.json else _healing_line(result["healing"]))
            return 0
        assign_data_job(cluster)
        servers = None if args.skip_tls or cluster.ca is None else DataServers(cluster, max(1, args.streams))
        if args.streams and servers is None:
            p.error("--streams needs the TLS data servers (--auth tls, no --skip-tls)")
        many = f"x{args.streams}"
        other = "mmap" if args.send_method == "sendfile" else "sendfile"
        rounds: dict[str, list[Rate]] = {
            "raw_tcp": [],
            "raw_tcp_into_ramdisk": [],
            "raw_tcp_into_preallocated": [],
            "raw_sendfile_into_ramdisk": [],
            "data_path": [],
            f"data_path_{other}": [],
            **({f"data_server_{auth}": [] for auth in SERVER_PORTS} if servers else {}),
            **({f"raw_tcp_into_ramdisk_{many}": [], f"data_server_tls_{many}": []} if args.streams else {}),
        }
        receivers: dict[str, list[float]] = {m: [] for m in RECEIVERS} if args.receivers else {}
        cert = str(b.tls_files.cert) if args.receivers and cluster.ca is not None else ""
        if cert:
            receivers["tls"] = []
            receivers["sealed"] = []
        src = make_step(a.root / ".bench-src", "bench_rx", 0, 1, size, 1, blob) / "data-00000.bin"
        src_crc = read_manifest(src.parent).files[0].crc32c
        for _ in range(args.repeat):  # interleaved, so a drift of the machine's load hits every path
            rounds["raw_tcp"].append(raw_tcp(a, b, size))
            rounds["raw_tcp_into_ramdisk"].append(raw_tcp(a, b, size, "ramdisk"))
            rounds["raw_tcp_into_preallocated"].append(raw_tcp(a, b, size, "preallocated"))
            rounds["raw_sendfile_into_ramdisk"].append(raw_tcp(a, b, size, "ramdisk", src))
            rounds["data_path"] += data_path(cluster, size, blob, args.send_method)
            rounds[f"data_path_{other}"] += data_path(cluster, size, blob, other)
            for auth in SERVER_PORTS if servers else ():
                rounds[f"data_server_{auth}"] += data_path(
                    cluster, size, blob, args.send_method, servers=servers, auth=auth
                )
            if args.streams and servers is not None:
                rounds[f"raw_tcp_into_ramdisk_{many}"].append(raw_tcp_streams(a, b, size, args.streams))
                rounds[f"data_server_tls_{many}"].append(
                    data_path_streams(cluster, size, blob, servers, args.streams)
                )
            for mode, out in receivers.items():
                out.append(receiver_variant(a, b, src, src_crc, mode, cert))
        subprocess.run(["rm", "-rf", str(src.parent.parent)], check=True)
        med = statistics.median
        result["transfers"] = {
            name: {
                "gbps": med(r.bps for r in rs) / 1e9,
                "rx_cpu_s_per_gib": med(r.rx_cpu for r in rs),
                "tx_cpu_s_per_gib": med(r.tx_cpu for r in rs),
                "rounds_gbps": [r.bps / 1e9 for r in rs],
            }
            for name, rs in rounds.items()
        }
        t = result["transfers"]
        dp = t["data_path"]["gbps"]
        result["data_path_over_raw_tcp"] = dp / t["raw_tcp"]["gbps"]
        result["data_path_over_raw_tcp_into_ramdisk"] = dp / t["raw_tcp_into_ramdisk"]["gbps"]
        result["data_path_over_raw_tcp_into_preallocated"] = dp / t["raw_tcp_into_preallocated"]["gbps"]
        result["data_path_over_raw_sendfile_into_ramdisk"] = dp / t["raw_sendfile_into_ramdisk"]["gbps"]
        result["data_path_over_raw_tcp_into_ramdisk_rounds"] = [
            d.bps / r.bps for d, r in zip(rounds["data_path"], rounds["raw_tcp_into_ramdisk"], strict=True)
        ]
        if servers is not None:
            plain, tls, raw = (
                t["data_server_token"]["gbps"],
                t["data_server_tls"]["gbps"],
                t["raw_tcp"]["gbps"],
            )
            result["tls"] = {
                "plain_gbps": plain,
                "tls_gbps": tls,
                "tls_over_plain": tls / plain,
                "plain_over_raw_tcp": plain / raw,
                "tls_over_raw_tcp": tls / raw,
                "small_push_ms": {
                    auth: push_latency(cluster, blob, servers, auth) * 1e3 for auth in SERVER_PORTS
                },
                "rounds_gbps": {auth: t[f"data_server_{auth}"]["rounds_gbps"] for auth in SERVER_PORTS},
            }
            servers.close()
        if args.streams:
            raws, tlss = rounds[f"raw_tcp_into_ramdisk_{many}"], rounds[f"data_server_tls_{many}"]
            result["streams"] = {
                "streams": args.streams,
                "raw_gbps": t[f"raw_tcp_into_ramdisk_{many}"]["gbps"],
                "tls_gbps": t[f"data_server_tls_{many}"]["gbps"],
                "tls_over_raw": t[f"data_server_tls_{many}"]["gbps"]
                / t[f"raw_tcp_into_ramdisk_{many}"]["gbps"],
                "tls_over_raw_rounds": [d.bps / r.bps for d, r in zip(tlss, raws, strict=True)],
            }
        result["receivers_gbps"] = {m: med(v) / 1e9 for m, v in receivers.items()}
        if args.stages:
            result["receive_stages_cpu_s_per_gib"] = receive_stages(a, b, size)
        if not args.skip_healing:
            result["healing"] = healing(cluster, size, blob, args.repeat)
        e2e = end_to_end(cluster, size, blob, args.repeat)
        result["end_to_end_seconds"] = med(e2e)
        result["end_to_end_gbps"] = size / med(e2e) / 1e9
        if not args.skip_training:
            result["training"] = training_configs(cluster, size, blob, args)
            if not args.skip_restore:
                for node in cluster.nodes:
                    node.restart_replicator()
        if not args.skip_restore:
            result["restore"] = restore_times(cluster, size, blob)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _print_table(r: dict[str, Any]) -> None:
    m, t = r["machine"], r["transfers"]
    print(
        f"machine: {m['cpus']} cpus ({m['cpu_model']}), kernel {m['kernel']}, python {m['python']}, "
        f"netns={m['netns']}, ramdisk: {m.get('ramdisk', '?')}"
    )
    print(f"step size: {r['size_bytes'] / MiB:.0f} MiB (one rank); transfers: medians of interleaved rounds")
    print(f"{'':40s} {'GB/s':>6s}  {'receiver':>9s} {'sender':>7s}  (CPU-s per GiB)")
    labels = {
        "raw_tcp": "raw TCP A->B (discarded)",
        "raw_tcp_into_ramdisk": "raw TCP into B's ramdisk (alloc. timed)",
        "raw_tcp_into_preallocated": "raw TCP into a preallocated file (alloc. untimed)",
        "raw_sendfile_into_ramdisk": "raw sendfile A's ramdisk -> B's ramdisk",
        "data_server_token": "data server on B, plain TCP (token)",
        "data_server_tls": "data server on B, mutual TLS",
    }
    for name, x in t.items():
        many = re.fullmatch(r"(raw_tcp_into_ramdisk|data_server_tls)_x(\d+)", name)
        if many:
            kind = (
                "raw TCP flows into B's ramdisk" if many[1].startswith("raw") else "pushes to B, mutual TLS"
            )
            labels[name] = f"{many[2]} {kind} at once"
        label = labels.get(name) or (
            f"replication data path ({r['send_method']}, {r.get('auth', 'token')})"
            if name == "data_path"
            else f"  ... sending with {name.removeprefix('data_path_')}"
        )
        print(f"{label:40.40s} {x['gbps']:6.2f}  {x['rx_cpu_s_per_gib']:9.2f} {x['tx_cpu_s_per_gib']:7.2f}")
    rounds = ", ".join(f"{x:.2f}" for x in r["data_path_over_raw_tcp_into_ramdisk_rounds"])
    print(
        f"data path = {r['data_path_over_raw_tcp_into_ramdisk']:.2f}x raw TCP into the ramdisk (target "
        f">= 0.8x; per round {rounds}), {r['data_path_over_raw_sendfile_into_ramdisk']:.2f}x raw sendfile "
        f"ramdisk to ramdisk, {r['data_path_over_raw_tcp_into_preallocated']:.2f}x raw TCP into a "
        f"preallocated file, {r['data_path_over_raw_tcp']:.2f}x raw TCP"
    )
    if "receive_stages_cpu_s_per_gib" in r:
        s = r["receive_stages_cpu_s_per_gib"]
        recv = t["raw_tcp"]["rx_cpu_s_per_gib"]
        floor = recv + s["allocate_pages"] + s["copy_into_allocated_pages"] + s["crc32c_in_cache"]
        print(
            "receiver's stages alone, CPU-s per GiB: TCP receive (raw TCP's receiver) "
            f"{recv:.2f} + page allocation {s['allocate_pages']:.2f} + copy into the pages "
            f"{s['copy_into_allocated_pages']:.2f} + crc32c {s['crc32c_in_cache']:.2f} = {floor:.2f}; "
            f"the data path's receiver spent {t['data_path']['rx_cpu_s_per_gib']:.2f}"
        )
    if "tls" in r:
        x, ms = r["tls"], r["tls"]["small_push_ms"]
        print(
            f"TLS cost: mutual TLS = {x['tls_over_plain']:.2f}x plain TCP (data servers on B; "
            f"{x['tls_over_raw_tcp']:.2f}x and {x['plain_over_raw_tcp']:.2f}x raw TCP); push of a 4 KiB "
            f"step {ms['token']:.1f} ms plain, {ms['tls']:.1f} ms TLS"
        )
    if "streams" in r:
        x = r["streams"]
        rounds = ", ".join(f"{v:.2f}" for v in x["tls_over_raw_rounds"])
        print(
            f"{x['streams']} ranks at once: data path (mutual TLS) {x['tls_gbps']:.2f} GB/s = "
            f"{x['tls_over_raw']:.2f}x as many raw TCP flows into the ramdisk ({x['raw_gbps']:.2f} GB/s; "
            f"per round {rounds})"
        )
    for mode, gbps in r.get("receivers_gbps", {}).items():
        print(f"receive loop '{mode}'{' ' * (12 - len(mode))} {gbps:.2f} GB/s  (file in B's ramdisk, crc32c)")
    print(
        f"commit on A -> replica on B      {r['end_to_end_seconds']:.3f} s  ({r['end_to_end_gbps']:.2f} GB/s)"
    )
    for x in r.get("training", {}).values():
        runs = ", ".join(f"{v:+.1f}" for v in x["slowdown_pct_runs"])
        print(
            f"training (1 thread) beside replication, {x['label']}: {x['idle_steps_per_s']:.1f} -> "
            f"{x['replicating_steps_per_s']:.1f} steps/s, slowdown {x['slowdown_pct']:+.1f}% (runs {runs}); "
            f"replication meanwhile {x['replication_mbps']:.0f} MB/s"
        )
    if "healing" in r:
        print(_healing_line(r["healing"]))
    if "restore" in r:
        x = r["restore"]
        print(
            f"restore a lost node's rank: from peer {x['peer_seconds']:.2f} s, from bucket (emulator) "
            f"{x['gcs_seconds']:.2f} s -> bucket/peer {x['gcs_over_peer']:.1f}x"
        )


if __name__ == "__main__":
    tempfile.tempdir = tempfile.gettempdir()
    sys.exit(main())
