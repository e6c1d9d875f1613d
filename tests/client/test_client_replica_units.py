"""Replica groups, piece by piece, in one process: the record, the node mark, fingerprints, the linked
commit and the pool's rule that a linked data file is never rewritten."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, ContractError, FormatError
from tierckpt.protocol.format import (
    FileEntry,
    Manifest,
    TensorEntry,
    job_dir,
    rank_dir,
    read_manifest,
    step_dir,
)
from tierckpt.protocol.integrity import crc32c
from tierckpt.protocol.replica import REPLICA_VERSION, ReplicaRecord, content_key, group_id, node_mark
from tierckpt.replica_group import ReplicaGroup
from tierckpt.snapshot import pool as pool_module
from tierckpt.snapshot.commit import StepIdentity
from tierckpt.snapshot.fingerprint import device_digest, fingerprint, structure_digest, tensor_digests
from tierckpt.snapshot.linked import LinkAbandoned, commit_linked

JOB = "units"
MARK = "0123456789abcdef0123456789abcdef"


def record(**changes: object) -> ReplicaRecord:
    fields: dict[str, object] = {
        "version": REPLICA_VERSION,
        "group": group_id((0, 2)),
        "members": (0, 2),
        "role": "linked",
        "source": 0,
        "node": MARK,
        "fingerprint": "ab" * 16,
        "diverged": False,
        "differs": (),
        "content": "cd" * 16,
        "written_bytes": 0,
        "logical_bytes": 512,
    }
    fields.update(changes)
    return ReplicaRecord(**fields)  # type: ignore[arg-type]


def manifest_with(replica: ReplicaRecord | None, rank: int = 2) -> Manifest:
    return Manifest(
        job=JOB,
        rank=rank,
        world_size=4,
        step=7,
        created_at=1.0,
        files=(FileEntry("data-00000.bin", 512, 11),),
        tensors=(TensorEntry("w", "float32", (128,), "data-00000.bin", 0, 512, 22),),
        replica=replica,
    )


# ------------------------------------------------------------------------------------------ the record


def test_the_record_travels_in_the_manifest_and_back() -> None:
    m = manifest_with(record())
    again = Manifest.from_bytes(m.to_bytes())
    assert again == m and again.replica is not None and again.replica.members == (0, 2)
    assert Manifest.from_bytes(manifest_with(None).to_bytes()).replica is None


@pytest.mark.parametrize(
    "changes",
    [
        {"members": (2, 0)},
        {"members": (0, 0, 2)},
        {"source": 1},
        {"node": "not-a-mark"},
        {"fingerprint": "XYZ"},
        {"written_bytes": 513},
        {"diverged": True, "differs": (0,)},  # a diverged save links nothing
        {"differs": (0,)},  # differs without diverged
        {"version": 0},
    ],
)
def test_a_malformed_record_is_refused(changes: dict[str, object]) -> None:
    with pytest.raises(FormatError):
        manifest_with(record(**changes))


def test_the_record_must_fit_the_manifest_rank() -> None:
    with pytest.raises(FormatError, match="not a member"):
        manifest_with(record(), rank=1)
    with pytest.raises(FormatError, match="role"):
        manifest_with(record(role="writer", source=0), rank=2)
    newer = record(version=REPLICA_VERSION + 1)
    assert not newer.known
    assert manifest_with(newer, rank=1).replica == newer  # a newer record is not checked: still readable


def test_the_content_key_covers_data_and_tensor_tables_only() -> None:
    files = (FileEntry("data-00000.bin", 512, 11), FileEntry("objects.pkl", 9, 5))
    tensors = (TensorEntry("w", "float32", (128,), "data-00000.bin", 0, 512, 22),)
    key = content_key(files, tensors)
    assert key == content_key((files[0], FileEntry("objects.pkl", 12, 6)), tensors)  # objects: per rank
    assert key != content_key((FileEntry("data-00000.bin", 512, 12),), tensors)
    assert key != content_key(files[:1], (dataclasses.replace(tensors[0], key="v"),))
    assert group_id([2, 0]) == group_id((0, 2)) != group_id((0, 1))


def test_the_node_mark_is_created_once_even_by_racing_processes(tmp_path: Path) -> None:
    marks: list[str] = []
    threads = [threading.Thread(target=lambda: marks.append(node_mark(tmp_path / "job"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(marks)) == 1 and len(marks[0]) == 32
    assert sorted(os.listdir(tmp_path / "job")) == [".node"]  # no temporary left behind
    (tmp_path / "job" / ".node").write_text("garbage")
    with pytest.raises(FormatError, match="not a node mark"):
        node_mark(tmp_path / "job")


# ------------------------------------------------------------------------------------------ fingerprints


def test_the_device_digest_sees_a_changed_and_a_swapped_word() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3 * 4096 + 77, generator=g)  # full rows, a tail of words and of bytes
    raw = base.view(torch.uint8)
    same = device_digest(raw.clone())
    assert torch.equal(device_digest(raw), same)
    changed = base.clone()
    changed[5000] = torch.nextafter(changed[5000], torch.tensor(1e9))  # one ulp
    assert not torch.equal(device_digest(changed.view(torch.uint8)), same)
    swapped = base.clone()
    swapped[[21, 8201]] = swapped[[8201, 21]]  # two values trade places (other rows, other columns)
    assert not torch.equal(device_digest(swapped.view(torch.uint8)), same)
    in_row = base.clone()
    in_row[[20, 40]] = in_row[[40, 20]]  # within one row
    assert not torch.equal(device_digest(in_row.view(torch.uint8)), same)
    assert not torch.equal(device_digest(raw[:-1]), device_digest(raw[:-1].clone()[:-1]))
    odd = raw[3:].clone()  # an unaligned view digests like the same bytes aligned
    assert torch.equal(device_digest(raw[3:]), device_digest(odd))


def test_fingerprints_compare_structure_and_bytes() -> None:
    a = {"w": torch.arange(10_000, dtype=torch.float32), "m": torch.ones(3, 3, dtype=torch.bfloat16)}
    keys = list(a)
    same = fingerprint(keys, [t.clone() for t in a.values()])
    base = fingerprint(keys, list(a.values()))
    assert base == dataclasses.replace(same)
    b = [a["w"].clone(), a["m"].clone()]
    b[0][9_999] += 1
    assert fingerprint(keys, b).host != base.host
    assert structure_digest(["w", "x"], list(a.values())) != base.structure
    table = tensor_digests(b, torch.device("cpu"))
    mine = tensor_digests(list(a.values()), torch.device("cpu"))
    assert (table != mine).any(dim=1).tolist() == [True, False]


# ------------------------------------------------------------------------------------------ groups alone


def test_a_group_of_one_saves_a_record_without_torch_distributed(root: Path) -> None:
    state = {"w": torch.arange(300, dtype=torch.float32), "note": "x"}
    with Checkpointer(root=root, job=JOB, replica_group=[0]) as ck:
        ck.save(1, state, blocking=True)
        stats = ck.last_save
        manifest = read_manifest(step_dir(ck.rank_path, 1))
    assert manifest.replica is not None
    assert (manifest.replica.role, manifest.replica.members, manifest.replica.diverged) == (
        "writer",
        (0,),
        False,
    )
    assert manifest.replica.content == content_key(manifest.files, manifest.tensors)
    assert manifest.replica.node == node_mark(job_dir(root, JOB))
    assert (
        stats["role"] == "writer" and stats["written_bytes"] == stats["logical_bytes"] == manifest.total_bytes
    )


def test_a_group_must_name_this_rank_and_needs_a_process_group(root: Path) -> None:
    with pytest.raises(ContractError, match="not a member"):
        Checkpointer(root=root, job=JOB, rank=1, world_size=2, replica_group=[0])
    with pytest.raises(ContractError, match=r"torch\.distributed"):
        Checkpointer(root=root, job=JOB, rank=0, world_size=2, replica_group=[0, 1])
    with pytest.raises(ValueError, match="distinct"):
        ReplicaGroup((0, 0))


# ------------------------------------------------------------------------------------------ linked commit


def _source_step(root: Path) -> tuple[Path, str, dict]:
    """Rank 0's committed step 3 (saved as a group of one), its fingerprint and its state."""
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(4, dtype=torch.int64)}
    with Checkpointer(root=root, job=JOB, rank=0, world_size=2, replica_group=[0]) as ck:
        ck.save(3, state, blocking=True)
    path = step_dir(rank_dir(root, JOB, 0), 3)
    replica = read_manifest(path).replica
    assert replica is not None
    return path, replica.fingerprint, state


