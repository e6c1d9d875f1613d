"""End-to-end harness for the operator: what surrounds it in a real cluster, emulated faithfully.

* ``Replicators``: real ``tierckpt-replicator`` processes on loopback, one per node, each with its
  own ramdisk directory (the console script, never imported). Each gets its certificate the way it
  does in a cluster: its projected ServiceAccount token (registered with the API emulator, bound to its
  pod and node) sent to the operator's signing endpoint, which reviews it with a TokenReview.
* ``Apiserver``: creates objects the way kube-apiserver does with our mutating webhooks: it sends an
  ``admission.k8s.io/v1`` AdmissionReview over HTTPS (verifying the webhook's certificate), applies
  the returned JSON patch, and stores the result in the API emulator.
* ``Cluster``: what the JobSet controller, the Job controller, the scheduler and the kubelet do:
  create pods with JobSet labels, bind them to nodes, report them running, restart a JobSet.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import datetime
import functools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import jsonpatch
import kmock
import yaml

from tests.fixtures.shared_data import JOBSET_CRD, require_jobset_crd
from tierckpt.protocol.certs import Authority, new_key, write_identity
from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.identity import TlsCredentials, TlsFiles
from tierckpt_demo.ports import free_port, free_ports
from tierckpt_operator.__main__ import build_runtime, run
from tierckpt_operator.runtime import Runtime
from tierckpt_operator.settings import Settings

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "charts" / "tierckpt" / "crds"
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=1)
def _crd_documents() -> tuple[str, ...]:
    paths = [*sorted(CRD_DIR.glob("*.yaml")), JOBSET_CRD]
    return tuple(json.dumps(yaml.load(p.read_text(), Loader=_YAML_LOADER)) for p in paths)


def load_crds() -> list[dict]:
    """Our CRDs (from the chart) and the JobSet CRD (from ../shared/k8s, never copied)."""
    require_jobset_crd()
    return [json.loads(doc) for doc in _crd_documents()]


ZONE = "topology.kubernetes.io/zone"
SYSTEM_NS = "tierckpt-system"
REPLICATOR_LABELS = {"app.kubernetes.io/name": "tierckpt", "app.kubernetes.io/component": "replicator"}
REPLICATOR_SA = "tierckpt-replicator"
REPLICATOR_DS = "tierckpt-replicator"
AUDIENCE = "tierckpt"
POD_EXTRA = "authentication.kubernetes.io/"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets"
CONFIGS = "/apis/tierckpt.io/v1alpha1/checkpointconfigurations"
CKJOBS = "/apis/tierckpt.io/v1alpha1/namespaces/{ns}/checkpointjobs"
PODS = "/api/v1/namespaces/{ns}/pods"


async def port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


async def eventually(check: Callable[[], Awaitable[T] | T], timeout: float = 20.0, what: str = "") -> T:
    """Poll ``check`` until it returns a truthy value (no fixed sleeps in assertions)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = check()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            last = value
        except (AssertionError, KeyError, LookupError, httpx.TransportError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}: last {last!r}")
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------------------------ TLS


def make_tls(directory: Path) -> Path:
    """A CA and a serving certificate for 127.0.0.1 (tls.crt, tls.key, ca.crt), as the chart makes."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tierckpt-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tierckpt-webhook")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    (directory / "tls.crt").write_bytes(cert.public_bytes(pem))
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "tls.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return directory


@dataclass(frozen=True)
class TierckptCA:
    """The release's tierckpt CA as the chart makes it (the CA Secret's tls.crt and tls.key), and the
    harness's own operator-role certificate (for its readiness probes)."""

    dir: Path

    @classmethod
    def make(cls, directory: Path) -> TierckptCA:
        directory.mkdir(parents=True, exist_ok=True)
        authority = Authority.create("tierckpt-e2e-ca")
        authority.save(directory / "tls.crt", directory / "tls.key")
        key = new_key()
        cert = authority.operator_certificate(key.public_key(), datetime.timedelta(days=1))
        write_identity(directory / "harness.pem", key, cert)
        return cls(directory)

    @property
    def cert(self) -> Path:
        return self.dir / "tls.crt"

    @property
    def key(self) -> Path:
        return self.dir / "tls.key"

    def probe_credentials(self) -> TlsCredentials:
        return TlsCredentials(TlsFiles(self.dir / "harness.pem", ca=self.cert))


