"""Benchmark the replicator on a real multi-node cluster on this machine (``tierckpt_demo.cluster``).

Measured in the same run, between the same network namespaces (root) or over loopback (otherwise):

* **raw TCP**: a Python sender ``sendall``-ing from memory to a receiver ``recv_into``-ing a reused
  buffer, node A -> node B: the link's speed as Python can drive it (the baseline);
* **data path**: one rank's step pushed from A's tmpfs to B's running replicator (a read-only mapping
  ``sendall``-ed, or ``sendfile``: both sender methods; B preallocates, receives into a ring of
  buffers, crc32c in cache, ``pwrite`` into place, verifies, commits): GB/s and the ratio to raw TCP
  (target >= 0.8) and to raw TCP into the ramdisk; the cluster runs with ``--auth`` (mutual TLS by
  default, as deployed);
* **TLS cost**: the same push to two data servers on B (the worker's ``DataServer``, one over plain
  TCP with the legacy token, one over mutual TLS with node certificates), interleaved with the raw TCP
  rounds: GB/s of each, their ratio, and each against raw TCP; plus the time of a tiny step's push
  (connection set-up, and the TLS handshake where there is one);
* **receiver variants** (``--receivers``): the replicator's receive loop against two alternatives,
  each into a preallocated file in B's ramdisk with its crc32c: ``recv_into`` straight into a shared
  mapping of the file (one copy; crc right behind on a second thread) and ``splice`` socket -> pipe ->
  file (no user-space copy; crc through a mapping);
* **end to end**: a step committed in A's ramdisk until its replica is committed on B (adds the
  inotify wake-up and scheduling);
* **restore**: node A lost, time until its rank is staged back from its peer, versus from the bucket
  (fake-gcs-server, memory backend, on this machine) when the peer is lost too;
* **training slowdown**: a CPU training step (torch MLP) timed while idle and while replication runs
  (a new step every ``--interval`` s), unpinned (everything shares the cores) and pinned (training
  on core 0, replicators on the others).

Every transfer path is measured once per round and rounds are interleaved, so a drift of the
machine's load hits all of them; figures are medians over rounds.

Run as root from the repository root: ``.venv/bin/python bench/replicator_bench.py [--size-mib 256]
[--receivers] [--json]``. Needs about 4x ``--size-mib`` of RAM for the ramdisks plus 3x for the
bucket emulator.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
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

from tierckpt.protocol.control import RestoreState, RestoreStatus, read_restore_status
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

MiB = 1 << 20
RAW_PORT = 9555
PLAIN_PORT, TLS_PORT = 9556, 9557
RECEIVERS = ("replicator", "mmap", "splice")
DATA_JOB = "bench_datapath"
"""The job the data path measurements push: assigned on B only (A's own replicator leaves it alone)."""


# ------------------------------------------------------------------------------------------ steps


def make_step(parent: Path, job: str, rank: int, step: int, size: int, world_size: int, blob: bytes) -> Path:
    """Commit a one-file step of ``size`` bytes in the client format (content: ``blob`` repeated)."""
    return write_step("", job, rank, step, world_size=world_size, sizes=(size,), block=blob, parent=parent)


def committed(path: Path) -> bool:
    return (path / "COMMIT").exists()


# ------------------------------------------------------------------------------------------ raw TCP

_RECEIVER = """
import os, socket, sys, time
n = int(sys.argv[1]); dest = sys.argv[3] if len(sys.argv) > 3 else ""
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[2]))); s.listen(1)
fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if dest else -1
if fd >= 0: os.posix_fallocate(fd, 0, n)
print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(4 << 20); view = memoryview(buf); got = 0; t0 = None
while got < n:
    k = c.recv_into(view)
    if not k: break
    if t0 is None: t0 = time.perf_counter()
    if fd >= 0: os.pwrite(fd, view[:k], got)
    got += k
print(got, time.perf_counter() - t0, flush=True)
if fd >= 0: os.close(fd); os.unlink(dest)
"""

_SENDER = """
import socket, sys
n, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]); blob = bytes(4 << 20)
s = socket.create_connection((host, port)); sent = 0
while sent < n:
    k = min(len(blob), n - sent); s.sendall(memoryview(blob)[:k]); sent += k
s.close()
"""


def raw_tcp(a: Node, b: Node, size: int, *, into_ramdisk: bool = False) -> float:
    """Bytes per second of plain Python TCP from A to B: discarded on arrival, or written
    into B's ramdisk (``pwrite`` of each received block, no verification). Timed from the first
    byte to the last (no connection set-up, no preallocation)."""
    dest = [str(b.root / ".bench-raw")] if into_ramdisk else []
    rx = b.popen_in_node(
        [sys.executable, "-c", _RECEIVER, str(size), str(RAW_PORT), *dest], stdout=subprocess.PIPE, text=True
    )
    assert rx.stdout is not None
    assert rx.stdout.readline().strip() == "ready"
    a.run_in_node([sys.executable, "-c", _SENDER, str(size), b.ip, str(RAW_PORT)], check=True)
    got, seconds = rx.stdout.readline().split()
    rx.wait()
    return int(got) / float(seconds)


# ------------------------------------------------------------------------------------------ data path

_PUSH = """
import json, sys, time
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.ipc import PeerAddress, WorkerConfig
from tierckpt_replicator.replication.transfer import push_step
config, job, peer, host, port, steps = sys.argv[1:7]
ctx = DataContext.from_config(WorkerConfig.from_bytes(config.encode()))
out = []
for step in json.loads(steps):
    t0 = time.perf_counter(); o = push_step(ctx, job, 0, step, PeerAddress(peer, host, int(port)))
    out.append([o.status, o.bytes, time.perf_counter() - t0])
print(json.dumps(out))
"""

_DATA_SERVER = """
import sys
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.data_server import DataServer
from tierckpt_replicator.replication.ipc import WorkerConfig
server = DataServer(DataContext.from_config(WorkerConfig.from_bytes(sys.argv[1].encode())))
server.start(); print("ready", flush=True); sys.stdin.read(); server.stop()
"""


def node_config(cluster: LocalCluster, node: Node, *, auth: str, method: str, port: int = 0) -> WorkerConfig:
    """A data plane configuration as ``node``'s worker has it: its certificate (``auth="tls"``) or the
    cluster's token (a token file is made for the plain runs of a TLS cluster)."""
    tls = node.tls_files if auth == "tls" else None
    token = cluster.workdir / "bench-token"
    if auth == "token" and not token.exists():
        token.write_text(secrets.token_urlsafe(24))
    return WorkerConfig(
        node=node.name,
        root=str(node.root),
        listen_host="0.0.0.0",
        data_port=port,
        holder=f"bench-{node.name}",
        transfer_timeout=60.0,
        send_method="mmap" if method == "mmap" else "sendfile",
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
    receiving into B's ramdisk beside B's own replicator."""

    def __init__(self, cluster: LocalCluster) -> None:
        b = cluster.nodes[1]
        self.procs = {}
        for auth, port in (("token", PLAIN_PORT), ("tls", TLS_PORT)):
            config = node_config(cluster, b, auth=auth, method="mmap", port=port).to_bytes().decode()
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
    repeat: int,
    method: str = "mmap",
    *,
    auth: str | None = None,
    port: int | None = None,
) -> list[float]:
    """Bytes per second of push_step A -> B, one per repetition: to B's replicator (the cluster's own
    auth mode), or with ``auth`` to B's data server on ``port``. Timed in full: lease, connection (and
    TLS handshake), header, B's preallocation, the bytes, verification and the commit."""
    a, b = cluster.nodes[0], cluster.nodes[1]
    auth = auth or cluster.auth
    job = DATA_JOB
    steps = list(range(1, repeat + 1))
    for s in steps:
        make_step(rank_dir(a.root, job, 0), job, 0, s, size, 1, blob)
    config = node_config(cluster, a, auth=auth, method=method).to_bytes().decode()
    dest = str(port or b.data_port)
    if auth == "token" and port is None:  # B's replicator checks the cluster's own token
        config = config.replace(str(cluster.workdir / "bench-token"), str(cluster.token_file))
    proc = a.run_in_node(
        [sys.executable, "-c", _PUSH, config, job, b.name, b.ip, dest, json.dumps(steps)], check=True
    )
    rates = []
    for status, nbytes, seconds in json.loads(proc.stdout):
        assert status == "ok", status
        rates.append(nbytes / seconds)
    for s in steps:  # free the ramdisks for what follows
        for p in (step_dir(rank_dir(a.root, job, 0), s), step_dir(replica_rank_dir(b.root, job, 0), s)):
            subprocess.run(["rm", "-rf", str(p)], check=True)
    return rates


