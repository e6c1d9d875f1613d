"""The one client of the control API (``tierckpt.protocol.client``): every call against the real
replicator app in-process, and the retry policy, size bound, typed decoding, token and quoting rules
against scripted answers (httpx's MockTransport), for the async and the sync form alike."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from tierckpt.protocol.client import (
    ReplicatorClient,
    ReplicatorError,
    RetryPolicy,
    SyncReplicatorClient,
)
from tierckpt.protocol.control import (
    BackupResult,
    JobPolicy,
    NodeInventory,
    NodePlan,
    NodePlanResult,
    PeerAssignment,
    PeerNode,
    PurgeResult,
    RestoreAccepted,
    RestorePlan,
)
from tierckpt.protocol.errors import ContractError, RetryableError
from tierckpt.protocol.tokens import TokenFile
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.daemon import Daemon
from tierckpt_replicator.settings import Settings

JOB = "team_train_1234abcd"
NODE = "http://10.0.0.9:8470/?data=9000"  # the ?data= part is never sent
FAST = RetryPolicy(attempts=3, backoff=0.001)


@pytest.fixture
def token(tmp_path: Path) -> TokenFile:
    path = tmp_path / "token"
    path.write_text("first-token\n")
    return TokenFile(path)


# ------------------------------------------------------------------------------ the real server


@pytest.fixture
async def served(tmp_path: Path, token: TokenFile) -> AsyncIterator[tuple[ReplicatorClient, Daemon]]:
    root = tmp_path / "ramdisk"
    root.mkdir()
    daemon = Daemon(
        Settings(
            node_name="node-a", root=root, auth="token", token_file=token.path, advertise_host="10.0.0.9"
        )
    )
    client = ReplicatorClient(token=token, retry=FAST, transport=httpx.ASGITransport(app=daemon.app))
    yield client, daemon
    await client.aclose()
    await daemon.shutdown()


async def test_every_call_against_the_real_app(served):
    client, daemon = served
    root = daemon.settings.root
    write_step(root, JOB, 0, 10, world_size=2, sizes=(64,))
    inv = await client.inventory(NODE, JOB, node="node-a")
    assert isinstance(inv, NodeInventory) and inv.ranks[0].local == (10,)
    nodes = {"node-a": PeerNode("node-a", NODE), "node-b": PeerNode("node-b", "http://10.0.0.8:8470")}
    peers = PeerAssignment(job=JOB, generation=2, nodes=nodes, peers={"node-a": ("node-b",)})
    assert await client.put_peers(NODE, peers) == peers
    with pytest.raises(ReplicatorError) as refused:  # not newer: final at once, with its status
        await client.put_peers(NODE, peers)
    assert refused.value.status == 409 and refused.value.endpoint == NODE
    policy = JobPolicy(job=JOB, generation=1, bucket="ckpt-bucket")
    assert await client.put_policy(NODE, policy) == policy
    plan = RestorePlan(job=JOB, step=None, world_size=2, sources={}, generation=2)
    assert await client.put_restore_plan(NODE, plan) == plan
    assert await client.restore(NODE, JOB) == RestoreAccepted(job=JOB, staging=True)
    with pytest.raises(
        ReplicatorError
    ) as unconfigured:  # no bucket on this node: 503, retried, then given up
        await client.backup(NODE, JOB)
    assert unconfigured.value.status == 503 and "not configured" in str(unconfigured.value)
    status = await client.status(NODE)
    assert status.node == "node-a" and [j.job for j in status.jobs] == [JOB]
    assert await client.purge(NODE, JOB) == PurgeResult(job=JOB, purged=True, bucket=False)
    assert not (root / JOB).exists()
    assert await client.purge(NODE, JOB) == PurgeResult(job=JOB, purged=False, bucket=False)
    assert await client.ready(NODE) is False  # no worker running in this test
    with pytest.raises(ContractError, match="answers as node"):
        await client.inventory(NODE, JOB, node="node-b")
    anonymous = ReplicatorClient(transport=httpx.ASGITransport(app=daemon.app))
    with pytest.raises(ReplicatorError) as no_token:
        await anonymous.status(NODE)
    assert no_token.value.status == 401
    await anonymous.aclose()


async def test_a_node_plan_is_one_call_and_its_shared_parts_are_encoded_once(served, monkeypatch):
    """The operator sends each node one ``NodePlan``: every node's own peers, and the job's one policy
    and restore plan. Each plan's bytes are what ``to_bytes`` gives, put together from its parts' JSON,
    each shared part encoded once however many nodes' plans carry it."""
    from tierckpt.protocol import client as client_module

    client, daemon = served
    nodes = {"node-a": PeerNode("node-a", NODE), "node-b": PeerNode("node-b", "http://10.0.0.8:8470")}
    peers = PeerAssignment(job=JOB, generation=2, nodes=nodes, peers={"node-a": ("node-b",)})
    policy = JobPolicy(job=JOB, generation=1, bucket="ckpt-bucket")
    plan = RestorePlan(job=JOB, step=None, world_size=2, sources={}, generation=2)
    whole = NodePlan(job=JOB, node="node-a", policy=policy, peers=peers, restore_plan=plan)
    assert await client.put_node_plan(NODE, whole, node="node-a") == NodePlanResult(
        job=JOB, node="node-a", stored=("policy", "peers", "restore_plan")
    )
    assert daemon.policies.get(JOB) == policy and daemon.assignments.get(JOB) == peers
    with pytest.raises(ContractError, match="answers as node"):  # the answer must come from that node
        await client.put_node_plan(NODE, whole, node="node-b")

    policy, plan = JobPolicy(job=JOB, generation=3, bucket="ckpt-bucket"), dataclasses.replace(plan, step=7)
    encoded = []
    real = client_module.record_bytes
    monkeypatch.setattr(client_module, "record_bytes", lambda r: encoded.append(r) or real(r))
    plans = [NodePlan(job=JOB, node=f"node-{i}", policy=policy, restore_plan=plan) for i in range(50)]
    assert all(client_module._encoded(p) == p.to_bytes() for p in plans)
    assert encoded == [policy, plan]


