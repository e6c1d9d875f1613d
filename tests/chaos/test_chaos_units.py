"""The chaos harness's pure parts: the seeded schedule, the invariants, the reference, the shrinker."""

from __future__ import annotations

import argparse
import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierckpt.planning.goodput import SoakFailure, compare
from tierckpt.protocol.control import RestorePlan, write_control
from tierckpt_demo.chaos.__main__ import parse_duration
from tierckpt_demo.chaos.jobs import JobRun
from tierckpt_demo.chaos.operator import Operator
from tierckpt_demo.chaos.oracle import (
    Held,
    committed_everywhere,
    heal_gaps,
    lost_work,
    newest_restorable,
    retention_excess,
)
from tierckpt_demo.chaos.reference import Anchor, Reference
from tierckpt_demo.chaos.rig import NetState
from tierckpt_demo.chaos.schedule import KINDS, Fault, Round, Schedule, fault_kind, plan_round, plan_rounds
from tierckpt_demo.chaos.shrink import ddmin, shrink
from tierckpt_demo.chaos.soak import soak_result
from tierckpt_demo.launcher import Launcher, LauncherEvent
from tierckpt_demo.training import EventLog, TrainerEvent, read_events
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.restore.stage import published_plan

EVERY = 3


# ------------------------------------------------------------------------------ the schedule


def test_a_seed_draws_the_same_schedule_every_time_and_another_seed_another() -> None:
    a, b = plan_rounds(7, 6, every=EVERY), plan_rounds(7, 6, every=EVERY)
    assert a == b and a.to_bytes() == b.to_bytes()
    assert plan_rounds(8, 6, every=EVERY) != a
    # a longer run starts with the same rounds: a run of any length is a prefix of the seed's sequence
    assert plan_rounds(7, 9, every=EVERY).rounds[:6] == a.rounds


def test_every_kind_is_drawn_once_in_each_deck_of_faults() -> None:
    for seed in (1, 2, 3):
        for deck in range(4):
            drawn = [fault_kind(seed, deck * len(KINDS) + i) for i in range(len(KINDS))]
            assert sorted(drawn) == sorted(KINDS), (seed, deck)


def test_rounds_are_whole_checkpoint_intervals_with_faults_in_order() -> None:
    schedule = plan_rounds(11, 20, every=EVERY, faults=(2, 5))
    for rnd in schedule.rounds:
        assert rnd.steps % EVERY == 0 and rnd.steps >= 3 * EVERY
        assert 2 <= len(rnd.faults) <= 5
        assert [f.at for f in rnd.faults] == sorted(f.at for f in rnd.faults)
        assert all(0 < f.at < rnd.steps for f in rnd.faults)
        assert all(f.job == "dcp" for f in rnd.faults if f.kind == "resize")
    assert {f.kind for r in schedule.rounds for f in r.faults} == set(KINDS)


def test_a_schedule_survives_its_file_and_a_bad_one_is_refused() -> None:
    schedule = plan_rounds(5, 3, every=EVERY)
    assert Schedule.from_bytes(schedule.to_bytes()) == schedule
    with pytest.raises(ValueError, match="mode 'sideways'"):
        Fault(kind="partition", mode="sideways", job="native", at=1)
    assert plan_round(5, 1, len(schedule.rounds[0].faults), every=EVERY) == schedule.rounds[1]


# ------------------------------------------------------------------------------ the invariants


def _held(node: str, rank: int, step: int, world: int = 2, replica: bool = False) -> Held:
    return Held(node=node, rank=rank, step=step, world=world, replica=replica)


def test_the_newest_restorable_step_needs_every_rank_on_a_live_node_or_the_bucket() -> None:
    copies = [
        _held("a", 0, 10),
        _held("b", 1, 10),
        _held("a", 0, 20),
        _held("c", 1, 20, replica=True),  # rank 1's only copy of 20 is on c
        _held("b", 1, 30),
    ]
    assert newest_restorable(copies, {}, ["a", "b", "c"], 2) == 20
    assert newest_restorable(copies, {}, ["a", "b"], 2) == 10, "c left the job: its copy does not count"
    assert newest_restorable(copies, {30: 2}, ["a", "b"], 2) == 30, "complete in the bucket"
    assert newest_restorable(copies, {40: 3}, ["a", "b"], 2) == 10, "another world size: not for this job"
    assert newest_restorable(copies, {40: 3}, ["a", "b"], None) == 40, "a job that reshards takes it"
    assert newest_restorable([], {}, ["a"], 2) is None
    # a step whose ranks were saved with different world sizes is restorable under neither
    mixed = [_held("a", 0, 50, world=2), _held("b", 1, 50, world=3), _held("b", 2, 50, world=3)]
    assert newest_restorable(mixed, {}, ["a", "b"], None) is None


