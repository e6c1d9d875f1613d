"""Orbax mode end to end on the operator's side (issue 24): the real operator (kopf, webhooks over
HTTPS) against the API emulator and real replicator processes, for a JobSet annotated
``tierckpt.io/mode: orbax``.

The operator does what GKE's controller does for stock Orbax: each pod mounts the job directory at the
configuration's ``ramdisk.mountRoot`` (Orbax's local checkpoint directory), and once the attempt's pods
are scheduled every node's replicator gets its session, which it writes as ``jax-init-info.txt``: the
node's rank as its process id, the pod of rank 0 as the JAX coordinator. After a restart whose pods land
on other nodes, each process id is the one of the data its node holds. (Stock Orbax itself runs on
tierckpt's replicators in ``tests/orbax``.)
"""

from __future__ import annotations

import pytest

from tests.operator.operator_harness import eventually, jobset_body
from tests.operator.test_operator_e2e import NAME, NS, place, status
from tierckpt.protocol.contract import Annotations
from tierckpt.protocol.control import read_control
from tierckpt.protocol.format import job_dir
from tierckpt.protocol.orbax import JAX_INIT_INFO, OrbaxSession

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MOUNT = "/local"
PORT = 8476


def orbax_jobset():
    body = jobset_body(NAME, [("slice", 2, 2)])  # two slices of two hosts
    body["metadata"]["annotations"][Annotations.MODE] = "orbax"
    return body


def init_info(node, job):
    try:
        return (job_dir(node.root, job) / JAX_INIT_INFO).read_text()
    except FileNotFoundError:
        return None


def where_pods_ran(env, attempt):
    """(job index, completion index) -> node of each pod of ``attempt``."""
    labels = "jobset.sigs.k8s.io/job-index", "batch.kubernetes.io/job-completion-index"
    return {
        tuple(p["metadata"]["labels"][k] for k in labels): p["spec"]["nodeName"]
        for p in env.cluster.pods(NS, NAME, attempt)
    }


def rank0_address(env, attempt, ranks):
    """The IP of the pod of node rank 0 in ``attempt`` (as on GKE; every pod is 127.0.0.1 here)."""
    rank0 = next(node for node, rank in ranks.items() if rank == 0)
    pod = next(p for p in env.cluster.pods(NS, NAME, attempt) if p["spec"]["nodeName"] == rank0)
    return pod["status"]["podIP"]


async def every_node_says(env, job, ranks, attempt):
    """Each node holds the session of ``attempt`` and its jax-init-info.txt names its node's rank and the
    rank 0 pod of ``attempt``."""
    coordinator = f"{rank0_address(env, attempt, ranks)}:{PORT}"
    want = {node: f"{rank}\n{coordinator}\n" for node, rank in ranks.items()}

    def sessions():
        return {
            n: read_control(env.replicators.nodes[n].root, job, OrbaxSession.FILE, OrbaxSession) for n in want
        }

    return await eventually(
        lambda: (
            all(s is not None and s.generation == attempt for s in sessions().values())
            and {n: init_info(env.replicators.nodes[n], job) for n in want} == want
            and sessions()
        ),
        30,
        f"the sessions and jax-init-info.txt of attempt {attempt} on every node",
    )


async def test_orbax_mode_process_ids_follow_their_data(env):
    nodes = await env.add_nodes(("n0", "a"), ("n1", "a"), ("n2", "b"), ("n3", "b"))
    await env.cluster.config(ramdisk={"mountRoot": MOUNT})
    await env.start_operator()
    js = await env.cluster.create_jobset(NS, orbax_jobset())
    job = f"{NS}_{NAME}_{js['metadata']['uid'].replace('-', '')[:8]}"
    await eventually(lambda: env.cluster.checkpoint_job(NS, NAME), what="CheckpointJob")

    first = await place(env, [n.name for n in nodes], 0, seed=5)
    # the webhook: Orbax's directory is the job's ramdisk, its run name the JobSet's
    for pod in env.cluster.pods(NS, NAME, 0):
        (container,) = pod["spec"]["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["tierckpt-ramdisk"] == MOUNT
        assert {"name": "JOBSET_NAME", "value": NAME} in container["env"]
    sessions = await every_node_says(env, job, first, 0)
    for node in nodes:
        session = sessions[node.name]
        assert (session.node, session.process_id, session.num_processes) == (node.name, first[node.name], 4)
    await eventually(
        lambda: any(
            c["type"] == "SessionsPublished" and c["status"] == "True"
            for c in status(env.cluster)["conditions"]
        ),
        20,
        "SessionsPublished",
    )

    # the job restarts and its pods land on other nodes: every process id stays with its node's data
    attempt = await env.cluster.restart(NS, NAME)
    again = await place(env, [n.name for n in reversed(nodes)], attempt, seed=6)
    assert again == first
    assert where_pods_ran(env, 0) != where_pods_ran(env, attempt), "some pod runs on another node now"
    sessions = await every_node_says(env, job, first, attempt)
    assert {n: s.process_id for n, s in sessions.items()} == first
