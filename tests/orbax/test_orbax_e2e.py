"""Stock Orbax on tierckpt's replicators, end to end: no change to Orbax (issue 24).

Four nodes (network namespaces, a tmpfs each, real replicator processes, a fake GCS bucket) run one
unmodified Orbax process each (``trainer.py``: ``initialize_multi_tier_checkpointing`` and
``ReplicatorCheckpointManager``, on JAX's CPU backend), on a mesh of two slices (two data-parallel
copies). The operator's part is played by ``tierckpt_demo.local_operator.LocalOperator`` with the
operator's own planning code: peers across the two failure domains, each restart attempt's Orbax
sessions (process ids that stick to the nodes holding their data) and restore plan.

* a node is lost after a save: the restarted job restores, bit-exact, the lost node's process from its
  peer's replica;
* every ramdisk is wiped: the job restores from the bucket (the backup interval is the one Orbax put
  in its replicator.yaml);
* the pods land on other nodes: each process id follows the data of its node, restored in place.

Each run of four trainers takes 10-20 s on a 2-core machine (JAX's start-up, mostly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.cluster import TEST_REPLICATOR_ARGS, api_get, new_job, wait
from tests.replicator.test_cluster_e2e import bucket_complete, lose
from tierckpt.protocol.format import committed_steps, rank_dir
from tierckpt.protocol.orbax import JAX_INIT_INFO
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.local_operator import LocalOperator

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

TRAINER = Path(__file__).with_name("trainer.py")
SLICES = 2
RUN_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def cluster4() -> Iterator[LocalCluster]:
    with LocalCluster(
        nodes=4,
        job=new_job("static"),
        k=1,
        domains=SLICES,
        gcs=True,
        ramdisk_size="96m",
        replicator_args=TEST_REPLICATOR_ARGS,
    ) as cluster:
        yield cluster


def operator(cluster: LocalCluster, job: str) -> LocalOperator:
    return LocalOperator(cluster, job, wait=lambda p, what, interval: wait(cluster, p, 60, what))


def new_attempt(op: LocalOperator, generation: int) -> None:
    """A restart attempt, as the operator publishes it: peers, each node's Orbax session, the plan."""
    op.assign_peers(k=1, generation=generation)
    op.orbax_sessions()
    op.publish_plan(world_size=None)


def as_host(node: Node) -> list[str]:
    """A command prefix that runs the rest as a host of its own, as a pod is: its own host name, which
    resolves to the node's address (JAX's CPU collectives, gloo, connect to the address of each
    process's host name; the machine's own name would be loopback in every namespace)."""
    hosts = node.dir / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{node.ip} {node.name}\n")
    script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--uts", "sh", "-c", script, "sh", str(hosts), node.name]


def train(cluster: LocalCluster, op: LocalOperator, job: str, *, save: str = "", tag: str) -> dict[str, Any]:
    """One unmodified Orbax process per node of the job, in the node's network namespace, on the job's
    directory (what the pod mounts); node name -> what the process saw (``trainer.py``'s JSON)."""
    n = len(op.nodes)
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
    for node in op.nodes:
        out = node.dir / f"trainer-{tag}.json"
        log = node.dir / f"trainer-{tag}.log"
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            # the process count, which JAX takes from a cluster environment (the id comes from
            # jax-init-info.txt, whatever SLURM_PROCID says)
            "SLURM_JOB_ID": "1",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": str(n),
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
        }
        cmd = [*as_host(node), sys.executable, str(TRAINER), "--dir", str(node.root / job)]
        cmd += ["--slices", str(SLICES), "--save", save, "--backup-interval-steps", "1"]
        cmd += ["--run-name", "orbaxjob", "--out", str(out)]
        with open(log, "wb") as f:
            procs[node.name] = (
                node.popen_in_node(cmd, env=env, stdout=f, stderr=subprocess.STDOUT),
                out,
                log,
            )
    deadline = time.monotonic() + RUN_TIMEOUT
    failed = []
    for name, (proc, _, _) in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()  # JAX catches SIGTERM
            proc.wait()
        if proc.returncode != 0:
            failed.append(name)
    if failed:
        logs = "\n".join(f"--- {name}\n{_tail(log.read_text())}" for name, (_, _, log) in procs.items())
        nodes = "\n".join(f"--- {n.name}\n{n.log_text()[-3000:]}" for n in cluster.nodes)
        raise AssertionError(f"trainers on {failed} failed:\n{logs}\n{nodes}")
    return {name: json.loads(out.read_text()) for name, (_, out, _) in procs.items()}


def _tail(text: str) -> str:
    """A trainer's log without JAX's info lines, its end."""
    return "\n".join(line for line in text.splitlines() if not line.startswith(("I1", "W1")))[-4000:]


def adopted(node: Node, job: str, rank: int, step: int) -> bool:
    return step in committed_steps(rank_dir(node.root, job, rank))


