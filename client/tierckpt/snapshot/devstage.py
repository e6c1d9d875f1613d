"""Device staging: a device-to-device snapshot of what the device-to-host copy cannot hide.

In overlap mode the optimizer-owned tensors are copied to the host while the next forward and backward
passes run, and the optimizer waits for what is left. When that copy takes longer than forward and
backward (10 GiB at 50 GB/s is 0.2 s; a step's forward and backward may take 0.1 s), the optimizer
waits. Device staging copies that remainder, and only that, into spare device memory first (at
device-to-device speed: milliseconds), lets the optimizer go, and drains the staging buffer to the
ramdisk in the background.

How much to stage (``plan_staging``, pure): the D2H copy can hide ``bandwidth x window x safety``
bytes, where ``CopyClock`` measures the window (the GPU time from the end of an optimizer step to the
start of the next, with CUDA events recorded by the optimizer's hooks) and the bandwidth (timing
events around each save's copies). The tail of the optimizer-owned bytes beyond that is staged; so
is every other CUDA tensor (those the forward pass may change: staging them lets ``save`` return
without waiting). Nothing is known before the first measurements: then everything that fits is staged.

The budget (``device_budget``: bytes, or a fraction of the device memory this process's peak has not
needed so far, ``cuda.headroom``) caps the staging buffer strictly; the buffer is kept between saves and
never grows past the budget. Whatever does not fit falls back to overlap mode (the optimizer waits
for it on the GPU, or ``save`` waits for non-optimizer tensors), and the reason is logged whenever it
changes. The staging buffer is released when the budget shrinks below it, and when an allocation fails.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence

import torch

from tierckpt import cuda
from tierckpt.protocol.format import ALIGNMENT, align_up

__all__ = ["CopyClock", "DeviceStager", "Piece", "StagePlan", "plan_staging"]

log = logging.getLogger(__name__)

SAFETY = 0.8
"""Share of the measured window the D2H copy is trusted to use."""
STAGE_ALIGN = 4096
"""Staged pieces start at multiples of this in the staging buffer."""
SPLIT_GRANULE = 64 << 20
"""A tensor split between direct and staged copies is cut at a multiple of this, and the bytes the copy
can hide are rounded down to it: the split stays put from save to save while measurements jitter."""
_GROW = 64 << 20
"""The staging buffer grows in steps of this (so estimates that jitter do not reallocate it)."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + length)`` of tensor ``index``."""

    index: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How one device's tensors are copied by a device-staged snapshot."""

    blocking: tuple[Piece, ...]
    """Device-to-host before ``save`` returns: unprotected tensors the budget cannot stage."""
    direct: tuple[Piece, ...]
    """Device-to-host while forward and backward run; the optimizer's next step waits for them."""
    staged: tuple[Piece, ...]
    """Device-to-device into the staging buffer now, drained to the host later."""
    offsets: tuple[int, ...]
    """Where each staged piece starts in the staging buffer."""
    staging_bytes: int
    wanted_bytes: int
    """What staging would take without the budget."""

    @property
    def staged_bytes(self) -> int:
        return sum(p.length for p in self.staged)


