"""Everything CUDA-specific, with a clean fallback when there is no GPU (or no CUDA build of torch).

* ``register``/``unregister``: pin an existing host mapping (a tmpfs shard file) with
  ``cudaHostRegister``, so device-to-host copies DMA straight into the ramdisk at pinned speed.
* ``copy_to_host``: issue ``dst.copy_(src, non_blocking=True)`` for every CUDA source on a side
  stream of its device (after that stream waits for the device's current stream), and return a
  ``CopyTicket`` of one event per device. ``copy_to_device`` is the way back, for restore.
* ``CopyTicket``: wait on the CPU (``synchronize``) or make a stream wait on the GPU (``block_stream``),
  which is what the overlap mode's optimizer hook does: training continues and only the parameter
  update is ordered after the snapshot copy.

Nothing here is called unless a tensor actually lives on a CUDA device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

__all__ = [
    "CopyTicket",
    "available",
    "copy_to_device",
    "copy_to_host",
    "in_use",
    "is_cuda",
    "register",
    "unregister",
]

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_READ_ONLY = 8
_side_streams: dict[int, torch.cuda.Stream] = {}


def available() -> bool:
    return torch.cuda.is_available()


def in_use() -> bool:
    """True once this process has initialised CUDA (its mappings are then worth pinning)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def is_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def register(address: int, nbytes: int, *, read_only: bool = False) -> bool:
    """Page-lock ``nbytes`` of host memory at ``address`` for DMA. False (and a log line) if refused."""
    if nbytes == 0 or not available():
        return False
    flags = _HOST_REGISTER_PORTABLE | (_HOST_REGISTER_READ_ONLY if read_only else 0)
    err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags))
    if err != 0:
        log.warning(
            "cudaHostRegister of %d bytes failed (cudaError %d); copies to it run at pageable speed",
            nbytes,
            err,
        )
        return False
    return True


def unregister(address: int) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(address))
    if err != 0:
        log.warning("cudaHostUnregister failed (cudaError %d)", err)


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


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src, non_blocking=True)`` for each pair, in one dispatch when torch allows."""
    try:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
    except (RuntimeError, TypeError, AttributeError):
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=True)


def copy_to_host(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> CopyTicket:
    """Copy CUDA ``srcs`` into host ``dsts`` on a side stream per device; returns their ticket.

    Each side stream first waits for its device's current stream, so the copies see every update
    queued before the call. The caller keeps ``srcs`` alive until the ticket is synchronised.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, src in enumerate(srcs):
        by_device.setdefault(src.device, []).append(i)
    events = []
    for device, indices in by_device.items():
        stream = _side_stream(device)
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                _copy_all([dsts[i] for i in indices], [srcs[i] for i in indices])
                event = torch.cuda.Event()
                event.record(stream)
        events.append((device, event))
    return CopyTicket(events)


def copy_to_device(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Copy host ``srcs`` (pinned: asynchronously) into CUDA ``dsts`` on each device's current stream,
    then wait for them. Used by restore, from the registered mapping of a data file."""
    by_device: dict[torch.device, list[int]] = {}
    for i, dst in enumerate(dsts):
        by_device.setdefault(dst.device, []).append(i)
    for device, indices in by_device.items():
        with torch.cuda.device(device):
            _copy_all([dsts[i] for i in indices], [srcs[i] for i in indices])
    for device in by_device:
        torch.cuda.current_stream(device).synchronize()
