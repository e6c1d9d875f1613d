"""End to end: the real operator (kopf, in its own thread) against the API emulator, real replicator
processes on loopback, and the webhooks called over HTTPS with AdmissionReviews as kube-apiserver
calls them. Pods are created, bound and restarted the way the JobSet controller, the Job controller
and the scheduler do it.

Covered: first start; a restart on the same nodes (ranks stay, restore from local copies); one node
replaced (its rank moves to the replacement, restored from the peer replica); a whole failure domain
lost; a configuration edit (peers re-planned, the backup policy re-sent); JobSet deletion purging
every node.
"""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest

from tests.fixtures.cluster import write_sparse_step
from tests.operator.operator_harness import eventually, jobset_body
from tierckpt.protocol.contract import Annotations
from tierckpt.protocol.control import (
    JobPolicy,
    PeerAssignment,
    RestorePlan,
    RestoreState,
    Tier,
    read_control,
    read_restore_status,
)
from tierckpt.protocol.format import committed_steps, job_dir, rank_dir, replica_rank_dir
from tierckpt_demo.step_writer import write_step
from tierckpt_operator.status_fields import parse_ranges

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NS, NAME = "team", "train"
ZONES = [("n0", "a"), ("n1", "a"), ("n2", "b"), ("n3", "b"), ("n4", "c"), ("n5", "c")]
STEP = 40


def ranks_by_node(cluster, attempt):
    out = {}
    for pod in cluster.pods(NS, NAME, attempt):
        ann = pod["metadata"].get("annotations", {})
        if ann.get(Annotations.ASSIGNMENT_GENERATION) == str(attempt) and Annotations.NODE_RANK in ann:
            out[pod["spec"]["nodeName"]] = int(ann[Annotations.NODE_RANK])
    return out


def status(cluster):
    return (cluster.checkpoint_job(NS, NAME) or {}).get("status", {})


async def place(env, nodes, attempt, *, seed):
    """Create the attempt's pods and bind them to ``nodes`` in a shuffled order."""
    pods = await env.cluster.create_pods(NS, NAME)
    order = list(nodes)
    random.Random(seed).shuffle(order)
    for pod, node in zip(pods, order, strict=True):
        await env.cluster.schedule(NS, pod["metadata"]["name"], node)
    return await eventually(
        lambda: (r := ranks_by_node(env.cluster, attempt)) and len(r) == len(nodes) and r,
        30,
        f"ranks of attempt {attempt}",
    )


async def restore_plan(env, attempt):
    return await eventually(
        lambda: (
            (s := status(env.cluster)).get("phase") == "Running"
            and s.get("restore", {}).get("generation") == attempt
            and s["restore"]
        ),
        30,
        f"restore plan of attempt {attempt}",
    )


async def save_everywhere(env, job, ranks, step, world):
    """Each node's trainer commits ``step`` for its rank; wait until every rank is replicated."""
    for node, rank in ranks.items():
        write_step(env.replicators.nodes[node].root, job, rank, step, world_size=world, sizes=(4096, 700))
    await eventually(lambda: status(env.cluster).get("latestReplicatedStep") == step, 40, "replicated step")


def policies(env, job, names):
    """The policy each named node's replicator stored (None where it has none yet)."""
    return {n: read_control(env.replicators.nodes[n].root, job, JobPolicy.FILE, JobPolicy) for n in names}


def policy_matches(policy, spec):
    """Whether a stored JobPolicy says what the CheckpointConfiguration spec says."""
    backup, retention = spec.get("backup", {}), spec.get("backup", {}).get("retention", {})
    return policy is not None and (
        policy.bucket,
        policy.prefix,
        policy.backup_interval_steps,
        policy.backup_interval_minutes,
        policy.keep_last,
        policy.keep_every,
        policy.replication_factor,
        policy.delete_backups_on_deletion,
    ) == (
        spec["gcs"]["bucket"],
        spec["gcs"].get("prefix", "tierckpt"),
        backup.get("intervalSteps", 0),
        backup.get("intervalMinutes", 30),
        retention.get("keepLast", 3),
        retention.get("keepEvery", 0),
        spec["replication"]["factor"],
        spec.get("deleteBackupsOnJobSetDeletion", False),
    )


