"""The node certificate signing endpoint (``tierckpt_operator.issuer``) against the API emulator's
TokenReview: a certificate for exactly the node a replicator pod's token proves, and nothing for any
other token, pod or request. Served over real HTTPS, with the real Kubernetes adapter."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.fixtures.k8s_emulator import KubeEmulator
from tests.operator.operator_harness import (
    AUDIENCE,
    POD_EXTRA,
    PODS,
    REPLICATOR_DS,
    REPLICATOR_LABELS,
    REPLICATOR_SA,
    SYSTEM_NS,
    TierckptCA,
    eventually,
    free_port,
)
from tierckpt.protocol.api import ISSUE_CERTIFICATE
from tierckpt.protocol.certs import issued_by, matches_key, named_peer, new_key, node_csr
from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.identity import CertificateIssued, CertificateRequest, Peer, node_server_name
from tierckpt_operator.credentials import OperatorCredentials
from tierckpt_operator.issuer import NodeCertificateIssuer
from tierckpt_operator.kube import Kube, api_client
from tierckpt_operator.metrics import Metrics
from tierckpt_operator.settings import Settings

USER = f"system:serviceaccount:{SYSTEM_NS}:{REPLICATOR_SA}"


class Issuer:
    """The endpoint served, and helpers to make the pods and tokens a cluster would have."""

    def __init__(self, kube: KubeEmulator, ca: TierckptCA, url: str, metrics: Metrics) -> None:
        self.kube, self.ca, self.url, self.metrics = kube, ca, url, metrics
        self.ds_uid = ""

    async def pod(
        self,
        node: str,
        *,
        name: str = "",
        owner: bool = True,
        labels: dict | None = None,
        phase: str = "Running",
    ) -> tuple[str, str]:
        """A replicator pod on ``node`` (the DaemonSet's, unless ``owner=False``); (name, uid)."""
        if not self.ds_uid:
            resp = await self.kube.post(
                f"/apis/apps/v1/namespaces/{SYSTEM_NS}/daemonsets", json={"metadata": {"name": REPLICATOR_DS}}
            )
            self.ds_uid = json.loads(await resp.text())["metadata"]["uid"]
        name = name or f"replicator-{node}-{uuid.uuid4().hex[:5]}"
        meta: dict = {"name": name, "labels": dict(REPLICATOR_LABELS if labels is None else labels)}
        if owner:
            meta["ownerReferences"] = [
                {
                    "apiVersion": "apps/v1",
                    "kind": "DaemonSet",
                    "name": REPLICATOR_DS,
                    "uid": self.ds_uid,
                    "controller": True,
                }
            ]
        body = {
            "metadata": meta,
            "spec": {"nodeName": node, "serviceAccountName": REPLICATOR_SA, "containers": []},
        }
        resp = await self.kube.post(PODS.format(ns=SYSTEM_NS), json=body)
        assert resp.status == 201, await resp.text()
        uid = json.loads(await resp.text())["metadata"]["uid"]
        resp = await self.kube.patch(
            f"{PODS.format(ns=SYSTEM_NS)}/{name}/status", json={"status": {"phase": phase}}
        )
        assert resp.status == 200
        return name, uid

    def token(
        self,
        pod: str,
        uid: str,
        node: str | None,
        *,
        user: str = USER,
        audiences: tuple[str, ...] = (AUDIENCE,),
    ) -> str:
        token = "sa-" + uuid.uuid4().hex
        extra = {POD_EXTRA + "pod-name": [pod], POD_EXTRA + "pod-uid": [uid]}
        if node is not None:
            extra[POD_EXTRA + "node-name"] = [node]
        self.kube.register_token(token, username=user, extra=extra, audiences=audiences)
        return token

    async def ask(
        self,
        node: str,
        token: str | None,
        *,
        csr_node: str | None = None,
        body: bytes | None = None,
        source: str = "127.0.0.1",
    ):
        """One signing request from the address ``source``: (the answer, the key of its CSR)."""
        key = new_key()
        if body is None:
            body = CertificateRequest(node=node, csr=node_csr(key, csr_node or node)).to_bytes()
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        transport = httpx.AsyncHTTPTransport(verify=str(self.ca.cert), local_address=source, retries=0)
        async with httpx.AsyncClient(transport=transport, timeout=30, trust_env=False) as http:
            resp = await http.post(self.url + ISSUE_CERTIFICATE.path, content=body, headers=headers)
        return resp, key


@contextlib.asynccontextmanager
async def serving(kube: KubeEmulator, ca: TierckptCA, **settings: Any) -> AsyncIterator[Issuer]:
    """The signing endpoint on 127.0.0.1 with ``settings`` over the defaults, against ``kube``."""
    await kube.post("/api/v1/namespaces", json={"metadata": {"name": SYSTEM_NS}})
    config = Settings(
        server=str(kube.url).rstrip("/"),
        namespace=SYSTEM_NS,
        ca_cert_file=str(ca.cert),
        ca_key_file=str(ca.key),
        issuer_port=free_port(),
        issuer_addr="0.0.0.0",  # reached from several loopback addresses (one source each)
        issuer_names="127.0.0.1",
        replicator_service_account=REPLICATOR_SA,
        token_audience=AUDIENCE,
        cert_hours=2,
        **settings,
    )
    credentials = OperatorCredentials(
        ca.cert, ca.key, ca.cert, server_names=["127.0.0.1"], lifetime=datetime.timedelta(hours=2)
    )
    adapter, metrics = Kube(api_client(config.server)), Metrics()
    runner = await NodeCertificateIssuer(config, adapter, credentials, metrics).start()
    try:
        yield Issuer(kube, ca, f"https://127.0.0.1:{config.issuer_port}", metrics)
    finally:
        await runner.cleanup()
        adapter.close()
        credentials.close()


@pytest.fixture
async def issuer(kube: KubeEmulator, tierckpt_ca: TierckptCA) -> AsyncIterator[Issuer]:
    async with serving(kube, tierckpt_ca) as served:
        yield served


async def test_a_replicator_pod_gets_a_certificate_for_its_node_only(issuer):
    pod, uid = await issuer.pod("n1")
    token = issuer.token(pod, uid, "n1")
    resp, key = await issuer.ask("n1", token, csr_node="n9")  # the CSR's own names are ignored
    assert resp.status_code == 200, resp.text
    issued = CertificateIssued.from_bytes(resp.content)
    pem = issued.certificate.encode()
    assert named_peer(pem) == Peer.of_node("n1") and matches_key(pem, key)
    assert issued_by(pem, issuer.ca.cert.read_bytes()) and issued.ca.encode() == issuer.ca.cert.read_bytes()
    life = issued.not_after - datetime.datetime.now(datetime.timezone.utc).timestamp()
    assert 3600 < life <= 7200  # --cert-hours 2
    # the same token cannot get another node's certificate
    resp, _ = await issuer.ask("n2", token)
    assert resp.status_code == 403 and "bound to node 'n1'" in resp.json()["detail"]


@pytest.mark.parametrize(
    ("case", "status", "why"),
    [
        ("no token", 401, "bearer token"),
        ("unknown token", 401, "not authenticated"),
        ("other audience", 401, "not authenticated"),
        ("other service account", 403, "is not system:serviceaccount"),
        ("pod on another node", 403, "runs on node 'n1'"),
        ("pod replaced", 403, "uid differs"),
        ("pod finished", 403, "terminating or finished"),
        ("pod gone", 403, "does not exist"),
        ("not a DaemonSet pod", 403, "not controlled by a DaemonSet"),
        ("not a replicator", 403, "not a replicator"),
        ("malformed request", 400, "malformed"),
        ("bad CSR", 400, "unusable certificate request"),
    ],
)
async def test_nothing_else_gets_a_certificate(issuer, case, status, why):
    node, body, token = "n2", None, None
    if case == "unknown token":
        token = "not-a-token"
    elif case == "other audience":
        pod, uid = await issuer.pod(node)
        token = issuer.token(pod, uid, node, audiences=("https://kubernetes.default.svc.cluster.local",))
    elif case == "other service account":
        pod, uid = await issuer.pod(node)
        token = issuer.token(pod, uid, node, user=f"system:serviceaccount:{SYSTEM_NS}:default")
    elif case == "pod on another node":  # an older API server: the token names no node
        pod, uid = await issuer.pod("n1")
        token = issuer.token(pod, uid, None)
    elif case == "pod replaced":
        pod, _ = await issuer.pod(node)
        token = issuer.token(pod, str(uuid.uuid4()), node)
    elif case == "pod finished":
        pod, uid = await issuer.pod(node, phase="Succeeded")
        token = issuer.token(pod, uid, node)
    elif case == "pod gone":
        token = issuer.token("replicator-gone", str(uuid.uuid4()), node)
    elif case == "not a DaemonSet pod":
        pod, uid = await issuer.pod(node, owner=False)
        token = issuer.token(pod, uid, node)
    elif case == "not a replicator":
        pod, uid = await issuer.pod(node, labels={"app": "training"})
        token = issuer.token(pod, uid, node)
    elif case in ("malformed request", "bad CSR"):
        pod, uid = await issuer.pod(node)
        token = issuer.token(pod, uid, node)
        csr = "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n"
        body = b'{"kind": "tierckpt.certificate-request"}' if case == "malformed request" else None
        body = body or CertificateRequest(node=node, csr=csr).to_bytes()
    resp, _ = await issuer.ask(node, token, body=body)
    assert resp.status_code == status and why in resp.json()["detail"], resp.text
    outcome = {401: "unauthenticated", 403: "refused", 400: "malformed"}[status]
    assert issuer.metrics.node_certificates.labels(outcome)._value.get() == 1
    assert issuer.metrics.node_certificates.labels("issued")._value.get() == 0


async def test_a_review_naming_no_audience_is_refused(kube, issuer):
    """An authenticator that ignores audiences (for kube-apiserver: a token for its own audience)
    proves nothing for ours: no certificate, though the token is the replicator pod's."""
    kube.audience_aware = False
    pod, uid = await issuer.pod("n1")
    resp, _ = await issuer.ask("n1", issuer.token(pod, uid, "n1"))
    assert resp.status_code == 401 and "the review names none" in resp.json()["detail"], resp.text
    assert issuer.metrics.node_certificates.labels("issued")._value.get() == 0


async def test_a_token_is_reviewed_once_while_its_review_is_fresh(kube, tierckpt_ca):
    async with serving(kube, tierckpt_ca, review_cache_seconds=1.0) as issuer:
        pod, uid = await issuer.pod("n1")
        token = issuer.token(pod, uid, "n1")
        for _ in range(3):  # a replicator asking again (a retry, a restart)
            assert (await issuer.ask("n1", token))[0].status_code == 200
        for _ in range(3):  # a pod repeating one string
            assert (await issuer.ask("n1", "not-a-token"))[0].status_code == 401
        assert kube.token_reviews == 2
        await asyncio.sleep(1.2)
        assert (await issuer.ask("n1", token))[0].status_code == 200
        assert kube.token_reviews == 3  # stale: reviewed again


async def test_bearer_strings_from_one_source_cost_reviews_at_its_rate_only(kube, tierckpt_ca):
    """30 requests with 30 different bearer strings from one address: at most the burst (and what the
    rate refilled meanwhile) reach the API server, the rest get 429 with when to come back; a
    replicator from another address gets its certificate meanwhile."""
    async with serving(kube, tierckpt_ca, issuer_rate=0.5, issuer_burst=5) as issuer:
        started = time.monotonic()
        answers = [(await issuer.ask("n1", f"guess-{i}", source="127.0.0.7"))[0] for i in range(30)]
        refilled = int((time.monotonic() - started) * 0.5)
        statuses = [r.status_code for r in answers]
        assert statuses[:5] == [401] * 5 and set(statuses) == {401, 429}
        assert kube.token_reviews == statuses.count(401) <= 5 + refilled + 1, statuses
        throttled = [r for r in answers if r.status_code == 429]
        assert all(int(r.headers["Retry-After"]) >= 1 for r in throttled)
        assert issuer.metrics.node_certificates.labels("throttled")._value.get() == len(throttled)
        pod, uid = await issuer.pod("n1")
        resp, _ = await issuer.ask("n1", issuer.token(pod, uid, "n1"), source="127.0.0.8")
        assert resp.status_code == 200, resp.text


async def test_api_calls_in_flight_are_bounded(kube, tierckpt_ca):
    """Twelve sources at once, each within its rate, while every review takes half a second: at most
    three are checked with the API server at once; the others get 503 at once, not a queue."""
    kube.review_delay = 0.5
    async with serving(kube, tierckpt_ca, issuer_api_calls=3) as issuer:
        asks = [issuer.ask("n1", f"guess-{i}", source=f"127.0.1.{i + 1}") for i in range(12)]
        answers = [resp for resp, _ in await asyncio.gather(*asks)]
        statuses = [r.status_code for r in answers]
        assert kube.max_reviews_in_flight <= 3 and kube.token_reviews == statuses.count(401) >= 3
        assert 503 in statuses and set(statuses) == {401, 503}, statuses
        assert all(r.headers["Retry-After"] == "1" for r in answers if r.status_code == 503)


def presented(port: int, node: str, ca: TierckptCA) -> bytes:
    """The certificate a replicator port presents now (the harness's operator-role credentials)."""
    ctx = ca.probe_credentials().client(named=True)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=node_server_name(node)) as tls,
    ):
        return tls.getpeercert(binary_form=True) or b""


