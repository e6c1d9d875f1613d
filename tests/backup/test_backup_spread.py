"""Upload spreading: one holder per rank, deterministic on every node, balanced over a regular peer plan,
and computable from a node's own neighbourhood of the plan."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt_replicator.backup.spread import assign_uploads

nodes = st.sampled_from([f"node-{i}" for i in range(6)])
holders_st = st.dictionaries(
    st.integers(0, 40), st.lists(nodes, min_size=1, max_size=3, unique=True), max_size=30
)


@settings(deadline=None)
@given(holders=holders_st, step=st.integers(0, 10**6), seed=st.integers())
def test_every_rank_goes_to_one_of_its_holders_whatever_the_order_of_the_ranks(
    holders: dict[int, list[str]], step: int, seed: int
) -> None:
    owner = assign_uploads("job", step, holders)
    assert set(owner) == set(holders)
    assert all(owner[r] in holders[r] for r in holders)
    items = list(holders.items())
    random.Random(seed).shuffle(items)
    assert assign_uploads("job", step, dict(items)) == owner


@settings(deadline=None)
@given(holders=holders_st, step=st.integers(0, 10**6), node=nodes)
def test_a_node_computes_its_ranks_uploaders_from_their_holders_alone(
    holders: dict[int, list[str]], step: int, node: str
) -> None:
    """What a node of a big job knows: the holders of the ranks it holds (its peers.json view)."""
    mine = {r: h for r, h in holders.items() if node in h}
    assert assign_uploads("job", step, mine) == {
        r: n for r, n in assign_uploads("job", step, holders).items() if r in mine
    }


@pytest.mark.parametrize(("nodes_", "per_node", "k"), [(8, 4, 1), (7, 1, 1), (12, 6, 2), (9, 8, 2)])
def test_a_regular_peer_plan_gives_every_node_its_own_number_of_ranks(
    nodes_: int, per_node: int, k: int
) -> None:
    """Every node is the peer of as many nodes as it has peers (the operator's plans): each uploads
    as many ranks as it runs (give or take the holders per rank when that number is not a multiple of
    them)."""
    names = [f"n{i}" for i in range(nodes_)]
    holders = {
        r: [names[(r // per_node + j) % nodes_] for j in range(k + 1)] for r in range(nodes_ * per_node)
    }
    for step in range(0, 50, 7):
        owner = assign_uploads("default_train_abcdef12", step, holders)
        loads = [list(owner.values()).count(n) for n in names]
        exact = per_node % (k + 1) == 0
        assert (loads == [per_node] * nodes_) if exact else (max(loads) - min(loads) <= k + 1)


def test_a_ring_of_replicas_spreads_evenly() -> None:
    nodes_ = [f"n{i}" for i in range(8)]
    holders = {
        r: [nodes_[r // 4], nodes_[(r // 4 + 1) % 8]] for r in range(32)
    }  # 4 ranks per node, 1 replica
    owner = assign_uploads("default_train_abcdef12", 500, holders)
    loads = [list(owner.values()).count(n) for n in nodes_]
    assert loads == [4] * 8


def test_different_steps_spread_differently_but_stay_balanced() -> None:
    holders = {r: ["a", "b"] for r in range(10)}
    owners = [assign_uploads("j", s, holders) for s in range(20)]
    assert all(sorted(list(o.values()).count(n) for n in "ab") == [5, 5] for o in owners)
    assert len({tuple(sorted(o.items())) for o in owners}) > 1


def test_ranks_without_holders_are_left_out() -> None:
    assert assign_uploads("j", 1, {0: [], 1: ["a"]}) == {1: "a"}
