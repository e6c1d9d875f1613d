"""Data file layout planning (snapshot.layout), pure."""

from __future__ import annotations

import pytest

from tierckpt.protocol.format import ALIGNMENT
from tierckpt.snapshot.layout import TensorSpec, plan_layout


def specs(*sizes_f32):
    return [TensorSpec(f"t{i}", "float32", (n,)) for i, n in enumerate(sizes_f32)]


def test_tensors_are_aligned_disjoint_and_inside_their_file():
    plan = plan_layout(specs(1, 100, 0, 64, 3))
    assert [f.name for f in plan.files] == ["data-00000.bin"]
    ends = 0
    for p, s in zip(plan.placements, plan.specs, strict=True):
        assert p.offset % ALIGNMENT == 0 and p.offset >= ends and p.length == s.nbytes
        ends = p.offset + p.length
    assert plan.files[0].size % ALIGNMENT == 0 and plan.files[0].size >= ends


def test_padding_plus_tensors_cover_each_file_exactly():
    plan = plan_layout(specs(1, 7, 64, 0, 1000), max_file_bytes=1024)
    for i, f in enumerate(plan.files):
        data = sum(p.length for p in plan.placements if p.file == i)
        assert data + sum(n for _, n in plan.padding(i)) == f.size


def test_max_file_bytes_starts_new_files_without_splitting_tensors():
    plan = plan_layout(specs(200, 200, 200, 1000), max_file_bytes=1024)
    assert [p.file for p in plan.placements] == [0, 1, 2, 3]
    assert plan.files[3].size == 4096  # a tensor larger than the limit gets a file of its own


def test_no_tensors_means_no_files_and_empty_tensors_still_get_one():
    assert plan_layout([]).files == ()
    plan = plan_layout(specs(0, 0))
    assert plan.files[0].size == ALIGNMENT and all(p.length == 0 for p in plan.placements)


def test_alignment_must_be_a_multiple_of_the_format_alignment():
    with pytest.raises(ValueError):
        plan_layout(specs(1), alignment=100)
    assert plan_layout(specs(1, 1), alignment=4096).placements[1].offset == 4096
