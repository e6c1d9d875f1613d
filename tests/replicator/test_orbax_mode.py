"""Orbax mode on one node (``tierckpt_replicator.orbax``): the handshake, adoption and hand-over on real
files, and everything a pod writes into its job directory treated as untrusted input (issue 24).

The pod of job A (in Orbax mode: process 0 of 2) writes what it likes where Orbax's files go:
malformed, oversized and contradicting ``replicator.yaml``, a FIFO or a link by that name, step
directories holding links into job B, links where the replicator writes its answers. Each gets a clear
error (in ``replicator.errors`` or ``replicator.failed``, and the log), nothing of B is read, linked,
written or deleted, and the replicator goes on serving the job. Restore staging is the one boundary
faked here (``Staged``); the real one runs in ``test_orbax_daemon.py`` and ``tests/orbax``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.protocol.control import RestorePlan, RestoreState, Tier, write_control
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import (
    FileEntry,
    Manifest,
    commit_step,
    committed_steps,
    rank_dir,
    read_manifest,
    step_dir,
)
from tierckpt.protocol.orbax import (
    ERRORS,
    FAILED,
    JAX_INIT_INFO,
    MAX_YAML_BYTES,
    PRERESTORE,
    REPLICATOR_YAML,
    OrbaxLayout,
    OrbaxSession,
    parse_replicator_yaml,
)
from tierckpt.protocol.safefs import Beneath
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.orbax import OrbaxJobs
from tierckpt_replicator.orbax import steps as orbax_steps
from tierckpt_replicator.orbax.steps import adopt, materialize
from tierckpt_replicator.orbax_state import OrbaxStore
from tierckpt_replicator.settings import Settings

A, B = "ns_orbax_aaaaaaaa", "ns_victim_bbbbbbbb"
SECRET = b"the weights of job B, which job A must never see"
GOOD_YAML = (
    b"job-name: llama\nframework: orbax\nassume-data-parallelism: 2\nnode-rank: 0\nnodes: 2\n"
    b"peer-ranks: [1]\nbackup-interval-steps: 5"
)


@dataclasses.dataclass
class Staged:
    """Restore staging, as the hand-over sees it (``restore.stage.Stager``'s public state)."""

    plans: dict[str, RestorePlan] = dataclasses.field(default_factory=dict)
    states: dict[str, dict[int, RestoreState]] = dataclasses.field(default_factory=dict)

    started: list[RestorePlan] = dataclasses.field(default_factory=list)

    def running(self, job: str) -> bool:
        return False

    def start_for_plan(self, job: str, plan: RestorePlan) -> None:
        """Staging the plan: done at once, every rank here ready."""
        self.started.append(plan)
        self.plans[job] = plan
        self.states[job] = {0: RestoreState.READY if plan.step is not None else RestoreState.NONE}


@dataclasses.dataclass
class Node:
    root: Path
    jobs: OrbaxJobs
    stager: Staged
    victim: Path

    @property
    def job(self) -> Path:
        return self.root / A

    def scan(self) -> None:
        asyncio.run(self.jobs.scan())

    def session(self, generation: int = 1) -> None:
        session = OrbaxSession(A, "node-a", generation, 0, 2, "10.0.0.1:8476")
        assert asyncio.run(self.jobs.put_session(session)) == (True, session)

    def write(self, name: str, data: bytes) -> None:
        """As Orbax does: a temporary file renamed into place."""
        (self.job / f"{name}.tmp").write_bytes(data)
        os.replace(self.job / f"{name}.tmp", self.job / name)

    def text(self, name: str) -> str:
        return (self.job / name).read_text()

    def victim_intact(self) -> bool:
        return (self.victim / "secret.bin").read_bytes() == SECRET and committed_steps(
            rank_dir(self.root, B, 0)
        ) == [7]

    def plan(self, step: int | None, generation: int = 1, state: RestoreState = RestoreState.READY) -> None:
        """The operator's plan of ``generation``, staged for rank 0 (``state``)."""
        plan = RestorePlan(A, step, 2, {0: Tier.LOCAL, 1: Tier.LOCAL}, generation=generation)
        write_control(self.root, A, RestorePlan.FILE, plan)
        self.stager.plans[A] = plan
        self.stager.states[A] = {0: RestoreState.NONE if step is None else state}


@pytest.fixture
def node(tmp_path: Path) -> Node:
    root = tmp_path / "ramdisk"
    root.mkdir()
    write_step(root, B, 0, 7, sizes=(1000,), seed=3)
    victim = root / B / "private"
    victim.mkdir()
    (victim / "secret.bin").write_bytes(SECRET)
    (root / A).mkdir()
    stager = Staged()
    jobs = OrbaxJobs(
        settings=Settings(node_name="node-a", root=root, orbax_keep=2),
        store=OrbaxStore(root),
        stager=stager,  # type: ignore[arg-type]
        metrics=Metrics(),
        poll=0.01,
    )
    n = Node(root, jobs, stager, victim)
    n.session()
    return n


def orbax_step(where: Path, step: int, *, seed: int = 0) -> dict[str, bytes]:
    """A committed Orbax step as Orbax lays it out (files, nested and empty directories); path -> bytes."""
    files = {
        "_CHECKPOINT_METADATA": b'{"item_handlers": {}}',
        "commit_success.txt": b"",
        "process_metadata/global_process_metadata.json": b"[[0], [1]]",
        "state/manifest.ocdbt": bytes(range(256)) * (seed + 1),
        "state/ocdbt.process_0/d/0a1b2c": os.urandom(3000 + seed),
    }
    base = where / str(step)
    for rel, data in files.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(data)
    (base / "state" / "empty").mkdir()
    return files


def tree_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


async def deliver(node: Node) -> None:
    await node.jobs.scan()
    task = node.jobs._deliveries.get(A)
    if task is not None:
        await asyncio.wait_for(task, 10)


# ------------------------------------------------------------------------------------- the handshake


def test_the_session_writes_jax_init_info_until_orbax_consumed_it(node: Node) -> None:
    node.scan()
    assert node.text(JAX_INIT_INFO) == "0\n10.0.0.1:8476\n"
    node.write(REPLICATOR_YAML, GOOD_YAML)
    node.scan()
    assert not (node.job / REPLICATOR_YAML).exists(), "consumed: Orbax goes on"
    assert not (node.job / JAX_INIT_INFO).exists(), "consumed: a restarted process never reads it again"
    node.scan()
    assert not (node.job / JAX_INIT_INFO).exists(), "not written again in the same attempt"
    run = node.jobs.store.run(A)
    assert (run.generation, run.run, run.schedule) == (1, "llama", (5, 0.0))
    node.session(2)  # the next restart attempt
    node.scan()
    assert node.text(JAX_INIT_INFO) == "0\n10.0.0.1:8476\n"


def test_nothing_to_restore_hands_over_the_empty_marker(node: Node) -> None:
    node.write(REPLICATOR_YAML, GOOD_YAML)
    node.plan(None)
    asyncio.run(deliver(node))
    marker = node.job / "llama-s0-n0-w0.restore"
    assert marker.is_file() and marker.stat().st_size == 0
    assert node.text(PRERESTORE) == "{}\n"


def test_a_step_is_adopted_then_handed_back_bit_exact(node: Node) -> None:
    files = orbax_step(node.job, 3, seed=1)
    node.scan()
    assert committed_steps(rank_dir(node.root, A, 0)) == [3]
    assert not (node.job / "3").exists()
    manifest = read_manifest(step_dir(rank_dir(node.root, A, 0), 3))
    assert manifest.manifest_kind == "orbax" and manifest.world_size == 2
    assert OrbaxLayout.of(manifest).dirs == (
        "process_metadata",
        "state",
        "state/empty",
        "state/ocdbt.process_0",
        "state/ocdbt.process_0/d",
    )
    node.write(REPLICATOR_YAML, GOOD_YAML)
    node.plan(3)
    asyncio.run(deliver(node))
    marker = node.job / "llama-s3-n0-w0.restore"
    assert marker.is_dir() and tree_of(marker) == files and (marker / "state" / "empty").is_dir()
    assert node.text(PRERESTORE) == "restore-step: 3\n"
    os.replace(marker, node.job / "3")  # what Orbax does with it
    node.scan()
    assert (node.job / "3").is_dir(), "the step handed over is not taken for a new save"
    assert committed_steps(rank_dir(node.root, A, 0)) == [3]
    orbax_step(node.job, 4)
    node.scan()
    assert not (node.job / "3").exists(), "once a newer step is saved, the restored one goes"
    assert committed_steps(rank_dir(node.root, A, 0)) == [3, 4]


def test_retention_keeps_the_newest_steps_and_retires_steps_of_an_abandoned_timeline(node: Node) -> None:
    for step in (10, 20, 30):
        orbax_step(node.job, step)
        node.scan()
    assert committed_steps(rank_dir(node.root, A, 0)) == [20, 30]  # --orbax-keep 2
    orbax_step(node.job, 25)  # training went back to an older step: 30 was saved before that
    node.scan()
    assert committed_steps(rank_dir(node.root, A, 0)) == [20, 25]


def test_a_plan_staged_for_another_step_is_staged_again_as_the_operator_published_it(node: Node) -> None:
    """A replicator that restarted computes a plan of its own; the hand-over waits for the operator's."""
    orbax_step(node.job, 3)
    orbax_step(node.job, 4)
    node.scan()
    node.write(REPLICATOR_YAML, GOOD_YAML)
    node.plan(3)
    node.stager.plans[A] = dataclasses.replace(node.stager.plans[A], step=4, generation=1767225600456)
    asyncio.run(deliver(node))
    assert [p.step for p in node.stager.started] == [3]
    assert (node.job / "llama-s3-n0-w0.restore").is_dir()


def test_a_failed_staging_fails_the_run_with_its_reason(node: Node) -> None:
    node.write(REPLICATOR_YAML, GOOD_YAML)
    node.plan(9, state=RestoreState.FAILED)
    asyncio.run(deliver(node))
    assert "step 9 cannot be restored for process 0" in node.text(FAILED)
    assert not list(node.job.glob("*.restore"))


def test_a_plan_of_another_attempt_is_not_handed_over(node: Node) -> None:
    node.write(REPLICATOR_YAML, GOOD_YAML)
    node.plan(None, generation=0)  # the last attempt's plan: this attempt's is not published yet

    async def handshake_then_wait() -> None:
        await node.jobs.scan()
        await asyncio.sleep(0.2)
        assert A in node.jobs._deliveries, "the hand-over waits"
        assert not list(node.job.glob("*.restore"))
        node.plan(None, generation=1)
        await asyncio.wait_for(node.jobs._deliveries[A], 10)

    asyncio.run(handshake_then_wait())
    assert (node.job / "llama-s0-n0-w0.restore").is_file()


# ------------------------------------------------------------------------------- untrusted replicator.yaml


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xff\xfe garbage", "not UTF-8"),
        (b"this is not yaml at all", "line 1: expected 'key: value'"),
        (GOOD_YAML.replace(b"nodes: 2", b"nodes: two"), "nodes must be an integer"),
        (GOOD_YAML.replace(b"node-rank: 0", b"node-rank: -1"), "node-rank must be an integer in 0..1"),
        (GOOD_YAML.replace(b"peer-ranks: [1]", b"peer-ranks: [1, 7]"), "peer-ranks must name distinct"),
        (GOOD_YAML + b"\nnode-rank: 1", "'node-rank' is given twice"),
        (GOOD_YAML.replace(b"framework: orbax\n", b""), "'framework' is missing"),
        (
            GOOD_YAML + b"\nbackup-interval-minutes: 3",
            "both backup-interval-minutes and backup-interval-steps",
        ),
        (b"job-name: x\n" * 1000, "lines, more than"),
        (b"#" * (MAX_YAML_BYTES + 1), "exceeds the limit"),
    ],
)
def test_a_malformed_yaml_is_reported_in_replicator_errors_and_orbax_goes_on(
    node: Node, content: bytes, reason: str
) -> None:
    node.write(REPLICATOR_YAML, content)
    node.scan()
    assert not (node.job / REPLICATOR_YAML).exists(), "released: Orbax reads the error and goes on"
    errors = node.text(ERRORS)
    assert "tierckpt replicator on node-a" in errors and reason in errors, errors
    assert not (node.job / FAILED).exists()
    assert node.jobs.store.run(A).schedule is None, "the job's configured schedule applies"
    node.plan(None)
    asyncio.run(deliver(node))
    assert (node.job / "tierckpt-s0-n0-w0.restore").is_file(), "the handshake is answered all the same"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            (b"node-rank: 0", b"node-rank: 1"),
            "says node-rank 1 of 2 nodes, but this node runs process 0 of 2",
        ),
        ((b"nodes: 2", b"nodes: 3"), "says node-rank 0 of 3 nodes"),
        ((b"framework: orbax", b"framework: pytorch"), "names framework 'pytorch'"),
    ],
)
def test_a_yaml_contradicting_the_session_fails_the_run(
    node: Node, change: tuple[bytes, bytes], reason: str
) -> None:
    node.write(REPLICATOR_YAML, GOOD_YAML.replace(*change))
    node.scan()
    assert reason in node.text(FAILED)
    assert not (node.job / REPLICATOR_YAML).exists()
    node.plan(None)
    asyncio.run(deliver(node))
    assert not list(node.job.glob("*.restore")), "a failed run gets no marker"