def push_latency(cluster: LocalCluster, blob: bytes, auth: str, port: int, repeat: int = 20) -> float:
    """Median seconds of pushing a 4 KiB step (mostly connection set-up, and the TLS handshake)."""
    rates = data_path(cluster, 4096, blob[:4096], repeat, "mmap", auth=auth, port=port)
    return statistics.median(4096 / r for r in rates)


# ------------------------------------------------------------------------------------------ receivers

_RX_VARIANT = """
import ctypes, mmap, os, queue, socket, sys, threading, time
from pathlib import Path
from tierckpt.protocol.integrity import crc32c_address
from tierckpt_replicator.replication.stream import CHUNK, _Ring, receive_file
from tierckpt_replicator.stepio import preallocate
mode, size, port, dest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
_Ring.take().give_back()  # the worker keeps its buffers between transfers
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.settimeout(60); t0 = time.perf_counter()
fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644); preallocate(fd, size, str(dest)); os.close(fd)

def behind(base):  # a thread computing the crc32c of each range right after it was written
    ends, state = queue.SimpleQueue(), {"crc": 0, "done": 0}
    def run():
        while (end := ends.get()) is not None:
            state["crc"] = crc32c_address(base + state["done"], end - state["done"], state["crc"])
            state["done"] = end
    t = threading.Thread(target=run); t.start()
    return ends, t, state

if mode == "replicator":
    fd = os.open(dest, os.O_WRONLY); crc = receive_file(c, fd, size, where=str(dest)); os.close(fd)
else:
    fd = os.open(dest, os.O_RDWR); mm = mmap.mmap(fd, size); head = ctypes.c_char.from_buffer(mm)
    ends, t, state = behind(ctypes.addressof(head)); done = 0
    if mode == "mmap":
        view = memoryview(mm)
        while done < size:
            end = min(done + CHUNK, size)
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
            if done - mark >= CHUNK or done == size:
                ends.put(done); mark = done
    ends.put(None); t.join(); crc = state["crc"]; del head; mm.close(); os.fsync(fd); os.close(fd)
print(size / (time.perf_counter() - t0), crc, flush=True)
dest.unlink()
"""

