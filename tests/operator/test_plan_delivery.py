"""How the operator delivers a job's plans (``JobController._send_plans``): one call a node, carrying the
parts of the policy, its peers and the restore plan that it does not hold yet; nothing to a node that
holds them all; a replicator from before ``PUT .../plan`` (404) gets the parts on their own endpoints;
a part refused for a newer generation is planned again. Inventories are asked once a round, however many
callers want them at once."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace
from typing import Any

from tierckpt.protocol.client import ReplicatorError
from tierckpt.protocol.control import PLAN_PARTS, JobPolicy, NodeInventory, NodePlan, NodePlanResult
from tierckpt_operator.clusterview import ClusterView
from tierckpt_operator.decisions import JobState, decide_peers, restore_plan
from tierckpt_operator.metrics import Metrics
from tierckpt_operator.pods import ReplicatorPod
from tierckpt_operator.reconcile import JobContext, JobController, _Restore
from tierckpt_operator.settings import parse_settings

JOB = "team_train_1234abcd"
NODES = ("n0", "n1", "n2", "n3")


class _Replicators:
    """The replicators as the operator calls them: what each node was sent, by which endpoint."""

    def __init__(self, old: tuple[str, ...] = (), slots: int = 64) -> None:
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self.slots = asyncio.Semaphore(slots)
        """The client's ``--http-concurrency``: every call holds one."""
        self.answer = asyncio.Event()
        self.answer.set()
        """Inventories are answered while set."""
        self.old = old
        """Nodes whose replicator predates ``PUT .../plan`` (it answers 404)."""
        self.refuse: dict[str, dict[str, int]] = {}
        """Node -> the parts it refuses, with the newer generation it holds."""

    async def put_node_plan(self, endpoint: str, plan: NodePlan, *, node: str) -> NodePlanResult:
        assert plan.node == node and plan.job == JOB
        async with self.slots:
            pass
        sent = tuple(name for name, part in zip(PLAN_PARTS, plan.parts(), strict=True) if part is not None)
        self.calls.append((node, "put_node_plan", sent))
        if node in self.old:
            raise ReplicatorError(endpoint, "PUT /v1/jobs/j/plan failed: HTTP 404", 404)
        refused = {p: g for p, g in self.refuse.get(node, {}).items() if p in sent}
        stored = tuple(p for p in sent if p not in refused)
        return NodePlanResult(job=plan.job, node=node, stored=stored, refused=refused)

    async def inventory(self, endpoint: str, job: str, *, node: str) -> NodeInventory:
        async with self.slots:
            self.calls.append((node, "inventory", ()))
            await asyncio.sleep(0.05)
            await self.answer.wait()
        return NodeInventory(job=job, node=node, endpoint=endpoint, updated_at=time.time(), ranks={})

    async def put_policy(self, endpoint: str, policy: Any, *, node: str) -> Any:
        self.calls.append((node, "put_policy", ()))
        return policy

    async def put_peers(self, endpoint: str, peers: Any, *, node: str) -> Any:
        self.calls.append((node, "put_peers", ()))
        return peers

    async def put_restore_plan(self, endpoint: str, plan: Any, *, node: str) -> Any:
        self.calls.append((node, "put_restore_plan", ()))
        return plan


def _job(replicators: _Replicators, concurrency: int = 64) -> tuple[JobController, JobState, ClusterView]:
    ctx = JobContext(
        settings=parse_settings(["--debounce", "0.01", "--http-concurrency", str(concurrency)]),
        kube=None,  # type: ignore[arg-type]  # no API calls here
        replicators=replicators,  # type: ignore[arg-type]
        metrics=Metrics(),
        running=lambda: True,
        track_nodes=lambda key, nodes: None,
    )
    ctl = JobController(ctx, ("team", "train"))
    ctl.job_id = JOB
    state = JobState(generation=1, nodes=NODES, domains=("a", "b", "a", "b"), pods=NODES)
    state = dataclasses.replace(state, peers=decide_peers(state, 1), peer_generation=1795839428974)
    endpoints = {n: f"https://10.0.0.{i}:8470" for i, n in enumerate(NODES)}
    ctl.state = state
    ctl.outgoing = ctl._peer_messages(SimpleNamespace(job_id=JOB), state, endpoints)  # type: ignore[arg-type]
    ctl.peer_digest = "planned"
    ctl.policy = JobPolicy(job=JOB, generation=5, bucket="ckpt-bucket")
    ctl.restore = _Restore(restore_plan(JOB, state, [], None, time.time()))
    pods = {n: [ReplicatorPod(n, ep, True)] for n, ep in endpoints.items()}
    return ctl, state, ClusterView({"tierckpt_replicators": pods})


