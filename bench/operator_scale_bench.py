"""The real operator at thousands of nodes: from the last pod scheduled to the peer plan at every
replicator, and after one node is replaced, to the new plans everywhere.

Three processes, as in a cluster: the Kubernetes API (the tests' emulator, ``KubeEmulator``, in this
process: it also plays the scheduler and the Job controller), the operator (``python -m
tierckpt_operator``, production settings, mutual TLS to the replicators with the certificate it issues
itself from the tierckpt CA) and the replicators (``tests/fixtures/fake_replicators.py``: one mutual-TLS
endpoint per node, each with its node's certificate, answering the control API the operator calls).

Phases, each timed from the moment the API server acknowledged the last scheduling write:

1. ``deliver``: a JobSet of ``--nodes`` single-pod jobs; every pod scheduled; until every replicator
   holds its peer plan (and, reported too, the job's policy and its restore plan);
2. ``replace``: one pod fails and the Job controller replaces it on a new node (with its replicator);
   until every replicator whose peer plan changed holds it and the new node holds peers, policy and
   restore plan.

It also reports the operator's CPU seconds per phase (from /proc) and the TLS connections the
replicators accepted. Pods are created straight in the API (no admission webhook: the training pods'
injected volumes play no part here), with the labels the JobSet webhook gives them.

Run from the repository root: ``.venv/bin/python bench/operator_scale_bench.py --nodes 1024``
(``--json`` for one JSON object). docs/benchmarks.md has the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), *(str(REPO / d) for d in ("client", "operator", "demo"))]

import kmock  # noqa: E402

from tests.fixtures.fake_replicators import issue_node_files  # noqa: E402
from tests.fixtures.k8s_emulator import KubeEmulator  # noqa: E402
from tests.operator.operator_harness import (  # noqa: E402
    REPLICATOR_LABELS,
    REPLICATOR_SA,
    SYSTEM_NS,
    ZONE,
    TierckptCA,
    load_crds,
    make_tls,
)
from tierckpt_demo.ports import free_port, free_ports  # noqa: E402

NS = "team"
JOB = "train"
PODS = f"/api/v1/namespaces/{NS}/pods"
SYS_PODS = f"/api/v1/namespaces/{SYSTEM_NS}/pods"
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/report", timeout=60) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


async def ok(resp: Any, *codes: int) -> dict[str, Any]:
    text = await resp.text()
    assert resp.status in (codes or (200, 201)), (resp.status, text[:500])
    out: dict[str, Any] = json.loads(text)
    return out


class Bench:
    def __init__(self, kube: Any, nodes: int, base: Path) -> None:
        self.kube, self.n, self.base = kube, nodes, base
        self.names = [f"node-{i:05d}" for i in range(nodes + 1)]  # the last one replaces a node
        self.ports = free_ports(nodes + 1)
        self.report_port = free_port()
        self.ca = TierckptCA.make(base / "ca")
        self.ds_uid = ""
        self.js_uid = ""

    # -- the replicators

    def start_replicators(self) -> subprocess.Popen[bytes]:
        ids = self.base / "ids"
        ids.mkdir()
        started = time.monotonic()
        for name in self.names:
            issue_node_files(self.ca.cert, self.ca.key, name, ids)
        print(f"  {len(self.names)} node identities issued in {time.monotonic() - started:.1f}s", flush=True)
        spec = {
            "ca": str(self.ca.cert),
            "dir": str(ids),
            "report_port": self.report_port,
            "ready_file": str(self.base / "replicators.ready"),
            "nodes": [[n, p] for n, p in zip(self.names, self.ports, strict=True)],
        }
        (self.base / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fixtures.fake_replicators", "--spec", str(self.base / "spec.json")],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:4])},
        )
        deadline = time.monotonic() + 300
        while not (self.base / "replicators.ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the replicators did not start"
            time.sleep(0.2)
        return proc

    # -- the API

    async def setup_cluster(self) -> None:
        for crd in load_crds():
            await ok(await self.kube.post(CRDS, json=crd))
        for ns in (SYSTEM_NS, NS):
            await ok(await self.kube.post("/api/v1/namespaces", json={"metadata": {"name": ns}}))
        config = {
            "apiVersion": "tierckpt.io/v1alpha1",
            "kind": "CheckpointConfiguration",
            "metadata": {"name": "default"},
            "spec": {
                "gcs": {"bucket": "ckpt-bucket"},
                "replication": {"factor": 2, "failureDomainLabel": ZONE},
            },
        }
        await ok(await self.kube.post("/apis/tierckpt.io/v1alpha1/checkpointconfigurations", json=config))
        ds = {"metadata": {"name": "tierckpt-replicator", "labels": dict(REPLICATOR_LABELS)}, "spec": {}}
        made = await ok(await self.kube.post(f"/apis/apps/v1/namespaces/{SYSTEM_NS}/daemonsets", json=ds))
        self.ds_uid = made["metadata"]["uid"]
        started = time.monotonic()
        await self._each(range(self.n), self.add_node)
        print(f"  {self.n} nodes and replicator pods in {time.monotonic() - started:.1f}s", flush=True)

    async def _each(self, items: Any, fn: Any, at_once: int = 16) -> None:
        slots = asyncio.Semaphore(at_once)

        async def one(item: Any) -> None:
            async with slots:
                await fn(item)

        await asyncio.gather(*(one(i) for i in items))

    async def add_node(self, i: int) -> None:
        name = self.names[i]
        labels = {ZONE: f"zone-{i % 8}", "kubernetes.io/hostname": name}
        await ok(await self.kube.post("/api/v1/nodes", json={"metadata": {"name": name, "labels": labels}}))
        owner = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": "tierckpt-replicator",
            "uid": self.ds_uid,
            "controller": True,
        }
        pod = {
            "metadata": {
                "name": f"replicator-{name}",
                "labels": dict(REPLICATOR_LABELS),
                "annotations": {
                    "tierckpt.io/replicator-endpoint": f"https://127.0.0.1:{self.ports[i]}/?data=1"
                },
                "ownerReferences": [owner],
            },
            "spec": {"nodeName": name, "serviceAccountName": REPLICATOR_SA, "containers": [{"name": "r"}]},
        }
        await ok(await self.kube.post(SYS_PODS, json=pod))
        status = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        }
        await ok(await self.kube.patch(f"{SYS_PODS}/replicator-{name}/status", json={"status": status}))

    async def create_jobset(self) -> None:
        template = {
            "metadata": {"labels": {"tierckpt.io/managed": "true"}},
            "spec": {"containers": [{"name": "t"}]},
        }
        opted = {"tierckpt.io/enabled": "true", "tierckpt.io/config": "default"}
        body = {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": JOB, "annotations": opted},
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "w",
                        "replicas": self.n,
                        "template": {
                            "spec": {
                                "parallelism": 1,
                                "completions": 1,
                                "completionMode": "Indexed",
                                "template": template,
                            }
                        },
                    }
                ],
                "network": {"enableDNSHostnames": True},
            },
        }
        js = await ok(await self.kube.post(JOBSETS, json=body))
        self.js_uid = js["metadata"]["uid"]

    def pod_body(self, j: int, suffix: str) -> dict[str, Any]:
        labels = {
            "tierckpt.io/managed": "true",
            "jobset.sigs.k8s.io/jobset-name": JOB,
            "jobset.sigs.k8s.io/jobset-uid": self.js_uid,
            "jobset.sigs.k8s.io/replicatedjob-name": "w",
            "jobset.sigs.k8s.io/job-index": str(j),
            "jobset.sigs.k8s.io/job-global-index": str(j),
            "jobset.sigs.k8s.io/restart-attempt": "0",
            "batch.kubernetes.io/job-completion-index": "0",
        }
        return {
            "metadata": {"name": f"{JOB}-w-{j}-0-{suffix}", "labels": labels},
            "spec": {"containers": [{"name": "t"}], "hostname": f"{JOB}-w-{j}-0", "subdomain": JOB},
        }

    async def schedule(self, pod: str, node: str) -> None:
        await ok(await self.kube.patch(f"{PODS}/{pod}", json={"spec": {"nodeName": node}}))
        status = {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1"}
        await ok(await self.kube.patch(f"{PODS}/{pod}/status", json={"status": status}))


async def wait_until(check: Any, timeout: float, what: str) -> Any:
    """Poll ``check`` (blocking: in a thread, so the API server in this loop keeps serving)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.25)


