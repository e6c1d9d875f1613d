"""Training ranks for the replica-group cluster tests (run through ``tests.dcp.dcp_dist.run_ranks``, gloo).

Four ranks, one per node: a 2 x 2 ``("replicate", "shard")`` mesh holds DTensors with placements
``(Replicate(), Shard(0))``, so ranks 0 and 2 hold shard 0 and ranks 1 and 3 shard 1 (replica groups
{0, 2} and {1, 3}). Every rank saves through the real ``Checkpointer(replica_group=...)`` into its
node's ramdisk (``roots[rank]``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tierckpt import Checkpointer, replica_group_from_mesh

ROWS, COLS = 1024, 512
"""The replicated-and-sharded weight: 2 MiB in all, 1 MiB per shard (float32)."""


def state_of(rank: int, step: int, drift: bool) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: its shard of the model, the same on every member of its
    group; with ``drift`` (rank 3 only) one element differs, as after a missed all-reduce."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(11)
    weight = distribute_tensor(torch.randn(ROWS, COLS, generator=g), mesh, [Replicate(), Shard(0)])
    local = weight.to_local().add_(float(step))
    if drift and rank == 3:
        local[3, 5] += 1.0
    return {"model": {"weight": local}, "step": step, "note": f"rank {rank}"}


def save_steps(rank: int, world_size: int, roots: list[str], job: str, steps: list[int], drift: bool) -> None:
    """Save ``steps`` as replica groups of the mesh's ``replicate`` dimension."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    group = replica_group_from_mesh(mesh, "replicate")
    with Checkpointer(root=roots[rank], job=job, keep=2, replica_group=group) as ck:
        for step in steps:
            ck.save(step, state_of(rank, step, drift), blocking=True)
