"""The control API in-process (httpx ASGITransport into the real daemon app, no worker started):
authorization, input validation, and that a refused request changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tierckpt.protocol.api import ENDPOINTS
from tierckpt.protocol.control import (
    JobPolicy,
    NodeInventory,
    NodePlan,
    NodePlanResult,
    NodeStatus,
    PeerAssignment,
    PeerNode,
    PurgeResult,
    RestorePlan,
    RestoreState,
    RestoreStatus,
    Tier,
    read_control,
    read_restore_status,
)
from tierckpt.protocol.format import state_dir
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.daemon import Daemon
from tierckpt_replicator.settings import Settings

TOKEN = "s3cr3t-token-value"
JOB = "team_train_1234abcd"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Daemon]]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    root = tmp_path / "ramdisk"
    root.mkdir()
    settings = Settings(
        node_name="node-a",
        root=root,
        auth="token",
        token_file=token,
        advertise_host="127.0.0.1",
        restore_attempts=1,
        max_request_bytes=64 << 10,
    )
    daemon = Daemon(settings)
    transport = httpx.ASGITransport(app=daemon.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replicator") as client:
        yield client, daemon
    await daemon.shutdown()


def assignment(generation: int = 1, job: str = JOB) -> PeerAssignment:
    return PeerAssignment(
        job=job,
        generation=generation,
        nodes={
            "node-a": PeerNode("node-a", "http://10.0.0.1:8470"),
            "node-b": PeerNode("node-b", "http://10.0.0.2:8470"),
        },
        peers={"node-a": ("node-b",), "node-b": ("node-a",)},
        node_ranks={"node-a": 0, "node-b": 1},
        procs_per_node=2,
    )


ROUTES = [(ep.method, ep.url_path(**{p: JOB for p in ep.path_params})) for ep in ENDPOINTS if ep.auth]
assert len(ROUTES) == 12 and ("DELETE", f"/v1/jobs/{JOB}") in ROUTES and ("GET", "/v1/openapi.json") in ROUTES


@pytest.mark.parametrize(("method", "path"), ROUTES)
async def test_every_control_route_needs_the_token(api, method, path):
    client, daemon = api
    write_step(daemon.settings.root, JOB, 0, 1, sizes=(64,))
    body = assignment().to_bytes()
    for headers, status in (
        ({}, 401),
        ({"Authorization": "Basic " + TOKEN}, 401),
        ({"Authorization": "Bearer "}, 401),
        ({"Authorization": "Bearer wrong-token"}, 403),
        ({"Authorization": f"Bearer {TOKEN}x"}, 403),
    ):
        resp = await client.request(method, path, headers=headers, content=body)
        assert resp.status_code == status, (headers, resp.text)
        if status == 401:
            assert resp.headers["www-authenticate"] == "Bearer"
    assert (daemon.settings.root / JOB / "rank-00000").is_dir()  # DELETE refused: nothing purged
    assert not (state_dir(daemon.settings.root, JOB) / "peers.json").exists()


async def test_probes_are_open_and_say_nothing(api):
    client, daemon = api
    transport = httpx.ASGITransport(app=daemon.probe_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://probes") as probes:
        for c in (client, probes):  # the probes answer on both ports
            assert (await c.get("/healthz")).json() == {"status": "ok"}
            ready = await c.get("/readyz")
            assert ready.status_code == 503 and ready.json() == {"status": "unavailable"}  # no worker
        metrics = await probes.get("/metrics")
        assert metrics.status_code == 200 and "tierckpt_replicator_worker_up" in metrics.text
        assert TOKEN not in metrics.text and "ramdisk" not in metrics.text
        assert (await client.get("/metrics")).status_code == 404  # not on the API port
        for hidden in ("/docs", "/openapi.json", "/redoc"):
            assert (await client.get(hidden)).status_code == 404
            assert (await probes.get(hidden)).status_code == 404
        for ep in ENDPOINTS:  # nothing of the API on the probe port
            if ep.auth:
                path = ep.url_path(**{p: JOB for p in ep.path_params})
                assert (await probes.request(ep.method, path, headers=AUTH)).status_code in (404, 405)


@pytest.mark.parametrize("job", ["..", ".hidden", "-rf", "a b", "a%2F..%2Fb", "x" * 300, "%2e%2e"])
async def test_bad_job_ids_are_refused(api, job):
    client, daemon = api
    resp = await client.get(f"/v1/jobs/{job}/inventory", headers=AUTH)
    assert resp.status_code in (400, 404)
    resp = await client.delete(f"/v1/jobs/{job}", headers=AUTH)
    assert resp.status_code in (400, 404, 405)
    assert sorted(p.name for p in daemon.settings.root.iterdir()) == []


async def test_inventory_reports_what_is_held(api):
    client, daemon = api
    root = daemon.settings.root
    write_step(root, JOB, 0, 10, world_size=4, sizes=(100,))
    write_step(root, JOB, 0, 20, world_size=4, sizes=(100,))
    write_step(root, JOB, 3, 10, world_size=4, sizes=(100,), parent=root / JOB / "replicas" / "rank-00003")
    (root / JOB / "rank-00000" / "step-000000000030").mkdir()  # not committed: does not exist
    resp = await client.get(f"/v1/jobs/{JOB}/inventory", headers=AUTH)
    inv = NodeInventory.from_bytes(resp.content)
    assert inv.node == "node-a" and inv.endpoint == "http://127.0.0.1:8470"
    assert inv.ranks[0].local == (10, 20) and inv.ranks[3].replica == (10,)
    assert inv.world_sizes == {10: 4, 20: 4}
    empty = NodeInventory.from_bytes((await client.get("/v1/jobs/other_job/inventory", headers=AUTH)).content)
    assert empty.ranks == {}  # known to hold nothing, which is not the same as unknown


async def test_peers_newer_generation_only(api):
    client, daemon = api
    url = f"/v1/jobs/{JOB}/peers"
    assert (await client.put(url, headers=AUTH, content=assignment(2).to_bytes())).status_code == 200
    path = state_dir(daemon.settings.root, JOB) / "peers.json"
    stored = path.read_bytes()
    for generation in (2, 1):
        resp = await client.put(url, headers=AUTH, content=assignment(generation).to_bytes())
        assert resp.status_code == 409
    assert path.read_bytes() == stored
    assert (await client.put(url, headers=AUTH, content=assignment(3).to_bytes())).status_code == 200
    assert PeerAssignment.from_bytes(path.read_bytes()).generation == 3


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[]",
        b'{"kind": "tierckpt.peers", "version": 1}',
        b'{"kind": "tierckpt.inventory", "version": 1}',
        b'{"kind": "tierckpt.peers", "version": 99, "job": "x", "generation": 1, "nodes": {}, "peers": {}}',
        assignment(job="another_job").to_bytes(),
        assignment().to_bytes().replace(b'"node-b":["node-a"]', b'"node-b":["node-zz"]'),
        assignment().to_bytes().replace(b'"generation":1', b'"generation":"1"'),
    ],
)
async def test_malformed_peers_change_nothing(api, body):
    client, daemon = api
    await client.put(f"/v1/jobs/{JOB}/peers", headers=AUTH, content=assignment(5).to_bytes())
    path = state_dir(daemon.settings.root, JOB) / "peers.json"
    before = path.read_bytes()
    resp = await client.put(f"/v1/jobs/{JOB}/peers", headers=AUTH, content=body)
    assert resp.status_code == 400, resp.text
    assert path.read_bytes() == before


async def test_bodies_are_bounded(api):
    client, daemon = api
    huge = b'{"kind":"tierckpt.peers","pad":"' + b"x" * (128 << 10) + b'"}'
    resp = await client.put(f"/v1/jobs/{JOB}/peers", headers=AUTH, content=huge)
    assert resp.status_code == 413

    async def chunks():  # no Content-Length: the stream itself is cut off
        for _ in range(200):
            yield b"x" * 1024

    resp = await client.put(f"/v1/jobs/{JOB}/peers", headers=AUTH, content=chunks())
    assert resp.status_code == 413
    assert not (daemon.settings.root / JOB).exists()


async def test_restore_plan_stages_a_local_step(api):
    client, daemon = api
    root = daemon.settings.root
    await client.put(f"/v1/jobs/{JOB}/peers", headers=AUTH, content=assignment(1).to_bytes())
    for rank in (0, 1):  # node-a has node rank 0 with 2 processes: ranks 0 and 1
        write_step(root, JOB, rank, 40, world_size=4, sizes=(128,))
    plan = RestorePlan(
        job=JOB, step=40, world_size=4, sources={r: Tier.LOCAL for r in range(4)}, generation=1
    )
    resp = await client.put(f"/v1/jobs/{JOB}/restore-plan", headers=AUTH, content=plan.to_bytes())
    assert resp.status_code == 202
    assert read_control(root, JOB, RestorePlan.FILE, RestorePlan) == plan

    async def ready(rank: int) -> RestoreStatus | None:
        st = read_restore_status(root, JOB, rank)
        return st if st is not None and st.state == RestoreState.READY else None

    for rank in (0, 1):
        for _ in range(200):
            if st := await ready(rank):
                break
            await asyncio.sleep(0.02)
        assert st is not None and st.step == 40 and st.source == Tier.LOCAL
    assert read_restore_status(root, JOB, 2) is None  # not this node's rank
    older = RestorePlan(job=JOB, step=30, world_size=4, sources={}, generation=0)
    resp = await client.put(f"/v1/jobs/{JOB}/restore-plan", headers=AUTH, content=older.to_bytes())
    assert resp.status_code == 409
    assert read_control(root, JOB, RestorePlan.FILE, RestorePlan) == plan


async def test_backup_without_a_bucket_is_unavailable(api):
    client, _ = api
    resp = await client.post(f"/v1/jobs/{JOB}/backup", headers=AUTH)
    assert resp.status_code == 503 and "not configured" in resp.json()["detail"]


async def test_delete_purges_only_that_job(api):
    client, daemon = api
    root = daemon.settings.root
    write_step(root, JOB, 0, 1, sizes=(64,))
    write_step(root, JOB, 1, 1, sizes=(64,), parent=root / JOB / "replicas" / "rank-00001")
    write_step(root, "keep_me", 0, 1, sizes=(64,))
    resp = await client.delete(f"/v1/jobs/{JOB}", headers=AUTH)
    assert PurgeResult.from_bytes(resp.content) == PurgeResult(job=JOB, purged=True, bucket=False)
    assert {k: v for k, v in resp.json().items() if k not in ("kind", "version")} == {  # the old fields
        "job": JOB,
        "purged": True,
        "bucket": False,
    }
    assert not (root / JOB).exists() and (root / "keep_me" / "rank-00000").is_dir()
    assert (await client.delete(f"/v1/jobs/{JOB}", headers=AUTH)).json()["purged"] is False
    for flag in ("maybe", "2"):  # a query flag is true or false, nothing else
        resp = await client.delete(f"/v1/jobs/keep_me?bucket={flag}", headers=AUTH)
        assert resp.status_code == 400 and "bucket" in resp.json()["detail"]
    assert (root / "keep_me" / "rank-00000").is_dir()


async def test_status_describes_the_node(api):
    client, daemon = api
    write_step(daemon.settings.root, JOB, 0, 7, sizes=(4096,))
    resp = await client.get("/v1/status", headers=AUTH)
    status = NodeStatus.from_bytes(resp.content)
    assert status.node == "node-a" and not status.healthy and status.problems
    (job,) = status.jobs
    assert job.job == JOB and job.local == {0: (7,)} and job.local_bytes == 4096 and job.generation == -1


def policy(generation: int = 1, job: str = JOB, **fields: object) -> JobPolicy:
    values: dict[str, object] = {
        "bucket": "ckpt-bucket",
        "prefix": "team/a",
        "backup_interval_steps": 100,
        "keep_last": 2,
        "keep_every": 1000,
        "replication_factor": 2,
        **fields,
    }
    return JobPolicy(job=job, generation=generation, **values)  # type: ignore[arg-type]


async def test_policy_is_stored_newer_generation_wins(api):
    client, daemon = api
    url = f"/v1/jobs/{JOB}/policy"
    path = state_dir(daemon.settings.root, JOB) / JobPolicy.FILE
    resp = await client.put(url, headers=AUTH, content=policy(5).to_bytes())
    assert resp.status_code == 200 and JobPolicy.from_bytes(resp.content) == policy(5)
    assert JobPolicy.from_bytes(path.read_bytes()) == policy(5)
    assert (await client.put(url, headers=AUTH, content=policy(5).to_bytes())).status_code == 200  # a retry
    for older in (policy(5, keep_last=9), policy(4, bucket="other-bucket")):
        resp = await client.put(url, headers=AUTH, content=older.to_bytes())
        assert resp.status_code == 409, resp.text
    assert JobPolicy.from_bytes(path.read_bytes()) == policy(5)
    assert daemon.policies.get(JOB) == policy(5)
    resp = await client.put(url, headers=AUTH, content=policy(6, bucket="bucket-2").to_bytes())
    assert resp.status_code == 200
    assert daemon.policies.get(JOB) == policy(6, bucket="bucket-2")
    assert sorted(p.name for p in path.parent.iterdir()) == [JobPolicy.FILE]  # no temporary left behind
    await client.delete(f"/v1/jobs/{JOB}", headers=AUTH)
    assert daemon.policies.get(JOB) is None


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b'{"kind": "tierckpt.job-policy", "version": 1, "job": "team_train_1234abcd"}',
        assignment().to_bytes(),
        policy(job="another_job").to_bytes(),
        policy().to_bytes().replace(b'"generation":1', b'"generation":"7"'),
        policy().to_bytes().replace(b'"keep_last":2', b'"keep_last":0'),
        policy().to_bytes().replace(b'"keep_every":1000', b'"keep_every":-1'),
        policy().to_bytes().replace(b'"backup_interval_steps":100', b'"backup_interval_steps":true'),
        policy().to_bytes().replace(b'"prefix":"team/a"', b'"prefix":"../escape"'),
        policy().to_bytes().replace(b'"bucket":"ckpt-bucket"', b'"bucket":"Not A Bucket"'),
        policy().to_bytes().replace(b'"replication_factor":2', b'"replication_factor":99'),
        policy().to_bytes().replace(b'"version":1', b'"version":2'),
    ],
)
async def test_malformed_policies_change_nothing(api, body):
    client, daemon = api
    await client.put(f"/v1/jobs/{JOB}/policy", headers=AUTH, content=policy(3).to_bytes())
    path = state_dir(daemon.settings.root, JOB) / JobPolicy.FILE
    before = path.read_bytes()
    resp = await client.put(f"/v1/jobs/{JOB}/policy", headers=AUTH, content=body)
    assert resp.status_code == 400, resp.text
    assert path.read_bytes() == before


async def test_policy_bodies_are_bounded(api):
    client, daemon = api
    huge = policy().to_bytes()[:-1] + b',"config":"' + b"x" * (128 << 10) + b'"}'
    resp = await client.put(f"/v1/jobs/{JOB}/policy", headers=AUTH, content=huge)
    assert resp.status_code == 413
    assert not (daemon.settings.root / JOB).exists()


async def test_a_node_plan_stores_each_part_as_its_own_endpoint_would(api):
    """``PUT .../plan`` carries the policy, the peers and the restore plan in one call (the operator's one
    call a node, docs/benchmarks.md): each is stored, or refused for a newer generation, as its own
    endpoint would; a plan addressed to another node, or for another job, changes nothing."""
    client, daemon = api
    root = daemon.settings.root
    url = f"/v1/jobs/{JOB}/plan"
    restore = RestorePlan(job=JOB, step=None, world_size=4, sources={}, generation=1)
    whole = NodePlan(job=JOB, node="node-a", policy=policy(5), peers=assignment(2), restore_plan=restore)
    resp = await client.put(url, headers=AUTH, content=whole.to_bytes())
    assert resp.status_code == 200, resp.text
    assert NodePlanResult.from_bytes(resp.content) == NodePlanResult(
        job=JOB, node="node-a", stored=("policy", "peers", "restore_plan")
    )
    state = state_dir(root, JOB)
    assert JobPolicy.from_bytes((state / JobPolicy.FILE).read_bytes()) == policy(5)
    assert PeerAssignment.from_bytes((state / PeerAssignment.FILE).read_bytes()) == assignment(2)
    assert read_control(root, JOB, RestorePlan.FILE, RestorePlan) == restore
    assert daemon.policies.get(JOB) == policy(5)

    # older peers and policy are refused with what the node holds; the same plan again is stored
    stale = NodePlan(job=JOB, node="node-a", policy=policy(4), peers=assignment(1), restore_plan=restore)
    resp = await client.put(url, headers=AUTH, content=stale.to_bytes())
    assert resp.status_code == 200, resp.text
    assert NodePlanResult.from_bytes(resp.content) == NodePlanResult(
        job=JOB, node="node-a", stored=("restore_plan",), refused={"policy": 5, "peers": 2}
    )
    assert PeerAssignment.from_bytes((state / PeerAssignment.FILE).read_bytes()) == assignment(2)
    assert daemon.policies.get(JOB) == policy(5)

    # only a part: the newer peers alone
    resp = await client.put(
        url, headers=AUTH, content=NodePlan(job=JOB, node="node-a", peers=assignment(3)).to_bytes()
    )
    assert NodePlanResult.from_bytes(resp.content).stored == ("peers",)
    assert PeerAssignment.from_bytes((state / PeerAssignment.FILE).read_bytes()) == assignment(3)

    before = {f.name: f.read_bytes() for f in state.iterdir()}
    for path, body in (
        (url, NodePlan(job=JOB, node="node-b", peers=assignment(9)).to_bytes()),  # another node's
        (f"/v1/jobs/{JOB}x/plan", NodePlan(job=JOB, node="node-a", peers=assignment(9)).to_bytes()),
        (
            url,
            NodePlan(job=JOB, node="node-a", peers=assignment(9))
            .to_bytes()
            .replace(b'"peers":{', b'"peers":['),
        ),
        (
            url,
            b'{"kind":"tierckpt.node-plan","version":1,"job":"%s","node":"node-a"}' % JOB.encode(),
        ),  # no part
        (
            url,
            NodePlan(job=JOB, node="node-a", policy=policy(9))
            .to_bytes()
            .replace(b'"job":"team', b'"job":"tram', 2),
        ),
    ):
        resp = await client.put(path, headers=AUTH, content=body)
        assert resp.status_code == 400, (path, body, resp.text)
    assert {f.name: f.read_bytes() for f in state.iterdir()} == before


async def test_node_plan_bodies_are_bounded(api):
    client, daemon = api
    huge = b'{"kind":"tierckpt.node-plan","pad":"' + b"x" * (128 << 10) + b'"}'
    resp = await client.put(f"/v1/jobs/{JOB}/plan", headers=AUTH, content=huge)
    assert resp.status_code == 413
    assert not (daemon.settings.root / JOB).exists()