def _link(
    root: Path, source: Path, fp: str, *, timeout: float = 10.0, cancelled: threading.Event | None = None
):
    target = step_dir(rank_dir(root, JOB, 1), 3)
    objects = b"\x80\x05]\x94."  # pickle of []
    return commit_linked(
        target,
        StepIdentity(JOB, 1, 2, 3),
        source,
        fingerprint=fp,
        keys=["w", "b"],
        tree={"t": "dict", "v": [["w", {"t": "tensor", "i": 0}], ["b", {"t": "tensor", "i": 1}]]},
        objects=objects,
        object_count=0,
        record=lambda files, tensors, linked: record(
            members=(0, 1),
            group=group_id((0, 1)),
            source=0,
            fingerprint=fp,
            content=content_key(files, tensors),
            written_bytes=sum(f.size for f in files) - linked,
            logical_bytes=sum(f.size for f in files),
        ),
        timeout=timeout,
        cancelled=cancelled or threading.Event(),
    )


def test_a_linked_step_shares_the_writers_inodes_and_loads_alone(root: Path) -> None:
    source, fp, state = _source_step(root)
    committed = _link(root, source, fp)
    target = step_dir(rank_dir(root, JOB, 1), 3)
    src_data, dst_data = os.stat(source / "data-00000.bin"), os.stat(target / "data-00000.bin")
    assert src_data.st_ino == dst_data.st_ino and dst_data.st_nlink == 2
    manifest = read_manifest(target)
    assert manifest == committed.manifest and manifest.rank == 1
    assert manifest.replica is not None and manifest.replica.written_bytes == len(b"\x80\x05]\x94.")
    assert manifest.file("objects.pkl").crc32c == crc32c(b"\x80\x05]\x94.")
    dest: dict = {}
    with Checkpointer(root=root, job=JOB, rank=1, world_size=2) as ck:
        assert ck.load(dest) == 3
    assert torch.equal(dest["w"], state["w"]) and torch.equal(dest["b"], state["b"])