def test_a_second_yaml_in_the_same_attempt_fails_the_run(node: Node) -> None:
    node.write(REPLICATOR_YAML, GOOD_YAML)
    node.scan()
    node.write(REPLICATOR_YAML, GOOD_YAML)
    node.scan()
    assert "came again in restart attempt 1" in node.text(FAILED)


def test_a_yaml_linking_to_another_jobs_file_is_refused_and_nothing_of_it_read(node: Node) -> None:
    (node.job / REPLICATOR_YAML).symlink_to(node.victim / "secret.bin")
    node.scan()
    assert not os.path.lexists(node.job / REPLICATOR_YAML), "the link is removed, never followed"
    errors = node.text(ERRORS)
    assert "replicator.yaml refused" in errors and SECRET.decode() not in errors
    assert node.victim_intact()


def test_a_yaml_that_is_a_fifo_or_a_directory_is_refused_without_hanging(node: Node) -> None:
    os.mkfifo(node.job / REPLICATOR_YAML)
    done = threading.Event()

    def run() -> None:
        node.scan()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(10), "reading a FIFO must not hang the replicator"
    assert "not a regular file" in node.text(ERRORS)
    node.session(2)
    (node.job / REPLICATOR_YAML).mkdir()
    (node.job / REPLICATOR_YAML / "x").write_text("y")
    node.scan()
    assert not (node.job / REPLICATOR_YAML).exists()