# ------------------------------------------------------------------------------------ replicators


@dataclass
class Node:
    name: str
    zone: str
    root: Path
    api_port: int
    data_port: int
    probe_port: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    token_file: Path | None = None
    """The pod's projected ServiceAccount token (audience tierckpt)."""

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.api_port}/?data={self.data_port}"


class Replicators:
    """Real replicator daemons, one per emulated node, on loopback ports, each asking ``issuer_url`` (the
    operator's signing endpoint) for its certificate; ``gcs_url``: the GCS endpoint (a fake-gcs-server)
    they reach the buckets of the jobs' policies through."""

    def __init__(self, base: Path, ca: TierckptCA, issuer_url: str, gcs_url: str = "") -> None:
        self.base, self.ca, self.issuer_url, self.gcs_url = base, ca, issuer_url, gcs_url
        self.nodes: dict[str, Node] = {}

    def prepare(self, name: str, zone: str) -> Node:
        """The node's directories and ports (its replicator not started yet)."""
        root = self.base / name / "ramdisk"
        root.mkdir(parents=True, exist_ok=True)
        node = Node(name, zone, root, *free_ports(3), log=self.base / name / "replicator.log")
        node.token_file = self.base / name / "sa-token"
        self.nodes[name] = node
        return node

    async def start(self, node: Node) -> Node:
        name, zone, root = node.name, node.zone, node.root
        exe = Path(sys.executable).with_name("tierckpt-replicator")
        args = [
            str(exe),
            "--node-name",
            name,
            "--root",
            str(root),
            "--auth",
            "tls",
            "--tls-ca",
            str(self.ca.cert),
            "--issuer-url",
            self.issuer_url,
            "--issuer-token-file",
            str(node.token_file),
            "--listen-host",
            "127.0.0.1",
            "--advertise-host",
            "127.0.0.1",
            "--api-port",
            str(node.api_port),
            "--data-port",
            str(node.data_port),
            "--probe-port",
            str(node.probe_port),
            "--domain",
            zone,
            "--poll-interval",
            "0.5",
            "--reconcile-interval",
            "2",
            "--inventory-timeout",
            "1",
            "--log-level",
            "INFO",
        ]
        if self.gcs_url:
            args += ["--gcs-endpoint", self.gcs_url, "--backup-poll-interval", "2"]
        assert node.log is not None
        with open(node.log, "wb") as out:
            node.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return node

    async def wait_ready(self, *names: str, timeout: float = 30.0) -> None:
        """Each replicator answers /readyz 200 over mutual TLS as its own node (so it has its certificate)."""
        async with ReplicatorClient(tls=self.ca.probe_credentials(), timeout=2) as client:

            async def ready(node: Node) -> None:
                async def ok() -> bool:
                    if node.proc is not None and node.proc.poll() is not None:
                        raise RuntimeError(f"replicator {node.name} exited: {node.log.read_text()[-2000:]}")
                    return await client.ready(node.endpoint, timeout=2, node=node.name)

                await eventually(ok, timeout, f"replicator {node.name} ready")

            await asyncio.gather(*(ready(self.nodes[n]) for n in names or list(self.nodes)))

    def kill(self, name: str) -> None:
        """The node is gone: its replicator dies with it (SIGKILL, no graceful backup)."""
        node = self.nodes[name]
        if node.proc is not None and node.proc.poll() is None:
            os.killpg(node.proc.pid, 9)
            node.proc.wait(10)

    def close(self) -> None:
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.proc.pid, 15)
        for node in self.nodes.values():
            if node.proc is not None:
                try:
                    node.proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(node.proc.pid, 9)
                    node.proc.wait(5)


# ------------------------------------------------------------------------------------ apiserver


