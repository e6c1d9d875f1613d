"""Bad bytes and bad luck: corruption is detected and named, crashes leave nothing torn, a full
ramdisk is a clear error that loses nothing."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch

from tests.client.client_helpers import assert_same
from tierckpt import Checkpointer, CorruptShardError, FormatError, RamdiskFullError
from tierckpt.protocol.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    OBJECTS_NAME,
    read_commit,
    read_manifest,
    step_dir,
    step_dirs,
)
from tierckpt.snapshot.pool import SlotPool
from tierckpt.verify import step_problems, verify_step


def state_for(step: int) -> dict:
    return {
        "w": torch.full((1000,), float(step)),
        "odd": torch.arange(3, dtype=torch.int8) + step,  # 3 bytes: followed by padding
        "tail": torch.full((50,), step, dtype=torch.int64),
        "obj": {"pickled": {step}},
    }


@pytest.fixture
def two_steps(root, job):
    with Checkpointer(root=root, job=job, keep=3) as ck:
        ck.save(1, state_for(1), blocking=True)
        ck.save(2, state_for(2), blocking=True)
    return Checkpointer(root=root, job=job, keep=3)


def flip(path: Path, offset: int, mask: int = 0x40) -> None:
    """Flip bits of one byte in place (as bit rot would: no truncation, same inode and pages)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def tensor_entry(ck: Checkpointer, step: int, key: str):
    manifest = read_manifest(step_dir(ck.rank_path, step))
    return next(t for t in manifest.tensors if t.key == key)


def assert_falls_back(ck: Checkpointer, error: type[Exception]) -> None:
    with pytest.raises(error):
        ck.load({})
    dest = {}
    assert ck.load(dest, fallback=True) == 1
    assert_same(state_for(1), dest)


def test_a_flipped_tensor_byte_is_named_and_falls_back(two_steps):
    with two_steps as ck:
        entry = tensor_entry(ck, 2, "w")
        path = step_dir(ck.rank_path, 2) / entry.file
        flip(path, entry.offset + 1234)
        with pytest.raises(CorruptShardError) as info:
            verify_step(step_dir(ck.rank_path, 2))
        assert info.value.key == "w" and info.value.path == str(path) and "'w'" in str(info.value)
        dest = state_for(7)
        with pytest.raises(CorruptShardError) as info:
            ck.load(dest)
        assert info.value.key == "w" and info.value.path == str(path)
        for key in ("w", "odd", "tail"):  # CPU tensors are verified before any of their bytes is copied
            assert torch.equal(dest[key], state_for(7)[key])
        assert_falls_back(ck, CorruptShardError)


def test_a_flipped_padding_byte_is_detected_by_verify(two_steps):
    with two_steps as ck:
        entry = tensor_entry(ck, 2, "odd")
        flip(step_dir(ck.rank_path, 2) / entry.file, entry.offset + entry.length + 10)
        with pytest.raises(CorruptShardError, match="padding") as info:
            verify_step(step_dir(ck.rank_path, 2))
        assert info.value.key is None


def test_a_flipped_manifest_byte_is_detected(two_steps):
    with two_steps as ck:
        flip(step_dir(ck.rank_path, 2) / MANIFEST_NAME, 300)
        with pytest.raises(FormatError, match="commit marker"):
            verify_step(step_dir(ck.rank_path, 2))
        assert_falls_back(ck, FormatError)


def test_a_flipped_objects_byte_is_detected(two_steps):
    with two_steps as ck:
        path = step_dir(ck.rank_path, 2) / OBJECTS_NAME
        flip(path, 20)
        with pytest.raises(CorruptShardError) as info:
            verify_step(step_dir(ck.rank_path, 2))
        assert info.value.path == str(path)
        assert_falls_back(ck, CorruptShardError)


