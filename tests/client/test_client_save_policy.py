"""What save() promises: the snapshot, the busy policy, overlap mode, and failed saves."""

from __future__ import annotations

import threading

import pytest
import torch

import tierckpt.save_writer as save_writer_module
from tierckpt import Checkpointer, SaveInProgressError
from tierckpt.protocol.format import step_dirs


@pytest.fixture
def held_commit(monkeypatch):
    """Make every commit wait until the test sets the returned event (a seam on the commit thread)."""
    release = threading.Event()
    real = save_writer_module.commit_files

    def slow_commit(*args, **kwargs):
        assert release.wait(10), "test never released the commit"
        return real(*args, **kwargs)

    monkeypatch.setattr(save_writer_module, "commit_files", slow_commit)
    return release


def test_the_snapshot_is_taken_when_save_returns(root, job):
    w = torch.arange(1000.0)
    with Checkpointer(root=root, job=job) as ck:
        handle = ck.save(1, {"w": w})
        w.add_(1)  # training continues while the commit runs
        handle.wait()
        dest = {}
        ck.load(dest)
    assert torch.equal(dest["w"], torch.arange(1000.0))


def test_busy_skip_returns_a_skipped_handle(root, job, held_commit):
    with Checkpointer(root=root, job=job, on_busy="skip") as ck:
        first = ck.save(1, {"v": torch.zeros(3)})
        second = ck.save(2, {"v": torch.ones(3)})
        assert second.skipped and second.done() and second.wait() is None and "step 1" in second.skip_reason
        assert not first.done() and first.snapshot_done()
        held_commit.set()
        assert first.wait().step == 1
        assert ck.committed_steps() == [1]


def test_busy_error_raises(root, job, held_commit):
    with Checkpointer(root=root, job=job, on_busy="error") as ck:
        ck.save(1, {"v": torch.zeros(3)})
        with pytest.raises(SaveInProgressError):
            ck.save(2, {"v": torch.zeros(3)})
        held_commit.set()


def test_busy_wait_blocks_until_the_previous_save_committed(root, job, held_commit):
    with Checkpointer(root=root, job=job, on_busy="wait") as ck:
        first = ck.save(1, {"v": torch.zeros(3)})
        returned = threading.Event()
        t = threading.Thread(target=lambda: (ck.save(2, {"v": torch.ones(3)}), returned.set()))
        t.start()
        assert not returned.wait(0.3)
        held_commit.set()
        t.join(10)
        assert returned.is_set() and first.done()
        ck.wait()
        assert ck.committed_steps() == [1, 2]


def test_blocking_save_returns_committed(root, job):
    with Checkpointer(root=root, job=job) as ck:
        handle = ck.save(1, {"v": torch.zeros(3)}, blocking=True)
        assert handle.done() and handle.wait().step == 1


def test_a_failed_commit_leaves_nothing_and_the_next_save_works(root, job, monkeypatch):
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, {"v": torch.zeros(3)}, blocking=True)

        def broken(*args, **kwargs):
            raise OSError("simulated I/O error")

        monkeypatch.setattr(save_writer_module, "commit_files", broken)
        handle = ck.save(2, {"v": torch.ones(3)})
        assert isinstance(handle.exception(), OSError)
        with pytest.raises(OSError, match="simulated"):
            handle.wait()
        assert sorted(step_dirs(ck.rank_path)) == [1]
        monkeypatch.undo()
        ck.save(3, {"v": torch.full((3,), 3.0)}, blocking=True)
        dest = {}
        assert ck.load(dest) == 3 and ck.committed_steps() == [1, 3]


def make_training(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt


def train_step(model, opt):
    opt.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()


def test_overlap_mode_snapshots_the_state_as_of_save_even_as_training_continues(root, job, held_commit):
    model, opt = make_training()
    train_step(model, opt)
    with Checkpointer(root=root, job=job, overlap=True) as ck:
        ck.register_optimizer(opt)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_avg = opt.state[model[0].weight]["exp_avg"].clone()
        handle = ck.save(1, {"model": model.state_dict(), "opt": opt.state_dict()})
        # Parameters and Adam state are copied by the commit thread; held_commit keeps the commit
        # from finishing, but the copy runs before it and the pre-step hook waits for it.
        train_step(model, opt)  # forward mutates BatchNorm buffers, step() mutates parameters
        assert handle.snapshot_done()
        held_commit.set()
        handle.wait()
        dest = {}
        ck.load(dest)
    for key, value in expected.items():
        assert torch.equal(dest["model"][key], value), key
    assert torch.equal(dest["opt"]["state"][0]["exp_avg"], expected_avg)
    assert not torch.equal(model[0].weight, expected["0.weight"])  # training did move on


def test_overlap_without_a_registered_optimizer_copies_before_returning(root, job, caplog):
    model, opt = make_training()
    with Checkpointer(root=root, job=job, overlap=True) as ck:
        expected = model[0].weight.clone()
        ck.save(1, {"model": model.state_dict()})
        train_step(model, opt)
        ck.wait()
        dest = {}
        ck.load(dest)
    assert torch.equal(dest["model"]["0.weight"], expected)
    assert "no optimizer is registered" in caplog.text
