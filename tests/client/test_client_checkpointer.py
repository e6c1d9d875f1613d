"""Checkpointer save/load round trips, retention, slot recycling and the public API, on a real tmpfs."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.client.client_helpers import assert_same, training_state
from tierckpt import Checkpointer, MissingCheckpointError, SaveHandle, TierckptError
from tierckpt.protocol.format import CommitMarker, read_manifest, step_dir
from tierckpt.snapshot.pool import SPARE_DIR
from tierckpt.verify import verify_step


def data_inode(ck: Checkpointer, step: int) -> int:
    return os.stat(step_dir(ck.rank_path, step) / "data-00000.bin").st_ino


def test_round_trip_of_a_training_state_is_exact(root, job):
    state = training_state()
    with Checkpointer(root=root, job=job) as ck:
        handle = ck.save(3, state)
        assert isinstance(handle, SaveHandle) and handle.snapshot_done() and handle.step == 3
        marker = handle.wait()
        assert isinstance(marker, CommitMarker) and marker.step == 3 and handle.done() and not handle.skipped
        dest = {}
        assert ck.load(dest) == 3
    assert_same(state, dest)


def test_load_fills_the_callers_tensors_in_place(root, job):
    state = training_state(seed=1)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, state, blocking=True)
        dest = training_state(seed=2)
        weight, exp_avg = dest["model"]["0.weight"], dest["optim"]["state"][0]["exp_avg"]
        assert ck.load(dest) == 1
    assert dest["model"]["0.weight"] is weight and dest["optim"]["state"][0]["exp_avg"] is exp_avg
    assert_same(state, dest)


def test_a_model_and_optimizer_restore_through_their_load_state_dict(root, job):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with Checkpointer(root=root, job=job) as ck:
        ck.save(10, {"model": model.state_dict(), "opt": opt.state_dict()}, blocking=True)
        model2 = torch.nn.Linear(4, 3)
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
        state = {"model": model2.state_dict(), "opt": opt2.state_dict()}
        ck.load(state)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    assert torch.equal(model2.weight, model.weight) and opt2.param_groups[0]["lr"] == 0.1
    assert torch.equal(
        opt2.state[model2.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )


def test_nothing_to_load(root, job):
    with Checkpointer(root=root, job=job) as ck:
        assert ck.latest_step() is None
        assert ck.load({}, allow_missing=True) is None
        with pytest.raises(MissingCheckpointError):
            ck.load({})
        ck.save(1, {"x": torch.zeros(1)}, blocking=True)
        with pytest.raises(MissingCheckpointError):
            ck.load({}, step=2)


def test_retention_keeps_the_newest_n_and_explicit_steps_load(root, job):
    with Checkpointer(root=root, job=job, keep=2) as ck:
        for step in range(1, 6):
            ck.save(step, {"v": torch.full((64,), step)})
        ck.wait()
        assert ck.committed_steps() == [4, 5] and ck.latest_step() == 5
        dest = {}
        assert ck.load(dest, step=4) == 4 and int(dest["v"][0]) == 4


def test_data_files_are_recycled_across_saves(root, job):
    state = {"w": torch.randn(64, 1024), "b": torch.randn(10)}
    inodes = set()
    with Checkpointer(root=root, job=job, keep=2) as ck:
        for step in range(1, 10):
            ck.save(step, state, blocking=True)
            inodes.add(data_inode(ck, step))
        spares = os.listdir(ck.rank_path / SPARE_DIR)
        assert len(spares) == 1  # keep + 1 slots: two retained steps and one spare
        assert len(inodes) == 3, "the same three data files rotate through every step"
        dest = {}
        ck.load(dest)
    assert_same(state, dest)


def test_steady_state_saves_fault_no_pages(root, job):
    state = {"w": torch.randn(8 << 20 >> 2), "small": [torch.randn(100) for _ in range(50)]}  # 8 MiB
    pages = (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    with Checkpointer(root=root, job=job, keep=2) as ck:
        ck.prepare(state)
        for step in range(4):
            ck.save(step, state, blocking=True)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for step in range(4, 8):
            ck.save(step, state, blocking=True)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 0.05 * pages * 4, f"{faults} page faults in 4 steady-state saves of {pages} pages"


def test_a_growing_layout_grows_the_recycled_file(root, job):
    small = {"w": torch.randn(1000)}
    big = {"w": torch.randn(1000), "extra": torch.randn(300_000)}
    with Checkpointer(root=root, job=job, keep=1) as ck:
        for step in range(1, 4):
            ck.save(step, small, blocking=True)
        ck.save(4, big, blocking=True)
        ck.save(5, small, blocking=True)
        dest = {}
        ck.load(dest, step=5)
        assert dest.keys() == small.keys() and torch.equal(dest["w"], small["w"])
        manifest = read_manifest(step_dir(ck.rank_path, 5))
        assert manifest.files[0].size < 300_000  # shrunk back: the file is exactly the layout


def test_resaving_an_existing_step_replaces_it(root, job):
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, {"v": torch.zeros(4)}, blocking=True)
        ck.save(1, {"v": torch.ones(4)}, blocking=True)
        dest = {}
        ck.load(dest)
    assert ck.committed_steps() == [1] and torch.equal(dest["v"], torch.ones(4))


def test_a_new_writer_adopts_spares_and_reads_what_the_last_one_committed(root, job):
    state = {"w": torch.randn(4096)}
    with Checkpointer(root=root, job=job, keep=2) as ck:
        for step in range(1, 5):
            ck.save(step, state, blocking=True)
        spare = next((ck.rank_path / SPARE_DIR).iterdir()) / "data-00000.bin"
        spare_inode = os.stat(spare).st_ino
    with Checkpointer(root=root, job=job, keep=2) as ck:
        dest = {}
        assert ck.load(dest) == 4 and torch.equal(dest["w"], state["w"])
        ck.save(5, state, blocking=True)
        assert data_inode(ck, 5) == spare_inode


def test_one_writer_per_rank(root, job):
    with Checkpointer(root=root, job=job, rank=0, world_size=2):
        with pytest.raises(TierckptError, match="writer"):
            Checkpointer(root=root, job=job, rank=0, world_size=2, writer_lock_timeout=0.2)
        Checkpointer(root=root, job=job, rank=1, world_size=2).close()  # another rank is fine
    Checkpointer(root=root, job=job, rank=0, world_size=2).close()  # released by close()


HOLD_THE_LOCK = """
import sys, time
from tierckpt import Checkpointer
ck = Checkpointer(root=sys.argv[1], job=sys.argv[2], rank=0, world_size=1)
print("holding", flush=True)
time.sleep(600)
"""


def test_a_writer_kept_waiting_names_the_holders_pid_and_command_line(root, job):
    """A process left holding the rank (a torchrun worker after kill -9 on torchrun): the next writer's
    error names its pid, host and command line, which it wrote into the lock file."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(root), job, "--marker=left behind"], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"holding\n"
        with pytest.raises(TierckptError) as err:
            Checkpointer(root=root, job=job, rank=0, world_size=1, writer_lock_timeout=0.2)
        message = str(err.value)
        assert f"pid {holder.pid} on host {os.uname().nodename} (" in message, message
        assert "'--marker=left behind'" in message and " -c " in message, message
        assert "kill -9 on torchrun" in message and "pid namespace" in message
    finally:
        holder.kill()
        holder.wait()
    Checkpointer(root=root, job=job, rank=0, world_size=1, writer_lock_timeout=5).close()  # free again


