"""CUDA state through DCP on the ramdisk (runs on the device machine; skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt.dcp import RamdiskReader, RamdiskWriter


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_state_round_trips(ramdisk: Path, job: str, mode: str) -> None:
    torch.manual_seed(0)
    state = {
        "w": torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16),
        "b": torch.randn(4096, device="cuda"),
        "cpu": torch.arange(10),
        "step": 3,
    }
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    in_place = []
    with RamdiskWriter(ramdisk, job) as writer:
        for step in (1, 2, 3):  # later saves copy into recycled, CUDA-registered pages
            if mode == "async":
                response = dcp.async_save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)
                getattr(response, "upload_completion", response).result()
                in_place.append(writer.staged_in_place)
            else:
                dcp.save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)
    if mode == "async":
        assert in_place == [False, True, True], "from the second async save, staged straight into the ramdisk"
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    dcp.load(got, checkpoint_id=3, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].device == v.device and torch.equal(got[k], v), k
        else:
            assert got[k] == v


@pytest.mark.gpu
def test_fsdp2_cuda_state_stages_into_the_ramdisk_and_stays_training_safe(ramdisk: Path, job: str) -> None:
    """FSDP2 on one GPU (a process group of one): async saves stage the CUDA shards straight into the
    registered ramdisk slot; each step holds the state as it was when its save was called."""
    import socket

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        saves = dist.new_group(backend="gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
        mesh = init_device_mesh("cuda", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

        def train() -> None:
            model(torch.randn(4, 256, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()

        wants, in_place = {}, []
        with RamdiskWriter(ramdisk, job, keep=3) as writer:
            for step in (1, 2, 3):
                train()
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                wants[step] = {k: v.full_tensor().cpu() for k, v in msd.items() if isinstance(v, DTensor)}
                response = dcp.async_save(
                    state, checkpoint_id=step, storage_writer=writer, process_group=saves
                )
                train()  # training goes on while the step is written
                getattr(response, "upload_completion", response).result()
                in_place.append(writer.staged_in_place)
        assert in_place == [False, True, True]
        for step, want in wants.items():
            msd, osd = get_state_dict(model, opt)
            got = {"model": msd, "optim": osd}
            dcp.load(got, checkpoint_id=step, storage_reader=RamdiskReader(ramdisk, job))
            for k, v in want.items():
                assert torch.equal(got["model"][k].full_tensor().cpu(), v), (step, k)
    finally:
        dist.destroy_process_group()