_TX_FILE = """
import os, socket, sys
from pathlib import Path
from tierckpt_replicator.replication.stream import send_file
path, host, port, method = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
fd = os.open(path, os.O_RDONLY)
with socket.create_connection((host, port)) as s:
    send_file(s, fd, os.fstat(fd).st_size, where=str(path), method=method)
"""


def receiver_variant(a: Node, b: Node, src: Path, want_crc: int, mode: str) -> float:
    """Bytes per second of one receive loop (``replicator``, ``mmap`` or ``splice``) from A's ramdisk
    file into a preallocated file in B's ramdisk, its crc32c checked; timed from the connection on."""
    size = src.stat().st_size
    rx = b.popen_in_node(
        [sys.executable, "-c", _RX_VARIANT, mode, str(size), str(RAW_PORT), str(b.root / ".bench-rx")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    a.run_in_node([sys.executable, "-c", _TX_FILE, str(src), b.ip, str(RAW_PORT), "mmap"], check=True)
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


# ------------------------------------------------------------------------------------------ training

_TRAIN = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1])); seconds = float(sys.argv[2])
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


def _pin(pids: list[int], cpus: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cpus)


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


def training_slowdown(
    cluster: LocalCluster,
    size: int,
    blob: bytes,
    *,
    seconds: float,
    interval: float,
    pin: bool,
    rounds: int = 3,
) -> dict[str, Any]:
    """Median training step time in idle windows vs replicating windows (a new step every ``interval``
    s), interleaved ``rounds`` times in one training process so drifts of the machine's load hit both."""
    a = cluster.nodes[0]
    ncpu = os.cpu_count() or 1
    threads = 1 if pin else ncpu
    reps = [p for n in cluster.nodes if n.proc for p in _tree(n.proc.pid)]
    if pin and ncpu > 1:
        _pin(reps, set(range(1, ncpu)))
    window = seconds / 2
    total = window * 2 * rounds
    loader = _Load(a, cluster.job, size, blob, interval)  # writes its one data file now, before timing
    train = a.popen_in_node(
        [sys.executable, "-c", _TRAIN, str(threads), str(total)], stdout=subprocess.PIPE, text=True
    )
    if pin:
        _pin([train.pid], {0})
    assert train.stdout is not None and train.stdout.readline().strip() == "ready"
    start = time.perf_counter()
    loader.start()
    windows: list[tuple[float, float, str]] = []
    for r in range(rounds):
        for phase in ("idle", "replicating"):
            t0 = start + (2 * r + (phase == "replicating")) * window
            if phase == "replicating":
                loader.active.set()
            time.sleep(max(0.0, t0 + window - time.perf_counter()))
            loader.active.clear()
            windows.append((t0, t0 + window, phase))
    samples = json.loads(train.stdout.readline())
    train.wait()
    loader.stop.set()
    loader.active.set()
    loader.join()
    if loader.error is not None:
        raise loader.error
    if pin and ncpu > 1:
        _pin(reps, set(range(ncpu)))
    phases: dict[str, list[float]] = {"idle": [], "replicating": []}
    for t, d in samples:  # steps wholly inside a window (the load stops within ~0.1 s of its end)
        for lo, hi, phase in windows:
            if lo + 0.2 <= t and t + d <= hi:
                phases[phase].append(d)
    idle, busy = statistics.median(phases["idle"]), statistics.median(phases["replicating"])
    return {
        "threads": threads,
        "pinned": pin,
        "idle_step_ms": idle * 1e3,
        "replicating_step_ms": busy * 1e3,
        "slowdown_pct": (busy / idle - 1) * 100,
        "steps_replicated": loader.count,
        "samples": {k: len(v) for k, v in phases.items()},
    }


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
        "--train-seconds",
        type=float,
        default=8.0,
        help="seconds of one idle + one replicating window; 3 rounds are interleaved [8]",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between replicated steps while training [1]"
    )
    p.add_argument(
        "--receivers", action="store_true", help="also compare receive loops (replicator, mmap, splice)"
    )
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
        help="the cluster's replicators' --auth (the TLS cost is measured either way) [tls]",
    )
    p.add_argument("--skip-tls", action="store_true", help="skip the plain vs TLS data path comparison")
    p.add_argument("--skip-restore", action="store_true", help="skip the restore measurement")
    p.add_argument("--skip-training", action="store_true", help="skip the training slowdown measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    size = args.size_mib * MiB
    blob = secrets.token_bytes(8 * MiB)
    ramdisk = f"{max(512, 8 * args.size_mib)}m"
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "netns": has_netns(),
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
    with LocalCluster(
        nodes=3,
        job="bench_job",
        k=1,
        gcs=not args.skip_restore,
        ramdisk_size=ramdisk,
        replicator_args=args_rep,
        auth=args.auth,
    ) as cluster:
        a, b = cluster.nodes[0], cluster.nodes[1]
        _renice(cluster, 0)  # transfers at the baseline's priority; the training phase restores nice 10
        assign_data_job(cluster)
        servers = None if args.skip_tls or cluster.ca is None else DataServers(cluster)
        other = "mmap" if args.send_method == "sendfile" else "sendfile"
        raws, raws_tmpfs, rates, rates_other = [], [], [], []
        by_auth: dict[str, list[float]] = {"token": [], "tls": []} if servers else {}
        receivers: dict[str, list[float]] = {m: [] for m in RECEIVERS} if args.receivers else {}
        src = make_step(a.root / ".bench-src", "bench_rx", 0, 1, size, 1, blob) / "data-00000.bin"
        src_crc = read_manifest(src.parent).files[0].crc32c
        for _ in range(args.repeat):  # interleaved, so a drift of the machine's load hits every path
            raws.append(raw_tcp(a, b, size))
            raws_tmpfs.append(raw_tcp(a, b, size, into_ramdisk=True))
            rates += data_path(cluster, size, blob, 1, method=args.send_method)
            rates_other += data_path(cluster, size, blob, 1, method=other)
            for auth, out in by_auth.items():
                port = PLAIN_PORT if auth == "token" else TLS_PORT
                out += data_path(cluster, size, blob, 1, args.send_method, auth=auth, port=port)
            for mode, out in receivers.items():
                out.append(receiver_variant(a, b, src, src_crc, mode))
        subprocess.run(["rm", "-rf", str(src.parent.parent)], check=True)
        if servers is not None:
            med = statistics.median
            raw = med(raws)
            plain, tls = med(by_auth["token"]), med(by_auth["tls"])
            result["tls"] = {
                "plain_gbps": plain / 1e9,
                "tls_gbps": tls / 1e9,
                "tls_over_plain": tls / plain,
                "plain_over_raw_tcp": plain / raw,
                "tls_over_raw_tcp": tls / raw,
                "small_push_ms": {
                    auth: push_latency(cluster, blob, auth, PLAIN_PORT if auth == "token" else TLS_PORT) * 1e3
                    for auth in ("token", "tls")
                },
                "rounds_gbps": {k: [r / 1e9 for r in v] for k, v in by_auth.items()},
            }
            servers.close()
        e2e = end_to_end(cluster, size, blob, args.repeat)
        med = statistics.median
        result["raw_tcp_gbps"] = med(raws) / 1e9
        result["raw_tcp_into_ramdisk_gbps"] = med(raws_tmpfs) / 1e9
        result["data_path_gbps"] = med(rates) / 1e9
        result["data_path_over_raw_tcp"] = med(rates) / med(raws)
        result["data_path_over_raw_tcp_into_ramdisk"] = med(rates) / med(raws_tmpfs)
        result["data_path_by_send_method_gbps"] = {
            args.send_method: med(rates) / 1e9,
            other: med(rates_other) / 1e9,
        }
        result["receivers_gbps"] = {m: med(v) / 1e9 for m, v in receivers.items()}
        result["rounds_gbps"] = {
            "raw_tcp": [r / 1e9 for r in raws],
            "raw_tcp_into_ramdisk": [r / 1e9 for r in raws_tmpfs],
            "data_path": [r / 1e9 for r in rates],
            f"data_path_{other}": [r / 1e9 for r in rates_other],
            **{f"receiver_{m}": [r / 1e9 for r in v] for m, v in receivers.items()},
        }
        result["end_to_end_seconds"] = med(e2e)
        result["end_to_end_gbps"] = size / med(e2e) / 1e9
        _renice(cluster, 10)
        if not args.skip_training:
            kw = {"seconds": args.train_seconds, "interval": args.interval}
            result["training"] = [training_slowdown(cluster, size, blob, pin=False, **kw)]
            if (os.cpu_count() or 1) > 1:
                result["training"].append(training_slowdown(cluster, size, blob, pin=True, **kw))
        if not args.skip_restore:
            result["restore"] = restore_times(cluster, size, blob)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _print_table(r: dict[str, Any]) -> None:
    m = r["machine"]
    print(f"machine: {m['cpus']} cpus, kernel {m['kernel']}, python {m['python']}, netns={m['netns']}")
    print(f"step size: {r['size_bytes'] / MiB:.0f} MiB (one rank); transfers: medians of interleaved rounds")
    print(f"raw TCP A->B (discarded)         {r['raw_tcp_gbps']:.2f} GB/s")
    print(f"raw TCP A->B into B's ramdisk    {r['raw_tcp_into_ramdisk_gbps']:.2f} GB/s")
    ratio, ratio_ram = r["data_path_over_raw_tcp"], r["data_path_over_raw_tcp_into_ramdisk"]
    print(
        f"replication data path A->B       {r['data_path_gbps']:.2f} GB/s  ({r['send_method']}) "
        f"= {ratio:.2f}x raw TCP, {ratio_ram:.2f}x raw TCP into the ramdisk"
    )
    for method, gbps in r["data_path_by_send_method_gbps"].items():
        if method != r["send_method"]:
            print(f"  ... sending with {method}{' ' * (14 - len(method))} {gbps:.2f} GB/s")
    for mode, gbps in r.get("receivers_gbps", {}).items():
        print(f"receive loop '{mode}'{' ' * (12 - len(mode))} {gbps:.2f} GB/s  (file in B's ramdisk, crc32c)")
    if "tls" in r:
        t = r["tls"]
        plain, tls = t["plain_over_raw_tcp"], t["tls_over_raw_tcp"]
        print(f"data path, plain TCP (token)     {t['plain_gbps']:.2f} GB/s = {plain:.2f}x raw TCP")
        print(
            f"data path, mutual TLS            {t['tls_gbps']:.2f} GB/s = {tls:.2f}x raw TCP "
            f"= {t['tls_over_plain']:.2f}x plain"
        )
        ms = t["small_push_ms"]
        print(f"push of a 4 KiB step             {ms['token']:.1f} ms plain, {ms['tls']:.1f} ms TLS")
    print(
        f"commit on A -> replica on B      {r['end_to_end_seconds']:.3f} s  ({r['end_to_end_gbps']:.2f} GB/s)"
    )
    for t in r.get("training", []):
        print(
            f"training step ({'pinned' if t['pinned'] else 'unpinned'}, {t['threads']} threads): idle "
            f"{t['idle_step_ms']:.1f} ms, while replicating {t['replicating_step_ms']:.1f} ms "
            f"-> slowdown {t['slowdown_pct']:+.1f}% ({t['steps_replicated']} steps replicated)"
        )
    if "restore" in r:
        x = r["restore"]
        print(
            f"restore a lost node's rank: from peer {x['peer_seconds']:.2f} s, from bucket (emulator) "
            f"{x['gcs_seconds']:.2f} s -> bucket/peer {x['gcs_over_peer']:.1f}x"
        )


if __name__ == "__main__":
    tempfile.tempdir = tempfile.gettempdir()
    sys.exit(main())
