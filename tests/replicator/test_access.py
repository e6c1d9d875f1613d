"""Who may do what on a node (``tierckpt_replicator.access``): the operator everything on the control
API, a node only what concerns a job both nodes belong to, as this node knows the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.protocol.api import ENDPOINTS
from tierckpt.protocol.control import PeerAssignment, PeerNode, RestorePlan, Tier, write_control
from tierckpt.protocol.identity import Peer
from tierckpt_replicator.access import JobMembers, api_refusal, data_refusal
from tierckpt_replicator.assignments import AssignmentStore

JOB = "team_train_1234abcd"
ME = "a"


def assign(root: Path, nodes: tuple[str, ...], generation: int = 1, attempt: int = 1) -> None:
    AssignmentStore(root).put(
        PeerAssignment(
            job=JOB,
            generation=generation,
            nodes={n: PeerNode(n, f"https://{n}:8470") for n in nodes},
            peers={nodes[0]: nodes[1:2]},
            attempt=attempt,
        )
    )


@pytest.fixture
def members(tmp_path: Path) -> JobMembers:
    assign(tmp_path, ("a", "b"))
    return JobMembers(tmp_path, AssignmentStore(tmp_path))


def test_members_are_the_assignment_and_the_plans_holders(tmp_path: Path, members: JobMembers) -> None:
    assert members(JOB) == {"a", "b"}
    assert members("other_job") == frozenset()  # no assignment here: nobody
    plan = RestorePlan(
        job=JOB, step=5, world_size=2, sources={0: Tier.PEER}, holders={0: ("d",)}, generation=1
    )
    write_control(tmp_path, JOB, RestorePlan.FILE, plan)
    assert members(JOB) == {"a", "b", "d"}
    assign(tmp_path, ("a", "b"), generation=1795839428974)  # a newer assignment of the plan's attempt
    assert JobMembers(tmp_path, AssignmentStore(tmp_path))(JOB) == {"a", "b", "d"}
    assign(tmp_path, ("a", "b"), generation=1795839428975, attempt=2)  # the next attempt: it names nobody
    assert JobMembers(tmp_path, AssignmentStore(tmp_path))(JOB) == {"a", "b"}


@pytest.mark.parametrize("endpoint", [ep.name for ep in ENDPOINTS if ep.auth])
def test_the_operator_may_call_everything(members: JobMembers, endpoint: str) -> None:
    assert api_refusal(Peer("operator"), endpoint, JOB, members, ME) is None
    assert api_refusal(Peer("operator"), endpoint, None, members, ME) is None


def test_a_node_may_only_read_inventories_of_shared_jobs(members: JobMembers) -> None:
    b, c = Peer.of_node("b"), Peer.of_node("c")
    assert api_refusal(b, "inventory", JOB, members, ME) is None
    assert "not a member" in (api_refusal(c, "inventory", JOB, members, ME) or "")
    assert "not a member" in (api_refusal(b, "inventory", "other_job", members, ME) or "")
    for endpoint in (
        "put_peers",
        "put_policy",
        "put_restore_plan",
        "put_node_plan",
        "backup",
        "restore",
        "purge",
        "status",
        "openapi",
    ):
        assert "may not call" in (api_refusal(b, endpoint, JOB, members, ME) or ""), endpoint
    assert "no tierckpt identity" in (api_refusal(None, "inventory", JOB, members, ME) or "")


@pytest.mark.parametrize("op", ["put", "get", "corrupt"])
def test_the_data_plane_serves_members_as_themselves(members: JobMembers, op: str) -> None:
    b = Peer.of_node("b")
    assert data_refusal(b, op, JOB, "b", members, ME) is None
    assert "claims to be" in (data_refusal(b, op, JOB, "c", members, ME) or "")  # b posing as c
    assert "claims to be" in (data_refusal(b, op, JOB, "", members, ME) or "")
    assert "not a member" in (data_refusal(Peer.of_node("c"), op, JOB, "c", members, ME) or "")
    assert "not a member" in (data_refusal(b, op, "other_job", "b", members, ME) or "")
    assert "may not use the data plane" in (data_refusal(Peer("operator"), op, JOB, "", members, ME) or "")
    assert "may not use the data plane" in (data_refusal(None, op, JOB, "b", members, ME) or "")
    assert "this node itself" in (data_refusal(Peer.of_node(ME), op, JOB, ME, members, ME) or "")
