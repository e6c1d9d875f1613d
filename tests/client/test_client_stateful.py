"""Stateful objects in the state: ``save(step, {"model": model, "optim": optimizer})``, as in the README."""

from __future__ import annotations

import copy

import torch

from tests.client.client_helpers import assert_same
from tierckpt import Checkpointer
from tierckpt.snapshot import stateful


def make(
    seed: int = 0,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]


def test_modules_and_optimizers_are_saved_and_loaded_through_their_state_dicts(root, job):
    model, opt, sched = make()
    train(model, opt, sched, 5, seed=1)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(5, {"model": model, "optim": opt, "sched": sched, "step": 5}, blocking=True)
    expected = copy.deepcopy(
        {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}
    )
    train(model, opt, sched, 3, seed=2)  # the uninterrupted run goes on
    fresh, fresh_opt, fresh_sched = make(seed=7)  # a restarted process: other weights, no optimizer state
    assert not fresh_opt.state
    state = {"model": fresh, "optim": fresh_opt, "sched": fresh_sched, "step": 0}
    with Checkpointer(root=root, job=job) as ck:
        assert ck.load(state) == 5
    assert state["step"] == 5 and state["model"] is fresh  # the objects stay; plain values are replaced
    assert_same(expected["model"], fresh.state_dict())
    assert_same(expected["optim"], fresh_opt.state_dict())
    assert fresh_sched.state_dict() == expected["sched"] and fresh_opt.param_groups[0]["lr"] == 2.5e-3
    train(fresh, fresh_opt, fresh_sched, 3, seed=2)  # resumed: the same three steps, bit for bit
    assert_same(model.state_dict(), fresh.state_dict())
    assert_same(opt.state_dict(), fresh_opt.state_dict())


def test_a_fresh_optimizer_gets_its_state_without_changing_the_model_or_its_settings():
    model, opt, _ = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad for p in model.parameters()]
    stateful.init_state(opt)
    assert len(opt.state) == len(list(model.parameters()))
    assert_same(before, dict(model.state_dict()))
    assert opt.param_groups[0]["lr"] == 1e-2 and [p.grad for p in model.parameters()] == grads
    state = dict(opt.state[next(iter(model.parameters()))])
    stateful.init_state(opt)  # once it has state: nothing happens
    assert state["step"] is opt.state[next(iter(model.parameters()))]["step"]


def test_optimizers_in_the_state_are_registered_for_overlap_mode(root, job):
    model, opt, sched = make()
    train(model, opt, sched, 1, seed=1)
    with Checkpointer(root=root, job=job, overlap=True) as ck:
        ck.save(1, {"model": model, "optim": opt})
        assert opt in ck._optimizers
        expected = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
        train(model, opt, sched, 1, seed=3)  # the pre-step hook waits for the deferred copy
        ck.wait()
        dest: dict = {}
        ck.load(dest, step=1)
    assert_same(expected["model"], dict(dest["model"]))


def test_nothing_to_load_leaves_a_fresh_optimizer_untouched(root, job):
    model, opt, _ = make()
    with Checkpointer(root=root, job=job) as ck:
        assert ck.load({"model": model, "optim": opt}, allow_missing=True) is None
    assert not opt.state