def test_lost_work_is_at_most_one_interval_and_the_save_in_flight() -> None:
    assert lost_work(last=23, committed=21, every=3) == ""
    assert lost_work(last=26, committed=21, every=3) == ""  # killed while step 24 committed
    assert "6 steps lost" in lost_work(last=27, committed=21, every=3)
    assert lost_work(last=5, committed=None, every=3) == ""
    assert "6 steps lost" in lost_work(last=6, committed=None, every=3)


def test_what_a_crash_keeps_is_the_newest_step_whole_in_primaries_of_any_world_that_reshards() -> None:
    """A DCP job that grew from 2 nodes to 3 and restored step 24 (saved by 2 ranks) holds step 24 and
    nothing on its new node: a crash then keeps step 24, not nothing (the harness counted 24 steps of
    lost work for it: found by the soak, seed 2076574236)."""
    grown = [_held("a", 0, 24), _held("b", 1, 24), _held("c", 0, 21, replica=True)]
    assert committed_everywhere(grown, ["a", "b", "c"], None) == 24
    assert committed_everywhere(grown, ["a", "b", "c"], 3) is None, "a job that does not reshard"
    assert committed_everywhere([_held("a", 0, 24), _held("b", 1, 24, replica=True)], ["a", "b"], 2) is None


def test_a_resharded_job_keeps_the_step_it_holds_as_replicas_of_the_ranks_of_a_node_it_left() -> None:
    """A DCP job on a, b, c (step 72, 3 ranks) shrank to b and c and restored 72 there, reading rank 0
    (whose primary stays on a, the node it left) from b's replica store; it trained no further. A crash
    then keeps step 72: the harness counted 72 steps of lost work for it, though the job restored 72 at
    once (soak, seed 1212452211, rounds 6 and 31)."""
    copies = [
        _held("a", 0, 72, world=3),
        _held("b", 1, 72, world=3),
        _held("c", 2, 72, world=3),
        _held("b", 0, 72, world=3, replica=True),
        _held("c", 1, 69, world=3, replica=True),
    ]
    assert committed_everywhere(copies, ["b", "c"], None) == 72
    assert committed_everywhere(copies[1:4], ["c"], None) is None, "rank 0 and 1's copies are on b"
    # a job that does not reshard restores its own ranks' primaries: a replica does not stand for one
    assert committed_everywhere(copies, ["b", "c"], 3) is None


def test_healing_counts_copies_of_each_ranks_newest_step_on_other_nodes_of_the_job() -> None:
    newest = {0: ("a", 12), 1: ("b", 12)}
    copies = [
        _held("b", 0, 12, replica=True),
        _held("a", 1, 9, replica=True),  # an older step does not count
        _held("z", 1, 12, replica=True),  # nor does a node outside the job
    ]
    gaps = heal_gaps(newest, copies, ["a", "b", "c"], factor=1)
    assert gaps == ["rank 1 step 12: 0/1 copies (none)"]
    assert heal_gaps(newest, [*copies, _held("c", 1, 12, replica=True)], ["a", "b", "c"], 1) == []
    # a factor above what the job's other nodes can hold asks for all of them
    assert heal_gaps({0: ("a", 12)}, [_held("b", 0, 12, replica=True)], ["a", "b"], factor=2) == []


def test_retention_allows_its_documented_exceptions_and_no_more() -> None:
    primaries = [_held("a", 0, s) for s in range(1, 6)]
    assert retention_excess(primaries, keep=2, replica_keep=2) == []
    leak = [_held("a", 0, s) for s in range(1, 7)]
    (problem,) = retention_excess(leak, keep=2, replica_keep=2)
    assert "a: rank 0 holds 6 primaries" in problem


def test_the_reference_knows_saved_states_and_replayed_losses() -> None:
    ref = Reference()
    ref.saving("job", 0, 6, "s6")
    assert ref.restored_ok("job", 0, 6, "s6") == ""
    assert "saved as s6" in ref.restored_ok("job", 0, 6, "other")
    assert "no save was announced" in ref.restored_ok("job", 1, 6, "s6")
    first = [Anchor(6, "s6", 2)]
    assert ref.loss(first, 7, 0.5) == ""
    assert ref.loss(first, 7, 0.5) == "" and ref.compared == 1
    assert "an earlier run from the same state computed 0.5" in ref.loss(first, 7, 0.25)
    assert ref.loss([Anchor(6, "s6", 3)], 7, 0.25) == "", "another world size is another computation"


