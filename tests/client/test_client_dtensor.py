"""DTensor (FSDP2) state in the native ``Checkpointer``: each rank's local shards round-trip in place under
the same mesh; any other layout is a clear error that points to DCP, never a silent wrong restore.
Real processes (gloo on the CPU), through ``tests.dcp.dcp_dist``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.dcp.dcp_dist import run_ranks
from tierckpt import Checkpointer
from tierckpt.protocol.format import rank_dir, read_manifest, step_dir
from tierckpt.snapshot.dtensor import DTensorLayoutError

pytestmark = pytest.mark.e2e


def _train(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i in range(2):
        torch.manual_seed(100 + i)
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _locals(value: Any) -> Any:
    """Every tensor's local bytes (a DTensor's shard), cloned."""
    if isinstance(value, DTensor):
        return ("D", value._local_tensor.clone(), tuple(value.placements))
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _locals(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_locals(v) for v in value]
    return value


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, tuple) and want and want[0] == "D":
        return (
            isinstance(got, tuple)
            and got[2] == want[2]
            and torch.equal(got[1].view(-1).view(torch.uint8), want[1].view(-1).view(torch.uint8))
        )
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    return bool(got == want)


def round_trip(rank: int, world_size: int, root: str, job: str) -> None:
    model, opt = _train(seed=0)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}
    assert all(isinstance(v, DTensor) for v in state["model"].values())
    saved = _locals(state)
    with Checkpointer(root, job) as ck:
        ck.save(2, state, blocking=True)
    torch.manual_seed(7)  # training goes on: parameters and Adam's moments change
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
    assert not _same(_locals({"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}), saved)
    with Checkpointer(root, job) as ck:
        assert ck.load(state) == 2  # in place: the model's own parameters and the optimizer's state
    now = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}
    assert _same(_locals(now), saved), f"rank {rank}: the restored shards differ from the saved ones"


def other_layouts(rank: int, world_size: int, root: str, job: str, out: str) -> None:
    """Save DTensors sharded on a 1-d mesh, then try to load them into other layouts."""
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    with Checkpointer(root, job) as ck:
        ck.save(1, {"w": distribute_tensor(full, mesh, [Shard(0)])}, blocking=True)
    named = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))
    destinations = {
        "replicated": distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()]),
        "sharded on dim 1": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]),
        "another mesh": distribute_tensor(torch.zeros(6, 4), named, [Shard(0)]),
        "another global shape": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]),
        "a plain tensor": torch.zeros(3, 4),
    }
    errors = {}
    for name, dest in destinations.items():
        with Checkpointer(root, job) as ck:
            try:
                ck.load({"w": dest}, step=1)
            except DTensorLayoutError as exc:
                errors[name] = str(exc)
    same = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])}
    with Checkpointer(root, job) as ck:
        ck.load(same, step=1)
    assert torch.equal(same["w"].full_tensor(), full)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(errors))


def _dtensor_nodes(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node] if node.get("t") == "dtensor" else []
        return found + [n for v in node.values() for n in _dtensor_nodes(v)]
    if isinstance(node, list):
        return [n for v in node for n in _dtensor_nodes(v)]
    return []


def test_fsdp2_state_round_trips_in_place_under_the_same_mesh(root: Path) -> None:
    run_ranks(2, round_trip, str(root), "dtensor")
    manifest = read_manifest(step_dir(rank_dir(root, "dtensor", 1), 2))
    nodes = _dtensor_nodes(manifest.tree)
    assert len(nodes) == 4 * 3, "weights and biases of 2 layers, and Adam's two moments of each"
    assert all(n["placements"] == ["S(0)"] and n["mesh"]["ranks"] == [0, 1] for n in nodes)
    weight = next(n for n in nodes if n["key"] == "model/0.weight")
    assert weight["shape"] == [12, 8] and manifest.tensors[weight["i"]].shape == (6, 8)


def test_another_layout_is_a_clear_error_that_points_to_dcp(root: Path, tmp_path: Path) -> None:
    run_ranks(2, other_layouts, str(root), "dtensor", str(tmp_path))
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert set(errors) == {
            "replicated",
            "sharded on dim 1",
            "another mesh",
            "another global shape",
            "a plain tensor",
        }
        for message in errors.values():
            assert message.startswith("w: ") and "tierckpt.dcp" in message, message
        assert "placements" in errors["replicated"] and "device mesh" in errors["another mesh"]
        assert (
            "global shape" in errors["another global shape"] and "holds a Tensor" in errors["a plain tensor"]
        )
