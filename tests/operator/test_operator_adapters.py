"""The operator's two I/O adapters at unit level.

``ReplicatorClient`` and ``purge_job`` against a small real HTTP server standing in for the replicator
API (a unit-level stand-in: retries, status codes and the exact requests are what is under test; the
e2e tests use real replicators). ``Kube`` leader election against the API emulator.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from tierckpt.protocol.client import ReplicatorClient, ReplicatorError, RetryPolicy
from tierckpt.protocol.control import (
    JobPolicy,
    NodeInventory,
    PeerAssignment,
    PeerNode,
    PurgeResult,
    RankHoldings,
)
from tierckpt.protocol.errors import ContractError
from tierckpt_operator.cleanup import purge_job
from tierckpt_operator.clusterview import ClusterView
from tierckpt_operator.kube import ClientError, Invalid, Kube, KubeError, NotFound, api_client
from tierckpt_operator.leader import LeaseElector
from tierckpt_operator.pods import ReplicatorPod
from tierckpt_operator.replicators import replicator_client
from tierckpt_operator.resources import ConfigSpec
from tierckpt_operator.settings import Settings

TOKEN = "adapter-token-0123456789abcdef"


class StandIn:
    """A real HTTP server speaking (part of) the replicator API, scripted per test."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], str]] = []
        self.script: dict[tuple[str, str], list[int]] = {}
        self.inventory: dict | None = None
        self.bucket_delay = 0.0
        """Seconds a bucket purge takes to answer (a node cut off from the bucket retries for minutes)."""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text()
        self.requests.append((request.method, request.path, dict(request.query), body))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.Response(status=401)
        codes = self.script.get((request.method, request.path))
        code = codes.pop(0) if codes else 200
        if code != 200:
            return web.Response(status=code, text="scripted")
        if request.path.endswith("/inventory"):
            return web.Response(text=json.dumps(self.inventory), content_type="application/json")
        if request.method == "DELETE":
            if request.query.get("bucket") == "true":
                await asyncio.sleep(self.bucket_delay)
            job = request.path.rsplit("/", 1)[1]
            answer = PurgeResult(job=job, purged=True, bucket=request.query.get("bucket") == "true")
            return web.Response(body=answer.to_bytes(), content_type="application/json")
        return web.Response(text=body, content_type="application/json")  # a PUT answers what it stored

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/?data={port + 1}"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def _client(token_file, retries: int = 3):
    """The operator's own client (``replicator_client``) with a short backoff."""
    settings = Settings(auth="token", token_file=str(token_file), http_timeout=2.0, http_retries=retries)
    client = replicator_client(settings)
    client.retry = RetryPolicy(attempts=retries, backoff=0.01)
    return client


async def test_calls_are_authorized_and_typed(token_file):
    server = StandIn()
    inv = NodeInventory(
        job="ns_j_01234567",
        node="n1",
        endpoint="",
        updated_at=1.0,
        ranks={0: RankHoldings(local=(5,))},
        world_sizes={5: 1},
    )
    server.inventory = inv.to_dict()
    async with server as endpoint:
        client = _client(token_file)
        try:
            got = await client.inventory(endpoint, "ns_j_01234567")
            assert got == inv
            peers = PeerAssignment(
                job="ns_j_01234567", generation=3, nodes={"n1": PeerNode("n1", endpoint)}, peers={"n1": ()}
            )
            assert await client.put_peers(endpoint, peers) == peers
            purged = await client.purge(endpoint, "ns_j_01234567", backups=True)
            assert purged == PurgeResult(job="ns_j_01234567", purged=True, bucket=True)
            policy = JobPolicy(job="ns_j_01234567", generation=7, bucket="ckpt-bucket", keep_last=2)
            assert await client.put_policy(endpoint, policy) == policy
        finally:
            await client.aclose()
    (m1, p1, _, _), (m2, p2, _, b2), (m3, p3, q3, _), (m4, p4, _, b4) = server.requests
    assert (m1, p1) == ("GET", "/v1/jobs/ns_j_01234567/inventory")  # ?data= is not part of the API URL
    assert (m2, p2) == ("PUT", "/v1/jobs/ns_j_01234567/peers") and PeerAssignment.from_bytes(b2) == peers
    assert (m3, p3, q3) == ("DELETE", "/v1/jobs/ns_j_01234567", {"bucket": "true"})
    assert (m4, p4) == ("PUT", "/v1/jobs/ns_j_01234567/policy") and JobPolicy.from_bytes(b4) == policy