def test_network_effects_of_overlapping_faults_add_up() -> None:
    a = NetState(cut_from={"n1"}, loss=5, rate_in=2000)
    b = NetState(refuse_from={"n2"}, loss=20, rate_in=500, rate_out=800)
    merged = a.merge(b)
    assert merged == NetState({"n1"}, False, {"n2"}, 20, 500, 800, 0)
    assert NetState().merge(NetState()) == NetState()


# ------------------------------------------------------------------------------ the shrinker


def test_ddmin_finds_a_minimal_failing_subset() -> None:
    tried: list[list[int]] = []

    def fails(items: list[int]) -> bool:
        tried.append(items)
        return 3 in items and 7 in items

    assert ddmin(list(range(12)), fails, lambda: False) == [3, 7]
    assert ddmin(list(range(5)), lambda items: True, lambda: False) == []
    assert ddmin(list(range(5)), fails, lambda: True) == list(range(5)), "no time: unchanged"


def test_shrink_keeps_the_rounds_and_faults_a_failure_needs() -> None:
    schedule = plan_rounds(3, 6, every=EVERY, faults=(3, 4))
    culprit = schedule.rounds[4].faults[1]

    def fails(candidate: Schedule) -> bool:
        return any(f == culprit for r in candidate.rounds for f in r.faults)

    minimal = shrink(schedule, fails, lambda: False)
    assert [f for r in minimal.rounds for f in r.faults] == [culprit]
    assert len(minimal.rounds) == 1 and minimal.rounds[0].steps == schedule.rounds[4].steps
    assert "shrunk from seed 3" in minimal.note
    assert dataclasses.replace(minimal, note="") == Schedule(
        seed=3, rounds=(Round(minimal.rounds[0].steps, (culprit,)),)
    )


def test_durations_read_as_seconds() -> None:
    assert parse_duration("90") == 90 and parse_duration("90s") == 90
    assert parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("an hour")


# ------------------------------------------------------------------------------ the soak result


def _launch(folder: Path, rank_events: dict[int, list[TrainerEvent]]) -> None:
    folder.mkdir(parents=True)
    for rank, events in rank_events.items():
        (folder / f"events-rank-{rank:05d}.jsonl").write_bytes(b"".join(e.to_bytes() + b"\n" for e in events))


def _trained(rank: int, t0: float, steps: range, saves: tuple[int, ...]) -> list[TrainerEvent]:
    out = []
    for i, step in enumerate(steps):
        out.append(TrainerEvent("step", rank, t0 + i, step=step, loss=0.5))
        if step in saves:
            out.append(TrainerEvent("saved", rank, t0 + i, step=step, seconds=0.1))
    return out


def test_a_runs_launches_give_its_wall_and_useful_time_and_each_failures_cost(tmp_path: Path) -> None:
    """Round 1 trains steps 1-9 and holds; round 2 restores 9 locally, trains to 14 and is killed; the
    next launch restores 12 (rank 1 from a peer, in 2 s) 5 s after the kill and trains to 20."""
    job, runs = "chaos-native-1-0", tmp_path / "launches"
    for index, (restore, tiers, steps, saves, held) in enumerate(
        [
            ((0.0, None, 0.0), ("none", "none"), range(1, 10), (3, 6, 9), True),
            ((100.0, 9, 0.5), ("local", "local"), range(10, 15), (12,), False),
            ((110.0, 12, 2.0), ("local", "peer"), range(13, 21), (15, 18), True),
        ],
        start=1,
    ):
        at, step, seconds = restore
        events = {}
        for rank in (0, 1):
            mine = [
                TrainerEvent("start", rank, at - 1),
                TrainerEvent("restored", rank, at, step=step, tier=tiers[rank], seconds=seconds),
                *_trained(rank, at + 1, steps, saves),
            ]
            if held:
                mine.append(TrainerEvent("held", rank, at + 100))
            events[rank] = mine
        _launch(runs / f"launch-{index:05d}-{job}", events)
    _launch(runs / "launch-00009-chaos-dcp-1-0", {0: _trained(0, 0.0, range(1, 50), ())})  # another job's

    soak = soak_result(runs, job, backup_every=6, factor=1)
    assert soak is not None
    assert soak.wall_s == pytest.approx(9 + 5 + 13)  # held time left out; the failure's downtime counted
    assert soak.useful_s == pytest.approx(20)  # steps 13 and 14 were trained twice, counted once
    assert (soak.interval_s, soak.backup_interval_s, soak.saves, soak.save_s) == (3, 6, 6, pytest.approx(0.1))
    assert soak.failures == (SoakFailure(tier="peer", lost_work_s=2, restart_s=3, restore_s=2),)
    assert compare(soak).observed == pytest.approx(20 / 27)


