"""Replica groups end to end on four gloo ranks: save once per node, verify identity, restore bit-exact.

The ranks are real processes; a "node" is a ramdisk root (a tmpfs directory): one root for all four,
or ranks 0-1 on one and ranks 2-3 on another. What the ramdisks hold is checked from outside: data
files by inode (hard links count once), manifests and their replica records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client import replica_scenarios as sc
from tests.dcp.dcp_dist import run_ranks
from tests.fixtures.ramdisk import fresh_ramdisk_dir
from tierckpt.protocol.format import committed_steps, rank_dir, read_manifest, step_dir
from tierckpt.protocol.replica import group_id
from tierckpt.verify import verify_step

WORLD = 4
pytestmark = pytest.mark.slow


@pytest.fixture
def node_roots(tmp_path: Path) -> Iterator[list[Path]]:
    with fresh_ramdisk_dir(tmp_path, "node-a") as a, fresh_ramdisk_dir(tmp_path, "node-b") as b:
        yield [a, b]


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def _data_files(root: Path, rank: int, step: int) -> list[os.stat_result]:
    return [os.stat(p) for p in sorted(step_dir(rank_dir(root, sc.JOB, rank), step).glob("data-*.bin"))]


def _unique_bytes(stats: list[os.stat_result]) -> int:
    """Bytes of memory the files take: each inode once."""
    return sum({(s.st_dev, s.st_ino): s.st_size for s in stats}.values())


def _check_every_step_verifies(roots: list[Path], ranks_of: dict[int, Path]) -> None:
    """Every retained step of every rank still matches its crc32c: no recycled file was rewritten under a
    step that links it."""
    for rank, root in ranks_of.items():
        rank_path = rank_dir(root, sc.JOB, rank)
        steps = committed_steps(rank_path)
        assert steps == list(sc.STEPS[-2:]), (rank, steps)
        for step in steps:
            assert verify_step(step_dir(rank_path, step)).step == step  # raises on a crc mismatch


def test_one_node_writes_each_shard_once_and_every_rank_restores_bit_exact(
    root: Path, tmp_path: Path
) -> None:
    run_ranks(WORLD, sc.save_and_restore, [str(root)], "hsdp", str(tmp_path))
    results = _results(tmp_path)
    groups = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    for step in sc.STEPS[-2:]:
        stats = {r: _data_files(root, r, step) for r in range(WORLD)}
        logical = sum(s.st_size for files in stats.values() for s in files)
        unique = _unique_bytes([s for files in stats.values() for s in files])
        assert unique * 2 == logical  # groups of two on one node: half the bytes
        for rank in range(WORLD):
            manifest = read_manifest(step_dir(rank_dir(root, sc.JOB, rank), step))
            record = manifest.replica
            assert record is not None and record.members == groups[rank]
            assert record.group == group_id(groups[rank]) and not record.diverged
            writer = groups[rank][0]
            assert (record.role, record.source) == (
                ("writer", rank) if rank == writer else ("linked", writer)
            )
            data = sum(f.size for f in manifest.files if f.name.startswith("data-"))
            assert record.logical_bytes == manifest.total_bytes
            assert record.written_bytes == (
                manifest.total_bytes if rank == writer else manifest.total_bytes - data
            )
            writer_files = _data_files(root, writer, step)
            assert [s.st_ino for s in stats[rank]] == [s.st_ino for s in writer_files]  # hard links
            peer = read_manifest(step_dir(rank_dir(root, sc.JOB, writer), step)).replica
            assert (
                peer is not None and peer.content == record.content and peer.fingerprint == record.fingerprint
            )
    for rank, out in enumerate(results):
        last = out["stats"][-1]
        assert last["role"] == ("writer" if rank in (0, 1) else "linked")
        if last["role"] == "linked":
            assert last["written_bytes"] < last["logical_bytes"] / 100  # only its small objects.pkl
        assert out["broadcast"]["broadcast_s"] >= 0
    _check_every_step_verifies([root], dict.fromkeys(range(WORLD), root))


@pytest.mark.parametrize("layout", ["hsdp", "hsdp_dims", "ddp"])
def test_two_nodes_hold_one_copy_per_group_each(node_roots: list[Path], tmp_path: Path, layout: str) -> None:
    run_ranks(WORLD, sc.save_and_restore, [str(r) for r in node_roots], layout, str(tmp_path))
    ranks_of = {r: node_roots[r // 2] for r in range(WORLD)}
    step = sc.STEPS[-1]
    for node, root in enumerate(node_roots):
        on_node = [r for r in range(WORLD) if ranks_of[r] == root]
        stats = [s for r in on_node for s in _data_files(root, r, step)]
        copies = len({(s.st_dev, s.st_ino) for s in stats}) // len(_data_files(root, on_node[0], step))
        # HSDP: groups {0, 2} and {1, 3} span the nodes: each node holds one copy of each group's shard.
        # DDP: one group of four: each node holds one copy in all.
        assert copies == (1 if layout == "ddp" else 2), (node, copies)
        for rank in on_node:
            record = read_manifest(step_dir(rank_dir(root, sc.JOB, rank), step)).replica
            assert record is not None and not record.diverged
            if layout != "ddp":
                assert record.role == "writer" and record.members == ((0, 2) if rank % 2 == 0 else (1, 3))
            else:
                assert record.members == (0, 1, 2, 3)
                assert (record.role, record.source) == (
                    ("writer", rank) if rank == on_node[0] else ("linked", on_node[0])
                )
    contents = {
        read_manifest(step_dir(rank_dir(ranks_of[r], sc.JOB, r), step)).replica.content  # type: ignore[union-attr]
        for r in range(WORLD)
        if layout == "ddp" or r % 2 == 0
    }
    assert len(contents) == 1  # the same content key across nodes: what the replicators deduplicate on
    _check_every_step_verifies(node_roots, ranks_of)


def test_a_diverging_member_is_reported_and_both_copies_are_kept(root: Path, tmp_path: Path) -> None:
    """Also: a member whose save fails before the exchange makes its group skip, not hang."""
    run_ranks(WORLD, sc.diverging_member, str(root), str(tmp_path))
    results = _results(tmp_path)
    for rank in (0, 2):  # the group that diverged: both raised, both wrote their own copy
        assert list(results[rank]["raised"]) == ["2"], results[rank]
        message = results[rank]["raised"]["2"]
        assert "differ at step 2" in message and "model/weight" in message, message
        record = results[rank]["record"]
        assert record["diverged"] and record["role"] == "writer" and record["source"] == rank
        assert record["differs"] == [2 - rank]
    for rank in (1, 3):  # the other group agreed
        assert results[rank]["raised"] == {}
        record = results[rank]["record"]
        assert not record["diverged"] and record["role"] == ("writer" if rank == 1 else "linked")
    s0, s2 = (_data_files(root, r, 2) for r in (0, 2))
    assert {s.st_ino for s in s0}.isdisjoint({s.st_ino for s in s2})  # two copies
    assert results[0]["record"]["content"] != results[2]["record"]["content"]
    s0, s2 = (_data_files(root, r, 3) for r in (0, 2))
    assert [s.st_ino for s in s0] == [s.st_ino for s in s2]  # step 3 agreed again: linked
    # step 4: rank 3 failed before the exchange; its group skipped, the other group saved
    assert results[3]["step4"] == "raised"
    assert results[1]["step4"].startswith("skipped") and "rank 3: its save failed" in results[1]["step4"]
    assert results[0]["step4"] == results[2]["step4"] == "committed"