async def test_retries_transient_failures_only(token_file):
    server = StandIn()
    async with server as endpoint:
        client = _client(token_file, retries=3)
        try:
            server.script[("DELETE", "/v1/jobs/j")] = [503, 502]
            await client.purge(endpoint, "j")  # third attempt succeeds
            assert len(server.requests) == 3
            server.script[("PUT", "/v1/jobs/j/peers")] = [409]
            with pytest.raises(ReplicatorError) as exc:
                await client.put_peers(endpoint, PeerAssignment(job="j", generation=1, nodes={}, peers={}))
            assert exc.value.status == 409 and len(server.requests) == 4  # no retry
            server.script[("DELETE", "/v1/jobs/j")] = [404]
            await client.purge(endpoint, "j")  # nothing to purge is success
            server.script[("GET", "/v1/jobs/j/inventory")] = [404]
            assert await client.inventory(endpoint, "j") is None
        finally:
            await client.aclose()


async def test_malformed_answers_and_dead_replicators(token_file):
    server = StandIn()
    server.inventory = {"kind": "tierckpt.inventory", "version": 1, "job": "j"}  # fields missing
    async with server as endpoint:
        client = _client(token_file)
        try:
            with pytest.raises(ContractError, match="malformed"):
                await client.inventory(endpoint, "j")
        finally:
            await client.aclose()
    client = _client(token_file, retries=2)
    try:
        with pytest.raises(ReplicatorError, match="ConnectError"):
            await client.inventory(endpoint, "j")  # the server is gone now
    finally:
        await client.aclose()
    anonymous = ReplicatorClient(timeout=1.0)  # no token: no Authorization header
    async with StandIn() as endpoint:
        try:
            with pytest.raises(ReplicatorError, match="401"):
                await anonymous.inventory(endpoint, "j")
        finally:
            await anonymous.aclose()


class _Index(dict):
    """A kopf index stand-in: key -> list of values."""


async def test_purge_asks_every_ready_replicator_and_one_for_the_bucket(token_file):
    servers = [StandIn(), StandIn(), StandIn()]
    async with servers[0] as e0, servers[1] as e1, servers[2] as e2:
        reps = _Index(
            n0=[ReplicatorPod("n0", e0, True)],
            n1=[ReplicatorPod("n1", e1, True)],
            n2=[ReplicatorPod("n2", e2, False)],
        )
        nodes = _Index(n0=[(("pool", "gpu"),)], n1=[(("pool", "gpu"),)], n2=[(("pool", "gpu"),)])
        cluster = ClusterView({"tierckpt_replicators": reps, "tierckpt_nodes": nodes})
        cfg = ConfigSpec.from_body(
            {
                "metadata": {"name": "c"},
                "spec": {
                    "gcs": {"bucket": "bkt"},
                    "nodeSelector": {"pool": "gpu"},
                    "deleteBackupsOnJobSetDeletion": True,
                },
            }
        )
        servers[0].script[("DELETE", "/v1/jobs/j")] = [200, 500, 500, 500]  # the bucket purge fails on n0
        client = _client(token_file, retries=2)
        try:
            result = await purge_job(client, cluster, "j", cfg)
        finally:
            await client.aclose()
    assert result.purged == ("n0", "n1") and result.failed == {} and result.backups_deleted
    assert [r[2] for r in servers[1].requests] == [{}, {"bucket": "true"}]
    assert servers[2].requests == []  # not ready: not asked
    assert "GCS backups deleted" in result.summary()


