"""Everything CUDA-specific, with a clean fallback when there is no GPU (or no CUDA build of torch).

* ``register``/``unregister``: pin an existing host mapping (a tmpfs shard file) with
  ``cudaHostRegister``, so device-to-host copies DMA straight into the ramdisk at pinned speed. It pins
  in pieces (``REGISTER_PIECE``) and can pause between them (``pace``): a registration holds up every
  CUDA call of the process that waits on the device for as long as it runs, so a background one that
  never pauses stalls a training step by its whole duration. CUDA refuses a copy that spans two
  registrations, so every host copy here is cut at the pieces' boundaries (``copy``, ``_copy_all``).
* ``copy_to_host``: issue ``dst.copy_(src, non_blocking=True)`` for every CUDA source on a side
  stream of its device (after that stream waits for the device's current stream), and return a
  ``CopyTicket`` of one event per device. ``copy_to_device`` is the way back, for restore.
* packed copies (``PackedCopy``): many small tensors of one device are gathered by a few fused
  device-to-device ``_foreach_copy_`` kernels into a persistent staging buffer laid out exactly like
  their region of the data file, then moved by ONE DMA (``copy_to_host(..., packed=...)``); restore
  does the reverse (``scatter_from_host``). This removes the ~10 µs per-copy cost of thousands of
  small DMAs.
* ``copy_through_bounce``: host-to-device copies from memory that is *not* registered (a cold
  restore), pipelined through a few reusable pinned bounce buffers filled by parallel memcpy.
* ``CopyTicket``: wait on the CPU (``synchronize``) or make a stream wait on the GPU (``block_stream``),
  which is what the overlap mode's optimizer hook does: training continues and only the parameter
  update is ordered after the snapshot copy.
* ``stage_on_device`` / ``drain_to_host``: the device-staged snapshot (``snapshot.devstage`` plans it):
  device-to-device copies into a staging buffer on the *current* stream (ordered before anything
  training queues later, no wait at all) and any direct device-to-host copies on the side stream; later,
  from the commit thread, the staging buffer drained to the host on the side stream. Timing events
  around the copies and the training steps (``mark``) feed the plan of the next save.
* ``headroom``: device memory the process can take without pushing its own peak into an OOM.

Nothing here is called unless a tensor actually lives on a CUDA device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "BOUNCE_BYTES",
    "REGISTER_PIECE",
    "CopyTicket",
    "Gather",
    "PackedCopy",
    "Segment",
    "Snapshot",
    "available",
    "copy",
    "copy_through_bounce",
    "copy_to_device",
    "copy_to_host",
    "current_device",
    "drain_to_host",
    "flat_bytes",
    "gather",
    "headroom",
    "in_use",
    "is_cuda",
    "mark",
    "plan_gather",
    "register",
    "scatter_from_host",
    "stage_on_device",
    "synchronize",
    "unregister",
]

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_READ_ONLY = 8
_side_streams: dict[int, torch.cuda.Stream] = {}
BOUNCE_BYTES = 64 << 20
"""Size of one pinned bounce buffer (``copy_through_bounce`` keeps ``_BOUNCE_COUNT`` of them)."""
_BOUNCE_COUNT = 3
_bounce: list[torch.Tensor] = []


def available() -> bool:
    return torch.cuda.is_available()


def in_use() -> bool:
    """True once this process has initialised CUDA (its mappings are then worth pinning)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def is_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def current_device() -> int | None:
    """The calling thread's CUDA device, None when this process has not initialised CUDA."""
    return torch.cuda.current_device() if in_use() else None


REGISTER_PIECE = 128 << 20
"""Host memory is pinned in pieces that end at multiples of this address: 3 to 9 ms each on an H200 host
(0.02-0.07 s/GiB with huge pages, 0.04 without), so a paced background registration holds up the
training thread's CUDA calls for milliseconds at a time instead of for the whole slot."""


