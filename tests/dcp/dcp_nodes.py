"""What each rank does in the DCP tests that spread ranks over several "nodes" on one machine.

Node ``n`` is the directory ``<base>/node-n`` (its ramdisk root) and ``$TIERCKPT_NODE_NAME=node-n``; rank
``r`` runs on node ``r // per_node``. No replicator runs: a load reads only its own node's directory, so a
load that needs another node's data fails (``MissingCheckpointError``) instead of reading it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.dcp import dcp_scenarios as sc
from tierckpt.dcp import RamdiskWriter, agreed_step


def node_root(base: str, rank: int, per_node: int) -> str:
    """This rank's node directory (created), with the node's name in the environment."""
    node = rank // per_node
    os.environ["TIERCKPT_NODE_NAME"] = f"node-{node}"
    root = Path(base, f"node-{node}")
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


def save_sharded(
    rank: int, world_size: int, base: str, per_node: int, job: str, step: int, ref: str, mode: str = "sync"
) -> None:
    sc.save_sharded(rank, world_size, node_root(base, rank, per_node), job, step, ref, mode)


def load_sharded(rank: int, world_size: int, base: str, per_node: int, job: str, step: int, ref: str) -> None:
    sc.load_sharded(rank, world_size, node_root(base, rank, per_node), job, step, ref)


def save_plain(rank: int, world_size: int, base: str, per_node: int, job: str, step: int, seed: int) -> None:
    sc.save_plain(rank, world_size, node_root(base, rank, per_node), job, step, seed)


def load_newest(rank: int, world_size: int, base: str, per_node: int, job: str, seed: int, out: str) -> None:
    sc.load_newest(rank, world_size, node_root(base, rank, per_node), job, seed, out)


def load_expecting_failure(
    rank: int, world_size: int, base: str, per_node: int, job: str, step: int, ref: str, out: str
) -> None:
    try:
        sc.load_sharded(rank, world_size, node_root(base, rank, per_node), job, step, ref)
    except CheckpointException as exc:
        failures = {str(r): f"{type(e).__name__}: {e}" for r, (e, _tb) in exc.failures.items()}
        Path(out, f"rank-{rank}.json").write_text(json.dumps(failures))
        return
    raise AssertionError(f"rank {rank}: a load that needs another node's data succeeded")


def agree(rank: int, world_size: int, base: str, per_node: int, job: str, out: str) -> None:
    step = agreed_step(node_root(base, rank, per_node), job)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(step))


def save_divergent(rank: int, world_size: int, base: str, per_node: int, job: str, out: str) -> None:
    """Every rank saves one key with its own value: DCP keeps one rank's, a node copy holds another's."""
    root = node_root(base, rank, per_node)
    state = {"w": torch.ones(4), "note": {"rank": rank}}
    try:
        dcp.save(state, checkpoint_id=3, storage_writer=RamdiskWriter(root, job))
    except CheckpointException as exc:
        Path(out, f"rank-{rank}.json").write_text(json.dumps([str(e) for e, _tb in exc.failures.values()]))
        return
    raise AssertionError("a save whose replicated key differs between nodes succeeded")


def save_sharded_on(
    rank: int, world_size: int, roots: list[str], job: str, step: int, ref: str, seed: int
) -> None:
    """``save_sharded`` with rank ``r`` on the node whose ramdisk root is ``roots[r]``."""
    os.environ["TIERCKPT_NODE_NAME"] = f"node-{rank}"
    sc.save_sharded(rank, world_size, roots[rank], job, step, ref, seed=seed)


def load_sharded_fetching(rank: int, world_size: int, root: str, job: str, step: int, ref: str) -> None:
    """``load_sharded`` on the node whose ramdisk root is ``root``, which a replicator serves: the ranks'
    steps it lacks are fetched (``RamdiskReader(fetch=True)``), waiting at most 60 s without progress."""
    os.environ["TIERCKPT_REPLICATOR_URL"] = "http://replicator.invalid"  # only says that one serves the node
    os.environ["TIERCKPT_RESTORE_WAIT"] = "60"
    sc.load_sharded(rank, world_size, root, job, step, ref)
