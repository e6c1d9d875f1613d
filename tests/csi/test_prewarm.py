"""Prewarming a new node's memory: the free space of a freshly mounted ramdisk written once and freed,
bounded by the free space, the limit and MemAvailable, leaving nothing behind (real tmpfs mounts)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tierckpt_csi import prewarm as prewarm_module
from tierckpt_csi.prewarm import PREWARM_FILE, prewarm

pytestmark = pytest.mark.root

MiB = 1 << 20


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_the_free_space_is_written_once_and_freed_and_the_jobs_data_kept(tmpfs: Callable[..., Path]):
    disk = tmpfs("64m", huge="never")
    job = disk / "team-a_job_0a1b2c3d"
    job.mkdir()
    payload = os.urandom(16 * MiB)
    (job / "data-00000.bin").write_bytes(payload)
    before = _used(disk)
    done = prewarm(disk, 1 << 40, workers=3)
    assert 44 * MiB <= done.nbytes <= 48 * MiB and done.nbytes % (2 * MiB) == 0
    assert _used(disk) == before and sorted(os.listdir(disk)) == [job.name]
    assert (job / "data-00000.bin").read_bytes() == payload


def test_the_limit_and_memavailable_bound_it(tmpfs: Callable[..., Path], monkeypatch: pytest.MonkeyPatch):
    disk = tmpfs("64m", huge="never")
    assert prewarm(disk, 10 * MiB).nbytes == 10 * MiB
    monkeypatch.setattr(prewarm_module, "_mem_available", lambda: 20 * MiB)
    assert prewarm(disk, 1 << 40).nbytes == 16 * MiB  # 80% of MemAvailable, in 2 MiB units


def test_a_full_ramdisk_is_left_alone_and_a_crashed_prewarms_file_removed(tmpfs: Callable[..., Path]):
    disk = tmpfs("8m", huge="never")
    (disk / PREWARM_FILE).write_bytes(b"\0" * MiB)  # a driver killed while prewarming (older version)
    (disk / "job").write_bytes(b"\1" * (7 * MiB))
    done = prewarm(disk, 1 << 40)
    assert (done.nbytes, done.seconds) == (0, 0.0)
    assert os.listdir(disk) == ["job"]


def test_a_memory_limit_of_the_drivers_cgroup_bounds_it(
    tmpfs: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
):
    """tmpfs pages are charged to their writer's cgroup: a prewarm past the container's memory limit
    would get the driver OOM-killed."""
    disk = tmpfs("64m", huge="never")
    monkeypatch.setattr(prewarm_module, "cgroup_room", lambda: 9 * MiB)
    assert prewarm(disk, 1 << 40).nbytes == 8 * MiB


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_room_is_the_tightest_limit_up_the_v2_hierarchy_or_the_v1_limit(tmp_path: Path):
    from tierckpt_csi.prewarm import CGROUP_MARGIN, cgroup_room

    sys_root = tmp_path / "sys"
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/driver\n")
    _write(sys_root / "kubepods/pod1/driver/memory.max", "max\n")
    _write(sys_root / "kubepods/pod1/driver/memory.current", "100\n")
    _write(sys_root / "kubepods/pod1/memory.max", f"{300 * MiB}\n")
    _write(sys_root / "kubepods/pod1/memory.current", f"{100 * MiB}\n")
    _write(sys_root / "kubepods/memory.max", f"{10_000 * MiB}\n")
    _write(sys_root / "kubepods/memory.current", f"{9_000 * MiB}\n")
    assert cgroup_room(proc, sys_root) == 200 * MiB - CGROUP_MARGIN  # the pod's limit is the tightest
    (sys_root / "kubepods/pod1/memory.max").write_text("max\n")
    (sys_root / "kubepods/memory.max").write_text("max\n")
    assert cgroup_room(proc, sys_root) is None
    proc.write_text("4:memory:/job\n0::/\n")
    _write(sys_root / "memory/job/memory.limit_in_bytes", f"{256 * MiB}\n")
    _write(sys_root / "memory/job/memory.usage_in_bytes", f"{16 * MiB}\n")
    assert cgroup_room(proc, sys_root) == 240 * MiB - CGROUP_MARGIN
    (sys_root / "memory/job/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_room(proc, sys_root) is None
