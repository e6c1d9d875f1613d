"""A framework job on the multi-node rig (``tierckpt_demo.cluster``: network namespaces, a tmpfs and a
real replicator per node): Lightning DDP with one rank per node under torchrun, a node lost (its
ramdisk wiped, its replicator replaced), the ranks reassigned to other nodes (as the operator does for a
replacement), each node's replicator staging its new rank (one from a peer, one from its own replica),
and the job resuming bit-exact, rank 0 saying where each rank's step came from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.cluster import TEST_REPLICATOR_ARGS, committed, new_job, replica_path, wait_restored
from tests.integrations.harness import Run, free_port, same_tensors
from tierckpt.protocol.control import RestoreState, Tier
from tierckpt_demo.cluster import LocalCluster, Node

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

pytest.importorskip("lightning")


@pytest.fixture
def cluster2() -> Iterator[LocalCluster]:
    with LocalCluster(
        nodes=2, job=new_job("fw"), k=1, ramdisk_size="64m", replicator_args=TEST_REPLICATOR_ARGS
    ) as cluster:
        yield cluster


def launch(cluster: LocalCluster, job: str, workdir: Path, name: str, ranks: dict[Node, int], **kw) -> dict:
    """torchrun on every node (one process each), node ranks as given; the runs by node rank."""
    master = next(node for node, rank in ranks.items() if rank == 0)
    port = free_port()
    runs = {}
    for node, rank in ranks.items():
        env = {"TIERCKPT_ROOT": str(node.root), "TIERCKPT_JOB": job, "TIERCKPT_REPLICATOR_URL": node.endpoint}
        args = (
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--master-addr",
            master.ip,
            "--master-port",
            str(port),
        )
        launcher: tuple[str, ...] = ()
        if node.netns:
            launcher = ("ip", "netns", "exec", node.netns)
            env["GLOO_SOCKET_IFNAME"] = (
                "eth0"  # the node's link to the bridge (its hostname is not resolvable)
            )
        runs[rank] = Run(
            "lightning_ddp.py",
            workdir,
            f"{name}-{rank}",
            env=env,
            nproc=1,
            torchrun_args=args,
            launcher=launcher,
            **kw,
        )
    return runs


def test_lost_node_and_moved_ranks_resume_bit_exact(
    cluster2: LocalCluster, tmp_path: Path, lightning_reference
):
    a, b = cluster2.nodes
    job = new_job("lightning")
    cluster2.assign(job)  # node-0 runs rank 0, node-1 rank 1; each replicates to the other

    first = launch(cluster2, job, tmp_path, "first", {a: 0, b: 1}, pause_at=6)
    for rank, run in first.items():
        run.wait_paused(ranks=[rank])
    for rank, holder in ((0, b), (1, a)):  # step 4 of each rank reached its peer
        cluster2.wait_for(lambda r=rank, h=holder: committed(replica_path(h, job, r, 4)), what="replication")
    for run in first.values():
        run.kill()

    a.kill_replicator()  # node-0 is lost: a replacement comes up with an empty ramdisk
    a.wipe_ramdisk()
    a.start_replicator()
    cluster2.assign(job, generation=2, node_ranks={a.name: 1, b.name: 0})  # the ranks move
    moved = wait_restored(a, job, 1)  # the replacement fetches rank 1 from node-1
    assert (moved.state, moved.step, moved.source) == (RestoreState.READY, 4, Tier.PEER), a.log_text()[-3000:]
    kept = wait_restored(b, job, 0)  # node-1 promotes its replica of rank 0
    assert (kept.state, kept.step) == (RestoreState.READY, 4), b.log_text()[-3000:]

    second = launch(cluster2, job, tmp_path, "second", {b: 0, a: 1})
    assert second[1].wait() == 0, second[1].log_text()
    finished = second[0].finish()
    assert finished["restored_step"] == 4
    assert same_tensors(finished["weights"], lightning_reference["weights"])
    announced = [line for line in second[0].log_text().splitlines() if "tierckpt: resumed job" in line]
    assert len(announced) == 1 and " from step 4 " in announced[0], announced  # by rank 0, for both ranks
    assert "rank 0 from a replica this node held" in announced[0], announced
    assert "rank 1 from a peer node (fetched by the replicator)" in announced[0], announced