async def test_a_replicator_that_does_not_answer_the_bucket_purge_does_not_hold_it(token_file, monkeypatch):
    """Found by the chaos soak: the first replicator asked to delete the backups was cut off from the
    bucket (its client retries for minutes), and the purge waited for it. The next one is asked once the
    first has not answered for ``BACKUP_PURGE_HEDGE`` seconds, and its answer ends the purge."""
    from tierckpt_operator import cleanup

    monkeypatch.setattr(cleanup, "BACKUP_PURGE_HEDGE", 0.5, raising=False)
    servers = [StandIn(), StandIn()]
    servers[0].bucket_delay = 8.0
    async with servers[0] as e0, servers[1] as e1:
        reps = _Index(n0=[ReplicatorPod("n0", e0, True)], n1=[ReplicatorPod("n1", e1, True)])
        cluster = ClusterView({"tierckpt_replicators": reps, "tierckpt_nodes": _Index()})
        spec = {"gcs": {"bucket": "bkt"}, "deleteBackupsOnJobSetDeletion": True}
        cfg = ConfigSpec.from_body({"metadata": {"name": "c"}, "spec": spec})
        client = _client(token_file, retries=1)
        started = time.monotonic()
        try:
            result = await purge_job(client, cluster, "j", cfg)
            took = time.monotonic() - started
        finally:
            await client.aclose()
    assert result.backups_deleted and took < 5.0  # n0 would have answered after 8 s
    assert [r[2] for r in servers[0].requests] == [{}, {"bucket": "true"}]
    assert [r[2] for r in servers[1].requests] == [{}, {"bucket": "true"}]


async def test_kube_maps_refusals_to_typed_errors(kube_with_crds):
    """Absent and already-there are answers (None, False); any other refusal is a typed error with the
    server's status, reason and message, never the client's ApiException."""
    adapter = Kube(api_client(str(kube_with_crds.url)))
    body = {
        "apiVersion": "tierckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {"name": "j", "namespace": "team"},
        "spec": {},
    }
    try:
        assert await adapter.get_jobset("team", "absent") is None  # 404
        assert await adapter.patch_checkpoint_job_status("team", "j", {"phase": "x"}) is False  # 404
        await adapter.delete_checkpoint_job("team", "j")  # 404: already gone
        assert await adapter.create_checkpoint_job(body) is not None
        assert await adapter.create_checkpoint_job(body) is None  # 409: it exists
        assert await adapter.patch_checkpoint_job_status("team", "j", {"phase": "x"}) is True
        assert await adapter.get_pod("team", "absent") is None  # 404
        nameless = {**body, "metadata": {"namespace": "team"}}
        with pytest.raises(Invalid) as refused:
            await adapter.create_checkpoint_job(nameless)  # 422
        error = refused.value
        assert isinstance(error, ClientError) and isinstance(error, KubeError)
        assert not isinstance(error, NotFound)
        assert (error.status, error.reason) == (422, "Invalid")
        assert "metadata.name is required" in error.message and "422" in str(error)
    finally:
        adapter.close()


async def test_lease_election(kube):
    def kube_client():
        return Kube(api_client(str(kube.url)))

    a, b = kube_client(), kube_client()
    try:
        first = LeaseElector(a, "default", "tierckpt-operator", "pod-a", duration=1.0)
        second = LeaseElector(b, "default", "tierckpt-operator", "pod-b", duration=1.0)
        await first.acquire()
        assert not await second._try()  # held and fresh
        assert await first._try()  # renewing our own lease
        lost = asyncio.Event()
        await asyncio.wait_for(second.acquire(), 10)  # pod-a stopped renewing: the lease expires
        holder = kube.objects["coordination.k8s.io/v1/leases", "default", "tierckpt-operator"]["spec"]
        assert holder["holderIdentity"] == "pod-b"
        holding = asyncio.create_task(first.hold(lost))
        await asyncio.wait_for(lost.wait(), 10)  # pod-a cannot renew a lease pod-b holds: it steps down
        await holding
    finally:
        a.close()
        b.close()