def test_close_waits_for_the_commit_and_refuses_further_use(root, job):
    ck = Checkpointer(root=root, job=job)
    handle = ck.save(1, {"w": torch.randn(100_000)})
    ck.close()
    assert handle.done() and handle.exception() is None
    ck.close()
    with pytest.raises(RuntimeError, match="closed"):
        ck.save(2, {})


def test_verify_false_and_new_tensors_on_a_device(root, job):
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, {"w": torch.arange(5.0)}, blocking=True)
        dest = {}
        ck.load(dest, verify=False, device="cpu")
    assert torch.equal(dest["w"], torch.arange(5.0))


def test_a_state_without_tensors_round_trips(root, job):
    state = {"epoch": 3, "name": "run", "hist": [0.5, 0.25]}
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, state, blocking=True)
        dest = {}
        ck.load(dest)
        assert read_manifest(step_dir(ck.rank_path, 1)).files == ()
    assert_same(state, dest)


def test_meta_tensors_in_the_destination_are_materialised(root, job):
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, {"w": torch.arange(4.0), "a": np.arange(3)}, blocking=True)
        dest = {"w": torch.empty(4, device="meta")}
        ck.load(dest)
    assert dest["w"].device.type == "cpu" and torch.equal(dest["w"], torch.arange(4.0))
    assert dest["a"].tolist() == [0, 1, 2]


def test_steps_split_over_several_data_files_round_trip_and_recycle(root, job):
    state = {f"t{i}": torch.full((50_000,), float(i)) for i in range(6)}  # 200 kB each
    with Checkpointer(root=root, job=job, keep=1, max_file_bytes=450_000) as ck:
        for step in range(1, 5):
            ck.save(step, state, blocking=True)
        manifest = read_manifest(step_dir(ck.rank_path, 4))
        assert [f.name for f in manifest.files] == [f"data-0000{i}.bin" for i in range(3)]
        verify_step(step_dir(ck.rank_path, 4))
        dest = {}
        ck.load(dest)
    assert_same(state, dest)
