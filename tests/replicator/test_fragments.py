"""Erasure-coded fragments on a ramdisk (``replication.fragments``): committed like replicas (COMMIT
last, through a hidden staging directory), read back cross-checked, listed for the inventory, retained."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierckpt.protocol.errors import CorruptShardError, FormatError
from tierckpt.protocol.format import COMMIT_NAME, read_manifest
from tierckpt.protocol.integrity import crc32c
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.replication.erasure import ERASURE_MANIFEST_NAME, encode_step, fragment_name
from tierckpt_replicator.replication.fragments import (
    FragmentScanner,
    FragmentWriter,
    find_fragment,
    fragment_tree,
    held_index,
    parse_fragment_header,
    read_fragment_header,
    retain,
)
from tierckpt_replicator.stepio import open_job, read_header

JOB = "frag_job"


def encoded(tmp_path: Path, step: int, k: int = 2, m: int = 1):  # type: ignore[no-untyped-def]
    """A committed step of rank 0 on a source node, its header and its erasure-coded fragments."""
    src = write_step(tmp_path / "src", JOB, 0, step, world_size=3, sizes=(70_000, 333), files=2)
    out = tmp_path / f"enc-{step}"
    em = encode_step(src, out, k, m)
    with open_job(tmp_path / "src", JOB) as tree:
        header = read_header(
            tree.at(f"rank-00000/step-{step:012d}"), job=JOB, rank=0, step_no=step, limit=1 << 20
        )
    return header, em, out


def store(root: Path, header, em, out: Path, index: int, *, flip: bool = False) -> None:  # type: ignore[no-untyped-def]
    frag = parse_fragment_header(
        header.commit_bytes, header.manifest_bytes, em.to_bytes(), job=JOB, rank=0, step=em.step, index=index
    )
    data = bytearray((out / fragment_name(index)).read_bytes())
    if flip:
        data[len(data) // 2] ^= 1
    root.mkdir(exist_ok=True)
    with open_job(root, JOB, create=True) as tree, FragmentWriter(fragment_tree(tree, 0), frag) as writer:
        writer.prepare()
        fd = writer.open()
        try:
            os.write(fd, bytes(data))
        finally:
            os.close(fd)
        writer.record(crc32c(bytes(data)))
        writer.commit()


def test_a_fragment_is_committed_read_back_and_listed(tmp_path):
    header, em, out = encoded(tmp_path, 10)
    root = tmp_path / "holder"
    store(root, header, em, out, 2)
    step_path = root / JOB / "fragments" / "rank-00000" / "step-000000000010"
    assert sorted(p.name for p in step_path.iterdir()) == sorted(
        [fragment_name(2), ERASURE_MANIFEST_NAME, "manifest.json", COMMIT_NAME]
    )
    assert (step_path / COMMIT_NAME).read_bytes() == header.commit_bytes  # the step's own marker
    assert read_manifest(step_path).world_size == 3
    with open_job(root, JOB) as tree:
        found = find_fragment(tree, 0, 10)
        assert found is not None and held_index(found) == 2
        back = read_fragment_header(found, job=JOB, rank=0, step_no=10, limit=1 << 20)
        assert (back.index, back.erasure, back.step.manifest_bytes) == (2, em, header.manifest_bytes)
        assert FragmentScanner(1 << 20)(tree) == {0: {10: ((2, 2), 3)}}
        assert find_fragment(tree, 0, 11) is None


def test_a_corrupt_fragment_is_never_committed(tmp_path):
    header, em, out = encoded(tmp_path, 10)
    root = tmp_path / "holder"
    with pytest.raises(CorruptShardError, match="crc32c"):
        store(root, header, em, out, 0, flip=True)
    assert not list((root / JOB / "fragments" / "rank-00000").iterdir())  # staging removed, nothing else


def test_a_header_that_does_not_match_its_step_is_refused(tmp_path):
    header, em, _ = encoded(tmp_path, 10)
    _, em20, _ = encoded(tmp_path, 20)
    with pytest.raises(FormatError):  # the erasure manifest of another step
        parse_fragment_header(
            header.commit_bytes, header.manifest_bytes, em20.to_bytes(), job=JOB, rank=0, step=10, index=0
        )
    with pytest.raises(FormatError):  # an index outside the code
        parse_fragment_header(
            header.commit_bytes, header.manifest_bytes, em.to_bytes(), job=JOB, rank=0, step=10, index=3
        )


def test_only_the_newest_fragment_steps_are_kept(tmp_path):
    root = tmp_path / "holder"
    for step in (10, 20, 30):
        header, em, out = encoded(tmp_path, step)
        store(root, header, em, out, 1)
    with open_job(root, JOB) as tree:
        assert retain(fragment_tree(tree, 0), 2) == [10]
        assert sorted(FragmentScanner(1 << 20)(tree)[0]) == [20, 30]