def test_events_read_while_a_trainer_writes_them_are_the_complete_lines(tmp_path: Path) -> None:
    """The harness reads a rank's events while the trainer appends to them: a line caught half written
    is not an event yet (it raised, and the harness stopped the soak: seed 523775774), and a torn line
    in the middle (a kill) is skipped."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=0)
    log.emit("step", step=1, loss=0.5)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"kind":"tierckpt_demo-trainer-event","version":1,"event":"st\n' + whole)
    with open(path, "ab") as f:
        f.write(whole[: len(whole) // 2])
    assert [(e.event, e.step) for e in read_events(path)] == [("step", 1), ("step", 1)]


def test_a_pid_the_launcher_uses_again_is_a_running_process_not_the_one_that_exited() -> None:
    """The launcher forks thousands of trainers; pids wrap at 32768 on the shared VM. A new trainer
    given the pid of one killed earlier read as exited with its status (-9), and the harness counted an
    attempt failed with no fault in force (the soak, seed 1123556854)."""
    launcher = Launcher.__new__(Launcher)
    launcher._lock = threading.Condition()
    launcher._started, launcher._exited, launcher._ready = [], {}, False
    events = [
        LauncherEvent(event="started", pid=4242),
        LauncherEvent(event="exited", pid=4242, status=-9),
        LauncherEvent(event="started", pid=4242),
    ]
    lines = [ev.to_bytes() + b"\n" for ev in events]
    launcher.proc = SimpleNamespace(stdout=iter(lines))  # type: ignore[assignment]
    launcher._read()
    assert launcher.status(4242) is None and launcher._started == [4242, 4242]


# ------------------------------------------------------------------------------ the operator stand-in


class _Replicators:
    """The replicators' API as the harness's operator calls it: what each node was sent."""

    def __init__(self) -> None:
        self.sent: dict[str, list[object]] = {}

    def put_peers(self, endpoint: str, assignment: object, *, node: str) -> object:
        self.sent.setdefault(node, []).append(assignment)
        return assignment

    def put_restore_plan(self, endpoint: str, plan: object, *, node: str) -> object:
        self.sent.setdefault(node, []).append(plan)
        return plan

    def inventory(self, endpoint: str, job: str, *, node: str) -> None:
        return None  # no node holds anything: the plan is a fresh start, its generation is what counts


def test_a_restarted_replicator_stages_the_plan_the_harness_published_for_the_attempt(tmp_path: Path) -> None:
    """Soak seed 1123556854, round 22: the plan's generation was the attempt and the assignment's
    milliseconds, so a replicator restarted while it staged dropped the plan as older and computed its
    own (restored 45, the plan said 48). The plan stands for every assignment of its attempt (a new
    replication factor sends one more), and not for the next attempt's."""
    api = _Replicators()
    nodes = {
        n: SimpleNamespace(
            name=n, endpoint=f"http://10.0.0.{i}:8470", peer_endpoint=f"http://10.0.0.{i}:8471", domain="z"
        )
        for i, n in enumerate(("node-0", "node-1", "node-2"), 1)
    }
    rig = SimpleNamespace(
        cluster=SimpleNamespace(api=api), node=nodes.__getitem__, nodes=list(nodes.values())
    )
    operator = Operator(rig)  # type: ignore[arg-type]
    try:
        job = JobRun("native", list(nodes), tag="t", factor=1)
        store = AssignmentStore(tmp_path)

        def restarted_replicator_stages() -> RestorePlan | None:
            """node-1's replicator after a restart: the newest assignment and plan it was sent."""
            *_, assignment = (m for m in api.sent["node-1"] if not isinstance(m, RestorePlan))
            store.put(assignment)  # type: ignore[arg-type]
            return published_plan(tmp_path, job.job_id, store.get(job.job_id))

        for attempt in (1, 2):
            job.attempt = attempt
            operator.publish_peers(job)
            plan = operator.publish_plan(job)
            write_control(tmp_path, job.job_id, RestorePlan.FILE, plan)
            assert restarted_replicator_stages() == plan
            job.factor = 2  # a new replication factor within the attempt: a newer assignment
            operator.publish_peers(job)
            assert restarted_replicator_stages() == plan
        job.attempt = 3  # the next attempt's node ranks, its plan not decided yet
        operator.publish_peers(job)
        assert restarted_replicator_stages() is None
    finally:
        operator.close()