def plan_staging(
    sizes: Sequence[int],
    protected: Sequence[bool],
    splittable: Sequence[bool],
    *,
    hidden: int,
    budget: int,
) -> StagePlan:
    """Split tensors of ``sizes`` bytes between blocking, direct and staged copies (pure).

    Unprotected tensors (the forward pass may change them) are staged whole while the budget lasts,
    else copied before ``save`` returns. Of the protected ones (only the optimizer changes them), the
    first ``hidden`` bytes in order are copied directly, and the tail beyond is staged, whole tensors
    from the end, the boundary tensor split if ``splittable``, as far as the budget goes; the rest is
    copied directly too (the optimizer will wait for it).
    """
    left = max(0, budget)
    staged: dict[int, Piece] = {}
    blocking = []
    for i, (n, guarded) in enumerate(zip(sizes, protected, strict=True)):
        if guarded or n == 0:
            continue
        if align_up(n, STAGE_ALIGN) <= left:
            staged[i] = Piece(i, 0, n)
            left -= align_up(n, STAGE_ALIGN)
        else:
            blocking.append(Piece(i, 0, n))
    guarded_total = sum(n for n, g in zip(sizes, protected, strict=True) if g)
    wanted = max(0, guarded_total - max(0, hidden))
    unguarded = sum(n for n, g in zip(sizes, protected, strict=True) if not g)
    todo = min(wanted, left)
    direct: dict[int, Piece] = {}
    for i in reversed(range(len(sizes))):
        n = sizes[i]
        if not protected[i] or n == 0:
            continue
        if todo <= 0:
            direct[i] = Piece(i, 0, n)
            continue
        if not splittable[i] or n <= todo:  # whole, if the budget holds it (overshooting ``todo`` is fine)
            if align_up(n, STAGE_ALIGN) <= left:
                staged[i] = Piece(i, 0, n)
                left -= align_up(n, STAGE_ALIGN)
                todo -= n
            else:
                direct[i] = Piece(i, 0, n)
            continue
        cut = max((n - todo) // SPLIT_GRANULE, -(-(n - left) // SPLIT_GRANULE), 0) * SPLIT_GRANULE
        tail = n - cut
        if cut >= n or (cut == 0 and align_up(n, STAGE_ALIGN) > left):
            direct[i] = Piece(i, 0, n)
            continue
        if cut == 0:
            staged[i] = Piece(i, 0, n)
            left -= align_up(n, STAGE_ALIGN)
            todo -= n
            continue
        direct[i] = Piece(i, 0, n - tail)
        staged[i] = Piece(i, n - tail, tail)
        left -= align_up(tail, STAGE_ALIGN)
        todo -= tail
    order = sorted(staged)
    offsets, at = [], 0
    for i in order:
        offsets.append(at)
        at += align_up(staged[i].length, STAGE_ALIGN)
    return StagePlan(
        blocking=tuple(blocking),
        direct=tuple(direct[i] for i in sorted(direct)),
        staged=tuple(staged[i] for i in order),
        offsets=tuple(offsets),
        staging_bytes=at,
        wanted_bytes=wanted + unguarded,
    )


class CopyClock:
    """Measures, per device, the GPU time between optimizer steps and the device-to-host bandwidth.

    ``step_finished``/``step_started`` are called by the optimizer's post- and pre-step hooks and record
    timing events on the current stream; ``snapshot_taken`` counts a save's own window (from the
    snapshot to the next step); ``copies_done`` reads a finished save's copy segments. Events are read
    only once complete, never waited for. Thread-safe.
    """

    def __init__(self, keep: int = 8) -> None:
        self._windows: dict[torch.device, collections.deque[float]] = {}
        self._rates: dict[torch.device, collections.deque[float]] = {}
        self._open: dict[torch.device, torch.cuda.Event] = {}
        self._pending: list[tuple[torch.device, torch.cuda.Event, torch.cuda.Event]] = []
        self._keep = keep
        self._lock = threading.Lock()

    def step_finished(self) -> None:
        event = cuda.mark()
        if event is not None:
            with self._lock:
                self._open[torch.device("cuda", torch.cuda.current_device())] = event

    def step_started(self) -> None:
        if not cuda.in_use():
            return
        device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            start = self._open.pop(device, None)
        if start is None:
            return
        end = cuda.mark()
        assert end is not None
        with self._lock:
            self._pending.append((device, start, end))
            del self._pending[: -4 * self._keep]
        self._settle()

    def snapshot_taken(self, device: torch.device, event: torch.cuda.Event) -> None:
        """A save's snapshot point: the window from it to the next step counts too."""
        with self._lock:
            self._open[device] = event

    def copies_done(self, segments: Sequence[cuda.Segment]) -> None:
        """Record the bandwidth of a finished save's copy segments (their events have completed)."""
        best: dict[torch.device, tuple[int, float]] = {}
        for seg in segments:
            if seg.nbytes < (16 << 20):
                continue
            seconds = seg.start.elapsed_time(seg.end) / 1e3
            if seconds > 0 and seg.nbytes > best.get(seg.device, (0, 0.0))[0]:
                best[seg.device] = (seg.nbytes, seconds)
        with self._lock:
            for device, (n, seconds) in best.items():
                self._rates.setdefault(device, collections.deque(maxlen=4)).append(n / seconds)

    def _settle(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        keep = []
        for device, start, end in pending:
            if end.query():
                seconds = start.elapsed_time(end) / 1e3
                with self._lock:
                    self._windows.setdefault(device, collections.deque(maxlen=self._keep)).append(seconds)
            else:
                keep.append((device, start, end))
        with self._lock:
            self._pending = keep + self._pending

    def window(self, device: torch.device) -> float | None:
        """The shortest recent window (seconds), None before any was measured."""
        self._settle()
        with self._lock:
            windows = self._windows.get(device)
            return min(windows) if windows else None

    def bandwidth(self, device: torch.device) -> float | None:
        """Recent device-to-host bandwidth in bytes per second (median), None before a measurement."""
        with self._lock:
            rates = sorted(self._rates.get(device, ()))
        return rates[len(rates) // 2] if rates else None

    def hidden_bytes(self, device: torch.device) -> int:
        """Bytes a device-to-host copy started at a save finishes before the next optimizer step."""
        window, rate = self.window(device), self.bandwidth(device)
        if window is None or rate is None:
            return 0
        return int(rate * window * SAFETY) // SPLIT_GRANULE * SPLIT_GRANULE


class DeviceStager:
    """The staging buffer of each device, the budget, and the device-staged copies of a save."""

    def __init__(self, budget: int | float) -> None:
        self.budget = budget
        self.clock = CopyClock()
        self.last: dict[str, float] = {}
        """The last snapshot: ``staged_bytes``, ``direct_bytes``, ``blocking_bytes``, ``wanted_bytes``,
        ``allowed_bytes``, ``window_s``, ``d2h_gbps`` (summed or taken over its devices)."""
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._layouts: dict[torch.device, tuple[int, tuple[tuple[Piece, int], ...] | None]] = {}
        """What each buffer's bytes are laid out for (so padding is zeroed only when it changes)."""
        self._reasons: dict[torch.device, str] = {}

    @property
    def device_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def allowed(self, device: torch.device) -> int:
        """Bytes of staging the budget allows on ``device`` now (never more than the headroom)."""
        held = self._buffers[device].numel() if device in self._buffers else 0
        room = cuda.headroom(device) + held
        if isinstance(self.budget, float):
            return int(self.budget * room)
        return min(self.budget, room)

    def _buffer(self, device: torch.device, need: int, allowed: int) -> torch.Tensor | None:
        held = self._buffers.get(device)
        roomy = align_up(need * 5 // 4, _GROW) + _GROW
        if held is not None and (held.numel() > allowed or held.numel() > roomy):
            del self._buffers[device]  # over the budget now, or well over what is needed: give it back
            held = None
        if need == 0:
            return None
        if held is not None and held.numel() >= need:
            return held
        size = min(allowed, align_up(need, _GROW))
        self._buffers.pop(device, None)
        try:
            buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            self._note(device, f"could not allocate {size} bytes of staging; overlap mode for this save")
            return None
        self._buffers[device] = buffer
        self._layouts[device] = (buffer.data_ptr(), None)  # all zero: fits any layout once
        return buffer

    def _note(self, device: torch.device, reason: str | None) -> None:
        """Log ``reason`` when it differs from the last one for ``device`` (None: all is staged again)."""
        if self._reasons.get(device) == reason:
            return
        if reason is None:
            self._reasons.pop(device, None)
            log.info("device staging on %s: everything that needs staging is staged again", device)
            return
        self._reasons[device] = reason
        log.warning("device staging on %s: %s", device, reason)

    def snapshot(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        protected: Sequence[bool],
        packs: Sequence[cuda.PackedCopy],
    ) -> cuda.StagedTicket:
        """Issue the device-staged copies of CUDA ``srcs`` into host ``dsts`` (and the ``packs``)."""
        by_device: dict[torch.device, list[int]] = {}
        for i, src in enumerate(srcs):
            by_device.setdefault(src.device, []).append(i)
        for p in packs:
            by_device.setdefault(p.device, [])
        parts = []
        last = dict.fromkeys(
            ("staged_bytes", "direct_bytes", "blocking_bytes", "wanted_bytes", "allowed_bytes"), 0.0
        )
        for device, indices in by_device.items():
            sizes = [srcs[i].numel() * srcs[i].element_size() for i in indices]
            splittable = [srcs[i].is_contiguous() and dsts[i].is_contiguous() for i in indices]
            guarded = [protected[i] for i in indices]
            hidden = self.clock.hidden_bytes(device)
            allowed = self.allowed(device)
            plan = plan_staging(sizes, guarded, splittable, hidden=hidden, budget=allowed)
            buffer = self._buffer(device, plan.staging_bytes, allowed)
            if buffer is None and plan.staging_bytes:
                plan = plan_staging(sizes, guarded, splittable, hidden=hidden, budget=0)
            elif plan.staged_bytes < plan.wanted_bytes:
                self._note(
                    device,
                    f"{plan.wanted_bytes} bytes should be staged, the budget allows {allowed} "
                    f"(device_budget={self.budget!r} of {cuda.headroom(device)} bytes of headroom): the "
                    "rest is copied in overlap mode (the optimizer, or save, waits for it)",
                )
            elif device in self._reasons:
                self._note(device, None)
            parts.append(self._copies(device, plan, indices, dsts, srcs, buffer, packs))
            window = self.clock.window(device)
            rate = self.clock.bandwidth(device)
            last["staged_bytes"] += plan.staged_bytes
            last["direct_bytes"] += sum(p.length for p in plan.direct)
            last["blocking_bytes"] += sum(p.length for p in plan.blocking)
            last["wanted_bytes"] += plan.wanted_bytes
            last["allowed_bytes"] += allowed
            last["window_s"] = -1.0 if window is None else window
            last["d2h_gbps"] = -1.0 if rate is None else rate / 1e9
        self.last = last
        ticket = cuda.copy_staged(parts)
        for device, event in ticket.started:
            self.clock.snapshot_taken(device, event)
        return ticket

    def _copies(
        self,
        device: torch.device,
        plan: StagePlan,
        indices: Sequence[int],
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        buffer: torch.Tensor | None,
        packs: Sequence[cuda.PackedCopy],
    ) -> cuda.StagedCopies:
        """The copies of ``plan``. Staged pieces that lie next to each other in a data file (only padding
        between them, as the tail of a layout does) form a *run*: the staging buffer mirrors the run's
        file bytes, padding included (kept zero), so the whole run drains with one DMA."""

        def pair(piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
            dst, src = dsts[indices[piece.index]], srcs[indices[piece.index]]
            if piece.start == 0 and piece.length == src.numel() * src.element_size():
                return dst, src
            end = piece.start + piece.length
            return _bytes(dst)[piece.start : end], _bytes(src)[piece.start : end]

        staged, drain = [], []
        if plan.staged:
            assert buffer is not None
            placed = []  # (storage base, host address, piece, dst, src)
            for piece in plan.staged:
                dst, src = pair(piece)
                placed.append((dst.untyped_storage().data_ptr(), dst.data_ptr(), piece, dst, src))
            placed.sort(key=lambda p: (p[0], p[1]))
            runs: list[list[tuple[int, int, Piece, torch.Tensor, torch.Tensor]]] = []
            for item in placed:
                last = runs[-1][-1] if runs else None
                if (
                    last is not None
                    and last[0] == item[0]
                    and 0 <= item[1] - (last[1] + last[2].length) < ALIGNMENT
                ):
                    runs[-1].append(item)
                else:
                    runs.append([item])
            at, layout = 0, []
            for run in runs:
                base, start = run[0][0], run[0][1]
                length = run[-1][1] + run[-1][2].length - start
                host = torch.empty(0, dtype=torch.uint8).set_(
                    run[0][3].untyped_storage(), start - base, torch.Size((length,)), (1,)
                )
                drain.append((host, buffer[at : at + length]))
                for _, address, piece, dst, src in run:
                    offset = at + address - start
                    region = buffer[offset : offset + piece.length]
                    slot = (
                        region
                        if dst.dtype == torch.uint8 and dst.dim() == 1
                        else region.view(src.dtype).view(src.shape)
                    )
                    staged.append((slot, src))
                    layout.append((piece, offset))
                at = align_up(at + length, STAGE_ALIGN)
            key = tuple(layout)
            known = self._layouts.get(device)
            if known is None or known[0] != buffer.data_ptr() or known[1] not in (None, key):
                buffer.zero_()  # a new layout: old bytes may sit where padding goes now
            self._layouts[device] = (buffer.data_ptr(), key)
        return cuda.StagedCopies(
            device=device,
            blocking=[pair(p) for p in plan.blocking],
            direct=[pair(p) for p in plan.direct],
            staged=staged,
            drain=drain,
            packs=[p for p in packs if p.device == device],
            staging=buffer,
        )

    def close(self) -> None:
        self._buffers.clear()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)