def test_every_flipped_commit_byte_is_detected(two_steps):
    with two_steps as ck:
        path = step_dir(ck.rank_path, 2) / COMMIT_NAME
        original = path.read_bytes()
        for offset in range(len(original)):
            for mask in (0x01, 0x20):
                flip(path, offset, mask)
                with pytest.raises(FormatError):
                    read_commit(path.parent)
                path.write_bytes(original)
        flip(path, len(original) // 2)
        assert step_problems(path.parent) and 2 not in ck.committed_steps()
        assert_falls_back(ck, FormatError)


def test_a_truncated_data_file_is_detected_without_crashing(two_steps):
    with two_steps as ck:
        assert ck.load({}) == 2  # the step's files are now mapped by this process
        path = step_dir(ck.rank_path, 2) / "data-00000.bin"
        os.truncate(path, 100)
        with pytest.raises(CorruptShardError, match="bytes, manifest says"):
            verify_step(path.parent)
        assert_falls_back(ck, CorruptShardError)


def test_a_crashed_writers_leftovers_are_removed_and_the_replicators_staging_kept(root, job):
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, state_for(1), blocking=True)
        rank_path = ck.rank_path
    torn = step_dir(rank_path, 2)
    torn.mkdir()
    (torn / "data-00000.bin").write_bytes(b"\0" * 4096)
    incoming = rank_path / ".incoming-000000000003-abcd"
    incoming.mkdir()
    with Checkpointer(root=root, job=job) as ck:
        assert sorted(step_dirs(rank_path)) == [1] and incoming.is_dir()
        dest = {}
        assert ck.load(dest) == 1


@pytest.mark.root
def test_a_full_ramdisk_is_a_clear_error_and_loses_nothing(small_tmpfs, job):
    small = {"w": torch.randn(4 << 20 >> 2)}  # 4 MiB
    huge = {"w": torch.randn(4 << 20 >> 2), "more": torch.randn(60 << 20 >> 2)}  # 64 MiB
    with Checkpointer(root=small_tmpfs, job=job, keep=1) as ck:
        ck.save(1, small, blocking=True)
        with pytest.raises(RamdiskFullError) as info:
            ck.save(2, huge)
        assert info.value.errno == errno.ENOSPC and "ramdisk full" in str(info.value)
        assert sorted(step_dirs(ck.rank_path)) == [1]
        verify_step(step_dir(ck.rank_path, 1))
        dest = {}
        assert ck.load(dest) == 1 and torch.equal(dest["w"], small["w"])
        ck.save(3, small, blocking=True)  # still works once the state fits again
        assert ck.committed_steps() == [3]


@pytest.mark.root
def test_running_out_of_space_while_committing_fails_the_handle_cleanly(small_tmpfs, job, monkeypatch):
    state = {"w": torch.randn(1 << 20), "obj": {"x": set(range(1000))}}
    real_take = SlotPool.take
    filler = small_tmpfs / "filler"

    def take_then_fill_the_disk(self, step, plan):
        slot = real_take(self, step, plan)
        if step == 2:
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            size = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
            os.posix_fallocate(fd, 0, size)
            os.close(fd)
        return slot

    monkeypatch.setattr(SlotPool, "take", take_then_fill_the_disk)
    with Checkpointer(root=small_tmpfs, job=job, keep=1) as ck:
        ck.save(1, state, blocking=True)
        handle = ck.save(2, state)
        assert isinstance(handle.exception(), RamdiskFullError)
        assert sorted(step_dirs(ck.rank_path)) == [1]
        filler.unlink()
        dest = {}
        assert ck.load(dest) == 1 and torch.equal(dest["w"], state["w"])


def test_a_flipped_manifest_byte_is_detected_by_the_writer_that_knows_the_manifest(root, job):
    with Checkpointer(root=root, job=job, keep=3) as ck:
        ck.save(1, state_for(1), blocking=True)
        ck.save(2, state_for(2), blocking=True)
        assert ck.load({}) == 2  # the manifest it committed is cached, its bytes are still checked
        flip(step_dir(ck.rank_path, 2) / MANIFEST_NAME, 100)
        assert_falls_back(ck, FormatError)


def test_an_unpicklable_object_is_refused_before_the_step_it_would_replace_goes(root, job):
    """Saving a step again replaces it; a state whose objects cannot be pickled is refused while the save
    is planned, so the committed copy of that step stays, whole and loadable."""
    with Checkpointer(root=root, job=job, keep=3) as ck:
        ck.save(5, state_for(5), blocking=True)
        bad = {**state_for(6), "fn": lambda: 0}
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            ck.save(5, bad)
        assert ck.committed_steps() == [5]
        dest = state_for(0)
        assert ck.load(dest) == 5
        assert_same(dest, state_for(5))
