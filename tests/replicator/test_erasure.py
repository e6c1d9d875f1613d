"""Erasure coding of steps (replication/erasure.py): every loss pattern of up to ``m`` fragments rebuilds
the step bit-exact, corrupt fragments are found by their crc32c and replaced by others, and nothing
corrupt is ever encoded or returned."""

from __future__ import annotations

import itertools
import os
import random
import shutil
from pathlib import Path

import pytest

from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError
from tierckpt.protocol.format import FileEntry, read_manifest
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.replication.erasure import (
    ERASURE_MANIFEST_NAME,
    ErasureLayout,
    ErasureManifest,
    decode_bytes,
    decode_step,
    encode_bytes,
    encode_step,
    fragment_name,
    read_erasure_manifest,
)

JOB = "ns_job_0123abcd"
CODES = [(2, 1), (4, 2)]
PIECE = 4096  # small pieces: many stripes, and a short last one, from small inputs


def losses(k: int, m: int) -> list[tuple[int, ...]]:
    """Every set of at most ``m`` lost fragments."""
    return [c for r in range(m + 1) for c in itertools.combinations(range(k + m), r)]


@pytest.mark.parametrize(("k", "m"), CODES)
@pytest.mark.parametrize("size", [0, 1, 3, 4095, 4096 * 2, 4096 * 4 + 1, 100_003])
def test_bytes_survive_every_loss_of_up_to_m_fragments(k, m, size):
    data = random.Random(size).randbytes(size)
    layout, fragments = encode_bytes(data, k, m, piece=PIECE)
    assert len(fragments) == k + m and {len(f) for f in fragments} == {layout.fragment_bytes}
    assert layout.total_bytes == size and layout.stripes == -(-size // (k * PIECE))
    if size:  # the data fragments hold the data itself (a systematic code), behind each piece header
        assert data[: min(10, size // k)] in fragments[0]
    for lost in losses(k, m):
        kept = {i: f for i, f in enumerate(fragments) if i not in lost}
        assert decode_bytes(layout, kept) == data, lost


def test_wide_codes_decode_every_loss_pattern():
    """Why Cauchy: ISA-L's Vandermonde code cannot decode some patterns of 5 or more lost fragments."""
    data = random.Random(5).randbytes(3000)
    layout, fragments = encode_bytes(data, 7, 5, piece=1024)
    for lost in itertools.combinations(range(12), 5):
        kept = {i: f for i, f in enumerate(fragments) if i not in lost}
        assert decode_bytes(layout, kept) == data, lost


@pytest.mark.parametrize(("k", "m"), CODES)
def test_more_than_m_losses_are_refused(k, m):
    layout, fragments = encode_bytes(b"x" * 10_000, k, m, piece=PIECE)
    with pytest.raises(MissingCheckpointError):
        decode_bytes(layout, dict(enumerate(fragments[: k - 1])))


def _step(tmp_path: Path, sizes: tuple[int, ...], files: int) -> Path:
    return write_step(tmp_path / "ramdisk", JOB, 2, 40, sizes=sizes, files=files, seed=7)


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: (path / f.name).read_bytes() for f in read_manifest(path).files}


@pytest.mark.parametrize(("k", "m"), CODES)
def test_step_rebuilt_bit_exact_from_every_loss_pattern(tmp_path, k, m):
    # three data files of odd sizes (one empty): stripes cross file boundaries
    step = _step(tmp_path, sizes=(12_345, 1, 70_001), files=4)
    original = _files(step)
    assert any(not v for v in original.values())
    frags = tmp_path / "fragments"
    em = encode_step(step, frags, k, m, piece=PIECE)
    assert read_erasure_manifest(frags) == em
    assert (em.job, em.rank, em.step) == (JOB, 2, 40)
    assert [f.index for f in em.fragments] == list(range(k + m))
    assert sorted(os.listdir(frags)) == sorted(
        [ERASURE_MANIFEST_NAME] + [fragment_name(i) for i in range(k + m)]
    )
    assert em.files == read_manifest(step).files
    for lost in losses(k, m):
        out = tmp_path / f"out-{'-'.join(map(str, lost))}"
        out.mkdir()
        have = {i: frags / fragment_name(i) for i in range(k + m) if i not in lost}
        result = decode_step(em, have, out)
        assert {name: (out / name).read_bytes() for name in original} == original, lost
        assert result.crcs == {f.name: f.crc32c for f in em.files}
        assert result.corrupt == () and len(result.used) == k and not set(result.used) & set(lost)


def test_data_fragments_are_preferred(tmp_path):
    em = encode_step(_step(tmp_path, (50_000,), 1), tmp_path / "f", 4, 2, piece=PIECE)
    out = tmp_path / "out"
    out.mkdir()
    have = {i: tmp_path / "f" / fragment_name(i) for i in range(6)}
    assert decode_step(em, have, out).used == (0, 1, 2, 3)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(100, id="coded-bytes"),  # inside the first piece's data: decodes wrongly
        pytest.param(8, id="piece-header"),  # inside liberasurecode's checked header: refused
        pytest.param(-1, id="last-byte"),
    ],
)
def test_a_corrupt_fragment_is_detected_and_replaced(tmp_path, where):
    step = _step(tmp_path, (60_000, 9_999), 2)
    original = _files(step)
    frags = tmp_path / "f"
    em = encode_step(step, frags, 2, 1, piece=PIECE)
    victim = frags / fragment_name(0)
    _flip(victim, where if where >= 0 else victim.stat().st_size - 1)
    out = tmp_path / "out"
    out.mkdir()
    result = decode_step(em, {i: frags / fragment_name(i) for i in range(3)}, out)
    assert result.corrupt == (0,)
    assert {n: (out / n).read_bytes() for n in original} == original


