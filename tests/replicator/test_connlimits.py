"""Admission of connections (``tierckpt_replicator.connlimits``): per source, in total, and when full
the oldest pending connection of the source holding the most pending ones makes room, never an
authenticated one. The sockets are left out: ``shed`` records which admission was closed."""

from __future__ import annotations

import itertools

import pytest

from tierckpt_replicator.connlimits import Admission, ConnectionLimits


class Table:
    """A ``ConnectionLimits`` and the names of the connections it shed, in order."""

    def __init__(self, total: int, per_source: int, deadline: float = 10.0) -> None:
        self.limits = ConnectionLimits("test", total=total, per_source=per_source, deadline=deadline)
        self.shed: list[str] = []
        self._names = itertools.count()

    def admit(self, source: str) -> tuple[str, Admission | None]:
        name = f"{source}#{next(self._names)}"
        return name, self.limits.admit(source, lambda: self.shed.append(name))


def test_a_source_past_its_share_is_refused_and_others_are_not():
    t = Table(total=10, per_source=2)
    assert all(t.admit("10.0.0.1")[1] for _ in range(2))
    assert t.admit("10.0.0.1")[1] is None
    assert t.admit("10.0.0.2")[1] is not None
    assert (t.limits.open, t.limits.refused, t.shed) == (3, 1, [])


def test_when_full_the_oldest_pending_connection_of_the_fullest_source_makes_room():
    t = Table(total=5, per_source=5)
    a = [t.admit("a") for _ in range(3)]
    b = [t.admit("b") for _ in range(2)]
    _, newcomer = t.admit("c")
    assert newcomer is not None and t.shed == [a[0][0]]  # a holds the most: its oldest goes
    assert a[0][1] is not None and a[0][1].was_shed
    assert t.limits.open == 5 and t.limits.open_from("a") == 2
    t.admit("c")  # a and b now hold two each: the older of their oldest goes (b's first)
    assert t.shed == [a[0][0], a[1][0]]
    a[0][1].release()  # the shed connection's own close later: counted once
    assert t.limits.open == 5 and t.limits.shed == 2
    assert b[0][1] is not None and not b[0][1].was_shed


def test_an_authenticated_connection_is_never_closed_for_a_newcomer():
    t = Table(total=3, per_source=3)
    peer = [t.admit("peer")[1] for _ in range(2)]
    for admission in peer:
        assert admission is not None
        admission.authenticated()
    pod, _ = t.admit("pod")
    _, pod2 = t.admit("pod2")
    assert pod2 is not None and t.shed == [pod]  # the pending one, not the peer's
    pod2.authenticated()
    assert t.admit("pod3")[1] is None  # all authenticated: refused
    assert t.limits.open == 3 and not any(a is not None and a.was_shed for a in peer)


def test_many_hostile_sources_never_displace_a_pending_caller_from_a_source_of_its_own():
    """Ten sources at their share, reconnecting as fast as they are shed: the caller's one pending
    connection stays (it could only go once no source held more pending connections than its own)."""
    t = Table(total=40, per_source=8)
    hostile = [f"10.0.1.{i}" for i in range(10)]
    for source in hostile[:5]:
        for _ in range(8):
            t.admit(source)
    caller, admission = t.admit("10.0.0.99")
    assert admission is not None
    for source in itertools.islice(itertools.cycle(hostile), 2000):
        if t.limits.open_from(source) < 8:
            t.admit(source)
    assert caller not in t.shed and not admission.was_shed and len(t.shed) > 1000
    assert t.limits.open == 40 and t.limits.open_from("10.0.0.99") == 1


@pytest.mark.parametrize(
    ("deadline", "open_before", "expected"),
    [(10.0, 0, 10.0), (10.0, 4, 10.0), (10.0, 5, 2.5), (10.0, 9, 2.5), (2.0, 5, 1.0), (0.5, 5, 0.5)],
)
def test_under_pressure_a_new_connection_gets_a_short_deadline(deadline, open_before, expected):
    t = Table(total=10, per_source=10, deadline=deadline)
    for i in range(open_before):
        t.admit(f"10.0.0.{i}")
    _, admission = t.admit("10.0.1.1")
    assert admission is not None and admission.deadline == expected


def test_release_is_counted_once():
    t = Table(total=2, per_source=2)
    _, first = t.admit("a")
    assert first is not None
    first.authenticated()
    first.release()
    first.release()
    first.authenticated()  # a late call changes nothing
    assert t.limits.open == 0 and t.limits.pending == 0
    assert all(t.admit("a")[1] for _ in range(2)) and t.limits.open == 2
