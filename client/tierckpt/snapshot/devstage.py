"""Device staging: a device-to-device snapshot, drained to the ramdisk in the background.

``save`` copies the state into spare device memory (a *staging buffer*), on the training stream, and
returns: at HBM speed that is milliseconds (10 GiB in about 4 ms on an H200), against 0.2 s for the
device-to-host copy. The buffer mirrors the data files byte for byte (padding included, kept zero), so
its *drain* to the ramdisk is a few large DMAs, issued later on a side stream by the commit thread once
the save's slot is ready: the training thread neither waits for host memory nor prepares it.

How much to stage (``plan_staging``, pure): everything, when the budget holds it. Otherwise the budget
is spent where it helps most: first on every CUDA tensor the optimizer does not own (the forward pass may
change those, so without staging ``save`` must wait for their copy) and on small ones; then on the tail
of the optimizer-owned bytes that a device-to-host copy started at the save cannot finish before the
next optimizer step. ``CopyClock`` measures that window (the GPU time from the end of an optimizer step
to the start of the next, with CUDA events recorded by the optimizer's hooks) and the bandwidth (timing
events around each save's copies). The rest is copied directly to the host while forward and backward
run, and the registered optimizer's pre-step hook orders its update after those copies (overlap mode).

The budget (``device_budget``: bytes, or a fraction of the device memory this process's peak has not
needed so far, ``cuda.headroom``) caps the staging buffer strictly; the buffer is kept between saves and
never grows past the budget. What does not fit falls back to overlap mode, and the reason is logged
whenever it changes. The buffer is released when the budget shrinks below it or an allocation fails.

What a save issues is a ``StagedSave``: the plan, the device-to-device pairs and the *runs* of the files
that the buffer mirrors. It is cached and reused while a save passes the same tensors (the same memory,
dtypes and shapes) with the same plan, so a steady save issues a few fused copy kernels and nothing more.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tierckpt import cuda
from tierckpt.protocol.format import ALIGNMENT, align_up
from tierckpt.snapshot.layout import LayoutPlan
from tierckpt.snapshot.shardfile import MappedFile

__all__ = [
    "CopyClock",
    "DeviceStager",
    "Piece",
    "Run",
    "Speculation",
    "StagePlan",
    "StagedSave",
    "plan_staging",
]

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
SMALL = 1 << 20
"""Optimizer-owned tensors up to this size are staged first, like the others: copying them one by one
to the host would cost a DMA each."""


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
    small: int = SMALL,
) -> StagePlan:
    """Split tensors of ``sizes`` bytes between blocking, direct and staged copies (pure).

    When the budget holds every tensor, everything is staged: the optimizer never waits, and the drain
    runs behind training. Otherwise, unprotected tensors (the forward pass may change them) and protected
    ones of at most ``small`` bytes are staged whole while the budget lasts, else copied before ``save``
    returns (unprotected) or directly (protected). Of the larger protected ones (only the optimizer
    changes them), the first ``hidden`` bytes in order are copied directly, and the tail beyond is
    staged, whole tensors from the end, the boundary tensor split if ``splittable``, as far as the budget
    goes; the rest is copied directly too (the optimizer will wait for it).
    """
    left = max(0, budget)
    staged: dict[int, Piece] = {}
    blocking: list[Piece] = []
    direct: dict[int, Piece] = {}
    if sum(align_up(n, STAGE_ALIGN) for n in sizes if n) <= left:
        staged = {i: Piece(i, 0, n) for i, n in enumerate(sizes) if n}
        return _staging(staged, blocking, direct, wanted=sum(sizes))
    first = [not guarded or n <= small for n, guarded in zip(sizes, protected, strict=True)]
    for i, n in enumerate(sizes):
        if not first[i] or n == 0:
            continue
        if align_up(n, STAGE_ALIGN) <= left:
            staged[i] = Piece(i, 0, n)
            left -= align_up(n, STAGE_ALIGN)
        elif protected[i]:
            direct[i] = Piece(i, 0, n)
        else:
            blocking.append(Piece(i, 0, n))
    guarded_total = sum(n for n, g, f in zip(sizes, protected, first, strict=True) if g and not f)
    wanted = max(0, guarded_total - max(0, hidden))
    unguarded = sum(n for n, f in zip(sizes, first, strict=True) if f)
    todo = min(wanted, left)
    for i in reversed(range(len(sizes))):
        n = sizes[i]
        if first[i] or n == 0:
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
    return _staging(staged, blocking, direct, wanted=wanted + unguarded)


def _staging(
    staged: dict[int, Piece], blocking: list[Piece], direct: dict[int, Piece], *, wanted: int
) -> StagePlan:
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
        wanted_bytes=wanted,
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


@dataclasses.dataclass(frozen=True)
class Run:
    """Bytes ``[offset, offset + length)`` of data file ``file``, mirrored at ``at`` in the staging buffer."""

    file: int
    offset: int
    length: int
    at: int


@dataclasses.dataclass(eq=False)
class DevicePart:
    """What one save issues on one device (cached while the same tensors are saved with the same plan)."""

    device: torch.device
    plan: StagePlan
    indices: tuple[int, ...]
    """The save's tensor indices of this device's tensors (``Piece.index`` counts within these)."""
    staged: cuda.Gather
    """The device-to-device copies into the staging buffer (planned once)."""
    runs: tuple[Run, ...]
    staging: torch.Tensor | None

    @property
    def all_staged(self) -> bool:
        return not (self.plan.blocking or self.plan.direct)

    def pieces(self, which: Sequence[Piece]) -> list[tuple[int, int, int]]:
        """``(save's tensor index, start, length)`` of ``which`` (the blocking or direct pieces)."""
        return [(self.indices[p.index], p.start, p.length) for p in which]


@dataclasses.dataclass(frozen=True)
class Speculation:
    """The last save's parts, issued again at the start of a save (``DeviceStager.speculate``)."""

    parts: list[DevicePart]
    snapshots: list[cuda.Snapshot]


class StagedSave:
    """One device-staged save: ``issue`` takes the snapshot (training thread), ``drain`` moves the staging
    buffer into the slot's files (commit thread). ``needs_host``: some bytes go straight to the host at
    the snapshot (the budget could not stage them), so the slot's views must exist before ``issue``."""

    def __init__(
        self,
        stager: DeviceStager,
        parts: list[DevicePart],
        sources: Sequence[torch.Tensor],
        issued: list[cuda.Snapshot] | None = None,
    ) -> None:
        self._stager = stager
        self.parts = parts
        self._sources = sources
        self._issued = issued
        """The snapshots of ``DeviceStager.speculate`` when it issued these very parts already."""
        self.needs_host = any(part.plan.blocking or part.plan.direct for part in parts)
        self.blocking = cuda.CopyTicket()
        """The copies ``save`` waits for."""
        self.release = cuda.CopyTicket()
        """The sources may change: the optimizer's pre-step hook makes the current stream wait for it."""
        self.landed = cuda.CopyTicket()
        """Every byte is in host memory (once drained)."""
        self.segments: tuple[cuda.Segment, ...] = ()
        self._staged: list[tuple[torch.device, torch.cuda.Event]] = []

    def issue(self, views: Sequence[torch.Tensor] | None) -> None:
        """The snapshot: device-to-device copies on the current streams, and (``needs_host``) the direct and
        blocking device-to-host copies into ``views`` (the slot's tensor views, in the save's order)."""
        if self.needs_host and views is None:
            raise ValueError("this staged save copies to the host at once: pass the slot's views")
        blocking: list[tuple[torch.device, torch.cuda.Event]] = []
        release: list[tuple[torch.device, torch.cuda.Event]] = []
        segments: list[cuda.Segment] = []
        for n, part in enumerate(self.parts):
            snap = (
                self._issued[n]
                if self._issued is not None
                else self._stager.stage(part, self._sources, views)
            )
            if snap.blocking is not None:
                blocking.append((part.device, snap.blocking))
            if snap.release is not None:
                release.append((part.device, snap.release))
            self._staged.append((part.device, snap.staged))
            self._stager.clock.snapshot_taken(part.device, snap.start)
            segments += snap.segments
        self.blocking, self.release = cuda.CopyTicket(blocking), cuda.CopyTicket(release)
        self.segments = tuple(segments)

    def drain(self, files: Sequence[MappedFile]) -> cuda.CopyTicket:
        """Issue the staging buffers' copies into ``files`` (the slot's data files) on the side streams,
        after the snapshot; returns the ticket of every byte landed (also ``landed``)."""
        landed, segments = [], []
        for part, (device, staged) in zip(self.parts, self._staged, strict=True):
            if part.staging is None or not part.runs:
                continue
            pairs = [
                (files[r.file].buffer[r.offset : r.offset + r.length], part.staging[r.at : r.at + r.length])
                for r in part.runs
            ]
            event, segment = cuda.drain_to_host(device, pairs, part.staging, after=staged)
            landed.append((device, event))
            segments.append(segment)
            self._stager.last_drain[device] = event
        self.landed = cuda.CopyTicket(landed)
        self.segments += tuple(segments)
        return self.landed


def _pair(dst: torch.Tensor, src: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)``, or their byte ranges ``[start, start + length)`` for a piece of a split tensor."""
    if start == 0 and length == src.numel() * src.element_size():
        return dst, src
    return cuda.flat_bytes(dst)[start : start + length], cuda.flat_bytes(src)[start : start + length]


class DeviceStager:
    """The staging buffer of each device, the budget, and the cached program of the last save."""

    def __init__(self, budget: int | float) -> None:
        self.budget = budget
        self.clock = CopyClock()
        self.last: dict[str, float] = {}
        """The last snapshot: ``staged_bytes``, ``direct_bytes``, ``blocking_bytes``, ``wanted_bytes``,
        ``allowed_bytes``, ``window_s``, ``d2h_gbps`` (summed or taken over its devices)."""
        self.last_drain: dict[torch.device, torch.cuda.Event] = {}
        """Each device's newest drain: the next snapshot into that buffer is ordered after it."""
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._layouts: dict[torch.device, tuple[int, tuple[Run, ...]]] = {}
        """What each buffer's bytes are laid out for (so padding is zeroed only when it changes)."""
        self._reasons: dict[torch.device, str] = {}
        self._cached: tuple[tuple[Any, ...], list[DevicePart]] | None = None

    @property
    def device_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def stage(
        self, part: DevicePart, sources: Sequence[torch.Tensor], views: Sequence[torch.Tensor] | None
    ) -> cuda.Snapshot:
        """Issue ``part``'s snapshot (its host copies into ``views``), after the buffer's last drain."""

        def to_host(pieces: Sequence[Piece]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            if not pieces:
                return []
            assert views is not None
            return [_pair(views[i], sources[i], start, n) for i, start, n in part.pieces(pieces)]

        return cuda.stage_on_device(
            part.device,
            part.staged,
            blocking=to_host(part.plan.blocking),
            direct=to_host(part.plan.direct),
            after=self.last_drain.get(part.device),  # the buffer is free once drained
        )

    def speculate(self) -> Speculation | None:
        """Issue the last save's device-to-device copies now, before this save has flattened and planned
        its state: a loop saves the same tensors every time, so the GPU copies while the CPU plans. Pass
        the result to ``plan``: if it finds other tensors, their copies are issued again (the buffer is
        simply overwritten)."""
        cached = self._cached
        if cached is None or not all(part.all_staged for part in cached[1]):
            return None
        parts = cached[1]
        return Speculation(parts, [self.stage(part, (), None) for part in parts])

    def allowed(self, device: torch.device) -> int:
        """Bytes of staging the budget allows on ``device`` now (never more than the headroom)."""
        held = self._buffers[device].numel() if device in self._buffers else 0
        room = cuda.headroom(device) + held
        if isinstance(self.budget, float):
            return int(self.budget * room)
        return min(self.budget, room)

    def plan(
        self,
        layout: LayoutPlan,
        tensors: Sequence[torch.Tensor],
        protected: Sequence[bool],
        speculation: Speculation | None = None,
    ) -> StagedSave:
        """The staged save of ``tensors`` (``layout``'s, in order; CUDA ones are staged, the others are the
        caller's) with ``protected`` flags (tensors only a registered optimizer's step changes)."""
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.is_cuda and t.numel():
                by_device.setdefault(t.device, []).append(i)
        allowed = {device: self.allowed(device) for device in by_device}
        hidden = {device: self.clock.hidden_bytes(device) for device in by_device}
        key = (
            layout,
            tuple(t.data_ptr() for t in tensors),
            tuple(protected),
            tuple(self._decision(layout, d, ix, allowed[d], hidden[d]) for d, ix in by_device.items()),
        )
        cached = self._cached
        if (
            cached is not None
            and cached[0] == key
            and all(
                part.staging is None or self._buffers.get(part.device) is part.staging for part in cached[1]
            )
        ):
            parts = cached[1]
        else:
            self._cached = None  # drop the old sources before planning anew
            parts = [
                self._part(device, layout, tensors, indices, protected, hidden[device], allowed[device])
                for device, indices in by_device.items()
            ]
            self._cached = (key, parts)
        self._report(parts, allowed)
        issued = speculation.snapshots if speculation is not None and speculation.parts is parts else None
        return StagedSave(self, parts, tensors, issued)

    @staticmethod
    def _decision(
        layout: LayoutPlan, device: torch.device, indices: Sequence[int], allowed: int, hidden: int
    ) -> tuple[Any, ...]:
        """What a device's staging plan depends on: nothing but the layout when everything fits, else
        the measured hidden bytes and the budget (in steps of the buffer's growth)."""
        if sum(align_up(layout.placements[i].length, STAGE_ALIGN) for i in indices) <= allowed:
            return (device, True)
        return (device, False, hidden, allowed // _GROW)

    def _part(
        self,
        device: torch.device,
        layout: LayoutPlan,
        tensors: Sequence[torch.Tensor],
        indices: Sequence[int],
        protected: Sequence[bool],
        hidden: int,
        allowed: int,
    ) -> DevicePart:
        sizes = [layout.placements[i].length for i in indices]
        splittable = [tensors[i].is_contiguous() for i in indices]
        guarded = [protected[i] for i in indices]
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
        staged, runs = self._mirror(plan, layout, tensors, indices, buffer) if plan.staged else ([], ())
        gather = cuda.plan_gather([d for d, _ in staged], [s for _, s in staged])
        return DevicePart(device, plan, tuple(indices), gather, runs, buffer if runs else None)

    def _mirror(
        self,
        plan: StagePlan,
        layout: LayoutPlan,
        tensors: Sequence[torch.Tensor],
        indices: Sequence[int],
        buffer: torch.Tensor | None,
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[Run, ...]]:
        """Lay the staged pieces out in ``buffer`` as their data files hold them: pieces that lie next to
        each other in a file (only padding between them) form a ``Run``, copied to the host as one DMA."""
        assert buffer is not None
        placed = []  # (file, offset in the file, piece)
        for piece in plan.staged:
            p = layout.placements[indices[piece.index]]
            placed.append((p.file, p.offset + piece.start, piece))
        placed.sort(key=lambda item: (item[0], item[1]))
        groups: list[list[tuple[int, int, Piece]]] = []
        for item in placed:
            last = groups[-1][-1] if groups else None
            if (
                last is not None
                and last[0] == item[0]
                and 0 <= item[1] - (last[1] + last[2].length) < ALIGNMENT
            ):
                groups[-1].append(item)
            else:
                groups.append([item])
        runs, staged, at = [], [], 0
        for group in groups:
            file, start = group[0][0], group[0][1]
            length = group[-1][1] + group[-1][2].length - start
            runs.append(Run(file, start, length, at))
            for _, offset, piece in group:
                src = tensors[indices[piece.index]]
                region = buffer[at + offset - start : at + offset - start + piece.length]
                if piece.start == 0 and piece.length == src.numel() * src.element_size():
                    staged.append((region.view(src.dtype).view(src.shape), src))
                else:
                    staged.append((region, cuda.flat_bytes(src)[piece.start : piece.start + piece.length]))
            at = align_up(at + length, STAGE_ALIGN)
        known = self._layouts.get(buffer.device)
        if known is None or known[0] != buffer.data_ptr() or known[1] != tuple(runs):
            drained = self.last_drain.get(buffer.device)
            if drained is not None:  # the previous save may still be draining this buffer
                torch.cuda.current_stream(buffer.device).wait_event(drained)
            buffer.zero_()  # a new layout: old bytes may sit where padding goes now
            self._layouts[buffer.device] = (buffer.data_ptr(), tuple(runs))
        return staged, tuple(runs)

    def _buffer(self, device: torch.device, need: int, allowed: int) -> torch.Tensor | None:
        held = self._buffers.get(device)
        roomy = align_up(need * 5 // 4, _GROW) + _GROW
        if held is not None and (held.numel() > allowed or held.numel() > roomy):
            self._drop(device)  # over the budget now, or well over what is needed: give it back
            held = None
        if need == 0:
            return None
        if held is not None and held.numel() >= need:
            return held
        size = min(allowed, align_up(need, _GROW))
        self._drop(device)
        try:
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            self._note(device, f"could not allocate {size} bytes of staging; overlap mode for this save")
            return None
        self._buffers[device] = buffer
        return buffer

    def _drop(self, device: torch.device) -> None:
        """Give ``device``'s buffer back (a cached program that refers to it is dropped too)."""
        if self._buffers.pop(device, None) is not None:
            self._layouts.pop(device, None)
            self._cached = None

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

    def _report(self, parts: Sequence[DevicePart], allowed: dict[torch.device, int]) -> None:
        last = dict.fromkeys(
            ("staged_bytes", "direct_bytes", "blocking_bytes", "wanted_bytes", "allowed_bytes"), 0.0
        )
        for part in parts:
            window, rate = self.clock.window(part.device), self.clock.bandwidth(part.device)
            last["staged_bytes"] += part.plan.staged_bytes
            last["direct_bytes"] += sum(p.length for p in part.plan.direct)
            last["blocking_bytes"] += sum(p.length for p in part.plan.blocking)
            last["wanted_bytes"] += part.plan.wanted_bytes
            last["allowed_bytes"] += allowed[part.device]
            last["window_s"] = -1.0 if window is None else window
            last["d2h_gbps"] = -1.0 if rate is None else rate / 1e9
        self.last = last

    def close(self) -> None:
        self._cached = None
        self._buffers.clear()
        self._layouts.clear()
        self.last_drain.clear()
