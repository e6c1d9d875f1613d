"""Peer planning (tierckpt.planning.placement.plan_peers): K peers, other domains whenever possible, distinct
domains, balanced, deterministic, and minimal churn when a node is replaced."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.planning.placement import peer_churn, plan_node_peers, plan_peers


def _in_degree(plan, n):
    c = Counter(p for peers in plan for p in peers)
    return [c.get(r, 0) for r in range(n)]


def test_two_zones_peer_across_zones():
    domains = ["a", "a", "a", "b", "b", "b"]
    plan = plan_peers(domains, 1)
    for r, peers in enumerate(plan):
        assert len(peers) == 1 and domains[peers[0]] != domains[r]
    assert _in_degree(plan, 6) == [1] * 6


def test_three_domains_k2_spans_both_other_domains():
    domains = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    plan = plan_peers(domains, 2)
    for r, peers in enumerate(plan):
        assert {domains[p] for p in peers} == {"a", "b", "c"} - {domains[r]}
    assert _in_degree(plan, 12) == [2] * 12


def test_single_domain_falls_back_to_other_nodes():
    plan = plan_peers(["z"] * 5, 2)
    for r, peers in enumerate(plan):
        assert len(set(peers)) == 2 and r not in peers


def test_small_worlds():
    assert plan_peers([], 2) == ()
    assert plan_peers(["a"], 3) == ((),)
    assert plan_peers(["a", "b"], 3) == ((1,), (0,))
    assert plan_peers(["a", "b", "c"], 0) == ((), (), ())


def test_skewed_domains_send_minority_all_it_can_take():
    domains = ["big"] * 9 + ["small"]
    plan = plan_peers(domains, 2)
    for r in range(9):
        # only one node outside 'big': it is always a peer, the other peer must be a 'big' node
        assert 9 in plan[r] and len(set(plan[r])) == 2
    assert all(domains[p] == "big" for p in plan[9])


def test_node_view_and_churn_helpers():
    plan = plan_node_peers({"n1": "a", "n2": "b", "n3": "a", "n4": "b"}, 1)
    assert set(plan) == {"n1", "n2", "n3", "n4"}
    assert all(len(p) == 1 for p in plan.values())
    assert plan_node_peers({"n1": "a", "n2": "b", "n3": "a", "n4": "b"}, 1, plan) == plan
    assert peer_churn([(1,), (0,)], [(1,), (0,)]) == 0
    assert peer_churn([(1,), (0,)], [(2,), (0,)]) == 2


# ------------------------------------------------------------------------------------ properties

worlds = st.integers(1, 5).flatmap(
    lambda nd: st.lists(st.integers(0, nd - 1).map(lambda d: f"z{d}"), min_size=1, max_size=48)
)


@settings(max_examples=200, deadline=None)
@given(worlds, st.integers(0, 4))
def test_peers_are_in_other_domains_whenever_possible(domains, k):
    plan = plan_peers(domains, k)
    n = len(domains)
    want = min(k, n - 1)
    ndomains = len(set(domains))
    for r, peers in enumerate(plan):
        assert len(peers) == want and r not in peers and len(set(peers)) == want
        others = sum(1 for d in domains if d != domains[r])
        outside = [p for p in peers if domains[p] != domains[r]]
        assert len(outside) == min(want, others)
        assert len({domains[p] for p in outside}) == min(len(outside), ndomains - 1)


@settings(max_examples=200, deadline=None)
@given(worlds, st.integers(0, 4))
def test_planning_is_deterministic_and_a_fixed_point(domains, k):
    plan = plan_peers(domains, k)
    assert plan_peers(list(domains), k) == plan
    assert plan_peers(domains, k, plan) == plan


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 4), st.booleans())
def test_equal_domains_are_exactly_balanced(ndomains, per_domain, k, blocked):
    n = ndomains * per_domain
    domains = [f"z{(r // per_domain) if blocked else (r % ndomains)}" for r in range(n)]
    plan = plan_peers(domains, k)
    assert _in_degree(plan, n) == [min(k, n - 1)] * n


@settings(max_examples=200, deadline=None)
@given(worlds, st.integers(1, 3), st.data())
def test_replacing_a_node_changes_only_its_edges(domains, k, data):
    """Ranks stick to nodes, so a replacement inside the domain changes nothing in rank space; one in
    another domain re-plans only the replaced rank and the ranks that sent to it."""
    n = len(domains)
    plan = plan_peers(domains, k)
    r = data.draw(st.integers(0, n - 1))
    assert plan_peers(domains, k, plan) == plan  # same-domain replacement
    moved = list(domains)
    moved[r] = data.draw(st.sampled_from(sorted(set(domains))))
    after = plan_peers(moved, k, plan)
    senders_to_r = {s for s in range(n) if r in plan[s]}
    changed = {s for s in range(n) if set(after[s]) != set(plan[s])}
    had_same = any(domains[p] == domains[s] for s in range(n) for p in plan[s])
    if len(set(moved)) == len(set(domains)) and not had_same:
        assert changed <= {r} | senders_to_r
        assert peer_churn(plan, after) <= 2 * k * (1 + len(senders_to_r))


def test_partners_in_other_domains_come_first_and_stay_balanced() -> None:
    # HSDP on 4 nodes in 2 zones: node ranks 0 and 2 hold one shard, 1 and 3 the other.
    domains = ["a", "b", "a", "b"]
    partners = [(2,), (3,), (0,), (1,)]
    # Members in the same zone: the partner is not taken over another zone (domain rules win).
    assert plan_peers(domains, 1, partners=partners) == plan_peers(domains, 1)
    # Members across zones: each rank's peer is the other member.
    domains = ["a", "a", "b", "b"]
    assert plan_peers(domains, 1, partners=partners) == ((2,), (3,), (0,), (1,))
    # DDP (everyone a partner of everyone): least-loaded partners, so no node receives more than k.
    everyone = [tuple(p for p in range(6) if p != r) for r in range(6)]
    plan = plan_peers(["a", "b", "c"] * 2, 2, partners=everyone)
    loads = [sum(r in ps for ps in plan) for r in range(6)]
    assert all(len(set(ps)) == 2 for ps in plan) and max(loads) <= 3


def test_partners_keep_previous_edges_that_remain() -> None:
    domains = ["a", "b", "a", "b"]
    previous = plan_peers(domains, 2)
    again = plan_peers(domains, 2, previous, partners=[(1,), (0,), (3,), (2,)])
    assert all(len(ps) == 2 for ps in again)
    assert sum(len(set(a) & set(b)) for a, b in zip(previous, again, strict=True)) >= 4
