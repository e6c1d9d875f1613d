"""When a backup is due and which steps retention keeps (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt_replicator.backup.policy import BackupPolicy


def test_first_backup_is_due_when_a_schedule_exists() -> None:
    assert BackupPolicy(interval_steps=100).due(7, newest_complete=None, now=0.0)
    assert not BackupPolicy(interval_steps=0, interval_seconds=0).due(7, newest_complete=None, now=0.0)


def test_step_interval_counts_from_the_newest_complete_backup() -> None:
    p = BackupPolicy(interval_steps=100, interval_seconds=0)
    assert not p.due(199, newest_complete=(100, 0.0), now=1e9)
    assert p.due(200, newest_complete=(100, 0.0), now=0.0)


def test_time_interval_counts_from_the_newest_completion() -> None:
    p = BackupPolicy(interval_steps=0, interval_seconds=600)
    assert not p.due(101, newest_complete=(100, 1000.0), now=1599.0)
    assert p.due(101, newest_complete=(100, 1000.0), now=1600.0)


def test_on_demand_is_always_due_unless_already_backed_up() -> None:
    p = BackupPolicy(interval_steps=0, interval_seconds=0)
    assert p.due(5, newest_complete=None, now=0.0, on_demand=True)
    assert p.due(101, newest_complete=(100, 0.0), in_progress=[(150, 0.0)], now=0.0, on_demand=True)
    assert not p.due(100, newest_complete=(100, 0.0), now=0.0, on_demand=True)


def test_no_new_backup_starts_while_one_is_in_progress_until_it_goes_stale() -> None:
    p = BackupPolicy(interval_steps=10, interval_seconds=0, stale_after=60)
    decision = p.due(300, newest_complete=(100, 0.0), in_progress=[(200, 1000.0)], now=1030.0)
    assert not decision and "200" in decision.reason
    assert p.due(300, newest_complete=(100, 0.0), in_progress=[(200, 1000.0)], now=1060.0)
    assert p.due(300, newest_complete=(100, 0.0), in_progress=[(50, 1000.0)], now=1030.0)  # older: ignored


def test_a_started_backup_is_given_up_only_once_nobody_can_complete_it() -> None:
    p = BackupPolicy(takeover_after=120)
    gone = {"holds_missing": False, "being_uploaded": False}
    assert not p.gives_up(started_at=1000.0, now=1119.0, **gone)  # its holders may still take over
    assert p.gives_up(started_at=1000.0, now=1120.0, **gone)
    assert not p.gives_up(started_at=1000.0, now=5000.0, holds_missing=True, being_uploaded=False)
    assert not p.gives_up(started_at=1000.0, now=5000.0, holds_missing=False, being_uploaded=True)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        BackupPolicy(keep_last=0)
    with pytest.raises(ValueError):
        BackupPolicy(interval_steps=-1)
    with pytest.raises(ValueError):
        BackupPolicy(takeover_after=-1)


def test_keep_last_and_every_window() -> None:
    p = BackupPolicy(keep_last=2, keep_every=1000)
    plan = p.retention([100, 900, 1100, 1500, 2300, 2400, 2500])
    assert plan.keep == (100, 1100, 2300, 2400, 2500)
    assert plan.delete == (900, 1500)


def test_protected_steps_are_kept() -> None:
    plan = BackupPolicy(keep_last=1).retention([1, 2, 3], protect=[1, 99])
    assert plan.keep == (1, 3) and plan.delete == (2,)


@settings(deadline=None)
@given(
    steps=st.sets(st.integers(0, 10_000), max_size=40),
    keep_last=st.integers(1, 5),
    keep_every=st.integers(0, 3000),
    later=st.integers(1, 5000),
)
def test_retention_properties(steps: set[int], keep_last: int, keep_every: int, later: int) -> None:
    p = BackupPolicy(keep_last=keep_last, keep_every=keep_every)
    plan = p.retention(steps)
    assert set(plan.keep) | set(plan.delete) == steps and not set(plan.keep) & set(plan.delete)
    assert set(sorted(steps)[-keep_last:]) <= set(plan.keep)  # the newest N, hence the newest, are kept
    assert list(plan.delete) == sorted(plan.delete)
    if keep_every:
        for window in {s // keep_every for s in steps}:
            assert any(s // keep_every == window for s in plan.keep)
    # A window's keeper stays kept when newer steps arrive (the decision is stable over time).
    if steps and keep_every:
        newer = max(steps) + later
        again = p.retention(steps | {newer})
        windows_kept = {
            min(s for s in steps if s // keep_every == w) for w in {s // keep_every for s in steps}
        }
        assert windows_kept <= set(again.keep)
