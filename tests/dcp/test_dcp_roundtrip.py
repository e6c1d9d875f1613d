"""dcp.save / dcp.async_save to the ramdisk and dcp.load back, on real gloo process groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dcp import dcp_scenarios as sc
from tests.dcp.dcp_dist import run_ranks
from tierckpt.dcp import full_state_dict
from tierckpt.protocol.format import committed_steps, rank_dir, read_manifest, step_dir

pytestmark = pytest.mark.e2e


def test_save_load_round_trip_is_bit_exact(ramdisk: Path, job: str) -> None:
    run_ranks(3, sc.save_plain, str(ramdisk), job, 100, 1)
    for rank in range(3):
        assert committed_steps(rank_dir(ramdisk, job, rank)) == [100]
    run_ranks(3, sc.load_plain, str(ramdisk), job, 100, 1)


def test_load_without_step_picks_the_newest_complete_checkpoint(ramdisk: Path, job: str) -> None:
    run_ranks(2, sc.save_plain, str(ramdisk), job, 10, 1)
    run_ranks(2, sc.save_plain, str(ramdisk), job, 20, 2)
    run_ranks(2, sc.load_plain, str(ramdisk), job, None, 2)
    run_ranks(2, sc.load_plain, str(ramdisk), job, 10, 1)


def test_async_save_then_load(ramdisk: Path, job: str) -> None:
    run_ranks(2, sc.async_save_twice, str(ramdisk), job, 3)
    run_ranks(2, sc.load_plain, str(ramdisk), job, 7, 3)
    run_ranks(2, sc.load_plain, str(ramdisk), job, 8, 3, True)


def test_async_save_of_fsdp2_state_reshards_on_load(ramdisk: Path, job: str, tmp_path: Path) -> None:
    ref = str(tmp_path / "full.pt")
    run_ranks(2, sc.save_sharded, str(ramdisk), job, 60, ref, "async")
    run_ranks(3, sc.load_sharded, str(ramdisk), job, 60, ref)


def test_async_saves_stage_straight_into_the_ramdisk_and_stay_training_safe(
    ramdisk: Path, job: str, tmp_path: Path
) -> None:
    """The second and third async saves stage into the slots they commit (no host copy in between);
    every step holds the state as it was when its save was called, bit-exact."""
    run_ranks(2, sc.async_save_sharded_thrice, str(ramdisk), job, str(tmp_path))
    for step in (1, 2, 3):
        run_ranks(2, sc.load_sharded, str(ramdisk), job, step, str(tmp_path / f"step-{step}.pt"))


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(4, 2), (2, 3), (4, 1)])
def test_fsdp2_state_reshards_on_load(
    ramdisk: Path, job: str, tmp_path: Path, saved_at: int, loaded_at: int
) -> None:
    ref = str(tmp_path / "full.pt")
    run_ranks(saved_at, sc.save_sharded, str(ramdisk), job, 50, ref)
    manifest = read_manifest(step_dir(rank_dir(ramdisk, job, saved_at - 1), 50))
    assert manifest.world_size == saved_at and manifest.manifest_kind == "dcp"
    run_ranks(loaded_at, sc.load_sharded, str(ramdisk), job, 50, ref)
    whole = full_state_dict(ramdisk, job, 50)  # one process, no model: every chunk of every rank
    sc.assert_same(whole, torch.load(ref, weights_only=False))