def test_linking_gives_up_when_the_writer_is_gone_or_reports_failure(root: Path) -> None:
    source, _, _ = _source_step(root)
    start = time.monotonic()
    with pytest.raises(LinkAbandoned, match="writer stopped"):  # nothing holds rank 0's writer lock
        _link(root, source, "ff" * 16)
    assert time.monotonic() - start < 5
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(LinkAbandoned, match="failed"):
        _link(root, source, "ff" * 16, cancelled=cancelled)
    live_writer = Checkpointer(root=root, job=JOB, rank=0, world_size=2)  # alive, never commits it
    with live_writer, pytest.raises(LinkAbandoned, match="in time"):
        _link(root, source, "ff" * 16, timeout=0.3)
    assert not (step_dir(rank_dir(root, JOB, 1), 3) / "COMMIT").exists()


# ------------------------------------------------------------------------------------------ the pool


def test_a_linked_data_file_is_never_recycled_while_linked(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower keeps step 1's file linked for long: retention retires step 1, and no later save writes
    into that file; past the grace the pool prepares another slot and lets the shared one go."""
    monkeypatch.setattr(pool_module, "SHARED_GRACE", 0.2)
    outside = root / "follower-link.bin"
    with Checkpointer(root=root, job=JOB, keep=1) as ck:
        ck.prepare({"w": torch.zeros(100_000)})
        ck.save(1, {"w": torch.full((100_000,), 1.0)}, blocking=True)
        os.link(step_dir(ck.rank_path, 1) / "data-00000.bin", outside)
        inode, content = os.stat(outside).st_ino, outside.read_bytes()
        for step in (2, 3, 4, 5):
            ck.save(step, {"w": torch.full((100_000,), float(step))}, blocking=True)
            assert outside.read_bytes() == content, step  # never rewritten
            assert os.stat(step_dir(ck.rank_path, step) / "data-00000.bin").st_ino != inode
        ck._pool.warm(None).result()
        held = [p for p in ck.rank_path.rglob("data-*.bin") if os.stat(p).st_ino != inode]
        assert len(held) <= 2  # keep + 1 slots: the shared one was let go, not kept besides
        dest: dict = {}
        assert ck.load(dest) == 5 and torch.equal(dest["w"], torch.full((100_000,), 5.0))
    assert outside.read_bytes() == content


def test_a_released_link_returns_the_slot_to_the_pool(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual case: the follower retires its link right after the writer retires the step; the writer's
    next save reuses the slot (the same inode, still mapped and prepared)."""
    # The grace must outlast this thread's way from the commit to the unlink on a loaded machine (the
    # default 2 s did not always); past it the pool rightly prepares another slot instead.
    monkeypatch.setattr(pool_module, "SHARED_GRACE", 60.0)
    outside = root / "follower-link.bin"
    with Checkpointer(root=root, job=JOB, keep=1) as ck:
        ck.prepare({"w": torch.zeros(100_000)})
        ck.save(1, {"w": torch.full((100_000,), 1.0)}, blocking=True)
        os.link(step_dir(ck.rank_path, 1) / "data-00000.bin", outside)
        inode = os.stat(outside).st_ino
        ck.save(2, {"w": torch.full((100_000,), 2.0)}, blocking=True)  # retires step 1: shared
        os.unlink(outside)  # the follower retires its step 1
        inodes = set()
        for step in (3, 4):
            ck.save(step, {"w": torch.full((100_000,), float(step))}, blocking=True)
            inodes.add(os.stat(step_dir(ck.rank_path, step) / "data-00000.bin").st_ino)
        assert inode in inodes
        assert len(list(ck.rank_path.rglob("data-*.bin"))) <= 2
