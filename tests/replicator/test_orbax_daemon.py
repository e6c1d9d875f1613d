"""Orbax mode in a real replicator process (issue 24): the operator's session through the control API,
a malformed ``replicator.yaml`` written by the pod answered with a clear error in ``replicator.errors``
while the daemon keeps running and serving the job, and a session for another node refused."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fixtures.cluster import TEST_REPLICATOR_ARGS, new_job, wait
from tierckpt.protocol.client import ReplicatorError
from tierckpt.protocol.format import state_dir
from tierckpt.protocol.orbax import ERRORS, FAILED, JAX_INIT_INFO, REPLICATOR_YAML, OrbaxSession
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.local_operator import LocalOperator

pytestmark = [pytest.mark.e2e]

YAML = (
    "job-name: run\nframework: orbax\nnode-rank: {rank}\nnodes: 2\npeer-ranks: []\nbackup-interval-steps: 3"
)


@pytest.fixture(scope="module")
def cluster2() -> Iterator[LocalCluster]:
    with LocalCluster(nodes=2, job=new_job("static"), k=1, replicator_args=TEST_REPLICATOR_ARGS) as cluster:
        yield cluster


def write_yaml(node: Node, job: str, text: str | bytes) -> None:
    """As Orbax writes it: a temporary file renamed into place."""
    d = node.root / job
    data = text.encode() if isinstance(text, str) else text
    (d / "replicator.yaml.tmp").write_bytes(data)
    os.replace(d / "replicator.yaml.tmp", d / REPLICATOR_YAML)


def test_a_malformed_yaml_gets_a_clear_error_and_the_daemon_keeps_running(cluster2: LocalCluster) -> None:
    a, b = cluster2.nodes
    job = new_job("orbax-yaml")
    op = LocalOperator(cluster2, job, wait=lambda p, what, interval: wait(cluster2, p, 30, what))
    op.assign_peers(k=1, generation=1)
    op.orbax_sessions()
    op.publish_plan(world_size=None)
    for rank, node in enumerate((a, b)):
        wait(
            cluster2,
            lambda n=node, r=rank: (
                (p := n.root / job / JAX_INIT_INFO).exists() and p.read_text().startswith(f"{r}\n")
            ),
            20,
            f"{node.name}'s jax-init-info.txt",
        )
    write_yaml(a, job, b"node-rank: 0\nnodes: 2\x00\nframework: [orbax")  # what a buggy or hostile pod writes
    write_yaml(b, job, YAML.format(rank=0))  # node b runs process 1: this is another process's yaml
    for node in (a, b):
        answered = f"{node.name} answered"
        wait(cluster2, lambda n=node: not (n.root / job / REPLICATOR_YAML).exists(), 20, answered)
    errors = (a.root / job / ERRORS).read_text()
    assert "on node-0: replicator.yaml is malformed: line 2: nodes must be an integer" in errors
    assert "the job's configured backup schedule applies" in errors
    failed = (b.root / job / FAILED).read_text()
    assert "says node-rank 0 of 2 nodes, but this node runs process 1 of 2 in restart attempt 1" in failed
    # node a's process goes on: nothing to restore, it starts fresh (a run name it could not read: tierckpt)
    wait(cluster2, lambda: (a.root / job / "tierckpt-s0-n0-w0.restore").is_file(), 20, "node-0's marker")
    assert not list((b.root / job).glob("*.restore")), "a failed run gets no marker"
    for node in (a, b):
        assert node.running and cluster2.api.ready(node.endpoint, node=node.name)
        assert cluster2.api.status(node.endpoint, node=node.name).healthy
        assert "Traceback" not in node.log_text()


def test_a_session_for_another_node_is_refused_and_a_purge_removes_the_jobs_orbax_state(
    cluster2: LocalCluster,
) -> None:
    a, b = cluster2.nodes
    job = new_job("orbax-purge")
    for_b = OrbaxSession(job, b.name, 1, 1, 2, f"{a.ip}:8476")
    with pytest.raises(ReplicatorError) as refused:
        cluster2.api.put_orbax_session(a.endpoint, for_b, node=a.name)
    assert refused.value.status == 400 and not state_dir(a.root, job).exists()
    older = OrbaxSession(job, a.name, 1, 0, 2, f"{a.ip}:8476")
    assert cluster2.api.put_orbax_session(a.endpoint, older, node=a.name) == older
    newer = OrbaxSession(job, a.name, 2, 0, 2, f"{a.ip}:8476")
    assert cluster2.api.put_orbax_session(a.endpoint, newer, node=a.name) == newer
    with pytest.raises(ReplicatorError) as stale:
        cluster2.api.put_orbax_session(a.endpoint, older, node=a.name)
    assert stale.value.status == 409
    wait(cluster2, lambda: (a.root / job / JAX_INIT_INFO).exists(), 20, "jax-init-info.txt")
    assert cluster2.api.purge(a.endpoint, job, node=a.name).purged
    assert not (a.root / job).exists() and not state_dir(a.root, job).exists()