def test_answers_written_where_a_pod_planted_links_replace_the_links(node: Node) -> None:
    for name in (JAX_INIT_INFO, ERRORS, PRERESTORE):
        (node.job / name).symlink_to(node.victim / "secret.bin")
    node.scan()
    info = node.job / JAX_INIT_INFO
    assert not info.is_symlink() and info.read_text() == "0\n10.0.0.1:8476\n"
    node.write(REPLICATOR_YAML, b"garbage")
    node.plan(None)
    asyncio.run(deliver(node))
    for name in (ERRORS, PRERESTORE):
        assert not (node.job / name).is_symlink() and SECRET not in (node.job / name).read_bytes()
    assert node.victim_intact()


# ------------------------------------------------------------------------------- untrusted step directories


def test_a_step_directory_that_is_a_link_is_not_adopted(node: Node) -> None:
    (node.job / "5").symlink_to(node.victim)
    node.scan()
    assert committed_steps(rank_dir(node.root, A, 0)) == []
    assert node.victim_intact()


@pytest.mark.parametrize("kind", ["file", "directory", "fifo"])
def test_a_step_holding_a_link_or_a_fifo_is_not_adopted_and_nothing_of_the_target_linked(
    node: Node, kind: str
) -> None:
    orbax_step(node.job, 5)
    planted = node.job / "5" / "state" / "planted"
    if kind == "file":
        planted.symlink_to(node.victim / "secret.bin")
    elif kind == "directory":
        planted.symlink_to(node.victim)
    else:
        os.mkfifo(planted)
    node.scan()
    assert committed_steps(rank_dir(node.root, A, 0)) == []
    assert "step 5 is not replicated" in node.text(ERRORS) and "symlink or special file" in node.text(ERRORS)
    linked = [
        p
        for p in (node.root / A).rglob("*")
        if p.is_file() and not p.is_symlink() and p.read_bytes() == SECRET
    ]
    assert linked == [] and node.victim_intact()
    node.scan()
    assert node.text(ERRORS).count("step 5 is not replicated") == 1, "reported once"


