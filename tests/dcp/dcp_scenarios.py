"""What each rank does in the multi-process DCP tests (run through ``dcp_dist.run_ranks``).

Every function takes ``(rank, world_size, ...)`` and asserts its outcome itself; a failing assertion
in any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tierckpt.dcp import RamdiskReader, RamdiskWriter

# ------------------------------------------------------------------------------ plain state


def plain_state(seed: int) -> dict[str, Any]:
    """The same nested state on every rank: many dtypes and shapes, views, and non-tensor objects."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(8, 6, generator=g)
    return {
        "w": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "ids": torch.arange(100, dtype=torch.int64) * seed,
        "mask": torch.rand(50, generator=g) > 0.5,
        "scalar": torch.tensor(2.5 * seed, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "transposed": base.t(),
        "slice": base[2:5, 1:],
        "nested": {"a": {"b": torch.randn(5, generator=g)}, "list": [torch.randn(3, generator=g), 7, "x"]},
        "meta": {"epoch": seed, "name": f"run-{seed}", "cfg": {"lr": 0.1, "betas": (0.9, 0.95)}},
    }


def blank_like(value: Any) -> Any:
    """The destination for a load: same structure, tensors zeroed (same dtype/shape), objects None."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: blank_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank_like(v) for v in value]
    return None


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Bit-exact equality of nested state (dtype, shape and every byte of every tensor)."""
    if isinstance(want, DTensor):
        want = want.full_tensor()
    if isinstance(got, DTensor):
        got = got.full_tensor()
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{got.shape}"
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (
            f"{where}: keys {sorted(got)} != {sorted(want)}"
        )
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def mutate(state: dict[str, Any]) -> None:
    """What training does to the live state after a save was staged."""
    state["w"].add_(1)
    state["ids"].add_(1)
    state["meta"]["epoch"] = 99


def save_plain(rank: int, world_size: int, root: str, job: str, step: int, seed: int, keep: int = 2) -> None:
    dcp.save(plain_state(seed), checkpoint_id=step, storage_writer=RamdiskWriter(root, job, keep=keep))


def async_save_twice(rank: int, world_size: int, root: str, job: str, seed: int) -> None:
    """Two async saves through one writer (staging buffers reused); training mutates state in between."""
    state = plain_state(seed)
    with RamdiskWriter(root, job) as writer:
        for step in (7, 8):
            response = dcp.async_save(state, checkpoint_id=step, storage_writer=writer)
            if step == 7:
                mutate(state)  # staging is done when async_save returns: this must not reach step 7
            getattr(response, "upload_completion", response).result()


def load_plain(
    rank: int, world_size: int, root: str, job: str, step: int | None, seed: int, mutated: bool = False
) -> None:
    want = plain_state(seed)
    if mutated:
        mutate(want)
    got = blank_like(want)
    dcp.load(got, checkpoint_id=step, storage_reader=RamdiskReader(root, job))
    assert_same(got, want)


# ------------------------------------------------------------------------------ FSDP2 / DTensor


def _model(world_size: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # reuse the default group: no new rendezvous
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def save_sharded(
    rank: int, world_size: int, root: str, job: str, step: int, ref: str, mode: str = "sync", seed: int = 0
) -> None:
    """Train an FSDP2 model (initialized from ``seed``) two steps, save model + optimizer state; rank 0
    keeps the full values."""
    model, opt = _model(world_size, seed=seed)
    for i in range(2):
        torch.manual_seed(100 + i)
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    shards = {k: tuple(v.to_local().shape) for k, v in msd.items()}
    assert any(isinstance(v, DTensor) for v in msd.values()), shards
    state = {"model": msd, "optim": osd, "extra": {"step": step}}
    full = _full(state)
    if mode == "async":
        with RamdiskWriter(root, job) as writer:
            response = dcp.async_save(state, checkpoint_id=step, storage_writer=writer)
            opt.step()  # training goes on while the checkpoint is written
            getattr(response, "upload_completion", response).result()
    else:
        dcp.save(state, checkpoint_id=step, storage_writer=RamdiskWriter(root, job))
    if rank == 0:
        torch.save(full, ref)


def async_save_sharded_thrice(rank: int, world_size: int, root: str, job: str, refs: str) -> None:
    """Three async saves of a training FSDP2 model through one writer, on a process group of their own;
    training goes on while each is written. From the second on, staging goes straight into the slot the
    save commits (the state is laid out as before). Rank 0 keeps the full state of each step."""
    model, opt = _model(world_size, seed=0)
    saves = dist.new_group(backend="gloo")
    in_place = []
    with RamdiskWriter(root, job, keep=3) as writer:
        for step in (1, 2, 3):
            torch.manual_seed(100 + step)
            model(torch.randn(4, 8)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "extra": {"step": step}}
            full = _full(state)
            response = dcp.async_save(state, checkpoint_id=step, storage_writer=writer, process_group=saves)
            torch.manual_seed(7)  # training goes on while the step is written
            model(torch.randn(4, 8)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            getattr(response, "upload_completion", response).result()
            in_place.append(writer.staged_in_place)
            if rank == 0:
                torch.save(full, os.path.join(refs, f"step-{step}.pt"))
    assert in_place == [False, True, True], in_place


def load_sharded(rank: int, world_size: int, root: str, job: str, step: int, ref: str) -> None:
    """A fresh FSDP2 model at another world size loads the checkpoint; values equal the saved ones."""
    model, opt = _model(world_size, seed=1234)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": -1}}
    dcp.load(state, checkpoint_id=step, storage_reader=RamdiskReader(root, job))
    want = torch.load(ref, weights_only=False)
    assert_same(_full(state), want)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_same(_full(dict(model.state_dict())), want["model"])


# ------------------------------------------------------------------------------ failures


def load_expecting_failure(
    rank: int, world_size: int, root: str, job: str, step: int | None, seed: int, out: str
) -> None:
    """Load, which must fail on every rank; record each failure DCP reports, for the test to inspect."""
    got = blank_like(plain_state(seed))
    try:
        dcp.load(got, checkpoint_id=step, storage_reader=RamdiskReader(root, job))
    except CheckpointException as exc:
        failures = {
            str(r): {
                "type": type(e).__name__,
                "message": str(e),
                "path": getattr(e, "path", None),
                "key": getattr(e, "key", None),
            }
            for r, (e, _tb) in exc.failures.items()
        }
        Path(out, f"rank-{rank}.json").write_text(json.dumps(failures))
        return
    raise AssertionError(f"rank {rank}: load of corrupt data succeeded")


def load_newest(rank: int, world_size: int, root: str, job: str, seed: int, out: str) -> None:
    """Load without a step: the state saved with ``seed`` must arrive bit-exact. Record the step loaded
    and the warnings the reader logged, for the test to inspect."""
    want = plain_state(seed)
    got = blank_like(want)
    reader = RamdiskReader(root, job)
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tierckpt.dcp")
    logger.addHandler(handler)
    try:
        dcp.load(got, storage_reader=reader)
    finally:
        logger.removeHandler(handler)
    assert_same(got, want)
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"step": reader.step, "warnings": logged}))