# ------------------------------------------------------------------------------ scripted answers


class Script:
    """Answers requests from a list of (status, body) or exceptions; records what was asked."""

    def __init__(self, *answers: tuple[int, bytes] | Exception) -> None:
        self.answers, self.requests = list(answers), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer[0], content=answer[1])


def purge_answer(job: str = JOB) -> tuple[int, bytes]:
    return 200, PurgeResult(job=job, purged=True).to_bytes()


Call = Callable[..., object]


@pytest.fixture(params=["sync", "async"])
def make(request, token: TokenFile) -> Callable[..., Call]:
    """``make(script, **client_kw)`` -> ``call(method_name, *args, **kw)`` on a client of either form."""

    def build(script: Script, **kw: object) -> Call:
        kw.setdefault("retry", FAST)
        kw.setdefault("token", token)
        if request.param == "sync":
            sync = SyncReplicatorClient(transport=httpx.MockTransport(script), **kw)  # type: ignore[arg-type]
            return lambda name, *a, **k: getattr(sync, name)(*a, **k)

        async def handler(req: httpx.Request) -> httpx.Response:
            return script(req)

        def call(name: str, *a: object, **k: object) -> object:
            async def run() -> object:
                async with ReplicatorClient(transport=httpx.MockTransport(handler), **kw) as client:  # type: ignore[arg-type]
                    return await getattr(client, name)(*a, **k)

            return asyncio.run(run())

        return call

    return build


def test_transient_answers_are_retried_then_given_up(make):
    script = Script((503, b"busy"), (502, b""), purge_answer())
    assert make(script)("purge", NODE, JOB) == PurgeResult(job=JOB, purged=True)
    assert len(script.requests) == 3
    for status in (408, 425, 429, 500, 504):
        script = Script((status, b"again"))
        with pytest.raises(ReplicatorError) as exc:
            make(script)("purge", NODE, JOB)
        assert exc.value.status == status and len(script.requests) == 3
        assert isinstance(exc.value, RetryableError)