def test_a_step_without_orbax_commit_signal_is_not_adopted(node: Node) -> None:
    (node.job / "6" / "state").mkdir(parents=True)
    (node.job / "6" / "state" / "x").write_bytes(b"x")
    node.scan()
    assert committed_steps(rank_dir(node.root, A, 0)) == []


def test_adoption_is_bounded_in_entries(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(orbax_steps, "MAX_ENTRIES", 8)
    orbax_step(node.job, 5)
    for i in range(8):
        (node.job / "5" / f"extra-{i}").write_bytes(b"")
    node.scan()
    assert committed_steps(rank_dir(node.root, A, 0)) == []
    assert "step 5 is not replicated: 5: more than 8 files or directories" in node.text(ERRORS)


def test_adoption_is_bounded_in_depth(node: Node) -> None:
    orbax_step(node.job, 6)
    (node.job / "6" / "/".join(["d"] * 40)).mkdir(parents=True)
    node.scan()
    assert committed_steps(rank_dir(node.root, A, 0)) == []
    errors = node.text(ERRORS)
    assert "not a safe path inside an Orbax step" in errors
    assert str(node.root) not in errors, "the pod is told paths in its own directory, not the node's"


def test_a_manifest_naming_paths_out_of_the_step_is_refused_and_nothing_is_created(node: Node) -> None:
    """A committed step of kind orbax comes from a peer, the bucket or the pod's own rewrite: its layout
    is checked before any path is made."""
    for evil in (["../../escaped"], ["/abs"], ["a/../../escaped"], ["ok", "ok"], ["x\nnewline"]):
        with pytest.raises(FormatError):
            OrbaxLayout(tuple(evil), ())
    with pytest.raises(FormatError):
        OrbaxLayout(("d/x",), ())  # a file in a directory the layout does not list
    rank = rank_dir(node.root, A, 0)
    path = step_dir(rank, 8)
    path.mkdir(parents=True)
    (path / "data-00000.bin").write_bytes(b"payload")
    manifest = Manifest(
        job=A,
        rank=0,
        world_size=2,
        step=8,
        created_at=0.0,
        files=(FileEntry("data-00000.bin", 7, 0),),
        tensors=(),
        manifest_kind="orbax",
        extra={"orbax": {"files": ["../../escaped"], "dirs": []}},
    )
    commit_step(path, manifest)
    with Beneath.open(node.root, A) as tree, pytest.raises(FormatError):
        materialize(tree, 0, 8, job_id=A, limit=1 << 20)
    assert not (node.root / "escaped").exists() and not list(node.job.glob(".orbax-restore-*"))


def test_a_corrupt_file_is_not_handed_over(node: Node) -> None:
    orbax_step(node.job, 3)
    node.scan()
    data = step_dir(rank_dir(node.root, A, 0), 3) / "data-00004.bin"
    data.write_bytes(b"\0" * data.stat().st_size)  # rotted, or rewritten by the pod
    with Beneath.open(node.root, A) as tree, pytest.raises(FormatError, match="does not match its manifest"):
        materialize(tree, 0, 3, job_id=A, limit=1 << 20)
    assert not list(node.job.glob(".orbax-restore-*"))


def test_adopting_a_step_links_no_byte_of_a_step_the_pod_swapped_in(node: Node) -> None:
    """Adoption hard-links exactly what the walk saw as regular files beneath the step, through no link."""
    files = orbax_step(node.job, 5)
    with Beneath.open(node.root, A) as tree:
        got = adopt(tree, "5", job_id=A, rank=0, world_size=2)
    assert got.step == 5 and got.files == len(files)
    copy = step_files(step_dir(rank_dir(node.root, A, 0), 5))
    assert sorted(v for k, v in copy.items() if k.startswith("data-")) == sorted(files.values())
    assert node.victim_intact()


# ------------------------------------------------------------------------------------- the parser, fuzzed

_KEYS = st.sampled_from(
    [
        "job-name",
        "framework",
        "node-rank",
        "nodes",
        "peer-ranks",
        "assume-data-parallelism",
        "backup-interval-minutes",
        "backup-interval-steps",
        "workers-per-node",
        "other",
    ]
)
_VALUES = st.one_of(
    st.integers(-(1 << 70), 1 << 70).map(str),
    st.lists(st.integers(-5, 70), max_size=6).map(str),
    st.text(max_size=40),
)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=600),
        st.lists(st.tuples(_KEYS, _VALUES), max_size=12).map(
            lambda kv: "\n".join(f"{k}: {v}" for k, v in kv).encode("utf-8", "surrogatepass")
        ),
    )
)
def test_the_yaml_parser_refuses_with_format_error_or_returns_a_consistent_config(data: bytes) -> None:
    try:
        config = parse_replicator_yaml(data)
    except FormatError:
        return
    assert 0 <= config.node_rank < config.nodes
    assert all(0 <= r < config.nodes for r in config.peer_ranks)
    assert not (config.backup_interval_minutes and config.backup_interval_steps)
    assert config.job_name.isascii() and config.job_name.isprintable()