class DieMidWrite(DefaultSavePlanner):
    """Kills the process (no cleanup, like SIGKILL or a node loss) after it copied ``after`` tensors."""

    def __init__(self, victim: int, after: int) -> None:
        super().__init__()
        self.victim, self.after, self.count = victim, after, 0

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == self.victim and write_item.type != WriteItemType.BYTE_IO:
            self.count += 1
            if self.count > self.after:
                os._exit(17)
        return super().resolve_data(write_item)


def save_and_die(rank: int, world_size: int, root: str, job: str, step: int, seed: int) -> None:
    state = plain_state(seed)
    writer = RamdiskWriter(root, job)
    dcp.save(state, checkpoint_id=step, storage_writer=writer, planner=DieMidWrite(victim=1, after=1))


def save_with_disagreeing_steps(rank: int, world_size: int, root: str, job: str, out: str) -> None:
    """Each rank names a different step: the coordinator must refuse before anything is written."""
    try:
        dcp.save(plain_state(1), checkpoint_id=10 + rank, storage_writer=RamdiskWriter(root, job))
    except CheckpointException as exc:
        messages = [str(e) for e, _tb in exc.failures.values()]
        Path(out, f"rank-{rank}.json").write_text(json.dumps(messages))
        return
    raise AssertionError("a save with disagreeing steps succeeded")
