"""Device staging: the pure staging plan, the settings, and the clean fallback without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.client.client_helpers import assert_same, training_state
from tierckpt import Checkpointer
from tierckpt.protocol.format import align_up
from tierckpt.settings import resolve
from tierckpt.snapshot.devstage import SPLIT_GRANULE, STAGE_ALIGN, Piece, StagePlan, plan_staging

MIB = 1 << 20


def covered(plan: StagePlan, sizes: list[int]) -> None:
    """Every byte of every tensor is copied exactly once, by exactly one kind of copy."""
    by_tensor: dict[int, list[Piece]] = {}
    for piece in (*plan.blocking, *plan.direct, *plan.staged):
        by_tensor.setdefault(piece.index, []).append(piece)
    for i, n in enumerate(sizes):
        pieces = sorted(by_tensor.get(i, []), key=lambda p: p.start)
        at = 0
        for p in pieces:
            assert p.start == at and p.length > 0, (i, pieces)
            at += p.length
        assert at == n, (i, pieces)
    ends = [o + align_up(p.length, STAGE_ALIGN) for o, p in zip(plan.offsets, plan.staged, strict=True)]
    assert all(o % STAGE_ALIGN == 0 for o in plan.offsets)
    assert all(a <= b for a, b in zip(ends, plan.offsets[1:], strict=False))
    assert plan.staging_bytes == (ends[-1] if ends else 0)


def test_nothing_measured_stages_everything_the_budget_holds():
    sizes = [100 * MIB, 50 * MIB, 30 * MIB]
    plan = plan_staging(sizes, [True] * 3, [True] * 3, hidden=0, budget=1 << 40)
    covered(plan, sizes)
    assert plan.staged_bytes == sum(sizes) and not plan.direct and not plan.blocking


def test_everything_is_staged_when_the_budget_holds_it_whatever_the_copy_could_hide():
    sizes = [400 * MIB, 200 * MIB, 120 * MIB, 5]
    plan = plan_staging(sizes, [True, True, True, False], [True] * 4, hidden=1 << 40, budget=721 * MIB)
    covered(plan, sizes)
    assert plan.staged_bytes == sum(sizes) and not plan.direct and not plan.blocking


def test_only_the_tail_the_copy_cannot_hide_is_staged():
    sizes = [400 * MIB, 200 * MIB, 120 * MIB]
    plan = plan_staging(sizes, [True] * 3, [True] * 3, hidden=480 * MIB, budget=700 * MIB)
    covered(plan, sizes)
    assert 240 * MIB <= plan.staged_bytes < 240 * MIB + SPLIT_GRANULE
    assert [p.index for p in plan.staged] == [1, 2]  # the tail: part of tensor 1 and all of tensor 2
    assert plan.direct == (Piece(0, 0, 400 * MIB), Piece(1, 0, SPLIT_GRANULE))  # cut at a granule


def test_a_fast_copy_stages_nothing_when_the_budget_is_short():
    sizes = [100 * MIB, 50 * MIB]
    plan = plan_staging(sizes, [True, True], [True, True], hidden=1 << 40, budget=149 * MIB)
    covered(plan, sizes)
    assert plan.staging_bytes == 0 and plan.wanted_bytes == 0


def test_the_budget_is_a_hard_cap():
    sizes = [100 * MIB, 50 * MIB, 30 * MIB, 7]
    for budget in (0, 1, STAGE_ALIGN, 10 * MIB, 33 * MIB + 5, 79 * MIB, 200 * MIB):
        plan = plan_staging(sizes, [True, True, True, False], [True] * 4, hidden=0, budget=budget)
        covered(plan, sizes)
        assert plan.staging_bytes <= budget
        assert plan.wanted_bytes == sum(sizes)


def test_tensors_the_optimizer_does_not_own_are_staged_first_else_copied_before_returning():
    sizes = [10 * MIB, 20 * MIB, 40 * MIB]
    protected = [False, True, False]
    plan = plan_staging(sizes, protected, [True] * 3, hidden=1 << 40, budget=15 * MIB)
    covered(plan, sizes)
    assert [p.index for p in plan.staged] == [0] and [p.index for p in plan.blocking] == [2]
    assert plan.direct == (Piece(1, 0, 20 * MIB),)


def test_small_optimizer_tensors_are_staged_first_not_copied_one_by_one():
    sizes = [200 * MIB, 1000, 2000, 100 * MIB]
    plan = plan_staging(sizes, [True] * 4, [True] * 4, hidden=1 << 40, budget=10 * MIB)
    covered(plan, sizes)
    assert [p.index for p in plan.staged] == [1, 2]
    assert [p.index for p in plan.direct] == [0, 3] and not plan.blocking


def test_a_tensor_that_cannot_be_split_is_staged_whole_or_not_at_all():
    sizes = [64 * MIB, 64 * MIB]
    plan = plan_staging(sizes, [True, True], [False, False], hidden=100 * MIB, budget=127 * MIB)
    covered(plan, sizes)
    assert plan.staged == (Piece(1, 0, 64 * MIB),)
    plan = plan_staging(sizes, [True, True], [False, False], hidden=100 * MIB, budget=32 * MIB)
    covered(plan, sizes)
    assert plan.staging_bytes == 0


def test_device_budget_is_bytes_or_a_fraction():
    assert resolve(root="/r", device_budget=1 << 30).device_budget == 1 << 30
    assert resolve(root="/r", device_budget=0.25).device_budget == 0.25
    assert resolve(root="/r").device_staging is None  # on for CUDA tensors, unless turned off
    for bad in (0.0, 1.5, -1, True, "1G"):
        with pytest.raises(ValueError, match="device_budget"):
            resolve(root="/r", device_budget=bad)


def test_device_staging_without_a_gpu_behaves_like_overlap_mode(root, job):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    with Checkpointer(root=root, job=job, device_staging=True) as ck:
        ck.register_optimizer(opt)
        for step in range(3):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            handle = ck.save(step, {"model": model.state_dict()})
            opt.step()  # mutates at once: the pre-step hook waits for the copy
            handle.wait()
            dest: dict = {}
            ck.load(dest, step=step)
            assert_same({"model": expected}, {"model": dict(dest["model"])})
        assert ck.last_snapshot == {} or ck.last_snapshot["staged_bytes"] == 0
        assert ck.device_staging_bytes == 0
        state = training_state()
        ck.save(9, state, blocking=True)
        dest = {}
        ck.load(dest, step=9)
    assert_same(state, dest)


def test_staged_tensors_next_to_each_other_in_the_file_drain_as_one_copy(monkeypatch):
    """The layout math of a device-staged save, run on CPU tensors: the staging buffer mirrors the file
    region of the staged tail (padding included, zero), so it drains with one copy per run."""
    from tierckpt.snapshot import devstage
    from tierckpt.snapshot.layout import TensorSpec, plan_layout

    granule = 1 << 16
    monkeypatch.setattr(devstage, "SPLIT_GRANULE", granule)
    torch.manual_seed(0)
    srcs = [torch.randn(n) for n in (3 * granule // 4 + 3, granule // 4 + 5, 1000, granule // 4 + 7)]
    srcs.insert(2, torch.randn(7, 5).t())  # not contiguous: staged whole
    specs = [TensorSpec(f"t{i}", "float32", tuple(t.shape)) for i, t in enumerate(srcs)]
    layout = plan_layout(specs)
    file = torch.full((layout.files[0].size,), 0xAB, dtype=torch.uint8)
    for gap_at, gap in layout.padding(0):
        file[gap_at : gap_at + gap] = 0
    dsts = [
        file[p.offset : p.offset + p.length].view(torch.float32).view(s.shape)
        for p, s in zip(layout.placements, specs, strict=True)
    ]
    sizes = [t.numel() * 4 for t in srcs]
    splittable = [t.is_contiguous() for t in srcs]
    plan = devstage.plan_staging(
        sizes, [True] * 5, splittable, hidden=3 * granule // 2, budget=sum(sizes), small=0
    )
    assert plan.direct == (Piece(0, 0, granule),)  # the head of tensor 0, cut at a granule
    assert plan.staged[0] == Piece(0, granule, sizes[0] - granule)
    stager = devstage.DeviceStager(1 << 30)
    buffer = torch.full((plan.staging_bytes,), 0xCD, dtype=torch.uint8)
    staged, runs = stager._mirror(plan, layout, srcs, range(5), buffer)
    assert len(runs) == 1, "the staged tail is one run of the file"
    for region, src in staged:
        region.copy_(src)
    for piece in plan.direct:
        dst, src = devstage._pair(dsts[piece.index], srcs[piece.index], piece.start, piece.length)
        dst.copy_(src)
    for run in runs:
        file[run.offset : run.offset + run.length] = buffer[run.at : run.at + run.length]
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src)
    for gap_at, gap in layout.padding(0):
        assert not file[gap_at : gap_at + gap].any(), "padding stays zero"
