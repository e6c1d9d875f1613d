"""Pure planning: send targets, replica retention, process ranks of a node, the token bucket."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.planning.common_step import current_ranks, newest_common_step
from tierckpt.protocol.control import PeerAssignment, PeerNode
from tierckpt_replicator.replication.plan import candidate_targets, plan_sends
from tierckpt_replicator.replication.replica_retention import replicas_to_drop
from tierckpt_replicator.replication.throttle import TokenBucket


def assignment(domains: dict[str, str], peers: dict[str, tuple[str, ...]], **kw) -> PeerAssignment:
    return PeerAssignment(
        job="j",
        generation=1,
        nodes={n: PeerNode(name=n, endpoint=f"http://{n}:8470", domain=d) for n, d in domains.items()},
        peers=peers,
        **kw,
    )


A = assignment({"a": "z1", "b": "z2", "c": "z1", "d": "z3"}, {"a": ("b",), "b": ("c",)})


def test_assigned_peers_first_then_other_domains_then_own():
    order = candidate_targets(A, "a")
    assert order[0] == "b"
    assert set(order) == {"b", "c", "d"}
    assert order.index("d") < order.index("c")  # d is in another domain than a, c shares a's


def test_nodes_in_backoff_go_last():
    assert candidate_targets(A, "a", avoid={"b"})[-1] == "b"


def test_plan_sends_only_what_lacks_copies():
    items = plan_sends(
        job="j",
        node="a",
        k=1,
        assignment=A,
        newest={0: 10, 1: 10, 2: 7},
        confirmed={(0, 10): {"b"}},
        in_flight={(2, 7)},
    )
    assert [(i.rank, i.step, i.want) for i in items] == [(1, 10, 1)]
    assert items[0].candidates[0] == "b"


def test_plan_sends_wants_the_remaining_copies():
    items = plan_sends(job="j", node="a", k=3, assignment=A, newest={0: 5}, confirmed={(0, 5): {"d"}})
    assert items[0].want == 2 and "d" not in items[0].candidates


def test_a_copy_on_a_fallback_goes_back_to_the_assigned_peer_once_it_is_out_of_backoff():
    held_by_fallback = {(0, 10): {"d"}}  # "b", a's assigned peer, was down when step 10 was sent
    kw = dict(job="j", node="a", k=1, assignment=A, newest={0: 10}, confirmed=held_by_fallback)
    assert plan_sends(**kw, avoid={"b"}) == []  # still in backoff: the fallback's copy counts
    (item,) = plan_sends(**kw)
    assert (item.candidates, item.want) == (("b",), 1)  # only the assigned peer, never another fallback
    assert plan_sends(**{**kw, "confirmed": {(0, 10): {"b"}}}) == []


def test_plan_sends_nothing_without_other_nodes():
    solo = assignment({"a": ""}, {})
    assert plan_sends(job="j", node="a", k=1, assignment=solo, newest={0: 1}, confirmed={}) == []


def test_retention_keeps_newest_and_the_newest_common_step():
    held = {0: [10, 20, 30, 40], 1: [10, 20]}  # rank 1's 30 and 40 have not arrived yet
    assert newest_common_step(held.values()) == 20
    assert replicas_to_drop(held, keep=1) == {0: [10, 30], 1: [10]}
    assert replicas_to_drop(held, keep=2) == {0: [10]}


def test_a_nodes_current_ranks_are_those_of_the_world_size_it_saved_last():
    # rank 1 of a 3-rank world (left, its step 9 committed at t=100), rank 0 of the 2-rank world now
    assert current_ranks({1: (100.0, 3), 0: (200.0, 2)}) == {0}
    assert current_ranks({0: (100.0, 2), 1: (90.0, 2)}) == {0, 1}, "a rank that lags stays counted"
    assert current_ranks({}) == set()


def test_retention_respects_pins_and_leases():
    held = {0: [1, 2, 3, 4]}
    assert replicas_to_drop(held, keep=1, pinned={2}, leased={0: {1}}) == {0: [3]}


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.integers(0, 4), st.lists(st.integers(0, 50), min_size=1, max_size=6), max_size=4),
    st.integers(1, 3),
)
def test_retention_never_drops_a_ranks_newest_replica(held, keep):
    drop = replicas_to_drop(held, keep=keep)
    for rank, steps in held.items():
        assert max(steps) not in drop.get(rank, [])
        assert len(set(steps)) - len(drop.get(rank, [])) >= min(keep, len(set(steps)))
    common = newest_common_step(held.values())
    if common is not None:
        assert all(common not in d for d in drop.values())


def test_process_ranks_of_a_node():
    a = assignment({"a": "", "b": ""}, {}, node_ranks={"a": 1, "b": 0}, procs_per_node=4)
    assert a.process_ranks("a") == (4, 5, 6, 7)
    assert a.process_ranks("zzz") == ()
    derived = assignment({"a": "", "b": ""}, {}, node_ranks={"a": 1, "b": 0})
    assert derived.process_ranks("a") == ()  # neither procs_per_node nor a world size
    assert derived.process_ranks("a", world_size=6) == (3, 4, 5)
    assert derived.process_ranks("b", world_size=5) == ()  # not divisible: unknown, never guessed


def test_token_bucket_paces_to_the_rate():
    clock = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    bucket = TokenBucket(1000.0, burst=100.0, clock=lambda: clock[0], sleep=sleep)
    for _ in range(10):
        bucket.take(100)
    assert abs(clock[0] - 0.9) < 1e-9  # the first 100 bytes are the burst, 900 more at 1000 B/s
    unlimited = TokenBucket(0)
    unlimited.take(1 << 40)  # returns at once