def test_too_many_corrupt_fragments_raise_and_return_nothing_wrong(tmp_path):
    step = _step(tmp_path, (30_000,), 1)
    frags = tmp_path / "f"
    em = encode_step(step, frags, 2, 1, piece=PIECE)
    _flip(frags / fragment_name(0), 200)
    _flip(frags / fragment_name(2), 300)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptShardError, match="1 intact fragments of 3, 2 needed"):
        decode_step(em, {i: frags / fragment_name(i) for i in range(3)}, out)


def test_a_fragment_of_the_wrong_size_or_missing_is_skipped(tmp_path):
    step = _step(tmp_path, (30_000,), 1)
    frags = tmp_path / "f"
    em = encode_step(step, frags, 2, 1, piece=PIECE)
    with open(frags / fragment_name(1), "ab") as f:
        f.write(b"tail")
    out = tmp_path / "out"
    out.mkdir()
    result = decode_step(
        em, {0: frags / fragment_name(0), 1: frags / fragment_name(1), 2: frags / fragment_name(2)}, out
    )
    assert result.corrupt == (1,) and result.used == (0, 2)
    (frags / fragment_name(2)).unlink()
    with pytest.raises(CorruptShardError):
        decode_step(em, {i: frags / fragment_name(i) for i in range(3)}, out)


def test_fewer_than_k_fragments_at_hand(tmp_path):
    em = encode_step(_step(tmp_path, (1000,), 1), tmp_path / "f", 4, 2, piece=PIECE)
    with pytest.raises(MissingCheckpointError, match="3 fragments at hand, 4 needed"):
        decode_step(em, {i: tmp_path / "f" / fragment_name(i) for i in range(3)}, tmp_path)


def test_a_corrupt_primary_is_never_encoded(tmp_path):
    step = _step(tmp_path, (20_000,), 1)
    _flip(step / "data-00000.bin", 5_000)
    with pytest.raises(CorruptShardError, match=r"data-00000\.bin of step 40: crc32c"):
        encode_step(step, tmp_path / "f", 2, 1)
    assert not (tmp_path / "f").exists()
    step2 = write_step(tmp_path / "ramdisk", JOB, 2, 41, sizes=(20_000,))
    with open(step2 / "data-00000.bin", "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptShardError, match="bytes on disk"):
        encode_step(step2, tmp_path / "f", 2, 1)
    assert not (tmp_path / "f").exists()


def test_decode_writes_into_preallocated_files(tmp_path):
    """Restores decode into a staging dir whose files ``create_preallocated`` already reserved."""
    from tierckpt.protocol.safefs import Beneath
    from tierckpt_replicator.stepio import create_preallocated

    step = _step(tmp_path, (10_000, 3), 2)
    original = _files(step)
    em = encode_step(step, tmp_path / "f", 2, 1, piece=PIECE)
    out = tmp_path / "out"
    out.mkdir()
    with Beneath.open(out) as tree:
        for f in em.files:
            create_preallocated(tree, f.name, f.size)
    decode_step(em, {i: tmp_path / "f" / fragment_name(i) for i in (1, 2)}, out)
    assert {n: (out / n).read_bytes() for n in original} == original


def test_manifest_round_trips_and_rejects_inconsistencies(tmp_path):
    em = encode_step(_step(tmp_path, (10_000,), 1), tmp_path / "f", 2, 1, piece=PIECE)
    raw = (tmp_path / "f" / ERASURE_MANIFEST_NAME).read_bytes()
    assert ErasureManifest.from_bytes(raw) == em
    lay = em.layout
    with pytest.raises(FormatError, match="k=0"):
        ErasureLayout(
            lay.codec, 0, 1, lay.stripe_bytes, lay.total_bytes, lay.piece_bytes, lay.last_piece_bytes
        )
    with pytest.raises(FormatError, match="k \\+ m <= 32"):
        ErasureLayout(
            lay.codec, 30, 3, lay.stripe_bytes, lay.total_bytes, lay.piece_bytes, lay.last_piece_bytes
        )
    with pytest.raises(FormatError, match="fragments must be"):
        ErasureManifest(em.job, em.rank, em.step, lay, em.files, em.fragments[:2])
    with pytest.raises(FormatError, match="do not add up"):
        ErasureManifest(em.job, em.rank, em.step, lay, (FileEntry("data-00000.bin", 1, 0),), em.fragments)
    with pytest.raises(FormatError):
        ErasureManifest.from_bytes(raw.replace(b'"codec":"isa_l_rs_cauchy"', b'"codec":"rot13"'))


def test_large_step_in_default_pieces(tmp_path):
    """A step of several default stripes (256 KiB pieces), two of the four data fragments lost."""
    step = write_step(tmp_path / "ramdisk", JOB, 0, 1, sizes=(3 << 20, (1 << 20) + 7), files=2, seed=1)
    original = _files(step)
    em = encode_step(step, tmp_path / "f", 4, 2)
    assert em.layout.stripes == 5 and em.layout.piece_bytes == (256 << 10) + 80
    out = tmp_path / "out"
    out.mkdir()
    decode_step(em, {i: tmp_path / "f" / fragment_name(i) for i in (1, 3, 4, 5)}, out)
    assert {n: (out / n).read_bytes() for n in original} == original
    shutil.rmtree(tmp_path / "f")
    assert os.listdir(out)
