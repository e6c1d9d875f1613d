"""Bad input gets a clear error and loses nothing: corrupt bytes, truncated files, a rank killed mid-save,
an existing step, a full ramdisk."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.multiprocessing import ProcessExitedException

from tests.dcp import dcp_nodes as dn
from tests.dcp import dcp_scenarios as sc
from tests.dcp.dcp_dist import run_ranks
from tierckpt.dcp import RamdiskReader, RamdiskWriter
from tierckpt.protocol import leases
from tierckpt.protocol.control import RestoreState, RestoreStatus, Tier, write_restore_status
from tierckpt.protocol.errors import CorruptShardError, MissingCheckpointError, RamdiskFullError
from tierckpt.protocol.format import (
    DCP_METADATA_NAME,
    committed_steps,
    discard_step,
    job_dir,
    rank_dir,
    read_manifest,
    step_dir,
)


def _find_entry(root: Path, job: str, step: int, key: str) -> tuple[Path, int]:
    """(data file, offset) of the item ``key``, whichever rank wrote it."""
    for rank in range(8):
        path = step_dir(rank_dir(root, job, rank), step)
        if not path.exists():
            continue
        for t in read_manifest(path).tensors:
            if t.key == key:
                return path / t.file, t.offset
    raise AssertionError(f"no item {key!r} in step {step}")


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _failures(out: Path, world_size: int) -> list[dict[str, str]]:
    """Every failure reported to every rank (DCP gathers each rank's exception to all ranks)."""
    records = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world_size)]
    assert all(rec == records[0] for rec in records), records
    return list(records[0].values())


def test_a_corrupt_byte_is_reported_with_its_item_and_file(ramdisk: Path, job: str, tmp_path: Path) -> None:
    run_ranks(2, sc.save_plain, str(ramdisk), job, 5, 1)
    data_file, offset = _find_entry(ramdisk, job, 5, "w@0,0")
    _flip_byte(data_file, offset + 100)
    run_ranks(2, sc.load_expecting_failure, str(ramdisk), job, 5, 1, str(tmp_path))
    failures = _failures(tmp_path, 2)  # both ranks read the replicated tensor "w": both detect it
    assert failures and all(f["type"] == "CorruptShardError" for f in failures), failures
    for failure in failures:
        assert failure["key"] == "w@0,0" and failure["path"] == str(data_file)
        assert "'w@0,0'" in failure["message"] and str(data_file) in failure["message"]
        assert "corrupt" in failure["message"]


def test_a_truncated_data_file_is_corrupt(ramdisk: Path, job: str, tmp_path: Path) -> None:
    run_ranks(2, sc.save_plain, str(ramdisk), job, 5, 1)
    data_file, _ = _find_entry(ramdisk, job, 5, "w@0,0")
    os.truncate(data_file, 300)
    run_ranks(2, sc.load_expecting_failure, str(ramdisk), job, 5, 1, str(tmp_path))
    failures = _failures(tmp_path, 2)
    assert any(f["type"] == "CorruptShardError" and f["path"] == str(data_file) for f in failures), failures


def test_corrupt_metadata_fails_the_load_clearly(ramdisk: Path, job: str, tmp_path: Path) -> None:
    run_ranks(2, sc.save_plain, str(ramdisk), job, 5, 1)
    metadata = step_dir(rank_dir(ramdisk, job, 0), 5) / DCP_METADATA_NAME
    _flip_byte(metadata, 40)
    run_ranks(2, sc.load_expecting_failure, str(ramdisk), job, 5, 1, str(tmp_path))
    failures = _failures(tmp_path, 2)
    assert all(str(metadata) in f["message"] and "corrupt" in f["message"] for f in failures), failures


