"""Host memory pinned in pieces: a background registration that pauses between pieces, and copies cut
at the pieces' boundaries (CUDA refuses a copy that spans two registrations).

The cutting is planned on the CPU (a ``meta`` tensor stands in for the device side); the round trips
through pinned ramdisk pages run on the device machine (``-m gpu``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.client.client_helpers import assert_same
from tierckpt import Checkpointer, cuda
from tierckpt.cuda import REGISTER_PIECE, _cut, _pieces
from tierckpt.snapshot import shardfile
from tierckpt.snapshot.shardfile import MappedFile, _FaultAhead

MIB = 1 << 20


def test_pieces_end_at_multiples_of_the_piece_size_and_cover_the_range():
    start = 3 * REGISTER_PIECE - 5 * MIB
    pieces = _pieces(start, 2 * REGISTER_PIECE + 7 * MIB)
    assert pieces == [
        (start, 5 * MIB),
        (3 * REGISTER_PIECE, REGISTER_PIECE),
        (4 * REGISTER_PIECE, REGISTER_PIECE),
        (5 * REGISTER_PIECE, 2 * MIB),
    ]
    assert _pieces(REGISTER_PIECE, REGISTER_PIECE) == [(REGISTER_PIECE, REGISTER_PIECE)]
    assert _pieces(10, 0) == []


def _straddling_host(nbytes: int) -> torch.Tensor:
    """A host uint8 tensor of ``nbytes`` that crosses a multiple of ``REGISTER_PIECE``."""
    backing = torch.empty(REGISTER_PIECE + nbytes, dtype=torch.uint8)
    boundary = -(-backing.data_ptr() // REGISTER_PIECE) * REGISTER_PIECE
    at = boundary - backing.data_ptr() - nbytes // 2
    return backing[at : at + nbytes]


def test_a_copy_across_a_piece_boundary_is_cut_there_in_both_directions():
    host = _straddling_host(8 * MIB).view(torch.float32)
    device = torch.empty(host.shape, dtype=torch.float32, device="meta")
    for dst, src in ((device, host), (host, device)):
        pairs = _cut(dst, src)
        assert len(pairs) == 2
        hosts = [s if s.device.type == "cpu" else d for d, s in pairs]
        assert [h.numel() for h in hosts] == [4 * MIB, 4 * MIB]
        assert hosts[0].data_ptr() == host.data_ptr()
        assert (hosts[1].data_ptr() % REGISTER_PIECE, hosts[1].data_ptr()) == (0, host.data_ptr() + 4 * MIB)
        for d, s in pairs:
            assert d.dtype == s.dtype == torch.uint8 and d.shape == s.shape


def test_a_copy_inside_one_piece_or_between_like_memory_is_left_whole():
    host = _straddling_host(8 * MIB)
    inside = host[: 2 * MIB]
    device = torch.empty(2 * MIB, dtype=torch.uint8, device="meta")
    ((dst, src),) = _cut(device, inside)
    assert dst is device and src is inside
    other = host.clone()
    ((dst, src),) = _cut(host, other)  # host to host: no registration involved
    assert dst is host and src is other


def test_a_converting_copy_from_host_memory_across_pieces_reads_a_pageable_copy():
    host = _straddling_host(8 * MIB).view(torch.float16)
    device = torch.empty(host.shape, dtype=torch.float32, device="meta")
    ((dst, src),) = _cut(device, host)
    assert dst is device and src.dtype == torch.float16 and src.data_ptr() != host.data_ptr()
    assert torch.equal(src, host)


def test_without_cuda_nothing_is_registered(tmp_path: Path):
    if cuda.available():
        pytest.skip("this machine has CUDA")
    f = MappedFile.create(tmp_path / "data.bin", 4 * MIB)
    try:
        assert cuda.register(f.address, f.size) == []
        assert f.register() is False
    finally:
        f.close()


def test_pinning_follows_the_faulting_piece_by_piece_and_waits_only_for_its_own_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    span = 1 * MIB  # faulted at a time
    monkeypatch.setattr(shardfile, "_AHEAD_SPAN", span)
    f = MappedFile.open(_sized(tmp_path / "data.bin", 3 * span), populate=False)
    faulted: list[tuple[int, int]] = []
    hold = threading.Event()
    real = shardfile._populate

    def populate(mm, address, start, length, *, write):  # every span after the first waits for the test
        if start > 0:
            assert hold.wait(10)
        real(mm, address, start, length, write=write)
        faulted.append((start, length))

    monkeypatch.setattr(shardfile, "_populate", populate)
    try:
        ahead = _FaultAhead(f._mapping, f.address, f.size, write=True)
        first = min(f.size, -(-(f.address + 1) // span) * span - f.address)
        ahead.wait_for(f.address, first)  # the first piece is faulted: no wait for the rest
        assert faulted and faulted[0][0] == 0 and sum(n for _, n in faulted) == first < f.size
        waited = threading.Thread(target=ahead.wait_for, args=(f.address + f.size - 1, 1))
        waited.start()
        waited.join(0.2)
        assert waited.is_alive()  # the last piece is not faulted while the faulting is held
        hold.set()
        waited.join(10)
        assert not waited.is_alive()
        ahead.finish()
        assert [start for start, _ in faulted] == sorted(start for start, _ in faulted)
        assert sum(n for _, n in faulted) == f.size and ahead.seconds > 0
    finally:
        hold.set()
        f.close()


def test_a_faulting_that_fails_lets_the_pinning_go_on_and_reports_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    f = MappedFile.open(_sized(tmp_path / "data.bin", 4 * MIB), populate=False)

    def populate(mm, address, start, length, *, write):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(shardfile, "_populate", populate)
    try:
        ahead = _FaultAhead(f._mapping, f.address, f.size, write=True)
        ahead.wait_for(f.address + f.size - 1, 1)  # does not hang
        with pytest.raises(OSError, match="Cannot allocate memory"):
            ahead.finish()
    finally:
        f.close()


def test_preparing_without_cuda_faults_the_mapping_and_pins_nothing(tmp_path: Path):
    if cuda.available():
        pytest.skip("this machine has CUDA")
    f = MappedFile.open(_sized(tmp_path / "data.bin", 4 * MIB), populate=False)
    try:
        assert f.prepare() == 0.0
        assert f.populated and not f.registered
    finally:
        f.close()


def _sized(path: Path, size: int) -> Path:
    with path.open("wb") as out:
        out.truncate(size)
    return path


# ----------------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
def test_a_mapping_faulted_ahead_of_its_pinning_is_pinned_and_takes_copies_bit_exact(root: Path):
    f = MappedFile.open(_sized(root / "data.bin", 3 * REGISTER_PIECE + 8192), populate=False)
    paused: list[float] = []
    try:
        assert f.prepare(pace=paused.append) > 0
        assert f.populated and f.registered and len(paused) >= 3
        src = torch.randint(0, 255, (3 * REGISTER_PIECE,), dtype=torch.uint8, device="cuda")
        window = f.buffer[4096 : 4096 + src.numel()]
        cuda.copy(window, src, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(window, src.cpu())
    finally:
        f.close()


@pytest.mark.gpu
def test_a_mapping_pinned_in_paced_pieces_takes_copies_across_them_bit_exact(root: Path):
    f = MappedFile.create(root / "data.bin", 3 * REGISTER_PIECE + 4096)
    paused = []
    try:
        assert f.register(pace=paused.append)
        assert len(paused) >= 3 and all(took >= 0 for took in paused)
        src = torch.randint(0, 255, (2 * REGISTER_PIECE + 12345,), dtype=torch.uint8, device="cuda")
        window = f.buffer[4096 + 7 : 4096 + 7 + src.numel()]  # crosses two or three boundaries
        cuda.copy(window, src, non_blocking=True)
        torch.cuda.synchronize()
        back = torch.empty_like(src)
        cuda.copy(back, window, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, src) and torch.equal(window, src.cpu())
        boundary = -(-f.address // REGISTER_PIECE) * REGISTER_PIECE - f.address + REGISTER_PIECE
        halves = f.buffer[boundary - 2 * MIB : boundary + 2 * MIB].view(torch.float16)
        halves.copy_(torch.randn(halves.shape, dtype=torch.float16))  # finite values: NaN != NaN
        wide = torch.empty(halves.shape, dtype=torch.float32, device="cuda")
        cuda.copy(wide, halves)  # converting, across a boundary
        assert torch.equal(wide.cpu(), halves.float())
    finally:
        f.close()


@pytest.mark.gpu
@pytest.mark.parametrize("device_staging", [True, False])
def test_a_state_larger_than_a_piece_round_trips_through_paced_slots(
    root: Path, job: str, device_staging: bool
):
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(25 * MIB // 4 * 4 + i, device="cuda") for i in range(6)}  # 600 MiB
    state["small"] = torch.randn(7, device="cuda")
    with Checkpointer(root=root, job=job, device_staging=device_staging) as ck:
        for step in (1, 2, 3):
            ck.save(step, state, blocking=True)
        ck._registering.result()
        warm = ck._pool.last_warm_up
        assert warm["register_s"] >= warm["register_busy_s"] > 0  # paced: pauses between the pieces
        for step in (2, 3):
            assert all(f.registered for f in ck._pool.slot_of(step).files)
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.load(dest) == 3
        assert_same(state, dest)