async def test_every_node_gets_what_it_lacks_in_one_call_and_nothing_twice():
    replicators = _Replicators()
    ctl, state, cluster = _job(replicators)
    await ctl._send_plans(state, cluster, restore=False)  # Orbax mode: the restore plan after the sessions
    assert replicators.calls == [(n, "put_node_plan", ("policy", "peers")) for n in NODES]
    replicators.calls.clear()
    await ctl._send_plans(state, cluster)
    assert replicators.calls == [(n, "put_node_plan", ("restore_plan",)) for n in NODES]
    replicators.calls.clear()
    await ctl._send_plans(state, cluster)
    assert replicators.calls == []  # every node holds everything
    assert ctl.restore is not None and ctl.restore.delivered(NODES) == len(NODES)
    ctl.policy = dataclasses.replace(ctl.policy, generation=6)  # the configuration changed
    await ctl._send_plans(state, cluster)
    assert replicators.calls == [(n, "put_node_plan", ("policy",)) for n in NODES]


async def test_a_fresh_job_sends_each_node_policy_peers_and_plan_together():
    replicators = _Replicators()
    ctl, state, cluster = _job(replicators)
    await ctl._send_plans(state, cluster)
    assert replicators.calls == [(n, "put_node_plan", PLAN_PARTS) for n in NODES]
    assert set(ctl.delivered) == set(NODES) and set(ctl.policy_delivered) == set(NODES)


async def test_a_replicator_from_before_the_plan_endpoint_gets_each_part_on_its_own():
    replicators = _Replicators(old=("n1",))
    ctl, state, cluster = _job(replicators)
    await ctl._send_plans(state, cluster)
    assert [c for c in replicators.calls if c[0] == "n1"] == [
        ("n1", "put_node_plan", PLAN_PARTS),
        ("n1", "put_policy", ()),
        ("n1", "put_peers", ()),
        ("n1", "put_restore_plan", ()),
    ]
    replicators.calls.clear()
    await ctl._send_plans(state, cluster)
    assert replicators.calls == []  # n1 holds them all now


async def test_a_part_refused_for_a_newer_generation_is_planned_again():
    replicators = _Replicators()
    replicators.refuse["n2"] = {"peers": 1795839499999, "policy": 7}
    ctl, state, cluster = _job(replicators)
    await ctl._send_plans(state, cluster)
    assert "n2" not in ctl.delivered and "n2" not in ctl.policy_delivered
    assert ctl.peer_digest is None and ctl.policy is None  # the next reconcile plans newer generations
    assert ctl.outgoing is not None and "n2" not in ctl.outgoing  # n2's view made anew, not kept
    assert ctl.restore is not None and "n2" in ctl.restore.acked  # the part it took counts


async def test_callers_wanting_inventories_at_once_share_one_round():
    """The refresh timer's round and a reconcile's (choosing the restore plan) met at 1,024 nodes: every
    node was asked twice. A round in flight is shared; the next round asks again."""
    replicators = _Replicators()
    ctl, state, cluster = _job(replicators)
    first, second = await asyncio.gather(
        ctl._inventories(state.nodes, cluster), ctl._inventories(state.nodes, cluster)
    )
    assert sorted(i.node for i in first) == sorted(NODES) and second == first
    assert replicators.calls == [(n, "inventory", ()) for n in NODES]
    await ctl._inventories(state.nodes, cluster)
    assert len(replicators.calls) == 2 * len(NODES)
    await asyncio.gather(ctl._inventories(state.nodes, cluster), ctl._inventories(NODES[:2], cluster))
    assert len(replicators.calls) == 3 * len(NODES) + 2  # other nodes: a round of their own


async def test_a_replicator_not_ready_gets_nothing_and_its_plan_is_due_when_it_is():
    replicators = _Replicators()
    ctl, state, cluster = _job(replicators)
    cluster.indices["tierckpt_replicators"]["n3"] = [ReplicatorPod("n3", "https://10.0.0.3:8470", False)]
    await ctl._send_plans(state, cluster)
    assert [c[0] for c in replicators.calls] == ["n0", "n1", "n2"]
    assert not ctl.wake.is_set()
    await asyncio.sleep(0.2)
    assert ctl.wake.is_set()  # the job is reconciled again for n3's restore plan


async def test_a_round_of_inventories_leaves_calls_free_for_the_plans():
    """At 4,096 nodes on an overloaded VM the refresh round's inventory calls timed out and retried while
    a replaced node's calls waited behind them for the client's slots (233 s). A round takes at most
    half of ``--http-concurrency``."""
    replicators = _Replicators(slots=2)
    replicators.answer.clear()  # the nodes do not answer their inventories yet
    ctl, state, cluster = _job(replicators, concurrency=2)
    round_ = asyncio.ensure_future(ctl._inventories(state.nodes, cluster))
    await asyncio.sleep(0.1)
    await asyncio.wait_for(ctl._send_plans(state, cluster), 2)  # not behind the round
    assert not round_.done()
    replicators.answer.set()
    assert len(await round_) == len(NODES)