def test_a_rank_killed_mid_save_leaves_no_visible_step(ramdisk: Path, job: str) -> None:
    run_ranks(3, sc.save_plain, str(ramdisk), job, 10, 1)
    with pytest.raises(ProcessExitedException):
        run_ranks(3, sc.save_and_die, str(ramdisk), job, 20, 2)
    victim = rank_dir(ramdisk, job, 1)
    assert step_dir(victim, 20).exists(), "the victim had started writing step 20"
    assert committed_steps(victim) == [10]
    assert 20 not in committed_steps(rank_dir(ramdisk, job, 0)), "the coordinator never committed step 20"
    run_ranks(3, sc.load_plain, str(ramdisk), job, None, 1)  # newest complete checkpoint: step 10
    # Whether the surviving ranks committed their own files before the group was torn down depends on
    # timing; either way step 20 is not readable, and the error says which case it is.
    survivors_committed = any(20 in committed_steps(rank_dir(ramdisk, job, r)) for r in (0, 2))
    if survivors_committed:
        expected = r"step 20 under \S+ has no committed DCP metadata"
    else:
        expected = r"no committed step 20 under"
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            sc.blank_like(sc.plain_state(2)), storage_reader=RamdiskReader(ramdisk, job, 20), no_dist=True
        )
    ((error, _tb),) = info.value.failures.values()
    assert isinstance(error, MissingCheckpointError) and re.search(expected, str(error)), error


