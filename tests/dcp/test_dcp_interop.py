"""A DCP step is an ordinary tierckpt step: format-level listing, verification and restore choice see it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.dcp import dcp_scenarios as sc
from tests.dcp.dcp_dist import run_ranks
from tierckpt.planning.restore_plan import choose_restore
from tierckpt.protocol.control import NodeInventory, RankHoldings, Tier
from tierckpt.protocol.format import (
    DCP_METADATA_NAME,
    committed_steps,
    iter_data_files,
    rank_dir,
    read_manifest,
    replica_rank_dir,
    step_dir,
)
from tierckpt.protocol.integrity import crc32c_file
from tierckpt.verify import verify_step

pytestmark = pytest.mark.e2e


def test_dcp_steps_are_committed_self_describing_and_verify(ramdisk: Path, job: str) -> None:
    run_ranks(3, sc.save_plain, str(ramdisk), job, 42, 1)
    for rank in range(3):
        path = step_dir(rank_dir(ramdisk, job, rank), 42)
        assert committed_steps(rank_dir(ramdisk, job, rank)) == [42]
        report = verify_step(path)
        manifest = read_manifest(path)
        assert (report.step, manifest.rank, manifest.world_size) == (42, rank, 3)
        assert manifest.manifest_kind == "dcp" and manifest.extra["dcp"]["coordinator"] == (rank == 0)
        for t in manifest.tensors:  # every item's own crc is right where the manifest says
            assert crc32c_file(path / t.file, offset=t.offset, length=t.length) == t.crc32c, t.key
        names = {f.name for f in manifest.files}
        assert (DCP_METADATA_NAME in names) == (rank == 0)
        assert all(f.name.startswith("data-") for f in iter_data_files(manifest))


def test_restore_choice_picks_the_dcp_step(ramdisk: Path, job: str) -> None:
    run_ranks(2, sc.save_plain, str(ramdisk), job, 8, 1)
    run_ranks(2, sc.save_plain, str(ramdisk), job, 9, 2)
    holdings = {r: RankHoldings(local=tuple(committed_steps(rank_dir(ramdisk, job, r)))) for r in range(2)}
    world = {s: read_manifest(step_dir(rank_dir(ramdisk, job, 0), s)).world_size for s in (8, 9)}
    inventory = NodeInventory(
        job=job,
        node="n0",
        endpoint="http://127.0.0.1:1",
        updated_at=time.time(),
        ranks=holdings,
        world_sizes=world,
    )
    plan = choose_restore([inventory])
    assert plan.step == 9 and plan.world_size == 2 and plan.sources == {0: Tier.LOCAL, 1: Tier.LOCAL}


def test_a_stale_primary_beside_a_replica_of_the_save_is_passed_over_for_the_replica(
    ramdisk: Path, job: str, tmp_path: Path
) -> None:
    """Found by the chaos soak (docs/reliability.md, seed 1512564371, round 41): a node holds rank 1's
    step 30 twice, as a primary the run the job left saved (another save of that step number) and as a
    replica of the save the checkpoint names. The reader took the primary and refused it ("not the step
    rank 1 wrote for this DCP checkpoint"), every attempt; it now reads the copy the checkpoint names."""
    other = tmp_path / "the-run-the-job-left"
    run_ranks(2, sc.save_plain, str(other), job, 30, 3)
    run_ranks(2, sc.save_plain, str(ramdisk), job, 30, 5)
    replica = replica_rank_dir(ramdisk, job, 1)
    replica.parent.mkdir(parents=True)
    shutil.move(rank_dir(ramdisk, job, 1), replica)
    shutil.copytree(rank_dir(other, job, 1), rank_dir(ramdisk, job, 1))  # the stale primary
    run_ranks(2, sc.load_plain, str(ramdisk), job, 30, 5)
    run_ranks(2, sc.load_plain, str(ramdisk), job, None, 5)


def test_a_rank_held_only_as_a_replica_is_read_from_there(ramdisk: Path, job: str) -> None:
    """After a node loss the replicator restores rank 1 as a replica on this node: the reader finds it."""
    run_ranks(2, sc.save_plain, str(ramdisk), job, 30, 5)
    primary = rank_dir(ramdisk, job, 1)
    replica = replica_rank_dir(ramdisk, job, 1)
    replica.parent.mkdir(parents=True)
    shutil.move(primary, replica)
    run_ranks(2, sc.load_plain, str(ramdisk), job, 30, 5)
    run_ranks(2, sc.load_plain, str(ramdisk), job, None, 5)
