"""Replica group dedup decisions (pure): which peers hold an identical member step, which members
differ, which nodes have not reported yet, and how the send plan uses them; and the inventory's view of
steps a real client format wrote (content keys recomputed, a lying record reported as diverged)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tierckpt.protocol.bucket_layout import DataRef, RankBackup
from tierckpt.protocol.control import PeerAssignment, PeerNode, StepContent
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import Manifest, read_manifest
from tierckpt.protocol.replica import ReplicaRecord, content_key, group_id
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.backup.spread import data_rank
from tierckpt_replicator.inventory import InventoryScanner, _facts
from tierckpt_replicator.replication.dedup import awaiting_members, differing, linkable_targets, member_nodes
from tierckpt_replicator.replication.plan import plan_sends, unplaced


def content(rank: int, step: int = 7, key: str = "aa", *, diverged: bool = False) -> StepContent:
    members = (0, 2) if rank % 2 == 0 else (1, 3)
    return StepContent(
        rank=rank,
        step=step,
        copy="local",
        group=f"g{members[0]}",
        members=members,
        content=key,
        diverged=diverged,
        written_bytes=10,
        logical_bytes=10,
    )


def assignment() -> PeerAssignment:
    names = [f"n{i}" for i in range(4)]
    return PeerAssignment(
        job="j",
        generation=1,
        nodes={n: PeerNode(name=n, endpoint=f"http://10.0.0.{i}:1") for i, n in enumerate(names)},
        peers={n: (names[(i + 1) % 4],) for i, n in enumerate(names)},
        node_ranks={n: i for i, n in enumerate(names)},
        procs_per_node=1,
    )


def test_a_peer_holding_the_other_members_identical_step_is_linkable() -> None:
    mine = content(0)
    peers = {
        "n2": (content(2),),  # the other member, same key: linkable
        "n1": (content(1),),  # another group
        "n3": (dataclasses.replace(content(2), step=6),),  # an older step of the member
    }
    assert linkable_targets(mine, "n0", peers) == {"n2": 2}
    assert differing(mine, peers) == {}


def test_members_whose_content_differs_are_never_linked_and_are_reported() -> None:
    mine = content(0)
    assert linkable_targets(mine, "n0", {"n2": (content(2, key="bb"),)}) == {}
    assert differing(mine, {"n2": (content(2, key="bb"),)}) == {2: "n2"}
    # A record that says the save diverged: not linked even with equal keys, on either side.
    assert linkable_targets(mine, "n0", {"n2": (content(2, diverged=True),)}) == {}
    assert linkable_targets(content(0, diverged=True), "n0", {"n2": (content(2),)}) == {}
    assert differing(content(0, diverged=True), {"n2": (content(2),)}) == {2: "n2"}


def test_this_node_and_the_rank_itself_never_count() -> None:
    mine = content(0)
    assert linkable_targets(mine, "n0", {"n0": (content(2),)}) == {}
    assert linkable_targets(mine, "n0", {"n2": (content(0),)}) == {}


def test_nodes_of_members_that_have_not_reported_the_step_are_awaited() -> None:
    mine = content(0)
    members = member_nodes(mine, assignment(), 4)
    assert members == {2: "n2"}
    assert awaiting_members(mine, "n0", members, {}) == {"n2"}
    assert awaiting_members(mine, "n0", members, {"n2": (dataclasses.replace(content(2), step=6),)}) == {"n2"}
    assert awaiting_members(mine, "n0", members, {"n2": (content(2, key="bb"),)}) == set()


def test_the_plan_sends_to_a_linkable_peer_first_with_its_base() -> None:
    two_peers = dataclasses.replace(assignment(), peers={"n0": ("n1", "n2")})
    items = plan_sends(
        job="j",
        node="n0",
        k=1,
        assignment=two_peers,
        newest={0: 7},
        confirmed={},
        linkable={0: {"n2": 2}},
    )
    (item,) = items
    assert item.candidates[0] == "n2" and item.bases == {"n2": 2}
    assert item.candidates[1] == "n1"  # the other assigned peer next, for a full copy if linking fails


def test_a_linkable_fallback_never_goes_before_the_assigned_peer() -> None:
    """The assigned peers are the operator's choice of failure domains: a fallback that could link
    comes first among the fallbacks only."""
    (item,) = plan_sends(
        job="j", node="n0", k=1, assignment=assignment(), newest={0: 7}, confirmed={}, linkable={0: {"n2": 2}}
    )
    assert item.candidates[0] == "n1" and item.candidates[1] == "n2" and item.bases == {"n2": 2}
    (dead,) = plan_sends(
        job="j",
        node="n0",
        k=1,
        assignment=assignment(),
        newest={0: 7},
        confirmed={},
        linkable={0: {"n2": 2}},
        avoid={"n1"},
    )
    assert dead.candidates[0] == "n2" and dead.candidates[-1] == "n1"
    plain = plan_sends(job="j", node="n0", k=1, assignment=assignment(), newest={0: 7}, confirmed={})
    assert plain[0].candidates[0] == "n1" and plain[0].bases == {}


def test_a_copy_off_the_plan_goes_back_to_the_assigned_peer_linked_there_if_it_can() -> None:
    """A fallback took step 7 while the assigned peer n1 was in backoff (the fallback linked it). Once
    n1 is back the copy returns to it, as a link when n1 holds an identical member step, so the upload
    split and the failure-domain pairing find it where the plan puts it; the fallback's copy is surplus.
    (A linked copy left on the fallback left rank 0 without an uploader for 120 s: the demo.)"""
    kw = dict(job="j", node="n0", k=1, assignment=assignment(), newest={0: 7}, confirmed={(0, 7): {"n2"}})
    (item,) = plan_sends(**kw)
    assert (item.candidates, item.want, item.bases) == (("n1",), 1, {})
    (linked,) = plan_sends(**kw, linkable={0: {"n1": 1, "n3": 3}})
    assert (linked.candidates, linked.want, linked.bases) == (("n1",), 1, {"n1": 1})
    assert plan_sends(**kw, avoid={"n1"}) == []  # still in backoff: the fallback's copy stands meanwhile
    placed = {(0, 7): {"n2"}, (1, 7): {"n1"}}  # rank 2 has no copy yet
    newest = {0: 7, 1: 7, 2: 7}
    assert unplaced(node="n0", k=1, assignment=assignment(), newest=newest, confirmed=placed) == {0, 2}
    # factor 2: one copy is short, and the assigned peer goes first
    (item,) = plan_sends(**{**kw, "k": 2})
    assert item.candidates[0] == "n1" and item.want == 1


def _record(manifest: Manifest, key: str) -> ReplicaRecord:
    return ReplicaRecord(
        version=1,
        group=group_id((0, 2)),
        members=(0, 2),
        role="writer",
        source=0,
        node="0" * 32,
        fingerprint="ab",
        diverged=False,
        differs=(),
        content=key,
        written_bytes=manifest.total_bytes,
        logical_bytes=manifest.total_bytes,
    )


def test_the_inventory_recomputes_the_key_and_flags_a_record_that_lies(tmp_path: Path) -> None:
    path = write_step(tmp_path, "j", 0, 1, world_size=4, sizes=(1000,), files=1, seed=1)
    manifest = read_manifest(path)
    assert _facts(manifest).content is None  # saved alone: nothing to report
    assert InventoryScanner(tmp_path, node="n0", endpoint="").holdings("j").contents == ()
    key = content_key(manifest.files, manifest.tensors)
    honest = _facts(dataclasses.replace(manifest, replica=_record(manifest, key))).content
    assert honest is not None and honest.content == key and not honest.diverged
    assert honest.group == group_id((0, 2)) and honest.members == (0, 2)
    lying = _facts(dataclasses.replace(manifest, replica=_record(manifest, "f" * 32))).content
    assert lying is not None and lying.content == key and lying.diverged  # never trusted, never linked


def test_the_data_rank_is_one_member_every_node_agrees_on_and_rotates_over_steps() -> None:
    picks = [data_rank("job", step, (1, 3)) for step in range(64)]
    assert set(picks) == {1, 3}  # both members carry the shard on some steps: the upload load rotates
    assert all(data_rank("job", s, (3, 1)) == p for s, p in enumerate(picks))  # order of members: moot


def test_a_rank_commit_cannot_refer_to_itself() -> None:
    fields = dict(
        job="j",
        step=1,
        rank=2,
        world_size=4,
        commit_size=1,
        commit_crc32c=0,
        manifest_size=1,
        manifest_crc32c=0,
        total_bytes=1,
        saved_at=0.0,
        uploaded_by="n",
        uploaded_at=0.0,
    )
    assert RankBackup(**fields, data=DataRef(rank=0, content="ab")).data == DataRef(rank=0, content="ab")
    with pytest.raises(FormatError):
        RankBackup(**fields, data=DataRef(rank=2, content="ab"))
