"""Redundancy accounting (pure): the grace for steps still being replicated, lost copies, transitions."""

from __future__ import annotations

from tierckpt.protocol.control import Redundancy
from tierckpt_replicator.replication.redundancy import RedundancyLog, assess


def test_a_fresh_step_is_not_degraded_until_the_grace_passed():
    copies, committed = {0: 0, 1: 2}, {0: 100.0, 1: 50.0}
    assert assess(factor=2, copies=copies, committed_at=committed, now=101.0, grace=2.0) == (2, False)
    assert assess(factor=2, copies=copies, committed_at=committed, now=103.0, grace=2.0) == (0, True)


def test_a_lost_copy_counts_at_once():
    got = assess(factor=1, copies={0: 0}, committed_at={0: 100.0}, now=100.5, grace=2.0, lost={0})
    assert got == (0, True)


def test_surplus_copies_are_reported_as_they_are():
    assert assess(factor=1, copies={0: 2, 1: 3}, committed_at={}, now=0.0, grace=0.0) == (2, False)


def test_the_log_says_when_a_job_degrades_and_heals():
    log = RedundancyLog()
    assert log.update("j", factor=2, copies=2, short=False, now=1.0) == (Redundancy(2, 2), "")
    assert log.update("j", factor=2, copies=1, short=True, now=5.0) == (Redundancy(2, 1, 5.0), "degraded")
    assert log.update("j", factor=2, copies=0, short=True, now=9.0) == (Redundancy(2, 0, 5.0), "")
    assert log.update("j", factor=2, copies=2, short=False, now=12.0) == (Redundancy(2, 2), "healed")
    assert log.update("other", factor=1, copies=1, short=False, now=12.0)[1] == ""
