"""Retention planning (tierckpt.planning.retention), pure."""

from __future__ import annotations

import pytest

from tierckpt.planning.retention import plan_retention


def test_keeps_the_newest_n_and_retires_the_rest_oldest_first():
    plan = plan_retention([5, 1, 3, 9], keep=2)
    assert plan.kept == (5, 9) and plan.retire == (1, 3) and plan.held == () and plan.discard == ()


def test_leased_steps_are_held_not_retired():
    plan = plan_retention([1, 2, 3, 4], keep=1, leased={2, 7})
    assert plan.kept == (4,) and plan.held == (2,) and plan.retire == (1, 3)


def test_the_newest_committed_step_always_stays():
    for keep in (1, 2, 5):
        assert 8 in plan_retention([8], keep=keep).kept
    with pytest.raises(ValueError):
        plan_retention([8], keep=0)


def test_uncommitted_leftovers_are_discarded_except_in_flight_or_leased():
    plan = plan_retention([2], keep=1, uncommitted=[1, 3, 4, 5], in_flight=4, leased={5})
    assert plan.discard == (1, 3)


def test_nothing_committed_plans_nothing():
    plan = plan_retention([], keep=2, uncommitted=[])
    assert plan == plan_retention([], keep=3)
    assert plan.kept == plan.retire == plan.held == plan.discard == ()


def test_steps_above_the_one_just_committed_were_superseded():
    """Training went back to step 5 (a restore) and saved 6: 10 and 15 are from before, not newer."""
    plan = plan_retention([5, 6, 10, 15], keep=2, latest=6)
    assert plan.kept == (5, 6) and plan.retire == (10, 15)
    plan = plan_retention([5, 6, 10, 15], keep=2, latest=6, leased={15})
    assert plan.kept == (5, 6) and plan.held == (15,) and plan.retire == (10,)
    assert plan_retention([5, 10], keep=2, latest=7).kept == (5, 10)  # not a committed step: no effect
    assert plan_retention([5, 10, 15], keep=2, latest=15) == plan_retention([5, 10, 15], keep=2)