@dataclass
class Apiserver:
    """Create objects through the mutating webhooks, as kube-apiserver does."""

    kube: Any
    webhook: str
    ca_file: Path
    reviews: list[dict[str, Any]] = field(default_factory=list)

    async def review(
        self, path: str, body: dict[str, Any], gvr: tuple[str, str, str], kind: str, namespace: str
    ) -> dict[str, Any]:
        """Send one AdmissionReview; returns its ``response``."""
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": gvr[0], "version": gvr[1], "kind": kind},
                "resource": {"group": gvr[0], "version": gvr[1], "resource": gvr[2]},
                "requestKind": {"group": gvr[0], "version": gvr[1], "kind": kind},
                "namespace": namespace,
                "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
                "object": body,
                "oldObject": None,
                "dryRun": False,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
            },
        }
        async with httpx.AsyncClient(verify=str(self.ca_file), timeout=10) as client:
            resp = await client.post(f"{self.webhook}{path}", json=review)
        resp.raise_for_status()
        answer = resp.json()
        assert answer["kind"] == "AdmissionReview" and answer["response"]["uid"] == review["request"]["uid"]
        self.reviews.append(answer)
        return answer["response"]

    async def create(
        self,
        url: str,
        body: dict[str, Any],
        *,
        webhook: str | None,
        gvr: tuple[str, str, str],
        kind: str,
        namespace: str,
    ) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body.setdefault("metadata", {}).setdefault("namespace", namespace)
        if webhook is not None:
            response = await self.review(webhook, body, gvr, kind, namespace)
            if not response["allowed"]:
                raise AdmissionRefused(response.get("status", {}).get("message", ""))
            if "patch" in response:
                assert response["patchType"] == "JSONPatch"
                ops = json.loads(base64.b64decode(response["patch"]))
                body = jsonpatch.apply_patch(body, ops)
        resp = await self.kube.post(url, json=body)
        assert resp.status == 201, await resp.text()
        return json.loads(await resp.text())


class AdmissionRefused(Exception):
    pass


# ------------------------------------------------------------------------------------ the cluster


def jobset_body(
    name: str,
    replicated: list[tuple[str, int, int]],
    *,
    config: str | None = "default",
    enabled: str = "true",
    indexed: bool = True,
) -> dict[str, Any]:
    annotations = {"tierckpt.io/enabled": enabled}
    if config is not None:
        annotations["tierckpt.io/config"] = config
    rjobs = []
    for rname, replicas, parallelism in replicated:
        job_spec: dict[str, Any] = {
            "parallelism": parallelism,
            "completions": parallelism,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "example/trainer:1",
                            "env": [{"name": "TIERCKPT_ROOT", "value": "/user-choice"}],
                        }
                    ],
                },
            },
        }
        if indexed:
            job_spec["completionMode"] = "Indexed"
        rjobs.append({"name": rname, "replicas": replicas, "template": {"spec": job_spec}})
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"replicatedJobs": rjobs, "network": {"enableDNSHostnames": True}},
    }


