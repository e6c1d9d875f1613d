"""DCP checkpoints of ranks spread over several nodes (directories of one machine, see ``dcp_nodes``).

Every node holds what its own ranks need to load again under the same sharding (the metadata and a copy
of every replicated item), ranks agree on one step from what the nodes hold (or the operator's plan),
and a step that some node never committed is not restorable.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.dcp import dcp_nodes as dn
from tests.dcp.dcp_dist import run_ranks
from tierckpt.dcp.agree import node_holdings
from tierckpt.dcp.metadata import DcpMetadata
from tierckpt.planning.restore_plan import choose_restore
from tierckpt.protocol.control import (
    NodeInventory,
    RestoreState,
    RestoreStatus,
    write_restore_status,
)
from tierckpt.protocol.format import (
    COMMIT_NAME,
    DCP_METADATA_NAME,
    committed_steps,
    job_dir,
    rank_dir,
    read_manifest,
    replica_rank_dir,
    step_dir,
)

pytestmark = pytest.mark.e2e

NODES, PER_NODE = 3, 2
WORLD = NODES * PER_NODE


def _node(base: Path, n: int) -> Path:
    return base / f"node-{n}"


def _inventory(base: Path, job: str, n: int) -> NodeInventory:
    held, world = node_holdings(_node(base, n), job)
    return NodeInventory(
        job=job, node=f"node-{n}", endpoint="", updated_at=0.0, ranks=held, world_sizes=world
    )


def _agreed(base: Path, job: str, tmp: Path, world: int = WORLD) -> list[int | None]:
    out = tmp / f"agree-{time.monotonic_ns()}"
    out.mkdir()
    run_ranks(world, dn.agree, str(base), PER_NODE, job, str(out))
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def test_every_node_holds_what_its_ranks_load_under_the_same_sharding(tmp_path: Path, job: str) -> None:
    base, ref = tmp_path / "nodes", str(tmp_path / "ref.pt")
    run_ranks(WORLD, dn.save_sharded, str(base), PER_NODE, job, 4, ref)
    for rank in range(WORLD):
        path = step_dir(rank_dir(_node(base, rank // PER_NODE), job, rank), 4)
        manifest = read_manifest(path)
        assert (manifest.extra["dcp"].get("metadata") is not None) == (rank % PER_NODE == 0), rank
        assert (path / DCP_METADATA_NAME).exists() == (rank % PER_NODE == 0), rank
    record = DcpMetadata.from_bytes(
        (step_dir(rank_dir(_node(base, 1), job, 2), 4) / DCP_METADATA_NAME).read_bytes()
    )
    replicated = [e for e in record.entries if e.items.copies]
    assert replicated, "the optimizer's step counters, param_groups and 'extra' are replicated"
    for e in replicated:
        for i, copies in e.items.copies.items():
            holders = (e.items.ranks[i], *copies)
            assert sorted(r // PER_NODE for r in holders) == list(range(NODES)), (e.fqn, holders)
    # each node alone (no replicator, no other node's files) loads its ranks, bit-exact
    run_ranks(WORLD, dn.load_sharded, str(base), PER_NODE, job, 4, ref)


def test_a_reshard_needs_the_other_nodes_ranks_and_says_which(tmp_path: Path, job: str) -> None:
    """Without a replicator to fetch them, a load at another sharding names the ranks it lacks."""
    base, ref, out = tmp_path / "nodes", str(tmp_path / "ref.pt"), tmp_path / "out"
    out.mkdir()
    run_ranks(WORLD, dn.save_sharded, str(base), PER_NODE, job, 4, ref)
    shutil.rmtree(_node(base, 2))  # node 2 lost; the job comes back on 2 nodes x 2 ranks
    run_ranks(4, dn.load_expecting_failure, str(base), PER_NODE, job, 4, ref, str(out))
    failures = [m for r in range(4) for m in json.loads((out / f"rank-{r}.json").read_text()).values()]
    assert failures and all("MissingCheckpointError" in m for m in failures), failures
    assert any("rank 4's step 4 is not on this node" in m for m in failures), failures


def test_ranks_agree_on_the_newest_step_every_rank_can_load(tmp_path: Path, job: str) -> None:
    base, ref = tmp_path / "nodes", str(tmp_path / "ref.pt")
    run_ranks(WORLD, dn.save_sharded, str(base), PER_NODE, job, 1, ref)
    run_ranks(WORLD, dn.save_sharded, str(base), PER_NODE, job, 2, str(tmp_path / "ref2.pt"))
    assert _agreed(base, job, tmp_path) == [2] * WORLD
    # node 2 loses step 2 (its ranks' copies of it): nodes now hold different steps, all agree on 1
    lost = {r: step_dir(rank_dir(_node(base, 2), job, r), 2) for r in (4, 5)}
    kept = tmp_path / "kept"
    for r, path in lost.items():
        shutil.move(path, kept / f"rank-{r}")
    assert _agreed(base, job, tmp_path) == [1] * WORLD
    # a replica of ranks 4 and 5 on node 0 makes step 2 loadable again (a load fetches it from there)
    for r in lost:
        dest = step_dir(replica_rank_dir(_node(base, 0), job, r), 2)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(kept / f"rank-{r}", dest)
    assert _agreed(base, job, tmp_path) == [2] * WORLD
    # the operator's plan wins: every node's replicator staged step 1
    for r in range(WORLD):
        status = RestoreStatus(job, r, RestoreState.READY, 1, None, 0, 0, time.time())
        write_restore_status(job_dir(_node(base, r // PER_NODE), job), status)
    assert _agreed(base, job, tmp_path) == [1] * WORLD
    run_ranks(WORLD, dn.load_sharded, str(base), PER_NODE, job, 1, ref)


def test_a_step_some_nodes_never_committed_is_not_restorable(tmp_path: Path, job: str) -> None:
    """Node 2 crashed while saving step 2: its ranks never committed, so the coordinator never did.
    The ranks of nodes 0 and 1 that committed step 2 do not make it restorable."""
    base, ref = tmp_path / "nodes", str(tmp_path / "ref.pt")
    run_ranks(WORLD, dn.save_sharded, str(base), PER_NODE, job, 1, ref)
    run_ranks(WORLD, dn.save_sharded, str(base), PER_NODE, job, 2, str(tmp_path / "ref2.pt"))
    for r in (0, 4, 5):  # what the crash leaves: no COMMIT on node 2's ranks, none on the coordinator
        (step_dir(rank_dir(_node(base, r // PER_NODE), job, r), 2) / COMMIT_NAME).unlink()
    assert [committed_steps(rank_dir(_node(base, r // PER_NODE), job, r)) for r in range(WORLD)] == [
        [1],
        [1, 2],
        [1, 2],
        [1, 2],
        [1],
        [1],
    ]
    plan = choose_restore([_inventory(base, job, n) for n in range(NODES)])
    assert plan.step == 1 and plan.world_size == WORLD
    assert _agreed(base, job, tmp_path) == [1] * WORLD
    run_ranks(WORLD, dn.load_sharded, str(base), PER_NODE, job, 1, ref)


def test_a_replicated_key_that_differs_between_nodes_fails_the_save(tmp_path: Path, job: str) -> None:
    """DCP keeps one rank's value of a key several ranks hold; a node copy holding another value would
    make nodes load different states. The coordinator finds it and the checkpoint never completes."""
    base, out = tmp_path / "nodes", tmp_path / "out"
    out.mkdir()
    run_ranks(2, dn.save_divergent, str(base), 1, job, str(out))
    messages = json.loads((out / "rank-1.json").read_text())
    assert any("'note.rank' is held by ranks [0, 1] with different bytes" in m for m in messages), messages
    assert committed_steps(rank_dir(_node(base, 0), job, 0)) == [], "the coordinator never committed"