def received_after(rep: dict[str, Any], what: str, since: float) -> dict[str, float]:
    return {
        n: r["received"][what][1]
        for n, r in rep.items()
        if what in r["received"] and r["received"][what][1] >= since
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="opscale-"))
    n = args.nodes
    out: dict[str, Any] = {
        "nodes": n,
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "load_before": os.getloadavg()[0],
    }
    async with KubeEmulator() as kube, kmock.Server(kube):
        bench = Bench(kube, n, base)
        replicators = bench.start_replicators()
        operator: subprocess.Popen[bytes] | None = None
        try:
            await bench.setup_cluster()
            webhook = free_port()
            log = open(base / "operator.log", "wb")  # noqa: SIM115 - lives with the process
            operator = subprocess.Popen(
                [
                    sys.executable,
                    *(["-m", "cProfile", "-o", args.profile] if args.profile else []),
                    "-m",
                    "tierckpt_operator",
                    "--server",
                    str(kube.url).rstrip("/"),
                    "--namespace",
                    SYSTEM_NS,
                    "--auth",
                    "tls",
                    "--ca-cert-file",
                    str(bench.ca.cert),
                    "--ca-key-file",
                    str(bench.ca.key),
                    "--issuer-port",
                    str(free_port()),
                    "--issuer-addr",
                    "127.0.0.1",
                    "--issuer-names",
                    "127.0.0.1",
                    "--replicator-service-account",
                    REPLICATOR_SA,
                    "--webhook-port",
                    str(webhook),
                    "--webhook-addr",
                    "127.0.0.1",
                    "--webhook-cert-dir",
                    str(make_tls(base / "webhook")),
                    "--metrics-port",
                    "0",
                    "--log-level",
                    args.log_level,
                ],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": args.operator_path} if args.operator_path else None,
            )
            await wait_until(lambda: _port_open(webhook), 60, "the operator")
            await asyncio.sleep(2.0)  # its watches listed the nodes and replicators
            await bench.create_jobset()
            pods = [bench.pod_body(j, "a") for j in range(n)]
            started = time.monotonic()
            await bench._each(pods, lambda p: kube.post(PODS, json=p))
            print(f"  {n} pods created in {time.monotonic() - started:.1f}s", flush=True)
            cpu0 = cpu_seconds(operator.pid)
            await bench._each(range(n), lambda j: bench.schedule(pods[j]["metadata"]["name"], bench.names[j]))
            t0 = time.time()
            print(f"  the last pod scheduled at {t0:.3f} (operator log: {base / 'operator.log'})", flush=True)
            names = set(bench.names[:n])

            def delivered() -> dict[str, Any] | None:
                rep = {k: v for k, v in report(bench.report_port).items() if k in names}
                got = received_after(rep, "peers", 0)
                return rep if len(got) == n else None

            rep = await wait_until(delivered, args.timeout, "peers at every replicator")
            cpu1 = cpu_seconds(operator.pid)
            peers = received_after(rep, "peers", 0)
            out["deliver_peers_s"] = max(peers.values()) - t0
            out["deliver_operator_cpu_s"] = cpu1 - cpu0

            def planned() -> dict[str, Any] | None:
                rep = {k: v for k, v in report(bench.report_port).items() if k in names}
                return rep if len(received_after(rep, "restore-plan", 0)) == n else None

            rep = await wait_until(planned, args.timeout, "the restore plan at every replicator")
            for what in ("policy", "restore-plan"):
                got = received_after(rep, what, 0)
                out[f"deliver_{what.replace('-', '_')}_s"] = max(got.values()) - t0
            out["deliver_connections"] = sum(r["connections"] for r in rep.values())
            out["deliver_connections_max"] = max(r["connections"] for r in rep.values())
            out["deliver_requests"] = sum(r["requests"] for r in rep.values())
            out["deliver_peers_bytes_max"] = max(r["received"]["peers"][2] for r in rep.values())
            phase = {k: v for k, v in out.items() if k.startswith("deliver")}
            print(f"  deliver: {json.dumps(phase)}", flush=True)
            await asyncio.sleep(args.settle)

            # -- one node replaced
            victim = n // 2
            now = await asyncio.to_thread(report, bench.report_port)
            before = {k: v["received"].get("peers", [0, 0])[0] for k, v in now.items()}
            connections = sum(r["connections"] for r in now.values())
            await bench.add_node(n)
            cpu0 = cpu_seconds(operator.pid)
            await ok(await kube.delete(f"{PODS}/{pods[victim]['metadata']['name']}"))
            new = bench.pod_body(victim, "b")
            await ok(await kube.post(PODS, json=new))
            await bench.schedule(new["metadata"]["name"], bench.names[n])
            t1 = time.time()
            newcomer = bench.names[n]

            def replanned() -> dict[str, Any] | None:
                rep = report(bench.report_port)
                got = rep[newcomer]["received"]
                if not all(w in got and got[w][1] >= t1 for w in ("peers", "policy", "restore-plan")):
                    return None
                return rep

            rep = await wait_until(replanned, args.timeout, "the new node's plans")
            await asyncio.sleep(args.settle)  # any node still to get its new view gets it by now
            rep = await asyncio.to_thread(report, bench.report_port)
            cpu1 = cpu_seconds(operator.pid)
            changed = {
                k: v["received"]["peers"][1]
                for k, v in rep.items()
                if "peers" in v["received"] and v["received"]["peers"][0] != before.get(k, 0)
            }
            out["replace_nodes_sent_new_peers"] = len(changed)
            out["replace_all_plans_s"] = (
                max(
                    max(changed.values()),
                    *(rep[newcomer]["received"][w][1] for w in ("policy", "restore-plan")),
                )
                - t1
            )
            out["replace_operator_cpu_s"] = cpu1 - cpu0
            out["replace_connections"] = sum(r["connections"] for r in rep.values()) - connections
            out["load_after"] = os.getloadavg()[0]
        finally:
            for proc in (operator, replicators):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    return out


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=600.0, help="give up on a phase after this long [s]")
    p.add_argument("--settle", type=float, default=3.0, help="wait between phases [s]")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--profile", default="", help="profile the operator's main thread into this file")
    p.add_argument(
        "--operator-path",
        default="",
        help="PYTHONPATH of the operator process (another checkout's client:operator, for a baseline)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, help="also write the figures here, as JSON")
    args = p.parse_args(argv)
    out = asyncio.run(run(args))
    if args.out:
        args.out.write_text(json.dumps(out))
    print(json.dumps(out, indent=1) if args.json else "\n".join(f"{k:32s} {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
