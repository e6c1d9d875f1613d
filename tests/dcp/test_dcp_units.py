"""In-process checks: the metadata encoding, step ids, DCP retention, argument errors, page reuse."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tierckpt.dcp import RamdiskReader, RamdiskWriter
from tierckpt.dcp._paths import parse_step_id
from tierckpt.dcp._store import plan_dcp_retention
from tierckpt.dcp.metadata import DcpMetadata, decode_metadata, encode_metadata
from tierckpt.protocol.errors import ContractError, FormatError
from tierckpt.protocol.format import committed_steps, rank_dir, step_dir


def _metadata(planner_data: object) -> tuple[Metadata, dict[MetadataIndex, tuple[int, ...]]]:
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4])),
        ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 4])),
    ]
    sdm = {
        "w": TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16, requires_grad=True), torch.Size([5, 4]), chunks
        ),
        "scalar": TensorStorageMetadata(
            TensorProperties(dtype=torch.float64),
            torch.Size([]),
            [ChunkStorageMetadata(torch.Size([]), torch.Size([]))],
        ),
        "obj": BytesStorageMetadata(),
    }
    holders = {
        MetadataIndex("w", [0, 0], 0): (0,),
        MetadataIndex("w", [3, 0], 1): (1,),
        MetadataIndex("scalar", [], 0): (0, 2),  # replicated: written by rank 0, a copy on rank 2's node
        MetadataIndex("obj"): (0, 3),
    }
    md = Metadata(
        sdm,
        planner_data=planner_data,
        storage_data=holders,
        storage_meta=StorageMeta("7", "s-1"),
        version="1.0.0",
    )
    return md, holders


@pytest.mark.parametrize(
    "planner_data", [None, {"w": ("model", "w"), "obj": ("extra", 0, "obj")}, {"any": [1, "x"]}]
)
def test_metadata_round_trips_through_typed_json(planner_data: object) -> None:
    md, holders = _metadata(planner_data)
    record = encode_metadata(md, holders, job="j", step=7, world_size=4, coordinator=0, save_id="s-1")
    body = record.to_bytes()
    assert json.loads(body)["kind"] == "tierckpt.dcp-metadata"
    back = decode_metadata(DcpMetadata.from_bytes(body))
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.storage_data == holders
    assert back.planner_data == planner_data
    assert back.version == "1.0.0" and back.storage_meta.checkpoint_id == "7"
    decoded = DcpMetadata.from_bytes(body)
    assert decoded.save_id == "s-1" and decoded.ranks_with_data == [0, 1, 2, 3]


def test_metadata_refuses_what_json_cannot_hold() -> None:
    md, holders = _metadata({"w": object()})
    with pytest.raises(FormatError, match="cannot be stored as JSON"):
        encode_metadata(md, holders, job="j", step=7, world_size=2, coordinator=0)
    md, holders = _metadata(None)
    holders[MetadataIndex("ghost", [0])] = (0,)
    with pytest.raises(FormatError, match="no entry"):
        encode_metadata(md, holders, job="j", step=7, world_size=2, coordinator=0)
    record = encode_metadata(*_metadata(None), job="j", step=7, world_size=2, coordinator=0).to_dict()
    record["entries"][0]["tensor"]["properties"]["dtype"] = "float128"
    with pytest.raises(FormatError, match="float128"):
        decode_metadata(DcpMetadata.from_dict(record))
    record["entries"][0]["tensor"]["properties"]["dtype"] = "bfloat16"
    record["entries"][0]["items"]["copies"] = {"5": [1]}
    with pytest.raises(FormatError, match="does not exist"):
        DcpMetadata.from_dict(record)


def test_metadata_of_the_previous_format_still_decodes() -> None:
    """Version 1 listed file, offset, length and crc per item (now in each holder's manifest)."""
    v1 = {
        "kind": "tierckpt.dcp-metadata",
        "version": 1,
        "job": "j",
        "step": 3,
        "world_size": 2,
        "coordinator": 0,
        "entries": [
            {
                "fqn": "x",
                "tensor": {
                    "properties": {"dtype": "float32"},
                    "size": [4],
                    "chunk_count": 2,
                    "chunk_offsets": [0, 2],
                    "chunk_sizes": [2, 2],
                },
                "items": {
                    "index_offsets": [0, 2],
                    "index_hints": [0, 1],
                    "ranks": [0, 1],
                    "files": [0, 0],
                    "offsets": [0, 0],
                    "lengths": [8, 8],
                    "crc32c": [1, 2],
                },
            }
        ],
        "ranks": {"1": 12345},
    }
    md = decode_metadata(DcpMetadata.from_dict(v1))
    assert md.storage_data == {MetadataIndex("x", [0]): (0,), MetadataIndex("x", [2]): (1,)}


def test_step_ids() -> None:
    assert [
        parse_step_id(x) for x in (0, 1200, "1200", "step-000000001200", Path("/a/step-000000000003"))
    ] == [
        0,
        1200,
        1200,
        1200,
        3,
    ]
    assert [parse_step_id(x) for x in (-1, True, "latest", "runs/last", "step-x", None)] == [None] * 6


def test_dcp_retention_keeps_complete_checkpoints_only() -> None:
    assert plan_dcp_retention([1, 2, 3, 4], [1, 2, 3, 4], keep=2) == (1, 2)
    assert plan_dcp_retention([1, 2, 3, 4], [1, 2], keep=2) == ()  # 3 and 4 are not known complete yet
    assert plan_dcp_retention([1, 2, 3, 4], [1, 2, 3], keep=1) == (1, 2)
    assert plan_dcp_retention([1, 2, 3, 4], [1, 2, 3], keep=1, leased={1}) == (2,)
    assert plan_dcp_retention([5], [], keep=1) == ()


def test_writer_argument_errors(ramdisk: Path, job: str) -> None:
    writer = RamdiskWriter(ramdisk, job)
    with pytest.raises(ValueError, match="names no step"):
        writer.reset("latest")
    with pytest.raises(ValueError, match="no step to save"):
        writer.set_up_storage_writer(True)
    writer.reset(5)
    with pytest.raises(ValueError, match="use_collectives=True"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)


def test_writer_needs_a_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCKPT_ROOT", raising=False)
    with pytest.raises(ContractError, match="no checkpoint root"):
        RamdiskWriter()


def test_the_writer_creates_a_root_that_does_not_exist_yet(
    ramdisk: Path, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like ``Checkpointer``: the node identity comes from the ramdisk's device when no node name is set,
    which needs the directory to exist."""
    monkeypatch.delenv("TIERCKPT_NODE_NAME", raising=False)
    root = ramdisk / "not" / "yet"
    state = {"x": torch.arange(5, dtype=torch.float32), "meta": {"n": 3}}
    dcp.save(state, checkpoint_id=1, storage_writer=RamdiskWriter(root, job), no_dist=True)
    assert committed_steps(rank_dir(root, job, 0)) == [1]
    got = {"x": torch.zeros(5), "meta": {"n": 0}}
    dcp.load(got, storage_reader=RamdiskReader(root, job), no_dist=True)
    assert torch.equal(got["x"], state["x"]) and got["meta"] == {"n": 3}


def test_a_used_writer_pickles_for_the_process_executor(ramdisk: Path, job: str) -> None:
    """DCP's process-based async executor pickles the writer into a helper process."""
    with RamdiskWriter(ramdisk, job) as writer:
        dcp.save({"x": torch.ones(3)}, checkpoint_id=1, storage_writer=writer, no_dist=True)
        clone = pickle.loads(pickle.dumps(writer))
    with clone:
        dcp.save({"x": torch.full((3,), 2.0)}, checkpoint_id=2, storage_writer=clone, no_dist=True)
    got = {"x": torch.zeros(3)}
    dcp.load(got, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
    assert torch.equal(got["x"], torch.full((3,), 2.0))


def test_repeated_saves_keep_n_checkpoints_and_reuse_pages(ramdisk: Path, job: str) -> None:
    with RamdiskWriter(ramdisk, job, keep=2) as writer:
        inodes = []
        for step in range(1, 6):
            state = {"w": torch.full((1 << 16,), float(step)), "step": step}
            dcp.save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)
            inodes.append(os.stat(step_dir(rank_dir(ramdisk, job, 0), step) / "data-00000.bin").st_ino)
    assert committed_steps(rank_dir(ramdisk, job, 0)) == [4, 5]
    assert set(inodes[3:]) & set(inodes[:2]), "later saves write into the recycled files of retired steps"
    got = {"w": torch.zeros(1 << 16), "step": 0}
    dcp.load(got, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
    assert got["step"] == 5 and bool((got["w"] == 5.0).all())


def test_async_staging_goes_into_the_slot_when_the_layout_is_known(ramdisk: Path, job: str) -> None:
    """From the second async save on, staging fills the slot the save commits; an object whose pickled
    size changes moves no tensor; a changed structure stages into host buffers again. Every step holds
    the state at the moment its save was called."""
    state = {"w": torch.arange(1 << 14, dtype=torch.float32), "t": torch.ones(3, 5).t(), "meta": {"n": 1}}
    wanted: dict[int, dict[str, object]] = {}
    used = []
    with RamdiskWriter(ramdisk, job, keep=5) as writer:
        for step in range(1, 6):
            if step == 4:
                state["extra"] = torch.zeros(7)  # a new key: the layout changes
            wanted[step] = {
                k: v.clone() if isinstance(v, torch.Tensor) else dict(v) for k, v in state.items()
            }
            response = dcp.async_save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)
            state["w"].add_(1)  # training goes on
            state["t"].mul_(2)
            state["meta"]["n"] = 10**step  # its pickle grows
            getattr(response, "upload_completion", response).result()
            used.append(writer.staged_in_place)
    assert used == [False, True, True, False, True]
    for step, want in wanted.items():
        got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"n": 0} for k, v in want.items()}
        dcp.load(got, checkpoint_id=step, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
        for k, v in want.items():
            assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, (step, k)


def test_steps_being_read_are_leased(ramdisk: Path, job: str) -> None:
    """While the reader copies a step's data, the step holds a lease (retention elsewhere keeps it)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from tierckpt.protocol import leases

    rank_path = rank_dir(ramdisk, job, 0)
    seen: list[set[int]] = []

    class Spy(DefaultLoadPlanner):
        def commit_tensor(self, read_item, tensor):  # type: ignore[no-untyped-def]
            seen.append(leases.leased_steps(rank_path))
            super().commit_tensor(read_item, tensor)

    with RamdiskWriter(ramdisk, job) as writer:
        dcp.save({"x": torch.ones(3)}, checkpoint_id=4, storage_writer=writer, no_dist=True)
    got = {"x": torch.zeros(3)}
    dcp.load(got, storage_reader=RamdiskReader(ramdisk, job), planner=Spy(), no_dist=True)
    assert seen == [{4}]
    assert leases.leased_steps(rank_path) == set(), "released after the load"


def test_a_reused_reader_without_step_follows_the_newest_checkpoint(ramdisk: Path, job: str) -> None:
    reader = RamdiskReader(ramdisk, job)
    got = {"x": torch.zeros(2)}
    with RamdiskWriter(ramdisk, job) as writer:
        for step in (1, 2):
            dcp.save(
                {"x": torch.full((2,), float(step))}, checkpoint_id=step, storage_writer=writer, no_dist=True
            )
            dcp.load(got, storage_reader=reader, no_dist=True)
            assert reader.step == step and torch.equal(got["x"], torch.full((2,), float(step)))


def test_a_second_save_while_one_runs_on_another_thread_is_refused(ramdisk: Path, job: str) -> None:
    """Overlapping async saves through one writer would trample each other: the second is refused."""
    import threading

    from tierckpt.protocol.errors import SaveInProgressError

    writer = RamdiskWriter(ramdisk, job, step=1)
    release = threading.Event()

    def in_flight() -> None:  # a save that set up and is still writing, like an async_save thread
        writer.set_up_storage_writer(True)
        release.wait(30)

    t = threading.Thread(target=in_flight)
    t.start()
    try:
        while writer._save is None:
            t.join(0.01)
        with pytest.raises(SaveInProgressError, match="still being saved"):
            writer.reset(2)
    finally:
        release.set()
        t.join()
    writer.reset(2)  # once that thread is gone, the next save may start
    writer.close()


def test_a_load_in_the_writers_process_reads_through_the_writers_mappings(
    ramdisk: Path, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer keeps its steps' files mapped (and pinned, for CUDA): a load in the same process reads
    through them instead of mapping and faulting the files afresh. A file replaced since (e.g. by a
    restore) is mapped anew, and a corrupt one is still caught."""
    from tierckpt.snapshot.shardfile import MappedFile

    opened: list[str] = []
    real_open = MappedFile.open.__func__  # type: ignore[attr-defined]

    def spy(cls, path, **kwargs):  # type: ignore[no-untyped-def]
        opened.append(Path(path).name)
        return real_open(cls, path, **kwargs)

    monkeypatch.setattr(MappedFile, "open", classmethod(spy))
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.full((7,), 3.0)}
    with RamdiskWriter(ramdisk, job) as writer:
        dcp.save(state, checkpoint_id=5, storage_writer=writer, no_dist=True)
        got = {"w": torch.zeros(1 << 16), "b": torch.zeros(7)}
        dcp.load(got, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
        assert opened == [] and all(torch.equal(got[k], state[k]) for k in state)

        step_path = step_dir(rank_dir(ramdisk, job, 0), 5)
        data = next(p for p in step_path.iterdir() if p.name.startswith("data"))
        copy = data.with_name(data.name + ".new")
        copy.write_bytes(data.read_bytes())
        os.replace(copy, data)  # the same bytes in a new file: the writer's mapping no longer backs it
        got = {"w": torch.zeros(1 << 16), "b": torch.zeros(7)}
        dcp.load(got, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
        assert opened == [data.name] and all(torch.equal(got[k], state[k]) for k in state)

        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
        with pytest.raises(CheckpointException, match="crc32c"):
            dcp.load(got, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)


def test_the_metadata_of_a_step_loaded_again_is_not_decoded_again(
    ramdisk: Path, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validating the metadata and building torch's ``Metadata`` was most of a DCP load of many small
    tensors; a body decoded before (the same bytes, its crc32c checked against the manifest) is reused,
    each load with a ``Metadata`` container of its own. A step saved again decodes its new body."""
    decoded: list[int] = []
    real = DcpMetadata.from_bytes.__func__  # type: ignore[attr-defined]

    def spy(cls, body, *args, **kwargs):  # type: ignore[no-untyped-def]
        decoded.append(len(body))
        return real(cls, body, *args, **kwargs)

    monkeypatch.setattr(DcpMetadata, "from_bytes", classmethod(spy))
    state = {"w": torch.arange(64, dtype=torch.float32), "b": torch.full((7,), 3.0)}
    with RamdiskWriter(ramdisk, job) as writer:
        dcp.save(state, checkpoint_id=5, storage_writer=writer, no_dist=True)
        readers = []
        for _ in range(3):
            got = {"w": torch.zeros(64), "b": torch.zeros(7)}
            reader = RamdiskReader(ramdisk, job)
            dcp.load(got, storage_reader=reader, no_dist=True)
            readers.append(reader)
            assert all(torch.equal(got[k], state[k]) for k in state)
        assert len(decoded) == 1
        first, second = (r.read_metadata() for r in readers[:2])
        assert first is not second and first.storage_meta is not second.storage_meta
        state = {
            "w": torch.arange(64, dtype=torch.float32) * 2,
            "b": torch.full((7,), 4.0),
            "c": torch.ones(3),
        }
        dcp.save(state, checkpoint_id=6, storage_writer=writer, no_dist=True)
        got = {"w": torch.zeros(64), "b": torch.zeros(7), "c": torch.zeros(3)}
        dcp.load(got, storage_reader=RamdiskReader(ramdisk, job), no_dist=True)
        assert all(torch.equal(got[k], state[k]) for k in state) and len(decoded) == 2
