"""Device staging on the GPU: bit-exact snapshots under immediate mutation, the budget, memory pressure.

Run on the device machine (``pytest -m gpu tests/client``); skipped where there is no GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.protocol.format import read_manifest, step_dir
from tierckpt.snapshot.restore import open_data_files, tensor_views

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def trainer(seed: int = 0, width: int = 2048, depth: int = 8) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """About 128 MiB of fp32 weights (and twice that of Adam state), a BatchNorm mutated by forward."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(width, width) for _ in range(depth)]
    layers.insert(1, torch.nn.BatchNorm1d(width))
    model = torch.nn.Sequential(*layers).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, *, step: bool = True) -> None:
    model(torch.randn(64, 2048, device="cuda")).pow(2).mean().backward()
    if step:
        opt.step()


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    """A CPU copy of every tensor of ``state`` (flattened keys), taken now."""
    out = {}
    for group, tensors in state.items():
        if group == "model":
            out |= {f"model/{k}": v.detach().cpu().clone() for k, v in tensors.items()}
        else:
            for i, s in tensors["state"].items():
                out |= {f"optim/state/{i}/{k}": v.detach().cpu().clone() for k, v in s.items()}
    return out


def assert_saved(ck: Checkpointer, step: int, expected: dict[str, torch.Tensor]) -> None:
    """The committed files of ``step`` hold exactly the bytes of ``expected``."""
    path = step_dir(ck.rank_path, step)
    manifest = read_manifest(path)
    files = open_data_files(path, manifest)
    try:
        views = dict(zip((t.key for t in manifest.tensors), tensor_views(manifest, files), strict=True))
        for key, value in expected.items():
            saved = views[key]
            assert saved.dtype == value.dtype and saved.shape == value.shape, key
            assert torch.equal(saved.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
        del views
    finally:
        for f in files.values():
            f.close()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.mark.parametrize("budget", [0.5, 96 * MIB])
def test_snapshots_are_bit_exact_when_the_optimizer_mutates_at_once(root, job, budget):
    model, opt = trainer()
    with Checkpointer(root=root, job=job, device_staging=True, device_budget=budget) as ck:
        ck.register_optimizer(opt)
        for step in range(1, 7):
            for _ in range(3):
                opt.zero_grad()
                train_step(model, opt)
            opt.zero_grad()
            train_step(model, opt, step=False)  # gradients ready: the next opt.step() mutates at once
            state = state_of(model, opt)
            expected = snapshot(state)
            handle = ck.save(step, state)
            opt.step()  # immediately: the hook orders it after the direct copies, staging covers the rest
            model(torch.randn(64, 2048, device="cuda"))  # forward mutates BatchNorm's running stats
            handle.wait()
            assert_saved(ck, step, expected)
            info = ck.last_snapshot
            assert info["staged_bytes"] + info["direct_bytes"] + info["blocking_bytes"] > 0
        assert info["d2h_gbps"] > 0 and info["window_s"] > 0  # measured by now
        if isinstance(budget, int):
            assert info["staged_bytes"] <= budget and ck._stager.device_bytes <= budget


def test_the_budget_caps_the_staging_memory(root, job):
    model, opt = trainer()
    budget = 40 * MIB
    with Checkpointer(root=root, job=job, device_staging=True, device_budget=budget) as ck:
        ck.register_optimizer(opt)
        for step in range(1, 4):
            opt.zero_grad()
            train_step(model, opt)
            state = state_of(model, opt)
            expected = snapshot(state)
            before = torch.cuda.memory_allocated()
            handle = ck.save(step, state)
            grown = torch.cuda.memory_allocated() - before
            opt.step()
            handle.wait()
            assert_saved(ck, step, expected)
            assert ck._stager.device_bytes <= budget
            assert grown <= budget + ck._packer.device_bytes + MIB
            info = ck.last_snapshot
            assert 0 < info["staged_bytes"] <= budget < info["wanted_bytes"]


def test_under_memory_pressure_it_falls_back_to_overlap_mode_and_says_why(root, job, caplog):
    model, opt = trainer()
    with Checkpointer(root=root, job=job, device_staging=True, device_budget=1.0) as ck:
        ck.register_optimizer(opt)
        opt.zero_grad()
        train_step(model, opt)
        free, _ = torch.cuda.mem_get_info()
        blocker = torch.empty(max(0, free - 64 * MIB), dtype=torch.uint8, device="cuda")  # leave ~64 MiB
        try:
            with caplog.at_level(logging.WARNING, logger="tierckpt.snapshot.devstage"):
                opt.zero_grad()
                train_step(model, opt)
                state = state_of(model, opt)
                expected = snapshot(state)
                handle = ck.save(1, state)
                opt.step()
                handle.wait()
            assert_saved(ck, 1, expected)
            info = ck.last_snapshot
            assert info["staged_bytes"] < info["wanted_bytes"] and info["allowed_bytes"] < 128 * MIB
            assert any("device staging on cuda" in r.message for r in caplog.records)
        finally:
            del blocker
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        opt.zero_grad()
        train_step(model, opt)
        state = state_of(model, opt)
        expected = snapshot(state)
        handle = ck.save(2, state)
        opt.step()
        handle.wait()
        assert_saved(ck, 2, expected)
        assert ck.last_snapshot["staged_bytes"] > 0  # room again: staging resumes


def test_without_a_registered_optimizer_everything_is_staged_or_copied_before_save_returns(root, job):
    model, opt = trainer()
    with Checkpointer(root=root, job=job, device_staging=True) as ck:
        opt.zero_grad()
        train_step(model, opt)
        state = state_of(model, opt)
        expected = snapshot(state)
        handle = ck.save(1, state)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # outside any optimizer: safe, as nothing was left to the hook
        handle.wait()
        assert_saved(ck, 1, expected)
        assert ck.last_snapshot["direct_bytes"] == 0


def test_by_default_everything_is_staged_and_the_state_may_change_once_save_returns(root, job):
    """The README's form: a ``Checkpointer()`` given the model and the optimizer. The whole state fits the
    budget, so it is staged: ``save`` returns with the snapshot taken, no optimizer hook needs to wait,
    and the slot is prepared and the staging buffer drained by the commit thread."""
    model, opt = trainer()
    with Checkpointer(root=root, job=job) as ck:
        for step in range(1, 4):
            opt.zero_grad()
            train_step(model, opt)
            expected = snapshot(state_of(model, opt))
            handle = ck.save(step, {"model": model, "optim": opt})
            assert handle.snapshot_done()
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.0)  # anything may change the state now
            handle.wait()
            assert_saved(ck, step, expected)
            info = ck.last_snapshot
            assert info["staged_bytes"] == info["wanted_bytes"] > 0
            assert info["direct_bytes"] == info["blocking_bytes"] == 0
        assert opt in ck._optimizers  # found in the state, registered


def test_a_save_does_not_wait_for_the_previous_commit_only_for_its_drain(root, job, monkeypatch):
    """The next snapshot is ordered after the previous drain on the GPU: while step 1 still commits
    (its checksums held back here), step 2 is saved, and both steps hold exactly what was saved."""
    import threading

    from tierckpt import save_writer

    gate = threading.Event()
    real = save_writer.commit_files

    def held(*args, **kwargs):  # type: ignore[no-untyped-def]
        gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_writer, "commit_files", held)
    model, opt = trainer()
    with Checkpointer(root=root, job=job) as ck:
        handles, expected = {}, {}
        for step in (1, 2):
            opt.zero_grad()
            train_step(model, opt)
            expected[step] = snapshot(state_of(model, opt))
            handles[step] = ck.save(step, {"model": model, "optim": opt})
        assert not handles[1].done(), "step 2 was saved while step 1 was still committing"
        gate.set()
        for step in (1, 2):
            handles[step].wait()
            assert_saved(ck, step, expected[step])