def policies_as_configured(env, job, names):
    """Each named node's stored policy, once all of them say what the configuration says (else None)."""
    spec = env.cluster.obj("tierckpt.io/v1alpha1/checkpointconfigurations", None, "default")["spec"]
    got = policies(env, job, names)
    return got if all(policy_matches(p, spec) for p in got.values()) else None


async def start_job(env, zones=ZONES, factor=1, **spec):
    nodes = await env.add_nodes(*zones)
    await env.cluster.config(
        replication={"factor": factor, "failureDomainLabel": "topology.kubernetes.io/zone"},
        backup={"intervalSteps": 100, "retention": {"keepLast": 2}},
        **spec,
    )
    await env.start_operator()
    js = await env.cluster.create_jobset(NS, jobset_body(NAME, [("workers", 3, 2)]))
    job = f"{NS}_{NAME}_{js['metadata']['uid'].replace('-', '')[:8]}"
    await eventually(lambda: env.cluster.checkpoint_job(NS, NAME), what="CheckpointJob")
    return nodes, job


async def test_first_start_restart_and_node_replacement(env):
    nodes, job = await start_job(env)
    ck = env.cluster.checkpoint_job(NS, NAME)
    assert ck["metadata"]["ownerReferences"][0]["name"] == NAME
    assert ck["spec"]["numNodes"] == 6 and ck["spec"]["jobId"] == job

    # first start: ranks are the initial ranks (job index * parallelism + completion index)
    pods = await env.cluster.create_pods(NS, NAME)
    for pod, node in zip(pods, nodes, strict=True):
        await env.cluster.schedule(NS, pod["metadata"]["name"], node.name)
    first = await eventually(lambda: len(r := ranks_by_node(env.cluster, 0)) == 6 and r, 30, "first ranks")
    assert first == {n.name: i for i, n in enumerate(nodes)}
    plan0 = await restore_plan(env, 0)
    assert plan0["freshStart"] and "step" not in plan0
    st = status(env.cluster)
    assert st["nodes"] == [n.name for n in nodes] and st["domains"] == ["a", "a", "b", "b", "c", "c"]
    for r, peers in enumerate(st["peers"]):
        assert len(peers) == 1 and st["domains"][peers[0]] != st["domains"][r]
    for node in nodes:  # the real replicators stored what the operator published
        assignment = read_control(node.root, job, PeerAssignment.FILE, PeerAssignment)
        assert assignment.node_ranks == {n.name: i for i, n in enumerate(nodes)}
        assert assignment.peers[node.name] == tuple(st["nodes"][p] for p in st["peers"][first[node.name]])
        assert read_control(node.root, job, RestorePlan.FILE, RestorePlan).step is None
    stored = await eventually(
        lambda: policies_as_configured(env, job, first), 20, "every replicator stored the policy"
    )
    assert {(p.generation, p.config) for p in stored.values()} == {(stored["n0"].generation, "default")}
    assert {e["reason"] for e in env.cluster.events()} >= {
        "CheckpointingEnabled",
        "RanksAssigned",
        "FreshStart",
    }
    cfg = await eventually(
        lambda: (
            (c := env.cluster.obj("tierckpt.io/v1alpha1/checkpointconfigurations", None, "default"))
            and c.get("status", {}).get("jobs") == 1
            and c["status"]
        ),
        20,
        "configuration status",
    )
    assert (cfg["nodes"], cfg["nodesReady"], cfg["nodesSelected"]) == ("6/6", 6, 6)
    assert [c["status"] for c in cfg["conditions"] if c["type"] == "Ready"] == ["True"]

    await save_everywhere(env, job, first, STEP, 6)
    assert status(env.cluster)["latestLocalStep"] == STEP
    # every rank's replica confirmed: the job reports full redundancy from the nodes' inventories
    await eventually(lambda: status(env.cluster).get("redundancy") == "replicas: 1/1", 30, "redundancy")
    assert status(env.cluster).get("degradedSince") is None
    # the operator's metrics (served without credentials) name no job: which one is degraded is in
    # the CheckpointJob's status
    assert env.operator is not None and env.operator.runtime is not None
    page = generate_latest(env.operator.runtime.metrics.registry).decode()
    assert f"{NS}/{NAME}" not in page and 'job="' not in page
    assert "tierckpt_operator_jobs_degraded 0.0" in page

    # all pods restarted, landing on the same nodes in another order: every rank stays on its node
    attempt = await env.cluster.restart(NS, NAME)
    again = await place(env, [n.name for n in nodes], attempt, seed=1)
    assert again == first
    plan1 = await restore_plan(env, attempt)
    assert plan1["step"] == STEP and not plan1["freshStart"] and set(plan1["sources"]) == {Tier.LOCAL.value}

    def plan_stands(node) -> bool:  # the plan a replicator restarted now would stage (the soak's 45 for 48)
        stored = read_control(node.root, job, RestorePlan.FILE, RestorePlan)
        held = read_control(node.root, job, PeerAssignment.FILE, PeerAssignment)
        return stored.generation == held.attempt == attempt and stored.stands_for(held) is None

    for node in nodes:  # the same nodes and peers, but each assignment names the new attempt
        await eventually(lambda node=node: plan_stands(node), 20, f"{node.name} holds attempt {attempt}")

    # one node replaced by a new node in the same failure domain: it inherits the vacated rank
    env.replicators.kill("n2")
    await env.cluster.remove_node("n2")
    (n6,) = await env.add_nodes(("n6", "b"))
    attempt = await env.cluster.restart(NS, NAME)
    survivors = [n.name for n in nodes if n.name != "n2"] + ["n6"]
    moved = await place(env, survivors, attempt, seed=2)
    assert moved == {**{k: v for k, v in first.items() if k != "n2"}, "n6": first["n2"]}
    plan2 = await restore_plan(env, attempt)
    assert plan2["step"] == STEP and parse_ranges(plan2["sources"]["replica"]) == [first["n2"]]
    assert status(env.cluster)["peers"] == st["peers"]  # same domain: the peer plan is unchanged
    assert policies_as_configured(env, job, ["n6"])  # the replacement got the policy too
    rank = first["n2"]
    staged = await eventually(
        lambda: (s := read_restore_status(n6.root, job, rank)) and s.state == RestoreState.READY and s,
        40,
        "the replacement node staged its rank",
    )
    assert staged.step == STEP and committed_steps(rank_dir(n6.root, job, rank)) == [STEP]
    # and the replicas the lost node held exist again: full redundancy with no save in between
    await eventually(lambda: status(env.cluster).get("redundancy") == "replicas: 1/1", 40, "healed")

    # deleting the JobSet purges the job on every node and removes the CheckpointJob
    await env.cluster.delete(f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/{NAME}")
    await eventually(
        lambda: env.cluster.obj("jobset.x-k8s.io/v1alpha2/jobsets", NS, NAME) is None,
        30,
        "JobSet gone (finalizer released)",
    )
    assert env.cluster.checkpoint_job(NS, NAME) is None
    for name in survivors:
        assert not job_dir(env.replicators.nodes[name].root, job).exists()
    assert env.cluster.events("JobDataPurged")


def pod_on(cluster, node, attempt):
    return next(
        p["metadata"]["name"] for p in cluster.pods(NS, NAME, attempt) if p["spec"].get("nodeName") == node
    )


async def test_a_node_replaced_within_an_attempt_is_restored_and_the_job_runs_again(env):
    """A pod fails and the Job controller recreates it (same attempt) on a new node: the replacement
    inherits the rank, gets the attempt's plan and stages the rank; the job is ``Running`` again with
    the plan delivered to the job's nodes only (not counting the node that left: "6/6", never "7/6")."""
    nodes, job = await start_job(env)
    first = await place(env, [n.name for n in nodes], 0, seed=5)
    await restore_plan(env, 0)
    await save_everywhere(env, job, first, STEP, 6)
    attempt = await env.cluster.restart(NS, NAME)
    assert await place(env, [n.name for n in nodes], attempt, seed=6) == first
    assert (await restore_plan(env, attempt))["step"] == STEP

    env.replicators.kill("n2")
    await env.cluster.remove_node("n2")
    (n6,) = await env.add_nodes(("n6", "b"))
    replacement = await env.cluster.replace_pod(NS, NAME, pod_on(env.cluster, "n2", attempt))
    await env.cluster.schedule(NS, replacement["metadata"]["name"], "n6")
    rank = first["n2"]
    await eventually(
        lambda: ranks_by_node(env.cluster, attempt).get("n6") == rank, 30, "the rank moved to the replacement"
    )
    running = await eventually(
        lambda: (
            (s := status(env.cluster)).get("phase") == "Running"
            and s["nodes"][rank] == "n6"
            and s.get("restore", {}).get("published") == 6
            and s
        ),
        40,
        "the job running again with the replacement",
    )
    assert running["restore"]["generation"] == attempt and running["assignmentGeneration"] == attempt
    planned = next(c for c in running["conditions"] if c["type"] == "RestorePlanned")
    assert (planned["status"], planned["message"]) == ("True", "6/6 nodes")
    staged = await eventually(
        lambda: (s := read_restore_status(n6.root, job, rank)) and s.state == RestoreState.READY and s,
        40,
        "the replacement node staged its rank",
    )
    assert staged.step == STEP and committed_steps(rank_dir(n6.root, job, rank)) == [STEP]


async def test_a_replaced_pod_whose_deletion_was_never_seen_does_not_hold_the_ranks(env):
    """The old pod leaves the API with no watch event (lost between two watch streams): the operator sees
    two scheduled pods for one rank, looks them up, forgets the one the API no longer has, and assigns
    the rank to the replacement (it waited forever at 4,096 nodes: "4097 scheduled pods for 4096
    ranks")."""
    nodes, _ = await start_job(env)
    first = await place(env, [n.name for n in nodes], 0, seed=5)
    env.replicators.kill("n2")
    await env.cluster.remove_node("n2")
    await env.add_nodes(("n6", "b"))
    old = pod_on(env.cluster, "n2", 0)
    replacement = await env.cluster.replace_pod(NS, NAME, old, deletion_seen=False)
    await env.cluster.schedule(NS, replacement["metadata"]["name"], "n6")
    rank = first["n2"]
    await eventually(
        lambda: ranks_by_node(env.cluster, 0).get("n6") == rank, 40, "the rank moved to the replacement"
    )
    assert env.cluster.obj("v1/pods", NS, old) is None


async def test_a_step_over_the_jobs_ramdisk_size_is_refused_and_reported(env):
    """A pod commits a step whose data file is a hole far larger than the job's ramdisk size: the
    replicators refuse to send it (the operator gave them that size as the job's quota) and the
    CheckpointJob says so, with a QuotaExceeded event."""
    nodes, job = await start_job(env, ramdisk={"size": "8Mi"})
    first = await place(env, [n.name for n in nodes], 0, seed=5)
    await restore_plan(env, 0)
    stored = await eventually(lambda: policies_as_configured(env, job, first), 20, "the policies")
    assert {p.quota_bytes for p in stored.values()} == {8 << 20}
    await save_everywhere(env, job, first, STEP, 6)
    name, rank = min(first.items())
    write_sparse_step(env.replicators.nodes[name].root, job, rank, STEP + 1, declared=24 << 20, world_size=6)
    refused = f"{name}: job {job} rank {rank} step {STEP + 1} declares 24.0Mi, over the job's quota of 8.0Mi"
    await eventually(lambda: refused in (status(env.cluster).get("overQuota") or ""), 30, "status.overQuota")
    (event,) = await eventually(lambda: env.cluster.events("QuotaExceeded"), 30, "a QuotaExceeded event")
    assert event["type"] == "Warning" and refused in event["message"] and "sparse" in event["message"]
    for node in env.replicators.nodes.values():  # no peer took it
        assert STEP + 1 not in committed_steps(replica_rank_dir(node.root, job, rank))
    # the next step within the quota clears the report
    await save_everywhere(env, job, first, STEP + 2, 6)
    await eventually(lambda: status(env.cluster).get("overQuota") is None, 30, "status.overQuota cleared")


async def test_whole_failure_domain_lost(env):
    nodes, job = await start_job(env)
    first = await place(env, [n.name for n in nodes], 0, seed=3)
    await restore_plan(env, 0)
    before = status(env.cluster)
    await save_everywhere(env, job, first, STEP, 6)

    for name in ("n2", "n3"):  # zone b is gone, with both of its nodes
        env.replicators.kill(name)
        await env.cluster.remove_node(name)
    await env.add_nodes(("n6", "d"), ("n7", "d"))
    attempt = await env.cluster.restart(NS, NAME)
    ranks = await place(env, ["n0", "n1", "n4", "n5", "n6", "n7"], attempt, seed=4)
    for name in ("n0", "n1", "n4", "n5"):
        assert ranks[name] == first[name]
    assert {ranks["n6"], ranks["n7"]} == {first["n2"], first["n3"]}
    plan = await restore_plan(env, attempt)
    assert plan["step"] == STEP
    assert sorted(parse_ranges(plan["sources"]["replica"])) == sorted([first["n2"], first["n3"]])
    after = status(env.cluster)
    assert after["peers"] == before["peers"]  # their peers still sit in other domains: nothing moves
    assert sorted(set(after["domains"])) == ["a", "c", "d"]

    before_edit = policies(env, job, ranks)
    # editing the configuration re-plans the running job: two peers per node from now on, and the
    # new backup policy reaches every replicator
    await env.cluster.patch(
        "/apis/tierckpt.io/v1alpha1/checkpointconfigurations/default",
        {
            "spec": {
                "replication": {"factor": 2},
                "gcs": {"bucket": "ckpt-bucket", "prefix": "edited/prefix"},
                "backup": {
                    "intervalSteps": 0,
                    "intervalMinutes": 5,
                    "retention": {"keepLast": 4, "keepEvery": 1000},
                },
                "deleteBackupsOnJobSetDeletion": True,
            }
        },
    )
    wider = await eventually(
        lambda: (s := status(env.cluster)) and all(len(p) == 2 for p in s["peers"]) and s,
        20,
        "two peers per node",
    )
    assert wider["peerGeneration"] > after["peerGeneration"]
    for r, peers in enumerate(wider["peers"]):
        assert before["peers"][r][0] in peers  # the old peer is kept, one is added
        domains = {wider["domains"][p] for p in peers}
        assert len(domains) == 2 and wider["domains"][r] not in domains
    n0 = env.replicators.nodes["n0"]
    await eventually(
        lambda: len(read_control(n0.root, job, PeerAssignment.FILE, PeerAssignment).peers["n0"]) == 2,
        20,
        "replicators got the new peers",
    )
    assert env.cluster.events("Replanning")
    spec = env.cluster.obj("tierckpt.io/v1alpha1/checkpointconfigurations", None, "default")["spec"]
    assert spec["gcs"]["prefix"] == "edited/prefix" and spec["replication"]["factor"] == 2
    after_edit = await eventually(
        lambda: policies_as_configured(env, job, ranks), 20, "every replicator stored the edited policy"
    )
    for name, policy in after_edit.items():
        assert policy.generation > before_edit[name].generation