def test_the_yaml_orbax_writes_parses() -> None:
    config = parse_replicator_yaml(GOOD_YAML)
    assert (config.job_name, config.node_rank, config.nodes, config.peer_ranks) == ("llama", 0, 2, (1,))
    assert (config.data_parallelism, config.backup_interval_steps) == (2, 5)


# ------------------------------------------------------------------------------------- the backup schedule


def test_backups_follow_the_interval_orbax_asked_for(node: Node) -> None:
    from tierckpt.protocol.control import JobPolicy
    from tierckpt_replicator.backup.jobs import effective_settings
    from tierckpt_replicator.backup.settings import BackupSettings

    store = node.jobs.store
    assert store.schedule(A) is None, "no handshake yet: the policy's schedule stands"
    node.write(REPLICATOR_YAML, GOOD_YAML)  # backup-interval-steps: 5
    node.scan()
    assert store.schedule(A) == (5, 0.0)
    policy = JobPolicy(A, 1, bucket="team-ckpts", backup_interval_minutes=30.0, keep_last=4)
    got = effective_settings(BackupSettings(bucket="node-bucket"), policy, store.schedule(A))
    assert got is not None
    assert (got.bucket, got.interval_steps, got.interval_seconds, got.keep_last) == ("team-ckpts", 5, 0.0, 4)
    node.session(2)
    node.write(REPLICATOR_YAML, GOOD_YAML.replace(b"backup-interval-steps: 5", b"backup-interval-minutes: 2"))
    node.scan()
    assert store.schedule(A) == (0, 120.0)


def test_a_job_without_a_session_is_not_in_orbax_mode(node: Node) -> None:
    """A native job's pod writing Orbax's files gets no answer: nothing is adopted, read or removed."""
    native = node.root / "ns_native_cccccccc"
    orbax_step(native, 5)
    (native / REPLICATOR_YAML).write_bytes(GOOD_YAML)
    node.scan()
    assert (native / REPLICATOR_YAML).read_bytes() == GOOD_YAML and (native / "5").is_dir()
    assert not (native / JAX_INIT_INFO).exists() and not (native / "rank-00000").exists()
