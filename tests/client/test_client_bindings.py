"""Restore bindings: a load into a destination of the same structure skips the tree walk's tensor work,
and anything that changed in the destination falls back to the walk, with the same result."""

from __future__ import annotations

import collections

import torch

from tests.client.client_helpers import assert_same, training_state
from tierckpt import Checkpointer
from tierckpt.snapshot.bindings import Binding
from tierckpt.snapshot.flatten import flatten


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {
        "model": collections.OrderedDict((f"l{i}.w", torch.randn(64, 32)) for i in range(8)),
        "optim": {"state": {i: {"m": torch.randn(64, 32), "step": torch.tensor(float(i))} for i in range(8)}},
        "pair": (torch.randn(3), torch.randn(4)),
        "list": [torch.randn(5), 7, "x"],
        "step": seed,
    }


def test_a_second_load_into_the_same_dict_is_bound_and_exact(root, job):
    saved = training_state(0)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, saved, blocking=True)
        dest = training_state(1)
        assert ck.load(dest) == 1 and ck.last_load_timings["bound"] == 0.0
        assert_same(saved, dest)
        with torch.no_grad():
            for t in flatten(dest).tensors:
                t.zero_() if t.dtype != torch.bool else t.fill_(False)
        dest["step"] = -1
        assert ck.load(dest) == 1 and ck.last_load_timings["bound"] == 1.0
    assert_same(saved, dest)


def test_loading_back_into_the_dict_that_was_saved_is_bound_from_the_save(root, job):
    state = model_state(0)
    expected = model_state(0)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, state, blocking=True)
        weight = state["model"]["l0.w"]
        weight.add_(1.0)
        state["step"] = 99
        assert ck.load(state) == 1 and ck.last_load_timings["bound"] == 1.0
        assert state["model"]["l0.w"] is weight
    assert_same(expected, state)


def test_a_replaced_tensor_is_filled_and_the_old_one_left_alone(root, job):
    saved = model_state(0)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, saved, blocking=True)
        dest = model_state(1)
        ck.load(dest)
        old = dest["optim"]["state"][3]["m"]
        dest["optim"]["state"][3]["m"] = torch.zeros(64, 32)
        old.fill_(5.0)
        assert ck.load(dest) == 1 and ck.last_load_timings["bound"] == 0.0
        assert torch.equal(old, torch.full((64, 32), 5.0)), "a tensor no longer in the dict is not written"
        assert_same(saved, dest)
        assert ck.load(dest) == 1 and ck.last_load_timings["bound"] == 1.0  # bound again to the new one
    assert_same(saved, dest)


def test_a_resized_or_retyped_tensor_or_a_changed_container_is_not_bound(root, job):
    saved = model_state(0)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, saved, blocking=True)
        dest = model_state(1)
        ck.load(dest)
        dest["model"]["l1.w"].resize_(10)  # (strict=False: such destinations are replaced, not refused)
        assert ck.load(dest, strict=False) == 1 and ck.last_load_timings["bound"] == 0.0
        assert_same(saved, dest)
        dest["model"]["l2.w"].data = dest["model"]["l2.w"].data.double()
        assert ck.load(dest, strict=False) == 1 and ck.last_load_timings["bound"] == 0.0
        assert_same(saved, dest)
        dest["list"] = dest["list"][1:]  # the tensor moved away from index 0
        assert ck.load(dest, strict=False) == 1 and ck.last_load_timings["bound"] == 0.0
        assert_same(saved, dest)
        dest["pair"] = list(dest["pair"])
        assert ck.load(dest) == 1
    assert_same(saved, dest)


def test_another_dict_of_the_same_structure_is_not_written_through_the_binding(root, job):
    saved = model_state(0)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, saved, blocking=True)
        first, second = model_state(1), model_state(2)
        ck.load(first)  # binds first's tensors
        for t in flatten(first).tensors:
            t.fill_(9.0)
        assert ck.load(second) == 1 and ck.last_load_timings["bound"] == 0.0
        assert all(torch.all(t == 9.0) for t in flatten(first).tensors), "first was not written"
    assert_same(saved, second)


def test_a_binding_needs_every_path_to_lead_to_a_tensor():
    state = model_state(0)
    flat = flatten(state, record_paths=True)
    binding = Binding.compile(state, flat.paths)
    assert binding is not None
    assert [t for _, t in binding.resolve(state).tensors] == list(flat.tensors)
    del state["optim"]["state"][5]
    assert binding.resolve(state) is None
    assert Binding.compile(state, flat.paths) is None
    assert Binding.compile({}, {}) is None


def test_another_step_of_the_same_structure_restores_its_own_values_and_any_new_key(root, job):
    state = model_state(0)
    with Checkpointer(root=root, job=job, keep=5) as ck:
        for step, lr in ((1, 0.1), (2, 0.2)):
            state["lr"], state["step"] = lr, step
            state["optim"]["state"][0]["m"].fill_(float(step))
            ck.save(step, state, blocking=True)
        state["extra"] = {"note": "only in step 3"}
        state["optim"]["state"][0]["m"].fill_(3.0)
        ck.save(3, state, blocking=True)
        dest = model_state(9)
        dest["optim"]["state"][0]["m"] = torch.zeros(64, 32)
        assert ck.load(dest, step=1) == 1 and ck.last_load_timings["bound"] == 0.0
        assert ck.load(dest, step=2) == 2 and ck.last_load_timings["bound"] == 1.0
        assert (dest["lr"], dest["step"]) == (0.2, 2) and torch.all(dest["optim"]["state"][0]["m"] == 2.0)
        assert "extra" not in dest
        assert (
            ck.load(dest, step=3) == 3 and ck.last_load_timings["bound"] == 1.0
        )  # tensors bound, tree walked
        assert dest["extra"] == {"note": "only in step 3"} and torch.all(
            dest["optim"]["state"][0]["m"] == 3.0
        )
        dest["step"] = "changed"
        assert ck.load(dest, step=3) == 3 and ck.last_load_timings["bound"] == 1.0
    assert_same(state, dest)


def test_a_load_into_a_module_and_its_optimizer_is_bound(root, job):
    """The README's ``{"model": model, "optim": optimizer}``: ``model.state_dict()`` makes new detached
    tensors over the parameters at every call, so a binding by tensor identity never held and every
    load walked and checked the whole tree; bound by memory, no load is walked after the save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, {"model": model, "optim": optim}, blocking=True)
        for _ in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            assert ck.load({"model": model, "optim": optim}) == 1
            assert ck.last_load_timings["bound"] == 1.0  # (the save bound it already)
            assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