def counters(cluster: LocalCluster, nodes: list[Node]) -> dict[tuple[str, str], float]:
    """(node, what) -> since its replicator started: ``served``, the steps it sent to a peer fetching
    them for a restore; ``gcs``, the bytes it downloaded from the bucket (from its metrics)."""
    out = {}
    for node in nodes:
        families = text_string_to_metric_families(api_get(cluster, node, "/v1/metrics").text)
        samples = [s for family in families for s in family.samples]
        out[node.name, "served"] = sum(
            s.value
            for s in samples
            if s.name == "tierckpt_replicator_transfers_total"
            and s.labels.get("direction") == "served"
            and s.labels.get("result") == "ok"
        )
        out[node.name, "gcs"] = sum(
            s.value for s in samples if s.name == "tierckpt_backup_downloaded_bytes_total"
        )
    return out


def save_two_steps(cluster: LocalCluster, op: LocalOperator, job: str) -> None:
    new_attempt(op, 1)
    seen = train(cluster, op, job, save="1,2", tag="save")
    assert sorted(s["process_index"] for s in seen.values()) == [0, 1, 2, 3]
    assert all(s["latest"] is None for s in seen.values()), "a fresh job restores nothing"
    for rank, node in enumerate(op.nodes):
        wait(cluster, lambda n=node, r=rank: adopted(n, job, r, 2), 30, f"{node.name} adopted step 2")
        assert not (node.root / job / "2").exists(), "the adopted step directory is Orbax's no more"
        assert not (node.root / job / JAX_INIT_INFO).exists(), "jax-init-info.txt was consumed"
    wait(cluster, lambda: op.replicated(2), 30, "step 2 replicated to every peer")


def test_a_lost_node_is_restored_from_its_peer_bit_exact(cluster4: LocalCluster) -> None:
    job = new_job("orbax-peer")
    op = operator(cluster4, job)
    save_two_steps(cluster4, op, job)
    lost = cluster4.nodes[1]
    survivors = [n for n in op.nodes if n is not lost]
    before = counters(cluster4, survivors)
    lose(lost)  # its replacement: same name, empty ramdisk
    lost.start_replicator()
    new_attempt(op, 2)
    seen = train(cluster4, op, job, tag="restore")
    for name, s in seen.items():
        assert (s["latest"], s["restored"], s["bit_exact"]) == (2, 2, True), (name, s)
    moved = {k: v - before.get(k, 0) for k, v in counters(cluster4, op.nodes).items()}
    assert not any(moved[n.name, "gcs"] for n in op.nodes), f"nothing came from the bucket: {moved}"
    assert sum(moved[n.name, "served"] for n in survivors) >= 1, f"a peer served the lost step: {moved}"


def test_every_ramdisk_wiped_restores_from_the_bucket(cluster4: LocalCluster) -> None:
    job = new_job("orbax-bucket")
    op = operator(cluster4, job)
    save_two_steps(cluster4, op, job)  # backup-interval-steps: 1 in replicator.yaml: every step goes up
    wait(cluster4, lambda: bucket_complete(cluster4, job, 2), 60, "step 2 complete in the bucket")
    for node in cluster4.nodes:
        lose(node)
    for node in cluster4.nodes:
        node.start_replicator()
    new_attempt(op, 2)
    seen = train(cluster4, op, job, tag="restore")
    for name, s in seen.items():
        assert (s["latest"], s["restored"], s["bit_exact"]) == (2, 2, True), (name, s)
    got = counters(cluster4, op.nodes)  # the replicators started empty
    assert all(got[n.name, "gcs"] > 0 for n in op.nodes), f"every process's step came from the bucket: {got}"


def test_process_ids_follow_their_data_when_pods_move(cluster4: LocalCluster) -> None:
    job = new_job("orbax-move")
    op = operator(cluster4, job)
    save_two_steps(cluster4, op, job)
    a, b, c, d = cluster4.nodes
    # the restarted pods land elsewhere: the pod of initial rank 0 on node c, that of 2 on node a, ...
    ranks = op.place({"w-0": (c, 0), "w-1": (b, 1), "w-2": (a, 2), "w-3": (d, 3)})
    assert ranks == {"w-0": 2, "w-1": 1, "w-2": 0, "w-3": 3}, "node ranks stay with the nodes"
    before = counters(cluster4, op.nodes)
    new_attempt(op, 2)
    seen = train(cluster4, op, job, tag="restore")
    assert {name: s["process_index"] for name, s in seen.items()} == {
        a.name: 0,
        b.name: 1,
        c.name: 2,
        d.name: 3,
    }
    for name, s in seen.items():
        assert (s["latest"], s["restored"], s["bit_exact"]) == (2, 2, True), (name, s)
    assert counters(cluster4, op.nodes) == before, "every process restored what its node held"
