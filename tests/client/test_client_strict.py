"""Strict loading (the default): a destination unlike the checkpoint raises ``StateMismatchError``
naming every difference, before any byte is copied; ``strict=False`` replaces and creates instead."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from tierckpt import Checkpointer, StateMismatchError
from tierckpt.snapshot.compare import mismatches


def model(hidden: int = 8, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])


def saved_state(m: torch.nn.Module) -> dict:
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 8)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "epoch": 3}


@pytest.mark.parametrize(
    ("dest_model", "expected"),
    [
        (lambda: model(hidden=8, layers=3), ["model/2.weight: in the destination, not in the checkpoint"]),
        (lambda: model(hidden=8, layers=1), ["model/1.weight: in the checkpoint, not in the destination"]),
    ],
)
def test_a_model_with_other_layers_is_refused_untouched(root, job, dest_model, expected):
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, saved_state(model()), blocking=True)
        dest = dest_model()
        before = {k: v.clone() for k, v in dest.state_dict().items()}
        with pytest.raises(StateMismatchError) as err:
            ck.load({"model": dest.state_dict()})
    assert [m for m in err.value.mismatches if ".weight" in m] == expected
    assert "strict=False" in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in dest.state_dict().items())  # nothing copied


def test_shape_and_dtype_differences_are_all_named(root, job):
    with Checkpointer(root=root, job=job) as ck:
        ck.save(
            1, {"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64), "c": np.zeros(3)}, blocking=True
        )
        dest = {"a": torch.ones(5), "b": torch.ones(2, dtype=torch.int32), "c": np.ones(3, dtype=np.float32)}
        with pytest.raises(StateMismatchError) as err:
            ck.load(dest)
        assert err.value.mismatches == (
            "a: checkpoint float32 (4,), destination float32 (5,)",
            "b: checkpoint int64 (2,), destination int32 (2,)",
            "c: checkpoint float64 (3,), destination float32 (3,)",
        )
        assert torch.equal(dest["a"], torch.ones(5)) and dest["c"].tolist() == [1, 1, 1]
        assert ck.load(dest, strict=False) == 1  # the old behaviour: mismatched tensors are replaced
    assert torch.equal(dest["a"], torch.zeros(4)) and dest["b"].dtype == torch.int64


def test_state_that_does_not_exist_yet_is_created_in_strict_mode(root, job):
    """An optimizer before its first step, an empty dict, None placeholders: filled, not refused."""
    m = model()
    saved = saved_state(m)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, saved, blocking=True)
        fresh = model()
        opt = torch.optim.AdamW(fresh.parameters())
        dest = {"model": fresh.state_dict(), "optim": opt.state_dict(), "epoch": None}
        assert ck.load(dest) == 1
        opt.load_state_dict(dest["optim"])
        assert ck.load({}) == 1
    assert dest["epoch"] == 3
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved["model"].items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved["optim"]["state"][0]["exp_avg"])


def test_mismatches_is_a_pure_comparison():
    t = torch.zeros
    od = collections.OrderedDict
    assert mismatches({"x": t(2)}, {"x": t(2, device="meta")}) == []
    assert mismatches({"x": None}, {"x": t(2)}) == []  # a placeholder
    assert mismatches({"x": 1.0}, {"x": t(2)}) == ["x: checkpoint float32 (2,), destination float"]
    assert mismatches({"x": [t(1)]}, {"x": [t(1), t(1)]}) == ["x: checkpoint has 2 items, destination 1"]
    assert mismatches({"x": []}, {"x": [t(1), t(1)]}) == []  # an empty list is filled
    assert mismatches({"x": {"k": t(1)}}, {"x": [t(1)]}) == ["x: checkpoint list, destination dict"]
    assert mismatches({"x": {"k": 1}}, {"x": {"j": 2}}) == []  # plain values are state, not structure
    assert mismatches(od(a=t(1)), od(a=t(1), b=t(1))) == ["b: in the checkpoint, not in the destination"]
    assert mismatches({"a": t(1)}, {"a": t(1), "b": t(1)}) == []  # a plain dict is extended