def test_other_answers_are_final(make):
    for status in (400, 401, 403, 409, 413):
        script = Script((status, b'{"detail": "no"}'))
        with pytest.raises(ReplicatorError) as exc:
            make(script)("restore", NODE, JOB)
        assert exc.value.status == status and len(script.requests) == 1 and "no" in str(exc.value)
    script = Script((404, b""))  # a node without the job's route: nothing held, nothing to purge
    assert make(script)("inventory", NODE, JOB) is None and make(script)("purge", NODE, JOB) is None
    with pytest.raises(ReplicatorError) as exc:
        make(Script((404, b"")))("status", NODE)
    assert exc.value.status == 404


def test_no_answer_is_retried_then_given_up(make):
    script = Script(httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), purge_answer())
    assert make(script)("purge", NODE, JOB) is not None and len(script.requests) == 3
    script = Script(httpx.ConnectError("refused"))
    with pytest.raises(ReplicatorError, match="ConnectError") as exc:
        make(script, retry=RetryPolicy(attempts=2, backoff=0.001))("purge", NODE, JOB)
    assert exc.value.status is None and len(script.requests) == 2
    assert make(Script(httpx.ConnectError("refused")))("ready", NODE) is False


def test_answers_are_typed_and_bounded(make):
    good = BackupResult(job=JOB, step=7)
    assert make(Script((200, good.to_bytes())))("backup", NODE, JOB) == good
    for body in (
        b"not json",
        b'{"kind": "tierckpt.backup-result", "version": 1}',  # fields missing
        b'{"kind": "tierckpt.purge-result", "version": 1, "job": "x", "purged": true}',  # another kind
        BackupResult(job="another_job", step=7).to_bytes(),  # for another job
    ):
        with pytest.raises(ContractError):
            make(Script((200, body)))("backup", NODE, JOB)
    huge = b'{"kind": "tierckpt.backup-result", "pad": "' + b"x" * 5000 + b'"}'
    with pytest.raises(ContractError, match="exceeds 1000"):
        make(Script((200, huge)), max_answer_bytes=1000)("backup", NODE, JOB)

    def streamed(request: httpx.Request) -> httpx.Response:  # no Content-Length: cut off while reading
        return httpx.Response(200, content=iter([b"x" * 600] * 5))

    client = SyncReplicatorClient(transport=httpx.MockTransport(streamed), max_answer_bytes=1000)
    with pytest.raises(ContractError, match="exceeds 1000 bytes"):
        client.backup(NODE, JOB)
    client.close()


def test_requests_come_from_the_table(make, token: TokenFile):
    script = Script(purge_answer())
    make(script)("purge", NODE, JOB, backups=True)
    (req,) = script.requests
    assert (req.method, str(req.url)) == ("DELETE", f"http://10.0.0.9:8470/v1/jobs/{JOB}?bucket=true")
    assert req.headers["authorization"] == "Bearer first-token"
    replacement = token.path.with_name("token.new")
    replacement.write_text("second-token")
    replacement.replace(token.path)  # how a Secret volume rotates
    policy = JobPolicy(job=JOB, generation=3)
    script = Script((200, policy.to_bytes()))
    make(script)("put_policy", NODE, policy)
    (req,) = script.requests
    assert req.headers["authorization"] == "Bearer second-token"
    assert (req.method, req.url.path, req.content) == ("PUT", f"/v1/jobs/{JOB}/policy", policy.to_bytes())
    assert req.headers["content-type"] == "application/json"
    script = Script(purge_answer())
    make(script, token=None)("purge", NODE, JOB)
    assert "authorization" not in script.requests[0].headers


def test_bad_job_ids_and_endpoints_never_leave_the_client(make):
    script = Script(purge_answer())
    for job in ("../status", "a/b", "", ".hidden", "x\n", "a b"):
        with pytest.raises(ContractError, match="invalid job"):
            make(script)("purge", NODE, job)
    for endpoint in ("ftp://x:1", "http://x", "10.0.0.1:8470"):
        with pytest.raises(ContractError, match="http"):
            make(script)("purge", endpoint, JOB)
    assert script.requests == []