async def test_certificates_are_renewed_without_a_restart(env, tierckpt_ca):
    env.settings = dataclasses.replace(env.settings, cert_hours=30 / 3600)  # 30 s: renewed after 20 s
    n0, n1 = await env.add_nodes(("n0", "a"), ("n1", "b"))
    await env.start_operator()
    api = {n.name: await asyncio.to_thread(presented, n.api_port, n.name, tierckpt_ca) for n in (n0, n1)}
    data = {n.name: await asyncio.to_thread(presented, n.data_port, n.name, tierckpt_ca) for n in (n0, n1)}
    assert api == data  # one certificate per node, on both ports

    def renewed(node) -> bool:
        return node.log.read_text().count("obtained this node's certificate") >= 2

    await eventually(lambda: renewed(n0) and renewed(n1), 45, "both nodes renewed their certificates")
    for node in (n0, n1):  # both ports present the new certificate, without a restart
        now_api = await asyncio.to_thread(presented, node.api_port, node.name, tierckpt_ca)
        now_data = await asyncio.to_thread(presented, node.data_port, node.name, tierckpt_ca)
        assert now_api != api[node.name] and now_data == now_api
        assert node.proc is not None and node.proc.poll() is None
    # peers and the operator (its own certificate renewed too) still reach both over mutual TLS
    async with ReplicatorClient(tls=env.operator.runtime.credentials.client, timeout=5) as op:
        assert (await op.status(n1.endpoint, node="n1")).node == "n1"
    assert "reloaded this node's certificate" in n0.log.read_text()