class Cluster:
    """The emulated control plane around the operator: nodes, JobSet controller, scheduler, kubelet."""

    def __init__(self, kube: Any, apiserver: Apiserver) -> None:
        self.kube, self.api = kube, apiserver

    # -- raw object access

    def obj(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.kube.objects or self.kube.objects[key].deleted:
            return None
        return self.kube.objects[key].raw

    def objs(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        out = []
        plural = resource.rsplit("/", 1)[-1]
        for (res, ns, _), o in self.kube.objects.items():
            if str(res.plural) == plural and (namespace is None or ns == namespace) and not o.deleted:
                out.append(o.raw)
        return out

    async def patch(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.kube.patch(url, json=body)
        assert resp.status == 200, await resp.text()
        return json.loads(await resp.text())

    async def delete(self, url: str) -> None:
        resp = await self.kube.delete(url)
        assert resp.status in (200, 404), await resp.text()

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        evs = self.objs("v1/events")
        return [e for e in evs if reason is None or e.get("reason") == reason]

    # -- nodes and replicators

    async def namespace(self, name: str) -> None:
        await self.kube.post("/api/v1/namespaces", json={"metadata": {"name": name}})

    async def replicator_daemonset(self) -> str:
        """The replicators' DaemonSet (created once): the controller of every replicator pod; its uid."""
        url = f"/apis/apps/v1/namespaces/{SYSTEM_NS}/daemonsets"
        found = self.obj("apps/v1/daemonsets", SYSTEM_NS, REPLICATOR_DS)
        if found is None:
            body = {"metadata": {"name": REPLICATOR_DS, "labels": dict(REPLICATOR_LABELS)}, "spec": {}}
            resp = await self.kube.post(url, json=body)
            assert resp.status == 201, await resp.text()
            found = json.loads(await resp.text())
        return found["metadata"]["uid"]

    async def add_node(self, node: Node) -> str:
        """The Node, and its replicator pod as the DaemonSet controller and the scheduler make it: bound
        to the node, running as the replicators' ServiceAccount, not ready yet. Returns the pod's uid."""
        body = {
            "metadata": {"name": node.name, "labels": {ZONE: node.zone, "kubernetes.io/hostname": node.name}}
        }
        resp = await self.kube.post("/api/v1/nodes", json=body)
        assert resp.status == 201, await resp.text()
        owner = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": REPLICATOR_DS,
            "uid": await self.replicator_daemonset(),
            "controller": True,
            "blockOwnerDeletion": True,
        }
        pod = {
            "metadata": {
                "name": f"replicator-{node.name}",
                "labels": dict(REPLICATOR_LABELS),
                "annotations": {"tierckpt.io/replicator-endpoint": node.endpoint},
                "ownerReferences": [owner],
            },
            "spec": {
                "nodeName": node.name,
                "serviceAccountName": REPLICATOR_SA,
                "containers": [{"name": "replicator", "image": "tierckpt"}],
            },
        }
        resp = await self.kube.post(PODS.format(ns=SYSTEM_NS), json=pod)
        assert resp.status == 201, await resp.text()
        status = {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1"}
        await self.patch(f"{PODS.format(ns=SYSTEM_NS)}/replicator-{node.name}/status", {"status": status})
        return json.loads(await resp.text())["metadata"]["uid"]

    async def mark_ready(self, node: Node) -> None:
        """The kubelet's readiness probe passes."""
        status = {"conditions": [{"type": "Ready", "status": "True"}]}
        await self.patch(f"{PODS.format(ns=SYSTEM_NS)}/replicator-{node.name}/status", {"status": status})

    async def remove_node(self, name: str) -> None:
        await self.delete(f"{PODS.format(ns=SYSTEM_NS)}/replicator-{name}")
        await self.delete(f"/api/v1/nodes/{name}")

    async def config(self, name: str = "default", **spec: Any) -> dict[str, Any]:
        body = {
            "apiVersion": "tierckpt.io/v1alpha1",
            "kind": "CheckpointConfiguration",
            "metadata": {"name": name},
            "spec": {
                "gcs": {"bucket": "ckpt-bucket"},
                "replication": {"factor": 1, "failureDomainLabel": ZONE},
                **spec,
            },
        }
        resp = await self.kube.post(CONFIGS, json=body)
        assert resp.status == 201, await resp.text()
        return json.loads(await resp.text())

    # -- JobSets and their pods

    async def create_jobset(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.api.create(
            JOBSETS.format(ns=namespace),
            body,
            webhook="/mutate-jobsets",
            gvr=("jobset.x-k8s.io", "v1alpha2", "jobsets"),
            kind="JobSet",
            namespace=namespace,
        )

    def jobset(self, namespace: str, name: str) -> dict[str, Any]:
        js = self.obj("jobset.x-k8s.io/v1alpha2/jobsets", namespace, name)
        assert js is not None, f"JobSet {namespace}/{name} not found"
        return js

    def checkpoint_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.obj("tierckpt.io/v1alpha1/checkpointjobs", namespace, name)

    def pods(self, namespace: str, jobset: str, attempt: int | None = None) -> list[dict[str, Any]]:
        out = []
        for pod in self.objs("v1/pods", namespace):
            labels = pod["metadata"].get("labels", {})
            if labels.get("jobset.sigs.k8s.io/jobset-name") != jobset:
                continue
            if attempt is None or labels.get("jobset.sigs.k8s.io/restart-attempt") == str(attempt):
                out.append(pod)
        return out

    async def create_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """What the JobSet and Job controllers do for the JobSet's current restart attempt."""
        js = self.jobset(namespace, name)
        attempt = (js.get("status") or {}).get("restarts", 0)
        created, global_index = [], 0
        for rj in js["spec"]["replicatedJobs"]:
            job_spec = rj["template"]["spec"]
            for j in range(rj.get("replicas", 1)):
                for c in range(job_spec.get("parallelism", 1)):
                    created.append(
                        await self._create_pod(namespace, js, rj, job_spec, j, global_index, c, attempt)
                    )
                global_index += 1
        return created

    async def _create_pod(
        self,
        ns: str,
        js: dict[str, Any],
        rj: dict[str, Any],
        job_spec: dict[str, Any],
        j: int,
        gj: int,
        c: int,
        attempt: int,
    ) -> dict[str, Any]:
        name = js["metadata"]["name"]
        template = copy.deepcopy(job_spec["template"])
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        labels.update(
            {
                "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/jobset-uid": js["metadata"]["uid"],
                "jobset.sigs.k8s.io/replicatedjob-name": rj["name"],
                "jobset.sigs.k8s.io/job-index": str(j),
                "jobset.sigs.k8s.io/job-global-index": str(gj),
                "jobset.sigs.k8s.io/restart-attempt": str(attempt),
                "batch.kubernetes.io/job-completion-index": str(c),
            }
        )
        hostname = f"{name}-{rj['name']}-{j}-{c}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{hostname}-a{attempt}-{uuid.uuid4().hex[:5]}",
                "labels": labels,
                "annotations": {"batch.kubernetes.io/job-completion-index": str(c)},
            },
            "spec": {**template["spec"], "hostname": hostname, "subdomain": name},
        }
        return await self.api.create(
            PODS.format(ns=ns), pod, webhook="/mutate-pods", gvr=("", "v1", "pods"), kind="Pod", namespace=ns
        )

    async def replace_pod(
        self, namespace: str, name: str, pod: str, *, deletion_seen: bool = True
    ) -> dict[str, Any]:
        """What the Job controller does when a pod fails within its backoff limit: the pod goes, a new
        one for the same index and restart attempt comes (not yet scheduled). Returns the new pod.
        ``deletion_seen=False``: the old pod vanishes from the API with no watch event (as a deletion
        between two watch streams is lost to a client that resumes or relists)."""
        js = self.jobset(namespace, name)
        old = self.obj("v1/pods", namespace, pod)
        assert old is not None, f"pod {namespace}/{pod} not found"
        labels = old["metadata"]["labels"]
        rj = next(
            r
            for r in js["spec"]["replicatedJobs"]
            if r["name"] == labels["jobset.sigs.k8s.io/replicatedjob-name"]
        )
        if deletion_seen:
            await self.delete(f"{PODS.format(ns=namespace)}/{pod}")
        else:
            del self.kube.objects[kmock.resource("v1/pods"), namespace, pod]
        return await self._create_pod(
            namespace,
            js,
            rj,
            rj["template"]["spec"],
            int(labels["jobset.sigs.k8s.io/job-index"]),
            int(labels["jobset.sigs.k8s.io/job-global-index"]),
            int(labels["batch.kubernetes.io/job-completion-index"]),
            int(labels["jobset.sigs.k8s.io/restart-attempt"]),
        )

    async def schedule(self, namespace: str, pod: str, node: str) -> None:
        """The scheduler binds the pod; the kubelet starts it."""
        await self.patch(f"{PODS.format(ns=namespace)}/{pod}", {"spec": {"nodeName": node}})
        status = {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1"}
        await self.patch(f"{PODS.format(ns=namespace)}/{pod}/status", {"status": status})

    async def restart(self, namespace: str, name: str) -> int:
        """JobSet failure policy Recreate: count a restart, delete every pod of the old attempt."""
        js = self.jobset(namespace, name)
        attempt = (js.get("status") or {}).get("restarts", 0) + 1
        await self.patch(f"{JOBSETS.format(ns=namespace)}/{name}/status", {"status": {"restarts": attempt}})
        for pod in self.pods(namespace, name):
            await self.delete(f"{PODS.format(ns=namespace)}/{pod['metadata']['name']}")
        return attempt


# ------------------------------------------------------------------------------------ the operator


class OperatorThread:
    """The operator in its own thread and event loop, as in production a process of its own.

    kopf cancels every task created after it started when it stops; in the test's loop that would
    include pytest's own fixture tasks, hence the thread (kopf's ``KopfRunner`` does the same).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime: Runtime | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._main, name="operator", daemon=True)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop, self.stop_event = loop, asyncio.Event()
        self._started.set()
        try:
            self.runtime = build_runtime(self.settings)  # the composition root's wiring: the real adapters
            self.exit_code = loop.run_until_complete(run(self.runtime, self.stop_event, signals=False))
        except BaseException as exc:  # reported by the test through .error
            self.error = exc
        finally:
            loop.close()

    def start(self) -> None:
        self.thread.start()
        self._started.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """Blocking: call it through ``asyncio.to_thread`` from a test whose loop serves the API."""
        if self.loop is not None and self.stop_event is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the operator did not stop"


@dataclasses.dataclass
class Env:
    kube: Any
    cluster: Cluster
    replicators: Replicators
    settings: Settings
    operator: OperatorThread | None = None
    starting: list[Node] = dataclasses.field(default_factory=list)
    """Replicators started before the operator: they get their certificates once it runs."""

    async def add_nodes(self, *spec: tuple[str, str]) -> list[Node]:
        """New nodes, each with its replicator pod, that pod's ServiceAccount token, and the replicator
        process; ready (certificate obtained, pod Ready) once the operator runs."""
        nodes = []
        for name, zone in spec:
            node = self.replicators.prepare(name, zone)
            uid = await self.cluster.add_node(node)
            self.register_token(node, uid)
            await self.replicators.start(node)
            nodes.append(node)
        self.starting.extend(nodes)
        if self.operator is not None:
            await self._ready_starting()
        return nodes

    def register_token(self, node: Node, pod_uid: str) -> str:
        """What the kubelet projects into the replicator pod: a token of the replicators' ServiceAccount,
        bound to the pod and its node, for the tierckpt audience (the emulator's TokenReview knows it)."""
        token = "sa-" + uuid.uuid4().hex
        self.kube.register_token(
            token,
            username=f"system:serviceaccount:{SYSTEM_NS}:{REPLICATOR_SA}",
            extra={
                POD_EXTRA + "pod-name": [f"replicator-{node.name}"],
                POD_EXTRA + "pod-uid": [pod_uid],
                POD_EXTRA + "node-name": [node.name],
            },
            audiences=(AUDIENCE,),
        )
        assert node.token_file is not None
        node.token_file.write_text(token)
        return token

    async def _ready_starting(self) -> None:
        nodes, self.starting = self.starting, []
        await self.replicators.wait_ready(*(n.name for n in nodes))
        for node in nodes:
            await self.cluster.mark_ready(node)

    async def start_operator(self) -> None:
        self.operator = OperatorThread(self.settings)
        self.operator.start()
        await eventually(self._webhook_up, 20, "operator webhook listening")
        await self._ready_starting()

    async def _webhook_up(self) -> bool:
        assert self.operator is not None
        if not self.operator.thread.is_alive():
            raise RuntimeError(f"operator exited: {self.operator.exit_code} {self.operator.error!r}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", self.settings.webhook_port)
        except OSError:
            return False
        writer.close()
        return True

    def lease_holder(self, name: str = "tierckpt-operator") -> str | None:
        key = (kmock.resource("coordination.k8s.io/v1/leases"), self.settings.namespace, name)
        if key not in self.kube.objects or self.kube.objects[key].deleted:
            return None
        return self.kube.objects[key].raw.get("spec", {}).get("holderIdentity")

    async def stop_operator(self) -> None:
        if self.operator is not None:
            await asyncio.to_thread(self.operator.stop)
            error, self.operator = self.operator.error, None
            if error is not None:
                raise error


def operator_settings(kube: Any, tmp: Path, tls: Path, ca: TierckptCA, **overrides: object) -> Settings:
    tmp.mkdir(parents=True, exist_ok=True)
    values: dict[str, object] = dict(
        server=str(kube.url).rstrip("/"),
        namespace=SYSTEM_NS,
        auth="tls",
        ca_cert_file=str(ca.cert),
        ca_key_file=str(ca.key),
        issuer_port=free_port(),
        issuer_addr="127.0.0.1",
        issuer_names="127.0.0.1",
        replicator_service_account=REPLICATOR_SA,
        token_audience=AUDIENCE,
        webhook_port=free_port(),
        webhook_addr="127.0.0.1",
        webhook_cert_dir=str(tls),
        metrics_port=0,
        debounce=0.05,
        resync_interval=2.0,
        refresh_interval=1.0,
        restore_grace=3.0,
        config_status_interval=0.5,
        http_timeout=2.0,
        http_retries=2,
    )
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]
