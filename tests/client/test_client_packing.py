"""Packed copies of small tensors and the parallel checksums, exercised on CPU.

The packing code is device-agnostic apart from the final DMA: here a "cpu" group stands in for a
CUDA device, so the gather into the staging buffer, its layout and the scatter back are checked
bit for bit without a GPU (the real CUDA path is in test_client_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from tierckpt import cuda
from tierckpt.protocol.integrity import crc32c
from tierckpt.snapshot import checksum
from tierckpt.snapshot.layout import TensorSpec, packed_runs, plan_layout
from tierckpt.snapshot.packing import LATER, SavePacker, pack_groups
from tierckpt.snapshot.pool import Slot
from tierckpt.snapshot.upload import plan_runs


def test_grouped_tensors_form_one_contiguous_run_per_group_and_file():
    specs = [
        TensorSpec("big", "float32", (1000,)),
        TensorSpec("a", "float32", (3,), "cuda:0"),
        TensorSpec("cpu", "int8", (5,)),
        TensorSpec("b", "bfloat16", (7,), "cuda:0"),
        TensorSpec("late", "float32", (2,), "cuda:0" + LATER),
        TensorSpec("c", "float32", (), "cuda:0"),
    ]
    plan = plan_layout(specs)
    runs = {r.group: r for r in packed_runs(plan)}
    assert set(runs) == {"cuda:0", "cuda:0" + LATER}
    assert runs["cuda:0"].indices == (1, 3, 5) and runs["cuda:0"].start == 0
    assert runs["cuda:0" + LATER].start == runs["cuda:0"].end + (-runs["cuda:0"].end % 256)
    for run in runs.values():  # nothing else inside a run
        inside = [i for i, p in enumerate(plan.placements) if run.start <= p.offset < run.end]
        assert sorted(inside) == sorted(run.indices)
    data = sum(p.length for p in plan.placements)
    assert data + sum(n for i in range(len(plan.files)) for _, n in plan.padding(i)) == plan.total_bytes


def test_groups_split_across_files_give_one_run_per_file():
    specs = [TensorSpec(f"t{i}", "float32", (1000,), "cuda:0") for i in range(10)]
    plan = plan_layout(specs, max_file_bytes=12_000)
    runs = packed_runs(plan)
    assert len(plan.files) > 1 and {r.file for r in runs} == set(range(len(plan.files)))
    assert sorted(i for r in runs for i in r.indices) == list(range(10))


def test_pack_groups_leaves_cpu_tensors_alone_and_respects_the_limits():
    tensors = [torch.zeros(4), torch.zeros(1 << 20)]
    assert pack_groups(tensors, [False, False], max_bytes=1 << 20, limit=1 << 30) == (None, None)
    assert pack_groups(tensors, [False, False], max_bytes=0, limit=1 << 30) == (None, None)


def test_save_packer_stages_like_the_file_and_scatter_restores_bit_exact(tmp_path):
    torch.manual_seed(0)
    tensors = [
        torch.randn(333),
        torch.randn(10, 7).bfloat16(),
        torch.randn(6, 5).t(),  # non-contiguous: copied on its own
        torch.tensor(2.5),
        torch.randint(0, 255, (3,), dtype=torch.uint8),
    ]
    specs = [
        TensorSpec(str(i), str(t.dtype).removeprefix("torch."), tuple(t.shape), "cpu")
        for i, t in enumerate(tensors)
    ]
    plan = plan_layout(specs)
    slot = Slot(tmp_path)
    try:
        views = slot.views(plan)
        run = packed_runs(plan)[0]
        slot.files[0].buffer[run.start : run.end].fill_(
            0xEE
        )  # garbage in the run's padding: zeroed by the copy
        packer = SavePacker()
        for _ in range(2):  # the second save reuses the same buffers
            copies = packer.copies(plan, slot.files, tensors, later=False)
            assert len(copies) == 1 and not packer.copies(plan, slot.files, tensors, later=True)
            for p in copies:  # what cuda.copy_to_host does on the side stream
                cuda.gather(p.slots, p.tensors)
                p.host.copy_(p.staging)
        assert packer.device_bytes == packed_runs(plan)[0].nbytes
        for view, t in zip(views, tensors, strict=True):
            assert torch.equal(view, t)
        buf = slot.files[0].buffer
        for offset, length in plan.padding(0):
            if offset < run.end:
                assert not buf[offset : offset + length].any()
        # restore: plan runs over the same bytes and scatter back into fresh tensors
        places = [
            (i, torch.device("cpu"), "data", plan.placements[i].offset, plan.placements[i].length)
            for i in range(len(tensors))
        ]
        (run,) = plan_runs(places, limit=1 << 20)
        assert run.start == 0 and sorted(run.indices) == list(range(len(tensors)))
        assert plan_runs(places, limit=10) == []
        staging = buf[run.start : run.end].clone()
        dests = [torch.empty_like(t) for t in tensors]
        slots = [
            staging[p.offset - run.start : p.offset - run.start + p.length].view(t.dtype).view(t.shape)
            for p, t in zip(plan.placements, tensors, strict=True)
        ]
        cuda.gather(dests, slots)
        for d, t in zip(dests, tensors, strict=True):
            assert torch.equal(d, t)
    finally:
        slot.close(unlink=True)


def test_plan_runs_splits_at_large_gaps():
    cpu = torch.device("cpu")
    places = [
        (0, cpu, "f", 0, 100),
        (1, cpu, "f", 256, 100),
        (2, cpu, "f", 10 << 20, 100),
        (3, cpu, "g", 0, 4),
    ]
    runs = plan_runs(places, limit=1 << 30)
    assert sorted((r.file, r.start, r.end, r.indices) for r in runs) == [
        ("f", 0, 356, (0, 1)),
        ("f", 10 << 20, (10 << 20) + 100, (2,)),
        ("g", 0, 4, (3,)),
    ]


@pytest.mark.parametrize("workers", [None, 1, 3])
def test_parallel_region_and_file_crcs_match_a_plain_crc(workers):
    data = torch.randint(0, 255, ((40 << 20) + 12345,), dtype=torch.uint8)
    base = data.data_ptr()
    regions = [(base, 20 << 20), (base + 5, 17), (base + (20 << 20), (20 << 20) + 12345), (base, 0)]
    want = [crc32c(data[a - base : a - base + n].numpy().tobytes()) for a, n in regions]
    assert checksum.region_crcs(regions, workers=workers) == want
    assert checksum.start_file_crcs([(base, data.numel())]).result() == [crc32c(data.numpy().tobytes())]
    pending = checksum.start_file_crcs([(base, data.numel())])
    pending.abandon()  # returns only once nothing reads the memory any more


def test_the_table_combiner_agrees_with_crc32c_combine():
    from tierckpt.protocol.integrity import crc32c_combine

    for length in (1, 256, 8 << 20, 12345):
        c = checksum.Combiner(length)
        for a, b in ((0, 0), (0xDEADBEEF, 0x12345678), (1, 0xFFFFFFFF)):
            assert c(a, b) == crc32c_combine(a, b, length)
