"""What each rank does in the replica-group tests (run through ``tests.dcp.dcp_dist.run_ranks``, gloo).

Every function takes ``(rank, world_size, ...)`` and asserts its own outcome; the test then inspects
the ramdisks. Four ranks: a 2 x 2 ``("replicate", "shard")`` mesh holds a DTensor with placements
``(Replicate(), Shard(0))``, so ranks 0 and 2 hold shard 0 and ranks 1 and 3 shard 1 (replica groups
{0, 2} and {1, 3}); or one group of all four ranks (DDP).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tierckpt import Checkpointer, ReplicaDivergenceError, StateMismatchError, replica_group_from_mesh
from tierckpt.protocol.format import read_manifest, step_dir

JOB = "replica-test"
STEPS = (1, 2, 3, 4, 5)


def _shard_state(rank: int) -> tuple[dict[str, Any], Any]:
    """This rank's local shards of a model sharded over ``shard`` and replicated over ``replicate``."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(7)
    weight = distribute_tensor(torch.randn(256, 300, generator=g), mesh, [Replicate(), Shard(0)])
    bias = distribute_tensor(torch.randn(64, generator=g).to(torch.bfloat16), mesh, [Replicate(), Shard(0)])
    state = {
        "model": {"weight": weight.to_local(), "bias": bias.to_local()},
        "optim": {"step": torch.tensor(0, dtype=torch.int64), "exp_avg": torch.zeros(128, 300)},
        "step": 0,
        "rank_note": f"written by rank {rank}",  # per rank, not a tensor: may differ between members
    }
    return state, mesh


def _advance(state: dict[str, Any], step: int) -> None:
    """The same update on every member (as an all-reduced gradient step would be)."""
    state["model"]["weight"].add_(0.5)
    state["model"]["bias"].mul_(0.5)
    state["optim"]["step"].fill_(step)
    state["optim"]["exp_avg"].add_(state["model"]["weight"][:128] * 1e-3)
    state["step"] = step


def _snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        "weight": state["model"]["weight"].clone(),
        "bias": state["model"]["bias"].clone(),
        "exp_avg": state["optim"]["exp_avg"].clone(),
    }


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optim": {k: torch.zeros_like(v) for k, v in state["optim"].items()},
    }


def _assert_restored(dest: dict[str, Any], want: dict[str, torch.Tensor], rank: int, step: int) -> None:
    assert torch.equal(dest["model"]["weight"], want["weight"]), f"rank {rank}: weight differs"
    assert torch.equal(dest["model"]["bias"], want["bias"]), f"rank {rank}: bias differs"
    assert torch.equal(dest["optim"]["exp_avg"], want["exp_avg"]), f"rank {rank}: exp_avg differs"
    assert int(dest["optim"]["step"]) == step and dest["step"] == step
    assert dest["rank_note"] == f"written by rank {rank}"


def _report(out: Path, rank: int, data: dict[str, Any]) -> None:
    (out / f"rank-{rank}.json").write_text(json.dumps(data))


# ------------------------------------------------------------------------------ scenarios


def save_and_restore(rank: int, world_size: int, roots: list[str], layout: str, out: str) -> None:
    """Save five steps as replica groups, then restore from the ramdisk and by broadcast, bit-exact.

    ``roots[rank // (world_size // len(roots))]`` is this rank's ramdisk: one root is one node.
    ``layout``: ``hsdp`` (groups {0, 2} and {1, 3}: the mesh's ``replicate`` group), ``hsdp_dims`` (the
    same from mesh coordinates, with a process group created among the members) or ``ddp`` (one group of
    four).
    """
    root = roots[rank // (world_size // len(roots))]
    state, mesh = _shard_state(rank)
    if layout == "ddp":
        for t in (state["model"]["weight"], state["model"]["bias"]):
            t.copy_(torch.full_like(t, 3.0))  # every rank the same state (as under DDP)
        group: Any = list(range(world_size))
    elif layout == "hsdp_dims":  # by mesh coordinates, in a process group of its own
        group = replica_group_from_mesh(mesh, ("replicate",))
        assert group.members == (rank % 2, rank % 2 + 2) and group.process_group is None
    else:
        group = replica_group_from_mesh(mesh, "replicate")
    stats = []
    with Checkpointer(root=root, job=JOB, keep=2, replica_group=group) as ck:
        for step in STEPS:
            _advance(state, step)
            handle = ck.save(step, state)
            stats.append(ck.last_save)
            handle.wait()
        want = _snapshot(state)
        dist.barrier()
        dest = _empty_like(state)
        assert ck.load(dest) == STEPS[-1]
        _assert_restored(dest, want, rank, STEPS[-1])
        dest = _empty_like(state)
        assert ck.load(dest, broadcast=True) == STEPS[-1]
        _assert_restored(dest, want, rank, STEPS[-1])
        broadcast_timings = ck.last_load_timings
        dest = {}  # nothing to fill in place: broadcast creates every tensor
        assert ck.load(dest, broadcast=True) == STEPS[-1]
        _assert_restored(dest, want, rank, STEPS[-1])
        dest = _empty_like(state)
        if rank == world_size - 1:  # a receiver's destination does not fit: every rank raises, none hangs
            dest["model"]["weight"] = torch.zeros(3)
        try:
            ck.load(dest, broadcast=True)
            raise AssertionError("a strict load into a destination that does not fit succeeded")
        except StateMismatchError as exc:
            assert ("model/weight" in str(exc)) == (rank == world_size - 1), str(exc)
    _report(Path(out), rank, {"stats": stats, "broadcast": broadcast_timings})


def diverging_member(rank: int, world_size: int, root: str, out: str) -> None:
    """Rank 2 perturbs its replicated weight at step 2: reported, both copies kept, each restores its own."""
    state, mesh = _shard_state(rank)
    group = replica_group_from_mesh(mesh, "replicate")
    raised: dict[int, str] = {}
    wants = {}
    with Checkpointer(root=root, job=JOB, keep=3, replica_group=group, on_divergence="raise") as ck:
        for step in (1, 2, 3):
            _advance(state, step)
            weight = state["model"]["weight"]
            kept = weight[5, 7].clone()
            if step == 2 and rank == 2:
                weight[5, 7] += 1.0  # one element drifted: a missed all-reduce, say
            try:
                ck.save(step, state, blocking=True)
            except ReplicaDivergenceError as exc:
                raised[step] = str(exc)
                ck.wait()  # the save itself went on, every member with its own copy
            wants[step] = _snapshot(state)
            weight[5, 7] = kept  # back in line: step 3 agrees again
        # Step 4: rank 3's save fails before the exchange (its state is not a dict): it raises, its
        # group skips the step instead of waiting for it, the other group saves.
        outcome = "committed"
        try:
            handle = ck.save(4, [state] if rank == 3 else state, blocking=True)  # type: ignore[arg-type]
            if handle.skipped:
                outcome = f"skipped: {handle.skip_reason}"
        except TypeError:
            outcome = "raised"
        manifest = read_manifest(step_dir(ck.rank_path, 2))
        dist.barrier()
        for broadcast in (False, True):
            dest = _empty_like(state)
            assert ck.load(dest, step=2, broadcast=broadcast) == 2
            _assert_restored(dest, wants[2], rank, 2)  # each rank its own bytes, rank 2's drifted ones
    record = manifest.replica
    assert record is not None
    _report(Path(out), rank, {"raised": raised, "record": dataclasses.asdict(record), "step4": outcome})