def _pieces(address: int, nbytes: int) -> list[tuple[int, int]]:
    """``[address, address + nbytes)`` cut at multiples of ``REGISTER_PIECE``: (start, length) pairs."""
    out = []
    end = address + nbytes
    while address < end:
        cut = min(end, (address // REGISTER_PIECE + 1) * REGISTER_PIECE)
        out.append((address, cut - address))
        address = cut
    return out


def register(
    address: int,
    nbytes: int,
    *,
    read_only: bool = False,
    device: int | None = None,
    pace: Callable[[float], None] | None = None,
    before: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Page-lock ``nbytes`` of host memory at ``address`` for DMA, in ``device``'s context (a background
    thread would otherwise create a context on device 0), piece by piece (``REGISTER_PIECE``), calling
    ``before(start, length)`` before each (e.g. to wait until its pages are faulted) and ``pace(seconds
    the piece took)`` after each (a background caller sleeps there, so the training thread's CUDA calls
    get through). Returns the pieces' addresses for ``unregister``; an empty list (and a log line) if
    CUDA refuses, with nothing left pinned."""
    if nbytes == 0 or not available():
        return []
    flags = _HOST_REGISTER_PORTABLE | (_HOST_REGISTER_READ_ONLY if read_only else 0)
    done: list[int] = []
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        for start, length in _pieces(address, nbytes):
            if before is not None:
                before(start, length)
            began = time.perf_counter()
            err = int(torch.cuda.cudart().cudaHostRegister(start, length, flags))
            if err != 0:
                log.warning(
                    "cudaHostRegister of %d bytes failed (cudaError %d); copies to it run at pageable speed",
                    nbytes,
                    err,
                )
                unregister(done)
                return []
            done.append(start)
            if pace is not None:
                pace(time.perf_counter() - began)
    return done


def unregister(pieces: Sequence[int]) -> None:
    """Unpin what ``register`` pinned (the addresses it returned)."""
    for address in pieces:
        err = int(torch.cuda.cudart().cudaHostUnregister(address))
        if err != 0:
            log.warning("cudaHostUnregister failed (cudaError %d)", err)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)


def _cut(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)``, a copy between host and device memory, as copies that each stay inside one
    ``REGISTER_PIECE`` of host memory (CUDA refuses a copy across two registrations: "invalid
    argument"). A pair that cannot be cut byte for byte (a dtype conversion, a strided side) goes through
    pageable memory instead: a copy of the host source, or, for a host destination, a copy done here."""
    host = src if src.device.type == "cpu" else dst
    if not _crosses(dst, src):
        return [(dst, src)]
    nbytes = host.numel() * host.element_size()
    same = dst.dtype == src.dtype and dst.shape == src.shape and host.is_contiguous()
    if same and (host is dst or dst.is_contiguous()):
        start = host.data_ptr()
        d, s = flat_bytes(dst), flat_bytes(src.contiguous())
        out = []
        for piece_start, length in _pieces(start, nbytes):
            at = piece_start - start
            out.append((d[at : at + length], s[at : at + length]))
        return out
    if host is src:
        return [(dst, src.clone(memory_format=torch.contiguous_format))]
    bounce = torch.empty(dst.shape, dtype=dst.dtype)
    bounce.copy_(src)  # into pageable memory: returns once the bytes are there
    dst.copy_(bounce)
    return []


def copy(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` between host and device memory, cut at registration boundaries (``_cut``)."""
    if _crosses(dst, src):
        _copy_all([dst], [src], non_blocking=non_blocking)
    else:
        dst.copy_(src, non_blocking=non_blocking)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


class CopyTicket:
    """Completion of a batch of asynchronous copies: one CUDA event per device involved."""

    def __init__(self, events: Sequence[tuple[torch.device, torch.cuda.Event]] = ()) -> None:
        self.events = tuple(events)

    def done(self) -> bool:
        return all(e.query() for _, e in self.events)

    def synchronize(self) -> None:
        """Block the calling thread until every copy has landed."""
        for _, e in self.events:
            e.synchronize()

    def block_stream(self) -> None:
        """Make each device's current stream wait for the copies (no CPU wait)."""
        for device, e in self.events:
            torch.cuda.current_stream(device).wait_event(e)


def _copy_all(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, non_blocking: bool = True
) -> None:
    """``dst.copy_(src, non_blocking=...)`` for each pair, in one dispatch when torch allows; host sides
    that cross a registration piece's boundary are cut there (``_cut``)."""
    if any(_crosses(d, s) for d, s in zip(dsts, srcs, strict=True)):
        cut = [pair for d, s in zip(dsts, srcs, strict=True) for pair in _cut(d, s)]
        dsts, srcs = [d for d, _ in cut], [s for _, s in cut]
    try:
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=non_blocking)
    except (RuntimeError, TypeError, AttributeError):
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=non_blocking)


def _crosses(dst: torch.Tensor, src: torch.Tensor) -> bool:
    host = src if src.device.type == "cpu" else dst
    if host.device.type != "cpu" or src.device.type == dst.device.type:
        return False
    start = host.data_ptr()
    end = start + host.numel() * host.element_size() - 1
    return end >= start and start // REGISTER_PIECE != end // REGISTER_PIECE


@dataclasses.dataclass
class PackedCopy:
    """Small tensors of one device moved as one region: ``slots[i]`` (a typed view of ``staging``)
    holds ``tensors[i]``; ``staging`` mirrors ``host`` (a uint8 region of the mapping) byte for byte."""

    staging: torch.Tensor
    host: torch.Tensor
    slots: Sequence[torch.Tensor]
    tensors: Sequence[torch.Tensor]

    @property
    def device(self) -> torch.device:
        return self.staging.device


def _fusable(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.is_contiguous()
        and b.is_contiguous()
        and not (a.is_conj() or a.is_neg() or b.is_conj() or b.is_neg())
    )


@dataclasses.dataclass(frozen=True)
class Gather:
    """Device-to-device copies planned once (``plan_gather``) and issued as often as wanted: contiguous
    pairs in one ``_foreach_copy_`` per dtype (fused multi-tensor kernels), the rest one by one."""

    fused: tuple[tuple[list[torch.Tensor], list[torch.Tensor]], ...]
    single: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def __bool__(self) -> bool:
        return bool(self.fused or self.single)

    def run(self) -> None:
        for dst, src in self.single:
            dst.copy_(src)
        for d, s in self.fused:
            _copy_all(d, s, non_blocking=False)


def plan_gather(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> Gather:
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    single = []
    for dst, src in zip(dsts, srcs, strict=True):
        if _fusable(dst, src):
            lists = by_dtype.setdefault(dst.dtype, ([], []))
            lists[0].append(dst)
            lists[1].append(src)
        elif src.numel():
            single.append((dst, src))
    return Gather(tuple(by_dtype.values()), tuple(single))


def gather(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for device pairs (see ``Gather``)."""
    plan_gather(dsts, srcs).run()


def copy_to_host(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], packed: Sequence[PackedCopy] = ()
) -> CopyTicket:
    """Copy CUDA ``srcs`` into host ``dsts`` on a side stream per device; returns their ticket.

    ``packed`` regions are gathered on the device into their staging buffer, then copied as one DMA
    each. Each side stream first waits for its device's current stream, so the copies see every
    update queued before the call. The caller keeps ``srcs`` alive until the ticket is synchronised.
    """
    by_device: dict[torch.device, tuple[list[int], list[PackedCopy]]] = {}
    for i, src in enumerate(srcs):
        by_device.setdefault(src.device, ([], []))[0].append(i)
    for p in packed:
        by_device.setdefault(p.device, ([], []))[1].append(p)
    events = []
    for device, (indices, packs) in by_device.items():
        stream = _side_stream(device)
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                if indices:  # the large DMAs first: the copy engine starts while the gathers are launched
                    _copy_all([dsts[i] for i in indices], [srcs[i] for i in indices])
                for p in packs:
                    gather(p.slots, p.tensors)
                    _copy_all([p.host], [p.staging])
                event = torch.cuda.Event()
                event.record(stream)
        events.append((device, event))
    return CopyTicket(events)


def scatter_from_host(packs: Sequence[PackedCopy]) -> None:
    """Restore's way: one H2D of each ``host`` region into its ``staging``, then fused device-to-device
    copies from the slots into the destination ``tensors`` (current stream; not waited for)."""
    for p in packs:
        with torch.cuda.device(p.device):
            _copy_all([p.staging], [p.host])
            gather(p.tensors, p.slots)


def copy_to_device(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, wait: bool = True) -> None:
    """Copy host ``srcs`` (pinned: asynchronously) into CUDA ``dsts`` on each device's current stream,
    then (``wait``) wait for them. Used by restore, from the registered mapping of a data file."""
    by_device: dict[torch.device, list[int]] = {}
    for i, dst in enumerate(dsts):
        by_device.setdefault(dst.device, []).append(i)
    for device, indices in by_device.items():
        with torch.cuda.device(device):
            _copy_all([dsts[i] for i in indices], [srcs[i] for i in indices])
    if wait:
        synchronize({d.device for d in dsts})


def headroom(device: torch.device) -> int:
    """Bytes of ``device`` memory free now that this process's peak has not needed so far: free in the
    driver plus what its caching allocator holds, less the allocator's peak. Allocating more than this
    could make a later training step run out of memory."""
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_reserved(device))


def mark() -> torch.cuda.Event | None:
    """A timing event recorded on the current stream of the current device (None without CUDA)."""
    if not in_use():
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream())
    return event


@dataclasses.dataclass(frozen=True)
class Segment:
    """A timed run of device-to-host copies: ``nbytes`` between two timing events of the side stream."""

    device: torch.device
    start: torch.cuda.Event
    end: torch.cuda.Event
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The events of one device's part of a device-staged snapshot (``stage_on_device``)."""

    start: torch.cuda.Event
    """Timing event on the current stream where the snapshot was taken."""
    staged: torch.cuda.Event
    """The device-to-device copies are done (current stream): the staging buffer may be drained."""
    blocking: torch.cuda.Event | None
    """The device-to-host copies ``save`` waits for (side stream)."""
    release: torch.cuda.Event | None
    """The direct device-to-host copies are done: the optimizer may change their sources."""
    segments: tuple[Segment, ...]


def _nbytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(src.numel() * src.element_size() for _, src in pairs)


def stage_on_device(
    device: torch.device,
    staged: Gather,
    *,
    blocking: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    direct: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    after: torch.cuda.Event | None = None,
) -> Snapshot:
    """A device-staged snapshot of one device: the ``staged`` device-to-device copies on the current
    stream, ordered after ``after`` (the staging buffer's previous drain); ``blocking`` and ``direct``
    device-to-host copies on the side stream. Returns at once."""
    current = torch.cuda.current_stream(device)
    side = _side_stream(device)
    segments = []
    blocked = released = None
    with torch.cuda.device(device), torch.no_grad():
        start = torch.cuda.Event(enable_timing=True)
        start.record(current)
        if after is not None:
            current.wait_event(after)
        staged.run()
        done = torch.cuda.Event()
        done.record(current)
        if blocking or direct:
            side.wait_event(start)
            with torch.cuda.stream(side):
                if blocking:
                    _copy_all([d for d, _ in blocking], [s for _, s in blocking])
                    blocked = torch.cuda.Event()
                    blocked.record(side)
                if direct:
                    d0 = torch.cuda.Event(enable_timing=True)
                    d0.record(side)
                    _copy_all([d for d, _ in direct], [s for _, s in direct])
                    released = torch.cuda.Event(enable_timing=True)
                    released.record(side)
                    segments.append(Segment(device, d0, released, _nbytes(direct)))
    return Snapshot(start, done, blocked, released, tuple(segments))


def drain_to_host(
    device: torch.device,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    staging: torch.Tensor,
    *,
    after: torch.cuda.Event,
) -> tuple[torch.cuda.Event, Segment]:
    """Copy ``(host, staging region)`` pairs on ``device``'s side stream once ``after`` (the snapshot's
    device-to-device copies) is done; returns the event of every byte landed and its timed segment.
    Callable from any thread; ``staging`` stays allocated until the copies are done."""
    side = _side_stream(device)
    with torch.cuda.device(device):
        side.wait_event(after)
        staging.record_stream(side)
        with torch.cuda.stream(side):
            start = torch.cuda.Event(enable_timing=True)
            start.record(side)
            _copy_all([h for h, _ in pairs], [s for _, s in pairs])
            end = torch.cuda.Event(enable_timing=True)
            end.record(side)
    return end, Segment(device, start, end, _nbytes(pairs))


def synchronize(devices: Sequence[torch.device] | set[torch.device]) -> None:
    """Wait for the current stream of each device."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _bounce_buffers() -> list[torch.Tensor]:
    if not _bounce:
        _bounce.extend(
            torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(_BOUNCE_COUNT)
        )
    return _bounce


def copy_through_bounce(
    items: Sequence[tuple[int, int, torch.Tensor]], memcpy: Callable[[int, int, int], None]
) -> None:
    """Copy ``(host address, nbytes, contiguous uint8 device tensor)`` items from pageable memory.

    Each item is cut into bounce-sized pieces; ``memcpy(dst, src, n)`` (parallel, GIL released) fills
    one pinned bounce buffer while the previous ones are DMA'd to the device; a buffer is refilled
    only once its DMA is done. Returns when every copy has landed.
    """
    buffers = _bounce_buffers()
    events: list[torch.cuda.Event | None] = [None] * len(buffers)
    devices = set()
    k = 0
    for address, nbytes, dst in items:
        devices.add(dst.device)
        for start in range(0, nbytes, BOUNCE_BYTES):
            n = min(BOUNCE_BYTES, nbytes - start)
            previous = events[k]
            if previous is not None:
                previous.synchronize()
            memcpy(buffers[k].data_ptr(), address + start, n)
            with torch.cuda.device(dst.device):
                dst[start : start + n].copy_(buffers[k][:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dst.device))
            events[k] = event
            k = (k + 1) % len(buffers)
    synchronize(devices)