def test_an_existing_step_is_kept_unless_overwrite(ramdisk: Path, job: str) -> None:
    first, second = {"x": torch.ones(4)}, {"x": torch.full((4,), 2.0)}
    dcp.save(first, checkpoint_id=3, storage_writer=RamdiskWriter(ramdisk, job), no_dist=True)
    with pytest.raises(CheckpointException, match="already has a committed step 3"):
        dcp.save(second, checkpoint_id=3, storage_writer=RamdiskWriter(ramdisk, job), no_dist=True)
    got = {"x": torch.zeros(4)}
    dcp.load(got, checkpoint_id=3, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
    assert torch.equal(got["x"], first["x"])
    replacing = RamdiskWriter(ramdisk, job, overwrite=True)
    with (
        leases.hold(rank_dir(ramdisk, job, 0), 3, "replicator"),
        pytest.raises(CheckpointException, match="leased"),
    ):
        dcp.save(second, checkpoint_id=3, storage_writer=replacing, no_dist=True)  # someone is copying step 3
    dcp.save(second, checkpoint_id=3, storage_writer=replacing, no_dist=True)
    dcp.load(got, checkpoint_id=3, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
    assert torch.equal(got["x"], second["x"])


def test_a_job_that_went_back_saves_over_the_steps_of_the_run_it_left(ramdisk: Path, job: str) -> None:
    """Found by the chaos harness (docs/reliability.md): a save of step 20 failed on one rank (its ramdisk
    full), so its coordinator never committed it and the restore went back to step 10; rank 1 also holds
    step 30 of that run (saved before one of its nodes was lost, say). Training then saves 20 and 30
    again. The replicator staged step 10 for the restore (the ranks' restore statuses say so, newer than
    any of their commits), so the steps above it belong to the run the job went back from and are
    replaced, as ``Checkpointer`` does. They were refused (``FileExistsError``, overwrite=False): every
    save of the job failed, and it restarted from step 10 forever."""
    for step, seed in ((10, 1), (20, 2), (30, 3)):
        run_ranks(2, sc.save_plain, str(ramdisk), job, step, seed, 3)
    discard_step(step_dir(rank_dir(ramdisk, job, 0), 20))  # the coordinator's part never committed
    discard_step(step_dir(rank_dir(ramdisk, job, 0), 30))
    for rank in range(2):
        staged = RestoreStatus(job, rank, RestoreState.READY, 10, Tier.LOCAL, 0, 0, time.time())
        write_restore_status(job_dir(ramdisk, job), staged)
    run_ranks(2, sc.load_plain, str(ramdisk), job, 10, 1)
    run_ranks(2, sc.save_plain, str(ramdisk), job, 20, 4)  # the same steps again, other bytes
    assert committed_steps(rank_dir(ramdisk, job, 1)) == [10, 20], "30 was saved before the job went back"
    run_ranks(2, sc.save_plain, str(ramdisk), job, 30, 5)
    run_ranks(2, sc.load_plain, str(ramdisk), job, 20, 4)
    run_ranks(2, sc.load_plain, str(ramdisk), job, 30, 5)
    # once the job saved after going back, a step of its own run is refused again (overwrite=False)
    with pytest.raises(ProcessExitedException):
        run_ranks(2, sc.save_plain, str(ramdisk), job, 30, 6)


def test_a_job_that_starts_afresh_saves_over_the_steps_of_the_run_it_left(ramdisk: Path, job: str) -> None:
    """Found by the chaos harness: the first save of a job (step 3) failed on one rank, so nothing was
    restorable and the replicator told every rank to start fresh (restore status ``none``). The rank that
    had committed its part of step 3 refused the next save of step 3 (``FileExistsError``), forever."""
    run_ranks(2, sc.save_plain, str(ramdisk), job, 3, 1)
    discard_step(step_dir(rank_dir(ramdisk, job, 0), 3))  # the coordinator's part never committed
    for rank in range(2):
        fresh = RestoreStatus(job, rank, RestoreState.NONE, None, None, 0, 0, time.time())
        write_restore_status(job_dir(ramdisk, job), fresh)
    run_ranks(2, sc.save_plain, str(ramdisk), job, 3, 2)
    run_ranks(2, sc.load_plain, str(ramdisk), job, 3, 2)


@pytest.mark.root
def test_a_full_ramdisk_raises_ramdisk_full_and_keeps_older_steps(
    tmpfs: Callable[[str], Path], job: str
) -> None:
    mount = tmpfs("1m")
    small = {"x": torch.arange(1000, dtype=torch.float32)}
    with RamdiskWriter(mount, job) as writer:
        dcp.save(small, checkpoint_id=1, storage_writer=writer, no_dist=True)
        with pytest.raises(CheckpointException) as info:
            big = {"x": torch.randn(1 << 20)}  # 4 MiB into a 1 MiB ramdisk
            dcp.save(big, checkpoint_id=2, storage_writer=writer, no_dist=True)
    ((error, _tb),) = info.value.failures.values()
    assert isinstance(error, RamdiskFullError), error
    assert "ramdisk full" in str(error)
    assert not step_dir(rank_dir(mount, job, 0), 2).exists(), "the partial step was removed"
    got = {"x": torch.zeros(1000)}
    dcp.load(got, storage_reader=RamdiskReader(mount, job), no_dist=True)
    assert torch.equal(got["x"], small["x"])


def test_ranks_naming_different_steps_are_refused_before_writing(
    ramdisk: Path, job: str, tmp_path: Path
) -> None:
    run_ranks(2, sc.save_with_disagreeing_steps, str(ramdisk), job, str(tmp_path))
    for rank in range(2):
        messages = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert any("ranks disagree on the step to save ([10, 11])" in m for m in messages), messages
        assert committed_steps(rank_dir(ramdisk, job, rank)) == []
        assert not step_dir(rank_dir(ramdisk, job, rank), 10 + rank).exists()


# ------------------------------------------------------------------------------ falling back

DAMAGE = ["deleted", "truncated", "corrupt"]


def _damage(data_file: Path, offset: int, how: str) -> None:
    if how == "deleted":
        data_file.unlink()
    elif how == "truncated":
        os.truncate(data_file, offset + 100)
    else:
        _flip_byte(data_file, offset + 100)


def _records(out: Path, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_load_without_step_falls_back_past_a_damaged_data_file(
    ramdisk: Path, job: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    older, newer = sc.plain_state(1), sc.plain_state(2)
    with RamdiskWriter(ramdisk, job) as writer:
        dcp.save(older, checkpoint_id=1, storage_writer=writer, no_dist=True)
        dcp.save(newer, checkpoint_id=2, storage_writer=writer, no_dist=True)
    data_file, offset = _find_entry(ramdisk, job, 2, "w@0,0")
    _damage(data_file, offset, how)
    got = sc.blank_like(older)
    reader = RamdiskReader(ramdisk, job)
    with caplog.at_level(logging.WARNING, logger="tierckpt.dcp"):
        dcp.load(got, storage_reader=reader, no_dist=True)
    sc.assert_same(got, older)
    assert reader.step == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("DCP step 2" in m and "cannot be loaded" in m and str(data_file) in m for m in warnings), (
        warnings
    )
    assert any("loading DCP step 1" in m for m in warnings), warnings


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_step_with_nothing_older_is_a_corrupt_shard(ramdisk: Path, job: str, how: str) -> None:
    dcp.save(sc.plain_state(1), checkpoint_id=5, storage_writer=RamdiskWriter(ramdisk, job), no_dist=True)
    data_file, offset = _find_entry(ramdisk, job, 5, "w@0,0")
    _damage(data_file, offset, how)
    for step in (None, 5):  # newest loadable, or this step
        with pytest.raises(CheckpointException) as info:
            dcp.load(
                sc.blank_like(sc.plain_state(1)),
                checkpoint_id=step,
                storage_reader=RamdiskReader(ramdisk, job),
                no_dist=True,
            )
        ((error, _tb),) = info.value.failures.values()
        assert isinstance(error, CorruptShardError), error
        assert error.path == str(data_file) and str(data_file) in str(error), error


@pytest.mark.e2e
@pytest.mark.parametrize("how", DAMAGE)
def test_ranks_fall_back_together_past_a_file_damaged_on_one_node(tmp_path: Path, job: str, how: str) -> None:
    """Two nodes of one rank each, each holding the whole checkpoint: step 20 is damaged on node 1 only,
    so node 0 could load it; both ranks load step 10, bit-exact, and say why."""
    base = tmp_path / "nodes"
    run_ranks(2, dn.save_plain, str(base), 1, job, 10, 1)
    run_ranks(2, dn.save_plain, str(base), 1, job, 20, 2)
    data_file = step_dir(rank_dir(base / "node-1", job, 1), 20) / "data-00000.bin"
    entry = next(t for t in read_manifest(data_file.parent).tensors if t.key == "w@0,0")
    _damage(data_file, entry.offset, how)
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(2, dn.load_newest, str(base), 1, job, 1, str(out))
    for record in _records(out, 2):
        assert record["step"] == 10, record
        assert any(
            "DCP step 20" in w and "rank 1" in w and str(data_file) in w for w in record["warnings"]
        ), record


@pytest.mark.e2e
@pytest.mark.parametrize("how", DAMAGE)
def test_ranks_of_one_node_fall_back_together_when_one_of_them_finds_the_damage(
    ramdisk: Path, job: str, how: str, tmp_path: Path
) -> None:
    """The ranks of a node share out the crc check of its files: only one of them reads the damaged one."""
    run_ranks(2, sc.save_plain, str(ramdisk), job, 10, 1)
    run_ranks(2, sc.save_plain, str(ramdisk), job, 20, 2)
    data_file, offset = _find_entry(ramdisk, job, 20, "w@0,0")
    _damage(data_file, offset, how)
    run_ranks(2, sc.load_newest, str(ramdisk), job, 1, str(tmp_path))
    assert [r["step"] for r in _records(tmp_path, 2)] == [10, 10]


@pytest.mark.e2e
def test_ranks_with_nothing_older_all_raise_corrupt_shard(ramdisk: Path, job: str, tmp_path: Path) -> None:
    run_ranks(2, sc.save_plain, str(ramdisk), job, 20, 2)
    data_file, offset = _find_entry(ramdisk, job, 20, "w@0,0")
    _flip_byte(data_file, offset + 100)
    run_ranks(2, sc.load_expecting_failure, str(ramdisk), job, None, 2, str(tmp_path))
    failures = _failures(tmp_path, 2)
    assert failures and all(f["type"] == "CorruptShardError" for f in failures), failures
    assert all(f["path"] == str(data_file) and "'w@0,0'" in f["message"] for f in failures), failures
