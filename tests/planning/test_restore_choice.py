"""restore_choice.choose_restore: the newest step every rank can restore, identical for every caller."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.planning.restore_plan import choose_restore, restorable_steps
from tierckpt.protocol.control import NodeInventory, RankHoldings, Tier
from tierckpt.protocol.errors import ContractError

JOB = "ns_train_abcdef12"


def inv(
    node: str, ranks: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], *, ws: int = 4, gcs=()
) -> NodeInventory:
    steps = {s for local, replica in ranks.values() for s in (*local, *replica)}
    return NodeInventory(
        job=JOB,
        node=node,
        endpoint=f"http://{node}:8470",
        updated_at=123.0,
        ranks={
            r: RankHoldings(local=tuple(sorted(lo)), replica=tuple(sorted(re)))
            for r, (lo, re) in ranks.items()
        },
        world_sizes={s: ws for s in steps},
        gcs=tuple(gcs),
    )


def test_newest_step_held_by_every_rank_wins():
    invs = [
        inv("a", {0: ((10, 20), ()), 1: ((10, 20), ()), 2: ((), (10,)), 3: ((), (10,))}),
        inv("b", {2: ((10,), ()), 3: ((10, 20), ()), 0: ((), (10, 20)), 1: ((), (10,))}),
    ]
    plan = choose_restore(invs)
    assert plan.step == 10  # rank 2 never committed step 20 anywhere
    assert plan.world_size == 4
    assert plan.sources == {0: Tier.LOCAL, 1: Tier.LOCAL, 2: Tier.LOCAL, 3: Tier.LOCAL}
    assert plan.holders[0] == ("a", "b")  # primary holder first, then replica holders
    assert plan.holders[2] == ("b", "a")


def test_a_lost_node_is_covered_by_replicas():
    # node "a" (ranks 0, 1) is gone; "b" holds replicas of its ranks
    b = inv("b", {2: ((30,), ()), 3: ((30,), ()), 0: ((), (30,)), 1: ((), (30,))})
    plan = choose_restore([b])
    assert plan.step == 30
    assert plan.sources[0] == Tier.REPLICA and plan.holders[0] == ("b",)
    assert plan.sources[2] == Tier.LOCAL


def test_bucket_backs_up_what_no_node_holds():
    c = inv("c", {2: ((40, 50), ()), 3: ((40, 50), ())}, gcs=(40,))
    plan = choose_restore([c])
    assert plan.step == 40
    assert plan.sources == {0: Tier.GCS, 1: Tier.GCS, 2: Tier.LOCAL, 3: Tier.LOCAL}
    assert plan.holders[0] == ()


def test_nothing_restorable_means_fresh_start():
    plan = choose_restore([inv("a", {0: ((5,), ())})])
    assert plan.step is None and plan.sources == {}


def test_bucket_only_step_with_unknown_world_size():
    empty = NodeInventory(job=JOB, node="x", endpoint="http://x:1", updated_at=0.0, ranks={}, gcs=(7, 9))
    plan = choose_restore([empty])
    assert plan.step == 9 and plan.world_size == 0 and plan.sources == {}
    plan = choose_restore([empty], world_size=2)
    assert plan.step == 9 and plan.sources == {0: Tier.GCS, 1: Tier.GCS}


def test_world_size_mismatch_and_disagreement_are_skipped():
    a = inv("a", {0: ((10, 20), ()), 1: ((10, 20), ())}, ws=2)
    assert choose_restore([a], world_size=2).step == 20
    assert choose_restore([a], world_size=3).step is None
    # two nodes disagree on the world size of step 20 (a corrupt or mixed step): fall back to 10
    b = NodeInventory(
        job=JOB,
        node="b",
        endpoint="http://b:1",
        updated_at=0.0,
        ranks={0: RankHoldings(replica=(20,))},
        world_sizes={20: 4},
    )
    assert choose_restore([a, b]).step == 10


def test_inventories_of_another_job_are_refused():
    other = NodeInventory(job="other", node="z", endpoint="http://z:1", updated_at=0.0, ranks={})
    with pytest.raises(ContractError):
        choose_restore([inv("a", {}), other])
    with pytest.raises(ContractError):
        choose_restore([])


# ------------------------------------------------------------------------------------------ properties

holdings = st.dictionaries(
    st.integers(0, 3),
    st.tuples(st.sets(st.sampled_from([10, 20, 30, 40])), st.sets(st.sampled_from([10, 20, 30, 40]))),
    max_size=4,
)
cluster = st.lists(
    st.tuples(holdings, st.sets(st.sampled_from([10, 20, 30, 40]), max_size=2)), min_size=1, max_size=4
)


def _build(spec) -> list[NodeInventory]:
    return [
        inv(f"n{i}", {r: (tuple(lo), tuple(re)) for r, (lo, re) in ranks.items()}, gcs=sorted(gcs))
        for i, (ranks, gcs) in enumerate(spec)
    ]


@settings(max_examples=300, deadline=None)
@given(cluster, st.randoms())
def test_same_answer_in_any_order(spec, rnd: random.Random):
    invs = _build(spec)
    shuffled = invs[:]
    rnd.shuffle(shuffled)
    a, b = (
        choose_restore(invs, 4, generation=3, decided_at=1.0),
        choose_restore(shuffled, 4, generation=3, decided_at=1.0),
    )
    assert a == b
    assert a.to_bytes() == b.to_bytes()


@settings(max_examples=300, deadline=None)
@given(cluster)
def test_chosen_step_is_restorable_and_none_newer_is(spec):
    invs = _build(spec)
    plan = choose_restore(invs, 4)
    gcs = {s for i in invs for s in i.gcs}

    def covered(step: int, rank: int) -> bool:
        return step in gcs or any(
            step in (*i.ranks[rank].local, *i.ranks[rank].replica) for i in invs if rank in i.ranks
        )

    all_steps = {s for i in invs for h in i.ranks.values() for s in (*h.local, *h.replica)} | gcs
    restorable = {s for s in all_steps if all(covered(s, r) for r in range(4))}
    assert plan.step == (max(restorable) if restorable else None)
    if plan.step is not None:
        for rank in range(4):
            tier = plan.sources[rank]
            holders = plan.holders[rank]
            if tier == Tier.GCS:
                assert holders == () and plan.step in gcs
            else:
                assert holders and all(covered(plan.step, rank) for _ in holders)
    assert [s for s, _ in restorable_steps(invs, 4)] == sorted(restorable, reverse=True)


@settings(max_examples=200, deadline=None)
@given(cluster, st.integers(0, 3), st.sampled_from([10, 20, 30, 40]))
def test_more_holdings_never_choose_an_older_step(spec, rank, step):
    invs = _build(spec)
    before = choose_restore(invs, 4).step
    extra = [*invs, inv("extra", {rank: ((step,), ())})]
    after = choose_restore(extra, 4).step
    assert (after or -1) >= (before or -1)


def fragments(node: str, held: dict[int, tuple[int, int]], *, ws: int = 2, gcs=()) -> NodeInventory:
    """A node holding, for step 30, fragment ``index`` (of a k-of-n code) of each rank in ``held``."""
    return NodeInventory(
        job=JOB,
        node=node,
        endpoint=f"http://{node}:8470",
        updated_at=1.0,
        ranks={r: RankHoldings(fragments={30: index_k}) for r, index_k in held.items()},
        world_sizes={30: ws},
        gcs=tuple(gcs),
    )


def test_a_rank_with_k_distinct_fragments_is_rebuilt_from_them_before_the_bucket():
    invs = [
        inv("a", {0: ((30,), ())}, ws=2),
        fragments("b", {1: (0, 2)}, gcs=(30,)),
        fragments("c", {1: (3, 2)}),
        fragments("d", {1: (3, 2)}),  # a second copy of fragment 3 adds nothing
    ]
    plan = choose_restore(invs)
    assert (plan.step, plan.sources) == (30, {0: Tier.LOCAL, 1: Tier.ERASURE})
    assert plan.holders[1] == ("b", "c", "d")
    plan = choose_restore(invs[:3])
    assert plan.sources[1] == Tier.ERASURE and plan.holders[1] == ("b", "c")


def test_fewer_than_k_fragments_restore_nothing_but_the_bucket():
    invs = [inv("a", {0: ((30,), ())}, ws=2), fragments("c", {1: (3, 2)}), fragments("d", {1: (3, 2)})]
    assert restorable_steps(invs) == []
    plan = choose_restore([*invs, fragments("b", {}, gcs=(30,))])
    assert (plan.step, plan.sources[1], plan.holders[1]) == (30, Tier.GCS, ())
