"""DCP loads that fetch other ranks' steps through the node's real replicator, end to end: three nodes
(network namespaces, a tmpfs each, real replicators in a ring with K=1: node-i runs rank i and sends it
to node-(i+1)), the ranks real processes (``dcp_dist``) reading and writing the nodes' ramdisks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.dcp import dcp_nodes as dn
from tests.dcp.dcp_dist import run_ranks
from tests.fixtures.cluster import cluster3, committed, new_job, replica_path, wait
from tierckpt.protocol.format import dcp_save_id, discard_step, rank_dir, read_manifest, step_dir
from tierckpt_demo.cluster import LocalCluster

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

__all__ = ["cluster3"]  # the module-scoped fixture, re-exported for pytest

WORLD, STEP = 3, 30


def _saved_twice(cluster: LocalCluster, tmp_path: Path, job: str) -> tuple[Path, str]:
    """Step 30 saved by the run the job left (under ``tmp_path``, off the nodes), then by the job on the
    nodes (rank r on node-r): the earlier save's root, and the full state the nodes' save holds."""
    cluster.assign(job)
    left = tmp_path / "the-run-the-job-left"
    left_roots = [str(left / f"node-{r}") for r in range(WORLD)]
    run_ranks(WORLD, dn.save_sharded_on, left_roots, job, STEP, str(tmp_path / "left.pt"), 7)
    ref = str(tmp_path / "ref.pt")
    run_ranks(WORLD, dn.save_sharded_on, [str(n.root) for n in cluster.nodes], job, STEP, ref, 0)
    return left, ref


def _save_of(path: Path) -> str:
    return dcp_save_id(read_manifest(path)) if committed(path) else ""


def test_a_node_holding_only_another_save_of_a_ranks_step_fetches_the_checkpoints(
    cluster3: LocalCluster, tmp_path: Path
) -> None:
    """Issue 20: node-0 holds rank 1's step 30 only as a replica of another save of that step number (the
    run the job left saved it; the checkpoint's own save of rank 1 is on node-1, and its replica on
    node-2). A load on node-0 at world size 1 took that copy for rank 1's step, never asked for the
    save's, and failed on it ("rewritten since?"); the replicator, asked, answered "already here". The
    load now asks for the save's copy, naming the save, and the replicator replaces the stale one."""
    job = new_job("dcpsave")
    left, ref = _saved_twice(cluster3, tmp_path, job)
    node0, node1 = cluster3.nodes[0], cluster3.nodes[1]
    stale = replica_path(node0, job, 1, STEP)
    stale.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(step_dir(rank_dir(left / "node-1", job, 1), STEP), stale)
    save = _save_of(step_dir(rank_dir(node1.root, job, 1), STEP))
    assert save and _save_of(stale) not in ("", save)

    run_ranks(1, dn.load_sharded_fetching, str(node0.root), job, STEP, ref)  # asserts every tensor equal
    assert _save_of(stale) == save


def test_a_peers_copy_of_another_save_is_passed_over_for_the_next_holder(
    cluster3: LocalCluster, tmp_path: Path
) -> None:
    """The first holder a fetch asks (node-1, rank 1's primary) holds another save of the step (the run
    the job left saved it there); node-2 holds a replica of the checkpoint's. The worker refuses the
    first copy on its manifest, before a byte of it is received, and fetches node-2's."""
    job = new_job("dcppeer")
    left, ref = _saved_twice(cluster3, tmp_path, job)
    node0, node1, node2 = cluster3.nodes
    primary = step_dir(rank_dir(node1.root, job, 1), STEP)
    save = _save_of(primary)
    wait(cluster3, lambda: _save_of(replica_path(node2, job, 1, STEP)) == save, 30, "rank 1 replicated")
    discard_step(primary)
    shutil.copytree(step_dir(rank_dir(left / "node-1", job, 1), STEP), primary)
    assert _save_of(primary) not in ("", save)

    run_ranks(1, dn.load_sharded_fetching, str(node0.root), job, STEP, ref)  # asserts every tensor equal
    assert _save_of(replica_path(node0, job, 1, STEP)) == save
    assert _save_of(replica_path(node2, job, 1, STEP)) == save, "node-2 kept the checkpoint's save"
