"""The slot pool: data files that stay mapped, pre-faulted and pinned across saves, and move between steps.

A *slot* is the set of mapped data files of one step. With ``keep`` retained steps and one save in
flight, a rank needs ``keep + 1`` slots. When retention retires a step (its COMMIT already removed,
under the lease lock) its files are renamed into ``<rank dir>/.spare/<n>/`` and become a spare; the
next save renames them into its own step directory. The mappings follow the inodes, so nothing is
re-faulted or re-registered.

Warm-up (``warm``) prepares the missing slots on one background thread, off the training thread:
spares adopted from an earlier process first (their tmpfs pages still exist, so only page tables are
built and the mapping pinned: nothing is zeroed again), then new ones sized for the layout. A spare
becomes *ready* only once it is completely prepared (fitted, pre-faulted and, for CUDA users,
registered); ``take`` hands out ready spares only, so a save never sees a half-prepared slot. A save
that finds none ready waits for the one being prepared (which is sooner than preparing its own, and
preparing two at once would make both late), never for the rest; with nothing being prepared it
prepares its own.

A data file with more than one hard link is never written in place: another member of a replica group
on this node committed a step that links it (``snapshot.linked``). A retired slot in that state is
*shared*: it waits apart until the other step lets go (its link count drops back to 1, normally
milliseconds later, when that rank retires the same step) and then becomes a ready spare again, pinned
mapping and all. The warm-up gives it ``SHARED_GRACE`` seconds before preparing a new slot instead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tierckpt.protocol.errors import CorruptShardError, RamdiskFullError
from tierckpt.protocol.format import (
    SPARE_DIR,
    Manifest,
    data_file_name,
    fsync_dir,
    iter_data_files,
    step_dir,
)
from tierckpt.snapshot.dtypes import torch_dtype
from tierckpt.snapshot.layout import LayoutPlan
from tierckpt.snapshot.restore import tensor_views
from tierckpt.snapshot.shardfile import MappedFile

__all__ = ["BACKGROUND_DUTY", "SHARED_GRACE", "SPARE_DIR", "URGENT_DUTY", "Slot", "SlotPool"]

log = logging.getLogger(__name__)

BACKGROUND_DUTY = 0.2
"""The warm-up pins a slot in pieces, busy at most this share of the time (it pauses four times as long
as each piece took). A registration holds up the training thread's CUDA calls while it runs: on an H200
host, 11 GiB pinned in one call or in 64 pieces back to back held one training step up by 0.18-0.43 s;
paced at 20%, no step by more than 7-21% of a step, over 1.5-3.8 s (``bench/register_stall_bench.py``)."""
URGENT_DUTY = 1.0
"""The share while a save waits for the slot being prepared (no pauses: the pool is behind, and a save
held up seconds costs more than the pinning's hold-ups of the steps meanwhile)."""

SHARED_GRACE = 2.0
"""Seconds the warm-up waits for a shared slot to be released before it prepares a new one."""
_SHARED_POLL = 0.01


class Slot:
    """The mapped data files of one step (or of a spare), in file-index order."""

    def __init__(self, directory: Path, files: Sequence[MappedFile] = ()) -> None:
        self.directory = directory
        self.files = list(files)
        self._layout: LayoutPlan | None = None
        self._views: list[torch.Tensor] = []
        self._read: tuple[Manifest, list[torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def move_to(self, directory: Path) -> None:
        """Rename every file into ``directory`` (created if needed); mappings stay valid."""
        directory.mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(self.files):
            f.move(directory / data_file_name(i))
        self.directory = directory

    def fits(self, plan: LayoutPlan) -> bool:
        """Whether its files have the sizes of ``plan``'s (taking it for a save of ``plan`` resizes none)."""
        return [f.size for f in self.files] == [fp.size for fp in plan.files]

    def _fit(self, plan: LayoutPlan, populate: bool) -> None:
        for i, fp in enumerate(plan.files):
            if i < len(self.files):
                self.files[i].resize(fp.size, prepare_later=not populate)
                if populate:
                    self.files[i].populate()
            else:
                self.files.append(MappedFile.create(self.directory / fp.name, fp.size, populate=populate))
        for extra in self.files[len(plan.files) :]:
            extra.close(unlink=True)
        del self.files[len(plan.files) :]

    def views(self, plan: LayoutPlan, *, populate: bool = True) -> list[torch.Tensor]:
        """One typed view per tensor of ``plan``, in plan order, into files sized for the plan.

        The first call for a layout resizes the files (pre-faulting them unless ``populate`` is False:
        ``prepare`` follows) and zeroes the padding; later calls with the same plan object return the
        cached views.
        """
        if self._layout is plan:
            return self._views
        self._views, self._layout, self._read = [], None, None  # release exports before any resize
        self._fit(plan, populate)
        for i, f in enumerate(self.files):
            f.zero(plan.padding(i))
        buffers = [f.buffer for f in self.files]
        views = []
        for spec, p in zip(plan.specs, plan.placements, strict=True):
            raw = buffers[p.file][p.offset : p.offset + p.length]
            views.append(raw.view(torch_dtype(spec.dtype)).view(spec.shape))
        self._views, self._layout = views, plan
        return views

    def read_views(self, manifest: Manifest) -> list[torch.Tensor]:
        """Typed views of ``manifest``'s tensors in these files (cached for the same manifest object)."""
        if self._read is None or self._read[0] is not manifest:
            self._read = (manifest, tensor_views(manifest, {f.path.name: f for f in self.files}))
        return self._read[1]

    def register(self, device: int | None = None, *, pace: Callable[[float], None] | None = None) -> None:
        for f in self.files:
            f.register(device, pace=pace)

    def populate(self) -> None:
        for f in self.files:
            f.populate()

    def prepare(self, device: int | None = None, *, pace: Callable[[float], None] | None = None) -> float:
        """Pre-fault and pin, the faulting running ahead of the pinning (``MappedFile.prepare``); the
        seconds the faulting took."""
        return sum(f.prepare(device, pace=pace) for f in self.files)

    @property
    def registered(self) -> bool:
        return all(f.registered for f in self.files)

    @property
    def shared(self) -> bool:
        """Whether another step links one of these files (then nothing may write them)."""
        return any(f.links() > 1 for f in self.files)

    def close(self, *, unlink: bool = False) -> None:
        self._views, self._layout, self._read = [], None, None
        for f in self.files:
            f.close(unlink=unlink)
        self.files = []


class SlotPool:
    """Slots of one rank directory: those of retained steps, those lent to saves in flight, and spares.

    Thread-safe: the training thread takes slots, the commit thread returns and recycles them, the
    warm-up thread prepares spares.
    """

    def __init__(self, rank_path: Path, *, target: int) -> None:
        self.rank_path = rank_path
        self.target = target
        """Slots worth keeping: ``keep + 1``."""
        self.register_cuda = False
        """Set once a save or load involves CUDA tensors: every slot is then pinned for DMA."""
        self.cuda_device: int | None = None
        """The CUDA device whose context pins the slots (background threads otherwise use device 0)."""
        self.last_warm_up: dict[str, float] = {}
        """What the last slot the warm-up prepared cost, in seconds and bytes: ``fault_s`` (the faulting,
        which runs ahead of the pinning when pinned), ``register_s`` (all of it, with the pauses between
        the pinned pieces), ``register_busy_s`` (pinning, without the pauses), ``bytes``: the one-time
        price of a slot."""
        self._by_step: dict[int, Slot] = {}
        self._lent: dict[int, Slot] = {}
        """Slots taken by saves not yet committed or forgotten, by ``id``."""
        self._ready: list[Slot] = []
        self._raw: list[Slot] = []
        """Adopted or retired slots whose mappings are not prepared yet."""
        self._shared: list[tuple[Slot, bool]] = []
        """Retired slots another step still links, with whether they are prepared (see the module doc)."""
        self._on_disk: set[int] = set()
        """Committed steps an earlier process left that this pool has not mapped: slots to come back
        through retention (so the warm-up builds none in their stead)."""
        self._preparing = 0
        self._waiters = 0
        """Saves waiting in ``take`` for the slot being prepared (its registration then paces less)."""
        self._register_busy = 0.0
        """Seconds the warm-up thread's current registration has spent pinning, pauses excluded."""
        self._stopping = False
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._warmer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-warm")
        self._warming: concurrent.futures.Future[None] | None = None
        self._warm_active = False
        self._warm_plan: LayoutPlan | None = None

    def use_cuda(self, device: int | None) -> None:
        """Pin every slot from now on, in ``device``'s context (the training thread's device)."""
        self.cuda_device = device
        self.register_cuda = True

    # ---------------------------------------------------------------------------------- adoption

    def adopt_spares(self, committed_count: int, committed: Sequence[int] = ()) -> None:
        """Adopt ``.spare/*`` left by an earlier process (up to what the pool needs); delete the rest.

        They are mapped lazily; ``warm`` (or the save that takes one) builds their page tables. The
        ``committed`` steps on disk count as slots too: they return as spares when retention retires them.
        """
        with self._cond:
            self._on_disk.update(committed)
        root = self.rank_path / SPARE_DIR
        room = max(0, self.target - committed_count)
        adopted = []
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            names = sorted(n for n in os.listdir(d) if n.startswith("data-"))
            if room == 0 or names != [data_file_name(i) for i in range(len(names))] or not names:
                shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                files = [MappedFile.open(d / n, populate=False) for n in names]
            except OSError as exc:
                log.warning("dropping spare %s: %s", d, exc)
                shutil.rmtree(d, ignore_errors=True)
                continue
            adopted.append(Slot(d, files))
            room -= 1
        with self._cond:
            for slot in adopted:
                if slot.shared:
                    self._shared.append((slot, False))
                else:
                    self._raw.append(slot)
        log.debug("adopted %d spare slot(s) in %s", len(adopted), self.rank_path)

    def slot_of(self, step: int) -> Slot | None:
        with self._cond:
            return self._by_step.get(step)

    def adopt_step(
        self, step: int, path: Path, manifest: Manifest, *, register: bool | None = None
    ) -> Slot | None:
        """Map a committed step's data files (read-write when permitted) and track them as its slot.

        ``register`` (default: ``register_cuda``) pins them now; a load passes False (it reads an
        unpinned mapping through bounce buffers) and leaves the pinning to ``warm`` later.
        """
        with self._cond:
            if step in self._by_step:
                return self._by_step[step]
        register = self.register_cuda if register is None else register
        files = []
        try:
            for entry in iter_data_files(manifest):  # CUDA users fault pages by copying (or pinning)
                try:
                    files.append(MappedFile.open(path / entry.name, populate=not self.register_cuda))
                except FileNotFoundError as exc:  # a step that lost a file is corrupt: callers fall back
                    raise CorruptShardError(
                        f"{path / entry.name}: missing", path=str(path / entry.name)
                    ) from exc
        except BaseException:
            for f in files:
                f.close()
            raise
        if any(not f.writable for f in files) or [f.path.name for f in files] != [
            data_file_name(i) for i in range(len(files))
        ]:
            for f in files:
                f.close()
            return None
        slot = Slot(path, files)
        if register:
            slot.register(self.cuda_device)
        with self._cond:
            self._by_step[step] = slot
            self._on_disk.discard(step)
        return slot

    # ---------------------------------------------------------------------------------- saving

    def take(self, step: int, plan: LayoutPlan) -> Slot:
        """A slot fitted to ``plan`` with its files inside ``step-<step>/``: a ready spare if any, else
        the one being prepared (waiting for it alone), else a shared slot about to be released (for at
        most ``SHARED_GRACE``), else an unprepared spare or a new slot prepared here.
        ``RamdiskFullError`` if new space cannot be reserved; nothing is left behind then."""
        path = step_dir(self.rank_path, step)
        deadline = time.monotonic() + SHARED_GRACE
        with self._cond:
            while True:
                self._reclaim_locked()
                if self._ready or self._raw or self._stopping:
                    break
                if self._preparing or self._warm_active:  # one slot at a time is prepared soonest
                    self._waiters += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._waiters -= 1
                elif self._shared and time.monotonic() < deadline:
                    self._cond.wait(_SHARED_POLL)  # the member linking it retires its step any moment
                else:
                    break
            slot = self._best(self._ready, plan) or self._best(self._raw, plan)
            if slot is not None:
                self._lent[id(slot)] = slot
        if slot is None:
            slot = Slot(path)
            path.mkdir(parents=True, exist_ok=True)
            with self._cond:
                self._lent[id(slot)] = slot
        else:
            spare_dir = slot.directory
            slot.move_to(path)
            with contextlib.suppress(OSError):
                os.rmdir(spare_dir)
        try:
            slot.views(plan, populate=not self.register_cuda)
            if self.register_cuda:
                slot.prepare(self.cuda_device)
            else:
                slot.populate()
        except BaseException:
            self.forget(slot)
            raise
        return slot

    @staticmethod
    def _best(spares: list[Slot], plan: LayoutPlan) -> Slot | None:
        if not spares:
            return None
        for i, s in enumerate(spares):
            if s.fits(plan):
                return spares.pop(i)
        return spares.pop()

    def committed(self, step: int, slot: Slot) -> None:
        with self._cond:
            self._lent.pop(id(slot), None)
            self._by_step[step] = slot

    def forget(self, slot: Slot) -> None:
        """A failed save's slot: unmap it and delete its files."""
        with self._cond:
            self._lent.pop(id(slot), None)
            self._cond.notify_all()
        slot.close(unlink=True)

    # ---------------------------------------------------------------------------------- warm-up

    def _count(self) -> int:
        slots = len(self._by_step) + len(self._lent) + len(self._ready) + len(self._raw) + self._preparing
        return slots + len(self._on_disk)

    def warm(self, plan: LayoutPlan | None) -> concurrent.futures.Future[None]:
        """Prepare, in the background, the adopted spares and then new spares sized for ``plan`` until
        the pool holds ``target`` slots; also pin (CUDA users) committed slots a load mapped unpinned.

        Returns at once; the future completes when the pool is warm. One warm-up runs at a time: a
        call while one runs returns it (with ``plan`` taken over for the slots it has yet to build).
        """
        with self._cond:
            if plan is not None:
                self._warm_plan = plan
            if self._warm_active and self._warming is not None:
                return self._warming  # it looks at the plan again before each slot
            self._warm_active = True
            self._warming = self._warmer.submit(self._warm_up)
            return self._warming

    def _warm_up(self) -> None:
        grace = time.monotonic() + SHARED_GRACE
        # ``active`` is cleared in the same critical section as the decision to stop, so that a ``warm``
        # call after that decision starts a new warm-up rather than joining this one, which builds no more.
        active = True
        try:
            while active:
                with self._cond:
                    if self._stopping:
                        active = self._warm_active = False
                        break
                    self._reclaim_locked()
                    if self._raw:
                        slot: Slot | None = self._raw.pop(0)
                    elif (misfit := self._misfit_locked()) is not None:
                        slot = misfit
                    elif self._warm_plan is not None and self._count() < self.target:
                        if self._shared and time.monotonic() < grace:
                            self._cond.wait(_SHARED_POLL)  # a shared slot is normally released soon
                            continue
                        slot = None
                    else:
                        active = self._warm_active = False
                        self._cond.notify_all()
                        break
                    self._preparing += 1
                    plan = self._warm_plan
                ready = None
                try:
                    ready = self._prepare(slot, plan)
                finally:
                    with self._cond:
                        self._preparing -= 1
                        if ready is not None:
                            self._ready.append(ready)
                        else:
                            active = self._warm_active = False
                        self._cond.notify_all()
        finally:
            if active:  # an error out of the loop
                with self._cond:
                    self._warm_active = False
                    self._cond.notify_all()
        if self.register_cuda and not self._stopping:
            with self._cond:
                committed = list(self._by_step.values())
            for slot in committed:  # mapped unpinned by a load: pin for later saves and loads
                slot.register(self.cuda_device, pace=self._pace)

    def _misfit_locked(self) -> Slot | None:
        """A ready spare whose files do not fit the newest layout, taken out to be prepared again (the
        layout grew or shrank since it was prepared, e.g. a fresh job's optimizer state created after
        ``load``: resized and pinned here, paced, instead of by the save that takes it); None if none."""
        plan = self._warm_plan
        if plan is None:
            return None
        for i, slot in enumerate(self._ready):
            if not slot.fits(plan):
                return self._ready.pop(i)
        return None

    def _pace(self, took: float) -> None:
        """Between two pieces of a background registration: pause so that it is busy only
        ``BACKGROUND_DUTY`` of the time (``URGENT_DUTY`` while a save waits; no pause once closing)."""
        self._register_busy += took
        with self._cond:
            if not self._stopping:
                duty = URGENT_DUTY if self._waiters else BACKGROUND_DUTY
                self._cond.wait(took * (1 / duty - 1))

    def _prepare(self, slot: Slot | None, plan: LayoutPlan | None) -> Slot | None:
        """Make ``slot`` (or a new slot for ``plan``) ready: fitted, pre-faulted, pinned. None on failure."""
        new = slot is None
        if slot is None:
            directory = self.rank_path / SPARE_DIR / f"{next(self._ids):06d}-{os.getpid()}-new"
            slot = Slot(directory)
        try:
            start = time.perf_counter()
            if new:
                slot.directory.mkdir(parents=True, exist_ok=True)
            if plan is not None:  # sized for the layout; the save that takes it finds its views built
                slot.views(plan, populate=not self.register_cuda)
            self._register_busy = 0.0
            if self.register_cuda:  # the pages are faulted ahead of the pinning, which is paced
                faulting = slot.prepare(self.cuda_device, pace=self._pace)
            else:
                slot.populate()
                faulting = time.perf_counter() - start
            self.last_warm_up = {
                "fault_s": faulting,
                "register_s": time.perf_counter() - start,
                "register_busy_s": self._register_busy,
                "bytes": float(slot.nbytes),
            }
        except (RamdiskFullError, OSError) as exc:
            directory = slot.directory
            slot.close(unlink=True)
            if new:
                shutil.rmtree(directory, ignore_errors=True)
            log.warning("could not prepare a spare slot (%s); the next save prepares its own", exc)
            return None
        log.debug(
            "prepared %s slot of %d bytes in %.3f s (faulting %.3f s, pinning %.3f s busy, paced)",
            "a new" if new else "an adopted",
            slot.nbytes,
            self.last_warm_up["register_s"],
            self.last_warm_up["fault_s"],
            self.last_warm_up["register_busy_s"],
        )
        return slot

    def stop_building(self) -> None:
        """Make the warm-up stop after the slot it is preparing (closing)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ---------------------------------------------------------------------------------- recycling

    def _reclaim_locked(self) -> None:
        """Shared slots no other step links any more become spares again (caller holds the lock)."""
        if not self._shared:
            return
        still = []
        for slot, prepared in self._shared:
            if slot.shared:
                still.append((slot, prepared))
            else:
                (self._ready if prepared else self._raw).append(slot)
                self._cond.notify_all()
        self._shared = still

    def recycle(self, step: int, path: Path) -> None:
        """Turn a retired step (COMMIT already gone) into a spare, or delete it if not needed."""
        with self._cond:
            slot = self._by_step.pop(step, None)
            self._on_disk.discard(step)
            wanted = self._count() < self.target
        prepared = slot is not None
        if slot is None and wanted:
            slot = self._map_retired(path)
        if slot is not None and wanted:
            spare = self.rank_path / SPARE_DIR / f"{next(self._ids):06d}-{os.getpid()}-{step}"
            try:
                slot.move_to(spare)
            except OSError as exc:
                log.warning("could not recycle step %d: %s", step, exc)
                slot.close(unlink=True)
            else:
                with self._cond:
                    if slot.shared:  # checked after the rename: no new link can appear any more
                        self._shared.append((slot, prepared))
                    else:
                        (self._ready if prepared else self._raw).append(slot)
                    self._cond.notify_all()
        elif slot is not None:
            slot.close()
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            fsync_dir(self.rank_path)

    def _map_retired(self, path: Path) -> Slot | None:
        names = sorted(n for n in os.listdir(path) if n.startswith("data-")) if path.is_dir() else []
        if not names or names != [data_file_name(i) for i in range(len(names))]:
            return None
        try:
            return Slot(path, [MappedFile.open(path / n, populate=False) for n in names])
        except OSError:
            return None

    def trim(self) -> None:
        """Delete spares beyond ``target`` slots (e.g. while leases hold extra steps)."""
        with self._cond:
            self._reclaim_locked()
            extra = self._count() + len(self._shared) - self.target
            drop = []
            while extra > 0 and self._shared:  # their data lives on in the steps that link them
                drop.append(self._shared.pop()[0])
                extra -= 1
            for spares in (self._raw, self._ready):
                while extra > 0 and spares:
                    drop.append(spares.pop())
                    extra -= 1
        for slot in drop:
            directory = slot.directory
            slot.close(unlink=True)
            shutil.rmtree(directory, ignore_errors=True)

    def register_all(self) -> None:
        """Pin every idle slot's files (those already pinned cost nothing); safe on a background thread."""
        with self._cond:
            slots = [*self._by_step.values(), *self._ready]
        for slot in slots:
            slot.register(self.cuda_device)

    @property
    def ready_spares(self) -> int:
        """Spares completely prepared now."""
        with self._cond:
            return len(self._ready)

    def close(self) -> None:
        """Stop the warm-up, unmap everything; files stay on disk (steps remain readable, spares are
        adopted next time)."""
        self.stop_building()
        self._warmer.shutdown(wait=True)
        with self._cond:
            slots = [*self._by_step.values(), *self._ready, *self._raw, *self._lent.values()]
            slots += [slot for slot, _ in self._shared]
            self._by_step, self._ready, self._raw, self._lent, self._shared = {}, [], [], {}, []
        for slot in slots:
            slot.close()
