"""Node-rank assignment (tierckpt.planning.placement): exactly once, sticky to nodes, same-domain replacement,
stale pods excluded, initial ranks from JobSet indices."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.planning.placement import (
    JobShape,
    Member,
    Placement,
    ReplicatedJob,
    Worker,
    assign_ranks,
    current_members,
)
from tierckpt.protocol.errors import ContractError

# ------------------------------------------------------------------------------------ initial ranks


def test_initial_rank_homogeneous_uses_global_index():
    shape = JobShape((ReplicatedJob("a", 2, 4), ReplicatedJob("b", 3, 4)))
    assert shape.world_size == 20
    assert shape.initial_rank("a", 1, 3, job_global_index=1) == 7
    assert shape.initial_rank("b", 0, 0, job_global_index=2) == 8
    assert shape.initial_rank("b", 2, 1, job_global_index=4) == 17


def test_initial_rank_heterogeneous_falls_back_to_offsets():
    shape = JobShape((ReplicatedJob("driver", 1, 1), ReplicatedJob("workers", 2, 4)))
    assert not shape.homogeneous
    # the global index would say 1*4+0 = 4 for workers-0, but the offset formula gives 1 + 0 = 1
    assert shape.initial_rank("driver", 0, 0, job_global_index=0) == 0
    assert shape.initial_rank("workers", 0, 0, job_global_index=1) == 1
    assert shape.initial_rank("workers", 1, 3, job_global_index=2) == 8


def test_every_pod_of_a_shape_has_a_distinct_initial_rank():
    shape = JobShape((ReplicatedJob("x", 3, 2), ReplicatedJob("y", 1, 5), ReplicatedJob("z", 2, 1)))
    ranks = [
        shape.initial_rank(rj.name, j, c)
        for rj in shape.replicated_jobs
        for j in range(rj.replicas)
        for c in range(rj.parallelism)
    ]
    assert sorted(ranks) == list(range(shape.world_size))


@pytest.mark.parametrize(
    ("rjob", "job", "completion"), [("nope", 0, 0), ("a", 2, 0), ("a", 0, 4), ("a", -1, 0)]
)
def test_initial_rank_rejects_out_of_range(rjob, job, completion):
    shape = JobShape((ReplicatedJob("a", 2, 4),))
    with pytest.raises(ContractError):
        shape.initial_rank(rjob, job, completion)


def test_replicated_job_rejects_bad_parallelism():
    with pytest.raises(ContractError, match="parallelism"):
        ReplicatedJob("a", 1, 0)


# ------------------------------------------------------------------------------------ assignment


def _members(nodes: list[str]) -> list[Member]:
    return [Member(pod=f"p{i}", node=n, initial_rank=i) for i, n in enumerate(nodes)]


def test_first_start_gives_initial_ranks():
    a = assign_ranks(4, _members(["n0", "n1", "n2", "n3"]))
    assert a.ranks == {"p0": 0, "p1": 1, "p2": 2, "p3": 3}
    assert a.nodes == ("n0", "n1", "n2", "n3")
    assert a.fresh == (0, 1, 2, 3) and a.sticky == () and a.moved == ()


def test_restart_on_same_nodes_keeps_ranks_even_when_pods_shuffle():
    prev = {0: Placement("n0"), 1: Placement("n1"), 2: Placement("n2"), 3: Placement("n3")}
    # after a restart the pod with index 0 landed on n3, index 3 on n0, and so on
    a = assign_ranks(4, _members(["n3", "n2", "n1", "n0"]), prev)
    assert a.nodes == ("n0", "n1", "n2", "n3")
    assert a.ranks == {"p0": 3, "p1": 2, "p2": 1, "p3": 0}
    assert a.sticky == (0, 1, 2, 3)


def test_replacement_node_inherits_vacated_rank_in_same_domain():
    prev = {r: Placement(f"n{r}", "A" if r < 2 else "B") for r in range(4)}
    domains = {"n0": "A", "n1": "A", "n3": "B", "new-b": "B", "new-a": "A"}
    # n2 (domain B) is gone; one new node in B and... all four slots are filled
    a = assign_ranks(4, _members(["n0", "new-b", "n1", "n3"]), prev, domains)
    assert a.nodes == ("n0", "n1", "new-b", "n3")
    assert a.moved == (2,)


def test_vacated_rank_prefers_same_domain_over_initial_rank():
    prev = {0: Placement("a0", "A"), 1: Placement("b0", "B")}
    domains = {"a9": "A", "b9": "B"}
    # the pod whose initial rank is 0 landed in B, the one with initial rank 1 in A
    a = assign_ranks(2, [Member("p0", "b9", 0), Member("p1", "a9", 1)], prev, domains)
    assert a.nodes == ("a9", "b9")


def test_delivered_rank_is_kept():
    prev = {0: Placement("n0"), 1: Placement("n1")}
    members = [Member("p0", "n0", 0, rank=1), Member("p1", "n1", 1)]
    a = assign_ranks(2, members, prev)
    assert a.ranks == {"p0": 1, "p1": 0}


def test_assignment_needs_one_member_per_rank():
    with pytest.raises(ContractError, match="exactly 3"):
        assign_ranks(3, _members(["n0", "n1"]))
    with pytest.raises(ContractError, match="duplicate"):
        assign_ranks(2, [Member("p", "n0", 0), Member("p", "n1", 1)])


def test_current_members_drops_stale_pending_and_inactive_pods():
    workers = [
        Worker("old-0", 0, attempt=1, node="n0", rank=0, rank_generation=1),
        Worker("new-0", 0, attempt=2, node="n5"),
        Worker("new-1", 1, attempt=2, node=None),
        Worker("new-2", 2, attempt=2, node="n2", active=False),
        Worker("new-3", 3, attempt=2, node="n3", rank=3, rank_generation=1),
    ]
    attempt, members = current_members(workers, restarts=1)
    assert attempt == 2
    assert [m.pod for m in members] == ["new-0", "new-3"]
    assert members[1].rank is None  # a rank from generation 1 is not carried into generation 2


def test_current_members_trusts_jobset_restarts_over_lagging_pods():
    attempt, members = current_members([Worker("p", 0, attempt=1, node="n0")], restarts=2)
    assert attempt == 2 and members == []


# ------------------------------------------------------------------------------------ properties


@st.composite
def restart_scenarios(draw):
    """A world, its previous placement, and a restart where some nodes were replaced."""
    n = draw(st.integers(1, 40))
    ndom = draw(st.integers(1, 5))
    old_domains = [f"d{draw(st.integers(0, ndom - 1))}" for _ in range(n)]
    previous = {r: Placement(f"old{r}", old_domains[r]) for r in range(n)}
    replaced = draw(st.sets(st.integers(0, n - 1), max_size=n))
    nodes, domains = [], {}
    for r in range(n):
        same_domain = draw(st.booleans())
        node = f"new{r}" if r in replaced else f"old{r}"
        nodes.append(node)
        domains[node] = old_domains[r] if (r not in replaced or same_domain) else f"d{ndom}"
    order = draw(st.permutations(range(n)))
    members = [Member(pod=f"pod{i}", node=nodes[j], initial_rank=i) for i, j in enumerate(order)]
    return n, members, previous, domains, replaced


@settings(max_examples=150, deadline=None)
@given(restart_scenarios())
def test_every_rank_assigned_exactly_once(scenario):
    n, members, previous, domains, _ = scenario
    a = assign_ranks(n, members, previous, domains)
    assert sorted(a.ranks.values()) == list(range(n))
    assert set(a.ranks) == {m.pod for m in members}
    assert sorted(a.sticky + a.moved + a.fresh) == list(range(n))


@settings(max_examples=150, deadline=None)
@given(restart_scenarios())
def test_rank_sticks_to_its_node_across_restart(scenario):
    n, members, previous, domains, replaced = scenario
    a = assign_ranks(n, members, previous, domains)
    for r in range(n):
        if r not in replaced:
            assert a.nodes[r] == f"old{r}"
    assert set(a.moved) == replaced


@settings(max_examples=150, deadline=None)
@given(restart_scenarios())
def test_replacement_stays_in_failure_domain_when_possible(scenario):
    n, members, previous, domains, replaced = scenario
    a = assign_ranks(n, members, previous, domains)
    # count, per domain, vacated ranks and replacement nodes: the matching is maximal per domain
    for d in {p.domain for p in previous.values()}:
        vacated = [r for r in replaced if previous[r].domain == d]
        newcomers = [f"new{r}" for r in replaced if domains[f"new{r}"] == d]
        kept_in_domain = sum(1 for r in vacated if domains[a.nodes[r]] == d)
        assert kept_in_domain == min(len(vacated), len(newcomers))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=30),
    st.integers(0, 3),
)
def test_stale_pods_never_take_a_rank(pods, restarts):
    workers = [
        Worker(f"p{i}", i % 7, attempt=att, node=f"n{i}" if scheduled else None, active=active)
        for i, (att, scheduled, active) in enumerate(pods)
    ]
    attempt, members = current_members(workers, restarts)
    assert attempt == max([restarts, *(w.attempt for w in workers)])
    stale = {w.pod for w in workers if w.attempt < attempt}
    assert not stale & {m.pod for m in members}
