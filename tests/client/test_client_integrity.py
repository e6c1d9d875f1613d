"""The client's integrity by default (issue 10, defects 7, 8 and the pickled objects): a missing or short
data file is a corrupt step (fallback works), a step of another world size is refused unless
``strict=False``, and ``objects.pkl`` is unpickled with a restricted unpickler."""

from __future__ import annotations

import collections
import datetime
import decimal
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tierckpt import (
    Checkpointer,
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    WorldSizeMismatchError,
)
from tierckpt.protocol.format import read_manifest, step_dir
from tierckpt.snapshot import objects
from tierckpt.snapshot.objects import UnsafeObjectError


def state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step)), "b": torch.arange(10) + step}


@pytest.fixture
def two_steps(root: Path, job: str) -> Path:
    """Steps 1 and 2 of rank 0 of 1; returns the rank directory."""
    with Checkpointer(root=root, job=job, rank=0, world_size=1) as ck:
        ck.save(1, state(1), blocking=True)
        ck.save(2, state(2), blocking=True)
        return ck.rank_path


@pytest.mark.parametrize("damage", ["missing", "short", "missing objects"])
def test_a_missing_or_short_file_is_a_corrupt_step_and_fallback_loads_the_previous(
    root: Path, job: str, two_steps: Path, damage: str
) -> None:
    newest = step_dir(two_steps, 2)
    data = newest / read_manifest(newest).files[0].name
    if damage == "missing":
        data.unlink()
    elif damage == "short":
        os.truncate(data, 100)
    else:  # a step with objects whose objects.pkl is gone
        with Checkpointer(root=root, job=job, rank=0, world_size=1) as ck:
            ck.save(3, {**state(3), "o": {1, 2}}, blocking=True)
        (step_dir(two_steps, 3) / "objects.pkl").unlink()
    with Checkpointer(root=root, job=job, rank=0, world_size=1) as ck:
        with pytest.raises(CorruptShardError):
            ck.load({})
        dest: dict = {}
        want = 2 if damage == "missing objects" else 1  # the step before the damaged one
        assert ck.load(dest, fallback=True) == want
        assert torch.equal(dest["w"], state(want)["w"]) and torch.equal(dest["b"], state(want)["b"])


def test_a_step_of_another_world_size_is_refused_unless_not_strict(root: Path, job: str) -> None:
    with Checkpointer(root=root, job=job, rank=1, world_size=4) as ck:
        ck.save(5, state(5), blocking=True)
    with Checkpointer(root=root, job=job, rank=1, world_size=2) as ck:
        dest = {"w": torch.zeros(4096), "b": torch.zeros(10, dtype=torch.int64)}
        with pytest.raises(WorldSizeMismatchError, match="world size 4"):
            ck.load(dest)
        assert not dest["w"].any(), "nothing was copied"
        with pytest.raises(MissingCheckpointError):  # no older step fits either
            ck.load(dest, fallback=True)
        assert ck.load(dest, strict=False) == 5 and torch.equal(dest["w"], state(5)["w"])


# ------------------------------------------------------------------------------------------- objects


class Exploit:
    """What a tampered objects.pkl carries: a callable that runs when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


class UserThing:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UserThing) and other.value == self.value


def test_plain_values_round_trip():
    values = [
        {1, 2},
        frozenset("ab"),
        b"\x00\xff",
        bytearray(b"xy"),
        3 + 4j,
        collections.OrderedDict(a=1),
        collections.defaultdict(list, a=[1]),
        collections.Counter("aab"),
        collections.deque([1, 2]),
        datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc),
        datetime.timedelta(seconds=5),
        decimal.Decimal("1.5"),
        np.float64(1.5),
        np.int32(7),
        np.dtype("float16"),
        np.array([1, "a", None], dtype=object),
        torch.float16,
        torch.Size([2, 3]),
        range(3),
        slice(1, 2),
    ]
    for value in values:
        for protocol in (2, pickle.HIGHEST_PROTOCOL):
            back = objects.loads(pickle.dumps(value, protocol=protocol))
            if isinstance(value, np.ndarray):
                assert back.tolist() == value.tolist()
            else:
                assert back == value and type(back) is type(value), value


def test_a_global_off_the_allowlist_is_refused_and_never_called(tmp_path: Path):
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeObjectError, match="system"):
        objects.loads(pickle.dumps([Exploit(marker)]))
    assert not marker.exists()
    for body in (b"garbage", pickle.dumps([1])[:-2]):
        with pytest.raises(FormatError):
            objects.loads(body)


def test_user_types_load_once_registered_as_torch_safe_globals():
    body = pickle.dumps([UserThing(3)])
    with pytest.raises(UnsafeObjectError, match="add_safe_globals"):
        objects.loads(body)
    torch.serialization.add_safe_globals([UserThing])
    try:
        assert objects.loads(body) == [UserThing(3)]
    finally:
        torch.serialization.clear_safe_globals()


def test_a_tampered_objects_file_runs_nothing_at_load(root: Path, job: str, tmp_path: Path):
    """A step as a compromised tier would hand it over: consistent checksums, a malicious objects.pkl."""
    marker = tmp_path / "pwned"
    with Checkpointer(root=root, job=job, rank=0, world_size=1) as ck:
        ck.save(1, {**state(1), "meta": {"epoch": {1}}}, blocking=True)
        ck.save(2, {**state(2), "meta": {"epoch": Exploit(marker)}}, blocking=True)
    with Checkpointer(root=root, job=job, rank=0, world_size=1) as ck:
        with pytest.raises(UnsafeObjectError):
            ck.load({})
        assert not marker.exists()
        dest: dict = {}
        assert ck.load(dest, fallback=True) == 1 and dest["meta"] == {"epoch": {1}}
    assert not marker.exists()


def test_checksum_threads_are_this_trainers_share_of_the_cpus(monkeypatch):
    """Four trainers of a node each running a pool of every CPU would oversubscribe the CPUs."""
    from tierckpt.snapshot.checksum import crc_threads

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("TIERCKPT_CRC_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert crc_threads() == cpus
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert crc_threads() == max(1, cpus // 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "junk")
    assert crc_threads() == cpus
    monkeypatch.setenv("TIERCKPT_CRC_THREADS", "3")
    assert crc_threads() == 3


def test_copy_threads_ignore_torchruns_one_thread_for_kernels(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 (torch.get_num_threads() == 1) for the training's kernels; the
    copies of a restore (and DCP's bounce buffers) still use this trainer's share of the CPUs."""
    from tierckpt.snapshot import copy

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert copy._copy_workers() == min(8, len(os.sched_getaffinity(0)))
    finally:
        torch.set_num_threads(threads)
