"""The slot pool: data files that stay mapped, pre-faulted and pinned across saves, and move between steps.

A *slot* is the set of mapped data files of one step. With ``keep`` retained steps and one save in
flight, a rank needs ``keep + 1`` slots; after the first save the pool builds the missing ones in the
background (``fill_spares``), so later saves allocate, fault and pin nothing. When retention retires
a step (its COMMIT already removed, under the lease lock) its files are renamed into
``<rank dir>/.spare/<n>/`` and become a spare; the next save renames them into its own step
directory. The mappings follow the inodes, so nothing is re-faulted or re-registered. Spares left by
an earlier process are adopted (mapped lazily: their pages already exist, only page tables are built).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from tierckpt.protocol.errors import RamdiskFullError
from tierckpt.protocol.format import Manifest, data_file_name, fsync_dir, iter_data_files, step_dir
from tierckpt.snapshot.dtypes import torch_dtype
from tierckpt.snapshot.layout import LayoutPlan
from tierckpt.snapshot.restore import tensor_views
from tierckpt.snapshot.shardfile import MappedFile

__all__ = ["SPARE_DIR", "Slot", "SlotPool"]

log = logging.getLogger(__name__)

SPARE_DIR = ".spare"


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

    def _fit(self, plan: LayoutPlan) -> None:
        for i, fp in enumerate(plan.files):
            if i < len(self.files):
                self.files[i].resize(fp.size)
                self.files[i].populate()
            else:
                self.files.append(MappedFile.create(self.directory / fp.name, fp.size))
        for extra in self.files[len(plan.files) :]:
            extra.close(unlink=True)
        del self.files[len(plan.files) :]

    def views(self, plan: LayoutPlan) -> list[torch.Tensor]:
        """One typed view per tensor of ``plan``, in plan order, into files sized for the plan.

        The first call for a layout resizes the files and zeroes the padding; later calls with the
        same plan object return the cached views.
        """
        if self._layout is plan:
            return self._views
        self._views, self._layout, self._read = [], None, None  # release exports before any resize
        self._fit(plan)
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

    def register(self) -> None:
        for f in self.files:
            f.register()

    def close(self, *, unlink: bool = False) -> None:
        self._views, self._layout, self._read = [], None, None
        for f in self.files:
            f.close(unlink=unlink)
        self.files = []


class SlotPool:
    """Slots of one rank directory: those of retained steps, and spares. Thread-safe."""

    def __init__(self, rank_path: Path, *, target: int) -> None:
        self.rank_path = rank_path
        self.target = target
        """Slots worth keeping: ``keep + 1``."""
        self.register_cuda = False
        """Set once a save involves CUDA tensors: every slot is then pinned for DMA."""
        self._by_step: dict[int, Slot] = {}
        self._spares: list[Slot] = []
        self._building = 0
        self._stopping = False
        self._cond = threading.Condition()
        self._ids = itertools.count()

    # ---------------------------------------------------------------------------------- adoption

    def adopt_spares(self, committed_count: int) -> None:
        """Adopt ``.spare/*`` left by an earlier process (up to what the pool needs); delete the rest."""
        root = self.rank_path / SPARE_DIR
        room = max(0, self.target - committed_count)
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
            self._spares.append(Slot(d, files))
            room -= 1
        log.debug("adopted %d spare slot(s) in %s", len(self._spares), self.rank_path)

    def slot_of(self, step: int) -> Slot | None:
        with self._cond:
            return self._by_step.get(step)

    def adopt_step(
        self, step: int, path: Path, manifest: Manifest, *, register: bool | None = None
    ) -> Slot | None:
        """Map a committed step's data files (read-write when permitted) and track them as its slot.

        ``register`` (default: ``register_cuda``) pins them now; a load passes False (it reads an
        unpinned mapping through bounce buffers) and leaves the pinning to ``register_all`` later.
        """
        with self._cond:
            if step in self._by_step:
                return self._by_step[step]
        register = self.register_cuda if register is None else register
        files = []
        try:
            for entry in iter_data_files(manifest):  # CUDA users fault pages by copying (or pinning)
                files.append(MappedFile.open(path / entry.name, populate=not self.register_cuda))
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
            slot.register()
        with self._cond:
            self._by_step[step] = slot
        return slot

    # ---------------------------------------------------------------------------------- saving

    def take(self, step: int, plan: LayoutPlan) -> Slot:
        """A slot fitted to ``plan`` with its files inside ``step-<step>/``: a spare if any, else new.

        ``RamdiskFullError`` if new space cannot be reserved; nothing is left behind then.
        """
        path = step_dir(self.rank_path, step)
        with self._cond:
            while not self._spares and self._building:
                self._cond.wait()
            slot = self._best_spare(plan)
        if slot is None:
            slot = Slot(path)
            path.mkdir(parents=True, exist_ok=True)
        else:
            spare_dir = slot.directory
            slot.move_to(path)
            with contextlib.suppress(OSError):
                os.rmdir(spare_dir)
        try:
            slot.views(plan)
            if self.register_cuda:
                slot.register()
        except BaseException:
            slot.close(unlink=True)
            raise
        return slot

    def _best_spare(self, plan: LayoutPlan) -> Slot | None:
        if not self._spares:
            return None
        want = [f.size for f in plan.files]
        for i, s in enumerate(self._spares):
            if [f.size for f in s.files] == want:
                return self._spares.pop(i)
        return self._spares.pop()

    def committed(self, step: int, slot: Slot) -> None:
        with self._cond:
            self._by_step[step] = slot

    def forget(self, slot: Slot) -> None:
        """A failed save's slot: unmap it and delete its files."""
        slot.close(unlink=True)

    # ---------------------------------------------------------------------------------- recycling

    def recycle(self, step: int, path: Path) -> None:
        """Turn a retired step (COMMIT already gone) into a spare, or delete it if not needed."""
        with self._cond:
            slot = self._by_step.pop(step, None)
            wanted = len(self._by_step) + len(self._spares) + self._building < self.target
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
                    self._spares.append(slot)
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

    def reserve_spares(self) -> int:
        """Claim the spares still missing (so ``take`` waits for them instead of building its own)."""
        with self._cond:
            need = max(0, self.target - len(self._by_step) - len(self._spares) - self._building)
            self._building += need
            return need

    def build_spares(self, plan: LayoutPlan, count: int) -> None:
        """Build ``count`` reserved spares sized for ``plan`` (off the training thread)."""
        for built in range(count):
            slot = None if self._stopping else self._build_spare(plan)
            with self._cond:
                self._building -= 1 if slot is not None else count - built
                if slot is not None:
                    self._spares.append(slot)
                self._cond.notify_all()
            if slot is None:
                return

    def fill_spares(self, plan: LayoutPlan) -> None:
        """Build spares sized for ``plan`` until the pool holds ``target`` slots."""
        self.build_spares(plan, self.reserve_spares())

    def _build_spare(self, plan: LayoutPlan) -> Slot | None:
        directory = self.rank_path / SPARE_DIR / f"{next(self._ids):06d}-{os.getpid()}-new"
        slot = Slot(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            slot.views(plan)
            if self.register_cuda:
                slot.register()
        except (RamdiskFullError, OSError) as exc:
            slot.close(unlink=True)
            shutil.rmtree(directory, ignore_errors=True)
            log.warning("could not pre-allocate a spare slot (%s); the next save allocates its own", exc)
            return None
        return slot

    def stop_building(self) -> None:
        """Make ``build_spares`` stop early (closing)."""
        self._stopping = True

    def trim(self) -> None:
        """Delete spares beyond ``target`` slots (e.g. while leases hold extra steps)."""
        with self._cond:
            extra = len(self._by_step) + len(self._spares) - self.target
            drop = [self._spares.pop() for _ in range(max(0, min(extra, len(self._spares))))]
        for slot in drop:
            directory = slot.directory
            slot.close(unlink=True)
            shutil.rmtree(directory, ignore_errors=True)

    def register_all(self) -> None:
        """Pin every slot's files (those already pinned cost nothing); safe on a background thread."""
        with self._cond:
            slots = [*self._by_step.values(), *self._spares]
        for slot in slots:
            slot.register()

    def close(self) -> None:
        """Unmap everything; files stay on disk (steps remain readable, spares are adopted next time)."""
        with self._cond:
            slots = [*self._by_step.values(), *self._spares]
            self._by_step, self._spares = {}, []
        for slot in slots:
            slot.close()
