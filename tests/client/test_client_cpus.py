"""The CPUs background work may use, and its priority: checksum, pre-fault, warm-up and commit threads
run nicer than the training thread, so that it always finds a core to launch its kernels."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tierckpt import Checkpointer
from tierckpt.snapshot import cpus
from tierckpt.snapshot.checksum import crc_pool


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_share_divides_the_cpus_among_the_nodes_trainers(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpus.cpu_share() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert cpus.cpu_share() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cpus.cpu_share() == 16


def test_checksum_threads_run_nicer_than_the_caller():
    mine = _nice()
    theirs = crc_pool().submit(_nice).result()
    assert theirs == min(19, mine + cpus.BACKGROUND_NICE)


def test_pre_fault_threads_run_nicer_and_the_warm_up_and_commit_threads_do_not(root: Path, job: str):
    import torch

    from tierckpt.snapshot.shardfile import _faulters

    seen: dict[str, int] = {}
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, {"w": torch.ones(4)}, blocking=True)
        seen["commit"] = ck._writer._executor.submit(_nice).result()
        seen["warm"] = ck._pool._warmer.submit(_nice).result()
    seen["fault"] = _faulters().submit(_nice).result()
    mine = _nice()
    assert seen == {"commit": mine, "warm": mine, "fault": min(19, mine + cpus.BACKGROUND_NICE)}
