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
    with RamdiskWriter(ramdisk, job) as writer:
        for step in (1, 2, 3):  # later saves copy into recycled, CUDA-registered pages
            if mode == "async":
                response = dcp.async_save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)
                getattr(response, "upload_completion", response).result()
            else:
                dcp.save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    dcp.load(got, checkpoint_id=3, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].device == v.device and torch.equal(got[k], v), k
        else:
            assert got[k] == v
