"""Upload spreading: one holder per rank, deterministic on every node, optimally balanced."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt_replicator.backup.spread import assign_uploads

nodes = st.sampled_from([f"node-{i}" for i in range(6)])
holders_st = st.dictionaries(
    st.integers(0, 40), st.lists(nodes, min_size=1, max_size=3, unique=True), max_size=30
)


def _max_load(owner: dict[int, str]) -> int:
    counts: dict[str, int] = {}
    for n in owner.values():
        counts[n] = counts.get(n, 0) + 1
    return max(counts.values(), default=0)


@settings(deadline=None)
@given(holders=holders_st, step=st.integers(0, 10**6), seed=st.integers())
def test_every_rank_goes_to_one_of_its_holders_whatever_the_input_order(
    holders: dict[int, list[str]], step: int, seed: int
) -> None:
    owner = assign_uploads("job", step, holders)
    assert set(owner) == set(holders)
    assert all(owner[r] in holders[r] for r in holders)
    rng = random.Random(seed)
    shuffled_items = list(holders.items())
    rng.shuffle(shuffled_items)
    shuffled = {r: rng.sample(h, len(h)) for r, h in shuffled_items}
    assert assign_uploads("job", step, shuffled) == owner


@settings(max_examples=150, deadline=None)
@given(
    holders=st.dictionaries(
        st.integers(0, 7), st.lists(nodes, min_size=1, max_size=3, unique=True), max_size=8
    )
)
def test_the_busiest_node_uploads_as_little_as_possible(holders: dict[int, list[str]]) -> None:
    owner = assign_uploads("job", 1, holders)
    ranks = sorted(holders)
    best = min(
        (
            _max_load(dict(zip(ranks, choice, strict=True)))
            for choice in itertools.product(*(holders[r] for r in ranks))
        ),
        default=0,
    )
    assert _max_load(owner) == best


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
